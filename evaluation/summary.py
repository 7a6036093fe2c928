"""``summary.md``: the markdown table of an evaluation (or of a comparison across heads).

``python -m evaluation.summary OUT_DIR NAME=QUALITY_DIR[,TIMING_DIR] [...]`` combines reports
of separate evaluations (one per head, since a run's variants share one head type; the top folder of
an ``eval.variants`` run gives one row per variant, ``NAME/<variant>``) into
``OUT_DIR/summary.md`` and ``OUT_DIR/summary.json`` (written atomically).  ``QUALITY_DIR`` holds the
``report.json`` whose τ, acceptance, parity and per-category figures are used; the optional
``TIMING_DIR`` holds the report of a repeated-timing run (``eval.repeats`` > 1, e.g. on a subset
of the prompts, with all cores) whose speedup mean ± std replaces the quality run's.
Exit status: 0, or 2 on an input error (the message names the directory).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from core.io import atomic_write_json, atomic_write_text
from evaluation.report import parity_text

USAGE = "usage: python -m evaluation.summary OUT_DIR NAME=QUALITY_DIR[,TIMING_DIR] [NAME=...]"


def summary_row(name: str | None, report: dict[str, Any]) -> dict[str, Any]:
    """One line of a results table from a report: τ, acceptance, passes, speedup (and its mean ±
    std over ``eval.repeats``), parity (overall and per turn), per-category τ and speedup, and the
    decoding tree ``eval.tree`` chose (:func:`tree_summary`; None if it applied none)."""
    m = report["method"]
    return {"variant": name, "head_type": report.get("head_type"), "checkpoint": report["checkpoint"],
            "tau": report.get("tau"), "prompts": report.get("num_prompts"), "turns": report.get("turns"),
            "speedup_repeats": (report.get("timing") or {}).get("speedup"),
            "identical_repeat_tokens": (report.get("timing") or {}).get("identical_tokens"),
            "parity_per_turn": {t: f"{p['matched']}/{p['total']}" if p.get("checked") else "not checked"
                                for t, p in (report.get("parity_per_turn") or {}).items()},
            "per_category": {c: {"tau": g["tau"], "speedup": g["speedup"], "prompts": g["prompts"]}
                             for c, g in (report.get("per_category") or {}).items()},
            "acceptance_per_depth": report.get("acceptance_per_depth"),
            "drafter_passes_per_step": report.get("drafter_passes_per_step"),
            "base_forwards_per_token": report["base_forwards_per_token"]["method"],
            "tokens_per_s": m.get("tokens_per_s"), "speedup": report.get("speedup"),
            "drafter_time_share": m.get("drafter_time_share"),
            "tree": tree_summary(report.get("tree")),
            "parity": parity_text(report),
            "decoder_summary": m.get("decoder_summary"),
            "complete": report.get("complete", True), "error": report.get("error"),
            "stopped_at": report.get("stopped_at"), "pending_prompts": len(report.get("pending_prompts") or []),
            "skipped": [{"ids": s.get("ids") or [s["id"]], "reason": s.get("reason")}
                        for s in report.get("skipped_prompts") or []],
            "phases": report.get("phases"), "dtype": report.get("dtype"),
            "fastest_vanilla": report.get("fastest_vanilla")}


def tree_summary(tree: dict[str, Any] | None) -> dict[str, Any] | None:
    """The table cells of a tree choice: mode, nodes, depth, predicted and measured τ / speedup."""
    if tree and not tree.get("applied") and tree.get("nodes") is not None:  # a tree given, not sized: what was drafted
        return {"mode": "config" if tree["mode"] == "config" else "given", "nodes": tree["nodes"],
                "depth": tree.get("depth"), "predicted_tau": None, "measured_tau": None, "predicted_speedup": None,
                "measured_speedup": None, "probe": None}
    if not tree or not tree.get("applied"):
        return None
    c = tree["chosen"]
    probe = tree.get("probe")
    return {"mode": tree["mode"], "nodes": c["nodes"], "depth": c.get("depth"), "predicted_tau": tree["predicted_tau"],
            "measured_tau": tree.get("measured_tau"), "predicted_speedup": tree["predicted_speedup"],
            "measured_speedup": tree.get("measured_speedup"),
            "probe": None if not probe else {k: probe.get(k) for k in ("nodes", "depth", "shape", "measured_tau",
                                                                         "measured_speedup", "parity")}}


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def fastest_vanilla_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The section "Against the fastest vanilla" (rows whose report timed other vanillas,
    :mod:`evaluation.fastest_vanilla`): every vanilla's tokens/s and the method against the fastest."""
    rows = [r for r in rows if len((r.get("fastest_vanilla") or {}).get("candidates") or {}) > 1]
    if not rows:
        return []
    out = ["", "## Against the fastest vanilla", "",
           "Every vanilla timed in this run on the same prompts, interleaved; the headline speedup is the method "
           "against the fastest of them.", "",
           "| method | eval dtype | vanilla tokens/s | fastest vanilla | method tokens/s | speedup vs fastest |",
           "|---|---|---|---|---:|---:|"]
    for r in rows:
        fv = r["fastest_vanilla"]
        cands = ", ".join(f"{k}: {_f(v, '{:.2f}')}" for k, v in fv["candidates"].items())
        out.append(f"| {r.get('variant') or r.get('head_type') or '-'} | {r.get('dtype') or '-'} | {cands} | "
                   f"{fv['label']} | {_f(r.get('tokens_per_s'), '{:.2f}')} | {_f(fv.get('speedup'))} |")
    return out


def speedup_text(row: dict[str, Any]) -> str:
    """``mean ± std (n=R)`` from ``speedup_repeats`` when it has a spread, else the single speedup."""
    rep = row.get("speedup_repeats") or {}
    if rep.get("std") is not None:
        return f"{rep['mean']:.2f} ± {rep['std']:.2f} (n={rep['n']})"
    return _f(row.get("speedup"))


def tree_text(tree: dict[str, Any] | None) -> str:
    """A table cell for :func:`tree_summary`: ``auto: 16 nodes, depth 4`` or ``-``."""
    if not tree:
        return "-"
    depth = f", depth {tree['depth']}" if (tree.get("depth") or 0) > 0 else ""  # -1: a budget (ctc, EAGLE-3); 0: the root
    return f"{tree.get('mode')}: {tree.get('nodes')} node{'s' if tree.get('nodes') != 1 else ''}{depth}"


def summary_markdown(rows: Sequence[dict[str, Any]], output_dir: str | None = None) -> str:
    """A markdown document: the main table (one row per variant/head: training seconds and steps
    when the rows carry ``train_seconds`` / ``train_steps``, prompts, τ, acceptance at
    depth 1/2/3, base forwards per token, drafter time share, speedup mean ± std, tree, parity per
    turn), the early exits of layer-skipping heads (rows whose ``decoder_summary`` has
    ``early_exit_rate``: AdaDecode), then τ / speedup per category when the prompts carry categories.

    Args:
        rows: :func:`summary_row` dicts (``variant`` may be None: one method).
        output_dir: the evaluation's ``eval.output_dir``, named in the resume hint of an incomplete row.
    """
    trained = any(r.get("train_steps") is not None for r in rows)  # rows of scripts/compare.py
    timed = any("timing_tau" in r for r in rows)  # speed from a separate timing run
    head = (("| method | train (s) | steps | tokens seen | " if trained else "| method | ")
            + "prompts | τ | acc@1 | acc@2 | acc@3 | base fwd/token | "
            + ("tree (τ runs) | timing tree | τ (timing) | " if timed else "")
            + "drafter share | speedup | " + ("" if timed else "tree | ") + "parity (per turn) |")
    lines = ["# Evaluation summary", "",
             "τ: tokens per base verification forward, bonus token included; acc@d: accepted / proposed at "
             "draft depth d; speedup: method ÷ vanilla tokens/s, mean ± sample std over `eval.repeats` when "
             "repeated.", "", head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        acc = list(r.get("acceptance_per_depth") or [])
        acc += [None] * (3 - len(acc))
        parity = r.get("parity", "-")
        per_turn = r.get("parity_per_turn") or {}
        if len(per_turn) > 1:
            parity += " (" + ", ".join(f"t{t}: {v}" for t, v in per_turn.items()) + ")"
        n_rep = (r.get("speedup_repeats") or {}).get("n") or 1
        if r.get("identical_repeat_tokens") is False:
            parity += "; repeats NOT identical"
        elif r.get("identical_repeat_tokens") and n_rep > 1:
            parity += f"; {n_rep} repeats identical"
        name = r.get("variant") or r.get("head_type") or "-"
        tree = r.get("tree")
        train = (f"{_f(r.get('train_seconds'), '{:.0f}')} | {_f(r.get('train_steps'), '{}')} | "
                 f"{_f(r.get('train_tokens'), '{:,}')} | " if trained else "")
        trees = (f"{tree_text(tree)} | {tree_text(r.get('timing_tree'))} | {_f(r.get('timing_tau'))} | " if timed else "")
        lines.append(f"| {name} | {train}{_f(r.get('prompts'), '{}')} | {_f(r.get('tau'))} | "
                     + " | ".join(_f(a) for a in acc[:3])
                     + f" | {_f(r.get('base_forwards_per_token'), '{:.3f}')} | {trees}{_f(r.get('drafter_time_share'))} | "
                       f"{speedup_text(r)} | " + ("" if timed else f"{tree_text(tree)} | ") + f"{parity} |")
    lines += status_lines(rows, output_dir)
    lines += fastest_vanilla_lines(rows)
    exits = [r for r in rows if (r.get("decoder_summary") or {}).get("early_exit_rate") is not None]
    if exits:  # layer-skipping heads (AdaDecode) have no τ: their early exits, as decoded in the τ runs
        lines += ["", "## Early exits (τ runs)", "",
                  "| method | accepted exits / token | exit attempts / token | rejection rate | layer steps / token "
                  "(vanilla) | layer-step speedup |", "|---|---:|---:|---:|---:|---:|"]
        for r in exits:
            d = r["decoder_summary"]
            lines.append(f"| {r.get('variant') or r.get('head_type') or '-'} | {_f(d.get('early_exit_rate'))} | "
                         f"{_f(d.get('exit_attempt_rate'))} | {_f(d.get('rejection_rate'))} | "
                         f"{_f(d.get('layer_steps_per_token'))} ({_f(d.get('vanilla_layer_steps_per_token'), '{}')}) | "
                         f"{_f(d.get('layer_step_speedup'))}× |")
    cats = []
    for r in rows:
        cats += [c for c in (r.get("per_category") or {}) if c not in cats]
    if cats and cats != ["-"]:
        names = [r.get("variant") or r.get("head_type") or "-" for r in rows]
        lines += ["", "## τ / speedup per category", "", "| category | " + " | ".join(names) + " |",
                  "|" + "---|" * (len(names) + 1)]
        for c in cats:
            cells = []
            for r in rows:
                g = (r.get("per_category") or {}).get(c)
                cells.append("-" if g is None else f"{_f(g['tau'])} / {_f(g['speedup'])}")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def resume_hint(output_dir: str | os.PathLike | None) -> str:
    """How to continue an interrupted evaluation.  The default ``eval.output_dir`` carries the launch
    time, so the hint names the folder: ``resume=auto`` alone would start a new one."""
    where = f"eval.output_dir={output_dir}" if output_dir is not None else "the same eval.output_dir"
    return f"run the same command again with {where} resume=auto to continue"


def status_lines(rows: Sequence[dict[str, Any]], output_dir: str | os.PathLike | None = None) -> list[str]:
    """Markdown lines under the main table: an incomplete run (where it stopped, why, how to go on:
    :func:`resume_hint` naming ``output_dir``), the skipped prompts and turns with their reasons, and
    each row's time per phase."""
    out: list[str] = []
    for r in rows:
        name = r.get("variant") or r.get("head_type") or "-"
        if r.get("complete") is False:
            out += ["", f"**{name}: incomplete** — stopped at {r.get('stopped_at') or '-'} ({r.get('error')}); "
                        f"{r.get('pending_prompts', 0)} prompt(s) not reached; {resume_hint(output_dir)}."]
    for r in rows:
        tree = r.get("tree") or {}
        if tree.get("nodes") == 1:  # the root alone verifies no draft: say so, and what the head gives at the probe
            name = r.get("variant") or r.get("head_type") or "-"
            p = tree.get("probe")
            line = f"**{name}: eval.tree={tree.get('mode')} chose the root alone** — no draft token was verified (τ 1 by construction), so this row does not test the head."
            if p:
                par = p.get("parity") or {}
                line += (f" At the {p['nodes']}-node probe tree ({p.get('shape')}) on the same prompts the head gives "
                         f"τ {_f(p.get('measured_tau'))}, speedup {_f(p.get('measured_speedup'))}×, parity "
                         f"{par.get('matched', '-')}/{par.get('total', '-')}.")
            out += ["", line]
    skipped = {(tuple(s["ids"]), s["reason"]) for r in rows for s in r.get("skipped") or []}
    if skipped:
        out += ["", "## Skipped prompts and turns", ""]
        out += [f"- {', '.join(ids)}: {reason}" for ids, reason in sorted(skipped)]
    timed = [r for r in rows if r.get("phases")]
    if timed:
        from evaluation.status import phases_line

        out += ["", "## Time", ""] + [f"- {r.get('variant') or r.get('head_type') or '-'}: "
                                      f"{phases_line(r['phases'])[len('time: '):]}" for r in timed]
    return out


def _load(path: Path) -> dict[str, Any]:
    f = path / "report.json"
    if not f.is_file():
        raise ValueError(f"{path}: no report.json (did that evaluation finish?)")
    try:
        rep = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{f}: unreadable report ({exc})") from None
    missing = [k for k in ("method", "checkpoint", "base_forwards_per_token") if not isinstance(rep, dict) or k not in rep]
    if missing:
        raise ValueError(f"{f}: not an evaluation report (no {', '.join(missing)})")
    return rep


def _chosen_tree(report: dict[str, Any]) -> dict[str, Any] | None:
    """The tree a report decoded with (``tree.chosen`` without the candidate list), None if none."""
    tree = report.get("tree") or {}
    if not tree.get("applied"):
        return None
    return {k: v for k, v in tree["chosen"].items() if k != "candidates"}


def variant_dirs(path: Path) -> list[tuple[str, Path]] | None:
    """``[(variant, folder)]`` of an ``eval.variants`` run's top folder (its ``summary.json`` lists the
    variants, each in ``<path>/<variant>/``), in the run's order; None for any other folder."""
    if (path / "report.json").is_file() or not (path / "summary.json").is_file():
        return None
    try:
        rows = json.loads((path / "summary.json").read_text(encoding="utf-8")).get("variants") or []
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None
    names = [r.get("variant") for r in rows if isinstance(r, dict) and r.get("variant")]
    return [(n, path / n) for n in names] or None


def expand_variants(entries: Sequence[tuple[str, Path, Path | None]]) -> list[tuple[str, Path, Path | None]]:
    """Each entry whose quality folder is an ``eval.variants`` run becomes one entry per variant, named
    ``NAME/<variant>``; its timing folder, if any, must be a variants run too and is paired by variant name.

    Raises:
        ValueError: a timing folder that is not a variants run beside one that is, or lacks a variant.
    """
    out = []
    for name, qdir, tdir in entries:
        variants = variant_dirs(Path(qdir))
        if variants is None:
            out.append((name, qdir, tdir))
            continue
        timing = None if tdir is None else dict(variant_dirs(Path(tdir)) or [])
        if tdir is not None and not timing:
            raise ValueError(f"{name}: {qdir} is an eval.variants run (variants {', '.join(v for v, _ in variants)}) but "
                             f"its timing folder {tdir} is not; pair variant folders instead ({name}=QUALITY/<variant>,TIMING)")
        for v, vdir in variants:
            if timing is not None and v not in timing:
                raise ValueError(f"{name}: the timing run {tdir} has no variant {v!r} (it has {', '.join(timing)})")
            out.append((f"{name}/{v}", vdir, None if timing is None else timing[v]))
    return out


def check_same_checkpoint(name: str, q: dict, qdir, t: dict, tdir) -> None:
    """Refuse a timing report of another head than its quality report: by the weights' SHA-256 where both
    reports record it (a checkpoint folder rewritten between the two runs is another head; a copy of it is
    the same), else by path.

    Raises:
        ValueError: naming both folders and what differs.
    """
    a, b = q.get("checkpoint_sha256"), t.get("checkpoint_sha256")
    if a and b:
        if a != b:
            raise ValueError(f"{name}: timing report {tdir} evaluated other weights ({t['checkpoint']}, sha256 "
                             f"{b[:12]}…) than {qdir} ({q['checkpoint']}, sha256 {a[:12]}…)")
    elif t["checkpoint"] != q["checkpoint"]:
        raise ValueError(f"{name}: timing report {tdir} evaluated {t['checkpoint']}, not {q['checkpoint']} like {qdir}")


def combine(entries: Sequence[tuple[str, Path, Path | None]]) -> list[dict[str, Any]]:
    """Summary rows for ``[(name, quality_dir, timing_dir or None)]``.

    A row with a timing report takes its speed figures from it (speedup, its mean ± std over the
    repeats, tokens/s, drafter time share, per-category speedup; the quality run's drafter share is
    kept as ``quality_drafter_time_share``) and its τ figures from the quality report; it also
    gives the timing run's tree and τ (``timing_tree``, ``timing_tau``) and whether both decoded
    with the same tree (``tree_matches_timing``; ``scripts/compare.py`` fixes the quality runs'
    node budget, so there they may differ by design).

    A folder of an ``eval.variants`` run gives one row per variant (:func:`expand_variants`).

    Raises:
        ValueError: a directory has no readable ``report.json``; a timing report ran another
            checkpoint than its quality report, or a name repeats (the message names it).
    """

    rows, seen = [], set()
    for name, qdir, tdir in expand_variants(entries):
        if name in seen:
            raise ValueError(f"duplicate name {name!r}")
        seen.add(name)
        q = _load(Path(qdir))
        row = summary_row(name, q)
        if tdir is not None:
            t = _load(Path(tdir))
            check_same_checkpoint(name, q, qdir, t, tdir)
            timing = t.get("timing") or {}
            t_method = t.get("method") or {}
            row.update(tree_matches_timing=_chosen_tree(q) == _chosen_tree(t), timing_tree=tree_summary(t.get("tree")),
                       timing_tau=t.get("tau"), quality_drafter_time_share=row.get("drafter_time_share"),
                       drafter_time_share=t_method.get("drafter_time_share"))
            row.update(speedup=t.get("speedup"), speedup_repeats=timing.get("speedup"),
                       identical_repeat_tokens=timing.get("identical_tokens"), timing_prompts=t.get("num_prompts"),
                       timing_threads=t.get("threads"), tokens_per_s=t_method.get("tokens_per_s"))
            for c, g in (t.get("per_category") or {}).items():  # speed per category from the timing run
                if c in row["per_category"]:
                    row["per_category"][c].update(speedup=g["speedup"], timing_prompts=g["prompts"])
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    if len(args) < 2 or any("=" not in a for a in args[1:]):
        print(USAGE, file=sys.stderr)
        return 2
    entries = []
    for a in args[1:]:
        name, dirs = a.split("=", 1)
        parts = dirs.split(",")
        if not name or len(parts) > 2 or not parts[0]:  # a third folder or an empty name was silently dropped
            print(f"error: {a!r}: give NAME=QUALITY_DIR[,TIMING_DIR] (a non-empty name, one or two folders)",
                  file=sys.stderr)
            return 2
        entries.append((name, Path(parts[0]), Path(parts[1]) if len(parts) > 1 and parts[1] else None))
    from core.io import output_dir_problem

    if (problem := output_dir_problem(args[0])) is not None:
        print(f"error: OUT_DIR {args[0]} cannot be written: {problem}", file=sys.stderr)
        return 2
    own = [f for f in ("report.json", "progress.jsonl") if (Path(args[0]) / f).is_file()]
    if own:  # an evaluation's folder: its summary.json lists its variants, which this would overwrite
        print(f"error: OUT_DIR {args[0]} is an evaluation's folder (it holds {', '.join(own)}): write the summary "
              "into another folder", file=sys.stderr)
        return 2
    try:
        rows = combine(entries)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "summary.json", {"rows": rows})
    atomic_write_text(out / "summary.md", summary_markdown(rows))
    print((out / "summary.md").read_text(encoding="utf-8"), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
