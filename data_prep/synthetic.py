"""A synthetic cache in the real :mod:`data_prep.cache` format, for tests and benchmarks.

Random token sequences run through a (tiny) base model: the same shards, manifest and record
contract as ``python -m data_prep`` writes, without chat data or templating.
"""
from __future__ import annotations

from pathlib import Path

import torch

from core.base_model import load_base_model
from data_prep import cache as C


def write_random_cache(root: str | Path, model_dir: str | Path, *, n_train: int, n_val: int, layers=(),
                       length_range: tuple[int, int] = (6, 20), mask_start=None, shard_size: int = 8,
                       tag: str = "test") -> Path:
    """A cache in the real ``data_prep.cache`` format over random token sequences.

    Each record is a random sequence of length ``T ~ U[length_range)`` run through the base model
    at ``model_dir`` (fp32, eager attention): greedy ``labels`` are the argmax of its logits,
    ``hidden`` the final post-norm layer hs[L] plus ``layers``.  The loss mask is True from
    ``mask_start(T, generator)`` on (default: a random start in [1, 4), drawn after the ids).
    Splits ``root/train`` (seed 1) and ``root/val`` (seed 2); the manifest's config hash is ``tag``.

    Returns:
        ``root``.
    """
    root = Path(root)
    layers = [int(l) for l in layers]
    if mask_start is None:
        mask_start = lambda T, g: int(torch.randint(1, 4, (1,), generator=g))  # noqa: E731
    model, _, identity = load_base_model({"path": str(model_dir), "dtype": "float32", "attn_implementation": "eager"})
    L = int(model.config.num_hidden_layers)
    for split, n, seed in (("train", n_train, 1), ("val", n_val, 2)):
        g = torch.Generator().manual_seed(seed)
        records = []
        for i in range(n):
            T = int(torch.randint(*length_range, (1,), generator=g))
            ids = torch.randint(3, int(model.config.vocab_size), (1, T), generator=g)
            with torch.no_grad():
                out = model(input_ids=ids, output_hidden_states=True)
            mask = torch.zeros(T, dtype=torch.bool)
            mask[mask_start(T, g):] = True
            records.append({"input_ids": ids[0], "loss_mask": mask, "labels": out.logits[0].argmax(-1),
                            "hidden": {l: out.hidden_states[l][0] for l in {L, *layers}}, "id": f"{split}{i}"})
        directory = root / split
        directory.mkdir(parents=True, exist_ok=True)
        shards = [records[i:i + shard_size] for i in range(0, len(records), shard_size)]
        for k, recs in enumerate(shards):
            C.write_shard(directory, k, C.build_shard_tensors(recs, layers, L, torch.float32),
                          [r["id"] for r in recs], {"config_hash": tag, "dropped": {}})
        C.write_manifest(directory, len(shards), {"config_hash": tag, "base": identity.to_dict(), "final_layer": L,
                                                  "layers": list(layers), "hidden_size": int(model.config.hidden_size),
                                                  "pad_id": 2, "split": split})
    return root
