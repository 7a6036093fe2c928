"""CTC / CE slot losses (losses/ctc.py) against brute-force enumeration and hand computation."""
from __future__ import annotations

import itertools

import pytest
import torch

from decoding.ctc import ctc_collapse
from losses.ctc import ce_slot_loss, ctc_alignment_feasible, ctc_slot_loss


def brute_force_ctc(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Enumerate every length-S alignment over V+1 classes; keep those collapsing to the label.

    Returns (loss as ctc_slot_loss defines it, feasible mask [A])."""
    a, s, c = logits.shape
    logp = torch.log_softmax(logits.double(), dim=-1)
    nlls, feasible = [], []
    for i in range(a):
        label = targets[i].tolist()
        terms = [sum(logp[i, j, cls] for j, cls in enumerate(al))
                 for al in itertools.product(range(c), repeat=s) if ctc_collapse(al, c - 1) == label]
        feasible.append(bool(terms))
        nlls.append(-torch.logsumexp(torch.stack(terms), 0) if terms else logp.sum() * 0.0)
    feas = torch.tensor(feasible)
    return torch.stack(nlls).sum() / (targets.shape[1] * max(int(feas.sum()), 1)), feas


CASES = [
    # (S, V, targets)
    (4, 3, [[0, 1], [2, 2], [1, 0]]),          # distinct, repeated, distinct
    (5, 2, [[1, 1, 1], [0, 1, 0], [0, 0, 1]]),  # repeats needing separating blanks
    (3, 3, [[1, 1, 1], [2, 0, 1], [0, 2, 0]]),  # first row infeasible: needs 5 frames > S=3
]


@pytest.mark.parametrize("s,v,targets", CASES)
def test_ctc_loss_and_gradient_equal_brute_force(s, v, targets):
    tgt = torch.tensor(targets)
    logits = torch.randn(len(targets), s, v + 1, dtype=torch.float64) * 2.0
    x1 = logits.clone().requires_grad_(True)
    x2 = logits.clone().requires_grad_(True)
    loss, stats = ctc_slot_loss(x1, tgt)
    ref, feas = brute_force_ctc(x2, tgt)
    loss.backward()
    ref.backward()
    assert torch.allclose(loss.double(), ref, atol=1e-5), (loss, ref)
    assert torch.allclose(x1.grad, x2.grad, atol=1e-5)
    assert int(stats["infeasible"]) == int((~feas).sum())
    assert torch.equal(ctc_alignment_feasible(tgt, s), feas)
    if (~feas).any():  # zero_infinity: the infeasible anchor contributes neither loss nor gradient
        assert torch.all(x1.grad[~feas] == 0)


def test_infeasible_only_gives_zero_and_is_counted():
    logits = torch.randn(1, 3, 4, requires_grad=True)
    loss, stats = ctc_slot_loss(logits, torch.tensor([[1, 1, 1]]))
    loss.backward()
    assert float(loss.detach()) == 0.0 and int(stats["infeasible"]) == 1
    assert torch.all(logits.grad == 0)


def test_feasibility_matches_enumeration_exhaustively():
    s, v, n = 4, 2, 3
    for label in itertools.product(range(v), repeat=n):
        exists = any(ctc_collapse(al, v) == list(label) for al in itertools.product(range(v + 1), repeat=s))
        assert bool(ctc_alignment_feasible(torch.tensor([label]), s)[0]) == exists, label


def test_ce_loss_hand_computed():
    # A=1, S=3, V=2 (blank=2), N=2: slot0 -> 1, slot1 -> 0, slot2 -> blank
    logits = torch.tensor([[[0.0, 1.0, -1.0], [2.0, 0.0, 0.0], [0.5, 0.5, 1.5]]], requires_grad=True)
    loss, stats = ce_slot_loss(logits, torch.tensor([[1, 0]]))
    import math

    def nll(row, k):
        return math.log(sum(math.exp(x) for x in row)) - row[k]

    rows = logits[0].tolist()
    expected = (nll(rows[0], 1) + nll(rows[1], 0) + nll(rows[2], 2)) / 2
    assert abs(float(loss.detach()) - expected) < 1e-6
    assert int(stats["infeasible"]) == 0
    loss.backward()
    p = torch.softmax(logits.detach()[0], -1)
    onehot = torch.tensor([[0.0, 1, 0], [1, 0, 0], [0, 0, 1]])
    assert torch.allclose(logits.grad[0], (p - onehot) / 2, atol=1e-6)


def test_loss_rejects_bad_labels():
    with pytest.raises(ValueError, match="blank"):
        ctc_slot_loss(torch.randn(1, 4, 3), torch.tensor([[2, 0]]))  # 2 == V is the blank
    with pytest.raises(ValueError, match="S=2 < N=3"):
        ce_slot_loss(torch.randn(1, 2, 5), torch.tensor([[0, 1, 2]]))
