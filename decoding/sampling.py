"""Lossless speculative *sampling* (temperature > 0): warping and the chain acceptance rule.

METHODS.md §4.2 "Chain (Leviathan et al. 2023; Chen et al. 2023)": a draft token x drawn from the
proposal q is accepted with probability min(1, p(x)/q(x)); on rejection a token is drawn from the
residual norm(max(0, p − q)).  The emitted token is then distributed exactly as p, whatever q is:

    P(emit y) = q(y)·min(1, p(y)/q(y)) + (1 − Σ_x min(p(x), q(x)))·max(0, p(y) − q(y)) / Z = p(y),

with Z = Σ_x max(0, p(x) − q(x)) = 1 − Σ_x min(p(x), q(x)).  The same warper (here: temperature)
must be applied to p and q.  Used by :class:`decoding.adadecode.AdaDecodeDecoder` (§3.4 step 3).
All probabilities are float32; randomness comes only from the caller's ``torch.Generator``.
"""
from __future__ import annotations

import torch


def warp(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) in float32.

    Args:
        logits: [..., V] (any float dtype).
        temperature: > 0.

    Returns:
        [..., V] float32 probabilities.

    Raises:
        ValueError: ``temperature`` <= 0 (use argmax for greedy decoding).
    """
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0 for sampling (greedy uses argmax)")
    return torch.softmax(logits.float() / float(temperature), dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token id drawn from ``probs`` [V] (non-negative, not necessarily normalised)."""
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_draft(p: torch.Tensor, q: torch.Tensor, draft: int,
                 generator: torch.Generator | None = None) -> tuple[int, bool]:
    """The chain rule for one draft token: accept ``draft`` w.p. min(1, p/q), else resample.

    Args:
        p: [V] float32 target distribution at the draft's position (warped).
        q: [V] float32 proposal the draft was sampled from (warped the same way); q[draft] > 0.
        draft: the proposed token id.
        generator: the source of randomness (on ``p``'s device).

    Returns:
        ``(token, accepted)``: ``draft`` and True, or a token drawn from norm(max(0, p − q)) and
        False.  The token's marginal distribution is exactly ``p`` (module docstring).

    Raises:
        ValueError: ``q[draft]`` is 0 (the draft cannot have come from q).
    """
    qd = float(q[draft])
    if qd <= 0.0:
        raise ValueError(f"draft {draft} has proposal probability 0: it was not sampled from q")
    u = float(torch.rand((), generator=generator, device=p.device))
    if u < min(1.0, float(p[draft]) / qd):
        return int(draft), True
    residual = (p - q).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had probability ~0
        residual = p
    return sample(residual, generator), False
