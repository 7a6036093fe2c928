"""When validation runs, and the run's record of every validation: tokens seen, step, loss, τ.

``train.val_schedule``:

* ``steps`` (default) - every ``train.val_every_n_steps`` optimizer steps (Lightning's own
  ``val_check_interval``).
* ``log`` - dense in tokens seen: the first validation once ``train.val_first_tokens`` tokens were
  seen, the next each time tokens seen grew by ``train.val_factor`` (thresholds
  ``first · factor^k``), never more than ``train.val_every_n_steps`` optimizer steps apart (so late
  in a long run validation still comes every N steps), and always at the last optimizer step (so
  ``best/`` can be the final weights).  Public learning curves (EAGLE-3) show τ arriving early and
  then falling while the loss still falls; a log schedule sees both.

Tokens seen = the non-padding tokens of every training micro-batch on every rank (the quantity
:func:`train.data.tokens_seen` replays), counted at optimizer-step boundaries.  Validation is
decided at the end of the batch that completes an optimizer step; for ``log`` the decision is given
to Lightning through ``trainer.val_check_batch`` (set to this batch's index + 1 when due, else to a
value never reached), so the validation, its checkpoints (``train.resume.RunCheckpoint``) and the
pre-emption path (``train.resume.Preemption``) are Lightning's as for ``steps``.

:class:`ValidationSchedule` keeps the counter, the next threshold, the last validated step and the
list of validations in every checkpoint (Lightning callback state), so a resumed run continues the
same schedule and its record holds exactly the validations up to the resumed step.  At each
validation global rank 0 writes

* ``<run_dir>/record.json`` - the monitor (``val/sim_tau`` max for heads with a simulated τ,
  ``val/loss`` min for the others), the schedule, each validation's ``step``, ``epoch``,
  ``tokens_seen``, ``train_seconds`` and metrics (``loss``, ``sim_tau``, ...), the best validation by
  the monitor and the checkpoints kept (``train.save_top_k``; -1 keeps every validation's).
  ``train_seconds`` is global rank 0's wall-clock time inside training batches (forward, backward,
  optimizer step; not validation, checkpointing or data loading between batches) summed over every
  resumed segment: the x axis of an equal-wall-clock comparison.  It is None for a run resumed from
  a checkpoint written before it was recorded (its earlier time is unknown).  ``threads`` (torch's
  intra-op threads of each training segment, distinct) and ``world_size`` (each segment's number of
  ranks, distinct) say what share of the machine that clock ran on (:mod:`train.budget` puts runs on
  one clock only when they agree); each is None when the run resumed from a checkpoint written before
  it was kept (the share of its earlier steps is unknown);
* ``<run_dir>/val_curve.png`` - validation τ (or the monitor) and loss against tokens seen
  (matplotlib, Agg canvas).
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

KINDS = ("steps", "log")
RECORD = "record.json"
PLOT = "val_curve.png"
FORMAT = "draftheads-run-record-v1"
#: ``trainer.val_check_batch`` when no validation is due: ``(batch + 1) % NEVER`` is never 0
NEVER = sys.maxsize


def next_threshold(threshold: int, tokens_seen: int, factor: float) -> int:
    """The first log-spaced threshold ``threshold · factor^k`` (k >= 0, each step rounded up) above ``tokens_seen``.

    Raises:
        ValueError: ``factor`` <= 1 or ``threshold`` < 1.
    """
    if not factor > 1 or threshold < 1:
        raise ValueError(f"log schedule needs factor > 1 and threshold >= 1, got {factor}, {threshold}")
    while threshold <= tokens_seen:
        threshold = max(threshold + 1, math.ceil(threshold * factor))
    return int(threshold)


def log_due(tokens_seen: int, threshold: int, step: int, last_val_step: int, every_n_steps: int,
            total_steps: int) -> bool:
    """Whether the ``log`` schedule validates after optimizer step ``step``: tokens seen reached the
    next threshold, or ``every_n_steps`` steps passed since the last validation, or ``step`` is the last."""
    return tokens_seen >= threshold or step - last_val_step >= every_n_steps or step >= total_steps


def best_validation(validations: list[dict[str, Any]], monitor: str, mode: str) -> dict[str, Any] | None:
    """The validation with the best ``monitor`` value (``val/<name>``; ``max`` or ``min``), the earliest
    on ties, ignoring non-finite values; None when none has the metric."""
    name = monitor[4:] if monitor.startswith("val/") else monitor
    scored = [v for v in validations if isinstance(v.get("metrics", {}).get(name), (int, float))
              and math.isfinite(v["metrics"][name])]
    if not scored:
        return None
    sign = 1.0 if mode == "max" else -1.0
    return max(scored, key=lambda v: (sign * v["metrics"][name], -v["step"]))


def unvalidated_tail(total_steps: int, every_n_steps: int) -> str | None:
    """The warning owed by ``train.val_schedule=steps`` when the run's optimizer-step budget (a step budget,
    or an epoch budget's steps) is not a multiple of ``train.val_every_n_steps``, else None: its last steps
    are never validated, and a budget below the interval is never validated at all."""
    if total_steps <= 0 or total_steps % every_n_steps == 0:
        return None
    if total_steps < every_n_steps:
        return (f"the run has {total_steps} optimizer steps, fewer than train.val_every_n_steps={every_n_steps}: "
                "it is never validated, so best/ will be the final weights (checkpoint last-no-validation); lower "
                "train.val_every_n_steps or use train.val_schedule=log (which validates at the last step)")
    return (f"the run has {total_steps} optimizer steps, not a multiple of train.val_every_n_steps={every_n_steps}: "
            f"the last {total_steps % every_n_steps} steps are never validated, so best/ cannot be the final weights "
            "(last/ always is)")


def _int_list(value: Any) -> list[int] | None:
    """A checkpoint's ``threads`` / ``world_size``: None (unknown), an int (one segment) or a list."""
    if value is None:
        return None
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def _copy(values: list[int] | None) -> list[int] | None:
    return None if values is None else list(values)


class ValidationSchedule(Callback):
    """Counts tokens seen, decides the ``log`` schedule's validations, records every validation.

    Args:
        kind: ``steps`` | ``log`` (module docstring).
        every_n_steps: ``train.val_every_n_steps`` (``log``: the largest gap between validations).
        first_tokens, factor: ``train.val_first_tokens``, ``train.val_factor`` (``log`` only).
        run_dir: where ``record.json`` and ``val_curve.png`` go (None: nothing written).
        monitor, mode: the checkpoint monitor (``train.module.head_monitor``).
        checkpoint_dir: the run's checkpoint directory (the kept checkpoints are listed in the record).
    """

    def __init__(self, kind: str, every_n_steps: int, first_tokens: int = 32768, factor: float = 2.0,
                 run_dir: str | os.PathLike | None = None, monitor: str = "val/sim_tau", mode: str = "max",
                 checkpoint_dir: str | os.PathLike | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"train.val_schedule={kind!r}; choices: {', '.join(KINDS)}")
        self.kind = kind
        self.every_n_steps = int(every_n_steps)
        self.first_tokens = int(first_tokens)
        self.factor = float(factor)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.monitor, self.mode = monitor, mode
        self.tokens_seen = 0
        self.threshold = self.first_tokens
        self.last_val_step = 0
        self.validations: list[dict[str, Any]] = []
        self._pending = 0  # this rank's tokens since the last optimizer step
        self._total = 0  # optimizer-step budget of the fit (set at train start)
        self.train_seconds: float | None = 0.0  # wall-clock inside training batches, all segments
        self._batch_started: float | None = None
        # torch intra-op threads and world sizes of the training segments (distinct, in order); None when
        # a resumed checkpoint predates them, so the share of the machine of its earlier steps is unknown
        self.threads: list[int] | None = []
        self.world_sizes: list[int] | None = []

    # -- resume state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"tokens_seen": int(self.tokens_seen), "threshold": int(self.threshold),
                "last_val_step": int(self.last_val_step), "validations": [dict(v) for v in self.validations],
                "train_seconds": self.train_seconds, "threads": _copy(self.threads),
                "world_size": _copy(self.world_sizes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tokens_seen = int(state.get("tokens_seen", 0))
        # a checkpoint from before train_seconds was recorded: the time of its steps is unknown
        seconds = state.get("train_seconds", None if self.tokens_seen else 0.0)
        self.train_seconds = None if seconds is None else float(seconds)
        self.threshold = int(state.get("threshold", self.first_tokens))
        self.last_val_step = int(state.get("last_val_step", 0))
        self.validations = [dict(v) for v in state.get("validations", [])]
        unknown = None if self.tokens_seen else []  # a checkpoint from before they were kept: unknown
        self.threads = _int_list(state.get("threads", unknown))
        self.world_sizes = _int_list(state.get("world_size", unknown))  # an int in checkpoints of one segment

    # -- counting and deciding ---------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        import torch

        self._pending = 0
        for seen, now in ((self.threads, int(torch.get_num_threads())), (self.world_sizes, int(trainer.world_size))):
            if seen is not None and now not in seen:
                seen.append(now)
        # the optimizer-step budget (an epoch budget's estimate), fixed for the fit
        self._total = int(pl_module.total_steps()) if hasattr(pl_module, "total_steps") else int(trainer.max_steps)
        if self.kind == "log":
            trainer.val_check_batch = NEVER
        elif (line := unvalidated_tail(self._total, self.every_n_steps)) and trainer.global_step < self._total:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(line)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._batch_started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._batch_started is not None and self.train_seconds is not None:
            self.train_seconds += time.perf_counter() - self._batch_started
        self._batch_started = None
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        if mask is not None:
            self._pending += int(mask.sum())
        loop = trainer.fit_loop.epoch_loop
        if loop._should_accumulate():  # mid-window: no optimizer step, no validation
            if self.kind == "log":
                trainer.val_check_batch = NEVER
            return
        seen = self._pending
        if trainer.world_size > 1:
            import torch

            flag = torch.tensor([seen], dtype=torch.long, device=trainer.strategy.root_device)
            seen = int(trainer.strategy.reduce(flag, reduce_op="sum").item())
        self.tokens_seen += int(seen)
        self._pending = 0
        if self.kind == "log":
            due = log_due(self.tokens_seen, self.threshold, int(trainer.global_step), self.last_val_step,
                          self.every_n_steps, self._total)
            trainer.val_check_batch = loop.total_batch_idx + 1 if due else NEVER

    # -- recording ---------------------------------------------------------------------------
    def _seconds(self) -> float | None:
        """``train_seconds`` as recorded: rounded to the millisecond, None when unknown."""
        return None if self.train_seconds is None else round(self.train_seconds, 3)

    def on_validation_end(self, trainer, pl_module) -> None:
        """Record this validation (before ``RunCheckpoint`` saves: Lightning runs checkpoint callbacks last,
        so the checkpoint of this step holds it) and advance the schedule past it."""
        if trainer.sanity_checking:
            return
        step = int(trainer.global_step)
        values = dict(getattr(pl_module, "validation_results", {}) or {})
        entry = {"step": step, "epoch": int(trainer.current_epoch), "tokens_seen": int(self.tokens_seen),
                 "train_seconds": self._seconds(),
                 "metrics": {k: (float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None)
                             for k, v in sorted(values.items())}}
        self.validations = [v for v in self.validations if v["step"] != step] + [entry]
        self.last_val_step = step
        if self.kind == "log":
            self.threshold = next_threshold(self.threshold, self.tokens_seen, self.factor)
        self.write(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self.write(trainer)  # the checkpoints kept after the last save

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.write(trainer)

    def record(self) -> dict[str, Any]:
        """The run record (module docstring) as a JSON-ready dict."""
        kept = sorted(p.name for p in self.checkpoint_dir.glob("step*.ckpt")) if self.checkpoint_dir and \
            self.checkpoint_dir.is_dir() else []
        best = best_validation(self.validations, self.monitor, self.mode)
        return {"format": FORMAT, "monitor": self.monitor, "mode": self.mode,
                "val_schedule": {"kind": self.kind, "every_n_steps": self.every_n_steps,
                                 **({"first_tokens": self.first_tokens, "factor": self.factor} if self.kind == "log" else {})},
                "tokens_seen": int(self.tokens_seen),
                "train_seconds": self._seconds(),
                "threads": _copy(self.threads) or None, "world_size": _copy(self.world_sizes) or None,
                "validations": list(self.validations),
                "best": best, "checkpoints": kept}

    def write(self, trainer) -> None:
        """Write ``record.json`` and ``val_curve.png`` (global rank 0; atomic)."""
        if self.run_dir is None or not trainer.is_global_zero or not self.run_dir.is_dir():
            return
        from core.io import atomic_write_json

        record = self.record()
        atomic_write_json(self.run_dir / RECORD, record)
        if record["validations"]:
            plot_curve(record, self.run_dir / PLOT, title=self.run_dir.name)


def _tokens_axes():
    """A 6.4 x 4 in figure (Agg canvas) and its axes, x = tokens seen on a log scale."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("tokens seen")
    return fig, ax


def _write_png(fig, path: str | os.PathLike) -> None:
    """Lay ``fig`` out and write it to ``path`` as a PNG, atomically."""
    import io

    from core.io import atomic_write_bytes

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())


def plot_curve(record: dict[str, Any], path: str | os.PathLike, title: str = "") -> Path:
    """Validation τ (or the record's monitor) and loss against tokens seen (log x axis), the best
    validation starred; written atomically as a PNG."""
    vals = record["validations"]
    monitor = str(record.get("monitor", "val/sim_tau"))
    name = monitor[4:] if monitor.startswith("val/") else monitor
    shown = "sim_tau" if any(v["metrics"].get("sim_tau") is not None for v in vals) else name
    x = [max(1, int(v["tokens_seen"])) for v in vals]
    fig, ax = _tokens_axes()
    ys = [v["metrics"].get(shown) for v in vals]
    label = "validation τ (simulated, incl. bonus)" if shown == "sim_tau" else f"val/{shown}"
    ax.plot(x, [float("nan") if y is None else y for y in ys], "o-", color="tab:blue", label=label)
    best = record.get("best")
    if best is not None and best["metrics"].get(shown) is not None:
        ax.plot([max(1, best["tokens_seen"])], [best["metrics"][shown]], "*", color="tab:red", markersize=14,
                label=f"best/ (step {best['step']})")
    ax.set_ylabel(label, color="tab:blue")
    if shown != "loss" and any(v["metrics"].get("loss") is not None for v in vals):
        ax2 = ax.twinx()
        ax2.plot(x, [float("nan") if v["metrics"].get("loss") is None else v["metrics"]["loss"] for v in vals],
                 "s--", color="tab:gray", markersize=3, label="val/loss")
        ax2.set_ylabel("val/loss", color="tab:gray")
        ax2.ticklabel_format(axis="y", useOffset=False)
    ax.legend(loc="best", fontsize=8)
    ax.set_title(f"{title}: validation against tokens seen" if title else "validation against tokens seen", fontsize=10)
    _write_png(fig, path)
    return Path(path)


def plot_curves(records: dict[str, dict[str, Any]], path: str | os.PathLike, title: str = "") -> list[str]:
    """Several runs' validation τ against tokens seen on one log x axis, one line per run (its
    ``best/`` starred): the learning curves of heads trained on one cache side by side.

    Args:
        records: ``{run name: record.json contents}`` (:meth:`ValidationSchedule.record`); runs
            without a ``sim_tau`` validation are left out.
        path: the PNG to write (atomically).

    Returns:
        The names of the runs drawn, in ``records`` order.

    Raises:
        ValueError: no record has a ``sim_tau`` validation.
    """
    shown = {name: [v for v in r.get("validations", []) if v["metrics"].get("sim_tau") is not None]
             for name, r in records.items()}
    shown = {name: vals for name, vals in shown.items() if vals}
    if not shown:
        raise ValueError(f"no validation τ (val/sim_tau) in the records of {sorted(records)}")
    fig, ax = _tokens_axes()
    for name, vals in shown.items():
        (line,) = ax.plot([max(1, int(v["tokens_seen"])) for v in vals], [v["metrics"]["sim_tau"] for v in vals],
                          "o-", markersize=4, label=name)
        best = best_validation(vals, "val/sim_tau", "max")
        ax.plot([max(1, best["tokens_seen"])], [best["metrics"]["sim_tau"]], "*", color=line.get_color(),
                markersize=12)
    ax.set_ylabel("validation τ (simulated, incl. bonus)")
    ax.legend(loc="best", fontsize=8, title="★ = best/", title_fontsize=8)
    ax.set_title(title or "validation τ against tokens seen", fontsize=10)
    _write_png(fig, path)
    return list(shown)
