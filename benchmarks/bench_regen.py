"""Regeneration (``labels=regenerate``) against bare batched ``model.generate``, over batch sizes.

One process, one loaded base (the real packaged SmolLM2-135M-Instruct unless ``--model-path``),
real ShareGPT conversations from the packaged file (``data_prep.front``: the same reading, split
and templating as ``python -m data_prep``).  For each batch size B, interleaved ``--repeats``
times (the order alternates):

* **ours**: :func:`data_prep.labels.regenerate` shard by shard (``--shard-size`` conversations,
  as ``data_prep.pipeline`` calls it), ``batch_size=B``: every assistant turn of every
  conversation, in order, each following the regenerated turns before it;
* **bare generate**: the same turns as independent prompts (each turn's full regenerated
  context, its budget ``min(max_new_tokens, max_length - context)``), shard by shard, sorted
  by context length into left-padded batches of B, through ``model.generate`` (greedy, KV cache,
  stops at the end-of-turn ids); its tokens are counted up to each row's end-of-turn or budget.

Both run on the same model object (same dtype, attention ``sdpa``: the fastest this machine has
for both; ours would switch an ``eager`` base to ``sdpa`` anyway).  Reported per B: tokens/s of
both (best wall time of the repeats, and process CPU seconds), their ratio, rows per forward
(ours), and whether both produced the same tokens.  ``--agree-turns K`` then decodes K of our
turns (from the largest B) at batch 1 with ``model.generate`` and reports the share identical
to ours: in bfloat16 a near-tie can differ between batch shapes (fp32: expect 100 %).
``--fp32-batch-size`` repeats one size in float32 for reference; ``--old-rev REV`` also times
the regeneration of git revision REV (e.g. the one before continuous batching) in float32 with
eager attention, its own default then (``prep.gen_batch_size=64``), on the same conversations.

    python benchmarks/bench_regen.py --conversations 32 --max-new-tokens 32 --batch-sizes 4,16,32
    python benchmarks/bench_regen.py --conversations 32 --max-new-tokens 32 --batch-sizes 16,32 --prepacked  # AMX
    # the figure of record (quiet machine):
    python benchmarks/bench_regen.py --conversations 128 --max-new-tokens 128 \\
        --batch-sizes 1,4,8,16,32,64,128 --fp32-batch-size 32 --agree-turns 64 --old-rev fa53138
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core.config import compose  # noqa: E402
from data_prep.labels import conversation_groups, regen_sources, regenerate  # noqa: E402
from data_prep.pipeline import read_split, shard_records, template_split  # noqa: E402
from data_prep.template import end_of_turn_ids  # noqa: E402


def turns_of(outputs, max_new: int | None, max_length: int) -> list[tuple[list[int], list[int], int]]:
    """Each regenerated reply as ``(context, reply, budget)`` (maximal runs of the loss mask)."""
    out = []
    for ids, mask in outputs:
        t = 0
        while t < len(ids):
            if not mask[t]:
                t += 1
                continue
            e = t
            while e < len(ids) and mask[e]:
                e += 1
            room = max_length - t
            out.append((ids[:t], ids[t:e], room if max_new is None else min(max_new, room)))
            t = e
    return out


def cut_at_eos(row: list[int], eos: set[int], budget: int) -> list[int]:
    got = []
    for tok in row[:budget]:
        got.append(tok)
        if tok in eos:
            break
    return got


@torch.inference_mode()
def bare_generate(model, turns, eos: set[int], pad: int, batch_size: int) -> list[list[int]]:
    """``model.generate`` over length-sorted left-padded batches; per turn its tokens (to eos / budget)."""
    order = sorted(range(len(turns)), key=lambda i: (len(turns[i][0]), i))
    result: list[list[int]] = [[] for _ in turns]
    for b in range(0, len(order), batch_size):
        chunk = order[b: b + batch_size]
        T = max(len(turns[i][0]) for i in chunk)
        ids = torch.full((len(chunk), T), pad, dtype=torch.long)
        attn = torch.zeros((len(chunk), T), dtype=torch.long)
        for r, i in enumerate(chunk):
            p = turns[i][0]
            ids[r, T - len(p):] = torch.tensor(p)
            attn[r, T - len(p):] = 1
        gen = model.generate(ids, attention_mask=attn, do_sample=False, max_new_tokens=max(turns[i][2] for i in chunk),
                             eos_token_id=sorted(eos), pad_token_id=pad, top_k=None, top_p=None,
                             temperature=None)[:, T:].tolist()
        for r, i in enumerate(chunk):
            result[i] = cut_at_eos(gen[r], eos, turns[i][2])
    return result


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def ours(regen, model, tok, shards, eos, max_new, max_length, batch_size, old: bool = False):
    """``regen`` over each shard of templated records; per shard its ``(ids, mask)`` records.  ``old``:
    a ``regenerate`` from before RegenSource (it took each record's segments, one output each)."""
    outputs, stats, calls = [], Counter(), [0]

    def count(n):
        calls[0] += 1

    for shard in shards:
        if old:
            outputs.append(regen(model, tok, [c.segments for c in shard], eos, max_new, max_length, batch_size,
                                 on_generated=count, stats=stats))
        else:
            out = regen(model, tok, regen_sources(shard), eos, max_new, max_length, batch_size, on_generated=count,
                        stats=stats)
            outputs.append([r for records in out for r in records])
    return outputs, stats, calls[0]


def sweep(model, tok, shards, eos, args, sizes, label: str) -> tuple[list[dict], list]:
    """Ours and bare generate at each batch size, interleaved (repeat 0 runs ours first: it defines the turns)."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    rows, turns = [], []
    for B in sizes:
        best: dict[str, dict] = {}
        shard_turns: list = []
        for rep in range(args.repeats):
            for which in (("ours", "bare") if rep % 2 == 0 else ("bare", "ours")):
                if which == "ours":
                    (outputs, stats, calls), wall, cpu = timed(
                        lambda: ours(regenerate, model, tok, shards, eos, args.max_new_tokens, args.max_length, B))
                    shard_turns = [turns_of(out, args.max_new_tokens, args.max_length) for out in outputs]
                    n = stats["generated_tokens"]
                    extra = {"turns": stats["turns"], "cut": stats["truncated_turns"], "forwards": calls}
                else:
                    gen, wall, cpu = timed(lambda: [bare_generate(model, t, eos, pad, B) for t in shard_turns])
                    n = sum(len(g) for g_s in gen for g in g_s)
                    extra = {"same": all(g == t[1] for g_s, t_s in zip(gen, shard_turns) for g, t in zip(g_s, t_s))}
                if which not in best or wall < best[which]["wall_s"]:
                    best[which] = {"tokens": n, "wall_s": wall, "cpu_s": cpu, **extra}
        o, b = best["ours"], best["bare"]
        row = {"dtype": label, "batch_size": B,
               "ours_tok_s": round(o["tokens"] / o["wall_s"], 2),
               "bare_generate_tok_s": round(b["tokens"] / b["wall_s"], 2),
               "ratio_wall": round((o["tokens"] / o["wall_s"]) / (b["tokens"] / b["wall_s"]), 3),
               "ours_tok_per_cpu_s": round(o["tokens"] / o["cpu_s"], 2),
               "bare_tok_per_cpu_s": round(b["tokens"] / b["cpu_s"], 2),
               "ratio_cpu": round((o["tokens"] / o["cpu_s"]) / (b["tokens"] / b["cpu_s"]), 3),
               "tokens": o["tokens"], "turns": o["turns"], "cut_turns": o["cut"],
               "rows_per_forward": round(o["tokens"] / max(o["forwards"], 1), 2),
               "same_tokens_as_bare": b["same"], "load_avg": _load()}
        print(json.dumps(row), flush=True)
        rows.append(row)
        turns = [t for t_s in shard_turns for t in t_s]
    return rows, turns


@torch.inference_mode()
def agreement(model, tok, turns, eos, k: int) -> dict:
    """Share of ``k`` of our turns equal to batch-1 ``model.generate`` of the same context."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    step = max(1, len(turns) // max(k, 1))
    picked = turns[::step][:k]
    same = tokens_same = tokens = 0
    for ctx, reply, budget in picked:
        ref = bare_generate(model, [(ctx, reply, budget)], eos, pad, 1)[0]
        same += ref == reply
        n = next((i for i, (a, b) in enumerate(zip(ref, reply)) if a != b), min(len(ref), len(reply)))
        tokens_same += n
        tokens += len(reply)
    return {"turns": len(picked), "identical_turns": same, "identical_share": same / max(len(picked), 1),
            "tokens_before_first_difference_share": tokens_same / max(tokens, 1)}


def _load() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return None


def load_old_regenerate(rev: str):
    """``regenerate`` from ``data_prep/labels.py`` at git revision ``rev`` (a temporary module)."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:data_prep/labels.py"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="old_labels_")) / "old_labels.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_labels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_labels"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.regenerate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="base model (default: the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--conversations", type=int, default=64, help="data.max_conversations (train + held-out)")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=128, help="per turn; 0 = full length (prep.max_new_tokens=null)")
    ap.add_argument("--shard-size", type=int, default=64, help="conversations per regenerate call (prep.shard_size)")
    ap.add_argument("--batch-sizes", default="1,4,8,16,32,64,128")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--fp32-batch-size", type=int, default=0, help="also sweep this one size in float32")
    ap.add_argument("--agree-turns", type=int, default=0, help="turns decoded at batch 1 for the agreement share")
    ap.add_argument("--old-rev", default=None, help="also time regenerate() from this git revision (fp32, eager, B=64)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--prepacked", action="store_true",
                    help="pack the --dtype base's bf16/fp16 linear weights for every product first "
                         "(decoding.prepacked.prepack_row_consistent), for ours and bare generate alike")
    args = ap.parse_args()
    args.max_new_tokens = args.max_new_tokens or None
    if args.threads:
        torch.set_num_threads(args.threads)
    from core.base_model import load_base_model

    cfg = compose([f"data.max_conversations={args.conversations}", f"data.max_length={args.max_length}"]
                  + ([f"model.path={args.model_path}"] if args.model_path else []))
    sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    header = {"threads": torch.get_num_threads(), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"), "max_length": args.max_length, "max_new_tokens": args.max_new_tokens,
              "shard_size": args.shard_size, "load_avg_start": _load()}
    results = {"setup": header, "rows": []}

    def prepared(dtype):
        model, tok, _ = load_base_model({**dict(cfg.model), "dtype": dtype, "attn_implementation": "sdpa"})
        eos = end_of_turn_ids(tok, model)
        templated = template_split(tok, read_split(cfg.data), eos, args.max_length)
        convs = templated["train"] + templated["val"]
        shards = shard_records(convs, args.shard_size, by_conversation=True)
        return model, tok, eos, shards

    model, tok, eos, shards = prepared(args.dtype)
    if args.prepacked:
        from decoding.prepacked import prepack_row_consistent

        if not prepack_row_consistent(model):
            raise SystemExit(f"--prepacked: this CPU cannot pack {args.dtype} linear weights row-consistently")
    header.update({"model": args.model_path or "SmolLM2-135M-Instruct (packaged)", "dtype": args.dtype,
                   "prepacked": bool(args.prepacked), "conversations": sum(len(conversation_groups(s)) for s in shards)})
    print(json.dumps(header), flush=True)
    rows, turns = sweep(model, tok, shards, eos, args, sizes, args.dtype)
    results["rows"] += rows
    if args.agree_turns and turns:
        results[f"agreement_{args.dtype}_batch_{sizes[-1]}_vs_batch_1"] = agreement(model, tok, turns, eos, args.agree_turns)
        print(json.dumps(results[f"agreement_{args.dtype}_batch_{sizes[-1]}_vs_batch_1"]), flush=True)
    if args.fp32_batch_size or args.old_rev:
        del model
        model, tok, eos, shards = prepared("float32")
        if args.fp32_batch_size:
            rows, turns = sweep(model, tok, shards, eos, args, [args.fp32_batch_size], "float32")
            results["rows"] += rows
        if args.old_rev:
            old = load_old_regenerate(args.old_rev)
            model.set_attn_implementation("eager")  # its default then (configs/model/smollm2.yaml)
            (_, stats, _), wall, cpu = timed(lambda: ours(old, model, tok, shards, eos, args.max_new_tokens,
                                                          args.max_length, 64, old=True))
            model.set_attn_implementation("sdpa")
            results["old"] = {"rev": args.old_rev, "dtype": "float32", "attn": "eager", "batch_size": 64,
                              "tokens": stats["generated_tokens"], "tok_s": stats["generated_tokens"] / wall,
                              "tok_per_cpu_s": stats["generated_tokens"] / cpu, "load_avg": _load()}
            print(json.dumps(results["old"]), flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
