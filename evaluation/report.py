"""An evaluation's report: ``report.json`` per method, and its console summary.

:func:`build_report` turns the per-prompt rows of :func:`evaluation.runner.run_evaluation` into the
report: τ and acceptance per depth (:mod:`evaluation.metrics`), parity overall / per turn / per
category (:mod:`evaluation.breakdown`), timing spread over ``eval.repeats``, and the tree choice
of ``eval.tree=auto`` with measured beside predicted.
"""
from __future__ import annotations

from typing import Any

import torch

from core.config import to_container
from decoding.cost_model import omp_wait_policy
from evaluation.breakdown import group_table, timing_spread
from evaluation.metrics import TAU_CONVENTION, summarize_method
from evaluation.status import phases_line


def parity_text(report: dict[str, Any]) -> str:
    """``"matched/total"``, or why parity was not checked (sampling)."""
    par = report["parity"]
    if par.get("checked", True):
        acc = par.get("accounting")  # bf16: exact matches, then how the divergences were accounted for
        extra = f" exact; {acc['near_ties']} near-tie(s), {acc['real_errors']} real error(s)" if acc else ""
        return f"{par['matched']}/{par['total']}{extra}"
    return f"not checked ({par['reason']})"


def build_report(info, identity, device, model, ev, prompts, skipped, max_new, eos_ids, vanilla, stats, seconds,
            tokens, rows, decoder, out_dir) -> dict[str, Any]:
    method = summarize_method(stats, tokens, seconds)
    if hasattr(decoder, "summarize"):
        method["decoder_summary"] = decoder.summarize(stats)
    mismatches = [r["id"] for r in rows if r["match"] is False]
    temperature = float(ev.get("temperature") or 0.0)
    per_turn = group_table(rows, stats, "turn")
    parity = {"matched": len(prompts) - len(mismatches), "total": len(prompts), "mismatched_ids": mismatches,
              "checked": temperature == 0}
    if temperature > 0:
        parity.update(matched=None, reason=f"temperature {temperature:g}: outputs are samples; lossless in "
                                           "distribution (tests/test_adadecode_sampling.py)")
    timing = timing_spread(rows)
    # greedy decoding is deterministic: every repeat must decode round 1's tokens (samples may differ)
    unstable = [r["id"] for r in rows if r.get("repeat_mismatch")] if temperature == 0 else []
    timing["identical_tokens"] = not unstable if temperature == 0 else None
    timing["nonidentical_ids"] = unstable
    return {
        "head_type": info["head_type"], "decoder": info["decoder"], "checkpoint": info["checkpoint"],
        "checkpoint_sha256": info.get("checkpoint_sha256"), "info": info,
        "base": identity.to_dict() if hasattr(identity, "to_dict") else str(identity),
        "device": str(device), "dtype": str(model.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
        "omp_wait_policy": omp_wait_policy(),
        "prompts_source": str(ev.prompts) if ev.get("prompts") else "sharegpt-heldout",
        "num_prompts": len(prompts), "skipped_prompts": skipped, "max_new_tokens": max_new,
        "eos_token_ids": eos_ids,
        "tau": method.get("tau"), "tau_convention": TAU_CONVENTION,
        "acceptance_per_depth": method.get("acceptance_per_depth"),
        "base_forwards_per_token": {"vanilla": vanilla["base_forwards_per_token"],
                                    "method": method.get("base_forwards_per_token")},
        "drafter_passes_per_step": method.get("drafter_passes_per_step"),
        "speedup": (method["tokens_per_s"] / vanilla["tokens_per_s"]) if method.get("tokens_per_s") and vanilla["tokens_per_s"] else None,
        "tree": tree_report(info.get("tree_choice"), method, vanilla),
        "parity": parity, "parity_per_turn": {t: g["parity"] for t, g in per_turn.items()},
        "turns": str(ev.get("turns", 1)), "per_turn": per_turn, "per_category": group_table(rows, stats, "category"),
        "timing": timing,
        "temperature": temperature,
        # the eval settings this method ran with (a variant's overrides merged in); ``info.head_config``
        # is the checkpoint's own config, whose decoding defaults eval keys such as falcon_tree override
        "eval": {k: v for k, v in to_container(ev).items() if k != "variants"},
        "vanilla": vanilla, "method": method, "per_prompt": rows,
        "output_dir": str(out_dir),
    }


def tree_report(choice: dict[str, Any] | None, method: dict[str, Any], vanilla: dict[str, Any]) -> dict[str, Any] | None:
    """``eval.tree``'s choice (:mod:`evaluation.tree_auto`) with the measured τ and speedup beside the predicted."""
    if choice is None:
        return None
    out = dict(choice)
    summary = method.get("decoder_summary") or {}
    if "adadecode_model" in choice:
        out["measured_layer_steps_per_token"] = summary.get("layer_steps_per_token")
        out["measured_layer_step_speedup"] = summary.get("layer_step_speedup")
    if choice.get("applied"):
        speed = (method["tokens_per_s"] / vanilla["tokens_per_s"]) if method.get("tokens_per_s") and vanilla["tokens_per_s"] else None
        out.update(measured_tau=method.get("tau"), measured_speedup=speed)
    return out


def tree_line(tree: dict[str, Any] | None) -> str:
    """The chosen tree with predicted vs measured τ and speedup, one console line."""
    from evaluation.tree_auto import describe, limits_text

    line = describe(tree)
    if tree and "adadecode_model" in tree:
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        line += (f"; measured {fmt(tree.get('measured_layer_steps_per_token'))} steps/token, "
                 f"{fmt(tree.get('measured_layer_step_speedup'))}x")
    if tree and tree.get("applied"):
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        line += f"; measured tau {fmt(tree.get('measured_tau'))}, speedup {fmt(tree.get('measured_speedup'))}x"
        line += limits_text(tree.get("limits"))
        line += probe_text(tree.get("probe"))
    return line


def probe_text(probe: dict[str, Any] | None) -> str:
    """``; at the 4-node probe tree (...): tau 1.40, speedup 0.95x, parity 8/8`` or ``""``."""
    if not probe:
        return ""
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    par = probe.get("parity") or {}
    depth = f", depth {probe['depth']}" if (probe.get("depth") or -1) > 0 else ""
    return (f"\nprobe: at the {probe['nodes']}-node probe tree{depth} ({probe.get('shape')}) the head gives tau "
            f"{fmt(probe.get('measured_tau'))}, speedup {fmt(probe.get('measured_speedup'))}x, parity "
            f"{par.get('matched', '-')}/{par.get('total', '-')}")


def fastest_vanilla_line(fv: dict[str, Any] | None, dtype: str | None) -> str:
    """``speed headline: 0.91x against the fastest vanilla, float32 (41.2 tok/s; bfloat16: 30.1)``, or
    an empty string when the run timed no other vanilla (:mod:`evaluation.fastest_vanilla`)."""
    if not fv or len(fv.get("candidates") or {}) < 2:
        return ""
    sp = "-" if fv.get("speedup") is None else f"{fv['speedup']:.2f}x"
    others = "; ".join(f"{k}: {'-' if v is None else f'{v:.1f}'}" for k, v in fv["candidates"].items() if k != fv["label"])
    tps = "-" if fv.get("tokens_per_s") is None else f"{fv['tokens_per_s']:.1f}"
    return f"speed headline: {sp} against the fastest vanilla, {fv['label']} ({tps} tok/s; {others})"


def format_summary(report: dict[str, Any]) -> str:
    """A few human-readable lines for the console."""
    m, v = report["method"], report["vanilla"]
    fmt = lambda x, f="{:.3f}": "-" if x is None else f.format(x)  # noqa: E731
    acc = report.get("acceptance_per_depth") or []
    lines = [
        f"decoder: {report['decoder']}{' [' + report['variant'] + ']' if report.get('variant') else ''}  "
        f"({report['num_prompts']} prompts, max_new_tokens={report['max_new_tokens']}, {report['device']}, {report['dtype']})",
        f"parity: {parity_text(report)}",
    ]
    from evaluation.divergence import accounting_line

    if accounting_line(report):
        lines.append(accounting_line(report))
    ds = m.get("decoder_summary") or {}
    if report.get("tau") is not None or not ds:
        lines += [
            f"tau (bonus incl.): {fmt(report.get('tau'))}   drafter passes/step: {fmt(report.get('drafter_passes_per_step'), '{:.2f}')}",
            "acceptance per depth: " + (" ".join(fmt(a, "{:.2f}") for a in acc) if acc else "-")]
    if "early_exit_rate" in ds:  # early-exit decoders (AdaDecode): their own figures, from summed counts
        lines += [
            f"early exits: accepted {fmt(ds.get('early_exit_rate'))} of emitted tokens, attempted "
            f"{fmt(ds.get('exit_attempt_rate'))}, rejection rate {fmt(ds.get('rejection_rate'))}",
            f"layer steps/token: {fmt(ds.get('layer_steps_per_token'), '{:.2f}')} (vanilla "
            f"{ds.get('vanilla_layer_steps_per_token')}; layer-step speedup {fmt(ds.get('layer_step_speedup'), '{:.2f}')}x)"]
    lines += [
        f"base forwards/token: vanilla {fmt(v['base_forwards_per_token'])}, method {fmt(m.get('base_forwards_per_token'))}",
        f"tokens/s: vanilla {fmt(v['tokens_per_s'], '{:.1f}')}, method {fmt(m.get('tokens_per_s'), '{:.1f}')}  "
        f"speedup {fmt(report.get('speedup'), '{:.2f}')}x  (drafter time share {fmt(m.get('drafter_time_share'), '{:.2f}')})",
        *[x for x in [fastest_vanilla_line(report.get("fastest_vanilla"), report.get("dtype"))] if x],
        tree_line(report.get("tree")),
        *[f"WARNING: {w}" for w in (report.get("tree") or {}).get("warnings") or []],
        phases_line(report.get("phases")),
        f"report: {report['output_dir']}/report.json",
    ]
    return "\n".join(lines)
