"""A linear layer and its soft-target cross-entropy in one pass over row chunks (Liger-style).

For rows x_r [H] of a draft head's last hidden state, an output projection W [N, H] and
non-negative target weights p_r [N] of mass m_r = Σ_v p_rv (a frozen teacher's distribution,
m_r = 1, or a weighted mix of one with a one-hot label):

    L = Σ_r  −Σ_v p_rv · log softmax(W x_r)_v  =  Σ_r  m_r·logsumexp(z_r) − p_r·z_r,   z_r = W x_r,
    ∂L/∂z_r = m_r·softmax(z_r) − p_r,   ∂L/∂x_r = (∂L/∂z_r) W,   ∂L/∂W = Σ_r (∂L/∂z_r)ᵀ x_r.

The autograd way computes z = x Wᵀ, keeps the whole [M, N] float32 z for the backward, reads it
again for the softmax and then runs two more products; a head that recomputes its logits under
activation checkpointing (AdaDecode's chunks) pays the forward product twice.  Here the gradients
are taken *during the forward*, one chunk of rows at a time, while that chunk's logits are hot in
cache: per chunk one product for z, one pass for logsumexp/softmax − p, one product for ∂L/∂x and,
if W trains, one for ∂L/∂W.  Nothing of size [M, N] outlives its chunk.  The backward only scales
the stored gradients by the incoming scalar.

This is the fused linear cross-entropy of Liger Kernel (Hsu et al. 2024, arXiv 2410.10989, §3.3,
"FusedLinearCrossEntropy"; its Triton kernels need a GPU) with soft targets, which covers the
distillation losses of this repository:

* EAGLE-3's per-step CE against the base's distribution (arXiv 2503.01840 §3.2);
* AdaDecode's KL(p* ‖ softmax(z)) = CE(p*, z) − H(p*), H(p*) constant for a frozen teacher
  (METHODS.md §3.3; :func:`teacher_entropy`);
* Falcon's α·KL + (1 − α)·CE(y) (METHODS.md §1.3), one target α/M·p + (1 − α)/M_ce·e_y per row.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

DEFAULT_CHUNK_ROWS = 256  # [256, 16384] fp32 logits = 16 MiB: a chunk stays in a 32 MiB L3


class LinearSoftCE(NamedTuple):
    """What :func:`linear_soft_cross_entropy` returns."""

    loss: torch.Tensor    # scalar Σ_r CE_r, float32 (float64 for float64 products); differentiable
    argmax: torch.Tensor  # [M] int64 argmax_v z_rv
    lse: torch.Tensor     # [M] logsumexp_v z_rv, float32 (float64), detached


def _chunked(x, weight, probs, mass, compute_dtype, chunk_rows, need_x, need_w, transform=None):
    """(Σ CE, argmax [M], lse [M], ∂/∂x [M, H] or None, ∂/∂W [N, H] or None), one row chunk at a time."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        xs = x.to(compute_dtype)
        w = weight.to(compute_dtype)
        acc = probs.dtype  # float32, or float64 for float64 inputs
        total = torch.zeros((), dtype=acc, device=x.device)
        argmax = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        lses = torch.empty(x.shape[0], dtype=acc, device=x.device)
        gx = torch.empty_like(xs) if need_x else None
        gw = torch.zeros(weight.shape, dtype=acc, device=x.device) if need_w else None
        for s in range(0, x.shape[0], chunk_rows):
            xc = xs[s:s + chunk_rows]
            z = (xc @ w.T).to(acc)                                       # [c, N]
            if transform is not None:                                    # the base's own logit map
                z = transform(z)
                dz = transform.derivative(z) if (need_x or need_w) else None
            argmax[s:s + chunk_rows] = z.argmax(-1)
            p = probs[s:s + chunk_rows]
            lse = torch.logsumexp(z, dim=-1)
            lses[s:s + chunk_rows] = lse
            m = None if mass is None else mass[s:s + chunk_rows]
            total += ((lse if m is None else m * lse) - torch.linalg.vecdot(p, z)).sum()
            if not (need_x or need_w):
                continue
            g = z.sub_(lse.unsqueeze(-1)).exp_()                           # softmax(z)
            g = (g if m is None else g.mul_(m.unsqueeze(-1))).sub_(p)    # m·softmax(z) − p
            g = (g if transform is None else g.mul_(dz)).to(compute_dtype)  # through the map to x Wᵀ
            if need_x:
                gx[s:s + chunk_rows] = g @ w
            if need_w:
                gw += (g.T @ xc).to(acc)
    return total, argmax, lses, gx, gw


class _LinearSoftCrossEntropy(torch.autograd.Function):
    """Σ_r CE(p_r, W x_r) with its gradients taken in the forward (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, probs, mass, compute_dtype, chunk_rows, transform):
        total, argmax, lse, gx, gw = _chunked(x, weight, probs, mass, compute_dtype, chunk_rows,
                                              ctx.needs_input_grad[0], ctx.needs_input_grad[1], transform)
        ctx.save_for_backward(gx, gw)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.mark_non_differentiable(argmax, lse)
        return total, argmax, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total, _grad_argmax, _grad_lse):
        gx, gw = ctx.saved_tensors
        grad_x = None if gx is None else (gx.to(grad_total.dtype) * grad_total).to(ctx.x_dtype)
        grad_w = None if gw is None else (gw * grad_total).to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None, None


def linear_soft_cross_entropy(x: torch.Tensor, weight: torch.Tensor, probs: torch.Tensor,
                              mass: torch.Tensor | None = None, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                              transform=None) -> LinearSoftCE:
    """Σ_r −Σ_v p_rv · log softmax(W x_r)_v, with argmax_v and logsumexp_v of W x_r, without an [M, N] logit tensor.

    Equal, to floating-point rounding, to
    ``soft_cross_entropy((x @ weight.T).float(), probs).sum()`` (:func:`losses.eagle3.soft_cross_entropy`)
    with its gradients to ``x`` and ``weight``; the gradients are computed in this call, chunk by
    chunk, and stored (module docstring; Liger Kernel §3.3).  Not twice differentiable.

    Precision: the products run in autocast's dtype when autocast is on (bf16 under
    ``train.precision=bf16-mixed``, as ``nn.Linear`` would), else in ``x``'s dtype; logits,
    logsumexp, the loss and ∂L/∂W are accumulated in float32 (float64 for float64 products).

    Args:
        x: [M, H] float rows (M may be 0).
        weight: [N, H] output projection; a frozen buffer or a trained parameter.
        probs: [M, N] float non-negative target weights; never receives a gradient.
        mass: [M] the row sums m_r = Σ_v p_rv, or None when every row is a distribution (m_r = 1,
            taken as exact: no summation rounding enters the loss).
        chunk_rows: rows per chunk (bounds the [chunk, N] working set).
        transform: the base's map of its LM head's product (:class:`core.logit_transform.LogitTransform`,
            e.g. Gemma 2's final soft-capping): the logits are ``transform(x Wᵀ)`` and the gradients
            pass through it; None or the identity map: ``x Wᵀ``.

    Returns:
        :class:`LinearSoftCE` ``(loss, argmax, lse)``: the scalar Σ_r CE_r, float32 (float64), the
        [M] int64 argmax and the [M] logsumexp of each row's logits.

    Raises:
        ValueError: shapes disagree or ``chunk_rows`` < 1.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"rows {tuple(x.shape)} and weight {tuple(weight.shape)} do not form x @ weight.T")
    if probs.shape != (x.shape[0], weight.shape[0]):
        raise ValueError(f"soft targets {tuple(probs.shape)} do not match logits {(x.shape[0], weight.shape[0])}")
    if mass is not None and mass.shape != (x.shape[0],):
        raise ValueError(f"target masses {tuple(mass.shape)} do not match {x.shape[0]} rows")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    dev = x.device.type
    compute_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    acc = torch.float64 if compute_dtype == torch.float64 else torch.float32
    probs = probs.detach().to(acc)
    mass = None if mass is None else mass.detach().to(acc)
    transform = None if transform is None or transform.is_identity else transform
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return LinearSoftCE(*_chunked(x, weight, probs, mass, compute_dtype, int(chunk_rows), False, False, transform)[:3])
    return LinearSoftCE(*_LinearSoftCrossEntropy.apply(x, weight, probs, mass, compute_dtype, int(chunk_rows), transform))


@torch.no_grad()
def teacher_entropy(teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher probabilities and their entropies: softmax(t) and H = logsumexp(t) − softmax(t)·t.

    With them KL(p ‖ softmax(z)) = CE(p, z) − H(p) per row (AdaDecode, METHODS.md §3.3).

    Args:
        teacher_logits: [M, N] logits of the frozen teacher (any float dtype).

    Returns:
        ``(probs [M, N] float32, entropy [M] float32, nats)``.
    """
    t = teacher_logits.float()
    lse = torch.logsumexp(t, dim=-1)
    probs = torch.exp(t - lse.unsqueeze(-1))
    return probs, lse - torch.linalg.vecdot(probs, t)
