"""Training-time-test (TTT) unrolling helpers shared by heads that unroll over their own outputs
(EAGLE-3, arXiv 2503.01840 §3.2; Falcon k = 1 with ``heads.ttt_steps`` > 1).

* :func:`shift_left` — x[:, t+n] at t (the ``padding(·, left=False)`` of EAGLE's ``cnets.py``,
  applied n times);
* :func:`ttt_visibility` — the EAGLE-3 attention mask of TTT step i over the keys of steps 0..i.
"""
from __future__ import annotations

import torch


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """y[:, t] = x[:, t+n] for t < T−n, ``fill`` after: x [B, T, ...] → same shape and dtype."""
    out = torch.full_like(x, fill)
    T = x.shape[1]
    if n < T:
        out[:, : T - n] = x[:, n:]
    return out


def ttt_visibility(length: int, step: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The EAGLE-3 training-time-test attention mask of step ``step`` as a dense bool matrix.

    Keys are ordered [step 0 slots 0..T−1 | step 1 slots | ... | step ``step`` slots].  Query
    (step i, slot t) sees key (step 0, slot s) iff s ≤ t (and s is not padding), and key
    (step j, slot s) for 1 ≤ j ≤ i iff s = t (EAGLE ``LlamaAttention.forward``: causal scores
    against ``cache_k[0]`` plus one diagonal score per later cache entry).

    Args:
        length: T.  step: i ≥ 0.  valid: optional [B, T] bool (False = padding key).

    Returns:
        bool [T, (i+1)·T], or [B, T, (i+1)·T] with ``valid`` (True = visible).
    """
    dev = None if valid is None else valid.device
    t = torch.arange(length, device=dev)
    first = t[None, :] <= t[:, None]  # [T, T]
    if valid is not None:
        first = first[None] & valid.bool()[:, None, :]
    diag = torch.eye(length, dtype=torch.bool, device=dev)
    if valid is not None:
        diag = diag[None].expand(valid.shape[0], -1, -1)
    return torch.cat([first] + [diag] * step, dim=-1)
