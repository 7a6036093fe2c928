"""Falcon's training objective and Coupled Sequential Glancing Distillation (CSGD) helpers.

Pure functions on tensors (METHODS.md §1.3, §1.4; Falcon, arXiv 2412.12639):

* :func:`falcon_loss` — L = L_reg + ω·(α·KL(p‖q) + (1−α)·CE(y, q)), masked means;
  :func:`falcon_loss_fused` — the same from the drafter features and W, without student logits.
* :func:`glancing_ratio` — the glancing ratio λ at a training point (paper / official-code /
  constant schedules, per-step or per-epoch).
* :func:`glancing_positions` — the vectorised CSGD replacement mask R (any batch size).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from losses.linear_soft_ce import linear_soft_cross_entropy, teacher_entropy

GLANCING_SCHEDULES = ("linear", "constant")
GLANCING_UNITS = ("epoch", "step")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)


def falcon_loss(
    pred_feat: torch.Tensor,
    target_feat: torch.Tensor,
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    alpha: float = 0.9,
    omega: float = 0.1,
    beta: float = 1.0,
    ce_mask: torch.Tensor | None = None,
    teacher_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Falcon's loss (METHODS.md §1.3 [P] with the Rec.: true KL at temperature 1, argmax teacher).

    L = L_reg + ω·(α·KL(p‖q) + (1−α)·CE(y, q)) with
    L_reg = (1/M) Σ m_t · mean_d SmoothL1_β(f̂_t, f_{t+k}), p = softmax(teacher), q = softmax(student),
    y = argmax teacher; every term is a masked mean over positions with ``mask`` True
    (M = Σ mask; an all-False mask gives 0 terms that still carry a gradient path).

    Args:
        pred_feat: drafter features f̂ [..., H] (any float dtype).
        target_feat: target features f_{t+k} [..., H].
        student_logits: W f̂ [..., V].
        teacher_logits: W f_{t+k} [..., V].
        mask: [...] bool (or 0/1), the loss positions.
        alpha: KL weight inside the distillation term (α, default 0.9).
        omega: distillation weight (ω, default 0.1).
        beta: SmoothL1 β (default 1).
        ce_mask: optional [...] bool: positions that keep the CE term (the CE mean is over
            ``mask & ce_mask``).  Draft-vocabulary rule (issue 13, as EAGLE-3): with logits over
            the draft vocabulary only, the KL teacher is restricted to it and renormalised, and a
            position whose greedy label lies outside it is dropped from CE (``ce_mask`` False).
        teacher_ids: optional [...] long, ``teacher_logits.argmax(-1)`` when the caller already has
            it (Falcon's glancing pass); it must equal that argmax (not checked, to save a pass over V).

    Returns:
        ``(loss, parts)``: the scalar fp32 loss and ``{"reg", "kl", "ce"}`` scalar fp32 tensors
        (detached).  All computation is in fp32.

    Raises:
        ValueError: on mismatched shapes.
    """
    if pred_feat.shape != target_feat.shape:
        raise ValueError(f"pred_feat {tuple(pred_feat.shape)} != target_feat {tuple(target_feat.shape)}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student_logits {tuple(student_logits.shape)} != teacher_logits {tuple(teacher_logits.shape)}")
    if mask.shape != pred_feat.shape[:-1] or mask.shape != student_logits.shape[:-1]:
        raise ValueError(f"mask {tuple(mask.shape)} does not match the leading dims of the features/logits")
    mask = mask.bool()
    reg = F.smooth_l1_loss(pred_feat.float(), target_feat.float(), reduction="none", beta=beta).mean(-1)
    logq = F.log_softmax(student_logits.float(), dim=-1)
    logp = F.log_softmax(teacher_logits.float(), dim=-1)
    kl = F.kl_div(logq, logp, reduction="none", log_target=True).sum(-1)  # Σ p (log p − log q)
    y = teacher_logits.argmax(-1) if teacher_ids is None else teacher_ids
    ce = -logq.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    ce_keep = mask if ce_mask is None else mask & ce_mask.bool()
    reg_m, kl_m, ce_m = _masked_mean(reg, mask), _masked_mean(kl, mask), _masked_mean(ce, ce_keep)
    loss = reg_m + omega * (alpha * kl_m + (1.0 - alpha) * ce_m)
    return loss, {"reg": reg_m.detach(), "kl": kl_m.detach(), "ce": ce_m.detach()}


def falcon_loss_fused(
    pred_feat: torch.Tensor,
    target_feat: torch.Tensor,
    weight: torch.Tensor,
    teacher_logits: torch.Tensor,
    alpha: float = 0.9,
    omega: float = 0.1,
    beta: float = 1.0,
    ce_mask: torch.Tensor | None = None,
    teacher_ids: torch.Tensor | None = None,
    transform=None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """:func:`falcon_loss` over every row, with the student logits q = softmax(W f̂) never formed.

    The distillation term is one soft cross-entropy per row against t = α/M·p + (1−α)/M_ce·e_y
    (M rows, M_ce of them with a CE term), since α·KL_m + (1−α)·CE_m = Σ_r CE(t_r, W f̂_r) − α/M·Σ_r H(p_r):
    :func:`losses.linear_soft_ce.linear_soft_cross_entropy` takes its gradient through W in the
    forward, one row chunk at a time.  Loss and gradients equal :func:`falcon_loss` to fp32
    rounding; the reported ``kl`` part is recovered from the sum (a few 1e-7 nats of cancellation).

    Args:
        pred_feat: drafter features f̂ [M, H] (any float dtype).
        target_feat: target features f_{t+k} [M, H].
        weight: the frozen LM head's rows [N, H] (W, or W[d2t] over a draft vocabulary).
        teacher_logits: W f_{t+k} [M, N] (no gradient).
        alpha, omega, beta, ce_mask, teacher_ids: as :func:`falcon_loss`; ``alpha`` must be > 0.
        transform: the base's map of W f̂ to its logits (:class:`core.logit_transform.LogitTransform`;
            None = none), as the student logits of :func:`falcon_loss` were made with it.

    Returns:
        ``(loss, parts, student_ids)``: as :func:`falcon_loss`, plus the student argmax [M] int64.
        All computation is in fp32, autocast off.

    Raises:
        ValueError: mismatched shapes, or ``alpha`` <= 0 (use :func:`falcon_loss`).
    """
    if pred_feat.shape != target_feat.shape or pred_feat.dim() != 2:
        raise ValueError(f"pred_feat {tuple(pred_feat.shape)} and target_feat {tuple(target_feat.shape)} must be equal [M, H]")
    if teacher_logits.shape != (pred_feat.shape[0], weight.shape[0]):
        raise ValueError(f"teacher_logits {tuple(teacher_logits.shape)} != [M, N] = {(pred_feat.shape[0], weight.shape[0])}")
    if not alpha > 0:
        raise ValueError(f"falcon_loss_fused needs alpha > 0 (got {alpha}); use falcon_loss")
    M = pred_feat.shape[0]
    with torch.autocast(device_type=pred_feat.device.type, enabled=False):
        f = pred_feat.float()
        w = weight.float()
        reg = F.smooth_l1_loss(f, target_feat.float(), reduction="none", beta=beta).mean(-1)
        reg_m = reg.sum() / max(M, 1)
        y = teacher_logits.argmax(-1) if teacher_ids is None else teacher_ids
        keep = torch.ones(M, dtype=torch.bool, device=f.device) if ce_mask is None else ce_mask.bool()
        rows = keep.nonzero().squeeze(-1)
        n_ce = max(int(rows.numel()), 1)
        probs, entropy = teacher_entropy(teacher_logits)
        target = probs.mul_(alpha / max(M, 1))
        target[rows, y[rows]] += (1.0 - alpha) / n_ce
        mass = torch.full((M,), alpha / max(M, 1), dtype=torch.float32, device=f.device) + keep * ((1.0 - alpha) / n_ce)
        out = linear_soft_cross_entropy(f, w, target, mass=mass, transform=transform)
        distill = out.loss - alpha * entropy.sum() / max(M, 1)
        with torch.no_grad():
            z_y = torch.linalg.vecdot(f[rows], w[y[rows]])
            ce_m = (out.lse[rows] - (z_y if transform is None else transform(z_y))).sum() / n_ce
            kl_m = (distill - (1.0 - alpha) * ce_m) / alpha
    loss = reg_m + omega * distill
    return loss, {"reg": reg_m.detach(), "kl": kl_m.detach(), "ce": ce_m.detach()}, out.argmax


def glancing_ratio(cfg: dict[str, Any], progress) -> float:
    """The glancing ratio λ at ``progress`` (METHODS.md §1.4 step 3).

    ``cfg`` keys: ``schedule`` (``linear`` | ``constant``), ``unit`` (``epoch`` | ``step``),
    ``scale`` a, ``offset`` b.  With the training fraction π = e/E (unit ``epoch``, e counted from
    0) or π = step/total_steps (unit ``step``):

    * ``linear``: λ = a·(1 − π) + b.  Paper [P]: a = 0.4, b = 0 (λ = 0.4·(E−e)/E); official code
      [C]: a = 0.35, b = 0.1 (λ = 0.35·(E−e)/E + 0.1, 0.45 → 0.10 over 20 epochs).
    * ``constant``: λ = b.

    Args:
        cfg: the ``heads.glancing`` section (a dict).
        progress: a :class:`heads.base.Progress` (step, total_steps, epoch, total_epochs).

    Returns:
        λ as a Python float, clipped below at 0.

    Raises:
        ValueError: an unknown schedule/unit, or a non-positive total.
    """
    schedule, unit = cfg.get("schedule", "linear"), cfg.get("unit", "epoch")
    a, b = float(cfg.get("scale", 0.4)), float(cfg.get("offset", 0.0))
    if schedule not in GLANCING_SCHEDULES:
        raise ValueError(f"heads.glancing.schedule={schedule!r}; choices: {', '.join(GLANCING_SCHEDULES)}")
    if unit not in GLANCING_UNITS:
        raise ValueError(f"heads.glancing.unit={unit!r}; choices: {', '.join(GLANCING_UNITS)}")
    if schedule == "constant":
        return max(0.0, b)
    if unit == "epoch":
        done, total = progress.epoch, progress.total_epochs
    else:
        done, total = progress.step, progress.total_steps
    if total <= 0:
        raise ValueError(f"glancing schedule needs a positive total {unit}s, got {total}")
    frac = min(max(done / total, 0.0), 1.0)
    return max(0.0, a * (1.0 - frac) + b)


def glancing_positions(
    loss_mask: torch.Tensor,
    distance: torch.Tensor,
    ratio: float,
    block_size: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose the CSGD replacement mask R for a batch (METHODS.md §1.4, Rec. for B > 1).

    Per row b: N_b = ⌊λ·d_b⌋ blocks are chosen uniformly without replacement among the candidate
    blocks, clamped to their number C_b.  Blocks are aligned at position 0 (block j covers
    positions jk..jk+k−1, the training mask's blocks); a block is a candidate iff all its k
    positions are loss positions (so the replaced slots' ground truth f_{t+k}, x_{t+k+1} exists).
    In each chosen block a prefix of length r ~ U{1..k−1} (independently per block) is replaced:
    R is True there.  The caller applies the coupled replacement to token AND feature inputs and
    removes R from the loss mask.

    Args:
        loss_mask: [B, T] bool, the loss positions m.
        distance: [B] long, the Hamming distance d_b of pass A.
        ratio: λ ≥ 0.
        block_size: k ≥ 2 (k = 1 has no prefix to glance at; raises).
        generator: optional ``torch.Generator`` on the mask's device.

    Returns:
        ``(R [B, T] bool, chosen [B] long)`` — the replaced positions and the blocks chosen per row.

    Raises:
        ValueError: k < 2, ratio < 0, or mismatched shapes.
    """
    if block_size < 2:
        raise ValueError(f"glancing needs block size k >= 2 (got {block_size}): r ∈ [1, k−1] is empty")
    if ratio < 0:
        raise ValueError(f"glancing ratio must be >= 0, got {ratio}")
    if loss_mask.dim() != 2 or distance.shape != loss_mask.shape[:1]:
        raise ValueError(f"loss_mask [B,T] and distance [B] expected, got {tuple(loss_mask.shape)}, {tuple(distance.shape)}")
    B, T = loss_mask.shape
    k = block_size
    nb = math.ceil(T / k)
    device = loss_mask.device
    padded = torch.zeros(B, nb * k, dtype=torch.bool, device=device)
    padded[:, :T] = loss_mask.bool()
    cand = padded.view(B, nb, k).all(-1)  # [B, nb]
    wanted = torch.floor(distance.to(torch.float64) * float(ratio) + 1e-9).long()
    chosen_n = torch.minimum(wanted, cand.sum(-1))
    scores = torch.rand(B, nb, generator=generator, device=device)
    scores = scores.masked_fill(~cand, 2.0)  # non-candidates rank last
    rank = scores.argsort(-1).argsort(-1)
    chosen = rank < chosen_n[:, None]  # [B, nb]
    r = torch.randint(1, k, (B, nb), generator=generator, device=device)
    within = torch.arange(k, device=device)[None, None, :] < r[..., None]
    R = (chosen[..., None] & within).reshape(B, nb * k)[:, :T]
    return R, chosen_n
