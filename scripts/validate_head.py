"""Re-run a trained head's validation metrics on a cache split (no training, no trainer).

Loads ``<checkpoint>/model.safetensors`` + ``config.json`` with ``heads.load`` and aggregates the
head's ``validation_metrics`` exactly as ``python -m train`` does (Σ sum / Σ count over the whole
split), so metrics added after a run was trained (e.g. Falcon's per-slot accuracy ``acc_slot<j>``)
can be read off old checkpoints, and checkpoints can be compared on another split.

    .venv/bin/python scripts/validate_head.py outputs/runs/falcon/falcon-tf640/best \
        --cache outputs/cache/real_tf640 [--split val] [--batch-size 4] [--out metrics.json]

Prints one JSON object ``{checkpoint: {metric: value}}``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import heads  # noqa: E402
from core.base_model import load_base_model  # noqa: E402
from core.io import atomic_write_json  # noqa: E402
from train.data import default_collate, open_split  # noqa: E402
from train.module import accumulate_metrics  # noqa: E402


@torch.no_grad()
def validate(head, reader, pad_id: int, batch_size: int) -> dict[str, float]:
    """``{metric: Σ sum / Σ count}`` of ``head.validation_metrics`` over every record of ``reader``."""
    collate = default_collate(pad_id)
    sums: dict[str, torch.Tensor] = {}
    for start in range(0, len(reader), batch_size):
        batch = collate([reader[i] for i in range(start, min(start + batch_size, len(reader)))])
        accumulate_metrics(sums, head.validation_metrics(batch))
    return {n: float(s) / float(c) if c > 0 else float("nan") for n, (s, c) in sorted(sums.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", help="exported head directories (best/ or last/)")
    ap.add_argument("--cache", required=True, help="prepared cache directory (with train/ and val/)")
    ap.add_argument("--split", default="val")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--model-path", default=None, help="base model (default: the packaged SmolLM2), as model.path")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    model, _, _ = load_base_model({"path": args.model_path, "dtype": "float32"})
    reader = open_split(args.cache, args.split)
    results = {}
    for ckpt in args.checkpoints:
        head, _ = heads.load(ckpt, base_model=model)
        head.eval()
        results[ckpt] = validate(head, reader, reader.pad_id, args.batch_size)
    print(json.dumps(results, indent=2))
    if args.out:
        atomic_write_json(args.out, results)


if __name__ == "__main__":
    main()
