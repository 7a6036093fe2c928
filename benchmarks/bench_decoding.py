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
* ``tree_forward_ms`` / ``cost_model``: c(n), one verification forward over a tree of n nodes after
  ``--context-tokens`` cached tokens (the measurement ``eval.tree=auto`` caches per base, device,
  dtype and threads), with its key and c(n)/c(1); ``--cost-only`` measures just this, in every
  dtype of ``--dtypes`` (issue 26's fp32 against bf16 table: the dtypes interleaved round by round
  on one copy of the weights each, best median per n kept, so load hits both alike);
  ``--dtypes float32,float32:prepacked`` compares ``F.linear`` with oneDNN-prepacked weights
  (:mod:`decoding.prepacked`, what ``eval.prepack_weights=auto`` does to an fp32 base, and to a bf16
  base on a CPU with AMX: ``bfloat16:prepacked``).

Outputs must equal vanilla on every prompt (checked; a mismatch exits 1).

    .venv/bin/python benchmarks/bench_decoding.py --num-prompts 4 --max-new-tokens 64 \
        --prompts ../shared/data/mt_bench_questions.jsonl --out runs/bench_decoding.json
    .venv/bin/python benchmarks/bench_decoding.py --cost-only --dtypes float32,bfloat16 --threads 2
    .venv/bin/python benchmarks/bench_decoding.py --cost-only --dtypes float32,float32:prepacked --threads 2
    .venv/bin/python benchmarks/bench_decoding.py --cost-only --dtypes float32:prepacked,float32:auto --threads 2
"""
from __future__ import annotations

import argparse
import functools
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
from decoding.cost_model import cost_key, measure_verify_ms  # noqa: E402
from decoding.vanilla import eos_token_ids, greedy_generate  # noqa: E402
from evaluation.prompts import read_jsonl_prompts, template  # noqa: E402


def tree_forward_ms(model, sizes, context_tokens: int = 256, repeats: int = 5, clock: str = "wall") -> dict[int, float]:
    """c(n): median ms of one verification forward over a random n-node tree (root incl.) after
    ``context_tokens`` cached tokens — :func:`decoding.cost_model.measure_verify_ms`, the measurement
    ``eval.tree=auto`` caches and searches over."""
    return dict(zip(sizes, measure_verify_ms(model, sizes, context_tokens, repeats, clock=clock)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="model.path (default: packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", default="/work/shared/data/mt_bench_questions.jsonl")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tree-sizes", default="1,2,3,4,6,8,12,16,24,32,48,64")
    ap.add_argument("--context-tokens", type=int, default=256, help="cached tokens before the tree in c(n)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per tree size (median)")
    ap.add_argument("--cost-only", action="store_true", help="measure and print only the cost model c(n)")
    ap.add_argument("--dtypes", default="float32",
                    help="with --cost-only: comma-separated dtypes, interleaved; <dtype>:prepacked = with the linear "
                         "weights prepacked for oneDNN (decoding/prepacked.py)")
    ap.add_argument("--rounds", type=int, default=2, help="with --cost-only: interleaved rounds per dtype (best kept)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="c(n) clock: wall (what a run pays) | cpu (process CPU time; robust to a loaded machine at 1 thread)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, ident = load_base_model({"path": args.model_path, "dtype": "float32", "attn_implementation": "eager"})
    eos = eos_token_ids(tok, model)
    sizes = [int(s) for s in args.tree_sizes.split(",")]
    if args.cost_only:
        return _emit(cost_table(model, ident, sizes, args), args.out, 0)
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
    ms = tree_forward_ms(model, sizes, args.context_tokens, args.repeats, args.clock)
    result["tree_forward_ms"] = ms
    result["cost_model"] = {"key": cost_key(ident, model, sizes, args.context_tokens, args.repeats), "clock": args.clock,
                            "tree_forward_ms": ms, "relative_to_one_token": {n: v / ms[sizes[0]] for n, v in ms.items()}}
    return _emit(result, args.out, 1 if mismatches else 0)


def cost_table(model, ident, sizes, args) -> dict:
    """c(n) in each of ``args.dtypes``: the fp32 weights cast once per dtype, then ``args.rounds``
    rounds of :func:`tree_forward_ms` alternating the dtypes; per dtype and n the lowest median."""
    import copy

    from decoding.prepacked import ROW_CONSISTENT_DTYPES, prepack_linear_weights, prepack_row_consistent

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    models = {}
    for d in dtypes:  # "<dtype>" or "<dtype>:prepacked" (decoding/prepacked.py: oneDNN-reordered weights)
        name, _, variant = d.partition(":")
        if variant not in ("", "prepacked", "auto") or (variant == "auto" and name != "float32"):
            raise SystemExit(f"--dtypes entry {d!r}: expected <dtype>, <dtype>:prepacked or float32:auto")
        m = model if d == "float32" else copy.deepcopy(model).to(getattr(torch, name))
        # bf16 / fp16: packed for every row count where row-consistent (what eval.prepack_weights does to them);
        # float32:prepacked from 3 rows; float32:auto per shape from 1, 2 or 3 rows, as timed (eval.prepack_weights=auto)
        if m.dtype in ROW_CONSISTENT_DTYPES:
            pack = prepack_row_consistent
        else:
            pack = functools.partial(prepack_linear_weights, min_rows="auto" if variant == "auto" else 3)
        if variant and not pack(m, dtypes=(m.dtype,)):
            raise SystemExit(f"--dtypes entry {d!r}: this CPU cannot prepack (row-consistently) {name} linear weights")
        models[d] = m
    best: dict[str, dict[int, float]] = {d: {} for d in dtypes}
    for _ in range(max(int(args.rounds), 1)):
        for d, m in models.items():
            for n, v in tree_forward_ms(m, sizes, args.context_tokens, args.repeats, args.clock).items():
                best[d][n] = min(v, best[d].get(n, float("inf")))
    one = sizes[0]
    out = {"threads": torch.get_num_threads(), "clock": args.clock, "context_tokens": args.context_tokens, "cost_models": {}}
    for d, ms in best.items():
        out["cost_models"][d] = {"key": cost_key(ident, models[d], sizes, args.context_tokens, args.repeats),
                                 "tree_forward_ms": ms, "relative_to_one_token": {n: v / ms[one] for n, v in ms.items()}}
    if any(d.partition(":")[0] == "bfloat16" for d in dtypes):
        out["bf16_support"] = _bf16_warning()
    if "float32" in best:
        out["relative_to_fp32_one_token"] = {d: {n: v / best["float32"][one] for n, v in ms.items()} for d, ms in best.items()}
    print("| n | " + " | ".join(f"{d} ms | {d} c(n)/c(1)" for d in dtypes) + " |", file=sys.stderr)
    for n in sizes:
        print(f"| {n} | " + " | ".join(f"{best[d][n]:.1f} | {best[d][n] / best[d][one]:.2f}" for d in dtypes) + " |",
              file=sys.stderr)
    return out


def _bf16_warning() -> dict:
    """This CPU's bf16 level (core.precision.bf16_support) for the JSON, and a stderr warning when it
    is not native: an emulated or slow bf16 c(n) is not the machine's fast path, so it must not be read
    as one (model.dtype=auto would not pick it)."""
    from core.precision import bf16_support

    support = bf16_support("cpu")
    if not support.native:
        print(f"warning: bf16 on this CPU is {support.level}: {support.reason}; its c(n) below is not this "
              f"machine's fast path (model.dtype=auto resolves to float32 here)", file=sys.stderr)
    return {"level": support.level, "reason": support.reason}


def _emit(result, out, rc: int) -> int:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        from core.io import atomic_write_text

        atomic_write_text(out, text + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
