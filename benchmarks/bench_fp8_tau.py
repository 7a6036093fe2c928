"""The effect of fp8 cache storage on validation τ (issue 17), against bf16 in the same run.

Given a bf16 (or fp16 / fp32) data-prep cache, the benchmark

0. writes (or resumes) its fp8 copy with :func:`data_prep.fp8_convert.convert_cache` (no base forward);
1. **training effect** - trains one head with ``python -m train``'s own code (:func:`train.run.train`)
   for ``--steps`` optimizer steps on the source cache and on the fp8 copy: same seed, same config,
   same batches in the same order (checked: the conversation ids of every training batch are
   compared), and reads each run's last validation (``val/sim_tau``, ``val/loss``, ...) from its
   module, computed on *its own* cache's held-out split;
2. **storage effect** - validates both trained heads on both held-out splits (a 2 x 2 matrix; the
   source-trained head on the fp8 split is the pure effect of fp8 features at inference time),
   with the same anchors and positions, reporting per slot:

   * ``top1_slot<j>``: the draft's top-1 against the base's stored greedy label (storage-independent).
     Falcon: slot j = block position ≡ j (mod k), its argmax against ``labels[t+k]``, over the
     ``sim_tau`` positions.  CTC: the greedy (top-1 per slot) CTC path collapsed, depth j+1 against
     ℓ_{j+1} (the slots themselves emit blanks and repeats, so depth is what a slot index means
     after the collapse), over the validation anchors;
   * ``agree_slot<j>`` (fp8 split only): the share of draft argmaxes (CTC: raw per-slot argmax incl.
     blank; Falcon: per block slot) equal to the same head's on the source split.

   The diagonal of the matrix is recomputed by this loop and checked equal to the trainer's logged
   validation (same code path, ``heads.<head>.validation_metrics``).

Usage (the figures in docs/online_fp8.md)::

    python benchmarks/bench_fp8_tau.py --cache /work/outputs/cache/real_tf640 \\
        --fp8-cache /work/outputs/fp8_tf640 --head ctc --steps 150
    # part 2 only, for a head you trained already (its heads= option):
    python benchmarks/bench_fp8_tau.py --cache CACHE --fp8-cache CACHE_FP8 --head ctc --head-dir outputs/runs/ctc/<run>/best

Prints a Markdown table; writes it and the JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def _compose(args, cache: Path, name: str):
    from core.config import compose

    extra = [f"model.path={args.model_path}"] if args.model_path else []
    return compose([f"heads={args.head}", "labels=teacher_forced", f"output_root={args.work}", f"seed={args.seed}",
                    f"train.cache_dir={cache}", f"train.run_name={name}", f"train.max_steps={args.steps}",
                    f"train.val_every_n_steps={args.steps}", f"train.batch_size={args.batch_size}",
                    f"train.optimizer.lr={args.lr}", f"train.scheduler.warmup_steps={args.warmup}",
                    "train.sanity_val_steps=0", "train.logger=csv", "train.progress_bar=false",
                    "train.devices=1", "strategy=auto", *extra, *args.override])


# ----------------------------------------------------------------------------------------------
# per-slot top-1 and argmax of one validation batch
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def slot_predictions(head, batch: dict[str, Any]) -> dict[str, Any]:
    """Per-slot draft argmax and top-1 against the greedy labels of one validation batch.

    Returns:
        ``argmax`` long [M, J] (the rows the head scores: CTC anchors / Falcon sim_tau positions;
        J = S slots for CTC, the block slot of the position for Falcon, 1 column), ``hits`` float
        [J] and ``counts`` float [J] (top-1 against the greedy label per slot, see the module
        docstring).

    Raises:
        ValueError: a head type other than ``ctc`` / ``falcon``.
    """
    from decoding.ctc import ctc_collapse

    if head.head_type == "ctc":
        out = head.forward_batch(batch, -1, int(head.cfg["val_anchors_per_seq"]))
        raw = out["slot_logits"].argmax(-1)  # [A, S] draft indices, blank = last class
        blank = int(out["slot_logits"].shape[-1]) - 1
        n = int(out["targets"].shape[1])
        hits, counts = torch.zeros(n), torch.zeros(n)
        for row, tgt in zip(raw.tolist(), out["targets"].tolist()):
            path = ctc_collapse(row, blank)
            base = head.to_base_ids(torch.tensor(path, dtype=torch.long)).tolist() if path else []
            for j in range(n):
                counts[j] += 1
                hits[j] += float(j < len(base) and base[j] == tgt[j])
        return {"argmax": raw, "hits": hits, "counts": counts}
    if head.head_type == "falcon":
        inp = head.prepare_inputs(batch)
        mask = inp["mask"]
        pred = head.forward_train(inp["F_in"], inp["X_in"], inp["valid"])
        draft = head.to_base_ids(head.logits_fp32(pred[mask]).argmax(-1))  # [M]
        k = head.k
        labels = batch["labels"]
        lab_shift = torch.full_like(labels, -1)
        if labels.shape[1] > k:
            lab_shift[:, : labels.shape[1] - k] = labels[:, k:]
        slot = (torch.arange(mask.shape[1]) % k)[None].expand_as(mask)[mask]
        hit = (draft == lab_shift[mask]).float()
        hits = torch.stack([hit[slot == j].sum() for j in range(k)])
        counts = torch.stack([(slot == j).sum().float() for j in range(k)])
        return {"argmax": draft[:, None], "hits": hits, "counts": counts, "slot": slot}
    raise ValueError(f"bench_fp8_tau supports heads ctc and falcon*, not {head.head_type!r}")


@torch.no_grad()
def validate(head, datamodule) -> tuple[dict[str, float], list[torch.Tensor], list]:
    """The head's validation over ``datamodule``'s held-out split, as ``train.module`` computes it
    (Σsum/Σcount of ``validation_metrics``), plus ``top1_slot<j>``; also the per-batch argmaxes."""
    from train.module import accumulate_metrics

    head.eval()
    sums: dict[str, torch.Tensor] = {}
    hits = counts = None
    argmaxes, slots = [], []
    for batch in datamodule.val_dataloader():
        weight = 0.0 if batch.get("is_padding", False) else 1.0
        accumulate_metrics(sums, head.validation_metrics(batch), weight)
        p = slot_predictions(head, batch)
        hits = p["hits"] if hits is None else hits + p["hits"]
        counts = p["counts"] if counts is None else counts + p["counts"]
        argmaxes.append(p["argmax"])
        slots.append(p.get("slot"))
    values = {n: float(s) / float(c) if c > 0 else float("nan") for n, (s, c) in sums.items()}
    values.update({f"top1_slot{j}": float(h) / float(c) for j, (h, c) in enumerate(zip(hits, counts))})
    return values, argmaxes, slots


def agreement(ref: list[torch.Tensor], got: list[torch.Tensor], slots: list) -> dict[str, float]:
    """``agree_slot<j>``: share of equal argmaxes per column (CTC slot) or block slot (Falcon)."""
    a, b = torch.cat(ref), torch.cat(got)
    if a.shape != b.shape:
        raise ValueError(f"the two validation splits scored different rows ({tuple(a.shape)} vs {tuple(b.shape)})")
    eq = (a == b).float()
    if slots and slots[0] is not None:
        s = torch.cat(slots)
        return {f"agree_slot{j}": float(eq[s == j].mean()) for j in sorted(set(s.tolist()))}
    return {f"agree_slot{j}": float(eq[:, j].mean()) for j in range(eq.shape[1])}


def _batch_recorder(seen: list):
    """A Lightning callback appending each training batch's conversation ids to ``seen``."""
    from lightning.pytorch.callbacks import Callback

    class Record(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(tuple(batch["ids"]))

    return Record()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", type=Path, required=True, help="the source (bf16) cache with train/ and val/")
    p.add_argument("--fp8-cache", type=Path, required=True, help="its fp8 copy (written or resumed here)")
    p.add_argument("--head", default="ctc", help="heads= option: ctc, falcon, falcon_k1, falcon_noglance")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-path", default=None, help="HF folder / GGUF (default: the packaged SmolLM2-135M)")
    p.add_argument("--work", type=Path, default=ROOT / "outputs" / "bench" / "fp8_tau_work")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "fp8_tau")
    p.add_argument("--head-dir", type=Path, default=None,
                   help="an exported head (best/ or last/): skip training, only validate it on both splits (part 2)")
    p.add_argument("override", nargs="*", help="extra config overrides (key=value) for both runs")
    args = p.parse_args(argv)

    from core.base_model import load_base_model
    from data_prep.fp8_convert import convert_cache
    from train.run import _cache_datamodule, train

    t0 = time.perf_counter()
    conv = convert_cache(args.cache, args.fp8_cache, out=None)
    convert_s = time.perf_counter() - t0
    caches = {"source": args.cache, "fp8": args.fp8_cache}
    base = None
    runs: dict[str, dict[str, Any]] = {}
    order: dict[str, list] = {"source": [], "fp8": []}
    if args.head_dir is not None:  # part 2 only, on a head trained elsewhere
        import heads

        cfg = _compose(args, args.cache, "unused")
        base = load_base_model(cfg.model)
        head, _ = heads.load(args.head_dir, base_model=base[0])
        runs["given"] = {"head": head, "logged": {}, "seconds": 0.0, "cfg": cfg, "run_dir": str(args.head_dir),
                         "steps": None}
    for name, cache in caches.items():
        if args.head_dir is not None:
            break
        cfg = _compose(args, cache, f"fp8tau-{args.head}-{name}")
        base = base or load_base_model(cfg.model)
        run_dir = Path(cfg.output_root) / "runs"
        for d in run_dir.glob(f"*/fp8tau-{args.head}-{name}"):  # a fresh run each time
            shutil.rmtree(d)
        dm = _cache_datamodule(cfg, base[1], base[2].to_dict())
        t1 = time.perf_counter()
        order[name] = []
        result = train(cfg, base=base, datamodule=dm, callbacks=[_batch_recorder(order[name])])
        seconds = time.perf_counter() - t1
        module = result["module"]
        runs[name] = {"head": module.head, "logged": dict(module.validation_results), "seconds": seconds,
                      "cfg": cfg, "run_dir": str(result["run_dir"]), "steps": int(result["trainer"].global_step)}
    if order["source"] != order["fp8"] or (args.head_dir is None and len(order["source"]) != args.steps):
        raise RuntimeError("the two runs saw different training batches")
    # 2 x 2: each trained head on each held-out split
    dms = {}
    for name, cache in caches.items():
        dms[name] = _cache_datamodule(_compose(args, cache, "unused"), base[1], base[2].to_dict())
        dms[name].setup()
    matrix: dict[str, dict[str, dict[str, float]]] = {}
    for trained in runs:
        head = runs[trained]["head"]
        ref_vals, ref_arg, slots = validate(head, dms["source"])
        fp8_vals, fp8_arg, _ = validate(head, dms["fp8"])
        fp8_vals.update(agreement(ref_arg, fp8_arg, slots))
        matrix[trained] = {"source": ref_vals, "fp8": fp8_vals}
    for name in runs:  # the loop above is the trainer's validation: the diagonal must match its log
        logged, mine = runs[name]["logged"], matrix[name].get(name, {})
        for key, v in logged.items():
            if abs(v - mine[key]) > 1e-4 * max(1.0, abs(v)):
                raise RuntimeError(f"{name}: val/{key} logged {v} but recomputed {mine[key]}")
    src_dtype = json.loads((args.cache / "val" / "manifest.json").read_text())["dtypes"]["hidden"]
    first = next(iter(matrix.values()))
    slot_keys = sorted(k for k in first["source"] if k.startswith("top1_slot"))
    agree_keys = sorted(k for k in first["fp8"] if k.startswith("agree_slot"))
    result = {"head": args.head, "steps": args.steps if args.head_dir is None else None,
              "head_dir": str(args.head_dir) if args.head_dir else None, "batch_size": args.batch_size, "lr": args.lr,
              "warmup": args.warmup, "seed": args.seed, "source_cache": str(args.cache), "source_dtype": src_dtype,
              "fp8_cache": str(args.fp8_cache), "convert_seconds": convert_s,
              "bytes_per_token": {"source": conv["source_bytes_per_token"], "fp8": conv["bytes_per_token"]},
              "fp8_error": conv["errors"], "train_seconds": {k: v["seconds"] for k, v in runs.items()},
              "train_steps": {k: v["steps"] for k, v in runs.items()},
              "val_conversations": len(dms["source"].val_reader), "matrix": matrix}
    fmt = lambda v: f"{v:.4f}"  # noqa: E731
    cols = ["sim_tau", "loss", *slot_keys]
    what = f"{args.steps} steps" if args.head_dir is None else str(args.head_dir)
    lines = [f"| {args.head}, {what}: trained on → validated on | " + " | ".join(cols) + " | "
             + " | ".join(agree_keys) + " |",
             "|---|" + "---|" * (len(cols) + len(agree_keys))]
    for trained in runs:
        for val in caches:
            vals = matrix[trained][val]
            agree = [fmt(vals[k]) if k in vals else "" for k in agree_keys]
            what = {"source": src_dtype, "fp8": "fp8"}.get(trained, args.head_dir)
            lines.append(f"| {trained} ({what}) → {val} | "
                         + " | ".join(fmt(vals[c]) for c in cols) + " | " + " | ".join(agree) + " |")
    table = "\n".join(lines)
    print(table)
    print(f"bytes/token {conv['source_bytes_per_token']:.1f} -> {conv['bytes_per_token']:.1f}; "
          f"train seconds {result['train_seconds']}")
    args.out.mkdir(parents=True, exist_ok=True)
    tag = args.head if args.head_dir is None else f"{args.head}_given"
    (args.out / f"bench_fp8_tau_{tag}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"bench_fp8_tau_{tag}.md").write_text(table + "\n")
    return result


if __name__ == "__main__":
    main()
