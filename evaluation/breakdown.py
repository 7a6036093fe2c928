"""Per-turn and per-category tables, and the spread of repeated timing (Spec-Bench conventions).

Every figure is recomputed from summed counts of the group's prompts (never averaged ratios):
τ = Σ emitted / Σ steps, acceptance = Σ accepted / Σ proposed (via
:func:`evaluation.metrics.summarize_method`), tokens/s = Σ tokens / Σ seconds, speedup = method
tokens/s ÷ vanilla tokens/s over the same prompts.
"""
from __future__ import annotations

import statistics
from typing import Any, Sequence

from evaluation.metrics import summarize_method


def _ratio(a, b):
    return float(a) / float(b) if b else None


def group_table(rows: Sequence[dict[str, Any]], stats: Sequence[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    """Aggregate the per-prompt ``rows`` (the report's ``per_prompt``) by ``row[key]``.

    Args:
        rows: per-prompt rows with ``vanilla_tokens``, ``vanilla_seconds``, ``method_tokens``,
            ``method_seconds``, ``match`` (bool or None) and ``key``.
        stats: the method's per-prompt stats dicts, aligned with ``rows`` (for τ and acceptance).
        key: ``"turn"`` or ``"category"``; a missing or None value is grouped as ``"-"``.

    Returns:
        ``{str(group): {"prompts", "steps" (decoding steps), "tau", "acceptance_per_depth", "base_forwards_per_token",
        "vanilla_tokens_per_s", "method_tokens_per_s", "speedup", "parity": {"matched", "total",
        "mismatched_ids", "checked"}}}`` in first-seen order.
    """
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        g = r.get(key)
        groups.setdefault("-" if g is None else str(g), []).append(i)
    out = {}
    for g, idx in groups.items():
        sub = [rows[i] for i in idx]
        m = summarize_method([stats[i] for i in idx], sum(r["method_tokens"] for r in sub),
                             sum(r["method_seconds"] for r in sub))
        v_tps = _ratio(sum(r["vanilla_tokens"] for r in sub), sum(r["vanilla_seconds"] for r in sub))
        bad = [r["id"] for r in sub if r["match"] is False]
        checked = all(r["match"] is not None for r in sub)
        out[g] = {"prompts": len(sub), "steps": m.get("steps"), "tau": m.get("tau"), "acceptance_per_depth": m.get("acceptance_per_depth"),
                  "base_forwards_per_token": m.get("base_forwards_per_token"),
                  "vanilla_tokens_per_s": v_tps, "method_tokens_per_s": m["tokens_per_s"],
                  "speedup": _ratio(m["tokens_per_s"], v_tps) if m["tokens_per_s"] else None,
                  "parity": {"matched": len(sub) - len(bad) if checked else None, "total": len(sub),
                             "mismatched_ids": bad, "checked": checked}}
    return out


def mean_std(values: Sequence[float]) -> dict[str, Any]:
    """``{"mean", "std", "n", "values"}``; ``std`` is the sample standard deviation (n − 1), None for n < 2."""
    vals = [float(v) for v in values]
    return {"mean": statistics.fmean(vals) if vals else None,
            "std": statistics.stdev(vals) if len(vals) > 1 else None, "n": len(vals), "values": vals}


def timing_spread(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean ± std over ``eval.repeats`` of the whole run's tokens/s (vanilla, method) and speedup.

    Repeat r's figure is Σ tokens / Σ seconds of repeat r over all prompts, so each repeat is one
    full timing of the evaluation, and the spread is between repeats (not between prompts).

    Args:
        rows: per-prompt rows with ``vanilla_tokens``, ``method_tokens`` and
            ``vanilla_seconds_repeats`` / ``method_seconds_repeats`` (lists of equal length R).

    Returns:
        ``{"repeats": R, "vanilla_tokens_per_s", "method_tokens_per_s", "speedup"}``, each a
        :func:`mean_std` dict.
    """
    reps = min((len(r["vanilla_seconds_repeats"]) for r in rows), default=0)
    reps = min([reps] + [len(r["method_seconds_repeats"]) for r in rows])
    v_tok = sum(r["vanilla_tokens"] for r in rows)
    m_tok = sum(r["method_tokens"] for r in rows)
    v_tps, m_tps, sp = [], [], []
    for k in range(reps):
        v = _ratio(v_tok, sum(r["vanilla_seconds_repeats"][k] for r in rows))
        m = _ratio(m_tok, sum(r["method_seconds_repeats"][k] for r in rows))
        v_tps.append(v)
        m_tps.append(m)
        sp.append(m / v)
    return {"repeats": reps, "vanilla_tokens_per_s": mean_std(v_tps), "method_tokens_per_s": mean_std(m_tps),
            "speedup": mean_std(sp)}
