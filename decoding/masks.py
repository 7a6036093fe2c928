"""Attention masks shared by the draft heads (training) and the decoding runtime.

Masks are built as bool visibility (True = the query may attend to the key) and turned into the
additive float form that transformers' eager and SDPA attention add to the scores.  They live
here, below ``heads``, because both a head's training forward and its drafter's cached decoding
forward use them (docs/design.md "Layers").
"""
from __future__ import annotations

import torch


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool visibility → additive float mask of the same shape in ``dtype``.

    Args:
        visible: bool tensor of any shape (True = visible), e.g. [B, 1, Q, K].
        dtype: the attention's compute dtype.

    Returns:
        ``dtype`` tensor on ``visible.device``: 0 where visible, ``torch.finfo(dtype).min`` elsewhere.
    """
    out = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return out.masked_fill(~visible, torch.finfo(dtype).min)


def block_causal_mask(length: int, block_size: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Falcon's relaxed causal mask (arXiv 2412.12639 §3.2; METHODS.md §1.2): query i sees key j
    iff j ≤ (⌊i/k⌋+1)·k − 1.

    Blocks are aligned at position 0; attention is bidirectional within a block and causal across
    blocks.  With ``valid`` [B, T] bool, padding keys are hidden too.

    Returns:
        bool [T, T] (no ``valid``) or [B, 1, T, T] (True = visible).
    """
    i = torch.arange(length, device=None if valid is None else valid.device)
    allowed = i[None, :] <= ((i[:, None] // block_size) + 1) * block_size - 1
    if valid is None:
        return allowed
    return allowed[None, None] & valid.bool()[:, None, None, :]
