"""A trained head packed for distribution: ``python -m heads.ship CKPT OUT [--dtype bfloat16] [--run RUN_DIR]``.

Copies a checkpoint directory (``model.safetensors`` + ``config.json``, :func:`heads.registry.save`)
to ``OUT`` with every floating-point weight cast to ``--dtype`` (default bfloat16: half the bytes of
the fp32 checkpoint); integer tensors (the draft vocabulary ``d2t``) are copied unchanged.
``config.json`` gains ``extra.stored_dtype`` and ``extra.shipped_from`` (the source directory and
the SHA-256 of its ``model.safetensors``).  With ``--run``, the run's training record
(``record.json``: tokens seen, every validation's τ; ``val_curve.png``) and its resolved
``config.yaml`` (with the labels and features the checkpoint records it trained on,
:func:`trained_config_yaml`) are copied next to the weights; with ``--cache``, the cache's identity (each split's
manifest SHA-256, conversations, tokens) goes into ``config.json``: the head documents its own training.

The result loads like any checkpoint (``checkpoint=OUT``; :func:`heads.registry.load` casts the
weights into the head's fp32 parameters).  Verification always runs the full base, so a head
stored in bf16 stays lossless; only its drafts (hence τ) can move, by the bf16 rounding of its
weights.  Writes are atomic; nothing is written when a check fails.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from core.finite import check_finite
from core.io import (atomic_save_safetensors, atomic_write_bytes, atomic_write_json, make_tmp_dir, manifest_identity,
                     replace_dir, sha256_file)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
RUN_FILES = ("record.json", "val_curve.png", "config.yaml")


def cache_identity(cache_dir: str | Path) -> dict:
    """The identity of the cache a head trained on: per split, the SHA-256 of ``manifest.json`` (what
    resume checks, :func:`train.resume.data_identity`) with its conversation and token counts.

    Raises:
        FileNotFoundError: ``cache_dir/<split>/manifest.json`` is missing for both splits.
    """
    out: dict = {"cache_dir": str(Path(cache_dir).resolve()), "splits": {}}
    for split in ("train", "val"):
        ident = manifest_identity(Path(cache_dir) / split)
        if ident is not None:
            out["splits"][split] = {"manifest_sha256": ident["sha256"], "config_hash": ident["config_hash"],
                                    "records": ident["records"], "tokens": ident["tokens"]}
    if not out["splits"]:
        raise FileNotFoundError(f"--cache {cache_dir}: no train/ or val/ manifest.json")
    return out


def trained_config_yaml(config_yaml: str, features: dict | None) -> str:
    """The run's ``config.yaml`` with what an offline head trained on: ``labels``, ``prep.layers`` and
    ``prep.dtype`` from the checkpoint's ``extra.features`` (:func:`core.config.feature_config_values`).
    Runs recorded before the run recorded its cache's values carry data prep's defaults there; the
    shipped file says what the weights were trained on.  Unchanged for online features or no record."""
    from omegaconf import OmegaConf

    from core.precision import with_values
    from core.config import feature_config_values

    if not features or features.get("source", "offline") != "offline":
        return config_yaml
    cfg = OmegaConf.create(config_yaml)
    return OmegaConf.to_yaml(with_values(cfg, feature_config_values(features)))


def ship(checkpoint: str | Path, out: str | Path, dtype: str = "bfloat16", run_dir: str | Path | None = None,
         cache_dir: str | Path | None = None) -> Path:
    """Write ``out`` = ``checkpoint`` with floating weights in ``dtype`` (module docstring).

    Args:
        checkpoint: a head directory with ``model.safetensors`` and ``config.json``.
        out: the destination directory (created; replaced whole and atomically, :func:`core.io.replace_dir`).
        dtype: ``bfloat16`` | ``float16`` | ``float32``.
        run_dir: optional run directory whose ``record.json``, ``val_curve.png`` and ``config.yaml``
            are copied along (those present).
        cache_dir: optional cache the head trained on: its identity (:func:`cache_identity`) goes
            into ``config.json`` as ``extra.cache``.

    Returns:
        ``out`` as a Path.

    Raises:
        FileNotFoundError: a checkpoint file or ``run_dir`` is missing.  ValueError: unknown dtype,
        ``checkpoint`` is no head checkpoint, ``out`` is ``checkpoint`` itself, cannot be written or holds
        other files than a shipped head's (:func:`check_destination`), or ``run_dir`` is another run's
        (:func:`check_run_of`).  core.finite.NonFiniteError: a weight is NaN/±inf
        before or after the cast (fp16 overflow; the tensor is named).
    """
    from safetensors import safe_open

    from core.io import output_dir_problem
    from heads.registry import check_checkpoint_dir

    src, out = Path(checkpoint), Path(out)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    check_checkpoint_dir(src)  # an engine export or another folder is no head checkpoint (named)
    if out.resolve() == src.resolve():
        raise ValueError(f"{out}: the destination is the checkpoint itself")
    if (problem := output_dir_problem(out)) is not None:
        raise ValueError(f"output {out} cannot be written: {problem}")
    check_destination(out)
    src_sha256 = sha256_file(src / "model.safetensors")
    if run_dir is not None:
        check_run_of(src, Path(run_dir), src_sha256)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        metadata = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    check_finite(tensors, f"checkpoint {src / 'model.safetensors'}")
    cast = {k: v.to(DTYPES[dtype]).contiguous() if v.is_floating_point() else v for k, v in tensors.items()}
    check_finite(cast, f"{src / 'model.safetensors'} cast to {dtype}")
    meta = json.loads((src / "config.json").read_text())
    meta.setdefault("extra", {})
    meta["extra"]["stored_dtype"] = dtype
    if cache_dir is not None:
        meta["extra"]["cache"] = cache_identity(cache_dir)
    meta["extra"]["shipped_from"] = {"checkpoint": str(src.resolve()), "sha256": src_sha256}
    # every file into a fresh sibling folder, then swapped in whole: a crash never leaves one head's weights
    # beside another's config.json (an earlier ship's training record is not this head's either)
    tmp = make_tmp_dir(prefix=f".{out.name}.", parent=out.parent)
    try:
        atomic_save_safetensors(cast, tmp / "model.safetensors", metadata={**metadata, "stored_dtype": dtype})
        atomic_write_json(tmp / "config.json", meta)
        for name in RUN_FILES if run_dir is not None else ():
            path = Path(run_dir) / name
            if path.is_file():
                data = path.read_bytes()
                if name == "config.yaml":
                    data = trained_config_yaml(data.decode("utf-8"), meta["extra"].get("features")).encode("utf-8")
                atomic_write_bytes(tmp / name, data)
        replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def check_destination(out: Path) -> None:
    """``out`` is new, empty, or an earlier ship (its ``config.json`` records ``extra.shipped_from``) holding
    only the files a ship writes, which are then replaced: a folder with anything else (an engine export's
    ``hot_token_ids.json``, another run's files) would end up mixing two heads' files.

    Raises:
        ValueError: naming the folder and what it holds.
    """
    if not out.is_dir() or not any(out.iterdir()):
        return
    names = sorted(p.name for p in out.iterdir())
    foreign = [n for n in names if n not in ("model.safetensors", "config.json", *RUN_FILES)]
    try:
        shipped = "shipped_from" in (json.loads((out / "config.json").read_text(encoding="utf-8")).get("extra") or {})
    except (OSError, ValueError, AttributeError):
        shipped = False
    if foreign or not shipped:
        raise ValueError(f"output {out} holds {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}, not a shipped "
                         "head: ship into a new or empty folder (a shipped head's folder is replaced)")


def check_run_of(src: Path, run_dir: Path, src_sha256: str) -> None:
    """``run_dir`` is the training run ``src`` comes from: ``src`` is its ``best/`` or ``last/``, or has the same
    weights (``src_sha256``, of its ``model.safetensors``) as one of them (a copy).  Another run's record would
    document the wrong training.

    Raises:
        FileNotFoundError: ``run_dir`` is not a directory.  ValueError: it is another run's.
    """
    if not run_dir.is_dir():
        raise FileNotFoundError(f"--run {run_dir}: not a directory")
    exports = [run_dir / d for d in ("best", "last") if (run_dir / d / "model.safetensors").is_file()]
    if src.resolve() in [e.resolve() for e in exports]:
        return
    if not any(sha256_file(e / "model.safetensors") == src_sha256 for e in exports):
        raise ValueError(f"--run {run_dir}: neither its best/ nor its last/ is the checkpoint {src} (other weights): "
                         "pass the run the checkpoint was trained in")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m heads.ship", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a head directory (best/ or last/ of a run)")
    p.add_argument("out", help="destination directory")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--run", default=None, help="the run directory: copy its record.json, val_curve.png, config.yaml")
    p.add_argument("--cache", default=None, help="the cache the head trained on: record its identity")
    a = p.parse_args(argv)
    try:
        out = ship(a.checkpoint, a.out, a.dtype, a.run, a.cache)
    except (OSError, ValueError) as exc:  # NonFiniteError is a ValueError; a full disk or a denied write is an OSError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    size = (out / "model.safetensors").stat().st_size
    print(f"shipped {a.checkpoint} -> {out} ({a.dtype}, {size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
