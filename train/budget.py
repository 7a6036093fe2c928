"""Heads compared at an equal budget: validation τ at equal tokens seen and at equal wall clock.

Issue 27's comparison of record gives every head the same **token** budget (one epoch of one
cache) and reports equal **wall clock** as a second column.  Both come from the run records
(``record.json``, :mod:`train.val_schedule`): each validation's ``tokens_seen``, ``train_seconds``
(wall clock inside training batches, summed over resumed segments) and ``sim_tau``.

* **Equal tokens**: each head's last validation (the end of the budget) and its best.
* **Equal wall clock**: each head's validation τ at W seconds of training, W the earliest last timed
  validation (``train_seconds``) among the heads trained on the same share of the machine (the same intra-op
  ``threads`` and ``world_size``, as the record gives them): linear interpolation in
  ``train_seconds`` between the two validations around W.  A head that only validated after W
  has no value there.  Heads trained on different shares of the machine are never put on one clock:
  each such group gets its own W, and a record that does not give its share (one written before
  ``threads`` and ``world_size`` were kept) is a group of its own.

``python -m train.budget NAME=RUN_DIR_OR_RECORD [...] [--seconds W] [--out FILE.md] [--plot FILE.png]``
prints the table (and writes it atomically with ``--out``); ``--plot`` draws the runs' validation τ
against tokens seen on one chart (:func:`train.val_schedule.plot_curves`).  Runs from several places
(a compare run directory, a shipped head's ``record.json``) go on one table and one chart this way.
Exit status 0, or 2 on an input error (the message names the file).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from train.val_schedule import RECORD

USAGE = ("usage: python -m train.budget NAME=RUN_DIR_OR_RECORD_JSON [NAME=...] [--seconds W] [--out FILE.md] "
         "[--plot FILE.png]")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _share_value_ok(x: Any) -> bool:
    """``threads`` / ``world_size`` as records give them: None, a positive int, or a list of them."""
    if x is None:
        return True
    items = x if isinstance(x, list) else [x]
    return bool(items) and all(_is_int(i) and i > 0 for i in items)


def load_record(path: str | Path) -> dict[str, Any]:
    """A run record: ``path`` itself or ``path/record.json``, with its types checked.

    Every validation needs an int ``step`` and ``tokens_seen``, a ``metrics`` mapping of finite
    numbers (or null) and a ``train_seconds`` that is a non-negative number or null; ``threads`` and
    ``world_size`` are null, a positive int or a list of them.

    Raises:
        ValueError: no such file, or it is not a run record, or a field has the wrong type; the
            message names the file, the validation and the key.
    """
    p = Path(path)
    f = p / RECORD if p.is_dir() else p
    try:
        record = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{f}: cannot read a run record ({exc})") from exc
    if not isinstance(record, dict) or not isinstance(record.get("validations"), list):
        raise ValueError(f"{f}: not a run record (no 'validations' list)")
    for key in ("threads", "world_size"):
        if not _share_value_ok(record.get(key)):
            raise ValueError(f"{f}: {key}={record.get(key)!r}: expected null, a positive int or a list of them")
    for k, v in enumerate(record["validations"]):
        missing = [key for key in ("step", "tokens_seen", "metrics") if not isinstance(v, dict) or key not in v]
        if missing:
            raise ValueError(f"{f}: validation {k} lacks {', '.join(missing)}")
        for key in ("step", "tokens_seen"):
            if not _is_int(v[key]) or v[key] < 0:
                raise ValueError(f"{f}: validation {k}: {key}={v[key]!r}: expected a non-negative int")
        if not isinstance(v["metrics"], dict):
            raise ValueError(f"{f}: validation {k}: metrics={v['metrics']!r}: expected a mapping")
        for name, value in v["metrics"].items():
            if value is not None and not _is_number(value):
                raise ValueError(f"{f}: validation {k}: metrics.{name}={value!r}: expected a finite number or null")
        sec = v.get("train_seconds")
        if sec is not None and not (_is_number(sec) and sec >= 0):
            raise ValueError(f"{f}: validation {k}: train_seconds={sec!r}: expected a non-negative number or null")
    return record


def _points(record: dict[str, Any], metric: str) -> list[tuple[float, float]]:
    """(train_seconds, metric) of every validation that has both, in (seconds, step) order: of two
    validations at one second, the later step is the later point."""
    pts = [(float(v["train_seconds"]), int(v["step"]), float(v["metrics"][metric])) for v in record.get("validations", [])
           if v.get("train_seconds") is not None and (v.get("metrics") or {}).get(metric) is not None]
    return [(s, y) for s, _, y in sorted(pts, key=lambda p: (p[0], p[1]))]


def metric_at_seconds(record: dict[str, Any], seconds: float, metric: str = "sim_tau") -> float | None:
    """A validation metric at ``seconds`` of training (``train_seconds``), linearly interpolated
    between the validations around it; exactly a validation's value at its own seconds.

    Returns:
        The value, or None when no validation came at or before ``seconds`` or none came at or
        after it (no extrapolation), or the record has no timed validation of ``metric``.
    """
    pts = _points(record, metric)
    s = float(seconds)
    if not pts or s < pts[0][0] or s > pts[-1][0]:
        return None
    for (s0, y0), (s1, y1) in zip(pts, pts[1:]):
        if s0 <= s <= s1:
            return y0 if s1 == s0 else y0 + (y1 - y0) * (s - s0) / (s1 - s0)
    return pts[-1][1]  # a single validation exactly at s


def machine_share(record: dict[str, Any]) -> tuple[Any, Any]:
    """``(threads, world_size)`` the run trained under, as its record gives them: an int when every
    segment agreed, a tuple of the distinct values otherwise, None when the record predates the key
    (unknown).  Runs are put on one clock only when both are known and agree."""
    def norm(x):
        if isinstance(x, list):
            return x[0] if len(x) == 1 else tuple(x)
        return x
    return norm(record.get("threads")), norm(record.get("world_size"))


def budget_rows(records: dict[str, dict[str, Any]], seconds: float | None = None,
                metric: str = "sim_tau") -> list[dict[str, Any]]:
    """One row per run: tokens seen, train seconds, machine share, ``metric`` at the end and at its
    best validation (equal tokens when every run saw the same tokens), and at equal wall clock.

    Args:
        records: ``{name: run record}``.
        seconds: the wall clock W to compare at (every group alike); None: per machine-share group,
            the earliest of the runs' last timed validations.  A run whose record does not give its
            threads or world size is a group of its own.

    Raises:
        ValueError: a record without any validation of ``metric`` (named); ``seconds`` negative or
            not finite.
    """
    if seconds is not None and not (_is_number(seconds) and seconds >= 0):
        raise ValueError(f"seconds={seconds!r}: expected a finite, non-negative number of seconds")
    groups: dict[tuple, list[str]] = {}
    for name, r in records.items():
        if not _any_metric(r, metric):
            raise ValueError(f"{name}: its run record has no validation with {metric!r}")
        share = machine_share(r)
        # an unknown share (a record from before threads / world_size were kept) is no one's clock
        # but its own
        key = share if None not in share else ("unknown", name)
        groups.setdefault(key, []).append(name)
    rows = []
    for gi, (key, names) in enumerate(groups.items(), start=1):
        share = machine_share(records[names[0]])
        # each run's last timed validation: time trained after it has no τ to read
        known = [_points(records[n], metric)[-1][0] for n in names if _points(records[n], metric)]
        w = float(seconds) if seconds is not None else (min(known) if known else None)
        for n in names:
            r = records[n]
            vals = [v for v in r["validations"] if (v.get("metrics") or {}).get(metric) is not None]
            last = max(vals, key=lambda v: v["step"])  # steps are ints (load_record)
            best = max(vals, key=lambda v: v["metrics"][metric])
            rows.append({"name": n, "tokens_seen": r.get("tokens_seen"), "train_seconds": r.get("train_seconds"),
                         "threads": share[0], "world_size": share[1], "validations": len(vals),
                         "end": last["metrics"][metric], "end_tokens": last["tokens_seen"],
                         "best": best["metrics"][metric], "best_tokens": best["tokens_seen"],
                         "wall_seconds": w, "at_wall": None if w is None else metric_at_seconds(r, w, metric),
                         "group": gi})
    return rows


def _any_metric(record: dict[str, Any], metric: str) -> bool:
    return any((v.get("metrics") or {}).get(metric) is not None for v in record.get("validations", []))


def _f(x, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def budget_markdown(rows: Sequence[dict[str, Any]], metric: str = "sim_tau") -> str:
    """The rows of :func:`budget_rows` as a markdown table (one machine-share group after another)."""
    label = "val τ" if metric == "sim_tau" else f"val/{metric}"
    lines = [f"| head | tokens seen | train (s) | threads × ranks | {label} at the end (equal tokens) | best {label} "
             f"(tokens) | {label} at equal wall clock (W s) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        share = f"{_f(r['threads'], '{}')} × {_f(r['world_size'], '{}')}"
        lines.append(f"| {r['name']} | {_f(r['tokens_seen'], '{:,}')} | {_f(r['train_seconds'], '{:.0f}')} | {share} | "
                     f"{_f(r['end'])} | {_f(r['best'])} ({_f(r['best_tokens'], '{:,}')}) | "
                     f"{_f(r['at_wall'])} ({_f(r['wall_seconds'], '{:.0f}')}) |")
    lines += ["", "Equal wall clock: each run's validation τ at W seconds inside training batches (`train_seconds`), "
              "W the earliest last timed validation among runs on the same threads × ranks, linear between the validations around "
              "W; runs on another share of the machine get their own W, and so does a run whose record does not say its share."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from core.io import atomic_write_text

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.strip() + "\n\n" + USAGE)
        return 0
    seconds, out, plot, pairs = None, None, None, []
    try:
        while args:
            a = args.pop(0)
            if a in ("--seconds", "--out", "--plot"):
                if not args:
                    raise ValueError(f"{a} needs a value")
                v = args.pop(0)
                if a == "--seconds":
                    try:
                        seconds = float(v)
                    except ValueError:
                        seconds = None
                    if seconds is None or not math.isfinite(seconds) or seconds < 0:
                        raise ValueError(f"--seconds {v!r}: expected a finite, non-negative number of seconds")
                elif a == "--out":
                    out = v
                else:
                    plot = v
            elif "=" in a and not a.startswith("-"):
                name, path = a.split("=", 1)
                pairs.append((name, path))
            else:
                raise ValueError(f"{a!r}: expected NAME=RUN_DIR_OR_RECORD_JSON")
        if not pairs:
            raise ValueError("no run given")
        for flag, target in (("--out", out), ("--plot", plot)):
            if target is not None and (Path(target).is_dir() or not Path(target).parent.is_dir()):
                raise ValueError(f"{flag} {target}: expected a file path in an existing directory")
        records = {}
        for name, path in pairs:
            if name in records:
                raise ValueError(f"duplicate name {name!r}")
            records[name] = load_record(path)
        text = budget_markdown(budget_rows(records, seconds))
    except ValueError as exc:
        print(f"error: {exc}\n{USAGE}", file=sys.stderr)
        return 2
    if out:
        try:
            atomic_write_text(out, text)
        except OSError as exc:
            print(f"error: --out {out}: cannot write ({exc})", file=sys.stderr)
            return 2
    if plot:
        from train.val_schedule import plot_curves

        try:
            drawn = plot_curves(records, plot, title="validation τ against tokens seen, per head")
        except ValueError as exc:  # no record has a validation τ
            print(f"error: --plot {plot}: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"error: --plot {plot}: cannot write ({exc})", file=sys.stderr)
            return 2
    print(text, end="")
    if plot:
        print(f"validation τ curves of {', '.join(drawn)} -> {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
