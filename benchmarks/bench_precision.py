"""bf16 against fp32 on this CPU: GEMM limit, data prep, training step, label agreement, feature error.

Issue 26 ("Data prep in bf16" and the GEMM / data prep / training-step benchmark rows).  Everything
runs in one process, fp32 and bf16 interleaved (A, B, A, B, ...; best of each), so a shared
machine's load falls on both alike:

1. **GEMM limit** - GFLOP/s of ``F.linear`` in fp32 and bf16 at the pipeline's shapes (SmolLM2's
   projections and LM head at data prep's row count; a draft head's LM head over the default
   draft vocabulary at a training batch's row count).
2. **Data prep** - ``data_prep.pipeline.build_records`` (teacher-forced features and greedy labels,
   the exact code ``python -m data_prep`` runs) on the real packaged base (SmolLM2-135M,
   ``model.path=null``) in fp32 and in bf16: tokens/s, the ratio, and the share of the GEMM limit
   (useful FLOPs per token x tokens/s / GFLOP/s; FLOPs: 2 x every linear weight incl. the LM
   head, + 4 H t per layer for attention over t causal positions).
3. **Label agreement and feature error** on the same conversations: the share of positions whose
   bf16 greedy label equals fp32's (all positions and assistant positions), the fp32 top-2 logit
   margin at the disagreements (a near-tie: margin below ``--tie-margin``), and bf16-compute
   against fp32-compute hidden states (max / mean abs, relative), beside the error bf16 *storage*
   alone puts on the fp32 features (``prep.dtype=bfloat16``).
4. **Training step** - for every head at its default draft vocabulary (``heads.draft_vocab_size=auto``:
   16384 of SmolLM2's 49152), ``training_loss`` + ``backward`` + ``AdamW.step`` on batches of the
   fp32 features stored in bf16: fp32 against bf16-mixed (``torch.autocast("cpu", bfloat16)``
   around the forward, as Lightning's ``bf16-mixed`` does), steps interleaved; tokens/s, ratio,
   share of the limit (FLOPs of one step from ``torch.utils.flop_counter``), and the validation
   loss of both after the same steps (fp32 evaluation) beside a second fp32 run with another seed
   (the noise); with ``--val-steps`` as a curve, after steps 1, 2, 4, ... and the last.

    python benchmarks/bench_precision.py                           # modest size (minutes)
    python benchmarks/bench_precision.py --conversations 64 --max-length 512 --train-steps 40 --val-steps 200  # + val-loss curves
    python benchmarks/bench_precision.py --skip-train --attn eager,sdpa   # data prep only, both attentions

Writes the JSON report to ``--out`` (default: print only) and prints a Markdown summary.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HEAD_LAYERS = {"eagle3": [2, 15, 27], "adadecode": [8, 15, 22]}  # SmolLM2 defaults (L = 30)
HEADS = ("ctc", "falcon", "falcon_k1", "eagle3", "adadecode")


def gemm_limit(shapes: dict[str, tuple[int, int, int]], repeats: int, min_seconds: float = 0.25) -> dict:
    """Best GFLOP/s of ``F.linear([M,K], [N,K])`` per shape and dtype, fp32 and bf16 interleaved."""
    out = {}
    for name, (M, K, N) in shapes.items():
        g = torch.Generator().manual_seed(0)
        a32, w32 = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) / K ** 0.5
        mats = {"float32": (a32, w32), "bfloat16": (a32.bfloat16(), w32.bfloat16())}
        flops = 2.0 * M * K * N
        best = {k: 0.0 for k in mats}
        for dt, (a, w) in mats.items():  # warm-up (oneDNN primitive creation)
            F.linear(a, w)
        n = max(1, int(min_seconds * 50e9 / flops))
        for _ in range(repeats):
            for dt, (a, w) in mats.items():
                t0 = time.perf_counter()
                for _ in range(n):
                    F.linear(a, w)
                best[dt] = max(best[dt], flops * n / (time.perf_counter() - t0) / 1e9)
        out[name] = {"shape": [M, K, N], "gflops": best, "ratio": best["bfloat16"] / best["float32"]}
    return out


def linear_flops_per_token(model) -> float:
    """2 x every linear weight of the decoder layers + 2 x H x V of the LM head (the label argmax)."""
    n = sum(m.weight.numel() for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head"))
    return 2.0 * (n + model.get_output_embeddings().weight.numel())


def attention_flops(model, lengths) -> float:
    """QK^T and AV over causal positions: 4 H t per token at position t (1-based), per layer."""
    L, H = int(model.config.num_hidden_layers), int(model.config.hidden_size)
    return float(sum(4.0 * H * L * T * (T + 1) / 2 for T in lengths))


def bench_data_prep(models: dict, tok, convs, args, layers, L) -> tuple[dict, dict]:
    """tokens/s of build_records per ``(attention, dtype)`` model, all interleaved in every repeat;
    returns (report per attention, the last records per dtype of the first attention)."""
    from data_prep.pipeline import build_records

    records, best = {}, {k: 0.0 for k in models}
    tokens = None
    for _ in range(args.repeats):
        for key, model in models.items():
            t0 = time.perf_counter()
            recs, _ = build_records(model, tok, convs, labels_mode="teacher_forced", max_length=args.max_length,
                                    max_new_tokens=None, layers=layers, final_layer=L,
                                    batch_tokens=args.batch_tokens, gen_batch_size=1)
            seconds = time.perf_counter() - t0
            tokens = sum(len(r["input_ids"]) for r in recs)
            best[key] = max(best[key], tokens / seconds)
            if key[0] == next(iter(models))[0]:
                records[key[1]] = recs
    model = next(iter(models.values()))
    lengths = [len(r["input_ids"]) for r in records["float32"]]
    flops = (linear_flops_per_token(model) * tokens + attention_flops(model, lengths)) / tokens
    reference = best[next(iter(models))[0], "float32"]
    out = {}
    for attn in dict.fromkeys(a for a, _ in models):
        t = {dt: best[attn, dt] for dt in ("float32", "bfloat16")}
        out[attn] = {"tokens": tokens, "conversations": len(lengths), "tokens_per_s": t,
                     "ratio": t["bfloat16"] / t["float32"], "fp32_ratio_to_first_attention": t["float32"] / reference,
                     "flops_per_token": flops}
    return out, records


@torch.no_grad()
def agreement(records: dict, model32, tie_margin: float, L: int, layers) -> dict:
    """bf16 greedy labels against fp32 on the same positions, and the feature error (module doc)."""
    W = model32.get_output_embeddings().weight
    n = n_eq = n_as = n_as_eq = 0
    margins_dis, margins_all = [], []
    err = {}
    for r32, r16 in zip(records["float32"], records["bfloat16"]):
        assert r32["id"] == r16["id"]
        a, b = r32["labels"], r16["labels"]
        m = torch.as_tensor(r32["loss_mask"], dtype=torch.bool)
        eq = a == b
        n, n_eq = n + eq.numel(), n_eq + int(eq.sum())
        n_as, n_as_eq = n_as + int(m.sum()), n_as_eq + int(eq[m].sum())
        logits = r32["hidden"][L].float() @ W.float().T
        top = logits.topk(2, dim=-1).values
        margin = top[:, 0] - top[:, 1]
        margins_all.append(margin)
        margins_dis.append(margin[~eq])
        for l in sorted({L, *layers}):
            h32, h16 = r32["hidden"][l].float(), r16["hidden"][l].float()
            store = h32.bfloat16().float()
            e = err.setdefault(l, {"max_abs": 0.0, "sum_abs": 0.0, "n": 0, "sum_rel": 0.0, "rows": 0, "max_rel": 0.0,
                                   "store_max_abs": 0.0, "store_sum_rel": 0.0})
            d = (h16 - h32).abs()
            rel = d.norm(dim=-1) / h32.norm(dim=-1).clamp_min(1e-12)
            srel = (store - h32).norm(dim=-1) / h32.norm(dim=-1).clamp_min(1e-12)
            e["max_abs"] = max(e["max_abs"], float(d.max()))
            e["sum_abs"] += float(d.sum())
            e["n"] += d.numel()
            e["sum_rel"] += float(rel.sum())
            e["rows"] += rel.numel()
            e["max_rel"] = max(e["max_rel"], float(rel.max()))
            e["store_max_abs"] = max(e["store_max_abs"], float((store - h32).abs().max()))
            e["store_sum_rel"] += float(srel.sum())
    dis = torch.cat(margins_dis)
    allm = torch.cat(margins_all)
    q = lambda x, p: float(torch.quantile(x.double(), p)) if x.numel() else None  # noqa: E731
    features = {str(l): {"max_abs": e["max_abs"], "mean_abs": e["sum_abs"] / e["n"], "mean_rel": e["sum_rel"] / e["rows"],
                         "max_rel": e["max_rel"], "storage_only_max_abs": e["store_max_abs"],
                         "storage_only_mean_rel": e["store_sum_rel"] / e["rows"]} for l, e in sorted(err.items())}
    return {"positions": n, "agree": n_eq / n, "assistant_positions": n_as, "assistant_agree": n_as_eq / max(n_as, 1),
            "disagreements": int(dis.numel()), "tie_margin": tie_margin,
            "disagreements_near_tie": int((dis < tie_margin).sum()),
            "fp32_margin_at_disagreements": {"median": q(dis, 0.5), "p90": q(dis, 0.9), "max": float(dis.max()) if dis.numel() else None},
            "fp32_margin_all_positions": {"median": q(allm, 0.5), "p10": q(allm, 0.1)},
            "positions_below_tie_margin": float((allm < tie_margin).float().mean()),
            "features": features}


def _batches(records, L, layers, batch_size: int, pad_id: int):
    """Cache-format batches of the records (hidden states stored in bf16, as prep.dtype does)."""
    from data_prep.cache import collate

    recs = [{"input_ids": torch.as_tensor(r["input_ids"]), "loss_mask": torch.as_tensor(r["loss_mask"], dtype=torch.bool),
             "labels": r["labels"], "hidden": r["hidden"][L].bfloat16(),
             "aux_hidden": {l: r["hidden"][l].bfloat16() for l in layers}, "id": r["id"]} for r in records]
    recs.sort(key=lambda r: len(r["input_ids"]))
    return [collate(recs[i:i + batch_size], pad_id) for i in range(0, len(recs), batch_size)]


def _head(name: str, model, counts, seed: int):
    import heads
    from core.config import compose

    cfg = compose([f"heads={name}"]).heads
    torch.manual_seed(seed)
    return heads.build(cfg, model, label_counts=counts, counts_source="bench_precision")


def _step_flops(head, batch) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    from heads.base import Progress

    with FlopCounterMode(display=False) as fc:
        loss, _ = head.training_loss(batch, Progress(step=0, total_steps=100))
        loss.backward()
    head.zero_grad(set_to_none=True)
    return float(fc.get_total_flops())


def bench_train(name: str, model, train_batches, val_batches, counts, args, limit_gflops: float) -> dict:
    """fp32 vs bf16-mixed steps of one head, interleaved; validation loss of both (and a second fp32 seed)."""
    from heads.base import Progress

    runs = {"float32": _head(name, model, counts, 0), "bf16-mixed": _head(name, model, counts, 0)}
    if args.val_steps:
        runs["float32-seed1"] = _head(name, model, counts, 1)
    opts = {k: torch.optim.AdamW([p for p in h.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95))
            for k, h in runs.items()}
    flops = _step_flops(runs["float32"], train_batches[0]) / int(train_batches[0]["attention_mask"].sum())
    timed = {k: [0.0, 0] for k in ("float32", "bf16-mixed")}
    total = max(args.train_steps, args.val_steps)
    losses = {k: [] for k in runs}
    # the validation-loss curve: after steps 1, 2, 4, ... and the last one (log-spaced, like train.val_schedule=log)
    val_at = {2 ** k for k in range(total.bit_length()) if 2 ** k <= total} | {total} if args.val_steps else set()
    curve = []
    for step in range(total):  # interleaved: step s of every run before step s + 1 of any
        for k, head in runs.items():
            batch = train_batches[(step if k != "float32-seed1" else 7 * step + 3) % len(train_batches)]
            head.train()
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=k == "bf16-mixed"):
                loss, _ = head.training_loss(batch, Progress(step=step, total_steps=total))
            loss.backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
            seconds = time.perf_counter() - t0
            losses[k].append(float(loss.detach()))
            if k in timed and args.train_warmup <= step < args.train_steps:
                timed[k][0] += seconds
                timed[k][1] += int(batch["attention_mask"].sum())
        if step + 1 in val_at:
            curve.append({"steps": step + 1, **{k: _val_loss(head, val_batches) for k, head in runs.items()}})
    tps = {k: n / s for k, (s, n) in timed.items() if s > 0}
    out = {"draft_vocab_size": runs["float32"].draft_vocab_size, "tokens_per_s": tps,
           "ratio": tps["bf16-mixed"] / tps["float32"], "flops_per_token": flops,
           "share_of_bf16_limit": {k: flops * v / (limit_gflops * 1e9) for k, v in tps.items()},
           "final_train_loss": {k: v[-1] for k, v in losses.items() if v}}
    if args.val_steps:
        val = {k: v for k, v in curve[-1].items() if k != "steps"}
        out["val_loss_after_steps"] = {"steps": total, **val,
                                       "bf16_minus_fp32": val["bf16-mixed"] - val["float32"],
                                       "fp32_seed_noise": val["float32-seed1"] - val["float32"]}
        out["val_loss_curve"] = curve
        out["val_curve_max_abs"] = {"bf16_minus_fp32": max(abs(c["bf16-mixed"] - c["float32"]) for c in curve),
                                    "fp32_seed_noise": max(abs(c["float32-seed1"] - c["float32"]) for c in curve)}
    return out


@torch.no_grad()
def _val_loss(head, val_batches) -> float:
    """Mean validation loss of ``head`` (fp32 evaluation) over the held-out batches, as train.module
    aggregates it: (sum, count) pairs where the head returns them, else batch means."""
    was_training = head.training
    head.eval()
    tot = torch.zeros(2, dtype=torch.float64)
    for b in val_batches:
        v = torch.as_tensor(head.validation_metrics(b)["loss"]).double().reshape(-1)
        tot += v if v.numel() == 2 else torch.stack([v.mean(), torch.ones((), dtype=torch.float64)])
    head.train(was_training)
    return float(tot[0] / tot[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=8192, help="prep.batch_tokens (padded tokens per forward)")
    ap.add_argument("--repeats", type=int, default=2, help="data-prep / GEMM repetitions per dtype (best is kept)")
    ap.add_argument("--attn", default="eager,sdpa",
                    help="comma list of attention implementations to time, all interleaved (the first gives the labels)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    ap.add_argument("--heads", default=",".join(HEADS))
    ap.add_argument("--train-steps", type=int, default=6)
    ap.add_argument("--train-warmup", type=int, default=2)
    ap.add_argument("--train-batch", type=int, default=4)
    ap.add_argument("--val-steps", type=int, default=0,
                    help="also train this many steps per precision (+ an fp32 run with another seed) and compare val loss")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--tie-margin", type=float, default=0.1, help="fp32 top-2 logit margin below which a label is a near-tie")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--model-path", default=None, help="default: the packaged SmolLM2-135M (model.path=null)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from core.base_model import load_base_model
    from core.config import compose
    from core.precision import bf16_support
    from data_prep.front import read_split, template_split
    from data_prep.template import end_of_turn_ids

    cfg = compose([f"model.path={args.model_path}" if args.model_path else "model.path=null", "model.dtype=float32",
                   f"data.max_conversations={args.conversations}", f"data.max_length={args.max_length}"])
    load = os.getloadavg()
    report = {"machine": {"cpu": _cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "bf16": bf16_support("cpu").__dict__, "loadavg_start": load}, "args": vars(args)}
    attns = [a for a in args.attn.split(",") if a]
    model32, tok, _ = load_base_model({**cfg.model, "attn_implementation": attns[0]})
    L, H, V = int(model32.config.num_hidden_layers), int(model32.config.hidden_size), int(model32.config.vocab_size)
    inter = int(getattr(model32.config, "intermediate_size", 4 * H))
    layers = sorted({l for name in args.heads.split(",") for l in HEAD_LAYERS.get(name, []) if l < L})
    rows = args.batch_tokens if args.batch_tokens <= 8192 else 8192
    report["gemm"] = gemm_limit({f"prep MLP {rows}x{H}x{inter}": (rows, H, inter),
                                 f"prep attn proj {rows}x{H}x{H}": (rows, H, H),
                                 f"prep LM head 2048x{H}x{V}": (2048, H, V),
                                 f"train draft LM head 1024x{H}x16384": (1024, H, 16384),
                                 f"one-token rows 8x{H}x{inter}": (8, H, inter)}, args.repeats)
    limit = report["gemm"][f"prep MLP {rows}x{H}x{inter}"]["gflops"]["bfloat16"]

    data = read_split(cfg.data)
    eos = end_of_turn_ids(tok, model32)
    templated = template_split(tok, data, eos, args.max_length)
    convs = templated["train"] + templated["val"]
    models = {}
    for attn in attns:
        m32 = model32 if attn == attns[0] else load_base_model({**cfg.model, "attn_implementation": attn})[0]
        models[attn, "float32"], models[attn, "bfloat16"] = m32, copy.deepcopy(m32).to(torch.bfloat16)
    report["data_prep"], records = bench_data_prep(models, tok, convs, args, layers, L)
    for res in report["data_prep"].values():
        res["share_of_bf16_limit"] = {k: res["flops_per_token"] * v / (limit * 1e9) for k, v in res["tokens_per_s"].items()}
    report["labels"] = agreement(records, model32, args.tie_margin, L, layers)
    del models
    if not args.skip_train:
        n_val = max(1, len(records["float32"]) // 4)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        train_b = _batches(records["float32"][n_val:], L, layers, args.train_batch, pad)
        val_b = _batches(records["float32"][:n_val], L, layers, args.train_batch, pad)
        counts = torch.zeros(V, dtype=torch.long)
        for r in records["float32"][n_val:]:
            counts += torch.bincount(r["labels"][torch.as_tensor(r["loss_mask"], dtype=torch.bool)], minlength=V)
        report["train"] = {name: bench_train(name, model32, train_b, val_b, counts, args, limit)
                           for name in args.heads.split(",") if name}
    report["machine"]["loadavg_end"] = os.getloadavg()
    text = summary(report)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
        Path(args.out).with_suffix(".md").write_text(text + "\n")


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def summary(r: dict) -> str:
    m = r["machine"]
    lines = [f"bench_precision: {m['cpu']}, {m['threads']} threads, torch {m['torch']}, bf16 {m['bf16']['level']} "
             f"({m['bf16']['reason']}); load average {m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f}", "",
             "| GEMM (M x K x N) | fp32 GFLOP/s | bf16 GFLOP/s | bf16 / fp32 |", "|---|---:|---:|---:|"]
    for name, g in r["gemm"].items():
        lines.append(f"| {name} | {g['gflops']['float32']:.0f} | {g['gflops']['bfloat16']:.0f} | {g['ratio']:.2f}x |")
    lines += ["", "| data prep (teacher-forced, real base) | fp32 tok/s | bf16 tok/s | bf16 / fp32 | share of bf16 GEMM limit (fp32 / bf16) |",
              "|---|---:|---:|---:|---:|"]
    first = next(iter(r["data_prep"].values()))
    for attn, d in r["data_prep"].items():
        t, s = d["tokens_per_s"], d["share_of_bf16_limit"]
        lines.append(f"| {attn} attention, {d['conversations']} conversations, {d['tokens']} tokens | {t['float32']:.0f} | "
                     f"{t['bfloat16']:.0f} | {d['ratio']:.2f}x | {s['float32']:.0%} / {s['bfloat16']:.0%} |"
                     + (f" fp32 {d['fp32_ratio_to_first_attention']:.2f}x the first attention's" if d is not first else ""))
    lab = r["labels"]
    lines += ["", f"greedy labels, bf16 vs fp32: {lab['agree']:.2%} of {lab['positions']} positions agree "
                  f"({lab['assistant_agree']:.2%} of {lab['assistant_positions']} assistant positions); "
                  f"{lab['disagreements']} disagreements, {lab['disagreements_near_tie']} with an fp32 top-2 margin < "
                  f"{lab['tie_margin']} (fp32 margin at disagreements: median {lab['fp32_margin_at_disagreements']['median']}, "
                  f"max {lab['fp32_margin_at_disagreements']['max']}; all positions: median "
                  f"{lab['fp32_margin_all_positions']['median']:.2f})", "",
              "| hs[l], bf16 compute vs fp32 | max abs | mean abs | mean rel | max rel | bf16 storage alone: max abs / mean rel |",
              "|---|---:|---:|---:|---:|---:|"]
    for l, e in lab["features"].items():
        lines.append(f"| hs[{l}] | {e['max_abs']:.3g} | {e['mean_abs']:.3g} | {e['mean_rel']:.3g} | {e['max_rel']:.3g} | "
                     f"{e['storage_only_max_abs']:.3g} / {e['storage_only_mean_rel']:.3g} |")
    if "train" in r:
        lines += ["", "| training step (draft vocab) | fp32 tok/s | bf16-mixed tok/s | bf16 / fp32 | GFLOP/token | "
                      "share of limit (fp32 / bf16) | val loss fp32 / bf16 / fp32 other seed |", "|---|---:|---:|---:|---:|---:|---:|"]
        for name, t in r["train"].items():
            v, c = t.get("val_loss_after_steps"), t.get("val_curve_max_abs")
            val = (f"{v['float32']:.3f} / {v['bf16-mixed']:.3f} / {v['float32-seed1']:.3f} ({v['steps']} steps); over the "
                   f"curve max abs bf16 - fp32 {c['bf16_minus_fp32']:.3f}, seed noise {c['fp32_seed_noise']:.3f}") if v else "-"
            lines.append(f"| {name} ({t['draft_vocab_size']}) | {t['tokens_per_s']['float32']:.0f} | "
                         f"{t['tokens_per_s']['bf16-mixed']:.0f} | {t['ratio']:.2f}x | {t['flops_per_token'] / 1e9:.3f} | "
                         f"{t['share_of_bf16_limit']['float32']:.0%} / {t['share_of_bf16_limit']['bf16-mixed']:.0%} | {val} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
