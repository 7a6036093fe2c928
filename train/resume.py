"""Exact resume: ``resume=auto|<path>`` and the data-loader position.

``resume`` (top-level config key):

* ``null`` (default) - start fresh;
* ``auto`` - continue from ``<run dir>/checkpoints/last.ckpt`` when it exists, else start fresh.
  With ``train.run_name`` set the run dir is that run's (Slurm scripts set
  ``train.run_name=<job name>-<job id>``, which survives ``--requeue``); with ``run_name`` null
  the newest run of this head type under ``<output_root>/runs/<head type>/`` that has a
  ``last.ckpt`` is continued, in its own run directory;
* ``<path>`` - a checkpoint file, or a run directory (its ``checkpoints/last.ckpt``).

A checkpoint restores the head weights, the optimizer (for ZeRO: every rank's partition, see
:mod:`train.zero_checkpoint`), the LR scheduler, the loop counters, the global RNG states
(``train.module.DraftHeadModule.on_save_checkpoint``) and the position inside the epoch
(:class:`DataPosition`).  ``last.ckpt`` is written atomically (temp file + rename), so a kill never
leaves a half-written one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

LAST = "last.ckpt"


def last_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest of ``<run_dir>/checkpoints/last.ckpt`` and Lightning's Slurm checkpoints
    ``<run_dir>/hpc_ckpt_<n>.ckpt`` (written on SIGUSR1 before a time limit), or None."""
    run_dir = Path(run_dir)
    found = [p for p in [run_dir / "checkpoints" / LAST, *run_dir.glob("hpc_ckpt_*.ckpt")] if p.is_file()]
    return max(found, key=lambda p: (p.stat().st_mtime, p.name)) if found else None


def resolve_resume(cfg: Any, run_dir_for) -> tuple[Path | None, Path | None]:
    """Resolve ``cfg.resume`` to ``(checkpoint file or None, run directory to use or None)``.

    ``run_dir_for(cfg)`` gives the run directory a fresh run would use (``train.run.run_dir_for``).
    A returned run directory replaces it (the resumed run keeps writing where it was).

    Raises:
        FileNotFoundError: ``resume=<path>`` names no checkpoint file and no run directory with
            ``checkpoints/last.ckpt``.
    """
    value = cfg.get("resume")
    if value in (None, "", "none", "null", False):
        return None, None
    if str(value) == "auto":
        if cfg.train.get("run_name"):
            run_dir = Path(run_dir_for(cfg))
            return last_checkpoint(run_dir), run_dir
        from train.run import runs_root  # the head variant's namespace of run names

        runs = runs_root(cfg)
        found = [ck for d in runs.iterdir() if d.is_dir() and (ck := last_checkpoint(d))] if runs.is_dir() else []
        if not found:
            return None, None
        newest = max(found, key=lambda p: (p.stat().st_mtime, str(p)))
        return newest, newest.parent.parent
    path = Path(str(value))
    if path.is_dir():
        ck = last_checkpoint(path) or (path / LAST if (path / LAST).is_file() else None)
        if ck is None:
            raise FileNotFoundError(f"resume={value}: directory has no checkpoints/{LAST} or {LAST}")
        path = ck
    if not path.is_file():
        raise FileNotFoundError(f"resume={value}: no such checkpoint file or run directory")
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
    return path, run_dir


class DataPosition(Callback):
    """Records how many training batches of the current epoch finished, for mid-epoch resume.

    Lightning stores the state of a train DataLoader that has ``state_dict`` / ``load_state_dict``
    in the checkpoint (``loops.fit_loop.combined_loader``) and gives it back before iterating.
    :class:`train.data.ShardedBatchSampler` reports ``{"epoch", "consumed"}`` and, after a load,
    skips the consumed batches of that epoch.  ``consumed`` must count *finished* batches, not
    the ones the DataLoader has handed out (Lightning prefetches one ahead), so this callback sets
    it at ``on_train_batch_end`` - before ``ModelCheckpoint`` (which Lightning always runs last)
    saves.
    """

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        for sampler in _samplers(trainer):
            sampler.consumed = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        for sampler in _samplers(trainer):
            sampler.consumed = int(batch_idx) + 1


def _samplers(trainer) -> list:
    loaders = trainer.train_dataloader
    if loaders is None:
        return []
    if not isinstance(loaders, (list, tuple)):
        loaders = [loaders]
    out = []
    for dl in loaders:
        sampler = getattr(dl, "sampler", None)
        if hasattr(sampler, "consumed"):
            out.append(sampler)
    return out


# ---------------------------------------------------------------------------------------------
# Checkpoint at every save, pre-emption at optimizer-step boundaries.
# ---------------------------------------------------------------------------------------------
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` that rewrites ``last.ckpt`` at *every* save point.

    Lightning 2.6 rewrites ``last.ckpt`` only when a top-k checkpoint was saved at the same step,
    so after a validation that does not improve the monitor, ``last.ckpt`` stays at the last
    improvement and ``resume=auto`` rewinds to it.  Here every validation end (the save points of
    a run; validation runs every ``train.val_every_n_steps`` optimizer steps) first updates the
    top-k checkpoints as Lightning does, then always writes ``last.ckpt``.
    """

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._should_skip_saving_checkpoint(trainer) or self._should_save_on_train_epoch_end(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._should_skip_saving_checkpoint(trainer) or not self._should_save_on_train_epoch_end(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)

    def save_last_now(self, trainer) -> None:
        """Write ``last.ckpt`` for the current state (a collective call; every rank must call it)."""
        if self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


class Preempted(RuntimeError):
    """Raised inside ``Trainer.fit`` after the pre-emption checkpoint was written; ``signum`` is the signal."""

    def __init__(self, signum: int, step: int, path: str) -> None:
        super().__init__(f"pre-empted by signal {signum} after optimizer step {step}; checkpoint {path}; "
                         "continue with resume=auto")
        self.signum, self.step, self.path = int(signum), int(step), str(path)


class Preemption(Callback):
    """Slurm pre-emption / time limit: ``SIGTERM`` or ``SIGUSR1`` -> checkpoint a whole optimizer step, stop.

    The signal handler only records the signal (it may arrive in the middle of an optimizer step,
    when some parameters are updated and others are not).  At the end of the next batch that
    completes an accumulation window (an optimizer-step boundary) every rank agrees on the flag
    (one all-reduce per optimizer step in multi-process runs, so all ranks checkpoint together,
    which ZeRO-3 requires), ``last.ckpt`` is written - unless a validation is due at that step,
    whose end writes it anyway - and before the next batch starts :class:`Preempted` stops the
    run, so nothing can overwrite that checkpoint.  On ``SIGUSR1`` inside a Slurm job (``#SBATCH
    --signal=SIGUSR1@<s>``, the time-limit warning) rank 0 also runs ``scontrol requeue
    $SLURM_JOB_ID``; on ``SIGTERM`` (pre-emption, ``scancel``) Slurm's own ``--requeue`` restarts
    the job.  ``resume=auto`` continues from the checkpoint.

    Installed at ``on_train_start`` (after Lightning's own handlers, which it replaces for these
    two signals: Lightning's SIGUSR1 handler checkpoints inside the signal handler, i.e. possibly
    halfway through an optimizer step) and restored at train end / on an exception.
    """

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self, checkpoint: RunCheckpoint) -> None:
        self.checkpoint = checkpoint
        self.received: int | None = None
        self._stop_after: int | None = None
        self._at_batch_end = False  # the pre-emption checkpoint is being written at a batch end
        self._previous: dict[int, Any] = {}

    def _handler(self, signum, frame) -> None:
        self.received = int(signum)

    def on_train_start(self, trainer, pl_module) -> None:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handler)

    def _restore(self) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()

    def _agreed(self, trainer) -> int:
        import torch

        signum = self.received or 0
        if trainer.world_size > 1:
            flag = torch.tensor([signum], dtype=torch.long, device=trainer.strategy.root_device)
            signum = int(trainer.strategy.reduce(flag, reduce_op="max").item())
        return signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        loop = trainer.fit_loop.epoch_loop
        if loop._should_accumulate():  # mid-window: the optimizer has not stepped yet
            return
        signum = self._agreed(trainer)
        if not signum:
            return
        self.received = signum
        if not loop._should_check_val_fx(trainer.fit_loop._data_fetcher):
            self._at_batch_end = True  # else the validation end of this step writes it
            try:
                self.checkpoint.save_last_now(trainer)
            finally:
                self._at_batch_end = False
        self._stop_after = int(trainer.global_step)
        if signum == getattr(__import__("signal"), "SIGUSR1", -1):
            _slurm_requeue(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """Record the batch whose end writes the pre-emption checkpoint as completed.

        Lightning counts a batch completed only after its ``on_train_batch_end`` hooks, so a
        checkpoint written there holds ``completed = processed - 1``.  On restart Lightning
        completes that batch itself, but when it was the epoch's last one it also counts the epoch
        processed and then starts the next epoch as the one after it: the resumed run skipped an
        epoch (epoch 0's end resumed in epoch 2).  With the batch counted completed here the
        checkpoint is the one a validation ending the same optimizer step writes, whose resume is exact.
        """
        if not self._at_batch_end:
            return
        progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
        for part in ("total", "current"):
            progress[part]["completed"] = progress[part]["processed"]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self._stop_after is not None:
            self.checkpoint.save_last_now(trainer)  # no-op unless the due validation was skipped
            raise Preempted(self.received or 0, self._stop_after, self.checkpoint.last_model_path)


def _slurm_requeue(trainer) -> None:
    """``scontrol requeue <job>`` on global rank 0 inside a Slurm job (array jobs: ``<array>_<task>``)."""
    import logging
    import os
    import subprocess

    job = os.environ.get("SLURM_JOB_ID")
    if not trainer.is_global_zero or not job:
        return
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    try:
        rc = subprocess.call(["scontrol", "requeue", job])
    except FileNotFoundError:
        rc = -1
    if rc != 0:
        logging.getLogger(__name__).warning("scontrol requeue %s failed (exit %s)", job, rc)


# ---------------------------------------------------------------------------------------------
# What a resume may change.
# ---------------------------------------------------------------------------------------------
#: Config keys (dotted; a trailing ``.*`` covers a section) that may differ between the launches of
#: one run: where and how it runs and logs, not what it trains.  Everything else - the head
#: (``heads.*``), base model (``model.*``), data and cache (``data.*``, ``prep.*``, ``labels``,
#: ``train.cache_dir``), ``seed`` and the training settings (budgets, batch, optimizer, schedule,
#: accumulation, precision, validation cadence) - defines the run and is refused.
MAY_CHANGE_ON_RESUME = (
    "resume", "output_root", "train.run_name", "train.devices", "train.num_nodes", "train.accelerator",
    "train.logger", "train.wandb_project", "train.progress_bar", "train.log_every_n_steps", "train.num_workers",
    "train.sanity_val_steps", "strategy.*", "eval.*",
)


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: obj}


def _may_change(key: str) -> bool:
    return any(key == p or (p.endswith(".*") and key.startswith(p[:-1])) for p in MAY_CHANGE_ON_RESUME)


def changed_run_keys(recorded: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (recorded value, new value)}`` for every key that defines the run and differs
    (a key present on one side only counts, as ``<absent>``); keys in :data:`MAY_CHANGE_ON_RESUME` are ignored."""
    a, b = _flatten(recorded), _flatten(current)
    missing = "<absent>"
    return {k: (a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if not _may_change(k) and a.get(k, missing) != b.get(k, missing)}


def check_resume_config(cfg: Any, run_dir: str | Path) -> None:
    """Refuse to resume ``run_dir`` with a config that changes what the run trains.

    Compares the resolved ``cfg`` with the run's recorded ``config.yaml`` (written by its first
    launch) and raises before anything is written.  A run directory without ``config.yaml`` is
    not checked.

    Raises:
        UserInputError: names every changed key with its recorded and new value.
    """
    from omegaconf import OmegaConf

    from core.config import UserInputError, to_container

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return
    recorded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    current = to_container(cfg)
    if recorded.get("train", {}).get("precision") == "auto":
        # recorded before auto was resolved: train.run.resolve_run_precision gives it its old meaning
        recorded["train"]["precision"] = current.get("train", {}).get("precision")
    changed = changed_run_keys(recorded, current)
    if changed:
        shown = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in list(changed.items())[:8])
        more = f" (and {len(changed) - 8} more)" if len(changed) > 8 else ""
        raise UserInputError(f"resume of {run_dir} would change what the run trains: {shown}{more}; "
                             f"resume with the recorded settings ({path}) or start a new run (another "
                             f"train.run_name); only {', '.join(MAY_CHANGE_ON_RESUME)} may change on resume")


def record_launch(cfg: Any, run_dir: str | Path) -> Path:
    """Write this launch's resolved config as ``<run_dir>/launches/<n>.yaml`` (n = 1, 2, ... for
    the resumed launches; the first launch's record is ``config.yaml``, never overwritten)."""
    from omegaconf import OmegaConf

    from core.io import atomic_write_text

    directory = Path(run_dir) / "launches"
    directory.mkdir(parents=True, exist_ok=True)
    n = 1 + max([int(p.stem) for p in directory.glob("*.yaml") if p.stem.isdigit()], default=0)
    path = directory / f"{n}.yaml"
    atomic_write_text(path, OmegaConf.to_yaml(cfg, resolve=True))
    return path
