"""Finite-value checks, one definition for every boundary (issue 28).

NaN and ±inf never pass a boundary silently (``docs/reliability.md``):

* data prep drops a conversation whose base forward gives a non-finite hidden state (any cached
  layer, any position) or non-finite logits (so an undefined greedy label), and counts it by
  reason (:func:`data_prep.pipeline.build_records`);
* the fp8 storage saturates finite values and refuses non-finite ones
  (:func:`data_prep.fp8.quantize_rows`, :mod:`data_prep.fp8_convert`);
* training stops on a non-finite loss or gradient, naming the step and the micro-batches'
  conversation ids, on every rank together (:mod:`train.finite`);
* ``heads.save`` and ``python -m heads.export`` refuse a non-finite weight, naming the tensor.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch

from core.config import UserInputError


class NonFiniteError(UserInputError):
    """A NaN or ±inf reached a boundary that refuses it; the message names where (tensor, index,
    step, conversation) and what to do.  A :class:`~core.config.UserInputError`: the CLIs print
    it as one ``error:`` line and exit 2."""


def describe(value: float) -> str:
    """``"nan"``, ``"inf"`` or ``"-inf"`` (or the number) for a message."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


def first_non_finite(t: torch.Tensor) -> tuple[tuple[int, ...], float, int] | None:
    """``(index, value, count)`` of the first non-finite element of ``t`` (row-major order) and how
    many there are, or None when every element is finite (integer and bool tensors always are)."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return None
    bad = ~torch.isfinite(t)
    count = int(bad.sum())
    if count == 0:
        return None
    index = tuple(int(i) for i in bad.nonzero()[0])
    return index, float(t[index].float()) if not t.is_complex() else float("nan"), count


def check_finite(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise unless every floating tensor in ``tensors`` is finite.

    Args:
        tensors: ``{name: tensor}`` (any shapes, dtypes; non-floating tensors are skipped).
        what: what is being refused, for the message (e.g. ``"heads.save into out/best"``).

    Raises:
        NonFiniteError: names the first tensor with a non-finite value, its count, value and index.
    """
    for name, t in tensors.items():
        found = first_non_finite(t)
        if found is not None:
            index, value, count = found
            raise NonFiniteError(f"{what}: tensor {name!r} {list(t.shape)} has {count} non-finite value(s) "
                                 f"(first {describe(value)} at {list(index)}); nothing was written")


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when every element of every tensor is finite (one device sync)."""
    norms = [torch.linalg.vector_norm(t.detach().float(), float("inf")) for t in tensors
             if t is not None and t.is_floating_point() and t.numel()]
    return not norms or bool(torch.isfinite(torch.stack(norms)).all())
