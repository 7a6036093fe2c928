"""One rank of a multi-process training run, for tests/test_distributed.py, test_resume.py and
test_slurm.py (run as a subprocess: Lightning's DDP would otherwise re-launch pytest itself).

Also defines the small test head (registered as ``test_dist``) and the tiny-cache writer those
tests share, so the distributed tests depend on no method head.

Usage (one process per rank; RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set by
the caller, or SLURM_* by srun)::

    python tests/_distributed_worker.py --model-dir D --cache C [--kill-after-step N] key=value ...

Writes ``<output_root>/runs/test_dist/<run_name>/`` like ``python -m train`` and, on rank 0,
``result.json`` there: the last training loss and every exported weight's sum.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import heads  # noqa: E402
from heads.base import DraftHead, Progress  # noqa: E402

AUX_LAYER = 2


@heads.register
class DistTestHead(DraftHead):
    """Two-layer MLP drafter on the cached final hidden state, read out by the frozen LM head.

    ``h [B,T,H]`` -> ``LayerNorm`` -> ``Linear(H, 2H)`` -> SiLU -> ``Linear(2H, H)`` (+ residual)
    -> frozen final norm -> frozen LM head -> logits ``[B,T,V]``; cross-entropy against the
    greedy ``labels`` on ``loss_mask``.  Several parameter tensors of different sizes, so ZeRO-3
    really partitions them; the borrowed base weights are non-persistent buffers.
    """

    head_type = "test_dist"
    monitor_metric = "loss"
    monitor_mode = "min"

    def __init__(self, cfg, base_config):
        super().__init__(cfg, base_config)
        g = torch.Generator().manual_seed(int(cfg.get("init_seed", 0)))
        H = self.hidden_size
        self.norm = torch.nn.LayerNorm(H)
        self.up = torch.nn.Linear(H, 2 * H)
        self.down = torch.nn.Linear(2 * H, H)
        with torch.no_grad():
            for p in (self.up.weight, self.down.weight):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)

    def logits(self, batch):
        """[B,T,V], or [B,T,N] over a draft vocabulary (``heads.draft_vocab_size``)."""
        h = batch["hidden"].float()
        z = h + self.down(F.silu(self.up(self.norm(h))))
        return self.draft_lm_head(self.final_norm(z))

    def _ce(self, batch):
        """CE per loss position whose label is in the draft vocabulary (OOV positions are dropped)."""
        logits = self.logits(batch)
        target = self.to_draft_ids(batch["labels"])
        m = batch["loss_mask"].bool() & (target >= 0)
        return F.cross_entropy(logits[m].float(), target[m], reduction="none")

    def training_loss(self, batch, progress: Progress):
        ce = self._ce(batch)
        return ce.mean(), {"tokens": float(ce.numel())}

    @torch.no_grad()
    def validation_metrics(self, batch):
        ce = self._ce(batch)
        return {"loss": torch.stack([ce.sum().double().cpu(), torch.tensor(float(ce.numel()), dtype=torch.float64)])}


def write_tiny_cache(root: Path, model_dir: Path, n_train: int = 24, n_val: int = 8) -> Path:
    """A real-format cache of random token sequences through the tiny base at ``model_dir``
    (``data_prep.synthetic.write_random_cache``; final layer + ``AUX_LAYER``).  Returns ``root``."""
    from data_prep.synthetic import write_random_cache

    return write_random_cache(root, model_dir, n_train=n_train, n_val=n_val, layers=[AUX_LAYER],
                              length_range=(6, 20), shard_size=8, tag="test")


def kill_after_step(n: int):
    """A callback that hard-exits every rank (``os._exit``: no cleanup, like SIGKILL) when step
    ``n + 1`` is about to start, i.e. after step ``n``'s checkpoint (``ModelCheckpoint`` saves at
    the validation / batch end of step ``n``) - the "kill" half of the resume test."""
    from lightning.pytorch.callbacks import Callback

    class KillAfterStep(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step >= n:
                trainer.strategy.barrier("kill")
                os._exit(17)

    return KillAfterStep()


def run_one(model_dir: str, overrides: list[str], kill_after: int | None = None, base=None,
            draft_vocab_size: int | None = None) -> None:
    """Train the test head once with ``overrides`` (see the module docstring for what is written)."""
    from omegaconf import OmegaConf, open_dict

    from core.base_model import load_base_model
    from core.config import compose
    from train.run import train

    cfg = compose(["train.logger=csv", "train.progress_bar=false", "train.sanity_val_steps=0",
                   "train.accelerator=cpu", "train.log_every_n_steps=1", *overrides])
    with open_dict(cfg):
        cfg.heads = OmegaConf.create({"type": "test_dist", "init_seed": 0, "draft_vocab_size": draft_vocab_size})
    if base is None:
        base = load_base_model({"path": model_dir, "dtype": "float32", "attn_implementation": "eager"})
    callbacks = [kill_after_step(kill_after)] if kill_after is not None else []
    result = train(cfg, base=base, callbacks=callbacks)
    trainer, module = result["trainer"], result["module"]
    local = {}
    if getattr(trainer.strategy, "zero_stage", 0) == 3:
        for name, p_ in module.head.named_parameters():
            local[name] = [int(p_.ds_tensor.numel()), int(p_.ds_numel)]
    run_dir = Path(result["run_dir"])
    if local:
        (run_dir / f"zero3_rank{trainer.global_rank}.json").write_text(json.dumps(local))
    if trainer.is_global_zero:
        loss = trainer.callback_metrics.get("train/loss")
        out = {"loss": float(loss) if loss is not None else None, "global_step": int(trainer.global_step),
               "world_size": int(trainer.world_size), "strategy": type(trainer.strategy).__name__,
               "exports": {k: str(v) for k, v in result["exports"].items()}}
        (run_dir / "result.json").write_text(json.dumps(out, indent=1))


def main(argv=None) -> None:
    """``--plan`` (JSON list of override lists) runs several trainings in these processes in turn
    (the process group is reused), sharing one interpreter start-up; the last may be killed."""
    from core.base_model import load_base_model

    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--kill-after-step", type=int, default=None, help="applies to the last run of the plan")
    p.add_argument("--plan", default=None, help='JSON: [["strategy=ddp", "train.run_name=a"], ...]')
    p.add_argument("--draft-vocab-size", type=int, default=None, help="heads.draft_vocab_size of the test head")
    args, common = p.parse_known_args(argv)
    plan = json.loads(args.plan) if args.plan else [[]]
    base = load_base_model({"path": args.model_dir, "dtype": "float32", "attn_implementation": "eager"})
    for i, overrides in enumerate(plan):
        kill = args.kill_after_step if i == len(plan) - 1 else None
        run_one(args.model_dir, [*common, *overrides], kill, base=base, draft_vocab_size=args.draft_vocab_size)
    from train.strategies import shutdown_distributed

    shutdown_distributed()  # as python -m train does (train.run.main): no gloo teardown at interpreter exit


if __name__ == "__main__":
    main()
