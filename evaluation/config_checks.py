"""Value checks for the ``eval`` config section (registered with :func:`core.config.register_validator`)."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from core.config import DTYPES, ConfigError, check_choice, check_range, register_validator


@register_validator
def _eval_checks(cfg: DictConfig) -> None:
    if "eval" not in cfg or not isinstance(cfg.eval, DictConfig) or "max_new_tokens" not in cfg.eval:
        return
    check_range(cfg, "eval.max_new_tokens", 1, None)
    if not isinstance(cfg.eval.max_new_tokens, int):
        raise ConfigError(f"eval.max_new_tokens={cfg.eval.max_new_tokens!r} must be an integer")
    for key in ("num_prompts", "max_prompt_tokens", "threads"):
        if OmegaConf.select(cfg, f"eval.{key}") is not None:
            check_range(cfg, f"eval.{key}", 1, None)
    check_range(cfg, "eval.warmup", 0, None)
    check_range(cfg, "eval.prompt_offset", 0, None)
    check_range(cfg, "eval.temperature", 0, None)
    check_range(cfg, "eval.reference_depth", 1, None)
    check_range(cfg, "eval.reference_width", 1, None)
    check_choice(cfg, "eval.dtype", DTYPES)
    dev = cfg.eval.get("device")
    if dev is not None and not (dev == "cpu" or str(dev).startswith("cuda") or dev == "mps"):
        raise ConfigError(f"eval.device={dev!r} is not valid; use null, cpu, cuda or cuda:N")
