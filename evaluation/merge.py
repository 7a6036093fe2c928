"""Combine sharded evaluations: ``python -m evaluation.merge [--no-report] OUT_DIR SHARD_DIR [SHARD_DIR ...]``.

An evaluation split over processes or machines with ``eval.prompt_offset`` / ``eval.num_prompts``
leaves one ``progress.jsonl`` per shard (see :class:`evaluation.progress.Progress`).  This checks
that every shard ran the same configuration against the same checkpoint weights (the header
fingerprint; checkpoints are identified by their weights' SHA-256, so shards may spell a
checkpoint's path differently), gathers their per-prompt records into ``OUT_DIR/progress.jsonl``
(written atomically), and then writes the merged reports itself (``report.json``,
``acceptance.png``, per variant and ``summary.json``): it re-runs the first shard's
``config.yaml`` with ``eval.output_dir=OUT_DIR``, ``resume=auto`` and the prompt range the shards
span together, which loads the base model and the heads but decodes only prompts that no shard
finished (none when the shards cover the range).  ``--no-report`` stops after the merge.

``OUT_DIR`` may be one of the shards (it is merged in place) or a new directory; an existing
``progress.jsonl`` there that is not one of the shards is never overwritten.  Merge finished
shards only: a shard whose evaluation is still running keeps appending to its own file.

Exit status: 0 on success, 1 when a merged prompt's output differs from vanilla greedy decoding,
2 on an input error (the message names the shard).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

from evaluation.progress import (UNFINGERPRINTED_EVAL_KEYS, differences_note, read_progress, weight_digests,
                                 write_progress)

USAGE = "usage: python -m evaluation.merge [--no-report] OUT_DIR SHARD_DIR [SHARD_DIR ...]"


def merge_progress(out_dir: Path, shard_dirs: Sequence[Path]) -> dict[str, Any]:
    """Merge the shards' ``progress.jsonl`` files into ``out_dir/progress.jsonl``.

    Records are kept in the order the shards are given, then file order; a prompt finished by
    several shards is kept once (the first), after checking that both decoded the same prompt (its
    token SHA-256).  A shard named twice is read once; a shard's torn last line (a crash
    mid-write) is dropped and counted.

    Returns:
        ``{"prompts": n merged, "per_shard": {shard: n records}, "duplicates": n, "torn": [shards],
        "path": str}``.

    Raises:
        ValueError: a shard has no ``progress.jsonl`` or an unreadable one (the message names the
            file and line); the shards differ in configuration or checkpoint weights; one prompt
            id carries different prompts; or ``out_dir`` already holds results that are not one of
            the shards.
        OSError: ``out_dir`` cannot be created or written.
    """
    if not shard_dirs:
        raise ValueError("no shard directories given")
    out_dir = Path(out_dir)
    shards: list[Path] = []
    for s in map(Path, shard_dirs):  # the same directory named twice (also via another path) is read once
        if not any(_same(s, seen) for seen in shards):
            shards.append(s)
    target = out_dir / "progress.jsonl"
    if target.is_file() and target.stat().st_size and not any(_same(s, out_dir) for s in shards):
        raise ValueError(f"{target} already holds results and is not one of the shards: name {out_dir} as a "
                         "shard to merge into it, or choose another OUT_DIR")
    header = None
    merged: dict[str, dict[str, Any]] = {}
    per_shard: dict[str, int] = {}
    duplicates, torn = 0, []
    for shard in shards:
        path = shard / "progress.jsonl"
        if not path.is_file():
            raise ValueError(f"shard {shard}: no progress.jsonl (is it an eval.output_dir?)")
        head, records, was_torn = read_progress(path)
        if was_torn:
            torn.append(str(shard))
        if header is None:
            header, first = head, shard
        elif weight_digests(head.get("weights")) != weight_digests(header.get("weights")):
            raise ValueError(f"shard {shard} evaluated other checkpoint weights than shard {first} (SHA-256 "
                             f"{weight_digests(head.get('weights'))} vs {weight_digests(header.get('weights'))}); "
                             "its records cannot be combined")
        elif head.get("fingerprint") != header.get("fingerprint"):
            raise ValueError(f"shard {shard} ran a different model/heads/eval configuration than shard {first}"
                             f"{differences_note(first / 'config.yaml', shard / 'config.yaml')} "
                             f"(only eval.{', eval.'.join(UNFINGERPRINTED_EVAL_KEYS)} may differ)")
        per_shard[str(shard)] = len(records)
        for pid, rec in records.items():
            if pid in merged:
                if merged[pid].get("prompt_sha256") != rec.get("prompt_sha256"):
                    raise ValueError(f"prompt {pid!r} holds different prompts in shard {shard} and an earlier shard "
                                     "(the prompt file changed between shards)")
                duplicates += 1
                continue
            merged[pid] = rec
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"OUT_DIR {out_dir} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_progress(target, header, merged.values())
    return {"prompts": len(merged), "per_shard": per_shard, "duplicates": duplicates, "torn": torn,
            "path": str(target)}


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def report_config(out_dir: Path, shard_dirs: Sequence[Path]):
    """The config that writes the merged report: the first shard's ``config.yaml`` with
    ``eval.output_dir=out_dir``, ``resume=auto``, ``eval.warmup=0`` and the prompt range the shards
    span (``prompt_offset`` = the smallest shard offset; ``num_prompts`` up to the largest shard
    end, or null when a shard ran to the end of the prompts).

    Raises:
        ValueError: a shard has no readable ``config.yaml``, or the composed config is invalid.
    """
    from omegaconf import OmegaConf, open_dict

    from core.config import ConfigError, validate

    cfgs = []
    for shard in shard_dirs:
        path = Path(shard) / "config.yaml"
        if not path.is_file():
            raise ValueError(f"shard {shard}: no config.yaml to rebuild the evaluation from (use --no-report)")
        try:
            cfgs.append(OmegaConf.load(path))
        except Exception as exc:  # a YAML error of any kind: the file is not a config
            raise ValueError(f"{path}: unreadable config ({' '.join(str(exc).split())})") from None
    offsets = [int(c.eval.get("prompt_offset") or 0) for c in cfgs]
    ends = [None if c.eval.get("num_prompts") is None else o + int(c.eval.num_prompts) for c, o in zip(cfgs, offsets)]
    cfg = cfgs[0]
    with open_dict(cfg):
        cfg.eval.output_dir = str(out_dir)
        cfg.eval.prompt_offset = min(offsets)
        cfg.eval.num_prompts = None if None in ends else max(ends) - min(offsets)
        cfg.eval.warmup = 0
        cfg.resume = "auto"
    OmegaConf.set_struct(cfg, True)
    try:
        validate(cfg)
    except ConfigError as exc:
        raise ValueError(f"config.yaml of shard {shard_dirs[0]}: {exc}") from None
    return cfg


def merge_and_report(out_dir: Path, shard_dirs: Sequence[Path], base=None, decoder=None) -> dict[str, Any]:
    """:func:`merge_progress`, then write the merged reports with
    :func:`evaluation.runner.run_evaluation` on :func:`report_config` (``base`` / ``decoder`` as
    there, for tests).  Returns the merge summary with ``report`` (the report dict) added.

    Raises:
        ValueError, OSError: as :func:`merge_progress` and :func:`report_config`.
        evaluation.runner.ParityError: a merged prompt's output differs from vanilla greedy
            decoding (the reports are written first).
    """
    from evaluation.runner import run_evaluation

    cfg = report_config(out_dir, list(map(Path, shard_dirs)))  # before anything is written
    out = merge_progress(out_dir, shard_dirs)
    out["report"] = run_evaluation(cfg, base=base, decoder=decoder)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry; returns the exit status (0 ok, 1 parity failure, 2 input error)."""
    import logging

    from core.quiet import silence_known_noise

    silence_known_noise()
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    report = "--no-report" not in args
    args = [a for a in args if a != "--no-report"]
    flags = [a for a in args if a.startswith("-")]
    if flags:  # a mistyped --no-report was taken for OUT_DIR: a folder named after it, the base loaded
        print(f"error: unknown option {flags[0]!r} (the only option is --no-report)\n{USAGE}", file=sys.stderr)
        return 2
    if len(args) < 2:
        print(USAGE, file=sys.stderr)
        return 2
    from evaluation.cli import run_and_report

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def merge_then_report() -> dict[str, Any] | None:
        # the report's config is checked before anything is written: a bad shard config.yaml leaves
        # no merged progress.jsonl behind
        cfg = report_config(Path(args[0]), [Path(a) for a in args[1:]]) if report else None
        out = merge_progress(Path(args[0]), [Path(a) for a in args[1:]])
        shards = ", ".join(f"{s}: {n}" for s, n in out["per_shard"].items())
        print(f"merged {out['prompts']} prompt(s) into {out['path']} ({shards}; {out['duplicates']} duplicate(s) kept once)")
        for shard in out["torn"]:
            print(f"note: {shard}/progress.jsonl ended in a torn line (a crash mid-write); that prompt is decoded again")
        if not report:
            return None
        from evaluation.runner import run_evaluation

        return run_evaluation(cfg)

    return run_and_report(merge_then_report)


if __name__ == "__main__":
    raise SystemExit(main())
