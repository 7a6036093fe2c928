"""Convert an existing cache to fp8 storage without running the base (issue 17).

``python -m data_prep.fp8_convert CACHE_IN CACHE_OUT`` writes ``CACHE_OUT``: the same conversations,
splits, shard boundaries, ids, ``input_ids`` / ``labels`` / ``loss_mask`` / ``offsets`` (bit-identical)
and label counts as ``CACHE_IN``, with every hidden-state tensor (``hidden``, ``aux_hidden.<l>``)
stored as ``prep.dtype=float8_e4m3fn`` with one float32 scale per token row
(:func:`data_prep.fp8.quantize_rows`; the reader returns bf16).  A user with a bf16 (or fp16 /
fp32) cache halves its disk this way in minutes instead of re-running data prep, and can compare
training and validation on both (``benchmarks/bench_fp8_tau.py``).

Format and guarantees (as ``python -m data_prep``, :mod:`data_prep.cache`):

* every shard is written atomically with its checksummed sidecar, each split's ``manifest.json``
  once all its shards exist, then ``label_counts.safetensors``, ``config.yaml`` (``prep.dtype``
  set to fp8) and ``summary.json``; the manifests record ``converted_from`` (source directory,
  source config hash and dtype).
* the config hash is the one ``python -m data_prep`` would give the source's settings with
  ``prep.dtype=float8_e4m3fn``, so ``train``/``evaluation`` treat the copy as that cache.  (Its
  values are the *bf16-rounded* states quantised, not the base's fp32 states: at most one bf16
  rounding, 2^-9 relative, on top of the fp8 step of 2^-4.)
* resumable: a re-run skips every shard whose sidecar checksum matches and rewrites torn ones;
  ``CACHE_OUT/fp8_conversion.json`` (written first) ties the directory to its source.
* finite values saturate into e4m3 and a non-finite one (NaN, ±inf) is refused, naming the shard,
  tensor, conversation and token (it would otherwise become a row of NaN or a clipped ±448);
  shards converted before it stay valid, and the conversion resumes once the source is fixed.
* before anything is written it refuses, with one line naming the file: a source that is not a
  complete cache (a split without ``manifest.json``, a missing shard, a checksum mismatch), a source
  already stored in fp8, a torch without ``float8_e4m3fn``, an output directory that is the source or
  lies inside it, and a non-empty output directory that is not a conversion of this source.

It prints, and stores in ``fp8_conversion.json``, the fp8 error against the source states per
tensor kind: max and mean ``|fp8 − src|`` over the row's max ``|src|``, and ``Σ|fp8 − src| / Σ|src|``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from core.config import UserInputError
from core.io import MANIFEST_FIX, atomic_write_json, read_json, sha256_file, sha256_json
from data_prep import cache as cache_mod
from data_prep.fp8 import FP8_NAME, dequantize_rows, fp8_dtype, quantize_rows

SPLITS = ("train", "val")
#: the marker that ties an output directory to its source (written before any shard)
MARKER = "fp8_conversion.json"
FORMAT = "draftheads-fp8-conversion-v1"


def _hidden_keys(keys: Sequence[str]) -> list[str]:
    """The hidden-state tensor names of a shard: ``hidden`` and ``aux_hidden.<l>``."""
    return [k for k in keys if k == "hidden" or k.startswith("aux_hidden.")]


def _check_source(src: Path) -> dict[str, dict[str, Any]]:
    """The manifests of ``src``'s splits, after checking the source is a complete, intact, non-fp8 cache.

    Raises:
        UserInputError: a split has no ``manifest.json``, an unknown format, a shard not named
            ``shard-<k>``, a missing shard or a shard whose sha256 differs from its manifest entry,
            or it is already fp8 (names the file).
    """
    if not src.is_dir():
        raise UserInputError(f"source cache {src} is not a directory")
    manifests = {}
    for split in SPLITS:
        mpath = src / split / cache_mod.MANIFEST
        if not mpath.is_file():
            raise UserInputError(f"{mpath} not found: {src} is not a complete cache (finish `python -m data_prep` first)")
        manifest = read_json(mpath, MANIFEST_FIX)
        if manifest.get("format") != cache_mod.FORMAT:
            raise UserInputError(f"{mpath}: format {manifest.get('format')!r} is not {cache_mod.FORMAT!r}")
        stored = (manifest.get("dtypes") or {}).get("hidden")
        if stored == FP8_NAME or "hidden_scale" in (manifest.get("dtypes") or {}):
            raise UserInputError(f"{mpath}: the cache is already stored in {FP8_NAME}; nothing to convert")
        for k, entry in enumerate(manifest["shards"]):
            if entry["file"] != f"{cache_mod.shard_name(k)}.safetensors":
                raise UserInputError(f"{mpath}: shard {k} is {entry['file']!r}, expected "
                                     f"{cache_mod.shard_name(k)}.safetensors")
            path = src / split / entry["file"]
            if not path.is_file():
                raise UserInputError(f"{path} listed in {mpath} is missing")
            if sha256_file(path) != entry["sha256"]:
                raise UserInputError(f"{path}: sha256 does not match {mpath}; the source cache is corrupt "
                                     "(re-run data prep on it first)")
        manifests[split] = manifest
    return manifests


def _target_config(src: Path, dst: Path, manifests: dict[str, dict]):
    """``(config, config_hash)`` of the fp8 copy: the source's ``config.yaml`` with
    ``prep.dtype=float8_e4m3fn`` and ``prep.cache_dir=dst`` (None without a config.yaml, and a hash
    derived from the source's)."""
    path = src / "config.yaml"
    if path.is_file():
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(path)
        if "prep" in cfg:
            cfg.prep.dtype = FP8_NAME
            cfg.prep.cache_dir = str(dst)
            return cfg, cache_mod.cache_hash(cfg)
    return None, sha256_json({"fp8_of": manifests["train"].get("config_hash"), "dtype": FP8_NAME})


def _prepare_output(src: Path, dst: Path, marker: dict[str, Any]) -> None:
    """Refuse an output that is the source, lies inside it, or holds something else; then write the marker.

    Raises:
        UserInputError: see the module docstring (names the directory or its marker file).
    """
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents or d in s.parents:
        raise UserInputError(f"output {dst} and source {src} overlap; choose an output directory outside the source")
    if d.exists() and not d.is_dir():
        raise UserInputError(f"output {dst} exists and is not a directory")
    if d.is_dir() and any(d.iterdir()):
        mpath = d / MARKER
        if not mpath.is_file():
            raise UserInputError(f"output {dst} is not empty and holds no {MARKER}: it is not an fp8 conversion; "
                                 "choose a new or empty directory")
        try:
            old = json.loads(mpath.read_text())
        except (OSError, json.JSONDecodeError):
            raise UserInputError(f"{mpath} is unreadable; choose a new or empty directory") from None
        keys = ("format", "source_manifests", "config_hash")
        if any(old.get(k) != marker[k] for k in keys):
            raise UserInputError(f"{mpath} records a conversion of another source ({old.get('source')!r}); "
                                 "choose a new or empty directory")
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_json(d / MARKER, marker)


class ErrorStats:
    """fp8-vs-source error sums of one tensor kind, mergeable over shards (stored in each shard's
    sidecar as ``fp8_error``, so a resumed conversion still reports every shard)."""

    FIELDS = ("max", "sum_over_rowmax", "values", "abs_err", "abs_src")

    def __init__(self, **sums: float) -> None:
        self.sums = {k: float(sums.get(k, 0.0)) for k in self.FIELDS}

    def add(self, src: torch.Tensor, back: torch.Tensor) -> "ErrorStats":
        """Add rows ``src`` [N, H] and their round trip ``back`` [N, H]."""
        x = src.float()
        e = (back.float() - x).abs()
        r = e / x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        s = self.sums
        if r.numel():
            s["max"] = max(s["max"], float(r.max()))
        s["sum_over_rowmax"] += float(r.double().sum())
        s["values"] += r.numel()
        s["abs_err"] += float(e.double().sum())
        s["abs_src"] += float(x.abs().double().sum())
        return self

    def merge(self, other: "ErrorStats") -> "ErrorStats":
        for k in self.FIELDS:
            self.sums[k] = max(self.sums[k], other.sums[k]) if k == "max" else self.sums[k] + other.sums[k]
        return self

    def summary(self) -> dict[str, float]:
        """``max_err_over_rowmax``, ``mean_err_over_rowmax`` (over all values), ``rel_err``
        (Σ|err| / Σ|x|) and ``values``."""
        s = self.sums
        return {"max_err_over_rowmax": s["max"], "mean_err_over_rowmax": s["sum_over_rowmax"] / max(s["values"], 1),
                "rel_err": s["abs_err"] / s["abs_src"] if s["abs_src"] else 0.0, "values": int(s["values"])}


def convert_shard(src_path: Path) -> tuple[dict[str, torch.Tensor], list[str], dict[str, ErrorStats]]:
    """The fp8 tensors of one source shard and its conversation ids.

    Hidden-state tensors [N, H] become ``float8_e4m3fn`` plus ``<name with hidden_scale>`` float32 [N]
    (:func:`data_prep.fp8.quantize_rows`: finite values saturate); every other tensor is copied unchanged.

    Raises:
        UserInputError: a hidden-state value is NaN / ±inf (names the tensor, conversation id and token).

    Returns:
        ``(tensors, ids, errors)``: ``errors`` by kind (``hidden``, ``aux_hidden``), the error of the
        dequantised values (what the reader returns) against the source values.
    """
    from safetensors import safe_open

    from core.finite import describe, first_non_finite

    out: dict[str, torch.Tensor] = {}
    stats: dict[str, ErrorStats] = {}
    with safe_open(str(src_path), framework="pt") as f:
        ids = json.loads(f.metadata()["ids"])
        offsets = f.get_tensor("offsets") if "offsets" in f.keys() else None
        for key in f.keys():
            t = f.get_tensor(key)
            if key in _hidden_keys([key]):
                found = first_non_finite(t)
                if found is not None:  # refused before this shard is written (earlier shards stay valid)
                    (row, col), value, count = found
                    r = int(torch.searchsorted(offsets, row, right=True)) - 1 if offsets is not None else -1
                    conv = f"conversation {ids[r]!r}, token {row - int(offsets[r])}" if 0 <= r < len(ids) else f"row {row}"
                    raise UserInputError(
                        f"{src_path}: tensor {key!r} holds {count} non-finite value(s) (first {describe(value)} in "
                        f"{conv}, column {col}); fp8 has no value for NaN/inf and the conversion never clips or "
                        "invents one: re-run data prep on the source (it drops and counts such conversations)")
                q, scale = quantize_rows(t, where=f"{src_path}:{key}")
                out[key], out[key.replace("hidden", "hidden_scale", 1)] = q, scale
                kind = "hidden" if key == "hidden" else "aux_hidden"
                stats.setdefault(kind, ErrorStats()).add(t, dequantize_rows(q, scale))
            else:
                out[key] = t
    return out, ids, stats


def convert_cache(src: str | Path, dst: str | Path, out=sys.stdout) -> dict[str, Any]:
    """Write (or resume) the fp8 copy ``dst`` of the cache ``src``; return its summary.

    Args:
        src: a complete cache directory with ``train/`` and ``val/`` (bf16, fp16 or fp32 states).
        dst: the output directory (new, empty, or a conversion of ``src`` to resume).
        out: where the summary is printed (None = silent).

    Returns:
        ``{"cache_dir", "source", "splits": {split: {"shards", "converted", "bytes", "tokens",
        "source_bytes"}}, "bytes_per_token", "source_bytes_per_token", "errors": {kind: {...}}}``;
        ``errors`` ({``hidden``, ``aux_hidden``}: :meth:`ErrorStats.summary`) covers every shard of
        ``dst``, also those converted by an earlier, interrupted call.

    Raises:
        UserInputError: see the module docstring; raised before anything is written.
    """
    from data_prep import label_counts

    src, dst = Path(src), Path(dst)
    fp8_dtype()  # a torch without float8_e4m3fn: one line, nothing written
    manifests = _check_source(src)
    cfg, chash = _target_config(src, dst, manifests)
    marker = {"format": FORMAT, "source": str(src.resolve()), "config_hash": chash, "dtype": FP8_NAME,
              "source_manifests": {s: sha256_file(src / s / cache_mod.MANIFEST) for s in SPLITS}}
    _prepare_output(src, dst, marker)
    stats: dict[str, ErrorStats] = {}
    splits: dict[str, dict[str, Any]] = {}
    for split in SPLITS:
        manifest = manifests[split]
        sdir, ddir = src / split, dst / split
        ddir.mkdir(parents=True, exist_ok=True)
        converted = 0
        for k, entry in enumerate(manifest["shards"]):
            if cache_mod.finished_entry(ddir, k, chash) is not None:
                continue
            tensors, ids, errs = convert_shard(sdir / entry["file"])
            extra = {k2: v for k2, v in entry.items()
                     if k2 not in ("file", "records", "tokens", "assistant_tokens", "bytes", "sha256")}
            cache_mod.write_shard(ddir, k, tensors, ids, {
                **extra, "config_hash": chash, "source_sha256": entry["sha256"],
                "fp8_error": {kind: e.sums for kind, e in sorted(errs.items())}})
            converted += 1
        shard_keys = {"file", "records", "tokens", "assistant_tokens", "bytes", "sha256", "dropped", "shards",
                      "num_shards", "num_records", "num_tokens", "num_assistant_tokens", "format"}
        header = {k: v for k, v in manifest.items() if k not in shard_keys}
        dtypes = dict(header.get("dtypes") or {})
        source_dtype = dtypes.get("hidden")
        dtypes.update({"hidden": FP8_NAME, "aux_hidden": FP8_NAME, "hidden_scale": "float32"})
        header.update({"dtypes": dtypes, "config_hash": chash,
                       "converted_from": {"cache": str(src.resolve()), "config_hash": manifest.get("config_hash"),
                                          "dtype": source_dtype}})
        new = cache_mod.write_manifest(ddir, len(manifest["shards"]), header)
        for e in new["shards"]:
            for kind, sums in e.get("fp8_error", {}).items():
                stats.setdefault(kind, ErrorStats()).merge(ErrorStats(**sums))
        label_counts.write_split_counts(ddir)  # labels are copied bit for bit: the source's counts
        splits[split] = {"shards": new["num_shards"], "converted": converted, "bytes": new["bytes"],
                         "tokens": new["num_tokens"], "source_bytes": manifest["bytes"]}
    errors = {kind: e.summary() for kind, e in sorted(stats.items())}
    atomic_write_json(dst / MARKER, {**marker, "errors": errors})
    if cfg is not None:
        from core.config import save_config

        save_config(cfg, dst)
    tokens = sum(s["tokens"] for s in splits.values())
    summary = {"cache_dir": str(dst), "source": str(src), "splits": splits,
               "bytes_per_token": sum(s["bytes"] for s in splits.values()) / max(tokens, 1),
               "source_bytes_per_token": sum(s["source_bytes"] for s in splits.values()) / max(tokens, 1),
               "errors": errors}
    src_summary = src / "summary.json"
    if src_summary.is_file():
        old = json.loads(src_summary.read_text())
        per = old.get("splits", {})
        for split, s in splits.items():
            if split in per:
                per[split]["bytes"] = s["bytes"]
        old.update({"bytes": sum(s["bytes"] for s in splits.values()), "bytes_per_token": summary["bytes_per_token"],
                    "splits": per})
        atomic_write_json(dst / "summary.json", old)
    if out is not None:
        print(format_summary(summary), file=out)
    return summary


def format_summary(s: dict[str, Any]) -> str:
    """The lines ``python -m data_prep.fp8_convert`` prints."""
    lines = [f"fp8 cache: {s['cache_dir']} (from {s['source']})"]
    for split, v in s["splits"].items():
        lines.append(f"  {split}: {v['shards']} shards ({v['converted']} converted now), {v['tokens']:,} tokens, "
                     f"{v['bytes']:,} bytes (source {v['source_bytes']:,})")
    lines.append(f"bytes per token: {s['bytes_per_token']:.1f} (source {s['source_bytes_per_token']:.1f}, "
                 f"{s['bytes_per_token'] / max(s['source_bytes_per_token'], 1e-9):.2f}x)")
    for kind, e in sorted(s["errors"].items()):
        lines.append(f"fp8 vs source {kind}: max |err|/row max {e['max_err_over_rowmax']:.3g}, "
                     f"mean |err|/row max {e['mean_err_over_rowmax']:.3g}, Σ|err|/Σ|x| {e['rel_err']:.3g}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m data_prep.fp8_convert CACHE_IN CACHE_OUT``: exit 0, or 2 with one ``error:`` line."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m data_prep.fp8_convert", description=__doc__.split("\n")[0])
    p.add_argument("cache_in", help="a complete cache directory (with train/ and val/)")
    p.add_argument("cache_out", help="the fp8 copy to write (new, empty, or an earlier conversion to resume)")
    args = p.parse_args(argv)
    try:
        convert_cache(args.cache_in, args.cache_out, out=sys.stdout)
    except UserInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
