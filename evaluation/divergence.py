"""Parity accounting for low-precision evaluation (issue 26): every divergence explained or failed.

In fp32 the evaluation's proof is exact parity: the method's tokens equal vanilla greedy decoding's
(:mod:`evaluation.runner`; unchanged).  In bf16 (``eval.dtype=bfloat16``; fp16 alike) two
computations of the same logits may round differently (a verification forward over n tokens and
a one-token step need not sum in the same order, :mod:`decoding.numerics`), so a speculative
decoder can leave bf16 vanilla decoding where the top two logits are within rounding of each
other.  Such a prompt is compared up to its **first divergence** and accounted for there:

* ``position`` d (0-based among the generated tokens), the vanilla token a and the method's token b;
* vanilla's top-2 logits at that step (its one-token step, recomputed exactly by
  :func:`decoding.vanilla.replay_step_logits`; its argmax must be a);
* the method's top-2 logits at that step: the verification forward's row that chose b (recorded
  by decoders with ``trace_logits``, :mod:`decoding.margins`; its argmax must be b);
* the fp32 logits z32 for the same prefix (prompt + the d shared tokens): one forward of an fp32
  copy of the base, loaded only when a divergence happens.

**Rule** (:data:`NEAR_TIE_ULPS` = c).  With Δ32 = z32[a] − z32[b] and u = ulp_dtype(max_v |z32_v|)
(the spacing of the eval dtype's numbers at the largest logit: 2^⌊log2 max|z32|⌋ · eps, eps = 2^-7
for bf16), the divergence is a **numerical near-tie** when

1. vanilla's replayed step reproduces a (else the run was not deterministic),
2. the method emitted the argmax of its own row (else the decoder accepted a token its
   verification did not choose: a bug, whatever the margins say), and
3. |Δ32| <= c · u: in exact arithmetic a and b are within c units of bf16 rounding of the logits.

Anything else is a **real error**, which fails the evaluation like an fp32 parity mismatch (exit 1).
Why condition 3 with c = 8: a bf16 run can prefer b where fp32 prefers a only if its error on the
difference z[a] − z[b] exceeds |Δ32|, so the bound must cover that error.
``benchmarks/bench_precision_eval.py bound`` measures it, |(z16[a] − z16[b]) − (z32[a] − z32[b])| / u
for fp32's top two tokens, teacher-forced over 24 held-out ShareGPT prompts + 64-token bf16 greedy
continuations (3 951 positions, SmolLM2-135M, every layer's bf16 rounding accumulated): median
0.42 u, 99th percentile 2.2 u, 99.9th 3.3 u, maximum 3.6 u; the 73 positions where bf16's argmax
differed from fp32's had fp32 gaps of at most 2.2 u (docs/precision_eval.md).  c = 8 is twice the
largest error seen; a wrong token's fp32 gap is typically tens to hundreds of u.

**After the first divergence nothing is compared**: the two runs then continue from different
prefixes, so their later tokens legitimately differ.  The report gives the divergence rate over
prompts and the share of vanilla's tokens emitted before the first divergence (all of a prompt's
tokens when it did not diverge).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Sequence

import torch

from decoding.margins import top2
from decoding.vanilla import replay_step_logits

log = logging.getLogger(__name__)

#: c of the near-tie rule |Δ32| <= c · ulp_dtype(max |z32|) (module docstring)
NEAR_TIE_ULPS = 8

RULE = ("near tie: vanilla's replayed step reproduces its token, the method emitted its own row's argmax, and "
        "|z32[vanilla token] - z32[method token]| <= {c} ulp_{dtype}(max |z32|) for the fp32 logits z32 at the "
        "shared prefix; any other divergence is a real error (a failure)")
AFTER_DIVERGENCE = "nothing: after the first divergence the runs continue from different prefixes"


def ulp(x: float, dtype: torch.dtype) -> float:
    """Spacing of ``dtype``'s numbers at magnitude |x|: 2^⌊log2 |x|⌋ · eps(dtype) (bf16: eps = 2^-7);
    the smallest normal's spacing for x = 0."""
    fi = torch.finfo(dtype)
    x = abs(float(x))
    if x < fi.tiny:
        return float(fi.tiny) * float(fi.eps)
    return 2.0 ** math.floor(math.log2(x)) * float(fi.eps)


def _pair(row: Sequence | None) -> dict[str, Any] | None:
    if row is None:
        return None
    i1, v1, i2, v2 = row
    return {"ids": [int(i1), int(i2)], "logits": [float(v1), float(v2)], "margin": float(v1) - float(v2)}


def first_divergence(ref: Sequence[int], out: Sequence[int]) -> int | None:
    """The first index where ``out`` differs from ``ref`` (or where one ends and the other goes on); None if equal."""
    if list(ref) == list(out):
        return None
    return next((j for j, (x, y) in enumerate(zip(ref, out)) if x != y), min(len(ref), len(out)))


def classify(vanilla_token: int | None, method_token: int | None, vanilla_row: Sequence | None,
             method_row: Sequence | None, z32: torch.Tensor | None, dtype: torch.dtype,
             tie_ulps: float = NEAR_TIE_ULPS) -> dict[str, Any]:
    """Apply the near-tie rule (module docstring) to one first divergence.

    Args:
        vanilla_token / method_token: the two tokens at the divergence (None: that output ended there).
        vanilla_row / method_row: :func:`decoding.margins.top2` rows of the two runs at that step
            (``method_row`` None when the decoder does not record its rows, or for the prefill's token).
        z32: fp32 logits [V] for the shared prefix (None when an output ended there).
        dtype: the evaluation's dtype (whose ulp the bound uses).

    Returns:
        ``{"class": "near_tie" | "real_error", "reason", "vanilla_top2", "method_top2",
        "fp32": {"top2", "delta", "max_abs_logit"} | None, "ulp", "bound"}``.
    """
    out: dict[str, Any] = {"vanilla_top2": _pair(vanilla_row), "method_top2": _pair(method_row), "fp32": None,
                           "ulp": None, "bound": None}
    if vanilla_token is None or method_token is None:
        which = "the method's" if method_token is None else "vanilla's"
        return out | {"class": "real_error", "reason": f"{which} output ends where the other goes on "
                                                       "(a stop rule differs: not a rounding effect)"}
    z = z32.detach().float().reshape(-1)
    big = float(z.abs().max())
    u = ulp(big, dtype)
    delta = float(z[int(vanilla_token)] - z[int(method_token)])
    out.update(fp32={"top2": _pair(top2(z)[0]), "delta": delta, "max_abs_logit": big}, ulp=u, bound=tie_ulps * u)
    if vanilla_row is not None and int(vanilla_row[0]) != int(vanilla_token):
        return out | {"class": "real_error", "reason": f"vanilla's replayed step chooses {int(vanilla_row[0])}, not "
                                                       f"its token {int(vanilla_token)}: the run was not deterministic"}
    if method_row is not None and int(method_row[0]) != int(method_token):
        return out | {"class": "real_error", "reason": f"the method emitted {int(method_token)} but its own row's "
                                                       f"argmax is {int(method_row[0])}: it accepted a token its "
                                                       "verification did not choose"}
    if abs(delta) <= tie_ulps * u:
        return out | {"class": "near_tie", "reason": f"|z32 difference| {abs(delta):.4g} <= {tie_ulps:g} ulp "
                                                     f"= {tie_ulps * u:.4g}"}
    return out | {"class": "real_error", "reason": f"|z32 difference| {abs(delta):.4g} > {tie_ulps:g} ulp = "
                                                   f"{tie_ulps * u:.4g}: fp32 clearly prefers "
                                                   f"{int(vanilla_token) if delta > 0 else int(method_token)}"}


class Accountant:
    """Accounts for a low-precision run's divergences prompt by prompt (module docstring).

    Args:
        model: the evaluation's base (bf16 / fp16).
        load_fp32: returns an fp32 copy of the base on the same device (packed or not); called once,
            at the first divergence.
        tokenizer: optional, to print the two tokens.
        tie_ulps: c of the rule.
    """

    def __init__(self, model, load_fp32: Callable[[], Any], tokenizer=None, tie_ulps: float = NEAR_TIE_ULPS) -> None:
        self.model, self.load_fp32, self.tokenizer, self.tie_ulps = model, load_fp32, tokenizer, float(tie_ulps)
        self.dtype = model.dtype
        self._fp32 = None

    @classmethod
    def for_run(cls, cfg, model, tokenizer, decoders, load: Callable[[], Any]) -> "Accountant | None":
        """The accountant of a greedy evaluation whose base is not fp32 (None otherwise: fp32 parity
        is exact).  Turns on ``trace_logits`` of every decoder that has it; ``load`` returns the
        base's fp32 copy, called at the first divergence (the evaluation shares it with its fp32
        vanilla reference: :func:`fp32_logits` computes with its plain products)."""
        if model.dtype == torch.float32 or float(cfg.eval.get("temperature") or 0.0) > 0:
            return None
        for d in decoders:
            if hasattr(d, "trace_logits"):
                d.trace_logits = True
        return cls(model, load, tokenizer)

    def fp32_logits(self, prefix: torch.Tensor) -> torch.Tensor:
        """fp32 logits [V] after ``prefix`` [T'] (one forward of the fp32 copy)."""
        if self._fp32 is None:
            log.info("a divergence from %s vanilla decoding: the base's fp32 copy judges its margin",
                     str(self.dtype).replace("torch.", ""))
            self._fp32 = self.load_fp32()
        from decoding.prepacked import plain_products
        from decoding.verify import base_forward, new_cache

        with plain_products(self._fp32):  # the copy may be the packed fp32 vanilla reference's
            logits, _ = base_forward(self._fp32, prefix, new_cache(self._fp32), logits_to_keep=1)
        return logits[-1]

    def _text(self, tok: int | None) -> str | None:
        if tok is None or self.tokenizer is None:
            return None
        return self.tokenizer.decode([int(tok)])

    @torch.no_grad()
    def account(self, prompt_ids: torch.Tensor, ref: Sequence[int], out: Sequence[int],
                trace: Sequence | None) -> dict[str, Any] | None:
        """The first divergence of ``out`` from ``ref`` on one prompt, classified; None when equal.

        Args:
            prompt_ids: LongTensor [T]; ref: vanilla's tokens; out: the method's tokens.
            trace: the method's ``last_trace`` (:mod:`decoding.margins`), or None.

        Returns:
            ``{"position", "vanilla_token", "method_token", "vanilla_text", "method_text",
            "tokens_before", **classify(...)}``.
        """
        d = first_divergence(ref, out)
        if d is None:
            return None
        a = int(ref[d]) if d < len(ref) else None
        b = int(out[d]) if d < len(out) else None
        v_row = top2(replay_step_logits(self.model, prompt_ids, ref, d))[0] if a is not None else None
        m_row = trace[d] if trace is not None and d < len(trace) else None
        z32 = None
        if a is not None and b is not None:
            prefix = torch.cat([prompt_ids.reshape(-1).cpu(), torch.tensor(list(ref[:d]), dtype=torch.long)])
            z32 = self.fp32_logits(prefix)
        res = classify(a, b, v_row, m_row, z32, self.dtype, self.tie_ulps)
        return {"position": d, "vanilla_token": a, "method_token": b, "vanilla_text": self._text(a),
                "method_text": self._text(b), "tokens_before": d, **res}

    def annotate(self, rec: dict[str, Any], prompt_ids: torch.Tensor, decoders) -> None:
        """Add ``divergence`` (:meth:`account`, None when the outputs match) to every method slot of a
        progress record (:func:`evaluation.runner._decode_prompt`), from the decoders' last traces."""
        ref = rec["vanilla"]["tokens"]
        for slot, dec in zip(rec["methods"], decoders):
            slot["divergence"] = self.account(prompt_ids, ref, slot["tokens"], getattr(dec, "last_trace", None))
            if slot["divergence"]:
                div = slot["divergence"]
                log.info("%s at token %d: vanilla %r, method %r (fp32 difference %s, bound %s): %s", rec["id"],
                         div["position"], div["vanilla_text"] or div["vanilla_token"],
                         div["method_text"] or div["method_token"],
                         f"{div['fp32']['delta']:.4g}" if div["fp32"] else "-",
                         f"{div['bound']:.4g}" if div["bound"] else "-", div["class"].replace("_", " "))


def accounting(rows: Sequence[dict[str, Any]], dtype: str, tie_ulps: float = NEAR_TIE_ULPS) -> dict[str, Any]:
    """The report's ``parity.accounting`` over one method's per-prompt rows (each with ``divergence``).

    Returns:
        ``{"dtype", "rule", "tie_ulps", "compared_after_divergence", "prompts", "diverged",
        "divergence_rate", "near_ties", "real_errors", "near_tie_ids", "error_ids",
        "tokens_before_first_divergence", "vanilla_tokens", "share_before_first_divergence",
        "divergences": [{"id", **divergence}]}``.
    """
    divs = [(r["id"], r.get("divergence")) for r in rows if r.get("match") is False]
    errors = [i for i, d in divs if not d or d.get("class") != "near_tie"]
    ties = [i for i, d in divs if d and d.get("class") == "near_tie"]
    before = sum((r["divergence"]["tokens_before"] if r.get("match") is False and r.get("divergence")
                  else r["vanilla_tokens"]) for r in rows)
    total = sum(r["vanilla_tokens"] for r in rows)
    return {"dtype": dtype, "rule": RULE.format(c=f"{tie_ulps:g}", dtype=dtype), "tie_ulps": tie_ulps,
            "compared_after_divergence": AFTER_DIVERGENCE, "prompts": len(rows), "diverged": len(divs),
            "divergence_rate": len(divs) / len(rows) if rows else None, "near_ties": len(ties),
            "real_errors": len(errors), "near_tie_ids": ties, "error_ids": errors,
            "tokens_before_first_divergence": before, "vanilla_tokens": total,
            "share_before_first_divergence": before / total if total else None,
            "divergences": [{"id": i, **(d or {"class": "real_error", "reason": "not accounted"})} for i, d in divs]}


def add_accounting(report: dict[str, Any]) -> dict[str, Any]:
    """A bf16 / fp16 greedy report's ``parity`` gets ``mode: "accounting"`` and ``accounting``
    (:func:`accounting`); an fp32 (exact parity) or sampled report is left as it is.  Returns the report."""
    par = report["parity"]
    rows = report["per_prompt"]
    if report.get("dtype") in ("float32", "float64") or not par.get("checked", True):
        return report
    par["mode"] = "accounting"
    par["accounting"] = accounting(rows, str(report["dtype"]))
    return report


def failing_ids(report: dict[str, Any]) -> list[str]:
    """The prompt ids that fail the report's parity: every mismatch (exact parity: fp32, sampling
    unchecked), or in accounting mode (bf16) the real errors, the divergences that are not near-ties."""
    par = report["parity"]
    if par.get("mode") == "accounting":
        return list(par["accounting"]["error_ids"])
    return list(par["mismatched_ids"])


def accounting_line(report: dict[str, Any]) -> str | None:
    """One console line for an accounted (bf16) parity, None in exact mode."""
    acc = report["parity"].get("accounting")
    if not acc:
        return None
    share = acc["share_before_first_divergence"]
    return (f"{acc['dtype']} parity accounting: {acc['diverged']}/{acc['prompts']} prompts diverged from "
            f"{acc['dtype']} vanilla ({acc['near_ties']} near-ties, {acc['real_errors']} real errors); "
            f"{'-' if share is None else f'{100 * share:.1f}%'} of vanilla's tokens before the first divergence")
