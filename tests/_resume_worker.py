"""One rank of a multi-process resume run with a real head, for tests/test_resume_distributed.py.

Run as a subprocess per rank (RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set by
the caller, like torchrun)::

    python tests/_resume_worker.py --model-dir D --plan '[{"overrides": [...], "stop": {...}}, ...]' common overrides...

Each plan entry is one ``train.run.train`` call (``core.config.compose`` of the common and the
entry's overrides) in these processes, so several runs share one interpreter start-up.  An
entry's optional ``stop``: ``{"kind": "kill", "step": N}`` hard-exits every rank
(``os._exit(17)``, like SIGKILL) before the batch after optimizer step N (so it must be the last
entry); ``{"kind": "signal", "step": N, "signal": "SIGTERM", "ranks": [0]}`` sends the signal to
the listed ranks' own process inside optimizer step N (before the update); the pre-empted run
returns and the plan goes on; ``{"kind": "stop", "step": N, "micro": m}`` sets ``trainer.should_stop``
on every rank at the end of micro-batch m of the window after step N (what ``train.max_time`` does).
An entry's optional ``poison`` (issue 28, the finite-value guard under DDP / ZeRO):
``{"kind": "batch" | "grad", "rank": r, "step": N}`` puts a NaN into rank r's micro-batch features
(``batch``) or into one element of rank r's gradient of the first head parameter (``grad``, a
tensor hook, so the loss stays finite) in optimizer step N; every rank must stop with the same error.
An entry's optional ``expect_error``: a path prefix; the entry's ``core.finite.NonFiniteError`` is
caught, its message written to ``<expect_error>.rank<r>.txt`` (any other outcome fails the rank),
and the plan goes on.
An entry's optional ``record``: a path prefix; every rank appends each micro-batch it trains as
a JSON line ``[epoch, batch index, [conversation ids]]`` to ``<record>.rank<r>.jsonl``.

Also registers ``adadecode_frozen``: AdaDecode plus one frozen parameter (issue 11, item 5).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import heads  # noqa: E402
from heads.adadecode import AdaDecodeHead  # noqa: E402


@heads.register
class FrozenParamAdaDecode(AdaDecodeHead):
    """AdaDecode with an extra frozen (``requires_grad=False``) parameter inside a layer's lightweight
    head, so ZeRO-3 gathers it with that layer's trainable weight in every forward."""

    head_type = "adadecode_frozen"

    def __init__(self, cfg, base_config):
        super().__init__(cfg, base_config)
        first = next(iter(self.transforms.values()))
        first.register_parameter("frozen_scale", torch.nn.Parameter(torch.linspace(0.5, 1.5, 8), requires_grad=False))


def stop_callback(spec: dict):
    from lightning.pytorch.callbacks import Callback

    step = int(spec["step"])

    class Stop(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if spec["kind"] == "kill" and trainer.global_step >= step \
                    and batch_idx % trainer.accumulate_grad_batches == int(spec.get("micro", 0)):
                trainer.strategy.barrier("kill")
                os._exit(17)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if spec["kind"] == "stop" and trainer.global_step >= step \
                    and batch_idx % trainer.accumulate_grad_batches == int(spec.get("micro", 0)):
                trainer.should_stop = True

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if spec["kind"] == "signal" and trainer.global_step + 1 == step \
                    and trainer.global_rank in spec.get("ranks", [0]):
                os.kill(os.getpid(), getattr(signal, spec["signal"]))

    return Stop()


def poison_callback(spec: dict):
    from lightning.pytorch.callbacks import Callback

    class Poison(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_rank != int(spec["rank"]) or trainer.global_step + 1 != int(spec["step"]):
                return
            if spec["kind"] == "batch":
                batch["hidden"][0, 1, 0] = float("nan")
                return
            param = next(p for p in pl_module.head.parameters() if p.requires_grad)

            def nan_one(grad):
                grad = grad.clone()
                grad.view(-1)[0] = float("nan")
                handle.remove()
                return grad

            handle = param.register_hook(nan_one)

    return Poison()


def record_callback(prefix: str):
    from lightning.pytorch.callbacks import Callback

    class Record(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            with open(f"{prefix}.rank{trainer.global_rank}.jsonl", "a") as f:
                f.write(json.dumps([int(trainer.current_epoch), int(batch_idx), list(batch["ids"])]) + "\n")

    return Record()


def main(argv=None) -> None:
    from core.base_model import load_base_model
    from core.config import compose
    from train.run import train

    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--plan", required=True)
    args, common = p.parse_known_args(argv)
    base = load_base_model({"path": args.model_dir, "dtype": "float32", "attn_implementation": "eager"})
    for entry in json.loads(args.plan):
        cfg = compose(["train.logger=csv", "train.progress_bar=false", "train.sanity_val_steps=0",
                       "train.accelerator=cpu", "train.log_every_n_steps=1", *common, *entry["overrides"]])
        callbacks = [stop_callback(entry["stop"])] if entry.get("stop") else []
        if entry.get("poison"):
            callbacks.append(poison_callback(entry["poison"]))
        if entry.get("record"):
            callbacks.append(record_callback(entry["record"]))
        if entry.get("expect_error"):
            from core.finite import NonFiniteError

            try:
                train(cfg, base=base, callbacks=callbacks)
            except NonFiniteError as exc:
                rank = int(os.environ.get("RANK", 0))
                Path(f"{entry['expect_error']}.rank{rank}.txt").write_text(str(exc))
                continue
            raise AssertionError("the run did not stop on the non-finite value")
        result = train(cfg, base=base, callbacks=callbacks)
        if entry.get("stop", {}).get("kind") == "signal":
            assert result["preempted"] is not None and result["preempted"].step == entry["stop"]["step"], result
    from train.strategies import shutdown_distributed

    shutdown_distributed()  # as python -m train does (train.run.main): no gloo teardown at interpreter exit


if __name__ == "__main__":
    main()
