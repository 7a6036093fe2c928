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
    for key in ("num_prompts", "max_prompt_tokens", "threads", "prompts_per_category"):
        if OmegaConf.select(cfg, f"eval.{key}") is not None:
            check_range(cfg, f"eval.{key}", 1, None)
    check_range(cfg, "eval.warmup", 0, None)
    if "repeats" in cfg.eval:
        if not isinstance(cfg.eval.repeats, int) or isinstance(cfg.eval.repeats, bool) or cfg.eval.repeats < 1:
            raise ConfigError(f"eval.repeats={cfg.eval.repeats!r} must be an integer >= 1")
    if "turns" in cfg.eval and str(cfg.eval.turns) not in ("1", "2", "all"):
        raise ConfigError(f"eval.turns={cfg.eval.turns!r} must be 1, 2 or all")
    check_range(cfg, "eval.prompt_offset", 0, None)
    check_range(cfg, "eval.temperature", 0, None)
    check_range(cfg, "eval.reference_depth", 1, None)
    check_range(cfg, "eval.reference_width", 1, None)
    check_choice(cfg, "eval.dtype", DTYPES)
    check_device(cfg.eval.get("device"))
    _tree_checks(cfg)


def check_device(dev) -> None:
    """``eval.device`` is null, ``cpu``, ``mps`` or ``cuda[:N]``, and exists on this machine.

    Raises:
        ConfigError: an unknown device string, ``cuda`` on a torch without a CUDA device, ``cuda:N``
            beyond the visible device count, or ``mps`` where it is not available.
    """
    import re

    import torch

    if dev is None:
        return
    dev = str(dev)
    m = re.fullmatch(r"cuda(?::(\d+))?", dev)
    if not (dev in ("cpu", "mps") or m):
        raise ConfigError(f"eval.device={dev!r} is not valid; use null, cpu, cuda or cuda:N")
    if m and not torch.cuda.is_available():
        raise ConfigError(f"eval.device={dev}, but this torch sees no CUDA device (torch {torch.__version__}, CUDA "
                          f"build: {torch.version.cuda or 'none'}); use eval.device=cpu or null")
    if m and m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
        raise ConfigError(f"eval.device={dev}: only {torch.cuda.device_count()} CUDA device(s) visible")
    if dev == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError("eval.device=mps, but MPS is not available on this machine; use eval.device=cpu or null")


def _tree_checks(cfg: DictConfig) -> None:
    """``eval.tree*`` (issue 14): a known mode, a non-empty grid of node counts, ``tree_nodes`` in it,
    and Falcon rank-tree specs given as paths that are trees (every path's parent listed too)."""
    if "tree" not in cfg.eval:
        return
    check_choice(cfg, "eval.tree", ("auto", "dynamic", "config"))
    grid = cfg.eval.get("tree_grid")
    if grid is None or len(grid) == 0:
        raise ConfigError("eval.tree_grid is empty: give the node counts (root included) to measure and search, "
                          "e.g. [1, 2, 4, 8, 16, 32, 64]")
    if any(not isinstance(n, int) or n < 1 for n in grid):
        raise ConfigError(f"eval.tree_grid={list(grid)}: node counts must be integers >= 1 (root included)")
    tn = cfg.eval.get("tree_nodes")
    if tn is not None and tn not in list(grid):
        raise ConfigError(f"eval.tree_nodes={tn} must be one of eval.tree_grid={list(grid)}")
    for key in ("tree_max_rank", "cost_context_tokens", "calibration_prompts"):
        check_range(cfg, f"eval.{key}", 1, None)
    if cfg.eval.get("calibration_max_new_tokens") is not None:
        check_range(cfg, "eval.calibration_max_new_tokens", 1, None)
    head_tree = OmegaConf.select(cfg, "heads.decoding.tree") if OmegaConf.select(cfg, "heads.type") == "falcon" else None
    for key, spec in (("eval.falcon_tree", cfg.eval.get("falcon_tree")), ("heads.decoding.tree", head_tree)):
        if spec is None or not isinstance(spec, DictConfig) or spec.get("paths") is None:
            continue
        from decoding.tree import TreeError
        from decoding.tree_search import check_rank_tree

        try:
            check_rank_tree(OmegaConf.to_container(spec.paths), contiguous=False)
        except TreeError as exc:
            raise ConfigError(f"{key}.paths: {exc}") from None
