"""Aggregating per-prompt decoding stats into the evaluation report (METHODS.md §5.1).

Conventions (written into every report):

* τ = tokens emitted per verification forward, **bonus token included**, averaged over all
  decoding steps of all prompts (Σ emitted / Σ steps).  The first token, which comes from the
  prefill exactly as in vanilla decoding, is not counted.  τ = 1 means no draft token was ever
  accepted.  (Falcon's paper reports τ − 1; CTC's β equals this τ.)
* acceptance per depth d = steps that accepted a depth-d draft token / steps whose tree reached
  depth d; conditional acceptance (n-α) = the same over steps that also accepted depths < d.
* base forwards per token = (prefill + decoding forwards of the base model) / generated tokens.
* speedup = method tokens/s / vanilla tokens/s (equal to (T_van/N)/(T_spec/N) since both decode
  the same tokens), wall clock, same prompts, same process, interleaved per prompt.
"""
from __future__ import annotations

from typing import Any, Sequence

TAU_CONVENTION = ("tau = tokens emitted per base verification forward, bonus token included "
                  "(sum of emitted tokens / sum of decoding steps; the prefill's first token excluded); "
                  "tau = 1 means no draft token accepted; Falcon's tau = this - 1")


def _sum_lists(lists: Sequence[Sequence[float]]) -> list[float]:
    n = max((len(x) for x in lists), default=0)
    out = [0.0] * n
    for x in lists:
        for i, v in enumerate(x):
            out[i] += v
    return out


def _ratio(a: float, b: float) -> float | None:
    return float(a) / float(b) if b else None


def stat_kind(key: str, values: Sequence[Any]) -> str | None:
    """How a per-prompt stat aggregates over prompts: ``"sum"``, ``"max"`` or None (not at all).

    By the Decoder protocol (docs/design.md), integer stats and lists of numbers are counts and
    add up; float stats add up only when they are durations (``seconds`` or ``*_seconds``); a
    ``max_*`` integer is a maximum.  Any other float (a per-prompt ratio such as
    ``rejection_rate``, ``layer_steps_per_token`` or ``tokens_per_s``) is never summed: an
    aggregate ratio is recomputed from summed counts (:func:`summarize_method`, or the decoder's
    own ``summarize``).
    """
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        if key.startswith("max_"):
            return "max"
        if all(isinstance(v, int) for v in values) or key == "seconds" or key.endswith("_seconds"):
            return "sum"
        return None
    if all(isinstance(v, (list, tuple)) and all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in v)
           for v in values):
        return "sum"
    return None


def numeric_totals(stats_list: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate the prompts' stats: counts and durations summed (lists element-wise), ``max_*``
    maximised, per-prompt ratios left out (see :func:`stat_kind`)."""
    totals: dict[str, Any] = {}
    keys = {k for s in stats_list for k in s}
    for k in sorted(keys):
        if k == "emitted_per_step":
            continue  # reduced to τ in summarize_method
        vals = [s[k] for s in stats_list if k in s]
        kind = stat_kind(k, vals)
        if kind == "max":
            totals[k] = max(vals)
        elif kind == "sum" and isinstance(vals[0], (list, tuple)):
            totals[k] = _sum_lists(vals)
        elif kind == "sum":
            totals[k] = float(sum(vals)) if any(isinstance(v, float) for v in vals) else int(sum(vals))
    return totals


def summarize_method(stats_list: Sequence[dict[str, Any]], new_tokens: int, seconds: float) -> dict[str, Any]:
    """The method's aggregate metrics from its per-prompt stats.

    Args:
        stats_list: the ``stats`` dicts returned by ``decoder.generate`` for each prompt.
        new_tokens: total generated tokens (all prompts).
        seconds: total wall-clock seconds of the method's ``generate`` calls.

    Returns:
        ``tokens``, ``seconds``, ``tokens_per_s`` and, when the stats carry the fields of
        :class:`decoding.speculative.SpeculativeDecoder`: ``tau``, ``steps``,
        ``acceptance_per_depth``, ``conditional_acceptance_per_depth``,
        ``base_forwards_per_token``, ``drafter_passes_per_step``, ``drafter_time_share``,
        ``draft_nodes_per_step``; plus ``totals`` (:func:`numeric_totals`: counts and durations
        summed over prompts, never per-prompt ratios) and ``means`` (every numeric scalar stat,
        ratios included, averaged over prompts: the per-prompt mean, not the aggregate).  A
        decoder with a ``summarize(stats_list) -> dict`` method gets its own aggregate under
        ``decoder_summary`` (added by the runner).
    """
    totals = numeric_totals(stats_list)
    out: dict[str, Any] = {"tokens": int(new_tokens), "seconds": float(seconds),
                           "tokens_per_s": _ratio(new_tokens, seconds)}
    emitted = [e for s in stats_list for e in s.get("emitted_per_step", [])]
    if emitted:
        out["steps"] = len(emitted)
        out["tau"] = sum(emitted) / len(emitted)
    elif any("emitted_per_step" in s for s in stats_list):
        out["steps"], out["tau"] = 0, None
    if "proposed_per_depth" in totals:
        prop, acc = totals["proposed_per_depth"], totals.get("accepted_per_depth", [])
        reached = totals.get("reached_per_depth", [])
        out["acceptance_per_depth"] = [_ratio(a, p) for a, p in zip(acc, prop)]
        out["conditional_acceptance_per_depth"] = [_ratio(a, r) for a, r in zip(acc, reached)]
        out["proposed_per_depth"] = prop
        out["accepted_per_depth"] = acc
    if "base_forwards" in totals:
        out["base_forwards_per_token"] = _ratio(totals["base_forwards"] + totals.get("prefill_forwards", 0), new_tokens)
    if "drafter_passes" in totals and out.get("steps"):
        out["drafter_passes_per_step"] = totals["drafter_passes"] / out["steps"]
    if "drafter_seconds" in totals:
        out["drafter_time_share"] = _ratio(totals["drafter_seconds"], seconds)
    if "verify_seconds" in totals:
        out["verify_time_share"] = _ratio(totals["verify_seconds"], seconds)
    if "tree_nodes" in totals and out.get("steps"):
        out["draft_nodes_per_step"] = totals["tree_nodes"] / out["steps"]
    out["totals"] = totals
    scalar = sorted({k for s in stats_list for k, v in s.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)})
    out["means"] = {k: sum(s[k] for s in stats_list if k in s) / sum(1 for s in stats_list if k in s)
                    for k in scalar if all(isinstance(s.get(k, 0), (int, float)) for s in stats_list)}
    return out
