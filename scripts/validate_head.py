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

from typing import Any, Iterable

import torch

from _heads_cli import run_per_checkpoint
from train.module import accumulate_metrics


@torch.no_grad()
def validate(head, batches: Iterable[dict[str, Any]]) -> dict[str, float]:
    """``{metric: Σ sum / Σ count}`` of ``head.validation_metrics`` over ``batches`` (collated cache batches)."""
    sums: dict[str, torch.Tensor] = {}
    for batch in batches:
        accumulate_metrics(sums, head.validation_metrics(batch))
    return {n: float(s) / float(c) if c > 0 else float("nan") for n, (s, c) in sorted(sums.items())}


if __name__ == "__main__":
    run_per_checkpoint(__doc__, validate)
