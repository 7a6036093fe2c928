"""EAGLE-3's training-time-test objective (arXiv 2503.01840 §3.2; EAGLE ``traineagle3``).

Pure functions on tensors:

* :func:`ttt_step_masks` — the loss positions of every TTT step;
* :func:`soft_cross_entropy` — −Σ_v p_v log softmax(z)_v per row, fused (one exp pass forward,
  one backward) so that the [M, N] soft targets of every TTT step cost two reads, not a
  log-softmax, a product and their backwards;
* :func:`ttt_loss` — L = Σ_i decay^i · CE_i (``ploss_weight = [0.8**i ...]`` in
  ``traineagle3/main.py``), each CE_i a masked mean over step i's positions;
  :func:`ttt_combine` — the same sum from per-step CE sums (the fused LM-head path,
  :func:`losses.linear_soft_ce.linear_soft_cross_entropy`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from losses.ttt import shift_left

TARGETS = ("soft", "greedy")


def ttt_step_masks(loss_mask: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Loss positions of TTT steps 0..S−1.

    Step i, slot t predicts the base's token at position t+2+i from its greedy label at t+1+i;
    it counts iff position t+1+i exists and is a loss (assistant) position.  A greedy label
    outside the draft vocabulary does not remove the position (issue 13's rule, as Falcon): it
    leaves the greedy CE (:func:`ttt_loss`, label −1) while the soft teacher keeps it.

    Args:
        loss_mask: [B, T] bool (False on padding).
        steps: S ≥ 1.

    Returns:
        S bool tensors [B, T].

    Raises:
        ValueError: S < 1.
    """
    if steps < 1:
        raise ValueError(f"ttt steps must be >= 1, got {steps}")
    m = loss_mask.bool()
    return [shift_left(m, 1 + i, False) for i in range(steps)]


class _SoftCrossEntropy(torch.autograd.Function):
    """Rows of −Σ_v p_v log softmax(z)_v = logsumexp(z) − p·z (Σ_v p_v = 1); ∂/∂z = softmax(z) − p."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits, dim=-1)
        ce = lse - torch.linalg.vecdot(probs, logits)
        ctx.save_for_backward(logits, probs, lse)
        return ce

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, probs, lse = ctx.saved_tensors
        g = torch.exp(logits - lse.unsqueeze(-1))
        g.sub_(probs).mul_(grad.unsqueeze(-1))
        return g, None


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Per-row cross-entropy against a target distribution: −Σ_v p_v · log softmax(z)_v.

    Equal to ``-(probs * logits.log_softmax(-1)).sum(-1)`` (EAGLE ``Model.forward``'s
    ``-torch.sum(target_p * out_logp, 2)``), computed as logsumexp(z) − p·z with the gradient
    softmax(z) − p written in one pass: on a [1536, 16384] step this is what an EAGLE-3 training
    step spends most of its time on (docs/heads.md, EAGLE-3, "Training cost").  No gradient
    flows to ``probs`` (a frozen teacher).

    Args:
        logits: [M, N] float32 (or float64) draft logits z.
        probs: [M, N] target probabilities p, same dtype; each row sums to 1 (a softmax).

    Returns:
        [M] per-row cross-entropies, z's dtype.

    Raises:
        ValueError: shapes or dtypes differ.
    """
    if logits.shape != probs.shape or logits.dtype != probs.dtype:
        raise ValueError(f"soft targets {tuple(probs.shape)} {probs.dtype} do not match logits "
                         f"{tuple(logits.shape)} {logits.dtype}")
    return _SoftCrossEntropy.apply(logits, probs.detach())


def ttt_loss(step_logits: list[torch.Tensor], step_targets: list[torch.Tensor], decay: float = 0.8):
    """Σ_i decay^i · CE_i over the TTT steps.

    Args:
        step_logits: per step [M_i, N] draft logits (any float dtype; computed in fp32).
        step_targets: per step either [M_i, N] float target probabilities over the draft vocabulary
            (soft: :func:`soft_cross_entropy`, EAGLE ``Model.forward``'s ``target_p``; over the draft
            vocabulary this is the base's distribution restricted and renormalised) or [M_i] long
            draft ids (greedy: CE against the label; −1 = outside the draft vocabulary, the row
            leaves the CE mean, issue 13's rule).
        decay: the step weight base (EAGLE-3: 0.8).

    Returns:
        ``(loss, parts)``: scalar fp32 loss and a list of the per-step mean CEs (detached fp32
        scalars).  A step with no scored row contributes 0 (still connected to its logits).

    Raises:
        ValueError: mismatched list lengths or shapes.
    """
    if len(step_logits) != len(step_targets) or not step_logits:
        raise ValueError(f"{len(step_logits)} step logits but {len(step_targets)} step targets")
    sums, counts = [], []
    for i, (lg, tg) in enumerate(zip(step_logits, step_targets)):
        if tg.dtype.is_floating_point:
            if tg.shape != lg.shape:
                raise ValueError(f"step {i}: soft targets {tuple(tg.shape)} != logits {tuple(lg.shape)}")
            lg = lg if lg.dtype == torch.float64 else lg.float()
            ce = soft_cross_entropy(lg, tg.to(lg.dtype))
            scored = ce.shape[0]
        else:
            if tg.shape != lg.shape[:-1]:
                raise ValueError(f"step {i}: labels {tuple(tg.shape)} do not match logits {tuple(lg.shape)}")
            logq = F.log_softmax(lg.float(), dim=-1)
            keep = tg >= 0  # −1: greedy label outside the draft vocabulary, no CE term
            ce = -logq.gather(-1, tg.long().clamp_min(0).unsqueeze(-1)).squeeze(-1) * keep
            scored = int(keep.sum())
        sums.append(ce.sum())
        counts.append(scored)
    return ttt_combine(sums, counts, decay)


def ttt_combine(step_sums: list[torch.Tensor], step_counts: list[int], decay: float = 0.8):
    """Σ_i decay^i · (S_i / max(n_i, 1)): the TTT loss from each step's summed CE S_i over n_i rows.

    Args:
        step_sums: per step a scalar Σ CE (float32, connected to the graph).
        step_counts: per step the number of scored rows n_i (0: the step adds 0, still connected).
        decay: the step weight base (EAGLE-3: 0.8).

    Returns:
        ``(loss, parts)`` as :func:`ttt_loss`.
    """
    total = step_sums[0].new_zeros((), dtype=torch.float32)
    parts = []
    for i, (ce_sum, n) in enumerate(zip(step_sums, step_counts)):
        mean = ce_sum.float() / max(int(n), 1)
        parts.append(mean.detach())
        total = total + (decay ** i) * mean
    return total, parts
