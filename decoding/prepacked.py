"""Verification's many-row linear products with weights reordered once for oneDNN.

A verification forward of an n-node tree runs every linear layer of the base over n rows; a vanilla
step runs them over one.  On this project's CPU (torch 2.13, fp32, MKL) ``F.linear`` over M >= 3
rows runs a blocked GEMM that reorders ("packs") the whole weight matrix on every call; over M <= 2
rows it runs a matrix-vector kernel that reads the weights as they are.  The repacking is paid once
per layer per forward: for SmolLM2-135M it is most of what makes a 9-node verification cost 1.8x a
one-token step (c(n), docs/precision.md), although the step is memory-bound and the extra rows are
nearly free arithmetic.

:func:`prepack_linear_weights` reorders each fp32 ``nn.Linear`` weight of a CPU model once into
oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the call Inductor's CPU
freezing makes) and gives the layer a ``forward`` that computes inputs of at least ``min_rows`` rows
with it (``torch.ops.mkldnn._linear_pointwise``) and every smaller input with ``F.linear`` on the
original weights.  With ``min_rows=3`` a one-token step (vanilla decoding, the speculative root) runs
exactly the kernel it ran before, bit for bit, and only verification and prefill change kernel.  With
``min_rows="auto"`` (the evaluation's) each weight shape's threshold is timed on this CPU
(:func:`probe_min_rows`): on the AMD EPYC Zen 3 the LM head's one-row product runs twice as fast packed,
so vanilla's one-token step takes it too, and that faster vanilla is the one a speedup is measured against.  Measured on
SmolLM2-135M fp32, 2 threads, 256 cached tokens (``benchmarks/bench_decoding.py --cost-only``):
see docs/precision.md "Prepacked verification weights".

Numerics: a packed product rounds differently from ``F.linear`` over the same rows (|Δ logit| up to
~6e-5 on SmolLM2, against ~2e-5 between ``F.linear``'s one-row and many-row kernels, which fp32
verification already lives with).  Losslessness is judged where it always is: fp32 parity of the
evaluation's tokens against vanilla greedy decoding.

:func:`prepack_linear_weights` packs fp32 layers only (:data:`PACK_DTYPES`): bf16 / fp16 verification
must keep the kernel of :func:`decoding.numerics.pad_one_row_products` (the one-token step computed
as two rows of the same ``F.linear``), which a packed many-row product alone would no longer match.

**bf16 for every row count** (:func:`prepack_row_consistent`).  On a CPU with AMX (issue 27, an Intel
Xeon with ``amx_bf16``; torch 2.13), oneDNN's packed bf16 product over one row equals the same row of
its products over 2, 9 or 16 rows bit for bit, and equals ``F.linear``'s many-row product; it is also
the fastest bf16 kernel there at every row count (SmolLM2's 576 -> 1536 projection: 25 us over one row
against 58 us for ``F.linear``, 31 against 82 us over 16 rows; docs/precision.md "bf16 on a CPU with
AMX").  There a bf16 layer is packed for *every* product, one-token steps included, wherever a probe of
its weight shape (:func:`consistent_rows`) finds the packed products row-consistent up to R rows (32
there: from 33 rows oneDNN blocks differently), and a product over more rows is computed in chunks of
at most R: vanilla's step and verification's rows then run one kernel, with no two-row padding.  A layer
whose packed products are not row-consistent is left to :mod:`decoding.numerics`.  On an AMD CPU with
``avx512_bf16`` (a Zen 4, 2026-12-07) the packed bf16 products are row-consistent up to 16 rows for every
SmolLM2 layer and faster there too (one-token step 38-40 against 44 ms; docs/precision.md "On an AMD EPYC
(Zen 4)"), so ``eval.prepack_weights=auto`` packs there as well (:func:`core.precision.packed_bf16_is_fastest`).

Products that need gradients run ``F.linear``; a weight changed after packing (or a deep-copied module)
is repacked at its next packed product.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import statistics
import time
import types

import torch
import torch.nn.functional as F

from core.frozen_linear import FrozenLinear
from decoding.numerics import ROW_CONSISTENT, is_one_row_padded

log = logging.getLogger(__name__)

#: weight dtypes that prepack_linear_weights packs for many-row products (bf16 / fp16 keep
#: decoding.numerics' row-consistent kernels, or are packed for every row count by prepack_row_consistent)
PACK_DTYPES = (torch.float32,)
#: weight dtypes prepack_row_consistent packs for every row count, where that is row-consistent
ROW_CONSISTENT_DTYPES = (torch.bfloat16, torch.float16)
#: inputs of at least this many rows use the packed weights: M <= 2 runs MKL's matrix-vector kernel,
#: which packing did not speed up on the Intel machine (the packed one-token step was not faster).
#: On the AMD EPYC MKL's M = 2 kernel is slow (c(2) 1.68x c(1), docs/precision.md), but there bf16 is
#: the dtype to decode in, and bf16 is not packed
MIN_ROWS = 3
#: ``min_rows="auto"`` (:func:`probe_min_rows`): a layer's products over fewer than MIN_ROWS rows are packed
#: only where the packed product is timed at least this much faster than ``F.linear``'s (a margin over timing
#: noise).  On the AMD EPYC Zen 3 (fp32, 2 threads) it is for every SmolLM2 shape over 2 rows (1.3-4.6x) and
#: for the 49,152- and 16,384-row LM heads over 1 row (about 2x); the 576-wide layers' one-row products stay
#: with ``F.linear`` (0.65-0.93x packed)
PROBE_MARGIN = 1.25

_PACKED = "_draftheads_prepacked"

#: the layers packed: ``nn.Linear`` and a draft head's product over frozen LM-head rows
#: (:class:`core.frozen_linear.FrozenLinear`, ``x Wᵀ`` with W a buffer; no bias)
LINEAR_TYPES = (torch.nn.Linear, FrozenLinear)


def available() -> bool:
    """Whether this torch build can reorder linear weights for oneDNN (CPU builds with mkldnn)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered into oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [rows, in] times a :func:`_reorder` ed weight, plus ``bias``: [rows, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.lru_cache(maxsize=None)
def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN on this CPU can run a prepacked product of ``dtype``: probed once per dtype on a
    tiny layer, through both calls the packed path makes (``_reorder_linear_weight``, then
    ``_linear_pointwise`` over :data:`MIN_ROWS` rows, checked against ``F.linear``).  bf16 needs
    ``avx512bw``/``avx512vl``/``avx512dq`` or ``avx_ne_convert``: on an AVX2-only CPU (an AMD Zen 3 here)
    the reorder raises for it.  A product that runs but disagrees with ``F.linear`` beyond the dtype's
    rounding also answers False (logged), so a broken kernel can never reach verification."""
    if not available():
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 32, generator=gen).to(dtype)
    b = torch.randn(16, generator=gen).to(dtype)
    x = torch.randn(MIN_ROWS, 32, generator=gen).to(dtype)
    try:
        with torch.no_grad():
            y = _packed_linear(x, _reorder(w), b)
    except RuntimeError as exc:
        log.info("oneDNN cannot prepack %s linear weights on this CPU (%s)", dtype, str(exc).splitlines()[0])
        return False
    ref = F.linear(x.float(), w.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 0.1
    if y.shape != ref.shape or not torch.allclose(y.float(), ref, atol=tol, rtol=tol):
        log.warning("oneDNN's prepacked %s product disagrees with F.linear on this CPU: not prepacking", dtype)
        return False
    return True


def _weight_stamp(w: torch.Tensor) -> tuple[int, int]:
    return w.data_ptr(), w._version


class _PackState:
    """A layer's packed weight, the row threshold, the weight stamp it was packed from, the dtypes
    that may be packed.  A deep copy of the module (``copy.deepcopy``: oneDNN tensors have no storage
    to copy) carries no packed weight; the copy repacks its own weight at its first many-row product."""

    __slots__ = ("packed", "min_rows", "stamp", "dtypes", "chunk_rows")

    def __init__(self, packed, min_rows: int, stamp, dtypes, chunk_rows: int | None = None) -> None:
        self.packed, self.min_rows, self.stamp, self.dtypes = packed, min_rows, stamp, tuple(dtypes)
        self.chunk_rows = chunk_rows

    def __deepcopy__(self, memo) -> "_PackState":
        return _PackState(None, self.min_rows, None, self.dtypes, self.chunk_rows)

    def repack(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.packed = _reorder(weight.detach())
        self.stamp = _weight_stamp(weight)


def _prepacked_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward``: rows >= the layer's ``min_rows`` through the packed weight, else the layer's own
    ``forward`` (``F.linear``).

    A weight changed since packing (in place, replaced, or the module deep-copied) is repacked here,
    once; a weight no longer in the packed dtypes (``module.to(bfloat16)``) or off the CPU, and
    products that need gradients, run ``F.linear``."""
    state: _PackState = getattr(self, _PACKED)
    w = self.weight
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows < state.min_rows or x.dtype != w.dtype or w.dtype not in state.dtypes or w.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return type(self).forward(self, x)  # the layer's own product (F.linear; FrozenLinear casts its weight)
    if state.stamp != _weight_stamp(w):
        state.repack(w)
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    step = state.chunk_rows
    if step and rows > step:  # row-consistent packing: every chunk runs the kernel a one-row product runs
        y = torch.cat([_packed_linear(flat[i:i + step], state.packed, self.bias) for i in range(0, rows, step)])
    else:
        y = _packed_linear(flat, state.packed, self.bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def prepack_linear_weights(model: torch.nn.Module, min_rows: int | str = MIN_ROWS, dtypes=PACK_DTYPES) -> list[str]:
    """Reorder ``model``'s fp32 CPU linear weights once for oneDNN; many-row products then use them.

    Args:
        model: any ``nn.Module`` (the frozen base).  Its linear layers (:data:`LINEAR_TYPES`) with a
            weight in ``dtypes`` on a CPU get an instance ``forward`` (:func:`_prepacked_forward`); the
            original weights stay (small products, gradients).  Memory: one more copy of those weights.
        min_rows: inputs of at least this many rows (all leading dims flattened) use the packed
            weight.  An int must be >= 2 (a one-row product keeps its kernel: vanilla is untouched).
            ``"auto"``: per weight shape, :func:`probe_min_rows` on this CPU (1, 2 or :data:`MIN_ROWS`):
            where a packed one-row product is measured faster, vanilla's one-token step runs it too, and
            the fastest vanilla of the machine is that one.
        dtypes: weight dtypes to pack; those this CPU cannot reorder (:func:`can_pack`) are left
            unpacked.

    Returns:
        The packed layers' module names; empty when this build has no oneDNN (:func:`available`).
        Idempotent; :func:`restore_linear_weights` undoes it.

    Raises:
        ValueError: an int ``min_rows`` < 2, or a string other than ``"auto"``.
    """
    probe = min_rows == "auto"
    if not probe and (isinstance(min_rows, str) or int(min_rows) < 2):
        raise ValueError(f"min_rows={min_rows!r}: must be 'auto' or an int >= 2 (one-row products keep F.linear's kernel)")
    if not available():
        log.info("this torch build has no oneDNN linear-weight reorder: verification weights are not prepacked")
        return []
    packable = tuple(d for d in dtypes if can_pack(d))
    packed = []
    for name, mod in model.named_modules():
        if not isinstance(mod, LINEAR_TYPES):
            continue
        w = mod.weight
        if w.dtype not in packable or w.device.type != "cpu" or is_one_row_padded(mod):
            continue
        _install(mod, probe_min_rows(w, mod.bias) if probe else int(min_rows), packable)
        packed.append(name)
    if packed:
        log.info("%d linear layer(s) compute inputs of >= %s rows with oneDNN-prepacked weights "
                 "(decoding.prepacked)", len(packed), prepacked_min_rows(model))
    return packed


def _median_seconds(fn, repeats: int) -> float:
    fn()
    fn()  # warm: the first call of a shape allocates
    times = []
    for _ in range(int(repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_PROBED: dict[tuple, int] = {}


def probe_min_rows(weight: torch.Tensor, bias: torch.Tensor | None = None, repeats: int = 7,
                   margin: float = PROBE_MARGIN) -> int:
    """From how many rows oneDNN's packed product of ``weight`` beats ``F.linear``'s on this CPU.

    Times both products (median of ``repeats`` calls each, on random inputs) over 2 rows and, when the
    packed one wins there by ``margin``, over 1 row, at the current thread count.  The answer is cached
    per weight shape, bias and dtype for the process, so that every evaluation and reference of one run
    packs alike (its cost-model key, :func:`prepacked_min_rows`, stays one).

    Args:
        weight: [N, K] on the CPU; bias: [N] or None.

    Returns:
        1 when the packed product wins over 1 and 2 rows, 2 when over 2 rows only, else :data:`MIN_ROWS`
        (from 3 rows ``F.linear`` reorders the whole weight at every call: packed always wins).
    """
    key = (tuple(weight.shape), bias is not None, weight.dtype)
    if key in _PROBED:
        return _PROBED[key]
    gen = torch.Generator().manual_seed(0)
    rows = MIN_ROWS
    with torch.no_grad():
        w = weight.detach()
        packed = _reorder(w)
        for m in (2, 1):
            x = torch.randn(m, w.shape[1], generator=gen).to(w.dtype)
            plain = _median_seconds(lambda: F.linear(x, w, bias), repeats)
            fast = _median_seconds(lambda: _packed_linear(x, packed, bias), repeats)
            if plain < margin * fast:
                break
            rows = m
    _PROBED[key] = rows
    return rows


def _install(mod: torch.nn.Linear, min_rows: int, dtypes: tuple, chunk_rows: int | None = None) -> None:
    """Give ``mod`` the packed ``forward`` for inputs of >= ``min_rows`` rows of ``dtypes`` (computed in
    chunks of at most ``chunk_rows`` rows when set), packed now."""
    state = getattr(mod, _PACKED, None)
    if state is None or state.min_rows != min_rows or state.dtypes != dtypes or state.chunk_rows != chunk_rows:
        state = _PackState(None, min_rows, None, dtypes, chunk_rows)
        setattr(mod, _PACKED, state)
        mod.forward = types.MethodType(_prepacked_forward, mod)
    if state.stamp != _weight_stamp(mod.weight):
        state.repack(mod.weight)


#: the largest product (rows) probed for row consistency: the largest verification tree of eval.tree_grid
MAX_CONSISTENT_ROWS = 64


def consistent_rows(weight: torch.Tensor, bias: torch.Tensor | None = None, max_rows: int = MAX_CONSISTENT_ROWS,
                    seed: int = 0) -> int:
    """The largest R <= ``max_rows`` such that oneDNN's packed product over any M <= R rows equals,
    row for row and bit for bit, the packed products over one row each.

    On the AMX CPU of issue 27 it is 32 for every SmolLM2 shape: from 33 rows oneDNN takes another
    blocking.  A product over more than R rows is therefore computed as chunks of at most R rows
    (:func:`_prepacked_forward`), which keeps every row equal to its one-row product.

    Args:
        weight: [N, K] on the CPU, in the dtype to probe; bias: [N] or None.
        max_rows: the most rows probed.
        seed: of the random probe inputs (standard normal, cast to ``weight.dtype``; the kernel's
            summation order depends on the shapes only).

    Returns:
        R, or 1 when already two rows differ or the packed product cannot run (a RuntimeError).
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(int(max_rows), weight.shape[1], generator=gen).to(weight.dtype)
    try:
        with torch.no_grad():
            packed = _reorder(weight.detach())
            one = torch.cat([_packed_linear(x[i:i + 1].contiguous(), packed, bias) for i in range(int(max_rows))])
            for m in range(2, int(max_rows) + 1):
                if not torch.equal(_packed_linear(x[:m].contiguous(), packed, bias), one[:m]):
                    return m - 1
    except RuntimeError as exc:
        log.info("oneDNN's packed %s product over %s failed (%s)", weight.dtype, tuple(weight.shape),
                 str(exc).splitlines()[0])
        return 1
    return int(max_rows)


def prepack_row_consistent(model: torch.nn.Module, dtypes=ROW_CONSISTENT_DTYPES,
                           max_rows: int = MAX_CONSISTENT_ROWS) -> list[str]:
    """Pack ``model``'s bf16 / fp16 CPU linear weights for **every** product, one-token steps included,
    computed so that each row equals its one-row product (module docstring, "bf16 for every row count").

    Each distinct (weight shape, bias, dtype) is probed once with that layer's weights
    (:func:`consistent_rows`, up to ``max_rows``); a layer whose products agree up to R >= 2 rows gets
    the packed ``forward`` with ``min_rows = 1`` and chunks of at most R rows, and the
    :data:`decoding.numerics.ROW_CONSISTENT` mark, so :func:`decoding.numerics.pad_one_row_products`
    (called after) leaves it alone.  Layers already padded by it, of another dtype, off the CPU, or of
    a dtype this CPU cannot pack (:func:`can_pack`) are skipped.

    Returns:
        The packed layers' names (empty without oneDNN).  Idempotent; :func:`restore_linear_weights`
        undoes it.
    """
    if not available():
        return []
    verdict: dict[tuple, int] = {}
    packed = []
    for name, mod in model.named_modules():
        if not isinstance(mod, LINEAR_TYPES):
            continue
        w = mod.weight
        if w.dtype not in dtypes or w.device.type != "cpu" or is_one_row_padded(mod) or not can_pack(w.dtype):
            continue
        key = (tuple(w.shape), mod.bias is not None, w.dtype)
        if key not in verdict:
            verdict[key] = consistent_rows(w, mod.bias, max_rows)
        if verdict[key] < 2:
            continue
        _install(mod, 1, (w.dtype,), chunk_rows=verdict[key])
        setattr(mod, ROW_CONSISTENT, True)
        packed.append(name)
    refused = sorted({f"{k[0][1]}->{k[0][0]}" for k, r in verdict.items() if r < 2})
    chunks = sorted({r for r in verdict.values() if r >= 2})
    if packed:
        log.info("%d %s linear layer(s) compute every product with oneDNN-prepacked weights, in chunks of <= %s rows "
                 "(row-consistent: decoding.prepacked)%s", len(packed), str(_model_dtype(model)).replace("torch.", ""),
                 "/".join(map(str, chunks)), f"; not packed, rows differ: {', '.join(refused)}" if refused else "")
    elif refused:
        log.info("oneDNN's packed products are not row-consistent for linear layers %s (in-out): not packed",
                 ", ".join(refused))
    return packed


def _model_dtype(model: torch.nn.Module):
    """The dtype of ``model``'s first parameter (None without parameters)."""
    return next((p.dtype for p in model.parameters()), None)


def restore_linear_weights(model: torch.nn.Module) -> None:
    """Undo :func:`prepack_linear_weights` and :func:`prepack_row_consistent` on ``model`` (drops the
    packed copies)."""
    for mod in model.modules():
        if getattr(mod, _PACKED, None) is not None:
            del mod.forward
            delattr(mod, _PACKED)
            if getattr(mod, ROW_CONSISTENT, False):
                delattr(mod, ROW_CONSISTENT)


@contextlib.contextmanager
def plain_products(model: torch.nn.Module):
    """Inside the block every linear product of ``model`` runs ``F.linear`` on its original weights, as if
    nothing were packed; the packed weights stay for after it.  One copy of a base can then be both a
    packed vanilla reference (timed) and the plain fp32 base whose logits judge a bf16 divergence
    (:class:`evaluation.divergence.Accountant`), instead of two copies in memory."""
    states = [getattr(m, _PACKED) for m in model.modules() if getattr(m, _PACKED, None) is not None]
    saved = [s.min_rows for s in states]
    for s in states:
        s.min_rows = float("inf")
    try:
        yield model
    finally:
        for s, rows in zip(states, saved):
            s.min_rows = rows


def prepacked_min_rows(model: torch.nn.Module) -> int | str | None:
    """The ``min_rows`` of ``model``'s prepacked layers (a cost-model key): an int when they all share one,
    ``"<rows>x<layers>,..."`` (e.g. ``"1x1,2x210"``) when :func:`probe_min_rows` gave them several, None when
    none is packed."""
    rows = [int(getattr(m, _PACKED).min_rows) for m in model.modules() if getattr(m, _PACKED, None) is not None]
    if not rows:
        return None
    if len(set(rows)) == 1:
        return rows[0]
    return ",".join(f"{r}x{rows.count(r)}" for r in sorted(set(rows)))


def packed_layers(model: torch.nn.Module) -> int:
    """How many of ``model``'s layers are packed (:func:`prepack_linear_weights`, :func:`prepack_row_consistent`)."""
    return sum(1 for m in model.modules() if getattr(m, _PACKED, None) is not None)


def prepacked_chunks(model: torch.nn.Module) -> tuple[int, int] | None:
    """``(layers, rows)`` of ``model``'s layers packed for every row count in chunks of at most ``rows``
    (:func:`prepack_row_consistent`; the smallest chunk when they differ), or None when there are none
    (a cost-model key)."""
    rows = [getattr(m, _PACKED).chunk_rows for m in model.modules()
            if getattr(m, _PACKED, None) is not None and getattr(m, _PACKED).chunk_rows]
    return (len(rows), min(rows)) if rows else None


def prepack_mode(value) -> str | None:
    """A ``prepack_weights`` setting (``eval.prepack_weights``, ``prep.prepack_weights``) as ``"auto"``,
    ``"true"`` or ``"false"`` (YAML booleans and None included: ``true`` typed on a command line arrives as
    True); None when it is none of them."""
    mode = {True: "true", False: "false", None: "false"}.get(value, str(value).lower())
    return mode if mode in ("auto", "true", "false") else None


def pack_for_decoding(model: torch.nn.Module, mode: str, key: str = "eval.prepack_weights") -> list[str]:
    """Pack ``model``'s linear weights for decoding as ``mode`` (:func:`prepack_mode`) says, in place.

    * an fp32 base on a CPU: products of >= 3 rows (verification, prefill) use the packed weights, and
      those of 1 or 2 rows where this CPU runs the packed product faster, timed per weight shape
      (:func:`prepack_linear_weights` with ``min_rows="auto"``);
    * a bf16 / fp16 base on a CPU: every product of a layer whose packed products are row-consistent
      uses them, one-token steps included (:func:`prepack_row_consistent`).  ``auto`` does this where
      bf16 is native and the packed products were measured the fastest bf16 kernels (AMX, and AMD's
      ``avx512_bf16``: :func:`core.precision.packed_bf16_is_fastest`); ``true`` on any CPU whose oneDNN
      packs the dtype.

    ``true`` requires packing to apply; ``false`` packs nothing.

    Returns:
        The packed layers' names ([] when off or not applicable).

    Raises:
        ValueError: ``mode`` is true where packing cannot apply (the message names ``key``).
    """
    from core.precision import bf16_support, packed_bf16_is_fastest

    if mode == "false":
        return []
    device = next(model.parameters()).device
    name = str(model.dtype).replace("torch.", "")
    packs = device.type == "cpu" and model.dtype in PACK_DTYPES + ROW_CONSISTENT_DTYPES and can_pack(model.dtype)
    if packs and model.dtype in ROW_CONSISTENT_DTYPES and mode == "auto":
        if not (bf16_support(device).native and packed_bf16_is_fastest()):
            return []
    if not packs:
        if mode == "true":
            raise ValueError(f"{key}=true needs a CPU base whose oneDNN packs its dtype; this base is {name} on {device} "
                             f"(oneDNN: {available()}, packs {name}: {can_pack(model.dtype)})")
        return []
    if model.dtype in ROW_CONSISTENT_DTYPES:
        names = prepack_row_consistent(model)
        if mode == "true" and not names:
            raise ValueError(f"{key}=true: oneDNN's packed {name} products are not row-consistent on this CPU for "
                             "any linear layer (decoding.prepacked)")
        return names
    return prepack_linear_weights(model, min_rows="auto")
