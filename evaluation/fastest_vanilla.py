"""The fastest vanilla on this machine: the speed headline's reference (issue 26).

An evaluation in one dtype times vanilla greedy decoding in that dtype, so its ``speedup`` says
how much faster the method is than vanilla *in the same precision*.  A user compares with the
fastest vanilla their machine has: on a CPU without native bf16, fp32 vanilla is faster than
bf16 vanilla, and a bf16 method that beats bf16 vanilla may still lose to it.  ``eval.fastest_vanilla``
therefore also times vanilla greedy decoding in the other precisions worth trying, on the same
prompts, interleaved with the evaluation's own vanilla and methods (each prompt's round: vanilla,
these references, then the methods), and the report gives the method against the fastest of them
(``fastest_vanilla``) and says which it was.

``eval.fastest_vanilla``:

* ``auto`` (default): a bf16 / fp16 evaluation also times **fp32** vanilla, and, when the
  row-consistent one-token steps are on (:mod:`decoding.numerics`: they cost a little), the eval
  dtype's vanilla **with its native one-row kernels**; an fp32 evaluation also times **bf16**
  vanilla where bf16 is native on the device (:func:`core.precision.bf16_support`), none else
  (where bf16 is slow or emulated it cannot be the faster one).  When the evaluation's base runs
  an attention other than ``sdpa`` (``eager``: the tree masks of verification need it), every one
  of these dtypes is also timed **with sdpa attention**, which vanilla decoding can use (0-5 %
  faster for a one-token step on 2 CPU threads, docs/precision.md).
* ``off``: only the evaluation's own vanilla (``fastest_vanilla`` names it).
* a list of dtypes, e.g. ``[float32, bfloat16]``: those (the eval dtype's own is always there); an
  entry ``<dtype>:<attention>`` (``float32:sdpa``, ``bfloat16:eager``) names the attention too.

Only greedy evaluations have references (sampling compares distributions, not speed headlines).
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Sequence

from omegaconf import ListConfig

from core.config import DTYPES
from decoding.vanilla import greedy_generate

log = logging.getLogger(__name__)

NATIVE_ONE_ROW = "native one-row kernels"
ATTENTIONS = ("eager", "sdpa")


def attention_label(dtype: str, attention: str) -> str:
    """The reference label of vanilla in ``dtype`` with ``attention`` (``"float32 (sdpa attention)"``)."""
    return f"{dtype} ({attention} attention)"


def parse_label(label: str) -> tuple[str, str | None, bool]:
    """``(dtype, attention or None for the evaluation's own, native one-row kernels?)`` of a label."""
    dtype, _, rest = label.partition(" (")
    rest = rest.rstrip(")")
    if rest == NATIVE_ONE_ROW:
        return dtype, None, True
    return dtype, (rest.removesuffix(" attention") or None), False


def model_attention(model) -> str | None:
    """The attention implementation a transformers model runs (``eager``, ``sdpa``, ...), or None."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) or getattr(config, "attn_implementation", None)


def check_entries(value) -> list[str]:
    """The entries of a list-valued ``eval.fastest_vanilla`` that are neither a dtype nor
    ``<dtype>:<attention>`` (empty when all are good)."""
    bad = []
    for v in value:
        dtype, _, attention = str(v).partition(":")
        if dtype not in DTYPES or (attention and attention not in ATTENTIONS):
            bad.append(str(v))
    return bad


def reference_labels(ev, model, device, row_padded: Sequence[str]) -> list[str]:
    """The labels of the extra vanilla references ``eval.fastest_vanilla`` asks for (module docstring):
    a dtype name (``float32``, ``bfloat16``), ``"<dtype> (<attention> attention)"`` or
    ``"<eval dtype> (native one-row kernels)"``.

    Raises:
        ValueError: ``eval.fastest_vanilla`` is not ``auto``, ``off`` or a list of dtype names
            (each optionally ``:eager`` / ``:sdpa``).
    """
    from core.precision import bf16_support

    dtype = str(model.dtype).replace("torch.", "")
    own_attention = model_attention(model)
    value = ev.get("fastest_vanilla", "auto")
    if float(ev.get("temperature") or 0.0) > 0 or value in ("off", None, False):
        return []
    if value == "auto":
        if dtype != "float32":
            dtypes = ["float32"]
            wanted = ["float32"] + ([f"{dtype} ({NATIVE_ONE_ROW})"] if row_padded else [])
        else:
            dtypes = ["bfloat16"] if bf16_support(device).level == "native" else []
            wanted = list(dtypes)
        if own_attention not in (None, "sdpa"):
            wanted += [attention_label(d, "sdpa") for d in [dtype, *dtypes]]
    elif isinstance(value, (list, tuple, ListConfig)):
        bad = check_entries(value)
        if bad:
            raise ValueError(f"eval.fastest_vanilla={list(value)}: {bad} not dtypes (float32, bfloat16, float16), "
                             "optionally with :eager or :sdpa")
        wanted = []
        for v in map(str, value):
            d, _, attention = v.partition(":")
            if attention and attention != own_attention:
                wanted.append(attention_label(d, attention))
            elif d != dtype:
                wanted.append(d)
        if row_padded and dtype in [str(v) for v in value]:
            wanted.append(f"{dtype} ({NATIVE_ONE_ROW})")
    else:
        raise ValueError(f"eval.fastest_vanilla={value!r}: use auto, off or a list of dtypes")
    return list(dict.fromkeys(wanted))


def build_references(labels: Sequence[str], model, load: Callable[[str], Any], eos_ids) -> dict[str, Callable]:
    """``{label: generate(ids, max_new) -> (tokens, stats)}`` vanilla greedy decoders, one per label.

    Args:
        labels: from :func:`reference_labels`.
        model: the evaluation's base (its copy with native one-row kernels is made by deep copy).
        load: returns the base in a dtype, optionally with an attention implementation
            (``load("float32")``, ``load("float32", "sdpa")``): loaded once per pair.
    """
    from decoding.numerics import restore_one_row_products

    refs = {}
    for label in labels:
        dtype, attention, native = parse_label(label)
        if native:
            m = copy.deepcopy(model)
            restore_one_row_products(m)
        else:
            m = load(dtype, attention) if attention else load(dtype)
        refs[label] = (lambda mm: (lambda ids, n: greedy_generate(mm, ids, n, eos_ids)))(m)
    if refs:
        log.info("speed headline against the fastest vanilla of: %s (eval.fastest_vanilla)",
                 ", ".join([str(model.dtype).replace("torch.", "")] + list(refs)))
    return refs


def fastest(own_label: str, own: dict[str, Any], refs: dict[str, dict[str, float]], method_tps: float | None,
            prompts: int) -> dict[str, Any]:
    """The report's ``fastest_vanilla``.

    Args:
        own_label: the evaluation's dtype; own: its vanilla (``tokens``, ``seconds``, ``tokens_per_s``).
        refs: ``{label: {"tokens", "seconds", "prompts"}}`` summed over the prompt turns they ran on.
        method_tps: the method's tokens/s.
        prompts: the prompt turns the evaluation's own vanilla and the method ran on.

    Returns:
        ``{"label": the fastest vanilla, "tokens_per_s", "speedup": method ÷ it (None without a
        rate), "candidates": {label: tokens/s}, "same_run": true, "prompts"}``.  A reference that did
        not run on every prompt turn (a run resumed from records made without it) is listed with
        None: it is not timed on the same prompts, so it is not compared.
    """
    cand = {own_label: own.get("tokens_per_s")}
    for label, r in refs.items():
        cand[label] = (r["tokens"] / r["seconds"]) if r.get("seconds") and r.get("prompts", prompts) == prompts else None
    rated = {k: v for k, v in cand.items() if v}
    best = max(rated, key=rated.get) if rated else own_label
    tps = rated.get(best)
    return {"label": best, "tokens_per_s": tps, "speedup": (method_tps / tps) if method_tps and tps else None,
            "candidates": cand, "same_run": True, "prompts": prompts}
