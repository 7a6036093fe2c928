"""The Lightning module that trains one draft head on cached batches.

Only the head is trained.  The frozen base model is *not* a submodule: the head borrows its
embedding, final norm and LM head as non-persistent buffers (``heads.base.DraftHead.attach_base``),
so the module's ``state_dict`` and every checkpoint hold the head's own weights only, and
DeepSpeed ZeRO-3 never shards the borrowed weights.

Optimisation (METHODS.md §6): ``torch.optim.AdamW`` (lr, betas, eps, weight decay on matrices
only), linear warmup then linear / cosine decay to ``min_lr_ratio`` (or constant), stepped every
optimizer step; gradient clipping by value or norm is the Trainer's (``train.grad_clip``).

Finite values (:mod:`train.finite`): a non-finite loss or gradient stops training before the
update, on every rank, naming the step and the window's conversation ids.

Validation: the head's ``validation_metrics(batch)`` values are summed over batches and ranks
as ``(sum, count)`` pairs, and ``val/<name> = Σ sum / Σ count`` - an exact mean over the whole
held-out split, not a mean of per-batch means.
"""
from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
import torch

import heads
from heads.base import Progress


def accumulate_metrics(sums: dict[str, torch.Tensor], metrics: dict[str, Any], weight: float = 1.0) -> None:
    """Add one batch's ``validation_metrics`` into ``sums`` ({name: float64 [Σ sum, Σ count]}),
    each pair scaled by ``weight`` (0 for a padding batch); ``Σ sum / Σ count`` is the split mean."""
    for name, value in metrics.items():
        pair = metric_pair(name, value) * weight
        sums[name] = sums.get(name, torch.zeros(2, dtype=torch.float64)) + pair


def metric_pair(name: str, value: Any) -> torch.Tensor:
    """Normalise one ``validation_metrics`` value to a float64 ``[sum, count]`` tensor.

    Accepted forms: a tensor of shape [2] ``(sum, count)``; a tuple/list ``(sum, count)``; a
    0-d tensor or float, treated as one observation ``(value, 1)`` (i.e. averaged over batches).

    Raises:
        ValueError: any other shape, naming the metric.
    """
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"validation metric {name!r}: expected (sum, count), got {len(value)} values")
        return torch.stack([torch.as_tensor(v, dtype=torch.float64).detach().reshape(()).cpu() for v in value])
    t = torch.as_tensor(value).detach().to(torch.float64).cpu()
    if t.dim() == 0:
        return torch.stack([t, torch.ones((), dtype=torch.float64)])
    if t.shape == (2,):
        return t
    raise ValueError(f"validation metric {name!r}: expected a scalar or a [sum, count] pair, got shape {tuple(t.shape)}")


def head_monitor(head_cls) -> tuple[str, str]:
    """``("val/<metric>", mode)`` from the head class's ``monitor_metric`` / ``monitor_mode``
    (``heads.base.DraftHead``; default ``("val/sim_tau", "max")``)."""
    metric = str(getattr(head_cls, "monitor_metric", "sim_tau"))
    mode = str(getattr(head_cls, "monitor_mode", "max"))
    if mode not in ("max", "min"):
        raise ValueError(f"{head_cls.__name__}.monitor_mode={mode!r} must be 'max' or 'min'")
    return f"val/{metric}", mode


_RESERVED = {"lr", "tokens_per_s", "assistant_tokens_per_s"}  # train/ keys the module logs itself


class WarmupDecay:
    """LR multiplier: linear warmup from 0 over ``warmup_steps``, then ``name`` decay to ``min_ratio``.

    ``name``: ``linear`` | ``cosine`` | ``constant``.  ``total_steps`` is the optimizer-step budget.
    A plain object (not a closure) so that ``LambdaLR.state_dict()`` stores its settings as JSON-safe
    values.
    """

    def __init__(self, name: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> None:
        if name not in ("linear", "cosine", "constant"):
            raise ValueError(f"unknown schedule {name!r}; choices: linear, cosine, constant")
        self.name = name
        self.warmup_steps = int(warmup_steps)
        self.total_steps = max(1, int(total_steps))
        self.min_ratio = float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.name == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        frac = min(1.0, (step - self.warmup_steps) / span)
        if self.name == "linear":
            shape = 1.0 - frac
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.min_ratio + (1.0 - self.min_ratio) * shape


class DraftHeadModule(pl.LightningModule):
    """Trains the head described by ``heads_cfg`` on top of a frozen ``base_model``.

    Args:
        heads_cfg: the ``heads`` config section (with ``type``).
        train_cfg: the ``train`` config section (``optimizer``, ``scheduler`` sub-sections).
        base_model: the frozen HF base model; only borrowed (see module docstring), never stored.
        head: an already-built head to train instead of building one (e.g. loaded from a checkpoint).
        features: ``train.online.BaseFeatures`` for ``train.features=online|hybrid``: a batch without
            ``hidden`` is filled in by the frozen base (moved to this module's device at fit start)
            before the head sees it; None (offline) = batches come from the cache.

    Logged: ``train/loss``, ``train/<head metric>``, ``train/lr``, ``train/tokens_per_s`` (all
    non-padding tokens per second on this device), ``train/assistant_tokens_per_s`` (loss-mask
    tokens), ``val/<metric>`` for each head validation metric (``val/loss``, ``val/sim_tau``...).
    """

    def __init__(self, heads_cfg: Any, train_cfg: Any, base_model=None, head=None, features=None) -> None:
        super().__init__()
        from omegaconf import DictConfig, OmegaConf

        to_plain = lambda c: OmegaConf.to_container(c, resolve=True) if isinstance(c, DictConfig) else dict(c)
        self.heads_cfg = to_plain(heads_cfg)
        self.train_cfg = to_plain(train_cfg)
        if head is None:
            if base_model is None:
                raise ValueError("DraftHeadModule needs base_model (to build the head) or head")
            head = heads.build(self.heads_cfg, base_model)
        self.head = head
        self.features = features  # a plain object: the base is never a submodule (not saved, not sharded)
        self.monitor = head_monitor(type(head))
        self._val_sums: dict[str, torch.Tensor] = {}
        self._tick: float | None = None
        #: what the batches are built from (train.resume.data_identity), recorded in every checkpoint
        self.data_identity: dict[str, Any] = {}
        self._window: list[list[str]] = []  # conversation ids of the open accumulation window's micro-batches

    # -- optimisation ------------------------------------------------------------------------
    def total_steps(self) -> int:
        """Optimizer-step budget: ``max_steps``, else the Trainer's estimate from epochs."""
        steps = int(self.trainer.max_steps) if self.trainer.max_steps and self.trainer.max_steps > 0 else -1
        if steps < 1:
            steps = int(self.trainer.estimated_stepping_batches)
        return max(1, steps)

    def configure_optimizers(self):
        opt_cfg, sch_cfg = self.train_cfg["optimizer"], self.train_cfg["scheduler"]
        params = [(n, p) for n, p in self.head.named_parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"head {self.heads_cfg.get('type')!r} has no trainable parameters")
        decay = [p for n, p in params if p.dim() >= 2]
        no_decay = [p for n, p in params if p.dim() < 2]
        groups = [g for g in ({"params": decay, "weight_decay": float(opt_cfg["weight_decay"])},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        optimizer = torch.optim.AdamW(groups, lr=float(opt_cfg["lr"]), betas=tuple(float(b) for b in opt_cfg["betas"]),
                                      eps=float(opt_cfg["eps"]))
        built = self.trainer.fit_loop._combined_loader is not None
        schedule = WarmupDecay(sch_cfg["name"], sch_cfg["warmup_steps"], self.total_steps(), sch_cfg["min_lr_ratio"])
        if not built and self.trainer.fit_loop._combined_loader is not None:
            # An epoch budget made Lightning build (and start iterating) the training loader to
            # estimate the step count - before a resumed run's checkpoint restores the loop and
            # sampler state.  Drop it: the fit loop rebuilds it after the restore, so the sampler
            # position is applied (train.resume: exact resume under epoch budgets).
            self.trainer.fit_loop._combined_loader = None
            self.trainer.fit_loop._data_fetcher = None
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    def progress(self) -> Progress:
        """Where training is (optimizer steps / epochs, with the configured totals)."""
        total_steps = self.total_steps()
        max_epochs = int(self.trainer.max_epochs or -1)
        if max_epochs < 1:
            per_epoch = max(1, int(self.trainer.num_training_batches) // max(1, self.trainer.accumulate_grad_batches)) \
                if math.isfinite(self.trainer.num_training_batches) else total_steps
            max_epochs = max(1, math.ceil(total_steps / per_epoch))
        return Progress(step=int(self.global_step), total_steps=total_steps,
                        epoch=int(self.current_epoch), total_epochs=max_epochs)

    # -- online / hybrid features (train.online) -----------------------------------------------
    def on_fit_start(self) -> None:
        if self.features is not None:
            self.features.to(self.device)

    def with_features(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` with the base's hidden states and labels (online/hybrid); unchanged if cached."""
        if self.features is None or "hidden" in batch:
            return batch
        return self.features(batch)

    def _finalize_hybrid(self) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        if hasattr(dm, "finalize_hybrid"):
            dm.finalize_hybrid()

    def on_train_epoch_end(self) -> None:
        self._finalize_hybrid()

    # -- training ----------------------------------------------------------------------------
    def on_train_epoch_start(self) -> None:
        self._tick = time.perf_counter()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        from core.finite import NonFiniteError
        from train.finite import batch_detail, check_window

        self._window.append(list(batch.get("ids", [])))  # this accumulation window's conversations
        loss, error = None, None
        try:
            batch = self.with_features(batch)
            loss, metrics = self.head.training_loss(batch, self.progress())
        except NonFiniteError as exc:  # e.g. fp8 rounding of non-finite online features: agreed below
            error = str(exc)
        bad, detail = batch_detail(batch, loss, error, batch_idx)
        check_window("training batch", self.trainer, bad, detail, self._window)  # all ranks, before backward
        n = int(batch["input_ids"].shape[0])
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=n)
        for name, value in metrics.items():
            if name == "loss":  # the returned loss is train/loss
                continue
            key = f"train/head_{name}" if name in _RESERVED else f"train/{name}"
            self.log(key, float(value), batch_size=n)
        if self.trainer.optimizers:  # the lr this step's update uses (logged before the scheduler steps)
            self.log("train/lr", float(self.trainer.optimizers[0].param_groups[0]["lr"]), batch_size=n)
        self._tokens = (int(batch["attention_mask"].sum()), int(batch["loss_mask"].sum()))
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        """Stop on a non-finite gradient before the update (and before clipping), on every rank
        together (:mod:`train.finite`); ZeRO-2/3 partitions are checked by the strategy's hook."""
        from train.finite import LOSS_SCALED, check_window, grad_detail

        if str(self.trainer.precision) in LOSS_SCALED:  # the loss scaler skips such steps itself
            return
        bad, detail = grad_detail((f"head.{n}", p.grad) for n, p in self.head.named_parameters())
        check_window("gradient", self.trainer, bad, detail, self._window)

    def check_partition_gradients(self, grads) -> None:
        """:meth:`on_before_optimizer_step` for ZeRO's flat gradient partitions (``grads``: this
        rank's fp32 partition gradients); called by :class:`train.strategies.ZeroStrategy`."""
        from train.finite import LOSS_SCALED, check_window, grad_detail

        if str(self.trainer.precision) in LOSS_SCALED:
            return
        bad, detail = grad_detail((f"ZeRO flat partition {i}", g) for i, g in enumerate(grads))
        check_window("gradient", self.trainer, bad, detail, self._window)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if not self.trainer.fit_loop.epoch_loop._should_accumulate():  # the window's optimizer step is done
            from train.finite import LOSS_SCALED, check_window

            skipped = getattr(self.trainer.strategy, "skipped_non_finite_step", None)
            if skipped is not None and str(self.trainer.precision) not in LOSS_SCALED and skipped():
                check_window("gradient", self.trainer, True, "DeepSpeed found the gradient norm non-finite and "
                             "skipped the update", self._window, step=int(self.global_step))
            self._window = []
        # The logged row's step is the number of finished optimizer steps (Lightning's default is
        # one less), the number checkpoint names carry (train.run_logs).
        self.log("step", float(self.global_step))
        self.log("epoch", float(self.current_epoch))
        now = time.perf_counter()
        if self._tick is not None and now > self._tick:
            dt = now - self._tick
            self.log("train/tokens_per_s", self._tokens[0] / dt, prog_bar=True)
            self.log("train/assistant_tokens_per_s", self._tokens[1] / dt)
        self._tick = now

    # -- validation --------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self._val_sums = {}

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        weight = 0.0 if batch.get("is_padding", False) else 1.0
        batch = self.with_features(batch)
        accumulate_metrics(self._val_sums, self.head.validation_metrics(batch), weight)

    def aggregated_validation(self) -> dict[str, float]:
        """``{name: Σ sum / Σ count}`` over this epoch's batches and all ranks (a collective call)."""
        names = sorted(self._val_sums)
        if not names:
            return {}
        stacked = torch.stack([self._val_sums[n] for n in names]).to(self.device)
        if self.trainer is not None and self.trainer.world_size > 1:
            stacked = self.trainer.strategy.reduce(stacked, reduce_op="sum")
        stacked = stacked.double().cpu()
        return {n: (float(s) / float(c) if c > 0 else float("nan")) for n, (s, c) in zip(names, stacked)}

    def on_validation_epoch_end(self) -> None:
        self._finalize_hybrid()
        values = self.aggregated_validation()
        self.validation_results = values
        if self.trainer.sanity_checking:
            return
        monitor = self.monitor[0]
        if monitor.startswith("val/") and monitor[4:] not in values:
            raise KeyError(f"head {self.heads_cfg.get('type')!r} declares monitor {monitor!r} but its "
                           f"validation_metrics return only {sorted(values)}")
        for name, value in values.items():
            self.log(f"val/{name}", value, prog_bar=name in ("loss", "sim_tau"), sync_dist=False)
        # identical on every rank; sync_dist only so Lightning does not warn about it
        self.log("step", float(self.global_step), sync_dist=True)
        self.log("epoch", float(self.current_epoch), sync_dist=True)

    # -- resume state ------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add the global RNG states (torch, numpy, python, cuda) of *every* rank for exact resume,
        ``data_identity`` (the data the run trains on, :func:`train.resume.data_identity`) and
        ``world_size`` (the ranks that wrote it, :func:`train.resume.check_resume_world_size`).

        ``rng_states`` is this (global rank 0's) state; with several ranks ``rng_states_per_rank``
        holds each rank's (gathered here: Lightning calls this hook on every rank, rank 0 writes).
        Ranks draw different amounts of randomness (feature noise, glancing masks of differently
        shaped batches), so restoring rank 0's state everywhere would not resume exactly.
        """
        from lightning.fabric.utilities.seed import _collect_rng_states

        states = _collect_rng_states(include_cuda=torch.cuda.is_available())
        checkpoint["rng_states"] = states
        if self.data_identity:  # checked on resume (train.resume.check_resume_data)
            checkpoint["data_identity"] = self.data_identity
        trainer = self._trainer
        if trainer is not None:  # checked on resume (train.resume.check_resume_world_size)
            checkpoint["world_size"] = int(trainer.world_size)
        if trainer is not None and trainer.world_size > 1 and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, states)  # in memory; the file holds no pickle
            checkpoint["rng_states_per_rank"] = gathered

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        from lightning.fabric.utilities.seed import _set_rng_states

        per_rank = checkpoint.get("rng_states_per_rank")
        trainer = self._trainer
        if per_rank and trainer is not None and len(per_rank) == trainer.world_size:
            _set_rng_states(per_rank[trainer.global_rank])
        elif "rng_states" in checkpoint:
            _set_rng_states(checkpoint["rng_states"])
