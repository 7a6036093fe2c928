"""Evaluation precision on the real base (issue 26): fp32 against bf16, interleaved in one run.

Subcommands (each writes JSON to ``--out`` and prints it; prompts: held-out ShareGPT first turns,
never MT-bench):

* ``cost``: c(n) for n = 1..64 with the cost model's own measurement
  (:func:`decoding.cost_model.measure_verify_ms`), fp32 vs bf16 (native one-row kernels) vs bf16
  with row-consistent one-token steps (:mod:`decoding.numerics`, ``eval.row_consistent``), one
  round of every variant after another so that load drift hits all alike; medians and c(n)/c(1).
* ``vanilla``: greedy tokens/s of :func:`decoding.vanilla.greedy_generate` for the same variants
  (and ``--attn eager,sdpa``), interleaved per prompt, same threads; outputs per variant kept so
  the bf16 variants can be compared with each other.  ``--profile`` adds a torch-profiler table of
  one one-token step per variant (where the time goes: GEMMs, attention, Python per layer).
* ``rows``: how often verification disagrees with sequential decoding, per candidate cause: on
  vanilla's own trajectory, every ``--stride``-th position gets a chain verification of n tokens
  from vanilla's cache; per variant the share of rows whose logits equal the one-token step's bit
  for bit and whose argmax agrees, and (``--oracle``) the first divergence of
  ``checkpoint=oracle`` speculative decoding from vanilla per prompt.  Variants: ``bf16`` (native),
  ``bf16-rc`` (row-consistent), ``bf16-lmhead32`` (native, LM head in fp32), ``bf16-sdpa``, ``fp32``.
* ``bound``: the error of bf16 logits against fp32 on the difference of fp32's top two tokens,
  |(z16[a] − z16[b]) − (z32[a] − z32[b])| in units of ulp_bf16(max |z32|), teacher-forced over prompt +
  bf16 greedy continuation: the measurement behind ``evaluation.divergence.NEAR_TIE_ULPS``.

    nice -n 5 .venv/bin/python benchmarks/bench_precision_eval.py cost --threads 1 --out outputs/bench/cost.json
    nice -n 5 .venv/bin/python benchmarks/bench_precision_eval.py vanilla --threads 1 --num-prompts 8
    nice -n 5 .venv/bin/python benchmarks/bench_precision_eval.py rows --num-prompts 8 --oracle
    nice -n 5 .venv/bin/python benchmarks/bench_precision_eval.py bound --num-prompts 32
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

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.base_model import load_base_model  # noqa: E402
from decoding.cost_model import measure_verify_ms  # noqa: E402
from decoding.numerics import pad_one_row_products  # noqa: E402
from decoding.tree import DraftTree  # noqa: E402
from decoding.vanilla import eos_token_ids, greedy_generate  # noqa: E402
from decoding.verify import base_forward, new_cache  # noqa: E402


def held_out_prompts(tokenizer, n: int, max_conversations: int):
    """The first ``n`` held-out ShareGPT first turns (templated), as the evaluation's default prompts."""
    from core.config import compose
    from evaluation.prompts import load_prompts

    cfg = compose([f"eval.num_prompts={n}", f"data.max_conversations={max_conversations}", "eval.max_prompt_tokens=1024"])
    return load_prompts(cfg.eval, cfg.data, tokenizer)[0]


def fp32_lm_head(model) -> None:
    """The LM head computed in fp32 (hidden states upcast, weights upcast once): fp32 logits."""
    head = model.lm_head
    w32 = head.weight.detach().float()
    head.forward = lambda x: torch.nn.functional.linear(x.float(), w32)


def variants(names, model_path=None, attn_default="eager"):
    """``{name: model}`` for names like ``fp32``, ``bf16``, ``bf16-rc``, ``bf16-sdpa``, ``bf16-rc-sdpa``,
    ``bf16-lmhead32``; loaded once per (dtype, attention)."""
    loaded, out = {}, {}
    for name in names:
        parts = name.split("-")
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[parts[0]]
        attn = "sdpa" if "sdpa" in parts else attn_default
        if (dtype, attn) not in loaded:
            loaded[(dtype, attn)] = load_base_model({"path": model_path, "dtype": dtype, "attn_implementation": attn})
        model, tok, ident = loaded[(dtype, attn)]
        m = copy.deepcopy(model)
        if "rc" in parts:
            pad_one_row_products(m)
        if "lmhead32" in parts:
            fp32_lm_head(m)
        out[name] = m
    tok = next(iter(loaded.values()))[1]
    ident = next(iter(loaded.values()))[2]
    return out, tok, ident


def _median(v):
    return statistics.median(v) if v else None


def cmd_cost(args) -> dict:
    sizes = list(range(1, 65)) if args.sizes == "all" else [int(s) for s in args.sizes.split(",")]
    models, _, _ = variants(args.variants.split(","), args.model_path)
    times = {k: [[] for _ in sizes] for k in models}
    for r in range(args.rounds):
        for name, m in models.items():
            ms = measure_verify_ms(m, sizes, args.context_tokens, repeats=1, seed=r, clock=args.clock)
            for i, v in enumerate(ms):
                times[name][i].append(v)
    out = {}
    for name in models:
        med = [_median(t) for t in times[name]]
        out[name] = {"verify_ms": dict(zip(sizes, med)), "relative_to_one_token": dict(zip(sizes, [x / med[0] for x in med]))}
    ref = out[next(iter(models))]["verify_ms"][sizes[0]]
    for name in models:
        out[name]["c1_vs_first_variant"] = out[name]["verify_ms"][sizes[0]] / ref
    return {"c_n": out, "sizes": sizes, "rounds": args.rounds, "context_tokens": args.context_tokens, "clock": args.clock}


def _profile_step(model, ids) -> str:
    from torch.profiler import profile

    cache = new_cache(model)
    base_forward(model, ids, cache, logits_to_keep=1)
    base_forward(model, torch.tensor([5]), cache)
    with profile() as prof:
        base_forward(model, torch.tensor([5]), cache)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def cmd_vanilla(args) -> dict:
    names = [f"{v}-sdpa" if a == "sdpa" else v for a in args.attn.split(",") for v in args.variants.split(",")]
    models, tok, _ = variants(names, args.model_path)
    eos = eos_token_ids(tok, next(iter(models.values())))
    prompts = held_out_prompts(tok, args.num_prompts, args.max_conversations)
    for m in models.values():  # warm-up (allocator, kernels)
        greedy_generate(m, prompts[0].input_ids, 8, eos)
    tok_n = {k: 0 for k in models}
    sec = {k: 0.0 for k in models}
    outputs = {k: [] for k in models}
    for p in prompts:
        for name, m in models.items():
            t0 = time.perf_counter()
            out, _ = greedy_generate(m, p.input_ids, args.max_new_tokens, eos)
            sec[name] += time.perf_counter() - t0
            tok_n[name] += len(out)
            outputs[name].append(out)
    first = next(iter(models))
    res = {name: {"tokens": tok_n[name], "seconds": sec[name], "tokens_per_s": tok_n[name] / sec[name],
                  "vs_first_variant": (tok_n[name] / sec[name]) / (tok_n[first] / sec[first]),
                  "same_tokens_as": [o for o in models if outputs[o] == outputs[name] and o != name]}
           for name in models}
    fastest = max(res, key=lambda k: res[k]["tokens_per_s"])
    out = {"vanilla": res, "fastest_vanilla": fastest, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
           "note": "tokens/s include the prefill (wall clock per prompt, as the evaluation times vanilla)"}
    if args.profile:
        out["profile"] = {name: _profile_step(m, prompts[0].input_ids) for name, m in models.items()}
    return out


@torch.no_grad()
def cmd_rows(args) -> dict:
    models, tok, _ = variants(args.variants.split(","), args.model_path)
    eos = eos_token_ids(tok, next(iter(models.values())))
    prompts = held_out_prompts(tok, args.num_prompts, args.max_conversations)
    n = args.chain
    out = {}
    for name, m in models.items():
        rows = equal = agree = steps_n = verifies = 0
        first_div = []
        t_step = t_ver = 0.0
        for p in prompts:
            van, _ = greedy_generate(m, p.input_ids, args.max_new_tokens, eos)
            cache = new_cache(m)
            lg, _ = base_forward(m, p.input_ids, cache, logits_to_keep=1)
            steps, snaps = [lg[-1]], {}  # steps[j] chose van[j]; snaps[t]: vanilla's cache before van[t-1]
            for j, t in enumerate(van[:-1]):
                if j % args.stride == 0 and j + 1 < len(van) - n:
                    snaps[j + 1] = copy.deepcopy(cache)
                t0 = time.perf_counter()
                lg, _ = base_forward(m, torch.tensor([t]), cache)
                t_step += time.perf_counter() - t0
                steps_n += 1
                steps.append(lg[-1])
            for t, c in snaps.items():  # a chain of vanilla's next n tokens, verified from vanilla's cache
                tree = DraftTree.chain(van[t - 1], van[t:t + n - 1])
                past = c.get_seq_length()
                t0 = time.perf_counter()
                lg, _ = base_forward(m, tree.tokens, c, position_ids=tree.position_ids(past),
                                     attention_mask=tree.attention_mask(past, m.dtype, torch.device("cpu")))
                t_ver += time.perf_counter() - t0
                verifies += 1
                for i in range(n):
                    rows += 1
                    equal += bool(torch.equal(lg[i], steps[t + i]))
                    agree += int(lg[i].argmax()) == int(steps[t + i].argmax())
            if args.oracle:
                from decoding.reference import OracleDrafter
                from decoding.speculative import SpeculativeDecoder

                spec, _ = SpeculativeDecoder(m, OracleDrafter(m, depth=4, width=2), eos).generate(p.input_ids, args.max_new_tokens)
                first_div.append(next((j for j, (x, y) in enumerate(zip(van, spec)) if x != y),
                                      None if van == spec else min(len(van), len(spec))))
        out[name] = {"rows": rows, "bitwise_equal_share": equal / rows if rows else None,
                     "argmax_agree_share": agree / rows if rows else None, "argmax_disagreements": rows - agree,
                     "chain": n, "step_ms": 1e3 * t_step / max(steps_n, 1), "verify_ms": 1e3 * t_ver / max(verifies, 1)}
        if args.oracle:
            out[name]["oracle_first_divergence"] = first_div
            out[name]["oracle_diverged_prompts"] = sum(d is not None for d in first_div)
    return {"rows": out, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "stride": args.stride}


@torch.no_grad()
def cmd_bound(args) -> dict:
    from decoding.margins import top2
    from evaluation.divergence import NEAR_TIE_ULPS, ulp

    models, tok, _ = variants(["fp32", "bf16-rc"], args.model_path)
    m32, m16 = models["fp32"], models["bf16-rc"]
    eos = eos_token_ids(tok, m16)
    errs, flips = [], []
    for p in held_out_prompts(tok, args.num_prompts, args.max_conversations):
        cont, _ = greedy_generate(m16, p.input_ids, args.max_new_tokens, eos)
        ids = torch.cat([p.input_ids, torch.tensor(cont, dtype=torch.long)])[None]
        z16 = m16(input_ids=ids).logits[0].float()
        z32 = m32(input_ids=ids).logits[0].float()
        for r16, r32, (a, _, b, _) in zip(z16, z32, top2(z32)):
            u = ulp(float(r32.abs().max()), torch.bfloat16)
            errs.append(abs(float((r16[a] - r16[b]) - (r32[a] - r32[b]))) / u)
            a16 = int(r16.argmax())
            if a16 != a:
                flips.append(abs(float(r32[a] - r32[a16])) / u)
    errs.sort()
    q = lambda x: errs[min(len(errs) - 1, int(x * len(errs)))]  # noqa: E731
    return {"positions": len(errs), "error_ulps": {"median": q(0.5), "p99": q(0.99), "p999": q(0.999), "max": errs[-1]},
            "bf16_vs_fp32_argmax_flips": len(flips),
            "flip_fp32_gap_ulps": {"max": max(flips) if flips else None, "values": sorted(flips)[-20:]},
            "near_tie_ulps": NEAR_TIE_ULPS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["cost", "vanilla", "rows", "bound"])
    ap.add_argument("--model-path", default=None, help="model.path (default: packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--variants", default=None, help="comma-separated (see module doc)")
    ap.add_argument("--attn", default="eager", help="vanilla: attention implementations, e.g. eager,sdpa")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-conversations", type=int, default=2000, help="data.max_conversations for the held-out split")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sizes", default="all", help="cost: node counts (default 1..64)")
    ap.add_argument("--rounds", type=int, default=5, help="cost: interleaved rounds (median)")
    ap.add_argument("--context-tokens", type=int, default=256)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--chain", type=int, default=8, help="rows: verification chain length n")
    ap.add_argument("--stride", type=int, default=4, help="rows: verify every k-th position")
    ap.add_argument("--oracle", action="store_true", help="rows: also oracle speculative decoding vs vanilla")
    ap.add_argument("--profile", action="store_true", help="vanilla: profile one one-token step per variant")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    defaults = {"cost": "fp32,bf16,bf16-rc", "vanilla": "fp32,bf16,bf16-rc",
                "rows": "bf16,bf16-rc,bf16-lmhead32,bf16-sdpa,bf16-rc-sdpa,fp32", "bound": ""}
    args.variants = args.variants or defaults[args.what]
    result = {"cost": cmd_cost, "vanilla": cmd_vanilla, "rows": cmd_rows, "bound": cmd_bound}[args.what](args)
    result.update(threads=torch.get_num_threads(), torch=torch.__version__, command=" ".join(sys.argv))
    text = json.dumps(result, indent=1, default=str)
    print(text if "profile" not in result else text.replace("\\n", "\n"))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
