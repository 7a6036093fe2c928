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
  an attention other than ``sdpa`` (``eager``: the tree masks of verification need it), the eval
  dtype and each of these dtypes are also timed **with sdpa attention**, which vanilla decoding can
  use.  On this project's CPU sdpa's one-token step is 5 % faster than eager's in fp32 and 19 % in
  bf16 on 2 threads, and 4 % slower in fp32 on 1 thread (docs/precision.md).
* ``off``: only the evaluation's own vanilla (``fastest_vanilla`` names it).
* a list of dtypes, e.g. ``[float32, bfloat16]``: those (the eval dtype's own is always there); an
  entry ``<dtype>:<attention>`` (``float32:sdpa``, ``bfloat16:eager``) names the attention too.

A reference runs on the weights of its dtype's vanilla, with no copy: the evaluation's own base for
its dtype (so a bf16 ``(sdpa attention)`` reference keeps the row-consistent kernels of bf16
vanilla; ``(native one-row kernels)`` is the one without them), one loaded copy per other dtype.  An
attention is switched for the duration of each reference call (``set_attn_implementation``: the
attention layers read it at every forward) and restored after it.

Only greedy evaluations have references (sampling compares distributions, not speed headlines).
"""
from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from omegaconf import ListConfig

from decoding.vanilla import greedy_generate
from evaluation.config_checks import check_fastest_vanilla_entries

log = logging.getLogger(__name__)

NATIVE_ONE_ROW = "native one-row kernels"


def attention_label(dtype: str, attention: str) -> str:
    """The reference label of vanilla in ``dtype`` with ``attention`` (``"float32 (sdpa attention)"``)."""
    return f"{dtype} ({attention} attention)"


def parse_label(label: str) -> tuple[str, str | None, bool]:
    """``(dtype, attention or None for the base's own, native one-row kernels?)`` of a reference label."""
    dtype, _, rest = label.partition(" (")
    rest = rest.rstrip(")")
    if rest == NATIVE_ONE_ROW:
        return dtype, None, True
    return dtype, (rest.removesuffix(" attention") or None), False


def model_attention(model) -> str | None:
    """The attention implementation a transformers model runs (``eager``, ``sdpa``, ...), or None."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


@contextmanager
def attention_as(model, attention: str | None) -> Iterator[None]:
    """Run ``model`` with ``attention`` inside the block, restoring its own on exit (also on error);
    nothing changes when ``attention`` is None or already the model's."""
    own = model_attention(model)
    if attention is None or attention == own:
        yield
        return
    model.set_attn_implementation(attention)
    try:
        yield
    finally:
        model.set_attn_implementation(own)


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
    native = [f"{dtype} ({NATIVE_ONE_ROW})"] if row_padded else []
    if value == "auto":
        if dtype != "float32":
            others = ["float32"]
        else:
            others = ["bfloat16"] if bf16_support(device).level == "native" else []
        wanted = others + (native if dtype != "float32" else [])
        if own_attention not in (None, "sdpa"):
            wanted += [attention_label(d, "sdpa") for d in [dtype, *others]]
    elif isinstance(value, (list, tuple, ListConfig)):
        bad = check_fastest_vanilla_entries(value)
        if bad:
            raise ValueError(f"eval.fastest_vanilla={list(value)}: {bad} not dtypes (float32, bfloat16, float16), "
                             "optionally with :eager or :sdpa")
        wanted = []
        for entry in map(str, value):
            d, _, attention = entry.partition(":")
            if attention and attention != own_attention:
                wanted.append(attention_label(d, attention))
            elif d != dtype:
                wanted.append(d)
            else:  # the evaluation's own vanilla: always timed; its native kernels are another vanilla
                wanted += native
    else:
        raise ValueError(f"eval.fastest_vanilla={value!r}: use auto, off or a list of dtypes")
    return list(dict.fromkeys(wanted))


def packed_loader(load: Callable[[str], Any], ev) -> Callable[[str], Any]:
    """``load`` (the base in a dtype) made to return each reference base packed as the evaluation packs
    its own (:func:`evaluation.methods.prepacked_products`), once per dtype.

    A vanilla reference in another dtype than the evaluation's (bf16 vanilla beside an fp32 evaluation,
    fp32 beside a bf16 one) is then as fast as this machine makes that dtype: on an AMD with
    ``avx512_bf16`` packed bf16 vanilla is 10-15 % faster than unpacked (docs/precision.md "On an AMD
    EPYC (Zen 4)"), and an unpacked one would not be the fastest vanilla.  ``eval.prepack_weights=false``
    leaves the references unpacked too; ``true`` packs them where ``auto`` would (a reference dtype
    that cannot be packed is timed as it is, not refused).
    """
    from decoding.prepacked import pack_for_decoding, prepack_mode

    mode = "false" if prepack_mode(ev.get("prepack_weights", "auto")) == "false" else "auto"
    cache: dict[str, Any] = {}

    def packed(dtype: str):
        if dtype not in cache:
            cache[dtype] = load(dtype)
            pack_for_decoding(cache[dtype], mode)
        return cache[dtype]

    return packed


def build_references(labels: Sequence[str], model, load: Callable[[str], Any], eos_ids) -> dict[str, Callable]:
    """``{label: generate(ids, max_new) -> (tokens, stats)}`` vanilla greedy decoders, one per label.

    Args:
        labels: from :func:`reference_labels`.
        model: the evaluation's base: the weights of its dtype's references (its copy with native
            one-row kernels is made by deep copy).
        load: returns the base in another dtype (``load("float32")``): called once per dtype.
    """
    from decoding.numerics import restore_one_row_products

    own_dtype = str(model.dtype).replace("torch.", "")
    loaded: dict[str, Any] = {}

    def weights(dtype: str):
        if dtype == own_dtype:
            return model
        if dtype not in loaded:
            loaded[dtype] = load(dtype)
        return loaded[dtype]

    def decoder(m, attention):
        def generate(ids, n):
            with attention_as(m, attention):
                return greedy_generate(m, ids, n, eos_ids)
        return generate

    refs = {}
    for label in labels:
        dtype, attention, native = parse_label(label)
        if native:
            m = copy.deepcopy(model)
            restore_one_row_products(m)
        else:
            m = weights(dtype)
        refs[label] = decoder(m, attention)
    if refs:
        log.info("speed headline against the fastest vanilla of: %s (eval.fastest_vanilla)",
                 ", ".join([own_dtype] + list(refs)))
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
