"""One training run: run directory, Trainer (loggers, checkpointing, precision, strategy), export.

``python -m train heads=<name> [key=value ...]`` calls :func:`main`; tests and the distributed
launchers call :func:`train` with an already composed config (and optionally a loaded base model).

Run directory ``<output_root>/runs/<heads option>/<train.run_name or UTC timestamp>/`` (``heads=falcon_k1``
runs live under ``runs/falcon_k1/``)::

    config.yaml               resolved config
    checkpoints/*.ckpt        Lightning resume checkpoints (safetensors, train.checkpoint_io)
    launches/<n>.yaml         resolved config of each resumed launch (config.yaml stays the first's)
    csv/metrics.csv           one metrics record for all launches (train/loss, val/loss, val/sim_tau, tokens/s...);
                              ``step`` = finished optimizer steps, as in the checkpoint names
    wandb/, wandb_run_id      the run's one W&B run (online when wandb finds credentials, see train.wandb_mode)
    record.json               every validation's step, tokens seen, loss, sim_tau; the best; checkpoints kept
    val_curve.png             validation tau (or the monitor) and loss against tokens seen (train.val_schedule)
    best/, last/              exported heads: model.safetensors + config.json (heads.save); Ctrl-C exports both
"""
from __future__ import annotations

import os
import sys
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from core.io import make_tmp_dir, replace_dir
from omegaconf import DictConfig, OmegaConf

import heads
from core.config import UserInputError, override, save_config, to_container
from train.checkpoint_io import SafetensorsCheckpointIO
from train.data import CacheDataModule
from train.module import DraftHeadModule, head_monitor
from train.resume import Preempted, check_resume_config, record_launch
from train.run_dirs import claimed_run_dir, named_by_time, run_dir_for, run_files
from train.run_logs import record_wandb_run_id
from lightning.fabric.utilities.rank_zero import rank_zero_only


def metrics_csv(run_dir: str | os.PathLike) -> Path:
    """The run's CSV metrics file ``<run_dir>/csv/metrics.csv`` (one record over all its launches).

    Raises:
        FileNotFoundError: the run has no CSV metrics.
    """
    path = Path(run_dir) / "csv" / "metrics.csv"
    if not path.is_file():
        raise FileNotFoundError(f"run {run_dir} has no csv/metrics.csv")
    return path


def build_loggers(cfg: DictConfig, run_dir: Path, resume_step: int | None = None) -> list:
    """Lightning loggers for ``train.logger``: ``csv`` -> one continuous ``csv/metrics.csv`` for the
    run (:class:`train.run_logs.ContinuingCSVLogger`; ``resume_step`` = the resumed checkpoint's
    ``global_step``, rows an interrupted launch logged after it are dropped); ``wandb`` -> that plus
    the run directory's one W&B run (:func:`train.run_logs.build_wandb_logger`: online when wandb
    finds credentials, offline otherwise); ``none`` -> no logger.  (:func:`train` logs the resolved
    config as hyperparameters.)"""
    from train.run_logs import ContinuingCSVLogger, build_wandb_logger

    kind = str(cfg.train.logger)
    if kind == "none":
        return []
    loggers: list = [ContinuingCSVLogger(run_dir, resume_step=resume_step)]
    if kind == "wandb":
        loggers.append(build_wandb_logger(cfg, run_dir))
    return loggers


def build_trainer(cfg: DictConfig, run_dir: Path, callbacks: list | None = None,
                  resume_step: int | None = None) -> tuple[pl.Trainer, Any]:
    """The Trainer for ``cfg.train`` and its :class:`~lightning.pytorch.callbacks.ModelCheckpoint`.

    The checkpoint monitors the head class's ``monitor_metric`` / ``monitor_mode`` (``val/sim_tau``
    max by default, ``val/loss`` min for heads without a simulated τ) and rewrites ``last.ckpt`` at
    every validation (:class:`train.resume.RunCheckpoint`); SIGTERM / SIGUSR1 checkpoint at the
    next optimizer-step boundary and stop (:class:`train.resume.Preemption`); checkpoints go through
    :class:`~train.checkpoint_io.SafetensorsCheckpointIO` (no pickle, atomic).
    Validation runs every ``train.val_every_n_steps`` optimizer steps (``train.val_schedule=steps``)
    or log-spaced in tokens seen (``log``; :class:`train.val_schedule.ValidationSchedule`, which also
    writes ``record.json`` and ``val_curve.png``), on every rank's shard.
    """
    t = cfg.train
    from train.val_schedule import NEVER, ValidationSchedule

    val_kind = str(t.get("val_schedule", "steps"))
    monitor, mode = head_monitor(heads.registry.head_class(str(cfg.heads.type)))
    from train.resume import DataPosition, Preemption, RunCheckpoint, RunConfigRecord
    from train.strategies import DistributedInfo, trainer_kwargs

    ckpt = RunCheckpoint(dirpath=str(run_dir / "checkpoints"), monitor=monitor, mode=mode,
                         save_top_k=int(t.save_top_k), save_last=True, filename="step{step:07d}",
                         auto_insert_metric_name=False)
    # before Preemption: it asks Lightning whether a validation is due, which the log schedule decides
    schedule = ValidationSchedule(val_kind, int(t.val_every_n_steps), int(t.get("val_first_tokens", 32768)),
                                  float(t.get("val_factor", 2.0)), run_dir=run_dir, monitor=monitor, mode=mode,
                                  checkpoint_dir=run_dir / "checkpoints")
    cbs = [ckpt, DataPosition(), schedule, Preemption(ckpt), DistributedInfo(), RunConfigRecord(cfg),
           *(callbacks or [])]
    if bool(t.progress_bar):
        from train.run_logs import StepProgressBar

        cbs.append(StepProgressBar())
    loggers = build_loggers(cfg, run_dir, resume_step)
    accumulate = int(t.accumulate_grad_batches)
    trainer = pl.Trainer(
        default_root_dir=str(run_dir),
        # accelerator, devices (auto: Slurm / torchrun / GPUs), num_nodes, strategy, precision and
        # gradient clipping (ZeRO clips by value itself): train.strategies.trainer_kwargs
        **trainer_kwargs(cfg),
        max_steps=int(t.max_steps),
        max_epochs=int(t.max_epochs),
        # train.max_time: a wall-clock budget (Lightning's Timer callback; its elapsed time is saved in
        # the checkpoint, so a resumed run continues the same budget)
        max_time=timedelta(seconds=float(t.max_time)) if t.get("max_time") is not None else None,
        accumulate_grad_batches=accumulate,
        # val_schedule=log: train.val_schedule.ValidationSchedule sets trainer.val_check_batch per batch
        val_check_interval=NEVER if val_kind == "log" else int(t.val_every_n_steps) * accumulate,
        check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches if t.limit_val_batches is not None else 1.0,
        num_sanity_val_steps=int(t.sanity_val_steps),
        # a run shorter than the logging interval still logs its training loss
        log_every_n_steps=min(int(t.log_every_n_steps), int(t.max_steps)) if int(t.max_steps) > 0 else int(t.log_every_n_steps),
        logger=loggers if loggers else False,
        callbacks=cbs,
        plugins=[SafetensorsCheckpointIO()],
        enable_progress_bar=bool(t.progress_bar),
        enable_model_summary=True,
        use_distributed_sampler=False,  # train.data.ShardedBatchSampler is rank-aware itself
        deterministic=False,
    )
    return trainer, ckpt


def export_head(head, directory: Path, identity: dict[str, Any], extra: dict[str, Any]) -> Path:
    """``heads.save`` into a temporary sibling directory, then swap it in for ``directory``.

    A crash leaves either the previous export or the new one under ``directory``, never a mix.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_tmp_dir(prefix=f".{directory.name}.", parent=directory.parent)
    try:
        heads.save(head, tmp, identity, extra=extra)
        replace_dir(tmp, directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return directory


def _head_state(module: DraftHeadModule, checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    prefix = "head."
    state = checkpoint["state_dict"]
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def export_checkpoints(trainer: pl.Trainer, module: DraftHeadModule, ckpt_cb, run_dir: Path,
                       identity: dict[str, Any], head=None, extra: dict[str, Any] | None = None) -> dict[str, Path]:
    """Export ``<run_dir>/last`` (the final weights) and ``<run_dir>/best`` (the best monitored checkpoint).

    Only global rank 0 writes.  ``best`` falls back to the final weights when no validation ran; when
    validations ran but the best one's checkpoint file is gone (deleted, or a run copied without it), an
    existing ``best/`` is left as it was and none is made up from the final weights (one line says so).
    ``extra`` is added to both exports' ``config.json`` ``extra`` (:func:`train`: ``features``, the
    feature definition the head was trained on, and ``precision``, the training precision that ran).
    Returns the written directories by name.
    """
    if not trainer.is_global_zero:
        return {}
    head = module.head if head is None else head  # ZeRO: train.strategies.consolidated_head
    out: dict[str, Path] = {}
    timer = next((c for c in trainer.callbacks if type(c).__name__ == "Timer"), None)  # train.max_time
    common = {"global_step": int(trainer.global_step), "epoch": int(trainer.current_epoch),
              "monitor": module.monitor[0], "mode": module.monitor[1], "run_dir": str(run_dir),
              # training wall-clock over all resumed segments (Lightning's Timer; only with train.max_time)
              "train_seconds": float(timer.time_elapsed("train")) if timer is not None else None, **(extra or {})}
    out["last"] = export_head(head, run_dir / "last", identity, {**common, "checkpoint": "last"})
    best_path = ckpt_cb.best_model_path
    if best_path and Path(best_path).is_file():
        checkpoint = SafetensorsCheckpointIO().load_checkpoint(best_path)
        final = {k: v.detach().clone() for k, v in head.state_dict().items()}
        head.load_state_dict(_head_state(module, checkpoint), strict=True)
        score = ckpt_cb.best_model_score
        extra = {**common, "checkpoint": "best", "source": str(best_path),
                 "global_step": int(checkpoint.get("global_step", -1)), "epoch": int(checkpoint.get("epoch", -1)),
                 "score": float(score) if score is not None else None}
        out["best"] = export_head(head, run_dir / "best", identity, extra)
        head.load_state_dict(final, strict=True)
    elif best_path:  # validations ran, but the best one's checkpoint is gone: never relabel the final weights
        from core.precision import note

        kept = run_dir / "best" / "model.safetensors"
        note(f"the best validation's checkpoint {best_path} is missing, so {run_dir / 'best'} is "
             + ("left as it was (exported from it earlier)" if kept.is_file() else "not written")
             + f"; {run_dir / 'last'} holds the final weights")
        if kept.is_file():
            out["best"] = run_dir / "best"
    else:
        out["best"] = export_head(head, run_dir / "best", identity, {**common, "checkpoint": "last-no-validation"})
    return out


def train(cfg: DictConfig, base: tuple | None = None, datamodule: CacheDataModule | None = None,
          callbacks: list | None = None, ckpt_path: str | None = None) -> dict[str, Any]:
    """Train ``cfg.heads`` on the cache and export ``best/`` and ``last/``.

    Args:
        cfg: composed config (``core.config.compose``).
        base: ``(model, tokenizer, identity)`` from ``core.base_model.load_base_model``; loaded
            from ``cfg.model`` when None.
        datamodule: overrides the cache data module (tests); default reads
            ``train.cache_dir`` or ``data_prep.cache.default_cache_dir(cfg)``.
        callbacks: extra Lightning callbacks.
        ckpt_path: a Lightning checkpoint to resume from (written by this module's CheckpointIO).

    Returns:
        ``{"run_dir", "trainer", "module", "checkpoint_callback", "exports", "preempted"}``;
        ``preempted`` is the :class:`train.resume.Preempted` that stopped the run (its checkpoint
        written, nothing exported) or None.

    Raises:
        FileNotFoundError: the cache (or one of its splits) does not exist.
        UserInputError: the cache was made with another base model (its recorded identity:
            GGUF SHA-256, architecture, layer count, vocab / hidden size; all but the sizes may
            be overridden with ``train.allow_other_base=true``); a fresh run (no ``resume``) would
            overwrite an existing run directory; a resume would change a key that defines the run
            (``train.resume.check_resume_config``, raised before anything is written); a bad
            ``heads`` / ``train`` value (raised before the run directory is created); the cache
            lacks a hidden-state layer the head reads.
    """
    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    from train.resume import resolve_resume

    resume_path, resume_dir = resolve_resume(cfg, run_dir_for)  # resume=auto|<path>
    online = str(cfg.train.get("features", "offline")) != "offline"
    # what runs, before the base loads or a directory exists: model.dtype / train.precision = auto resolved
    # (core.precision; a resumed run keeps what it recorded), the offline cache's feature definition checked
    resumed = resume_dir if resume_path else (
        Path(ckpt_path).parent.parent if ckpt_path and Path(ckpt_path).parent.name == "checkpoints" else None)
    cfg, cache_def = resolve_run_precision(cfg, resumed, online, datamodule)
    if base is None:
        from core.base_model import load_base_model

        base = load_base_model(cfg.model)
    model, tokenizer, identity = base
    identity_dict = identity.to_dict() if hasattr(identity, "to_dict") else dict(identity)
    features = None
    if online:  # train.online: the frozen base runs inside training (token batches, no feature cache)
        from train.online import online_datamodule

        online_dm, features = online_datamodule(cfg, model, tokenizer, identity_dict)
        datamodule = datamodule or online_dm
    elif datamodule is None:
        datamodule = _cache_datamodule(cfg, tokenizer, identity_dict)
    if not online and cache_def is None and getattr(getattr(datamodule, "train_reader", None), "manifest", None):
        from data_prep.features import FeatureDefinition

        reader = datamodule.train_reader
        cache_def = FeatureDefinition.from_manifest(reader.manifest, Path(reader.directory).parent)
    ckpt_path = ckpt_path or (str(resume_path) if resume_path else None)
    by_time = resume_dir is None and named_by_time(cfg)  # before run_dir_for passes the name on in the environment
    run_dir = resume_dir or run_dir_for(cfg)
    with claimed_run_dir(run_dir, by_time=by_time and ckpt_path is None, rank=rank_zero_only.rank) as run_dir:
        return _train_in(cfg, run_dir, ckpt_path, model, tokenizer, identity, identity_dict, online, datamodule,
                         features, cache_def, callbacks)


def _train_in(cfg: DictConfig, run_dir: Path, ckpt_path: str | None, model, tokenizer, identity, identity_dict,
              online: bool, datamodule, features, cache_def, callbacks) -> dict[str, Any]:
    """The rest of :func:`train`, inside the claimed run directory."""
    from train.strategies import consolidated_head

    if ckpt_path is None:
        refuse_existing_run(run_dir, resume_asked=str(cfg.get("resume")) == "auto")
    else:
        check_resume_config(cfg, run_dir, ckpt_path)
    try:  # a bad heads/train value is the user's to fix: one line, and no run directory left behind
        head_cfg = cfg.heads
        if online and str(head_cfg.get("draft_vocab_size")) == "auto":
            # no label counts exist before the base has run: auto means the full vocabulary here
            print("draftheads: train.features=%s has no label counts yet, so heads.draft_vocab_size=auto uses the full "
                  "vocabulary (set an integer N and train from a cache to draft over a subset)" % cfg.train.features,
                  file=sys.stderr)
            head_cfg = OmegaConf.merge(head_cfg, {"draft_vocab_size": None})
        head = heads.build(head_cfg, model, **draft_vocab_source(head_cfg, datamodule, int(model.config.vocab_size)))
        module = DraftHeadModule(head_cfg, cfg.train, head=head, features=features)
    except ValueError as exc:
        raise UserInputError(str(exc)) from exc
    if online:
        from train.online import check_online_config

        check_online_config(cfg, model, module.head)
    else:
        check_cache_layers(module.head, datamodule)
    from train.resume import check_resume_data, check_resume_world_size, data_identity

    module.data_identity = data_identity(datamodule)
    # read once for the checks below; Lightning loads it again to restore the run
    resume_from = SafetensorsCheckpointIO().load_checkpoint(ckpt_path) if ckpt_path else None
    if resume_from is not None:  # a checkpoint of other data (a rebuilt cache) is refused before anything is written
        check_resume_data(resume_from, ckpt_path, module.head, module.data_identity)
    resume_step = int(resume_from.get("global_step", 0)) if resume_from is not None else None
    # its loggers and callbacks write lazily
    trainer, ckpt_cb = build_trainer(cfg, run_dir, callbacks, resume_step=resume_step)
    if resume_from is not None:  # so is one written on another number of ranks, or under another ZeRO stage
        from train.resume import check_resume_strategy
        from train.strategies import zero_stage

        check_resume_strategy(resume_from, ckpt_path, zero_stage(cfg))
        check_resume_world_size(resume_from, ckpt_path, trainer.world_size)
    del resume_from
    run_dir.mkdir(parents=True, exist_ok=True)  # validated first, so a refused run leaves no directory
    if resume_step is None or not (run_dir / "config.yaml").is_file():
        save_config(cfg, run_dir)
    elif rank_zero_only.rank == 0:
        record_launch(cfg, run_dir)  # the run's config.yaml stays the first launch's
    record_wandb_run_id(run_dir, trainer.loggers)
    for lg in trainer.loggers:  # rank-zero-only inside Lightning's loggers
        lg.log_hyperparams({**to_container(cfg), "world_size": trainer.world_size})
    interrupted_exports: dict[str, Path] = {}

    def export_on_interrupt(trainer_: pl.Trainer) -> None:  # Ctrl-C: inside fit, so ZeRO can still gather
        head_ = consolidated_head(trainer_, module)
        interrupted_exports.update(export_checkpoints(trainer_, module, ckpt_cb, run_dir, identity_dict, head=head_))

    from train.resume import Preemption

    for cb in trainer.callbacks:
        if isinstance(cb, Preemption):
            cb.on_interrupt = export_on_interrupt
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    except Preempted as stop:  # SIGINT also exported last/ and best/ (export_on_interrupt); SIGTERM/SIGUSR1 did not
        return {"run_dir": run_dir, "trainer": trainer, "module": module, "checkpoint_callback": ckpt_cb,
                "exports": dict(interrupted_exports), "preempted": stop}
    head = consolidated_head(trainer, module)  # collective under ZeRO (gathers fp32 masters)
    from data_prep.features import FeatureDefinition

    trained_on = cache_def or FeatureDefinition.from_config(cfg, int(model.config.num_hidden_layers))
    record = {"features": {**trained_on.to_dict(), "source": str(cfg.train.get("features", "offline"))},
              "precision": str(cfg.train.precision)}
    exports = export_checkpoints(trainer, module, ckpt_cb, run_dir, identity_dict, head=head, extra=record)
    return {"run_dir": run_dir, "trainer": trainer, "module": module, "checkpoint_callback": ckpt_cb,
            "exports": exports, "preempted": None}


def resume_command(argv: list[str], run_name: str) -> str:
    """The shell command that continues this run: ``python -m train`` with ``argv`` minus any
    ``resume=``, plus ``train.run_name=<run_name>`` when ``argv`` names none (so ``resume=auto``
    finds this run, not a newer one), plus ``resume=auto``.  ``python`` is this interpreter
    (``sys.executable``) unless ``python`` on ``$PATH`` is that same path."""
    import shlex

    python = sys.executable
    found = shutil.which("python")
    if found and os.path.abspath(found) == os.path.abspath(python):  # not realpath: a venv python is a symlink
        python = "python"
    args = [a for a in argv if not a.startswith("resume=")]
    if not any(a.startswith("train.run_name=") for a in args):
        args.append(f"train.run_name={run_name}")
    return " ".join(shlex.quote(a) for a in [python, "-m", "train", *args, "resume=auto"])


def resolve_run_precision(cfg: DictConfig, resumed_run: Path | None, online: bool, datamodule=None):
    """``(cfg with model.dtype, train.precision and labels resolved, the offline cache's FeatureDefinition or None)``.

    * ``train.precision=auto`` -> ``bf16-mixed`` where bf16 is native on the training device, else
      ``32-true`` (one line; :func:`core.precision.resolve_train_precision`).
    * ``model.dtype`` (the base's compute dtype, ``data_prep.features``): online / hybrid resolve
      ``auto`` for the training device (a GPU: bf16); offline, the base never runs, and ``auto``
      takes the cache's recorded compute dtype, while an explicit value that differs from it is
      refused with the difference (:func:`data_prep.features.check_same_features`).
    * ``labels``, ``prep.layers``, ``prep.dtype`` (offline): the cache's recorded labels
      (``teacher_forced`` | ``regenerate``), cached intermediate layers and storage dtype, which are
      what the run trains on whatever the config's data-prep defaults say (a cache given by
      ``train.cache_dir`` need not match them).
    * A resumed run (``resumed_run`` holds its ``config.yaml``) keeps the values it recorded; a run
      recorded before ``auto`` was resolved (``train.precision: auto``) keeps the old meaning
      (``bf16-mixed`` on GPUs, ``32-true`` on CPUs).

    The returned config is what the run's ``config.yaml`` records.

    Raises:
        core.config.ConfigError: bf16 asked for on a device without bf16 instructions.
        UserInputError: ``model.dtype`` differs from the offline cache's compute dtype.
    """
    from core.precision import note, resolve_dtype, resolve_train_precision, with_values
    from train.strategies import legacy_auto_precision, resolve_accelerator

    accel = resolve_accelerator(str(cfg.train.accelerator))
    recorded = None
    if resumed_run is not None and (Path(resumed_run) / "config.yaml").is_file():
        recorded = OmegaConf.load(Path(resumed_run) / "config.yaml")
    precision, dtype = str(cfg.train.precision), str(cfg.model.dtype)
    if precision == "auto" and recorded is not None:
        was = str(OmegaConf.select(recorded, "train.precision", default="auto"))
        precision = legacy_auto_precision(accel) if was == "auto" else was
        note(f"train.precision=auto -> {precision}: the resumed run {resumed_run} trained in it")
    else:
        precision = resolve_train_precision(precision, accel)
    cache_def = None
    if not online and datamodule is None:
        from data_prep.cache import default_cache_dir
        from data_prep.features import FeatureDefinition, cache_features, check_same_features

        cache_dir = Path(cfg.train.cache_dir) if cfg.train.get("cache_dir") else default_cache_dir(cfg)
        check_cache_exists(cfg, cache_dir)  # before the base loads
        cache_def = cache_features(cache_dir)
        if cache_def is not None:
            check_cache_layers_early(cfg, cache_def.layers, cache_dir)
        if cache_def is not None and cache_def.compute_dtype is not None:
            if dtype == "auto":
                dtype = cache_def.compute_dtype
                note(f"model.dtype=auto -> {dtype}: the compute dtype of the cache {cache_dir}")
            else:
                run_def = FeatureDefinition(**{**cache_def.to_dict(), "layers": cache_def.layers,
                                               "compute_dtype": resolve_dtype(dtype, "model.dtype", "cpu")})
                check_same_features(cache_def, run_def, f"cache {cache_dir}")
    if dtype == "auto" and recorded is not None:
        was = str(OmegaConf.select(recorded, "model.dtype", default="auto"))
        dtype = was if was != "auto" else dtype
    dtype = resolve_dtype(dtype, "model.dtype", "cuda" if online and accel == "gpu" else "cpu")
    values = {"train.precision": precision, "model.dtype": dtype}
    if cache_def is not None:  # offline, the cache's labels and features are what trains: record them
        from core.config import feature_config_values

        for key, value in feature_config_values(cache_def.to_dict()).items():
            asked = OmegaConf.select(cfg, key)
            if (sorted(int(l) for l in asked) if key == "prep.layers" else str(asked)) != value:
                note(f"{key}={asked} -> {value}: an offline run trains on the {key} of its cache {cache_dir}")
                values[key] = value
    return with_values(cfg, values), cache_def


def draft_vocab_source(heads_cfg: DictConfig, datamodule, vocab_size: int) -> dict[str, Any]:
    """``heads.build`` keywords for the draft vocabulary: the training split's label counts
    (``<cache>/train/label_counts.safetensors``, or a scan of older caches; no base forward) and
    the cache they came from.  Empty when ``heads.draft_vocab_size`` resolves to the full
    vocabulary (null, or ``auto`` with V <= :data:`heads.draft_vocab.AUTO_SIZE`).

    Raises:
        UserInputError: the counts cannot be read or scanned (names the cache file).
    """
    from heads.draft_vocab import check_size

    if check_size(heads_cfg.get("draft_vocab_size"), vocab_size) is None:  # full vocabulary (raises on a bad N)
        return {}
    from data_prep.label_counts import load_counts

    reader = getattr(datamodule, "train_reader", None)
    directory = getattr(reader, "directory", None)
    if directory is None and getattr(datamodule, "cache_dir", None) is not None:
        directory = Path(datamodule.cache_dir) / "train"
    if directory is None:
        raise UserInputError("heads.draft_vocab_size is set but the training data has no cache directory "
                             "to read label counts from (online/hybrid training: set heads.draft_vocab_size=null "
                             "or auto, or train from a cache)")
    try:
        counts = load_counts(directory)
    except (FileNotFoundError, ValueError) as exc:
        raise UserInputError(f"heads.draft_vocab_size needs label counts: {exc}") from exc
    return {"label_counts": counts, "counts_source": str(Path(directory).parent)}


def check_cache_layers(head, datamodule) -> None:
    """Fail before training when the cache lacks an intermediate layer the head reads.

    Raises:
        UserInputError: a split's manifest ``layers`` misses one of ``head.required_cache_layers``.
    """
    for split in ("train", "val"):
        reader = getattr(datamodule, f"{split}_reader", None)
        if reader is not None:
            check_reader_layers(head, reader, split)


def check_reader_layers(head, reader, split: str = "split") -> None:
    """Fail before a head reads a cache split (``data_prep.cache.CacheReader``) that lacks one of its
    ``head.required_cache_layers`` (EAGLE-3's and AdaDecode's intermediate hidden states).

    Raises:
        UserInputError: the split's manifest ``layers`` misses one (the message gives the data-prep
            override that writes them).
    """
    need = [int(l) for l in getattr(head, "required_cache_layers", [])]
    manifest = getattr(reader, "manifest", None)
    if need and manifest is not None:
        check_layers_held(head.head_type, need, manifest.get("layers", []),
                          f"cache split {getattr(reader, 'directory', split)}")


def check_cache_layers_early(cfg: DictConfig, cache_layers, cache_dir: Path) -> None:
    """:func:`check_cache_layers` before the base's weights load: the layers the ``heads`` section
    would read (``cache_layers_for`` of its class, over the base's depth from its config alone,
    :func:`core.base_model.load_base_config`) against the cache's recorded ``prep.layers``.
    An unknown head type is left to the head's build, which names the registered ones.

    Raises:
        UserInputError: the cache lacks one of those layers, or ``heads.layers`` is not valid for
            the base's depth (the message names the key).
    """
    from heads.base import DraftHead
    from heads.registry import head_class

    try:
        cls = head_class(str(cfg.heads.type))
    except KeyError:
        return
    if cls.cache_layers_for.__func__ is DraftHead.cache_layers_for.__func__:
        return  # reads the final state only: nothing to check, no config to read
    from core.base_model import load_base_config

    num_layers = int(load_base_config(cfg.model).num_hidden_layers)
    try:
        need = cls.cache_layers_for(OmegaConf.to_container(cfg.heads, resolve=True), num_layers)
    except ValueError as exc:
        raise UserInputError(str(exc)) from exc
    check_layers_held(cls.head_type, need, cache_layers or [], f"cache {cache_dir}")


def check_layers_held(head_type: str, need, have, where: str) -> None:
    """Raise :class:`UserInputError` when ``have`` (a cache's layers) lacks one of ``need`` (a head's),
    naming ``where`` and the data-prep override that writes them."""
    need, have = [int(l) for l in need], [int(l) for l in have]
    missing = [l for l in need if l not in have]
    if missing:
        raise UserInputError(f"the {head_type} head reads hidden states hs{missing} but {where} holds layers "
                             f"{have}; prepare a cache with {override('prep.layers', need)} "
                             f"(python -m data_prep {override('prep.layers', need)} ...)")


def refuse_existing_run(run_dir: Path, resume_asked: bool = False) -> None:
    """Refuse to start a fresh run where a run already left checkpoints or exported heads
    (``resume_asked``: ``resume=auto`` was given but found no ``last.ckpt``, so the message names the
    newest step checkpoint instead of asking for ``resume=auto``).

    Raises:
        UserInputError: ``run_dir`` holds ``checkpoints/*.ckpt``, ``best/`` or ``last/`` (nothing
            is overwritten; the message says to resume or rename).
    """
    found = [str(p.relative_to(run_dir)) for p in run_files(run_dir)]
    if found:
        steps = sorted(run_dir.glob("checkpoints/step*.ckpt"))
        if resume_asked and steps:  # resume=auto found no last.ckpt: say so, and name what can continue it
            way = (f"resume=auto found no checkpoints/last.ckpt there; continue from its newest step checkpoint "
                   f"with resume={steps[-1]}")
        else:
            way = "pass resume=auto to continue it"
        raise UserInputError(f"run directory {run_dir} already holds a run ({', '.join(found[:3])}"
                             f"{', ...' if len(found) > 3 else ''}): {way}, or choose another train.run_name")


def check_cache_exists(cfg: DictConfig, cache_dir: Path) -> None:
    """Refuse an offline run whose cache is not there: with ``train.cache_dir`` set, naming that key and what
    the folder lacks; else the cache the settings name, with the caches that do exist and how they differ
    (:func:`data_prep.cache.missing_cache_message`).

    Raises:
        UserInputError: no ``train/manifest.json`` under ``cache_dir``.
    """
    if (cache_dir / "train" / "manifest.json").is_file():
        return
    if cfg.train.get("cache_dir"):
        what = "no such folder" if not cache_dir.exists() else "no train/manifest.json there (not a data-prep cache)"
        raise UserInputError(f"train.cache_dir={str(cfg.train.cache_dir)!r}: {what}; pass the folder `python -m data_prep` "
                             "printed (it holds train/ and val/), or unset train.cache_dir to find the cache of these settings")
    from data_prep.cache import missing_cache_message

    raise UserInputError(missing_cache_message(cfg, cache_dir))


def _cache_datamodule(cfg: DictConfig, tokenizer, identity: dict[str, Any]) -> CacheDataModule:
    from data_prep.cache import default_cache_dir

    from train.data import open_split

    cache_dir = Path(cfg.train.cache_dir) if cfg.train.cache_dir else default_cache_dir(cfg)
    check_cache_exists(cfg, cache_dir)
    readers = {split: open_split(cache_dir, split) for split in ("train", "val")}
    empty = [split for split, reader in readers.items() if len(reader) == 0]
    if empty:
        raise UserInputError(f"cache {cache_dir}: the {' and '.join(empty)} split{'s hold' if len(empty) > 1 else ' holds'} "
                             "0 conversations; training needs both (prepare more data: raise "
                             "data.max_conversations or data.heldout_fraction, or check data.path)")
    from data_prep.verify import verify_cache

    # every shard's size, and its SHA-256 once per file version (data_prep.verify: a stamp keyed by size/mtime/inode)
    verify_cache(cache_dir, readers, full=str(cfg.train.get("verify_cache", "auto")) == "full",
                 quiet=rank_zero_only.rank != 0)
    from core.base_model import check_same_base

    for split, reader in readers.items():
        differs = check_same_base(reader.manifest.get("base"), identity, f"cache {cache_dir / split}",
                                  "train.allow_other_base", bool(cfg.train.get("allow_other_base", False)))
        if differs:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"train.allow_other_base=true: training on cache {cache_dir / split} made with another "
                           f"base ({'; '.join(differs)})")
    from data_prep.template import pad_token_id

    pad_id = readers["train"].pad_id if hasattr(readers["train"], "pad_id") else pad_token_id(tokenizer)
    t = cfg.train
    return CacheDataModule(cache_dir, pad_id, batch_size=t.batch_size, max_tokens=t.max_tokens, seed=int(cfg.seed),
                           shuffle=bool(t.shuffle), bucket_size=int(t.bucket_size), num_workers=int(t.num_workers),
                           train_reader=readers["train"], val_reader=readers["val"])


#: ``python -m train --help`` text (train/__main__.py runs :func:`main`)
USAGE = """``python -m train heads=<ctc|falcon|falcon_noglance|falcon_k1|eagle3|adadecode> [key=value ...]``: train a draft head on the cache.

Examples::

    python -m train heads=ctc train.max_steps=2000 train.optimizer.lr=3e-4
    python -m train heads=falcon train.logger=csv train.run_name=falcon-k2

Writes ``<output_root>/runs/<head>/<run_name>/`` (see :mod:`train.run`); exit status 2 on a bad
config key or value.
"""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """CLI entry: compose the config from ``argv`` (or ``sys.argv``), train, print the exports."""
    from core.config import run_cli

    from train.strategies import shutdown_distributed

    result = run_cli(train, argv, USAGE, interrupted="training interrupted (Ctrl-C): nothing more was saved; where the "
                                                     "run has a checkpoints/last.ckpt, add resume=auto to the command "
                                                     "to continue from it")
    shutdown_distributed()  # every rank got here: training ended, or all agreed on the pre-emption stop
    stop = result.get("preempted")
    if stop is not None:
        import signal

        if stop.signum == signal.SIGINT:
            if rank_zero_only.rank == 0:
                saved = ", ".join(f"{name}/" for name in result["exports"])
                print(f"interrupted (Ctrl-C) after optimizer step {stop.step}: saved {stop.path}"
                      f"{' and ' + saved if saved else ''} in {result['run_dir']}")
                print("resume with: " + resume_command(list(sys.argv[1:] if argv is None else argv),
                                                       Path(result["run_dir"]).name))
        else:
            print(f"pre-empted: {stop}")
        raise SystemExit(128 + stop.signum)
    if result["exports"]:
        for name, path in result["exports"].items():
            print(f"{name}: {path}")
    return result
