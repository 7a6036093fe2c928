"""The methods an evaluation runs: a head checkpoint's (or a reference drafter's) decoder, one per
``eval.variants`` entry.

* :func:`build_decoder` loads ``eval.checkpoint`` (``heads.load``), checks it was trained on the
  loaded base, and returns a :class:`decoding.speculative.Decoder` (a head's own decoder, or its
  :class:`decoding.speculative.Drafter` wrapped in :class:`decoding.speculative.SpeculativeDecoder`);
  ``eval.checkpoint=oracle|random`` builds a reference drafter (:mod:`decoding.reference`).
* :func:`variant_configs` expands ``eval.variants`` into one checked config per method, all sharing
  one vanilla pass per prompt.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from core.config import to_container
from decoding.reference import REFERENCE_DRAFTERS, OracleDrafter, RandomDrafter
from decoding.speculative import Decoder, Drafter, SpeculativeDecoder

log = logging.getLogger(__name__)


def resolve_device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_checkpoint_given(ckpt) -> None:
    """Raises ValueError when an evaluation names no checkpoint (``eval.checkpoint`` null), saying how to."""
    if ckpt is None:
        raise ValueError("eval.checkpoint is required: `python -m evaluation heads=<h> checkpoint=PATH` "
                         f"(or checkpoint={'|'.join(REFERENCE_DRAFTERS)} for a reference drafter)")


def build_decoder(cfg: DictConfig, base_model, eos_ids: list[int], device: torch.device, identity=None):
    """The method's decoder for this run, and a description dict.

    ``identity`` (the loaded base's :class:`core.base_model.BaseIdentity` or its dict) is compared
    with the base the head checkpoint recorded (:func:`core.base_model.check_same_base`).

    Raises:
        ValueError: ``eval.checkpoint`` is missing, or the checkpoint's head type differs from
            ``heads.type``.
        core.config.UserInputError: the checkpoint was trained on another base (unless
            ``eval.allow_other_base=true`` and only the weights / architecture differ).
        TypeError: ``make_drafter`` returned neither a Decoder nor a Drafter.
    """
    ev = cfg.eval
    ckpt = ev.get("checkpoint")
    check_checkpoint_given(ckpt)
    info: dict[str, Any] = {"checkpoint": str(ckpt)}
    if str(ckpt) not in REFERENCE_DRAFTERS:  # its identity: summaries pair runs by weights, not by path
        from evaluation.progress import checkpoint_digest

        info["checkpoint_sha256"] = checkpoint_digest(ckpt)
    if str(ckpt) in REFERENCE_DRAFTERS:
        depth, width = int(ev.reference_depth), int(ev.reference_width)
        if ckpt == "oracle":
            obj = OracleDrafter(base_model, depth=depth, width=width, seed=int(cfg.get("seed", 0)))
        else:
            obj = RandomDrafter(int(base_model.config.vocab_size), depth=depth, width=width, seed=int(cfg.get("seed", 0)))
        info.update(head_type=f"reference:{ckpt}", reference_depth=depth, reference_width=width)
        info["precision"] = precision_info(base_model, None, None)
    else:
        import heads
        from core.rope import cast_module

        path = Path(str(ckpt))
        if not path.is_dir():
            raise ValueError(f"eval.checkpoint={str(ckpt)!r}: not a directory")
        if identity is not None:  # before loading: a head of another base may not even fit
            from core.base_model import check_same_base

            recorded = json.loads((path / "config.json").read_text()).get("base") if (path / "config.json").is_file() else None
            differs = check_same_base(recorded, identity.to_dict() if hasattr(identity, "to_dict") else dict(identity),
                                      f"head checkpoint {path}", "eval.allow_other_base",
                                      bool(ev.get("allow_other_base", False)))
            if differs:
                log.warning("eval.allow_other_base=true: %s was trained on another base (%s)", path, "; ".join(differs))
                info["other_base"] = differs
        head, meta = heads.load(path, base_model=base_model)
        heads.registry.check_head_type(path, meta["head_type"], cfg.heads.get("type") if "heads" in cfg else None)
        cast_module(head, base_model.dtype, device).eval()  # the drafter computes in the eval dtype too (RoPE stays fp32)
        head.requires_grad_(False)
        if (packed := pack_like_base(head, base_model)):
            info["head_prepacked_layers"] = len(packed)
        kwargs = {k: v for k, v in to_container(ev).items()}
        kwargs["seed"] = int(cfg.get("seed") or 0)  # sampling decoders (temperature > 0)
        obj = head.make_drafter(base_model, eos_token_ids=list(eos_ids), **kwargs)
        info.update(head_type=meta["head_type"], head_config=meta.get("head"), checkpoint_extra=meta.get("extra", {}),
                    head_parameters=int(sum(p.numel() for p in head.parameters())))
        info["precision"] = precision_info(base_model, head, meta)
    if isinstance(obj, Decoder):
        info["decoder"] = type(obj).__name__
        return obj, info
    if isinstance(obj, Drafter):
        info["decoder"] = f"SpeculativeDecoder({type(obj).__name__})"
        return SpeculativeDecoder(base_model, obj, eos_ids), info
    raise TypeError(f"make_drafter returned {type(obj).__name__}: neither a Decoder (generate) nor a Drafter "
                    "(start/draft/accept); see docs/design.md 'Decoding runtime API'")


def row_consistent_products(model, ev) -> list[str]:
    """``eval.row_consistent`` (default true): on a bf16 / fp16 base on a CPU, the linear layers whose
    one-row product rounds differently from their many-row product compute a one-token step as
    two rows, so vanilla's steps equal verification's rows bit for bit
    (:func:`decoding.numerics.pad_one_row_products`; docs/precision_eval.md).  Applies to ``model``
    itself (vanilla and every method share it).  Returns the padded layers' names ([] in fp32)."""
    if not ev.get("row_consistent", True):
        return []
    from decoding.numerics import pad_one_row_products

    return pad_one_row_products(model)


def prepacked_products(model, ev) -> list[str]:
    """``eval.prepack_weights`` (default ``auto``): linear weights reordered once for oneDNN
    (:func:`decoding.prepacked.pack_for_decoding`; docs/precision.md "Prepacked verification weights" and
    "bf16 on a CPU with AMX").  Applies to ``model`` itself, before :func:`row_consistent_products`.
    Where a layer's one-row product is packed (the LM head on the AMD EPYC Zen 3), vanilla's one-token
    step runs it too: vanilla is as fast as this machine makes it, and every vanilla reference shares it.

    Returns:
        The packed layers' names ([] when off or not applicable).

    Raises:
        ValueError: ``eval.prepack_weights`` is not auto/true/false, or is true where it cannot apply.
    """
    from decoding.prepacked import pack_for_decoding, prepack_mode

    mode = prepack_mode(ev.get("prepack_weights", "auto"))
    if mode is None:
        raise ValueError(f"eval.prepack_weights={ev.get('prepack_weights')!r}: use auto, true or false")
    return pack_for_decoding(model, mode, "eval.prepack_weights")


def pack_like_base(head, base_model) -> list[str]:
    """A draft head's linear layers packed for oneDNN as :func:`prepacked_products` packed its base's.

    The head's layers include its product over the frozen LM-head rows (``frozen_draft_lm_head``,
    :class:`core.frozen_linear.FrozenLinear`: W[d2t], 16,384 x 576 for SmolLM2's heads of record),
    which is most of a drafter pass's weights.

    * A bf16 base packed for every row count (:func:`decoding.prepacked.prepack_row_consistent`, a CPU
      with AMX): so is the head; there the packed product is the fastest bf16 kernel at every row
      count, and a drafter pass runs its layers over 1-16 rows.
    * An fp32 base packed for many-row products (:func:`decoding.prepacked.prepack_linear_weights`):
      so is the head, each layer from the row count where this CPU runs its packed product faster
      (``min_rows="auto"``).  Unpacked, every tree pass over >= 3 rows reordered each whole weight
      matrix, the LM-head rows included, at every call.
    * Anything else (``eval.prepack_weights=false``, no oneDNN, a GPU): nothing.

    Drafts decide nothing about the output (verification does), so the head needs no row consistency
    of its own; the same kernels give it.

    Returns:
        The packed layers' module names.
    """
    from decoding.prepacked import (ROW_CONSISTENT_DTYPES, prepack_linear_weights, prepack_row_consistent,
                                    prepacked_chunks, prepacked_min_rows)

    if prepacked_chunks(base_model) is not None and base_model.dtype in ROW_CONSISTENT_DTYPES:
        return prepack_row_consistent(head, dtypes=(base_model.dtype,))  # the base's weights are buffers of a head
    if prepacked_min_rows(base_model) is not None:
        return prepack_linear_weights(head, min_rows="auto")
    return []


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def precision_info(base_model, head=None, meta: dict | None = None) -> dict[str, Any]:
    """What ran and what the head was made with (issue 26), for ``report.json["info"]["precision"]``.

    Returns:
        ``{"base": eval dtype of the base, "head": the drafter's parameter dtype (None without a head),
        "trained_precision": the checkpoint's recorded ``train.precision`` (``extra.precision``) or
        None, "features": its recorded feature definition (``extra.features``: the data-prep compute /
        storage dtype) or None, "note": a line when the head is evaluated in another dtype than it
        was trained or its features were computed in}``.
    """
    extra = (meta or {}).get("extra") or {}
    params = [p for p in head.parameters() if p.is_floating_point()] if head is not None else []
    out = {"base": _dtype_name(base_model.dtype), "head": _dtype_name(params[0].dtype) if params else None,
           "trained_precision": extra.get("precision"), "features": extra.get("features"), "note": None}
    feats = extra.get("features") if isinstance(extra.get("features"), dict) else {}
    made = {k: v for k, v in (("trained", extra.get("precision")), ("features computed", feats.get("compute_dtype")))
            if v is not None}
    if made and head is not None:
        out["note"] = ("evaluated in " + out["base"] + "; " + ", ".join(f"{k} in {v}" for k, v in made.items())
                       + " (allowed: training and evaluation precisions may differ)")
    return out


def checkpoint_label(ckpt) -> str:
    """A short name for a checkpoint: ``<run>-best`` for ``.../<run>/best``, else the last path part."""
    if ckpt is None:
        return "none"
    path = Path(str(ckpt))
    return f"{path.parent.name}-{path.name}" if path.name in ("best", "last") and path.parent.name else path.name


_NAME_OK = re.compile(r"[^A-Za-z0-9._=,+-]+")


def _name_value(val) -> str:
    """A variant override's value as it appears in the variant's default name: a list's items
    joined by ``_`` (``topk=[1, 1, 1]`` → ``topk=1_1_1``), a mapping's ``key-value`` pairs likewise."""
    from omegaconf import OmegaConf

    val = to_container(val) if OmegaConf.is_config(val) else val
    if isinstance(val, (list, tuple)):
        return "_".join(_name_value(v) for v in val)
    if isinstance(val, dict):
        return "_".join(f"{k}-{_name_value(v)}" for k, v in val.items())
    return str(val)


# eval keys that define the shared reference run (prompts, lengths, dtype, device, sampling), not a method
SHARED_EVAL_KEYS = frozenset({"variants", "prompts", "prompt_field", "num_prompts", "prompt_offset", "max_new_tokens",
                              "max_prompt_tokens", "dtype", "device", "threads", "plan_threads", "warmup",
                              "output_dir", "fail_on_mismatch", "temperature", "allow_other_base", "turns", "repeats",
                              "prompts_per_category", "row_consistent", "prepack_weights"})


def variant_configs(cfg: DictConfig) -> list[tuple[str | None, DictConfig]]:
    """Expand ``eval.variants`` into one config per method variant.

    ``eval.variants`` is null (one method: the run's own ``eval`` section) or a list of mappings of
    ``eval.*`` overrides, e.g. ``[{checkpoint: runs/falcon/k2/best}, {checkpoint: runs/falcon/k1/best}]``
    or ``[{gamma: 0.7}, {gamma: 0.85}]``; an optional ``name`` key names the variant's report
    subdirectory (default: the overrides, e.g. ``gamma=0.7`` or ``k2-best`` for a checkpoint).
    All variants share one vanilla decoding of every prompt, so their speedups are measured against
    the same reference in the same run.

    Returns:
        ``[(name, cfg)]``: ``name`` is None when ``eval.variants`` is unset.

    Raises:
        ValueError: a variant is not a mapping, overrides an unknown ``eval`` key or one shared by
            the whole run (:data:`SHARED_EVAL_KEYS`: prompts, lengths, dtype, device, temperature...;
            the key and the variant index are named), two variants share a name, or a variant's
            merged ``eval`` section fails the checks a whole run's does (a value's type or range,
            :func:`evaluation.config_checks.check_decoding_overrides`); the message names
            ``eval.variants[i]``.
    """
    from omegaconf import OmegaConf, open_dict

    raw = cfg.eval.get("variants")
    if raw is None:
        return [(None, cfg)]
    if len(raw) == 0:  # config_checks refuses it first; a config built in code gets the same answer
        raise ValueError("eval.variants=[] lists no variant, so nothing would be evaluated; list at least one "
                         "(e.g. '[{gamma: 0.7}]') or leave eval.variants null for the run's own eval section")
    out: list[tuple[str | None, DictConfig]] = []
    for i, v in enumerate(to_container(raw) if not isinstance(raw, list) else raw):
        if not isinstance(v, dict) or not v:
            raise ValueError(f"eval.variants[{i}]={v!r}: expected a non-empty mapping of eval.* overrides")
        v = dict(v)
        name = v.pop("name", None)
        bad = sorted(k for k in v if k not in cfg.eval or k == "variants")
        if bad:
            raise ValueError(f"eval.variants[{i}]: unknown eval key(s) {', '.join(bad)}; valid: "
                             f"{', '.join(sorted(k for k in cfg.eval if k not in SHARED_EVAL_KEYS))}")
        shared = sorted(k for k in v if k in SHARED_EVAL_KEYS)
        if shared:
            raise ValueError(f"eval.variants[{i}]: {', '.join(shared)} cannot differ between variants (one vanilla "
                             f"pass serves them all); set eval.{shared[0]} for the whole run")
        if name is None:
            parts = []
            for k, val in v.items():
                if k == "checkpoint" and val not in REFERENCE_DRAFTERS:
                    parts.append(checkpoint_label(val))
                else:
                    parts.append(f"{k}={_name_value(val)}")
            name = ",".join(parts)
        name = _NAME_OK.sub("_", str(name)).strip("._") or f"variant{i}"
        if any(name == n for n, _ in out):
            raise ValueError(f"eval.variants[{i}]: duplicate variant name {name!r}; give each a distinct `name`")
        from core.config import ConfigError, check_override_type

        for k, val in v.items():
            try:
                check_override_type(f"eval.variants[{i}].{k}", cfg.eval.get(k), val)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        c = cfg.copy()
        with open_dict(c):
            c.eval.variants = None
            for k, val in v.items():
                OmegaConf.update(c, f"eval.{k}", val, merge=False)
        from core.config import validate
        from evaluation.config_checks import check_decoding_overrides

        try:  # the variant's eval section passes the same checks as a whole run's (ranges, per-head overrides)
            heads_cfg = to_container(c.heads) if "heads" in c else {}
            check_decoding_overrides({k: val for k, val in to_container(c.eval).items() if k in v},
                                     heads_cfg.get("type"), heads_cfg, where=f"eval.variants[{i}]")
            validate(c)
        except ConfigError as exc:
            msg = str(exc)
            raise ValueError(msg if msg.startswith(f"eval.variants[{i}]") else f"eval.variants[{i}]: {msg}") from None
        out.append((name, c))
    return out
