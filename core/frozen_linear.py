"""A linear product over a borrowed, frozen weight, as a module.

A draft head scores its drafts with rows of the base model's LM head (all of it, or the draft
vocabulary's rows W[d2t], FR-Spec).  Those rows are not the head's to train or to save, so they are a
*non-persistent buffer*, never a parameter: no optimizer, checkpoint or ZeRO-3 partition sees them.
Held in a module of their own, the product is still a layer that inference tooling can find and
speed up like any ``nn.Linear``: :mod:`decoding.prepacked` reorders its weight once for oneDNN, as it
does for the base's linear layers.  Before, the product was a bare ``h @ W.T``, which on the CPU
reordered the whole [N, H] weight at every call over three or more rows (fp32) or ran the slow
unpacked bf16 kernel (a CPU with AMX), and it was most of a Falcon drafter pass.

It is deliberately *not* an ``nn.Linear`` subclass: code that initialises or unfreezes every
``nn.Linear`` of a head must never write into the base model's weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FrozenLinear(nn.Module):
    """``y = x Wᵀ`` with W a frozen, non-persistent buffer (no bias).

    Args:
        weight: Tensor [out_features, in_features], kept as it is (no copy): a view of, or the very
            tensor of, the base model's weight.  Moving the module (``.to``) moves the buffer.

    Attributes:
        weight: the buffer; ``bias`` is None (what :mod:`decoding.prepacked` reads of a linear layer).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"FrozenLinear: weight must be [out, in], got shape {tuple(weight.shape)}")
        self.register_buffer("weight", weight.detach(), persistent=False)
        self.bias = None

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] → [..., out_features], in x's dtype (the weight is cast when it differs).

        Raises:
            RuntimeError: (from ``F.linear``) x's last dimension is not ``in_features``.
        """
        w = self.weight
        return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, frozen"
