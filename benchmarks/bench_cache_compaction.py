"""KV-cache compaction after a verification step: moving only the accepted tree slots
(:func:`decoding.verify.keep_cache_positions`) against an index-select of every whole layer (what it
did before), on SmolLM2-135M's cache shape, in one run.

After a tree of N nodes is verified at cache length P, the cache keeps positions [0, P) and the root
plus the accepted path.  Each round times both on the same caches (alternating which goes first) and
checks that they leave identical tensors.  Reports ms per compaction (all layers) per (P, accepted).

    .venv/bin/python benchmarks/bench_cache_compaction.py --threads 2 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from decoding.verify import keep_cache_positions  # noqa: E402


def whole_layer_gather(cache, past: int, keep: torch.Tensor) -> None:
    """The reference: every layer rebuilt by an index-select of [0, P) + P + keep."""
    idx = torch.cat([torch.arange(past), past + keep])
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)


def make_cache(layers: int, kv_heads: int, head_dim: int, length: int, dtype, seed: int):
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for i in range(layers):
        k = torch.randn(1, kv_heads, length, head_dim, generator=g).to(dtype)
        cache.update(k, torch.randn(1, kv_heads, length, head_dim, generator=g).to(dtype), i)
    return cache


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="256,512,1024", help="cache lengths P before the tree")
    ap.add_argument("--tree-nodes", type=int, default=9)
    ap.add_argument("--accepted", default="0,1,3", help="accepted drafts (the root is kept besides)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = []
    for past in (int(x) for x in args.contexts.split(",")):
        for acc in (int(x) for x in args.accepted.split(",")):
            # a non-contiguous accepted path: the root, then every other node (a branching tree's layout)
            keep = torch.tensor([0] + [min(2 * j + 1, args.tree_nodes - 1) for j in range(acc)])
            times = {"moved_slots": [], "whole_layer_gather": []}
            for r in range(args.rounds):
                order = ("moved_slots", "whole_layer_gather") if r % 2 == 0 else ("whole_layer_gather", "moved_slots")
                for name in order:
                    fn = keep_cache_positions if name == "moved_slots" else whole_layer_gather
                    caches = [make_cache(args.layers, args.kv_heads, args.head_dim, past + args.tree_nodes, dtype, s)
                              for s in range(args.repeats)]
                    t0 = time.perf_counter()
                    for c in caches:
                        fn(c, past, keep)
                    times[name].append(1e3 * (time.perf_counter() - t0) / args.repeats)
            a = make_cache(args.layers, args.kv_heads, args.head_dim, past + args.tree_nodes, dtype, 0)
            b = make_cache(args.layers, args.kv_heads, args.head_dim, past + args.tree_nodes, dtype, 0)
            keep_cache_positions(a, past, keep)
            whole_layer_gather(b, past, keep)
            same = all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.layers, b.layers))
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"context": past, "accepted": acc, "ms_moved_slots": med["moved_slots"],
                         "ms_whole_layer_gather": med["whole_layer_gather"],
                         "speedup": med["whole_layer_gather"] / med["moved_slots"], "identical": same})
    print(json.dumps({"dtype": args.dtype, "threads": torch.get_num_threads(), "layers": args.layers,
                      "tree_nodes": args.tree_nodes, "rows": rows}, indent=2))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
