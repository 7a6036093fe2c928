"""Registry of draft-head classes, and the checkpoint format.

A head module registers its class with ``@register``.  Every module of the ``heads`` package
except :data:`NON_HEAD_MODULES` is imported on first use (:func:`head_modules`), so adding a head
is one file under ``heads/`` (plus its loss under ``losses/``, its drafter under ``decoding/``
and ``configs/heads/<name>.yaml``) with nothing to register by hand.
"""
from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any


from core.io import atomic_save_safetensors, atomic_write_json

#: modules of the ``heads`` package that define no head (never imported by the registry scan)
NON_HEAD_MODULES = ("base", "registry", "export", "export_engines")
HEADS: dict[str, type] = {}
FORMAT_VERSION = 1


def register(cls):
    """Class decorator: register a :class:`heads.base.DraftHead` subclass under ``cls.head_type``."""
    if not cls.head_type:
        raise ValueError(f"{cls.__name__} has no head_type")
    HEADS[cls.head_type] = cls
    return cls


def head_modules() -> list[str]:
    """Dotted names of the head modules: every ``heads.<name>`` module not in :data:`NON_HEAD_MODULES`
    and not starting with ``_``, sorted."""
    import pkgutil

    return sorted(f"heads.{m.name}" for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                  if not m.name.startswith("_") and m.name not in NON_HEAD_MODULES)


def _import_heads() -> None:
    for mod in head_modules():
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise


def head_class(head_type: str):
    """The registered class for ``head_type``; raises ``KeyError`` listing the valid types."""
    _import_heads()
    if head_type not in HEADS:
        raise KeyError(f"unknown head type {head_type!r}; registered: {', '.join(sorted(HEADS))}")
    return HEADS[head_type]


def build(head_cfg: Any, base_model, label_counts=None, counts_source: str | None = None):
    """Build the head described by ``head_cfg`` (a ``heads`` section with a ``type`` key).

    The head's trainable weights are initialised (seeded by the caller), and the base model's
    frozen embedding / final norm / LM head are attached as non-persistent buffers.

    With ``heads.draft_vocab_size`` = N the draft vocabulary is the top N of ``label_counts``
    (int64 [V], the training split's counts, :mod:`data_prep.label_counts`); its coverage of those
    labels and ``counts_source`` (the cache) are recorded in ``cfg["draft_vocab"]``.

    Raises:
        ValueError: ``draft_vocab_size`` < 2 or > V, or N is set and ``label_counts`` is None or
            not of length V.
    """
    from omegaconf import DictConfig, OmegaConf

    cfg = OmegaConf.to_container(head_cfg, resolve=True) if isinstance(head_cfg, DictConfig) else dict(head_cfg)
    head = head_class(cfg["type"])(cfg, base_model.config)
    if head.draft_vocab_size is not None:
        from heads.draft_vocab import DraftVocab, coverage

        if label_counts is None:
            raise ValueError(f"heads.draft_vocab_size={head.draft_vocab_size} needs the cache's label counts "
                             "(data_prep.label_counts); none were given")
        if int(label_counts.numel()) != head.vocab_size:
            raise ValueError(f"label counts have {label_counts.numel()} entries, the base vocabulary has {head.vocab_size}")
        vocab = DraftVocab.from_counts(label_counts, head.draft_vocab_size)
        head.set_draft_vocab(vocab, {"size": vocab.size, "train_coverage": coverage(label_counts, vocab.d2t),
                                     "train_labels": int(label_counts.sum()), "cache": counts_source})
    head.attach_base(base_model)
    return head


def save(head, directory: str | os.PathLike, base_identity: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
    """Write ``model.safetensors`` (head weights only, fp32) and ``config.json`` atomically.

    ``config.json`` holds ``head_type``, the full head config, ``base`` (identity incl. vocab
    size) and ``base_config`` (the base model's HF config dict, so the head can be rebuilt
    without loading the base).  ``extra`` (e.g. training step, metrics) is stored as-is.

    Raises:
        core.finite.NonFiniteError: a weight holds NaN or ±inf (names the tensor; nothing is written).
    """
    from core.finite import check_finite

    directory = Path(directory)
    tensors = {k: v.detach().float().contiguous() if v.is_floating_point() else v for k, v in head.trainable_state_dict().items()}
    check_finite(tensors, f"heads.save into {directory}")
    directory.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(tensors, directory / "model.safetensors", metadata={"format": "draftheads", "head_type": head.head_type})
    atomic_write_json(
        directory / "config.json",
        {
            "format_version": FORMAT_VERSION,
            "head_type": head.head_type,
            "head": head.cfg,
            "base": base_identity,
            "base_config": head.base_config.to_dict(),
            "extra": extra or {},
        },
    )
    return directory


def check_head_type(directory: str | os.PathLike, held: str, want: str | None) -> None:
    """Refuse a checkpoint holding a ``held`` head where a ``want`` head (``heads.type``) was asked for.

    Raises:
        ValueError: naming the checkpoint, both types and the ``heads=`` to run with.
    """
    if want is not None and held != want:
        raise ValueError(f"checkpoint {directory} holds a {held!r} head but heads.type={want!r}; run with heads={held}")


def check_checkpoint_dir(directory: str | os.PathLike, head_type: str | None = None) -> Path:
    """``directory`` as a Path once it is a head checkpoint folder (``config.json`` and
    ``model.safetensors``, as :func:`save` writes them) holding a ``head_type`` head (None: any).

    Raises:
        FileNotFoundError: it does not exist; it is a training run's folder (names its ``best/`` and
            ``last/``); or a file is missing (named).
        ValueError: its ``config.json`` is not a head config, its ``model.safetensors`` header is unreadable,
            it records another head type (:func:`check_head_type`), or its tensors are not the ones
            ``config.json``'s head has (:func:`check_weight_shapes`).
    """
    directory = Path(directory)
    if not directory.exists():
        from core.io import interrupted_swap

        left = interrupted_swap(directory)
        raise FileNotFoundError(f"checkpoint {directory}: no such directory" + (
            f" ({left} holds its previous contents, whole: a replacement was stopped between its two renames; "
            f"rename it back to {directory.name})" if left else ""))
    if directory.is_file():
        raise FileNotFoundError(f"checkpoint {directory} is a file: pass the folder that holds it ({directory.parent})")
    if not (directory / "model.safetensors").is_file():
        inside = [d for d in ("best", "last") if (directory / d / "model.safetensors").is_file()]
        if inside:
            raise FileNotFoundError(f"checkpoint {directory} is a training run's folder: pass "
                                    + " or ".join(f"{directory / d}" for d in inside)
                                    + " (best/ is chosen by validation τ)")
    for name in ("model.safetensors", "config.json"):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"checkpoint {directory} has no {name}")
    try:
        meta = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        held = meta["head_type"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"checkpoint {directory}: config.json is not a head config ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    from safetensors import SafetensorError, safe_open

    try:  # the header only: a torn or foreign file is named here, not as a library traceback at load
        with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"checkpoint {directory}: model.safetensors is not a readable safetensors file "
                         f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    check_head_type(directory, str(held), head_type)
    check_weight_shapes(directory, meta, shapes)
    return directory


def check_weight_shapes(directory: str | os.PathLike, meta: dict[str, Any], shapes: dict[str, tuple]) -> None:
    """Refuse a checkpoint whose ``model.safetensors`` is not the one its ``config.json`` describes.

    The head ``config.json`` records (``head``, ``base_config``) is built on the meta device (no memory, no
    base) and its tensor names and shapes are compared with ``shapes`` (the safetensors header): a
    ``model.safetensors`` copied in from another run (another ``draft_vocab_size``, layer count, fuse) was a
    ``size mismatch`` traceback at load, and :mod:`heads.export` wrote an engine config whose
    ``draft_vocab_size`` disagreed with its ``lm_head``.  A ``config.json`` without ``head`` /
    ``base_config`` is left to the reader, which names the missing key.

    Raises:
        ValueError: names the checkpoint and each differing tensor with both shapes (or the tensors on one
            side only), or the head ``config.json`` describes cannot be built.
    """
    if not isinstance(meta.get("head"), dict) or not isinstance(meta.get("base_config"), dict):
        return
    import torch
    from transformers import AutoConfig

    try:
        bc = meta["base_config"]
        base_config = AutoConfig.for_model(**{k: v for k, v in bc.items() if k != "model_type"},
                                           model_type=bc["model_type"])
        with torch.device("meta"):
            want = {k: tuple(v.shape) for k, v in head_class(meta["head_type"])(meta["head"], base_config)
                    .trainable_state_dict().items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint {directory}: config.json describes no head that can be built "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    differ = [f"{k} {list(shapes[k])} (config.json's head has {list(want[k])})"
              for k in sorted(set(want) & set(shapes)) if shapes[k] != want[k]]
    missing, unexpected = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want))
    if differ or missing or unexpected:
        parts = ([f"shapes differ: {'; '.join(differ[:4])}{' ...' if len(differ) > 4 else ''}"] if differ else []) \
            + ([f"missing {missing[:4]}"] if missing else []) + ([f"unexpected {unexpected[:4]}"] if unexpected else [])
        raise ValueError(f"checkpoint {directory}: model.safetensors does not hold the {meta['head_type']} head its "
                         f"config.json describes ({', '.join(parts)}); the two files come from different heads - "
                         "copy both from one checkpoint folder")


def load(directory: str | os.PathLike, base_model=None, model_cfg: Any | None = None):
    """Rebuild a head from a checkpoint directory alone (no pickle).

    Args:
        directory: holds ``model.safetensors`` and ``config.json``.
        base_model: the frozen base model to borrow embedding / norm / LM head from.  If None,
            the base is loaded from ``model_cfg`` or, failing that, from the source recorded in
            ``config.json``.

    Returns:
        ``(head, meta)`` with ``meta`` the parsed ``config.json``.

    Raises:
        FileNotFoundError: a file is missing.  ValueError: the checkpoint's vocab size does not
        match the base model's, or its ``d2t`` / ``t2d`` are invalid (duplicates, ids out of range,
        wrong length; :func:`heads.draft_vocab.validate_d2t`).
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig

    directory = check_checkpoint_dir(directory)
    meta = json.loads((directory / "config.json").read_text())
    if base_model is None:
        from core.base_model import load_base_model

        source = model_cfg if model_cfg is not None else {"path": meta["base"]["source"], "dtype": "float32"}
        base_model, _, _ = load_base_model(source)
    if int(base_model.config.vocab_size) != int(meta["base"]["vocab_size"]):
        raise ValueError(
            f"checkpoint {directory} was trained for vocab {meta['base']['vocab_size']}, "
            f"base model has {base_model.config.vocab_size}"
        )
    cls = head_class(meta["head_type"])
    base_config = AutoConfig.for_model(**{k: v for k, v in meta["base_config"].items() if k != "model_type"},
                                       model_type=meta["base_config"]["model_type"])
    head = cls(meta["head"], base_config)
    state = load_file(directory / "model.safetensors")
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {directory}: missing keys {missing}, unexpected keys {unexpected}")
    head.check_draft_vocab(where=f"checkpoint {directory / 'model.safetensors'}")
    head.attach_base(base_model)
    return head, meta
