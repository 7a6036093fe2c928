"""Label counts: how often each base token is a greedy label on a loss position, per cache split.

What a drafter must predict is exactly ``labels[loss_mask]`` (design.md "Cache → batch contract"),
so these counts rank the base vocabulary for the draft vocabulary (:mod:`heads.draft_vocab`,
FR-Spec / EAGLE-3 ``d2t``).

Storage (additive to ``draftheads-cache-v1``; shard files are unchanged): every split directory
gets ``label_counts.safetensors`` = ``{"label_counts": int64 [V]}``, the sum over its shards of
``bincount(labels[loss_mask])``, written atomically right after the manifest by whichever rank
completes the split (all ranks write the same bytes: the sum does not depend on the rank count or
on which rank wrote which shard).  Only the int32 ``labels`` and bool ``loss_mask`` tensors are
read, never the hidden states, and no base forward runs.

A cache written before this change has no counts file: :func:`load_counts` then scans the shards
the same way (nothing is written) and
``python -m data_prep.label_counts CACHE [--write]`` prints the coverage table and, with
``--write``, stores the file in the cache.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterable, Sequence

import torch

from core.io import MANIFEST_FIX, DamagedFile, atomic_save_safetensors, read_json

FILE = "label_counts.safetensors"
KEY = "label_counts"
#: draft-vocabulary sizes whose held-out coverage data prep prints
REPORT_SIZES = (2048, 4096, 8192, 16384, 32768)


def count_labels(labels: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Histogram of ``labels[loss_mask]``: labels [N] (int), loss_mask [N] (bool) → int64 [V] (CPU).

    Raises:
        ValueError: shapes differ, or a counted label lies outside [0, V).
    """
    if labels.shape != loss_mask.shape:
        raise ValueError(f"labels {tuple(labels.shape)} and loss_mask {tuple(loss_mask.shape)} differ in shape")
    sel = labels.reshape(-1)[loss_mask.reshape(-1).bool()].to(torch.int64).cpu()
    if sel.numel() and (int(sel.min()) < 0 or int(sel.max()) >= int(vocab_size)):
        raise ValueError(f"a label on a loss position lies outside [0, {vocab_size}): "
                         f"range [{int(sel.min())}, {int(sel.max())}]")
    return torch.bincount(sel, minlength=int(vocab_size))


def _vocab_size(manifest: dict, where: Path) -> int:
    v = (manifest.get("base") or {}).get("vocab_size")
    if v is None:
        raise ValueError(f"{where / 'manifest.json'} records no base vocab_size; cannot count labels")
    return int(v)


def scan_split(directory: str | Path) -> torch.Tensor:
    """Σ over a split's shards of ``bincount(labels[loss_mask])`` (no base forward) → int64 [V].

    Raises:
        FileNotFoundError: no manifest or a listed shard is missing.
        ValueError: the manifest lacks the vocab size, or a shard has no ``labels``/``loss_mask``
            (a scan is impossible), or a label lies outside [0, V).
    """
    from safetensors import safe_open

    directory = Path(directory)
    mpath = directory / "manifest.json"
    if not mpath.is_file():
        raise FileNotFoundError(f"{mpath} not found: the cache split is incomplete")
    manifest = read_json(mpath, MANIFEST_FIX)
    v = _vocab_size(manifest, directory)
    total = torch.zeros(v, dtype=torch.int64)
    for entry in manifest.get("shards", []):
        path = directory / entry["file"]
        if not path.is_file():
            raise FileNotFoundError(f"{path} listed in {mpath} is missing")
        with safe_open(str(path), framework="pt") as f:
            if not {"labels", "loss_mask"} <= set(f.keys()):
                raise ValueError(f"{path} has no labels/loss_mask tensors: its label counts cannot be scanned")
            counts = count_labels(f.get_tensor("labels"), f.get_tensor("loss_mask"), v)
        total += counts
    return total


def write_split_counts(directory: str | Path, counts: torch.Tensor | None = None) -> Path:
    """Write ``<split>/label_counts.safetensors`` (atomic) with ``counts`` or :func:`scan_split`'s sum."""
    directory = Path(directory)
    counts = scan_split(directory) if counts is None else counts
    path = directory / FILE
    atomic_save_safetensors({KEY: counts.to(torch.int64).contiguous()}, path, metadata={"format": "draftheads-label-counts-v1"})
    return path


def load_counts(directory: str | Path, scan: bool = True) -> torch.Tensor:
    """The label counts int64 [V] of one cache split directory (e.g. ``<cache>/train``).

    Reads ``label_counts.safetensors``; without it (a cache made before counts existed) and with
    ``scan`` the shards are scanned (:func:`scan_split`, nothing is written).

    Raises:
        FileNotFoundError: neither the file nor (with ``scan``) a manifest exists.
        ValueError: the stored counts are not int64 [V] with V = the manifest's vocab size, or a
            scan is impossible (see :func:`scan_split`).
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    path = directory / FILE
    if path.is_file():
        from safetensors import SafetensorError

        try:
            tensors = load_file(str(path))
        except SafetensorError as exc:
            raise DamagedFile(path, f"not a readable safetensors file ({exc}); delete it: the counts are "
                                    "scanned from the shards again") from exc
        counts = tensors.get(KEY)
        if counts is None or counts.dtype != torch.int64 or counts.dim() != 1:
            raise ValueError(f"{path}: expected an int64 [V] tensor {KEY!r}")
        mpath = directory / "manifest.json"
        if mpath.is_file():
            v = _vocab_size(read_json(mpath, MANIFEST_FIX), directory)
            if counts.numel() != v:
                raise ValueError(f"{path}: {counts.numel()} counts, but the cache's base vocab_size is {v}")
        return counts
    if not scan:
        raise FileNotFoundError(f"{path} not found (a cache made before label counts; run "
                                f"`python -m data_prep.label_counts {directory.parent} --write`)")
    return scan_split(directory)


def coverage_table(train_counts: torch.Tensor, heldout_counts: torch.Tensor,
                   sizes: Iterable[int] = REPORT_SIZES) -> list[dict]:
    """Per N: the draft vocabulary chosen from ``train_counts`` and its coverage of both splits.

    Returns rows ``{"N", "train_coverage", "heldout_coverage"}`` (floats in [0, 1]; NaN for an
    empty split); sizes above V are clipped to V and duplicates dropped.
    """
    from heads.draft_vocab import coverage, select_d2t

    v = int(train_counts.numel())
    rows, seen = [], set()
    for n in sizes:
        n = min(int(n), v)
        if n < 2 or n in seen:
            continue
        seen.add(n)
        d2t = select_d2t(train_counts, n)
        rows.append({"N": n, "train_coverage": coverage(train_counts, d2t),
                     "heldout_coverage": coverage(heldout_counts, d2t)})
    return rows


def format_coverage(rows: Sequence[dict], heldout_labels: int) -> str:
    """One line per N: ``top N: held-out x.xx% (train y.yy%)``; an empty split's coverage (NaN) shows as ``-``."""
    def pct(x: float) -> str:
        return f"{100 * x:6.2f}%" if x == x else f"{'-':>7}"

    head = f"label coverage of the top-N training labels on the held-out split ({heldout_labels:,} labels):"
    body = [f"  top {r['N']:>6,}: held-out {pct(r['heldout_coverage'])}   train {pct(r['train_coverage'])}" for r in rows]
    return "\n".join([head, *body])


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m data_prep.label_counts CACHE_DIR [--write] [--sizes 2048,4096,...]``.

    Prints the held-out coverage table (counts read or scanned); ``--write`` stores
    ``label_counts.safetensors`` in both splits (for caches made before label counts).
    """
    import argparse

    from core.config import UserInputError

    p = argparse.ArgumentParser(prog="python -m data_prep.label_counts", description=main.__doc__)
    p.add_argument("cache_dir")
    p.add_argument("--write", action="store_true")
    p.add_argument("--sizes", default=",".join(str(s) for s in REPORT_SIZES))
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    root = Path(args.cache_dir)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        print(f"error: --sizes={args.sizes!r}: expected comma-separated integers", file=sys.stderr)
        return 2
    try:
        counts = {split: load_counts(root / split) for split in ("train", "val")}
        if args.write:
            for split, c in counts.items():
                write_split_counts(root / split, c)
    except (FileNotFoundError, ValueError, UserInputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = coverage_table(counts["train"], counts["val"], sizes)
    if args.json:
        print(json.dumps({"cache": str(root), "heldout_labels": int(counts["val"].sum()),
                          "train_labels": int(counts["train"].sum()), "rows": rows}, indent=1))
    else:
        print(format_coverage(rows, int(counts["val"].sum())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
