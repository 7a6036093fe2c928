"""Value checks of the ``train`` config section (registered with :func:`core.config.register_validator`).

Each check raises :class:`core.config.ConfigError` naming the offending key and the valid values.
"""
from __future__ import annotations

from datetime import timedelta

from omegaconf import DictConfig, ListConfig, OmegaConf

from core.config import ConfigError, check_choice, check_range, register_validator

LOGGERS = ("wandb", "csv", "none")
#: the largest ``train.max_time`` (seconds) Lightning's ``timedelta`` budget can hold
MAX_TIME = timedelta.max.total_seconds()
SCHEDULES = ("linear", "cosine", "constant")
CLIP_ALGORITHMS = ("value", "norm")
PRECISIONS = ("auto", "32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(cfg: DictConfig, key: str, lo: int | None = None, nullable: bool = False) -> None:
    value = OmegaConf.select(cfg, key, default=None)
    if value is None and nullable:
        return
    if not _is_int(value) or (lo is not None and value < lo):
        raise ConfigError(f"{key}={value!r} must be an integer" + (f" >= {lo}" if lo is not None else "")
                          + (" or null" if nullable else ""))


@register_validator
def check_train(cfg: DictConfig) -> None:
    """Validate ``cfg.train`` (no-op when the section is absent)."""
    if "train" not in cfg or cfg.train is None:
        return
    _check_int(cfg, "train.max_steps", -1)
    _check_int(cfg, "train.max_epochs", -1)
    if cfg.train.max_steps in (0,) or cfg.train.max_epochs == 0:
        raise ConfigError("train.max_steps / train.max_epochs must not be 0 (use -1 for 'no limit')")
    if cfg.train.max_steps == -1 and cfg.train.max_epochs == -1:
        raise ConfigError("train.max_steps and train.max_epochs are both -1: set at least one budget")
    mt = cfg.train.get("max_time")
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, (int, float)) or not 0 < mt <= MAX_TIME):
        raise ConfigError(f"train.max_time={mt!r} must be a number of seconds > 0 (at most {MAX_TIME:.0f}, Python's "
                          "longest timedelta) or null for no time limit")
    _check_int(cfg, "train.batch_size", 1, nullable=True)
    _check_int(cfg, "train.max_tokens", 1, nullable=True)
    if cfg.train.batch_size is None and cfg.train.max_tokens is None:
        raise ConfigError("train.batch_size and train.max_tokens are both null: set at least one")
    check_choice(cfg, "train.features", ("offline", "online", "hybrid"))
    _check_int(cfg, "train.bucket_size", 1)
    _check_int(cfg, "train.num_workers", 0)
    _check_int(cfg, "train.accumulate_grad_batches", 1)
    _check_int(cfg, "train.val_every_n_steps", 1)
    _check_int(cfg, "train.limit_val_batches", 1, nullable=True)
    _check_int(cfg, "train.sanity_val_steps", 0)
    _check_int(cfg, "train.num_nodes", 1)
    _check_int(cfg, "train.log_every_n_steps", 1)
    k = cfg.train.save_top_k
    if not _is_int(k) or not (k >= 1 or k == -1):
        raise ConfigError(f"train.save_top_k={k!r} must be an integer >= 1, or -1 (keep every validation's checkpoint)")
    check_choice(cfg, "train.verify_cache", ("auto", "full"))
    check_choice(cfg, "train.val_schedule", ("steps", "log"))
    _check_int(cfg, "train.val_first_tokens", 1)
    vf = cfg.train.val_factor
    if isinstance(vf, bool) or not isinstance(vf, (int, float)) or not 1 < vf < float("inf"):
        raise ConfigError(f"train.val_factor={vf!r} must be a number > 1 (the growth of tokens seen between validations)")
    if not isinstance(cfg.train.shuffle, bool):
        raise ConfigError(f"train.shuffle={cfg.train.shuffle!r} must be true or false")
    check_range(cfg, "train.optimizer.lr", 0.0)
    if not cfg.train.optimizer.lr > 0:
        raise ConfigError(f"train.optimizer.lr={cfg.train.optimizer.lr!r} must be > 0")
    betas = cfg.train.optimizer.betas
    if (not isinstance(betas, (ListConfig, list)) or len(betas) != 2
            or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
        raise ConfigError(f"train.optimizer.betas={betas!r} must be two numbers in [0, 1)")
    check_range(cfg, "train.optimizer.eps", 0.0)
    check_range(cfg, "train.optimizer.weight_decay", 0.0)
    check_choice(cfg, "train.scheduler.name", SCHEDULES)
    _check_int(cfg, "train.scheduler.warmup_steps", 0)
    check_range(cfg, "train.scheduler.min_lr_ratio", 0.0, 1.0)
    if cfg.train.grad_clip.value is not None:
        check_range(cfg, "train.grad_clip.value", 0.0)
    check_choice(cfg, "train.grad_clip.algorithm", CLIP_ALGORITHMS)
    check_choice(cfg, "train.precision", PRECISIONS)
    check_choice(cfg, "train.accelerator", ("auto", "cpu", "gpu", "cuda"))
    check_accelerator_and_precision(cfg)
    devices = cfg.train.devices
    if not (devices == "auto" or _is_int(devices) and (devices >= 1 or devices == -1)
            or isinstance(devices, (ListConfig, list)) and all(_is_int(d) for d in devices)):
        raise ConfigError(f"train.devices={devices!r} must be auto, a positive integer, -1 or a list of device ids")
    if isinstance(devices, (ListConfig, list)) and str(cfg.train.accelerator) in ("auto", "cpu"):
        import torch

        if str(cfg.train.accelerator) == "cpu" or not torch.cuda.is_available():
            raise ConfigError(f"train.devices={list(devices)!r}: a list names GPU ids, and this run trains on the CPU, "
                              "where train.devices counts processes: auto, 1, 2, ... or -1 (one per core)")
    check_choice(cfg, "train.logger", LOGGERS)
    if not isinstance(cfg.train.wandb_project, str) or not cfg.train.wandb_project:
        raise ConfigError(f"train.wandb_project={cfg.train.wandb_project!r} must be a non-empty string")
    run_name = cfg.train.run_name
    if run_name is not None and (not isinstance(run_name, str) or not run_name or "/" in run_name
                                 or run_name in (".", "..")):
        raise ConfigError(f"train.run_name={run_name!r} must be null or a plain directory name (no '/')")
    if not isinstance(cfg.train.progress_bar, bool):
        raise ConfigError(f"train.progress_bar={cfg.train.progress_bar!r} must be true or false")


def check_accelerator_and_precision(cfg: DictConfig) -> None:
    """``train.accelerator`` must exist on this machine; float16 precisions are refused on CPUs.

    Lightning runs ``16-mixed`` on a CPU as ``bf16-mixed`` without saying so (torch has no fp16
    autocast for CPUs); so ``16-mixed`` / ``16-true`` on a CPU is an error that says to use
    ``auto`` or ``32-true``.  ``auto`` and the bf16 precisions are resolved by
    :func:`core.precision.resolve_train_precision` when the run starts (bf16-mixed where bf16 is
    native, a warning line where it runs but is not faster, refused where it is emulated).

    Raises:
        ConfigError: ``train.accelerator=gpu|cuda`` without a CUDA device, or a float16 precision
            on a CPU run.
    """
    import torch

    accel = str(cfg.train.accelerator)
    has_cuda = torch.cuda.is_available()
    if accel in ("gpu", "cuda") and not has_cuda:
        raise ConfigError(f"train.accelerator={accel}, but this torch sees no CUDA device (torch "
                          f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); use train.accelerator=auto or cpu")
    on_cpu = accel == "cpu" or (accel == "auto" and not has_cuda)
    precision = str(cfg.train.precision)
    if on_cpu and precision in ("16-mixed", "16-true"):
        raise ConfigError(f"train.precision={precision} on a CPU: torch has no float16 autocast on CPUs, so Lightning "
                          "would silently run bf16-mixed instead; use train.precision=auto (bf16-mixed where this "
                          "CPU's bf16 is native, else 32-true) or 32-true")


STRATEGIES = ("auto", "ddp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3")


#: ``strategy.bucket_size``'s default (configs/strategy/*.yaml): set otherwise outside ZeRO, it is refused.
ZERO_BUCKET = 50_000_000


@register_validator
def check_strategy_and_resume(cfg: DictConfig) -> None:
    """Validate ``cfg.strategy`` (train/strategies.py) and the top-level ``resume``."""
    if "strategy" in cfg and cfg.strategy is not None and "name" in cfg.strategy:
        s = cfg.strategy
        check_choice(cfg, "strategy.name", STRATEGIES)
        zero = str(s.name).startswith("deepspeed")
        if zero and s.get("zero_stage") not in (1, 2, 3):
            raise ConfigError(f"strategy.zero_stage={s.get('zero_stage')!r} must be 1, 2 or 3 for strategy.name={s.name}")
        if not zero and s.get("zero_stage") is not None:
            raise ConfigError(f"strategy.zero_stage={s.zero_stage!r} needs a deepspeed_zero* strategy (got {s.name})")
        # a key of another strategy would be ignored silently: refused where it is set off its default
        if not zero:
            for key, default in (("offload_optimizer", False), ("overlap_comm", False), ("bucket_size", ZERO_BUCKET)):
                if s.get(key, default) != default:
                    raise ConfigError(f"strategy.{key}={s.get(key)!r} needs a deepspeed_zero* strategy (got {s.name}), "
                                      "which is the only one that reads it")
        if s.name != "ddp" and s.get("find_unused_parameters"):
            raise ConfigError(f"strategy.find_unused_parameters=true needs strategy=ddp (got {s.name}), which is the "
                              "only one that reads it")
        check_choice(cfg, "strategy.process_group_backend", ("auto", "nccl", "gloo", "mpi"))
        check_range(cfg, "strategy.timeout_minutes", 0.1)
        _check_int(cfg, "strategy.bucket_size", 1)
    resume = cfg.get("resume")
    if resume is not None and not isinstance(resume, str):
        raise ConfigError(f"resume={resume!r} must be null, auto, or a checkpoint file / run directory path")
