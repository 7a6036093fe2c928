"""Training throughput and per-rank memory of the distributed set-up.

1. Throughput (one process, one run): the same batches, in the same order, are trained
   (a) by a bare loop - ``head.training_loss`` + ``backward`` + ``AdamW.step`` on batches already
   in memory - and (b) through the full stack (``train.run.train``: Lightning, DataLoader over the
   safetensors cache, logging, checkpoint callbacks).  Reported: assistant+context tokens/s of
   each over the steps after ``--warmup``, and (b)/(a) (target >= 0.80).
2. Memory per rank under DDP and ZeRO-1/2/3 (``--world`` processes, gloo on CPU / nccl on GPU):
   the bytes each rank holds in parameters, in fp32 master weights + optimizer state (what ZeRO
   partitions), on GPU the peak allocated memory, and the process's max RSS.

Usage::

    python benchmarks/bench_train.py                                  # tiny model, synthetic cache, falcon head
    python benchmarks/bench_train.py --head ctc --steps 40 --world 2
    python benchmarks/bench_train.py --model-path /path/to/hf_model --cache /path/to/cache --head falcon

Prints a Markdown table and writes it (plus JSON) to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def write_synthetic_cache(root: Path, model_dir: Path, n_train: int, n_val: int, layers: list[int]) -> Path:
    """A real-format cache of random token sequences (48-95 tokens, loss on the last 3/4) run
    through the base model at ``model_dir`` (``data_prep.synthetic.write_random_cache``)."""
    from data_prep.synthetic import write_random_cache

    return write_random_cache(root, model_dir, n_train=n_train, n_val=n_val, layers=layers, length_range=(48, 96),
                              mask_start=lambda T, g: T // 4, shard_size=16, tag="bench")


def compose_cfg(args, extra: list[str]):
    from core.config import compose

    return compose([f"heads={args.head}", f"model.path={args.model_path}", "model.dtype=float32",
                    "model.attn_implementation=eager", f"train.cache_dir={args.cache}", f"output_root={args.work}",
                    f"train.batch_size={args.batch_size}", f"train.max_steps={args.steps}",
                    f"train.val_every_n_steps={10 * args.steps}", "train.sanity_val_steps=0", "train.logger=csv",
                    "train.progress_bar=false", "train.log_every_n_steps=10", *args.overrides, *extra])


class StepClock:
    """Callback: wall time and tokens of the training steps after ``warmup``."""

    def __new__(cls, warmup: int):
        from lightning.pytorch.callbacks import Callback

        class _Clock(Callback):
            def __init__(self):
                self.t0 = self.t1 = None
                self.tokens = 0

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if trainer.global_step == warmup and self.t0 is None:
                    self.t0 = time.perf_counter()
                if self.t0 is not None:
                    self.tokens += int(batch["attention_mask"].sum())

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.t1 = time.perf_counter()
                self.peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
                self.rank_bytes = held_bytes(trainer)

        return _Clock()


def held_bytes(trainer) -> dict[str, int]:
    """Bytes this rank holds in parameters and in optimizer state (fp32 masters + moments)."""
    module = trainer.lightning_module
    params = 0
    for p in module.parameters():
        t = p.ds_tensor if hasattr(p, "ds_tensor") else p
        params += t.numel() * t.element_size()
    opt = trainer.optimizers[0] if trainer.optimizers else None
    inner = getattr(opt, "optimizer", opt)
    state = 0
    masters = 0
    if inner is not None:
        for st in inner.state.values():
            state += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        if hasattr(opt, "single_partition_of_fp32_groups"):
            masters = sum(t.numel() * t.element_size() for t in opt.single_partition_of_fp32_groups)
        elif hasattr(opt, "fp32_partitioned_groups_flat"):
            masters = sum(t.numel() * t.element_size() for t in opt.fp32_partitioned_groups_flat)
    return {"params": params, "optimizer_state": state, "fp32_masters": masters}


def throughput(args) -> dict:
    """Bare loop vs the full Lightning stack on the same batches (one process)."""
    import lightning.pytorch as pl

    import heads
    from core.base_model import load_base_model
    from heads.base import Progress
    from train.data import CacheDataModule
    from train.run import train

    cfg = compose_cfg(args, ["strategy=auto", "train.devices=1", "train.run_name=bench-lightning"])
    base = load_base_model(cfg.model)
    model, tok, _ = base
    dm = CacheDataModule(args.cache, 2, batch_size=args.batch_size, seed=int(cfg.seed), shuffle=True)
    dm.setup()
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(0)
    batches = []
    while len(batches) < args.steps:
        batches += list(loader)
    batches = batches[:args.steps]

    def bare_loop() -> float:
        pl.seed_everything(int(cfg.seed), verbose=False)
        head = heads.build(cfg.heads, model)
        opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=float(cfg.train.optimizer.lr))
        t0, tokens = None, 0
        for step, batch in enumerate(batches):
            if step == args.warmup:
                t0 = time.perf_counter()
            if t0 is not None:
                tokens += int(batch["attention_mask"].sum())
            loss, _ = head.training_loss(batch, Progress(step=step, total_steps=args.steps))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return tokens / (time.perf_counter() - t0)

    # The machine may be shared: the bare loop runs before and after the full run and the faster
    # of the two is the reference (a conservative ratio).
    bare_before = bare_loop()
    clock = StepClock(args.warmup)
    train(cfg, base=base, callbacks=[clock])
    full = clock.tokens / (clock.t1 - clock.t0)
    bare_after = bare_loop()
    bare = max(bare_before, bare_after)
    return {"bare_tokens_per_s": bare, "bare_before": bare_before, "bare_after": bare_after,
            "lightning_tokens_per_s": full, "ratio": full / bare, "steps_timed": args.steps - args.warmup}


def worker(args) -> None:
    """One rank of the memory run (``--worker``); rank 0 writes ``memory-<strategy>.json``."""
    from train.run import train

    strategy = args.worker
    cfg = compose_cfg(args, [f"strategy={strategy}", f"train.run_name=bench-{strategy}", "train.logger=none"])
    clock = StepClock(args.warmup)
    result = train(cfg, callbacks=[clock])
    trainer = result["trainer"]
    import torch.distributed as dist

    row = {**clock.rank_bytes, "tokens_per_s": clock.tokens / (clock.t1 - clock.t0),
           "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "peak_gpu": clock.peak}
    rows = [None] * trainer.world_size
    dist.all_gather_object(rows, row)
    if trainer.is_global_zero:
        Path(args.work, f"memory-{strategy}.json").write_text(json.dumps(rows))


def memory(args) -> dict:
    rows = {}
    for strategy in args.strategies:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in range(args.world):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.world),
                   "LOCAL_WORLD_SIZE": str(args.world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            cmd = [sys.executable, __file__, "--worker", strategy, *sys.argv[1:]]
            procs.append(subprocess.Popen(cmd, env=env))
        codes = [p.wait(timeout=args.timeout) for p in procs]
        if any(codes):
            raise RuntimeError(f"{strategy}: ranks exited {codes}")
        rows[strategy] = json.loads(Path(args.work, f"memory-{strategy}.json").read_text())
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", default="falcon")
    p.add_argument("--model-path", default=None, help="HF folder; default: a tiny random Llama written here")
    p.add_argument("--cache", default=None, help="cache dir (train/ + val/); default: synthetic from the model")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--strategies", nargs="+", default=["ddp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"])
    p.add_argument("--layers", default="", help="intermediate layers to cache, e.g. 1,2 (AdaDecode)")
    p.add_argument("--work", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (OMP_NUM_THREADS)")
    args = p.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    if args.worker:
        worker(args)
        return
    args.work = args.work or tempfile.mkdtemp(prefix="bench_train.")
    work = Path(args.work)
    if args.model_path is None:
        from core.tiny import save_tiny_model

        args.model_path = str(save_tiny_model(work / "model", seed=0, hidden_size=128, num_layers=4))
    layers = [int(x) for x in args.layers.split(",") if x]
    if args.cache is None:
        args.cache = str(write_synthetic_cache(work / "cache", Path(args.model_path), 8 * args.batch_size, 8, layers))
    # pass the resolved paths to the memory workers
    sys.argv = [sys.argv[0], "--head", args.head, "--model-path", args.model_path, "--cache", args.cache,
                "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
                "--world", str(args.world), "--work", args.work, "--threads", str(args.threads), *args.overrides]
    report = {"config": {k: v for k, v in vars(args).items() if k != "worker"},
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu x{os.cpu_count()}"}
    report["throughput"] = throughput(args)
    if not args.skip_memory:
        report["memory"] = memory(args)
    lines = [f"bench_train: head={args.head} model={args.model_path} batch={args.batch_size} steps={args.steps} "
             f"(timed {args.steps - args.warmup}) device={report['device']}", "",
             "| | tokens/s |", "|---|---|",
             f"| bare head fwd+bwd+AdamW (best of before / after: {report['throughput']['bare_before']:.0f} / "
             f"{report['throughput']['bare_after']:.0f}) | {report['throughput']['bare_tokens_per_s']:.0f} |",
             f"| python -m train (Lightning, 1 process) | {report['throughput']['lightning_tokens_per_s']:.0f} "
             f"({report['throughput']['ratio']:.2f}x) |"]
    if "memory" in report:
        mib = lambda b: f"{b / 2**20:.2f}" if b is not None else "-"  # noqa: E731
        lines += ["", f"| strategy ({args.world} ranks) | rank | params MiB | fp32 masters MiB | optimizer state MiB "
                      "| peak GPU MiB | max RSS MiB | tokens/s per rank |", "|---|---|---|---|---|---|---|---|"]
        for strategy, rows in report["memory"].items():
            for r, row in enumerate(rows):
                lines.append(f"| {strategy} | {r} | {mib(row['params'])} | {mib(row['fp32_masters'])} | "
                             f"{mib(row['optimizer_state'])} | {mib(row['peak_gpu'])} | {mib(row['max_rss'])} | "
                             f"{row['tokens_per_s']:.0f} |")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out) if args.out else work / "bench_train.md"
    out.write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
