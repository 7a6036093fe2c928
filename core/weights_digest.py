"""Content identity of a base model's weights: one SHA-256 over its tensors, whatever the source.

:func:`weights_sha256` of a Hugging Face folder is computed from the stored tensors, not from the
files' bytes, so it depends on the weights only:

* every tensor of every ``*.safetensors`` file in the folder, in name order, contributes
  ``name``, its stored dtype, its shape and the SHA-256 of its raw bytes; the folder's digest is
  the SHA-256 of those lines.  The split into shards (``model-0000k-of-0000n``), the header
  layout and the file metadata do not enter, so a re-sharded copy has the same identity, and any
  changed weight (same shape, other values) gives another one.
* a folder without safetensors files (``pytorch_model*.bin``, ``*.pt``): the SHA-256 of each weight
  file's bytes, in name order (those files are never unpickled here).

A GGUF base (the packaged SmolLM2 included) is identified by the folder it converts to
(``core.base_model.convert_gguf``), so loading the GGUF and loading that folder give the same
digest.  Per-file results of weight files of at least :data:`CACHE_MIN_BYTES` are cached under
``<cache_dir>/weight_digests/`` keyed by the file's path, size, mtime and inode: a 135M fp32 base
(540 MB) is hashed once, then read from the cache in milliseconds.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from core.io import atomic_write_json, sha256_file

FORMAT = "draftheads-weights-v1"
#: weight files at least this large get their digest cached (smaller ones hash faster than a lookup is worth)
CACHE_MIN_BYTES = 64 << 20
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def _file_key(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path.resolve()), "bytes": int(st.st_size), "mtime_ns": int(st.st_mtime_ns),
            "inode": int(st.st_ino)}


def _cache_file(cache_dir: Path, path: Path) -> Path:
    return cache_dir / "weight_digests" / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]}.json"


def _safetensors_lines(path: Path) -> dict[str, str]:
    """``{tensor name: "name dtype shape sha256"}`` for every tensor of one safetensors file."""
    import torch
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
            digest = hashlib.sha256(memoryview(raw) if len(raw) else b"").hexdigest()
            out[name] = f"{name} {str(t.dtype).removeprefix('torch.')} {list(t.shape)} {digest}"
    return out


def _file_lines(path: Path, cache_dir: Path | None) -> dict[str, str]:
    """The digest lines of one weight file, from the per-file cache when its key still matches."""
    key = _file_key(path)
    cached = _cache_file(cache_dir, path) if cache_dir is not None and key["bytes"] >= CACHE_MIN_BYTES else None
    if cached is not None and cached.is_file():
        try:
            entry = json.loads(cached.read_text())
            if entry.get("format") == FORMAT and entry.get("key") == key:
                return dict(entry["lines"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if path.suffix == ".safetensors":
        lines = _safetensors_lines(path)
    else:  # pickled weights: their bytes, never loaded here
        lines = {path.name: f"file {path.name} {sha256_file(path)}"}
    if cached is not None and _file_key(path) == key:
        try:
            atomic_write_json(cached, {"format": FORMAT, "key": key, "lines": lines})
        except OSError:  # a read-only cache only costs the next load a re-hash
            pass
    return lines


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The weight files of an HF folder: its ``*.safetensors`` files, else its pickled weight files
    (``*.bin`` / ``*.pt`` / ``*.pth``), sorted by name; empty when it has neither."""
    folder = Path(folder)
    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    if not files:
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in PICKLE_SUFFIXES)
    return files


def weights_sha256(folder: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str | None:
    """Hex SHA-256 identifying the weights stored in the HF folder ``folder`` (module docstring).

    Args:
        folder: a local Hugging Face model folder (or a hub snapshot folder).
        cache_dir: where per-file digests of large files are cached (``<cache_dir>/weight_digests``);
            None = no cache.

    Returns:
        The digest, or None when the folder holds no weight file this function knows.
    """
    files = weight_files(folder)
    if not files:
        return None
    cache = Path(cache_dir) if cache_dir is not None else None
    lines: dict[str, str] = {}
    for path in files:
        for name, line in _file_lines(path, cache).items():
            lines[f"{name}\0{path.name}" if name in lines else name] = line
    h = hashlib.sha256(f"{FORMAT}\n".encode())
    for name in sorted(lines):
        h.update((lines[name] + "\n").encode())
    return h.hexdigest()
