"""Speculative vs vanilla greedy tokens/s in one run, with reference drafters, on the real base.

What it measures (all greedy, batch size 1, same prompts, same process, interleaved):

* ``vanilla``: KV-cached greedy decoding (:func:`decoding.vanilla.greedy_generate`).
* ``oracle``: :class:`decoding.reference.OracleDrafter` (the base model's own greedy chain plus
  wrong siblings).  Its drafting costs ``depth`` base forwards, so its wall clock is not a
  method's; ``verify_only_tokens_per_s`` = tokens / (time − drafter time) is the **ceiling** a
  free drafter with the same acceptance would reach: it isolates the runtime's verification
  and cache-compaction overhead.
* ``random``: :class:`decoding.reference.RandomDrafter` (τ ≈ 1): the pure overhead of verifying a
  tree that is never accepted.
* ``tree_forward_ms``: one base forward over a tree of N nodes after a fixed context, for the
  tree sizes heads may choose (``max_nodes``).

Outputs must equal vanilla on every prompt (checked; a mismatch exits 1).

    .venv/bin/python benchmarks/bench_decoding.py --num-prompts 4 --max-new-tokens 64 \
        --prompts ../shared/data/mt_bench_questions.jsonl --out runs/bench_decoding.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.base_model import load_base_model  # noqa: E402
from decoding.reference import OracleDrafter, RandomDrafter  # noqa: E402
from decoding.speculative import SpeculativeDecoder  # noqa: E402
from decoding.tree import DraftTree  # noqa: E402
from decoding.vanilla import eos_token_ids, greedy_generate  # noqa: E402
from decoding.verify import prefill, verify_tree  # noqa: E402
from evaluation.prompts import read_jsonl_prompts, template  # noqa: E402


def tree_forward_ms(model, prompt: torch.Tensor, sizes, repeats: int = 5) -> dict[int, float]:
    """Median ms of one verification forward over a random N-node tree (N incl. root) after ``prompt``."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        times = []
        for _ in range(repeats):
            cache, root, _ = prefill(model, prompt)
            paths = [torch.randint(0, model.config.vocab_size, (4,), generator=gen).tolist() for _ in range(n)]
            tree = DraftTree.from_paths(root, paths, max_nodes=n)
            t0 = time.perf_counter()
            verify_tree(model, cache, tree)
            times.append(time.perf_counter() - t0)
        out[n] = 1000 * sorted(times)[len(times) // 2]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="model.path (default: packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", default="/work/shared/data/mt_bench_questions.jsonl")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tree-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, ident = load_base_model({"path": args.model_path, "dtype": "float32", "attn_implementation": "eager"})
    eos = eos_token_ids(tok, model)
    prompts = [(pid, template(tok, msgs)) for pid, msgs in read_jsonl_prompts(args.prompts, limit=args.num_prompts)]
    decoders = {
        "oracle": SpeculativeDecoder(model, OracleDrafter(model, args.depth, args.width), eos),
        "random": SpeculativeDecoder(model, RandomDrafter(model.config.vocab_size, args.depth, args.width), eos),
    }
    greedy_generate(model, prompts[0][1], 4, eos)  # warm-up
    for dec in decoders.values():
        dec.generate(prompts[0][1], 4)
    acc = {k: {"tokens": 0, "seconds": 0.0, "drafter_seconds": 0.0, "emitted": 0, "steps": 0} for k in ["vanilla", *decoders]}
    mismatches = []
    for pid, ids in prompts:
        t0 = time.perf_counter()
        ref, _ = greedy_generate(model, ids, args.max_new_tokens, eos)
        acc["vanilla"]["seconds"] += time.perf_counter() - t0
        acc["vanilla"]["tokens"] += len(ref)
        for name, dec in decoders.items():
            t0 = time.perf_counter()
            out, st = dec.generate(ids, args.max_new_tokens)
            a = acc[name]
            a["seconds"] += time.perf_counter() - t0
            a["tokens"] += len(out)
            a["drafter_seconds"] += st["drafter_seconds"]
            a["emitted"] += sum(st["emitted_per_step"])
            a["steps"] += st["steps"]
            if out != ref:
                mismatches.append(f"{name}:{pid}")
    van_tps = acc["vanilla"]["tokens"] / acc["vanilla"]["seconds"]
    result = {"model": ident.source, "threads": torch.get_num_threads(), "num_prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "depth": args.depth, "width": args.width,
              "vanilla_tokens_per_s": van_tps, "mismatches": mismatches}
    for name in decoders:
        a = acc[name]
        tps = a["tokens"] / a["seconds"]
        verify_only = a["tokens"] / (a["seconds"] - a["drafter_seconds"])
        result[name] = {"tau": a["emitted"] / a["steps"] if a["steps"] else None, "tokens_per_s": tps,
                        "speedup": tps / van_tps, "drafter_time_share": a["drafter_seconds"] / a["seconds"],
                        "verify_only_tokens_per_s": verify_only, "verify_only_speedup": verify_only / van_tps}
    sizes = [int(s) for s in args.tree_sizes.split(",")]
    result["tree_forward_ms"] = tree_forward_ms(model, prompts[0][1], sizes)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        from core.io import atomic_write_text

        atomic_write_text(args.out, text + "\n")
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
