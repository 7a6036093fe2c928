"""``acceptance.png``: one evaluation report as a figure."""
from __future__ import annotations

import io
from typing import Any

from evaluation.report import parity_text


def plot(report: dict[str, Any]) -> bytes:
    """PNG bytes of :func:`make_figure` (``acceptance.png``)."""
    import matplotlib.pyplot as plt

    fig = make_figure(report)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def make_figure(report: dict[str, Any]):
    """A matplotlib figure of one report: the method's own figures (left), per-prompt speedup (right).

    Left: for tree decoders, acceptance per draft depth (bars: accepted / proposed) and the
    conditional acceptance (line: accepted at depth d / steps that accepted every depth < d and
    whose tree reached d, the n-α of METHODS §5.1); for a decoder that reports per-layer early exits
    (AdaDecode's ``decoder_summary``: ``exits_l<ℓ>`` / ``accepted_l<ℓ>``), exits and accepted exits
    per layer as a share of emitted tokens, titled with its exit rate, rejection rate and layer
    steps per token.  Right: histogram of per-prompt speedups (bars edged, y = prompt count) with
    the labelled break-even line at 1.0.  The figure's title names the variant (``eval.variants``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = report["method"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    acc = m.get("acceptance_per_depth")
    probe = (report.get("tree") or {}).get("probe") or {}
    title_tail = ""
    if not acc and probe.get("acceptance_per_depth"):  # the root alone: plot what the head gave at the probe tree
        acc = probe["acceptance_per_depth"]
        m = {"acceptance_per_depth": acc, "tau": probe.get("measured_tau"),
             "conditional_acceptance_per_depth": probe.get("conditional_acceptance_per_depth")}
        title_tail = f"\nat the {probe['nodes']}-node probe tree (eval.tree chose the root alone)"
    summary = m.get("decoder_summary") or {}
    layers = sorted(int(k[len("exits_l"):]) for k in summary if k.startswith("exits_l") and k[7:].isdigit())
    if acc:
        depths = list(range(1, len(acc) + 1))
        ax1.bar(depths, [a or 0.0 for a in acc], color="tab:blue", edgecolor="black", linewidth=0.6,
                label="accepted / proposed at depth d")
        cond = m.get("conditional_acceptance_per_depth") or []
        if len(cond) == len(depths):
            ax1.plot(depths, [c if c is not None else float("nan") for c in cond], "o-", color="tab:orange",
                     label="conditional: given depths < d accepted")
        ax1.set_ylim(0, 1.25)
        ax1.set_xticks(depths)
        ax1.legend(loc="upper right", fontsize=8)
        tau = m.get("tau")
        ax1.set_title((f"acceptance per draft depth  (τ={tau:.2f}, bonus incl.)" if tau else "acceptance per draft depth")
                      + title_tail, fontsize=10 if title_tail else None)
        ax1.set_xlabel("draft depth d")
        ax1.set_ylabel("acceptance rate")
    elif layers and summary.get("new_tokens"):
        n = float(summary["new_tokens"])
        x = list(range(len(layers)))
        ax1.bar([i - 0.2 for i in x], [summary[f"exits_l{l}"] / n for l in layers], width=0.4, color="tab:blue",
                edgecolor="black", linewidth=0.6, label="early exits proposed")
        ax1.bar([i + 0.2 for i in x], [summary.get(f"accepted_l{l}", 0) / n for l in layers], width=0.4,
                color="tab:green", edgecolor="black", linewidth=0.6, label="accepted by verification")
        ax1.set_xticks(x, [f"hs[{l}]" for l in layers])
        ax1.set_xlabel("exit layer")
        ax1.set_ylabel("share of emitted tokens")
        ax1.legend(loc="upper right", fontsize=8)
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        ax1.set_title(f"early exits: rate {fmt(summary.get('early_exit_rate'))}, rejected "
                      f"{fmt(summary.get('rejection_rate'))}\nlayer steps/token {fmt(summary.get('layer_steps_per_token'))}"
                      f" (vanilla {summary.get('vanilla_layer_steps_per_token')})", fontsize=10)
    else:
        ax1.text(0.5, 0.5, no_acceptance_text(report), ha="center", va="center", fontsize=9)
        ax1.set_title("acceptance per draft depth")
    sp = [p["speedup"] for p in report["per_prompt"] if p.get("speedup")]
    ax2.hist(sp, bins=min(20, max(1, len(sp))), color="tab:green", edgecolor="black", linewidth=0.6)
    ax2.axvline(1.0, color="k", lw=0.9, ls="--", label="1.0 = vanilla speed")
    ax2.legend(loc="upper right", fontsize=8)
    ax2.set_title(f"per-prompt speedup (overall {report['speedup']:.2f}x)" if report.get("speedup") else "per-prompt speedup")
    ax2.set_xlabel("method tokens/s ÷ vanilla tokens/s")
    ax2.set_ylabel("prompts")
    variant = f" [{report['variant']}]" if report.get("variant") else ""
    fig.suptitle(f"{report['head_type']}{variant} — {report['num_prompts']} prompts, parity {parity_text(report)}")
    fig.tight_layout()
    return fig


def no_acceptance_text(report: dict[str, Any]) -> str:
    """Why a report has no per-depth acceptance, named for its decoder: a tree decoder whose every
    verified tree was the root alone (eval.tree's choice, a budget of 1), a tree decoder that drafted
    nothing, or a decoder that drafts no tree at all (an early-exit decoder without exits, a custom one)."""
    m = report.get("method") or {}
    totals = m.get("totals") or {}
    head = str(report.get("head_type") or report.get("decoder") or "the decoder")
    if "tree_nodes" in totals:  # a tree decoder (decoding.speculative.SpeculativeDecoder)
        chosen = ((report.get("tree") or {}).get("chosen") or {})
        if int(chosen.get("nodes") or 0) == 1:
            why = "eval.tree chose the root alone" + (" (tree_fallback)" if chosen.get("fallback") else "")
        else:
            why = "no verified tree held a draft token"
        return f"{head}: no draft token was proposed\n({why}; τ = 1 by construction)"
    return f"no per-depth acceptance\n({head} drafts no token tree)"
