"""AdaDecode's distillation objective: per-layer KL to the final layer (METHODS.md §3.3).

    L = Σ_ℓ w_ℓ · (1/M) Σ_t m_t · KL(p*_t ‖ softmax(z^(ℓ)_t)),   τ = 1, fp32,

where p*_t = softmax(W f_t) is the base model's own next-token distribution at position t (the
final post-norm feature f_t = hs[L]_t), z^(ℓ)_t the logits of the head at candidate layer ℓ at the
**same** position t (no shift), m_t the loss mask (assistant tokens) and M = Σ m.

Pure functions on tensors; no model code.  Everything is computed in float32 whatever the input
dtype, with autocast disabled.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F


def kl_per_token(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(teacher) ‖ softmax(student)) per token, in nats, float32.

    Args:
        teacher_logits: [..., V] logits of p* (any float dtype).
        student_logits: [..., V] logits of the head (same shape).

    Returns:
        [...] float32 KL divergences (>= 0 up to rounding).

    Raises:
        ValueError: the shapes differ.
    """
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"teacher logits {tuple(teacher_logits.shape)} and student logits "
                         f"{tuple(student_logits.shape)} differ in shape")
    with torch.autocast(device_type=student_logits.device.type, enabled=False):
        t_logp = F.log_softmax(teacher_logits.float(), dim=-1)
        s_logp = F.log_softmax(student_logits.float(), dim=-1)
        return F.kl_div(s_logp, t_logp, reduction="none", log_target=True).sum(-1)


def masked_kl_sum(teacher_logits: torch.Tensor, student_logits: torch.Tensor,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_t m_t KL_t and M = Σ_t m_t (float32 scalars), for exact aggregation over chunks/ranks.

    Args:
        teacher_logits, student_logits: [..., V].
        mask: bool/float [...] or None (all tokens count).
    """
    kl = kl_per_token(teacher_logits, student_logits)
    if mask is None:
        return kl.sum(), torch.tensor(float(kl.numel()), device=kl.device)
    if mask.shape != kl.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match the token shape {tuple(kl.shape)}")
    m = mask.to(kl.dtype)
    return (kl * m).sum(), m.sum()


def adadecode_loss(teacher_logits: torch.Tensor, student_logits: Mapping[int, torch.Tensor],
                   mask: torch.Tensor | None = None,
                   weights: Mapping[int, float] | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The weighted sum of per-layer masked-mean KLs (METHODS.md §3.3).

    Args:
        teacher_logits: [..., V] final-layer logits W·f_t.
        student_logits: {ℓ: [..., V]} head logits per candidate layer.
        mask: [...] loss mask or None.
        weights: {ℓ: w_ℓ}; default 1.0 for every layer (the paper's equal weights).

    Returns:
        ``(loss, {ℓ: masked-mean KL at ℓ})``, float32 scalars; an all-zero mask gives 0 (not NaN).
    """
    if not student_logits:
        raise ValueError("adadecode_loss needs at least one candidate layer")
    per_layer: dict[int, torch.Tensor] = {}
    loss = teacher_logits.new_zeros((), dtype=torch.float32)
    for layer, logits in student_logits.items():
        kl_sum, count = masked_kl_sum(teacher_logits, logits, mask)
        per_layer[layer] = kl_sum / count.clamp_min(1.0)
        w = 1.0 if weights is None else float(weights[layer])
        loss = loss + w * per_layer[layer]
    return loss, per_layer
