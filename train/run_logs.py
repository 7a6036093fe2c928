"""A run's metric records across launches: one continuous CSV, one W&B run, W&B mode from credentials.

A run directory holds one record however often it is resumed (issue 19 item 6):

* ``<run_dir>/csv/metrics.csv`` (:class:`ContinuingCSVLogger`): a resumed launch first drops the
  rows a killed launch logged after the checkpoint it resumes from (``step`` > the checkpoint's
  ``global_step``), then appends.  ``step`` is the number of finished optimizer steps when the row
  was logged, the same number as in the checkpoint names ``step<NNNNNNN>.ckpt`` (the training row
  of optimizer step k, and a validation after it, carry ``step = k``).
* W&B: one run id per run directory, kept in ``<run_dir>/wandb_run_id`` and resumed
  (``resume="allow"``) by every later launch, Slurm requeues included.

W&B mode (issue 19 item 5, issue 31 item 1): :func:`train.wandb_mode.decide_wandb_mode` - a
``WANDB_MODE`` the user set is obeyed; otherwise the run is online when wandb itself finds
credentials (``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE``, the netrc entry ``wandb login``
writes for ``WANDB_BASE_URL``, or wandb's settings file) and offline when it finds none; the mode
goes to ``wandb.init`` explicitly (no login prompt) and is printed in one line.
"""
from __future__ import annotations

import csv
import io
import os
import secrets
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from core.io import atomic_write_bytes

RUN_ID_FILE = "wandb_run_id"


def truncate_metrics(path: str | os.PathLike, keep_step: int) -> int:
    """Rewrite the CSV ``path`` (atomically) without the rows whose ``step`` exceeds ``keep_step``.

    Returns the number of rows dropped (0 when the file does not exist).
    """
    path = Path(path)
    if not path.is_file():
        return 0
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        fields = list(reader.fieldnames or [])
        rows = list(reader)
    keep = [r for r in rows if not r.get("step") or int(float(r["step"])) <= int(keep_step)]
    if len(keep) != len(rows):
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(keep)
        atomic_write_bytes(path, out.getvalue().encode())
    return len(rows) - len(keep)


class _ContinuingWriter(ExperimentWriter):
    """Lightning's CSV writer, minus the deletion of an existing ``metrics.csv``: the file is cut
    back to ``keep_step`` (None = a fresh run: removed) and its header columns are kept."""

    def __init__(self, log_dir: str, keep_step: int | None) -> None:
        self._keep_step = keep_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if not path.is_file():
            return
        if self._keep_step is None:
            path.unlink()
            return
        truncate_metrics(path, self._keep_step)
        with open(path, newline="") as f:
            self.metrics_keys = sorted(csv.DictReader(f).fieldnames or [])


class ContinuingCSVLogger(CSVLogger):
    """``CSVLogger`` writing ``<save_dir>/csv/metrics.csv`` (and ``hparams.yaml``) for the whole run.

    Args:
        save_dir: the run directory.
        resume_step: the ``global_step`` of the checkpoint this launch resumes from (rows logged
            after it by an interrupted launch are dropped), or None for a fresh run.
    """

    def __init__(self, save_dir: str | os.PathLike, resume_step: int | None = None) -> None:
        super().__init__(save_dir=str(save_dir), name="", version="csv")
        self._resume_step = resume_step

    @property
    def experiment(self):
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuingWriter(log_dir=self.log_dir, keep_step=self._resume_step)
        return self._experiment


def wandb_run_id(run_dir: str | os.PathLike) -> str:
    """The run directory's W&B run id: the one recorded in ``<run_dir>/wandb_run_id``, else a W&B
    sweep agent's ``$WANDB_RUN_ID`` (with ``$WANDB_SWEEP_ID`` set, as ``wandb agent`` sets both), else a
    new random id (recorded by :func:`record_wandb_run_id` once the run directory exists).

    A ``$WANDB_RUN_ID`` outside a sweep (left exported in a shell, a job script) is not taken: every run
    started under it would log into one W&B run (``resume="allow"`` merges them); one line says so.
    """
    path = Path(run_dir) / RUN_ID_FILE
    if path.is_file():
        value = path.read_text().strip()
        if value:
            return value
    stray = os.environ.get("WANDB_RUN_ID")
    if stray and os.environ.get("WANDB_SWEEP_ID"):
        return stray
    if stray:
        from core.precision import note

        note(f"WANDB_RUN_ID={stray} is set outside a W&B sweep (no WANDB_SWEEP_ID): not taken, so runs do not "
             f"merge into one W&B run; this run's id is in {path} (a resume continues it)")
    return secrets.token_hex(4)


def record_wandb_run_id(run_dir: str | os.PathLike, loggers: list) -> None:
    """Write the W&B logger's run id to ``<run_dir>/wandb_run_id`` (global rank 0, first launch only),
    so every later launch of the run - resume, Slurm requeue - continues the same W&B run."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from lightning.pytorch.loggers import WandbLogger

    path = Path(run_dir) / RUN_ID_FILE
    if rank_zero_only.rank != 0 or path.is_file():
        return
    for lg in loggers:
        run_id = getattr(lg, "_wandb_init", {}).get("id") if isinstance(lg, WandbLogger) else None
        if run_id:
            atomic_write_bytes(path, (str(run_id) + "\n").encode())
            return


def build_wandb_logger(cfg: Any, run_dir: Path):
    """``WandbLogger`` for the run directory's one W&B run (resumed when it exists), in the mode
    :func:`train.wandb_mode.decide_wandb_mode` picks (printed once, by global rank 0).

    The mode is passed to ``wandb.init(mode=...)``: wandb's session may already exist (its settings
    then ignore a later ``WANDB_MODE``), and without it wandb would ask for a login.
    """
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from lightning.pytorch.loggers import WandbLogger

    from train.wandb_mode import decide_wandb_mode

    decision = decide_wandb_mode()
    if decision.offline:
        os.environ.setdefault("WANDB_MODE", decision.mode)  # ranks > 0 and tools started from this process
    if rank_zero_only.rank == 0:
        import sys

        print(decision.line(run_dir), file=sys.stderr)
    logger = WandbLogger(project=str(cfg.train.wandb_project), name=run_dir.name, save_dir=str(run_dir),
                         offline=decision.offline, group=str(cfg.heads.type), id=wandb_run_id(run_dir), resume="allow",
                         mode=decision.mode)
    # lightning 2.6.6 always passes anonymous=None, which wandb >= 0.2x answers with a deprecation warning
    getattr(logger, "_wandb_init", {}).pop("anonymous", None)
    return logger


# ---------------------------------------------------------------------------------------------
# Progress bar.
# ---------------------------------------------------------------------------------------------
from lightning.pytorch.callbacks import TQDMProgressBar  # noqa: E402


def progress_description(step: int, total_steps: int, epoch: int, max_epochs: int) -> str:
    """``"step k/N"``, plus ``" · epoch e/E"`` (1-based) when the budget is in epochs (``max_epochs`` > 0)."""
    text = f"step {int(step)}/{int(total_steps)}"
    if int(max_epochs) > 0:
        text += f" · epoch {int(epoch) + 1}/{int(max_epochs)}"
    return text


class StepProgressBar(TQDMProgressBar):
    """One training bar for the whole run over optimizer steps (``step k/N``, N = ``train.max_steps``
    or the epoch budget's step count), starting at a resumed run's step; Lightning's default bar
    counts micro-batches per epoch and reads ``Epoch 0/-2`` under a step budget."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.train_progress_bar = self.init_train_tqdm()
        self._total = int(pl_module.total_steps())
        self.train_progress_bar.reset(total=self._total)
        self.train_progress_bar.update(int(trainer.global_step))
        self._describe(trainer)

    def _describe(self, trainer) -> None:
        self.train_progress_bar.set_description(progress_description(
            trainer.global_step, self._total, trainer.current_epoch, int(trainer.max_epochs or -1)))

    def on_train_epoch_start(self, trainer, *_: Any) -> None:
        self._describe(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        bar = self.train_progress_bar
        if bar is not None and int(trainer.global_step) != bar.n:
            bar.update(int(trainer.global_step) - bar.n)
            self._describe(trainer)
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
