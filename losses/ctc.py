"""CTC-drafter objectives on slot logits (METHODS.md §2.4 "Rec." blank logit, §2.6 NAR variant).

Both functions take the slot logits of A anchors, ``logits`` [A, S, V+1] (any float dtype; the
loss is computed in fp32), where class ``V`` is the dedicated blank, and the greedy labels
``targets`` [A, N] (long, values in [0, V)), ℓ_j = the j-th base-greedy token after the bonus.

* :func:`ctc_slot_loss` — ``torch.nn.functional.ctc_loss`` (the forward-backward dynamic
  programme) with ``blank = V`` and ``zero_infinity=True``: every alignment of the S slots that
  collapses (merge repeats, then drop blanks) to ℓ_1..ℓ_N counts.
* :func:`ce_slot_loss` — the ablation with the same architecture: per-slot cross-entropy,
  slot j predicts ℓ_j for j ≤ N and the blank for j > N (so the drafter's CTC collapse of the
  top-1 path is exactly ℓ_1..ℓ_N; a genuine repeat "a a" collapses to "a" under CE, which is
  the ablation's known weakness).

Units: both losses are negative log-likelihoods in nats **per target token** (divided by N), so
their values are comparable.

Draft vocabulary (issue 13): with a head drafting over N_d tokens the logits are [A, S, N_d+1]
(blank still last) and the targets are draft indices, ``-1`` where the greedy label lies outside
the draft vocabulary.  Out-of-vocabulary rule: CTC drops an anchor with any OOV target (no
alignment can emit it; like an infeasible anchor it leaves the mean), CE drops the OOV slot terms
(the other slots of the anchor still train).  Both report ``oov_anchors`` (anchors with ≥ 1 OOV
target).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ctc_alignment_feasible", "ctc_slot_loss", "ce_slot_loss"]


def _check(logits: torch.Tensor, targets: torch.Tensor) -> tuple[int, int, int, int]:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [A, S, V+1], got shape {tuple(logits.shape)}")
    if targets.dim() != 2 or targets.shape[0] != logits.shape[0]:
        raise ValueError(f"targets must be [A, N] with A={logits.shape[0]}, got shape {tuple(targets.shape)}")
    a, s, c = logits.shape
    n = targets.shape[1]
    if n < 1:
        raise ValueError("targets must hold at least one label per anchor (N >= 1)")
    if targets.numel() and (int(targets.min()) < -1 or int(targets.max()) >= c - 1):
        raise ValueError(f"targets must lie in [0, V={c - 1}) (class V is the blank; -1 = outside the draft "
                         f"vocabulary); got range [{int(targets.min())}, {int(targets.max())}]")
    return a, s, c, n


def ctc_alignment_feasible(targets: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Whether some length-``num_slots`` alignment collapses to each label row.

    A CTC alignment of a label with ``r`` adjacent repeats needs at least ``N + r`` frames (a
    blank must separate equal neighbours), so the row is feasible iff ``N + r <= S``.

    Args:
        targets: LongTensor [A, N].
        num_slots: S.
    Returns:
        BoolTensor [A].
    """
    repeats = (targets[:, 1:] == targets[:, :-1]).sum(dim=1)
    return targets.shape[1] + repeats <= num_slots


def ctc_slot_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CTC loss of S slot distributions against N greedy labels (METHODS.md §2.6 "Training").

    Args:
        logits: [A, S, V+1] slot logits, blank index V.
        targets: [A, N] long labels in [0, V), or -1 (outside the draft vocabulary).

    Returns:
        ``(loss, stats)``: ``loss`` the fp32 scalar mean over *feasible*, fully in-vocabulary anchors of
        −log Σ_{alignments collapsing to ℓ} Π_s p_s(c_s), divided by N (0 with a zero gradient
        when no anchor is feasible or A = 0); ``stats`` holds ``infeasible`` (count of anchors
        with no alignment: their loss is zeroed by ``zero_infinity=True``), ``oov_anchors`` (anchors
        with an OOV target, dropped) and ``anchors`` (A), as 0-d tensors.

    Raises:
        ValueError: on shape or label-range errors.
    """
    a, s, c, n = _check(logits, targets)
    in_vocab = (targets >= 0).all(dim=1)
    feasible = ctc_alignment_feasible(targets, s)
    stats = {"infeasible": (~feasible & in_vocab).sum().detach(), "oov_anchors": (~in_vocab).sum().detach(),
             "anchors": torch.tensor(a, device=logits.device)}
    keep = feasible & in_vocab
    if a == 0 or not bool(keep.any()):
        return logits.float().sum() * 0.0, stats
    log_probs = F.log_softmax(logits[keep].float(), dim=-1).transpose(0, 1)  # [S, A', V+1]
    k = int(keep.sum())
    input_lengths = torch.full((k,), s, dtype=torch.long, device=logits.device)
    target_lengths = torch.full((k,), n, dtype=torch.long, device=logits.device)
    nll = F.ctc_loss(log_probs, targets[keep].long(), input_lengths, target_lengths, blank=c - 1,
                     reduction="none", zero_infinity=True)  # [A']
    loss = nll.sum() / (n * k)
    return loss, stats


def ce_slot_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-slot cross-entropy ablation (config ``heads.loss: ce``).

    Slot j (1-based) is trained towards ℓ_j for j ≤ N and towards the blank (class V) for
    N < j ≤ S.  Requires S ≥ N.

    Args:
        logits: [A, S, V+1].  targets: [A, N] long in [0, V), or -1 (outside the draft vocabulary).

    Returns:
        ``(loss, stats)``: ``loss`` = (1/A) Σ_a (1/N) Σ_{j=1..S} CE(slot j), fp32 scalar (0 with a
        zero gradient when A = 0), where an OOV slot j ≤ N contributes 0; ``stats`` as in
        :func:`ctc_slot_loss` (``infeasible`` is always 0 here: CE has no alignment).

    Raises:
        ValueError: on shape or label-range errors, or S < N.
    """
    a, s, c, n = _check(logits, targets)
    if s < n:
        raise ValueError(f"ce loss needs at least as many slots as targets, got S={s} < N={n}")
    stats = {"infeasible": torch.zeros((), dtype=torch.long, device=logits.device),
             "oov_anchors": (targets < 0).any(dim=1).sum().detach() if a else torch.zeros((), dtype=torch.long),
             "anchors": torch.tensor(a, device=logits.device)}
    if a == 0:
        return logits.float().sum() * 0.0, stats
    full = torch.full((a, s), c - 1, dtype=torch.long, device=logits.device)
    full[:, :n] = targets
    ce = F.cross_entropy(logits.float().reshape(a * s, c), full.reshape(-1), reduction="sum", ignore_index=-1)
    return ce / (a * n), stats
