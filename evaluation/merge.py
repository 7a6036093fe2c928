"""Combine sharded evaluations: ``python -m evaluation.merge OUT_DIR SHARD_DIR [SHARD_DIR ...]``.

An evaluation split over processes or machines with ``eval.prompt_offset`` / ``eval.num_prompts``
leaves one ``progress.jsonl`` per shard (see :class:`evaluation.runner.Progress`).  This checks
that every shard ran the same configuration against the same checkpoint weights (the header
fingerprint), gathers their per-prompt records into ``OUT_DIR/progress.jsonl`` (written
atomically), and prints the command that writes the reports: the same evaluation with the full
``eval.num_prompts``, ``eval.prompt_offset=0``, ``eval.output_dir=OUT_DIR`` and ``resume=auto``,
which decodes only prompts that no shard finished.

``OUT_DIR`` may be one of the shards (it is merged in place) or a new directory; an existing
``progress.jsonl`` there that is not one of the shards is never overwritten.  Merge finished
shards only: a shard whose evaluation is still running keeps appending to its own file.

Exit status: 0 on success, 2 on an input error (the message names the shard).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

from evaluation.runner import UNFINGERPRINTED_EVAL_KEYS, read_progress, write_progress

USAGE = "usage: python -m evaluation.merge OUT_DIR SHARD_DIR [SHARD_DIR ...]"


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
        elif head.get("weights") != header.get("weights"):
            raise ValueError(f"shard {shard} evaluated other checkpoint weights than shard {first} "
                             f"({head.get('weights')} vs {header.get('weights')}); its records cannot be combined")
        elif head.get("fingerprint") != header.get("fingerprint"):
            raise ValueError(f"shard {shard} ran a different model/heads/eval configuration than shard {first} "
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


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    if len(args) < 2:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        out = merge_progress(Path(args[0]), [Path(a) for a in args[1:]])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc.filename or args[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    shards = ", ".join(f"{s}: {n}" for s, n in out["per_shard"].items())
    print(f"merged {out['prompts']} prompt(s) into {out['path']} ({shards}; {out['duplicates']} duplicate(s) kept once)")
    for shard in out["torn"]:
        print(f"note: {shard}/progress.jsonl ended in a torn line (a crash mid-write); that prompt is decoded again")
    print("write the reports with the shards' command plus: eval.prompt_offset=0 "
          f"eval.num_prompts={out['prompts']} (or the full count, to decode what no shard finished) "
          f"eval.output_dir={args[0]} resume=auto")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
