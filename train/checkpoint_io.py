"""Lightning resume checkpoints without pickle: one safetensors file, tensors + a JSON tree.

Lightning's default ``.ckpt`` is a ``torch.save`` pickle; loading one runs arbitrary code.
:class:`SafetensorsCheckpointIO` stores the same checkpoint dict (module state, optimizer
states, LR-scheduler states, loop state, callback state, RNG states) as a single safetensors
file: every tensor (and numpy array) goes into the tensor table under ``t<k>``; the rest of the
structure is JSON in the safetensors metadata (key ``draftheads.state``), with markers for what
JSON cannot express (tuples, dicts with non-string keys, tensors, numpy arrays and scalars,
torch dtypes and sizes, non-finite floats).  The file is written to a temporary name in the
destination directory and renamed into place (``core.io.atomic_write_bytes``), so a killed run
never leaves a half-written ``last.ckpt``.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.apply_func import move_data_to_device

from core.io import DamagedFile, atomic_write_bytes

STATE_KEY = "draftheads.state"
DIGEST_KEY = "draftheads.sha256"  # content_digest of the state and tensors, checked at load
FORMAT = "draftheads-lightning-ckpt-v1"


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def _tensor(self, t: torch.Tensor) -> str:
        key = f"t{len(self.tensors)}"
        self.tensors[key] = t.detach().cpu().contiguous()
        return key

    def encode(self, obj: Any, where: str) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"__float__": repr(obj)}
        if isinstance(obj, torch.Tensor):
            if obj.is_sparse or obj.is_quantized:
                raise TypeError(f"checkpoint entry {where}: sparse/quantized tensors are not supported")
            return {"__tensor__": self._tensor(obj)}
        if isinstance(obj, np.ndarray):
            if obj.dtype == object:
                raise TypeError(f"checkpoint entry {where}: object arrays are not supported")
            return {"__ndarray__": self._tensor(torch.from_numpy(np.ascontiguousarray(obj).astype(_np_storage(obj.dtype)))),
                    "dtype": obj.dtype.str}
        if isinstance(obj, np.generic):
            return {"__npscalar__": obj.item(), "dtype": obj.dtype.str}
        if isinstance(obj, torch.dtype):
            return {"__dtype__": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.Size):
            return {"__size__": list(obj)}
        if isinstance(obj, tuple):
            return {"__tuple__": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            if all(isinstance(k, str) for k in obj) and not any(k.startswith("__") and k.endswith("__") for k in obj):
                return {k: self.encode(v, f"{where}.{k}") for k, v in obj.items()}
            return {"__items__": [[self.encode(k, f"{where}<key>"), self.encode(v, f"{where}[{k!r}]")]
                                  for k, v in obj.items()]}
        raise TypeError(f"checkpoint entry {where}: cannot store a {type(obj).__name__} without pickle")


def _np_storage(dtype: np.dtype) -> np.dtype:
    """numpy dtype used to carry an array through torch/safetensors (unsigned 32/64 -> int64)."""
    if dtype in (np.uint32, np.uint64, np.uint16):
        return np.dtype(np.int64)
    return dtype


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return tensors[obj["__ndarray__"]].numpy().astype(np.dtype(obj["dtype"]))
    if "__npscalar__" in obj:
        return np.dtype(obj["dtype"]).type(obj["__npscalar__"])
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__dtype__" in obj:
        return getattr(torch, obj["__dtype__"])
    if "__size__" in obj:
        return torch.Size(obj["__size__"])
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def dumps(checkpoint: dict[str, Any]) -> bytes:
    """Serialise a checkpoint dict to safetensors bytes (tensors + JSON tree in the metadata).

    Raises:
        TypeError: an entry has a type that cannot be stored without pickle (the message names it).
    """
    from core.io import safetensors_bytes

    enc = _Encoder()
    tree = enc.encode(checkpoint, "checkpoint")
    # safetensors refuses tensors that share storage; clone the few that do.
    seen: set[int] = set()
    for k, t in enc.tensors.items():
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            enc.tensors[k] = t.clone()
        seen.add(enc.tensors[k].untyped_storage().data_ptr())
    state = json.dumps(tree, allow_nan=False)
    meta = {"format": FORMAT, STATE_KEY: state, DIGEST_KEY: content_digest(enc.tensors, state)}
    return safetensors_bytes(enc.tensors, meta)


def content_digest(tensors: dict[str, torch.Tensor], state: str) -> str:
    """SHA-256 over a checkpoint's JSON state and every tensor (name, dtype, shape, bytes; by name), as
    written into its metadata (``sha256``): a file damaged after it was written (a flipped byte in the
    optimizer state) is refused at load instead of resumed from."""
    h = hashlib.sha256(state.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        h.update(f"\0{name}\0{str(t.dtype)}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def loads(data: bytes, source: str = "<bytes>") -> dict[str, Any]:
    """Inverse of :func:`dumps`.  ValueError if ``data`` is not a draftheads checkpoint, or its contents
    differ from the digest recorded when it was written (checkpoints written before it are not checked)."""
    from safetensors.torch import load

    meta = _metadata(data, source)
    tensors = load(data)
    if DIGEST_KEY in meta and content_digest(tensors, meta[STATE_KEY]) != meta[DIGEST_KEY]:
        raise ValueError(f"{source}: its contents differ from the SHA-256 recorded when it was written (the file was "
                         "damaged after it was saved)")
    return _decode(json.loads(meta[STATE_KEY]), tensors)


def _metadata(data: bytes, source: str) -> dict[str, str]:
    import struct

    if len(data) < 8:
        raise ValueError(f"{source}: not a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + n]) if 0 < n <= len(data) - 8 else None
        if not isinstance(header, dict):
            raise ValueError
    except ValueError:
        raise ValueError(f"{source}: not a safetensors file (unreadable header)") from None
    meta = header.get("__metadata__") or {}
    if meta.get("format") != FORMAT or STATE_KEY not in meta:
        raise ValueError(f"{source}: not a draftheads Lightning checkpoint (format {meta.get('format')!r})")
    return meta


def checkpoint_entry(path: str | os.PathLike, key: str) -> Any:
    """One top-level entry of a checkpoint written by :func:`dumps`, read from its header alone (no tensor
    is read): e.g. ``run_config``, the launch's resolved config (:class:`train.resume.RunConfigRecord`).
    None when the entry is absent or holds tensors.

    Raises:
        ValueError: ``path`` is not a draftheads checkpoint (its header unreadable).
    """
    import struct

    with open(path, "rb") as f:
        head = f.read(8)
        (n,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
        if not 0 < n <= 100_000_000:
            raise ValueError(f"{path}: not a safetensors file")
        data = head + f.read(n)
    tree = json.loads(_metadata(data, str(path))[STATE_KEY])
    value = tree.get(key) if isinstance(tree, dict) else None
    try:
        return _decode(value, {})
    except KeyError:  # a tensor marker: not a plain entry
        return None


class SafetensorsCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` plugin: pickle-free, atomic checkpoint files.

    Use as ``Trainer(plugins=[SafetensorsCheckpointIO()])``.  ``path`` is the file Lightning asks
    for (e.g. ``.../last.ckpt``); its content is safetensors (see module docstring).
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"SafetensorsCheckpointIO.save_checkpoint takes no storage_options, got {storage_options!r}")
        atomic_write_bytes(path, dumps(checkpoint))

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint file {path} not found")
        from safetensors import SafetensorError

        try:
            ckpt = loads(path.read_bytes(), str(path))
        except (ValueError, SafetensorError) as exc:  # torn by a full disk or a copy: name it and the way out
            others = sorted(p.name for p in path.parent.glob("*.ckpt") if p != path)
            way = (f"resume from another checkpoint of the run (resume=<its path>; {path.parent} holds "
                   f"{', '.join(others[-3:])})" if others else "no other checkpoint of the run is there")
            raise DamagedFile(path, f"not a readable checkpoint ({str(exc).replace(str(path) + ': ', '')}); {way}") from exc
        if isinstance(map_location, (str, torch.device)):
            ckpt = move_data_to_device(ckpt, map_location)
        return ckpt

    def remove_checkpoint(self, path) -> None:
        path = Path(path)
        if path.is_file() or path.is_symlink():
            os.remove(path)
