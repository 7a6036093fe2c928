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

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from train.run_dirs import runs_root

LAST = "last.ckpt"


def last_checkpoint(run_dir: str | Path) -> Path | None:
    """The furthest of ``<run_dir>/checkpoints/last.ckpt`` and Lightning's Slurm checkpoints
    ``<run_dir>/hpc_ckpt_<n>.ckpt`` (written on SIGUSR1 before a time limit), or None.

    Furthest by the ``global_step`` each file records (read from its header alone,
    :func:`train.checkpoint_io.checkpoint_entry`), then by modification time: a run folder copied without
    keeping times (``cp -r``, ``rsync`` without ``-t``) gives its files arbitrary times, and resuming from the
    older one would repeat steps.  When a file's header cannot be read, modification time alone decides, and
    the load names the unreadable file."""
    from train.checkpoint_io import checkpoint_entry

    run_dir = Path(run_dir)
    found = [p for p in [run_dir / "checkpoints" / LAST, *run_dir.glob("hpc_ckpt_*.ckpt")] if p.is_file()]
    if not found:
        return None
    try:
        steps = {p: checkpoint_entry(p, "global_step") for p in found}
    except (OSError, ValueError):
        steps = {}
    if len(steps) != len(found) or not all(isinstance(s, int) for s in steps.values()):
        return max(found, key=lambda p: (p.stat().st_mtime, p.name))
    return max(found, key=lambda p: (steps[p], p.stat().st_mtime, p.name))


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run directory a checkpoint file belongs to: ``<run>/checkpoints/*.ckpt`` and Lightning's Slurm
    ``<run>/hpc_ckpt_<n>.ckpt`` (:func:`last_checkpoint`); None for a file anywhere else."""
    checkpoint = Path(checkpoint)
    if checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent
    if checkpoint.name.startswith("hpc_ckpt_"):
        return checkpoint.parent
    return None


def resolve_resume(cfg: Any, run_dir_for) -> tuple[Path | None, Path | None]:
    """Resolve ``cfg.resume`` to ``(checkpoint file or None, run directory to use or None)``.

    ``run_dir_for(cfg)`` gives the run directory a fresh run would use (``train.run.run_dir_for``).
    A returned run directory replaces it (the resumed run keeps writing where it was).

    Raises:
        FileNotFoundError: ``resume=<path>`` names no checkpoint file and no run directory with
            ``checkpoints/last.ckpt``.
        UserInputError: ``train.run_name`` names another run than the one ``resume=<path>`` continues.
    """
    value = cfg.get("resume")
    if value in (None, "", "none", "null", False):
        return None, None
    if str(value) == "auto":
        if cfg.train.get("run_name"):
            run_dir = Path(run_dir_for(cfg))
            return last_checkpoint(run_dir), run_dir
        runs = runs_root(cfg)
        found = [ck for d in runs.iterdir() if d.is_dir() and (ck := last_checkpoint(d))] if runs.is_dir() else []
        if not found:
            return None, None
        newest = max(found, key=lambda p: (p.stat().st_mtime, str(p)))
        return newest, run_dir_of(newest)
    path = Path(str(value))
    if path.is_dir():
        ck = last_checkpoint(path) or (path / LAST if (path / LAST).is_file() else None)
        if ck is None:
            raise FileNotFoundError(f"resume={value}: directory has no checkpoints/{LAST} or {LAST}")
        path = ck
    if not path.is_file():
        raise FileNotFoundError(f"resume={value}: no such checkpoint file or run directory")
    run_dir = run_dir_of(path)
    from core.config import UserInputError

    named = Path(run_dir_for(cfg)) if cfg.train.get("run_name") else None
    if run_dir is not None and named is not None and named.resolve() != run_dir.resolve():
        # the resumed run writes where its checkpoint is: the other run's last/ and best/ would be rewritten
        raise UserInputError(f"resume={value} continues the run in {run_dir}, but train.run_name="
                             f"{cfg.train.run_name} names {named}: leave train.run_name out (or set it to "
                             f"{run_dir.name}) to continue that run; a resume never starts another one")
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

    A checkpoint holds whole optimizer steps only: no save happens inside an accumulation window.
    A validation runs there only when the run is told to stop (``trainer.should_stop``: the
    ``train.max_time`` Timer, early stopping); its checkpoint would record the window's finished
    micro-batches as consumed while their gradients are in no saved weight, so a resume would skip
    them (issue 28).  ``last.ckpt`` then stays at the last whole step, from which a resume is exact.
    """

    @staticmethod
    def mid_window(trainer) -> bool:
        """True while an accumulation window is open (some micro-batches accumulated, no optimizer step yet)."""
        return bool(trainer.fit_loop.epoch_loop._should_accumulate())

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._should_skip_saving_checkpoint(trainer) or self._should_save_on_train_epoch_end(trainer):
            return
        if self.mid_window(trainer):
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"validation inside an accumulation window (the run was told to stop at step "
                           f"{trainer.global_step}): no checkpoint written there; last.ckpt stays at the last whole "
                           "optimizer step")
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

    def on_train_end(self, trainer, pl_module) -> None:
        if not self.mid_window(trainer):
            super().on_train_end(trainer, pl_module)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning's restore, for a run whose folder was moved or renamed since the checkpoint was written.

        Lightning keeps the top-k ranking only when the checkpoint's ``dirpath`` equals this run's; else
        it forgets the scores but keeps the old ``best_model_path``, so the first validation after the
        resume became ``best/`` whatever its τ.  A run folder is moved whole: the paths under the old
        ``dirpath`` are mapped to the same names under this one, and the ranking is restored.  A file that
        is not under the new folder but still under the old one (a checkpoint copied out of its run and
        resumed from there) keeps its old path."""
        old = state_dict.get("dirpath")
        if old is None or self.dirpath is None or os.path.normpath(old) == os.path.normpath(self.dirpath):
            return super().load_state_dict(state_dict)

        def moved(path):
            if not path:
                return path
            rel = os.path.relpath(path, old)
            new = path if rel.startswith("..") else os.path.join(self.dirpath, rel)
            # a checkpoint copied out of its run (resume=<file>): the ranked files stay in the old folder
            return path if not os.path.exists(new) and os.path.exists(path) else new

        state = dict(state_dict, dirpath=self.dirpath,
                     best_model_path=moved(state_dict.get("best_model_path")),
                     kth_best_model_path=moved(state_dict.get("kth_best_model_path")),
                     last_model_path=moved(state_dict.get("last_model_path")),
                     best_k_models={moved(k): v for k, v in (state_dict.get("best_k_models") or {}).items()})
        super().load_state_dict(state)

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

    ``SIGINT`` (Ctrl-C) takes the same path: the first one prints one line and stops at the next
    optimizer-step boundary with ``last.ckpt`` written; before :class:`Preempted` is raised,
    :attr:`on_interrupt` (set by ``train.run.train``: export ``last/`` and ``best/``) runs on every
    rank while the strategy is still up.  A second Ctrl-C raises ``KeyboardInterrupt`` at once
    (Lightning then shuts down without saving).

    Installed at ``on_train_start`` (after Lightning's own handlers, which it replaces for these
    signals: Lightning's SIGUSR1 handler checkpoints inside the signal handler, i.e. possibly
    halfway through an optimizer step) and restored at train end / on an exception.
    """

    SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")

    def __init__(self, checkpoint: RunCheckpoint) -> None:
        self.checkpoint = checkpoint
        self.received: int | None = None
        self.on_interrupt = None  # callable(trainer), run on every rank before a SIGINT stop
        self._stop_after: int | None = None
        self._at_batch_end = False  # the pre-emption checkpoint is being written at a batch end
        self._previous: dict[int, Any] = {}
        self._rank = 0

    def _handler(self, signum, frame) -> None:
        import os
        import signal

        if signum == signal.SIGINT:
            if self.received == signal.SIGINT:  # the second Ctrl-C: abort now, nothing more is saved
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt
            if self._rank == 0:  # os.write: print() is not safe inside a signal handler
                os.write(2, b"\ndraftheads: Ctrl-C - saving checkpoints/last.ckpt, last/ and best/ at the end of this "
                            b"optimizer step, then stopping (Ctrl-C again aborts without saving)\n")
        if signum != signal.SIGINT and self.received == signal.SIGINT:
            return  # an interrupt already asked for the save and the exports
        self.received = int(signum)

    def on_train_start(self, trainer, pl_module) -> None:
        import signal
        import threading

        self._rank = int(trainer.global_rank)
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
            import signal

            self.checkpoint.save_last_now(trainer)  # no-op unless the due validation was skipped
            if self.received == signal.SIGINT and self.on_interrupt is not None:
                self.on_interrupt(trainer)
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
#: accumulation, precision, validation cadence) - defines the run and is refused.  The strategy may
#: change (``auto`` <-> ``ddp``) but not its ZeRO stage: :func:`check_resume_strategy`.
MAY_CHANGE_ON_RESUME = (
    "resume", "output_root", "train.run_name", "train.devices", "train.num_nodes", "train.accelerator",
    "train.logger", "train.wandb_project", "train.progress_bar", "train.log_every_n_steps", "train.num_workers",
    "train.sanity_val_steps", "train.verify_cache", "strategy.*", "choices.strategy", "eval.*",
)

#: Keys added to the config after runs were recorded without them, with the value that trains as
#: before they existed: absent from a run's recorded ``config.yaml`` and at this value now, they are
#: unchanged (so runs started before the key existed still resume).
ADDED_KEYS_NEUTRAL = {"train.val_schedule": "steps", "train.val_first_tokens": 32768, "train.val_factor": 2.0}


def _may_change(key: str) -> bool:
    return any(key == p or (p.endswith(".*") and key.startswith(p[:-1])) for p in MAY_CHANGE_ON_RESUME)


def changed_run_keys(recorded: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (recorded value, new value)}`` for every key that defines the run and differs
    (a key present on one side only counts, as ``<absent>``); keys in :data:`MAY_CHANGE_ON_RESUME` are ignored."""
    from core.config import flatten_dotted

    a, b = flatten_dotted(recorded), flatten_dotted(current)
    missing = "<absent>"
    for k, neutral in ADDED_KEYS_NEUTRAL.items():  # a run recorded before the key existed
        if k not in a and b.get(k, missing) == neutral:
            a[k] = neutral
    return {k: (a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if not _may_change(k) and a.get(k, missing) != b.get(k, missing)}


def _data_prep_defaults() -> dict[str, Any]:
    """Data prep's defaults (configs/config.yaml) of the keys an offline run records from its cache
    (:data:`core.config.FEATURE_CONFIG_KEYS`), which runs recorded before they recorded the cache's."""
    from omegaconf import OmegaConf

    from core.config import compose
    from core.config import FEATURE_CONFIG_KEYS

    cfg = compose([])
    return {k: OmegaConf.to_container(v) if OmegaConf.is_config(v := OmegaConf.select(cfg, k)) else v
            for k in FEATURE_CONFIG_KEYS}


class RunConfigRecord(Callback):
    """Carries the launch's resolved config in every checkpoint (``checkpoint["run_config"]``), so a
    checkpoint resumed away from its run folder (``resume=<copied file>``) is checked against what it was
    trained with (:func:`check_resume_config`), not against nothing."""

    def __init__(self, cfg: Any) -> None:
        from core.config import to_container

        self.config = to_container(cfg)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        checkpoint["run_config"] = self.config


def check_resume_config(cfg: Any, run_dir: str | Path, ckpt_path: str | Path | None = None) -> None:
    """Refuse to resume ``run_dir`` with a config that changes what the run trains.

    Compares the resolved ``cfg`` with the run's recorded ``config.yaml`` (written by its first
    launch), or where the run directory has none (a checkpoint resumed away from its run folder),
    with the config the checkpoint ``ckpt_path`` carries (:class:`RunConfigRecord`), and raises before
    anything is written.

    Raises:
        UserInputError: names every changed key with its recorded and new value; or neither record
            exists (a checkpoint from before checkpoints carried their config, away from its run folder).
    """
    from omegaconf import OmegaConf

    from core.config import UserInputError, to_container

    path = Path(run_dir) / "config.yaml"
    if path.is_file():
        recorded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    else:
        from train.checkpoint_io import checkpoint_entry

        try:
            recorded = checkpoint_entry(ckpt_path, "run_config") if ckpt_path else None
        except (OSError, ValueError):
            recorded = None  # unreadable: the full load names the damage
        if not isinstance(recorded, dict):
            if ckpt_path is None:
                return
            raise UserInputError(f"resume={ckpt_path} refused: neither {path} nor the checkpoint records the config it "
                                 "was trained with, so this launch's settings cannot be checked against it; resume it "
                                 "from its run folder (resume=<run dir>), or start a new run from its weights")
        path = Path(ckpt_path)
    current = to_container(cfg)
    if recorded.get("train", {}).get("precision") == "auto":
        # recorded before auto was resolved: train.run.resolve_run_precision gives it its old meaning
        recorded["train"]["precision"] = current.get("train", {}).get("precision")
    if str(current.get("train", {}).get("features", "offline")) == "offline":
        # offline, the cache's labels and features train (train.run.resolve_run_precision); runs recorded
        # before that carry data prep's defaults here (and the cache itself is checked by
        # check_resume_data).  Any other recorded value is what the run trained on and must not change
        for key, default in _data_prep_defaults().items():
            section, _, name = key.rpartition(".")
            old_part = recorded.get(section, {}) if section else recorded
            new_part = current.get(section, {}) if section else current
            if name in new_part and old_part.get(name) == default:
                old_part[name] = new_part[name]
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


# ---------------------------------------------------------------------------------------------
# What a resume restores must be what this launch derives (issue 28).
# ---------------------------------------------------------------------------------------------
def data_identity(datamodule) -> dict[str, dict[str, Any]]:
    """What a run's batches are built from, per split: ``{split: {"sha256", "records", "source"}}``.

    A data-prep cache split (a reader with ``directory``) is identified by the SHA-256 of its
    ``manifest.json``, which lists every shard's SHA-256 and record count, so any rebuilt shard with
    other bytes changes it; a deterministic re-run of data prep (same settings, same data) gives the
    same bytes.  In-memory token records (``train.features=online|hybrid``,
    :class:`train.online.ConversationRecords`) are identified by the SHA-256 of their ids, tokens and
    loss masks.  A split that is neither is left out (not checked).
    """
    import hashlib

    import torch

    from core.io import manifest_identity

    out: dict[str, dict[str, Any]] = {}
    for split in ("train", "val"):
        reader = getattr(datamodule, f"{split}_reader", None)
        if reader is None:
            continue
        directory = getattr(reader, "directory", None)
        ident = manifest_identity(directory) if directory is not None else None
        if ident is not None:
            out[split] = {"sha256": ident["sha256"], "records": len(reader), "source": str(directory)}
        elif isinstance(getattr(reader, "records", None), list):
            h = hashlib.sha256()
            for r in reader.records:
                h.update(str(r["id"]).encode() + b"\0")
                h.update(r["input_ids"].to(torch.int64).numpy().tobytes())
                h.update(r["loss_mask"].numpy().tobytes())
            out[split] = {"sha256": h.hexdigest(), "records": len(reader), "source": "tokenized data"}
    return out


def _draft_vocab_difference(saved, current) -> str | None:
    """One line describing how two ``d2t`` tensors (or None: full vocabulary) differ, or None if equal."""
    if saved is None and current is None:
        return None
    if saved is None or current is None:
        what = lambda d: "the full vocabulary" if d is None else f"N={d.numel()} tokens"  # noqa: E731
        return f"draft vocabulary: checkpoint {what(saved)}, this launch {what(current)}"
    a, b = set(saved.tolist()), set(current.tolist())
    if a == b and saved.numel() == current.numel():
        return None
    only_saved, only_current = sorted(a - b), sorted(b - a)
    return (f"draft vocabulary d2t (N={saved.numel()} -> {current.numel()}): {len(only_saved)} token ids only in the "
            f"checkpoint (first {only_saved[:5]}), {len(only_current)} only in the selection from this cache's label "
            f"counts (first {only_current[:5]})")


def check_resume_data(checkpoint: dict[str, Any], ckpt_path: str | Path, head,
                      identity: dict[str, dict[str, Any]]) -> None:
    """Refuse a resume whose checkpoint was trained on other data than this launch would use.

    A checkpoint restores the draft vocabulary ``d2t`` / ``t2d``, the data position (batch indices
    into the cache's records), the optimizer moments and the LR schedule position; this launch
    derives the draft-index table, the soft teacher's rows ``W[d2t]``, the batches and the label
    counts from the cache it opens.  If the cache was rebuilt with other content in the meantime
    those two halves disagree, and the checkpoint cannot win everywhere: the batches themselves come
    from the new cache.  So the resume is refused, with the difference, before anything is written.

    Compared: every split's :func:`data_identity` recorded in the checkpoint (``data_identity``,
    written by :class:`train.module.DraftHeadModule`; checkpoints made before it carry none) and the
    checkpoint's ``head.d2t`` against the draft vocabulary ``head`` selected now.

    Args:
        checkpoint: the loaded checkpoint (``SafetensorsCheckpointIO().load_checkpoint(ckpt_path)``).
        ckpt_path: where it was loaded from, for the message.
        head: this launch's draft head (its ``d2t`` when it has a draft vocabulary).
        identity: this launch's :func:`data_identity`.

    Raises:
        UserInputError: names each differing split (manifest SHA-256, record counts, source) and the
            draft-vocabulary difference (token ids on either side only).
    """
    from core.config import UserInputError

    problems = []
    saved = checkpoint.get("data_identity") or {}
    for split in sorted(set(saved) & set(identity)):
        old, new = saved[split], identity[split]
        if old.get("sha256") != new.get("sha256"):
            problems.append(f"{split} data changed ({old.get('source')}: {old.get('records')} -> {new.get('records')} "
                            f"conversations, manifest sha256 {str(old.get('sha256'))[:12]} -> {str(new.get('sha256'))[:12]})")
    state = checkpoint.get("state_dict", {})
    current = head.d2t.detach().cpu() if getattr(head, "draft_vocab_size", None) is not None else None
    diff = _draft_vocab_difference(state.get("head.d2t"), current)
    if diff is not None:
        problems.append(diff)
    if problems:
        raise UserInputError(f"resume from {ckpt_path} refused: the checkpoint was trained on other data than this "
                             f"launch would use ({'; '.join(problems)}); its draft vocabulary, data position and "
                             "optimizer state belong to that data. Resume with the cache the run was trained on, or "
                             "start a new run (another train.run_name)")


def saved_world_size(checkpoint: dict[str, Any]) -> int:
    """The number of ranks that wrote a checkpoint of :class:`train.module.DraftHeadModule`: its
    ``world_size``, or for a checkpoint written before that key, the length of ``rng_states_per_rank``
    (gathered only on more than one rank), else 1."""
    if "world_size" in checkpoint:
        return int(checkpoint["world_size"])
    per_rank = checkpoint.get("rng_states_per_rank")
    return len(per_rank) if per_rank else 1


def check_resume_world_size(checkpoint: dict[str, Any], ckpt_path: str | Path, world_size: int) -> None:
    """Refuse a resume on another number of ranks than the checkpoint was written on.

    ``train.devices`` and ``train.num_nodes`` may change between launches (8 devices on one node
    resume as 4 on two), but their product may not.  A run's data position is a per-rank count of
    finished batches into a stride of the epoch's global batch order (rank r trains positions r, r + W,
    ...; :class:`train.data.ShardedBatchSampler`): replayed on W' ranks it repeats batches (W > W') or
    skips them (W < W').  The global batch (W x batch size x accumulation), hence the steps of an
    epoch, the LR schedule's length and the tokens-seen validation schedule, and each rank's RNG state
    belong to W as well; ZeRO's optimizer partitions too (:mod:`train.zero_checkpoint`).

    Args:
        checkpoint: the loaded Lightning checkpoint the launch would resume from.
        ckpt_path: where it was loaded from, for the message.
        world_size: this launch's ranks (``train.devices`` x ``train.num_nodes``, resolved).

    Raises:
        UserInputError: the two differ; names both, before anything is written.
    """
    from core.config import UserInputError

    saved = saved_world_size(checkpoint)
    if saved != int(world_size):
        raise UserInputError(
            f"resume from {ckpt_path} refused: it was written by {saved} rank(s) and this launch has {world_size} "
            f"(train.devices x train.num_nodes). Its data position counts batches per rank, and its global batch, "
            f"LR schedule and RNG states belong to {saved} ranks: on {world_size} some batches would be trained "
            f"twice or never. Resume with {saved} rank(s) in all, or start a new run (another train.run_name)")


def saved_zero_stage(checkpoint: dict[str, Any]) -> int:
    """The ZeRO stage a checkpoint was written under (its ``zero`` entry, :mod:`train.zero_checkpoint`), 0 for none."""
    zero = checkpoint.get("zero")
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else 0


def check_resume_strategy(checkpoint: dict[str, Any], ckpt_path: str | Path, stage: int) -> None:
    """Refuse a resume under another ZeRO stage than the checkpoint was written under.

    ``strategy.*`` may change on resume (``auto`` <-> ``ddp``: both keep the whole optimizer state in the
    checkpoint), but ZeRO's optimizer partitions are stage- and rank-local (:mod:`train.zero_checkpoint`),
    and a plain checkpoint holds no partitions for ZeRO to load: Lightning's and DeepSpeed's own errors
    there were tracebacks that blamed ``save_weights_only``.

    Raises:
        UserInputError: the stages differ (0 = no ZeRO); names both and the ``strategy=`` that resumes it,
            before anything is written.
    """
    from core.config import UserInputError

    saved = saved_zero_stage(checkpoint)
    if saved != int(stage):
        def name(n: int) -> str:
            return f"ZeRO-{n}" if n else "no ZeRO (auto/ddp)"

        way = f"strategy=deepspeed_zero{saved}" if saved else "strategy=auto (or strategy=ddp)"
        raise UserInputError(f"resume from {ckpt_path} refused: it was written under {name(saved)} and this launch "
                             f"runs {name(int(stage))}; a ZeRO stage keeps its own optimizer partitions, so resume "
                             f"with {way}")
