"""The fused linear soft cross-entropy (losses.linear_soft_ce) against the autograd formulation."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from losses.linear_soft_ce import linear_soft_cross_entropy, teacher_entropy


def brute(x, w, probs):
    """−Σ_r Σ_v p log softmax(x Wᵀ): the textbook formulation, autograd through everything."""
    return -(probs * F.log_softmax((x @ w.T).float(), dim=-1)).sum()


def make(M=37, H=16, N=50, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g, dtype=dtype)
    w = torch.randn(N, H, generator=g, dtype=dtype) / 3
    probs = torch.softmax(2 * torch.randn(M, N, generator=g, dtype=torch.float64), -1).float()
    return x, w, probs


@pytest.mark.parametrize("chunk_rows", [1, 5, 37, 256])
def test_value_gradients_and_argmax_match_brute_force(chunk_rows):
    x, w, probs = make(dtype=torch.float32)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, argmax, lse = linear_soft_cross_entropy(x1, w1, probs, chunk_rows=chunk_rows)
    (2.5 * loss).backward()  # a non-unit upstream gradient scales both stored gradients
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = brute(x2, w2, probs)
    (2.5 * ref).backward()
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-4, atol=1e-5)
    assert torch.equal(argmax, (x @ w.T).argmax(-1))
    torch.testing.assert_close(lse, torch.logsumexp(x @ w.T, -1))


def test_gradcheck_float64():
    x, w, probs = make(M=6, H=4, N=7)
    probs = probs.double()
    x.requires_grad_()
    w.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: linear_soft_cross_entropy(a, b, probs, chunk_rows=4).loss, (x, w))


def test_frozen_weight_gets_no_gradient_and_rows_still_do():
    x, w, probs = make(dtype=torch.float32)
    x.requires_grad_()
    loss = linear_soft_cross_entropy(x, w, probs, chunk_rows=8).loss
    loss.backward()
    x2 = x.detach().clone().requires_grad_()
    brute(x2, w, probs).backward()
    assert w.grad is None
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-5)


def test_no_rows_gives_zero_loss_and_empty_gradient():
    x, w, probs = make(M=0, dtype=torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    loss, argmax, _ = linear_soft_cross_entropy(x, w, probs)
    loss.backward()
    assert float(loss) == 0.0 and argmax.shape == (0,)
    assert x.grad.shape == (0, 16) and torch.equal(w.grad, torch.zeros_like(w))


def test_bf16_autocast_runs_the_products_in_bf16_like_linear():
    """Under autocast the products run in bf16 as nn.Linear's would; loss and gradients then agree
    with the autograd path under the same autocast to bf16 rounding, and with fp32 only loosely."""
    x, w, probs = make(M=64, H=32, N=300, dtype=torch.float32)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_soft_cross_entropy(x1, w1, probs, chunk_rows=16).loss
        ref = -(probs * F.log_softmax(F.linear(x2, w2).float(), -1)).sum()
    loss.backward()
    ref.backward()
    assert x1.grad.dtype == torch.float32 and w1.grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=2e-2, atol=2e-2)
    exact = brute(x, w, probs)
    assert abs(float(loss) - float(exact)) > 0  # bf16 products: not the fp32 value
    assert float(loss) == pytest.approx(float(exact), rel=1e-2)


def test_teacher_entropy_turns_the_ce_into_the_kl():
    x, w, _ = make(dtype=torch.float32)
    t = torch.randn(x.shape[0], w.shape[0], generator=torch.Generator().manual_seed(3))
    probs, ent = teacher_entropy(t)
    ce = linear_soft_cross_entropy(x, w, probs).loss
    kl = F.kl_div(F.log_softmax(x @ w.T, -1), F.log_softmax(t, -1), reduction="sum", log_target=True)
    torch.testing.assert_close(ce - ent.sum(), kl, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent, -(probs * probs.log()).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shapes, match", [
    (((4, 3), (5, 2), (4, 5)), "do not form"),
    (((4, 3), (5, 3), (4, 6)), "soft targets"),
])
def test_bad_shapes_are_named(shapes, match):
    x, w, p = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        linear_soft_cross_entropy(x, w, p)
    with pytest.raises(ValueError, match="target masses"):
        linear_soft_cross_entropy(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(2, 4), mass=torch.ones(3))
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_soft_cross_entropy(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(2, 4), chunk_rows=0)


def test_targets_of_any_mass_a_distribution_mixed_with_one_hot_labels():
    """Falcon's target α/M·p + (1−α)/M_ce·e_y (rows of mass ≠ 1, some without the label term):
    the loss is −Σ t log softmax(z) and the gradients follow (m·softmax − t)."""
    x, w, probs = make(dtype=torch.float32)
    y = torch.randint(0, w.shape[0], (x.shape[0],), generator=torch.Generator().manual_seed(4))
    keep = torch.arange(x.shape[0]) % 3 != 0
    t = probs * (0.9 / x.shape[0])
    t[keep.nonzero().squeeze(-1), y[keep]] += 0.1 / int(keep.sum())
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    mass = 0.9 / x.shape[0] + keep * (0.1 / int(keep.sum()))
    loss = linear_soft_cross_entropy(x1, w1, t, mass=mass, chunk_rows=6).loss
    loss.backward()
    ref = brute(x2, w2, t)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-4, atol=1e-7)
