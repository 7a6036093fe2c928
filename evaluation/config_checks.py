"""Value checks for the ``eval`` config section (registered with :func:`core.config.register_validator`)."""
from __future__ import annotations

from omegaconf import DictConfig, ListConfig, OmegaConf

from core.config import DTYPES, ConfigError, check_choice, check_range, register_validator

ATTENTIONS = ("eager", "sdpa")


def check_fastest_vanilla_entries(value) -> list[str]:
    """The entries of a list-valued ``eval.fastest_vanilla`` that are neither a dtype nor
    ``<dtype>:<attention>`` (:mod:`evaluation.fastest_vanilla`); empty when all are good."""
    bad = []
    for v in value:
        dtype, _, attention = str(v).partition(":")
        if dtype not in DTYPES or (attention and attention not in ATTENTIONS):
            bad.append(str(v))
    return bad


@register_validator
def _eval_checks(cfg: DictConfig) -> None:
    if "eval" not in cfg or not isinstance(cfg.eval, DictConfig) or "max_new_tokens" not in cfg.eval:
        return
    check_range(cfg, "eval.max_new_tokens", 1, None)
    if not isinstance(cfg.eval.max_new_tokens, int):
        raise ConfigError(f"eval.max_new_tokens={cfg.eval.max_new_tokens!r} must be an integer")
    for key in ("num_prompts", "max_prompt_tokens", "threads", "plan_threads", "prompts_per_category"):
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
    fv = cfg.eval.get("fastest_vanilla", "auto")
    # `eval.fastest_vanilla=off` on a command line arrives as False (YAML 1.1 reads off as a boolean)
    if not (fv in ("auto", "off") or fv is False
            or (isinstance(fv, ListConfig) and not check_fastest_vanilla_entries(fv))):
        raise ConfigError(f"eval.fastest_vanilla={fv!r} must be auto, off or a list of dtypes ({', '.join(DTYPES)}), "
                          "each optionally :eager or :sdpa (float32:sdpa)")
    from decoding.prepacked import prepack_mode

    if prepack_mode(cfg.eval.get("prepack_weights", "auto")) is None:
        raise ConfigError(f"eval.prepack_weights={cfg.eval.prepack_weights!r}: use auto, true or false")
    check_device(cfg.eval.get("device"))
    _tree_checks(cfg)
    variants = cfg.eval.get("variants")
    if variants is not None and not isinstance(variants, ListConfig):
        raise ConfigError(f"eval.variants={variants!r} must be null or a list of mappings of eval.* overrides, "
                          "e.g. '[{gamma: 0.7}, {gamma: 0.85}]'")
    if variants is not None and len(variants) == 0:
        raise ConfigError("eval.variants=[] lists no variant, so nothing would be evaluated; list at least one "
                          "(e.g. '[{gamma: 0.7}]') or leave eval.variants null for the run's own eval section")
    head_type = OmegaConf.select(cfg, "heads.type", default=None)
    heads_cfg = OmegaConf.to_container(cfg.heads, resolve=True) if "heads" in cfg and isinstance(cfg.heads, DictConfig) else {}
    check_decoding_overrides(OmegaConf.to_container(cfg.eval, resolve=True), head_type, heads_cfg)


# eval.<key> -> (head type whose drafter reads it, the heads.* key it overrides, expected value)
DECODING_OVERRIDES = {
    "topk": ("ctc", "topk", "int_or_list"),
    "max_nodes": ("ctc", "max_nodes", "int"),
    "max_alignments": ("ctc", "max_alignments", "int"),
    "falcon_passes": ("falcon", "decoding.passes", "int"),
    "falcon_tree": ("falcon", "decoding.tree", "mapping"),
    "gamma": ("adadecode", "gamma", "number"),
    "gamma_schedule": ("adadecode", "gamma_schedule", "numbers"),
    "max_inflight": ("adadecode", "max_inflight", "int"),
}


def check_decoding_overrides(ev: dict, head_type: str | None = None, heads_cfg: dict | None = None,
                             where: str = "eval") -> None:
    """Type and range checks of the per-head decoding overrides of the ``eval`` section.

    These keys default to null (= the head checkpoint's own value), so :func:`core.config.compose`
    cannot type them by their default.  Each must hold what the ``heads.*`` key it overrides holds
    (:data:`DECODING_OVERRIDES`): an integer >= 1 (``max_nodes``, ``max_alignments``,
    ``falcon_passes``, ``max_inflight``), an integer >= 1 or a non-empty list of them (``topk``), a
    number in [0, 1] (``gamma``), a list of numbers in [0, 1] (``gamma_schedule``), or a tree mapping
    (``falcon_tree``: exactly one of node_children / depth_children / paths; with ``heads=falcon``
    it is built with the selected ``heads.block_size`` and the pass count, as the drafter builds it).

    Args:
        ev: the plain ``eval`` section (or one ``eval.variants`` entry merged into it).
        head_type: ``heads.type`` of the run (null: no head-specific checks).
        heads_cfg: the plain ``heads`` section (block size and passes for the tree check).
        where: the prefix that names the key in messages (``eval`` or ``eval.variants[i]``).

    Raises:
        ConfigError: a bad value, or a key of another head than ``head_type`` (its decoder would
            ignore it); the message names ``<where>.<key>``, the value and what it must be.
    """
    import json

    dec = ev.get("decoding")
    if dec is not None:  # eval.decoding: a map merged over heads.decoding (any head that has one)
        if not isinstance(dec, dict):
            raise ConfigError(f"{where}.decoding={json.dumps(dec)} must be a mapping merged over the head's "
                              "heads.decoding section, e.g. '{topk: 8}'")
        head_dec = (heads_cfg or {}).get("decoding")
        if isinstance(head_dec, dict):
            from core.config import check_override_type

            unknown = sorted(set(dec) - set(head_dec))
            if unknown:
                raise ConfigError(f"{where}.decoding: unknown key(s) {', '.join(unknown)} for heads={head_type}; "
                                  f"heads.decoding has {', '.join(sorted(head_dec))}")
            for k, v in dec.items():
                check_override_type(f"{where}.decoding.{k}", head_dec[k], v)

    for key, (owner, head_key, kind) in DECODING_OVERRIDES.items():
        value = ev.get(key)
        if value is None:
            continue
        name = f"{where}.{key}={json.dumps(value)}"
        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        is_num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        hint = f" (overrides heads.{head_key} of heads={owner})"
        if head_type is not None and head_type != owner:  # ignored by this head: a sweep over it would only repeat
            raise ConfigError(f"{name} applies to {owner} heads only (it overrides heads.{head_key}); this run's "
                              f"head is heads.type={head_type}, whose decoder would ignore it")
        if kind == "int" and not (is_int(value) and value >= 1):
            raise ConfigError(f"{name} must be an integer >= 1{hint}")
        if kind == "int_or_list" and not ((is_int(value) and value >= 1) or (
                isinstance(value, list) and value and all(is_int(v) and v >= 1 for v in value))):
            raise ConfigError(f"{name} must be an integer >= 1 or a non-empty list of them, e.g. [10,6,4]{hint}")
        if kind == "number" and not (is_num(value) and 0 <= value <= 1):
            raise ConfigError(f"{name} must be a number in [0, 1] (an exit threshold on a confidence){hint}")
        if kind == "numbers" and not (isinstance(value, list) and value and all(is_num(v) and 0 <= v <= 1 for v in value)):
            raise ConfigError(f"{name} must be a non-empty list of numbers in [0, 1], one per heads.layers entry{hint}")
        if kind == "mapping":
            if not isinstance(value, dict):
                raise ConfigError(f"{name} must be a mapping with one of node_children, depth_children, paths, "
                                  f"e.g. {{depth_children: [4, 2, 1]}}{hint}")
            if head_type == owner:
                from decoding.falcon import FalconTreeTemplate

                c = heads_cfg or {}
                passes = ev.get("falcon_passes") or (c.get("decoding") or {}).get("passes") or 4
                try:
                    FalconTreeTemplate.from_config(value, int(c.get("block_size") or 2), int(passes))
                except (ValueError, TypeError, AttributeError) as exc:
                    msg = str(exc).replace("heads.decoding.tree", f"{where}.{key}")
                    raise ConfigError(msg if msg.startswith(f"{where}.{key}") else f"{where}.{key}: {msg}") from None


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
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in grid):  # YAML's true is no node count
        raise ConfigError(f"eval.tree_grid={list(grid)}: node counts must be integers >= 1 (root included)")
    from decoding.tree_search import TREE_OBJECTIVES

    if cfg.eval.get("tree_objective") is not None:
        check_choice(cfg, "eval.tree_objective", TREE_OBJECTIVES)
    tn = cfg.eval.get("tree_nodes")
    if cfg.eval.get("tree_objective") == "tau" and tn is None and cfg.eval.tree != "config":
        raise ConfigError("eval.tree_objective=tau maximises tau at a node budget: set eval.tree_nodes too (e.g. 16); "
                          "without it the largest size of eval.tree_grid would be drafted")
    if tn is not None and tn not in list(grid):
        raise ConfigError(f"eval.tree_nodes={tn} must be one of eval.tree_grid={list(grid)}")
    if tn is not None and cfg.eval.tree == "config":  # the configured tree is decoded as it is: the budget is unused
        raise ConfigError(f"eval.tree_nodes={tn} sizes the tree of eval.tree=auto or dynamic; eval.tree=config decodes "
                          "the head's configured tree as it is and would ignore it: drop one of the two")
    for key in ("tree_max_rank", "cost_context_tokens", "calibration_prompts"):
        check_range(cfg, f"eval.{key}", 1, None)
    from decoding.reference import REFERENCE_DRAFTERS

    if cfg.eval.get("calibration_max_new_tokens") is not None:
        check_range(cfg, "eval.calibration_max_new_tokens", 2, None)
    elif (cfg.eval.tree in ("auto", "dynamic") and OmegaConf.select(cfg, "heads.type") in ("falcon", "ctc", "eagle3")
          and str(cfg.eval.get("checkpoint")) not in REFERENCE_DRAFTERS
          and isinstance(cfg.eval.get("max_new_tokens"), int) and cfg.eval.max_new_tokens < 2):
        # the calibration decodes eval.max_new_tokens per held-out prompt; a reply's first token comes from the prefill
        raise ConfigError(f"eval.max_new_tokens={cfg.eval.max_new_tokens} leaves eval.tree={cfg.eval.tree}'s calibration "
                          "no draft to verify (a reply's first token comes from the prefill); set "
                          "eval.calibration_max_new_tokens=128 (the tree is sized on longer replies) or eval.tree=config")
    head_tree = OmegaConf.select(cfg, "heads.decoding.tree") if OmegaConf.select(cfg, "heads.type") == "falcon" else None
    for key, spec in (("eval.falcon_tree", cfg.eval.get("falcon_tree")), ("heads.decoding.tree", head_tree)):
        if spec is None or not isinstance(spec, DictConfig) or spec.get("paths") is None:
            continue
        from decoding.tree import TreeError
        from decoding.tree_search import check_rank_tree

        if not isinstance(spec.paths, ListConfig):
            raise ConfigError(f"{key}.paths={spec.paths!r} must be a list of rank paths (lists of ints), "
                              "e.g. [[0], [1], [0, 0]]")
        try:
            check_rank_tree(OmegaConf.to_container(spec.paths), contiguous=False)
        except TreeError as exc:
            raise ConfigError(f"{key}.paths: {exc}") from None
