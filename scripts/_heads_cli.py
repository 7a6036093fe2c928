"""Shared command line of the head diagnostics in ``scripts/``: load the base model once, open a
cache split, and apply one measurement to every exported head checkpoint.

``run_per_checkpoint(doc, measure)`` parses ``CHECKPOINT... --cache DIR [--split val]
[--batch-size 4] [--model-path P] [--out FILE.json]``, calls ``measure(head, batches)`` per
checkpoint (``batches``: a fresh iterator of collated batches over the whole split, in order) and
prints / atomically writes ``{checkpoint: result}`` as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import heads  # noqa: E402
from core.base_model import load_base_model  # noqa: E402
from core.io import atomic_write_json  # noqa: E402
from train.data import default_collate, open_split  # noqa: E402


def split_batches(reader, batch_size: int) -> Iterator[dict[str, Any]]:
    """Collated batches of ``batch_size`` records over a whole cache split, in record order."""
    collate = default_collate(reader.pad_id)
    for start in range(0, len(reader), batch_size):
        yield collate([reader[i] for i in range(start, min(start + batch_size, len(reader)))])


def run_per_checkpoint(doc: str, measure: Callable[[Any, Iterator[dict[str, Any]]], Any],
                       argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the command line, apply ``measure`` to each checkpoint's head (eval mode), report JSON.

    Ordinary input errors are one ``error:`` line and exit 2, found before the base model loads where
    they can be: a checkpoint that is not a head checkpoint, a missing cache split, an ``--out`` that
    cannot be written, a split without the hidden-state layers a head reads; Ctrl-C exits 130.
    """
    from core.config import report_errors
    from core.quiet import silence_known_noise

    silence_known_noise()  # as every entry point: no library progress bars around the one error line
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", help="exported head directories (best/ or last/)")
    ap.add_argument("--cache", required=True, help="prepared cache directory (with train/ and val/)")
    ap.add_argument("--split", default="val")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--model-path", default=None, help="base model (default: the packaged SmolLM2), as model.path")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    return report_errors(lambda: _run(args, measure), "interrupted (Ctrl-C): nothing was written")


def _run(args, measure) -> dict[str, Any]:
    from core.config import UserInputError
    from core.io import output_dir_problem
    from heads.registry import check_checkpoint_dir
    from train.run import check_reader_layers

    if args.batch_size < 1:
        raise UserInputError(f"--batch-size {args.batch_size}: must be >= 1")
    for ckpt in args.checkpoints:  # before the base loads
        check_checkpoint_dir(ckpt)
    reader = open_split(args.cache, args.split)
    if args.out is not None and (problem := output_dir_problem(Path(args.out).parent)
                                 or (f"{args.out} is a folder" if Path(args.out).is_dir() else None)):
        raise UserInputError(f"--out {args.out}: {problem}")
    model, _, _ = load_base_model({"path": args.model_path, "dtype": "float32"})
    loaded = {}
    for ckpt in args.checkpoints:  # every head checked against the split before any is measured
        head, _ = heads.load(ckpt, base_model=model)
        check_reader_layers(head, reader, args.split)
        loaded[ckpt] = head.eval()
    results = {ckpt: measure(head, split_batches(reader, args.batch_size)) for ckpt, head in loaded.items()}
    print(json.dumps(results, indent=2))
    if args.out:
        atomic_write_json(args.out, results)
    return results
