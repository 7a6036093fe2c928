"""Online vs offline training throughput, and fp8 vs bf16 cache storage (issue 17).

One process, one run, the same head and the same batches in the same order:

1. **throughput** - a bare training loop (``head.training_loss`` + backward + AdamW step) over
   ``--steps`` batches (a) read from a bf16 data-prep cache (``train.features=offline``) and (b) as
   token batches whose features the frozen base computes in the loop
   (``train.online.BaseFeatures``, ``train.features=online``).  Reported: tokens/s of each after
   ``--warmup`` steps, online/offline, and the base forward's share of the online step time.  The
   online losses are checked equal to the offline ones (same features, ``prep.dtype`` rounding).
2. **fp8 storage** - the same conversations cached with ``prep.dtype=bfloat16`` and
   ``float8_e4m3fn``: bytes per token of each, and on the real states of those batches the error
   of fp8 against bf16 (max and mean of ``|fp8 - bf16|`` relative to the row's max, mean relative to
   ``|bf16|``) plus the top-1 agreement of the frozen LM head applied to fp8 vs bf16 hs[L].

Usage::

    python benchmarks/bench_online.py                               # packaged SmolLM2-135M, falcon head
    python benchmarks/bench_online.py --head ctc --steps 16 --model-path /path/to/hf_model

Prints a Markdown table; writes it and the JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

HEAD_LAYERS = {"adadecode": "[8,15,22]"}


def _cfg(args, dtype: str):
    from core.config import compose

    layers = HEAD_LAYERS.get(args.head, "[]")
    extra = [f"model.path={args.model_path}"] if args.model_path else []
    return compose([f"heads={args.head}", "labels=teacher_forced", f"data.max_conversations={args.conversations}",
                    f"data.max_length={args.max_length}", f"prep.dtype={dtype}", f"prep.layers={layers}",
                    "prep.progress=false", f"output_root={args.work}", f"train.batch_size={args.batch_size}",
                    "train.features=online", *extra])


def _loop(head_cfg, model, batches, features, warmup: int, lr: float) -> dict:
    """Train a fresh head over ``batches``; features=None: batches already hold the cached features."""
    import lightning.pytorch as pl

    import heads
    from heads.base import Progress

    pl.seed_everything(0, verbose=False)
    head = heads.build(head_cfg, model)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    t0, tokens, losses, base_s = None, 0, [], 0.0
    for step, batch in enumerate(batches):
        if step == warmup:
            t0 = time.perf_counter()
        if features is not None:
            s0 = time.perf_counter()
            batch = features(dict(batch))
            if t0 is not None:
                base_s += time.perf_counter() - s0
        if t0 is not None:
            tokens += int(batch["attention_mask"].sum())
        loss, _ = head.training_loss(batch, Progress(step=step, total_steps=len(batches)))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    dt = time.perf_counter() - t0
    return {"tokens_per_s": tokens / dt, "seconds": dt, "base_forward_s": base_s, "losses": losses}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="HF folder / GGUF (default: the packaged SmolLM2-135M)")
    p.add_argument("--head", default="falcon")
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--work", type=Path, default=ROOT / "outputs" / "bench" / "online_work")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "online")
    args = p.parse_args(argv)

    from core.base_model import load_base_model
    from data_prep import pipeline
    from data_prep.cache import default_cache_dir
    from data_prep.fp8 import storage_roundtrip
    from train.data import CacheDataModule, open_split
    from train.online import online_datamodule

    cfg = _cfg(args, "bfloat16")
    model, tok, ident = load_base_model(cfg.model)
    summaries, roots = {}, {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        c = _cfg(args, dtype)
        summaries[dtype] = pipeline.prepare(c, model, tok, ident, rank=0, world=1, out=None)
        roots[dtype] = default_cache_dir(c)
    root = roots["bfloat16"]
    offline = CacheDataModule(root, 0, batch_size=args.batch_size, seed=0, train_reader=open_split(root, "train"),
                              val_reader=open_split(root, "val"))
    offline.setup()
    dm, features = online_datamodule(cfg, model, tok, ident.to_dict())
    dm.setup()
    assert dm.train_batches == offline.train_batches
    order = list(offline.train_dataloader().sampler)[: args.steps]
    off_batches = [offline.train_dataloader().dataset[k] for k in order]
    on_batches = [dm.train_dataloader().dataset[k] for k in order]
    head_cfg = cfg.heads
    lr = 1e-4
    off = _loop(head_cfg, model, off_batches, None, args.warmup, lr)
    on = _loop(head_cfg, model, on_batches, features, args.warmup, lr)
    loss_diff = max(abs(a - b) for a, b in zip(off["losses"], on["losses"]))

    # fp8 vs bf16 on the real states of the same batches (hs[L] and the cached aux layers)
    W = model.get_output_embeddings().weight
    errs, agree, n_tok = [], 0, 0
    with torch.no_grad():
        for batch in on_batches:
            out = model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(),
                                   output_hidden_states=True, use_cache=False)
            m = batch["attention_mask"]
            for l in [len(out.hidden_states) - 1, *features.layers]:
                x = out.hidden_states[l][m].float()
                b16 = storage_roundtrip(x, "bfloat16").float()
                f8 = storage_roundtrip(x, "float8_e4m3fn").float()
                e = (f8 - b16).abs()
                rowmax = b16.abs().amax(-1, keepdim=True).clamp_min(1e-12)
                errs.append(((e / rowmax).amax().item(), (e / rowmax).mean().item(),
                             (e.sum() / b16.abs().sum()).item(), l == len(out.hidden_states) - 1))
                if l == len(out.hidden_states) - 1:
                    agree += int(((f8 @ W.float().T).argmax(-1) == (b16 @ W.float().T).argmax(-1)).sum())
                    n_tok += int(m.sum())
    fp8 = {"max_err_over_rowmax": max(e[0] for e in errs), "mean_err_over_rowmax": sum(e[1] for e in errs) / len(errs),
           "mean_rel_err": sum(e[2] for e in errs) / len(errs), "top1_agreement_lm_head": agree / n_tok}
    bpt = {d: s["bytes_per_token"] for d, s in summaries.items()}
    result = {"model": str(cfg.model.path or "packaged SmolLM2-135M"), "head": args.head, "steps": args.steps,
              "warmup": args.warmup, "batch_size": args.batch_size, "hidden_size": int(model.config.hidden_size),
              "layers": features.layers, "tokens": summaries["bfloat16"]["tokens"],
              "offline": {k: v for k, v in off.items() if k != "losses"}, "online": {k: v for k, v in on.items() if k != "losses"},
              "online_over_offline": on["tokens_per_s"] / off["tokens_per_s"],
              "base_forward_share": on["base_forward_s"] / on["seconds"], "max_loss_diff": loss_diff,
              "bytes_per_token": bpt, "fp8_over_bf16_bytes": bpt["float8_e4m3fn"] / bpt["bfloat16"], "fp8_error": fp8}
    table = "\n".join([
        f"| {args.head} on {result['model']} (H={result['hidden_size']}, layers {features.layers}) | value |",
        "|---|---|",
        f"| offline tokens/s (bf16 cache) | {off['tokens_per_s']:,.0f} |",
        f"| online tokens/s (base forward in the loop) | {on['tokens_per_s']:,.0f} |",
        f"| online / offline | {result['online_over_offline']:.2f} |",
        f"| base forward share of the online step | {result['base_forward_share']:.0%} |",
        f"| max per-step loss difference online vs offline | {loss_diff:.2e} |",
        f"| cache bytes/token bf16 / fp8 | {bpt['bfloat16']:.1f} / {bpt['float8_e4m3fn']:.1f} "
        f"({result['fp8_over_bf16_bytes']:.2f}x) |",
        f"| fp8 vs bf16: max / mean abs error (÷ row max) | {fp8['max_err_over_rowmax']:.3g} / {fp8['mean_err_over_rowmax']:.3g} |",
        f"| fp8 vs bf16: mean relative error | {fp8['mean_rel_err']:.3g} |",
        f"| fp8 vs bf16: top-1 agreement of the LM head on hs[L] | {fp8['top1_agreement_lm_head']:.4f} |",
    ])
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_online.json").write_text(json.dumps(result, indent=1))
    (args.out / "bench_online.md").write_text(table + "\n")
    return result


if __name__ == "__main__":
    main()
