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
