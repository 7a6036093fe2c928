"""The sharded safetensors cache: format, writer helpers, reader and batching (design.md).

Layout of one (sub-)cache directory (``<cache>/train`` or ``<cache>/val``)::

    manifest.json            # written once every shard exists (see Manifest below)
    shard-00000.safetensors  # records [0, S) of the split, S = prep.shard_size conversations
    shard-00000.json         # the shard's manifest entry (written after the shard, atomically)
    ...

A shard stores its records concatenated along the token axis (so the file is the raw tensor
bytes plus one small header, ≤1.02× raw):

* ``input_ids`` int32 [N], ``labels`` int32 [N], ``loss_mask`` bool [N]
* ``offsets`` int64 [R+1] — record r spans tokens ``offsets[r]:offsets[r+1]``
* ``hidden`` [N, H] — hs[L], the final post-norm state, in ``prep.dtype``
* ``aux_hidden.<l>`` [N, H] — hs[l] for every configured intermediate layer l
* with ``prep.dtype=float8_e4m3fn`` also ``hidden_scale`` / ``aux_hidden_scale.<l>`` float32 [N]:
  one scale per token row (``data_prep.fp8``); the reader returns ``q * scale`` in bf16
* safetensors metadata ``{"ids": JSON list of conversation ids}``

Manifest: format, split, config hash, base identity, final layer L, aux layer ids, hidden
size, dtypes, pad id, labels mode, totals, and per shard: file, records, tokens, assistant
tokens, dropped-by-reason, bytes and sha256.  Nothing in it depends on the rank count or on
time, so any number of ranks produces byte-identical caches.
"""
from __future__ import annotations

import bisect
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from core.io import MANIFEST_FIX, atomic_save_safetensors, atomic_write_json, read_json, sha256_file, sha256_json

FORMAT = "draftheads-cache-v1"
MANIFEST = "manifest.json"
#: config keys that do not change the cache's content (excluded from the cache hash)
RUNTIME_KEYS = {"model": ("cache_dir",),
                "prep": ("cache_dir", "batch_tokens", "gen_batch_size", "prepack_weights", "progress")}

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
if hasattr(torch, "float8_e4m3fn"):  # prep.dtype=float8_e4m3fn: per-row scales (data_prep.fp8)
    _TORCH_DTYPES["float8_e4m3fn"] = torch.float8_e4m3fn


# ----------------------------------------------------------------------------------------------
# where the cache lives
# ----------------------------------------------------------------------------------------------
def cache_defining_config(cfg) -> dict[str, Any]:
    """The resolved sections that define a cache's content: ``model``, ``data``, ``prep``, ``labels``
    (minus the runtime-only keys in :data:`RUNTIME_KEYS`).

    ``model.dtype`` is the base's compute dtype (``data_prep.features``) and enters as the dtype that
    runs: ``auto`` is resolved for data prep's device, the CPU (:func:`core.precision.resolve_dtype`),
    so an fp32 and a bf16 cache of the same data never share a hash, and a cache made with
    ``model.dtype=float32`` keeps the hash it had before ``auto`` existed."""
    from omegaconf import OmegaConf

    out: dict[str, Any] = {}
    for key in ("model", "data", "prep", "labels"):
        node = OmegaConf.select(cfg, key)
        value = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if k not in RUNTIME_KEYS.get(key, ())}
        out[key] = value
    if isinstance(out.get("model"), dict) and "dtype" in out["model"]:
        from core.precision import resolve_dtype

        out["model"]["dtype"] = resolve_dtype(out["model"]["dtype"], "model.dtype", "cpu", check=False)
    return out


def cache_hash(cfg) -> str:
    """SHA-256 (hex) of :func:`cache_defining_config`."""
    return sha256_json(cache_defining_config(cfg))


def default_cache_dir(cfg) -> Path:
    """The cache directory for a composed config: ``prep.cache_dir`` if set, else
    ``<output_root>/cache/<cache_hash[:16]>``.  ``python -m train`` / ``python -m evaluation``
    call this with the same overrides to find the cache ``python -m data_prep`` wrote."""
    explicit = cfg.prep.get("cache_dir") if "prep" in cfg else None
    if explicit:
        return Path(explicit)
    return Path(cfg.output_root) / "cache" / cache_hash(cfg)[:16]


def missing_cache_message(cfg, cache_dir: str | os.PathLike) -> str:
    """Why a launch found no cache at ``cache_dir`` (:func:`default_cache_dir`) and what to do.

    The default cache's name is the hash of :func:`cache_defining_config`, so a launch whose overrides
    differ from data prep's in any cache-defining key looks for another folder.  The message names
    the keys this launch sets away from the defaults and, for every cache under
    ``<output_root>/cache/`` (its recorded ``config.yaml``), the keys where it differs from this
    launch and whether it is complete, then the two ways out: data prep with the same overrides, or
    ``train.cache_dir=<a cache>``."""
    from omegaconf import OmegaConf

    from core.config import compose, flatten_dotted

    missing = "<absent>"
    here = flatten_dotted(cache_defining_config(cfg))
    out = [f"no cache at {cache_dir} (no train/manifest.json)."]
    if cfg.prep.get("cache_dir"):
        out.append(f"It is this launch's prep.cache_dir; run data prep with prep.cache_dir={cache_dir} first.")
    else:
        defaults = flatten_dotted(cache_defining_config(compose([])))
        own = [f"{k}={here[k]}" for k in sorted(here) if defaults.get(k, missing) != here[k]]
        runtime = ", ".join(f"{g}.{k}" for g, keys in RUNTIME_KEYS.items() for k in keys)
        out.append(f"Its name is the hash of every model.*, data.*, prep.* key and labels (not {runtime}); "
                   f"this launch sets {', '.join(own) if own else 'none of them away from the defaults'}.")
    found = []
    for path in sorted((Path(str(cfg.output_root)) / "cache").glob("*/config.yaml")):
        if path.parent.resolve() == Path(cache_dir).resolve():
            continue
        try:
            theirs = flatten_dotted(cache_defining_config(OmegaConf.load(path)))
        except Exception:  # noqa: BLE001 — a hand-made or old config.yaml: not a hint
            continue
        diff = [f"{k}={theirs.get(k, missing)} (here {here.get(k, missing)})" for k in sorted(set(here) | set(theirs))
                if theirs.get(k, missing) != here.get(k, missing)]
        state = "complete" if (path.parent / "train" / "manifest.json").is_file() else "incomplete"
        found.append(f"{path.parent} ({state}): {'; '.join(diff[:6]) or 'the same settings'}"
                     f"{f' and {len(diff) - 6} more' if len(diff) > 6 else ''}")
    if found:
        out.append("Caches under " + str(Path(str(cfg.output_root)) / "cache") + ": " + " | ".join(found) + ".")
    out.append("Run data prep with this launch's model/data/prep/labels overrides (python -m data_prep ...), "
               "or pass train.cache_dir=<a cache> to train on one of them.")
    return " ".join(out)


def rank_world(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` from torchrun (``RANK``/``WORLD_SIZE``) or SLURM
    (``SLURM_PROCID``/``SLURM_NTASKS``); ``(0, 1)`` when neither is set.

    Raises:
        ValueError: the variables are not integers or ``rank`` is outside ``[0, world)``.
    """
    env = os.environ if env is None else env
    for r_key, w_key in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if r_key in env and w_key in env:
            try:
                rank, world = int(env[r_key]), int(env[w_key])
            except ValueError:
                raise ValueError(f"{r_key}={env[r_key]!r} / {w_key}={env[w_key]!r} are not integers") from None
            if world < 1 or not 0 <= rank < world:
                raise ValueError(f"{r_key}={rank} is not in [0, {w_key}={world})")
            return rank, world
    return 0, 1


# ----------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------
def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def build_shard_tensors(records: Sequence[dict], layers: Sequence[int], final_layer: int, dtype: torch.dtype
                        ) -> dict[str, torch.Tensor]:
    """Concatenate records into the shard tensors listed in the module docstring.

    Args:
        records: dicts with ``input_ids`` / ``loss_mask`` / ``labels`` (sequences or 1-D tensors of
            length T) and ``hidden`` ``{layer: Tensor [T, H]}`` holding ``final_layer`` and ``layers``.
        layers: intermediate layer ids (stored as ``aux_hidden.<l>``).
        final_layer: L (stored as ``hidden``).
        dtype: storage dtype of hidden states; ``torch.float8_e4m3fn`` stores per-row scales too
            (``hidden_scale``, ``aux_hidden_scale.<l>`` float32 [N], :func:`data_prep.fp8.quantize_rows`).
    """
    lengths = [len(r["input_ids"]) for r in records]
    offsets = torch.zeros(len(records) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.as_tensor(lengths, dtype=torch.int64), 0)
    cat = lambda key, dt: torch.cat([torch.as_tensor(r[key]).to(dt).reshape(-1) for r in records])  # noqa: E731
    out = {
        "input_ids": cat("input_ids", torch.int32),
        "labels": cat("labels", torch.int32),
        "loss_mask": cat("loss_mask", torch.bool),
        "offsets": offsets,
    }
    from data_prep.fp8 import is_fp8, quantize_rows

    for key, l in (("hidden", final_layer), *((f"aux_hidden.{l}", l) for l in layers)):
        rows = torch.cat([r["hidden"][l] for r in records])
        if is_fp8(dtype):
            out[key], out[key.replace("hidden", "hidden_scale", 1)] = quantize_rows(rows)
        else:
            out[key] = rows.to(dtype)
    return out


def write_shard(directory: Path, index: int, tensors: dict[str, torch.Tensor], ids: Sequence[str],
                entry_extra: dict[str, Any]) -> dict[str, Any]:
    """Write ``shard-<index>.safetensors`` then its sidecar ``shard-<index>.json`` (both atomic).

    Returns the manifest entry (also the sidecar's content): ``file``, ``records``, ``tokens``,
    ``assistant_tokens``, ``bytes``, ``sha256`` plus ``entry_extra``.
    """
    name = shard_name(index)
    path = directory / f"{name}.safetensors"
    atomic_save_safetensors(tensors, path, metadata={"ids": json.dumps(list(ids))})
    entry = {
        "file": path.name,
        "records": len(ids),
        "tokens": int(tensors["input_ids"].numel()),
        "assistant_tokens": int(tensors["loss_mask"].sum()),
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
        **entry_extra,
    }
    atomic_write_json(directory / f"{name}.json", entry)
    return entry


def finished_entry(directory: Path, index: int, config_hash: str) -> dict[str, Any] | None:
    """The sidecar entry of a finished, intact shard, or ``None`` if it must be (re)written.

    A shard counts as finished when its sidecar exists and the shard file's sha256 matches
    the sidecar; a torn or corrupt shard (or a missing sidecar) returns ``None``.  A shard that
    was finished once (its sidecar is readable) but is now missing or does not match is about to be
    replaced: one warning line on stderr names it (a shard never written says nothing).

    Raises:
        ValueError: the sidecar belongs to a cache made with a different config hash.
    """
    import sys

    name = shard_name(index)
    side, path = directory / f"{name}.json", directory / f"{name}.safetensors"
    if not side.is_file():
        return None
    try:
        entry = json.loads(side.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if entry.get("config_hash") != config_hash:
        raise ValueError(f"{side} was written with config hash {entry.get('config_hash')!r}, not {config_hash!r}; "
                         "use a fresh prep.cache_dir")
    if not path.is_file():
        print(f"warning: data prep: cache shard {path} is missing (its sidecar {side.name} says it was written); "
              "writing it again", file=sys.stderr)
        return None
    got = sha256_file(path)
    if entry.get("sha256") != got:
        print(f"warning: data prep: cache shard {path} does not match its recorded sha256 ({got[:16]}… instead of "
              f"{str(entry.get('sha256'))[:16]}…): replacing it", file=sys.stderr)
        return None
    return entry


def write_manifest(directory: Path, num_shards: int, header: dict[str, Any]) -> dict[str, Any] | None:
    """Assemble ``manifest.json`` from the sidecars once all ``num_shards`` exist; else ``None``.

    Several ranks may call this; they all write the same bytes (atomic rename).

    Raises:
        core.config.UserInputError: a sidecar was written under another config hash than the header's:
            another data prep with other settings wrote into the same folder meanwhile (both passed the
            start's checks before either wrote); no manifest is written.
    """
    entries = []
    for k in range(num_shards):
        side = directory / f"{shard_name(k)}.json"
        if not side.is_file():
            return None
        entry = json.loads(side.read_text())
        theirs, ours = entry.pop("config_hash", None), header.get("config_hash")
        if theirs is not None and ours is not None and theirs != ours:
            from core.config import UserInputError

            raise UserInputError(f"{side} was written under config hash {theirs!r}, not this run's {ours!r}: another "
                                 f"data prep with other settings writes into {directory.parent} (prep.cache_dir) at "
                                 "the same time; no manifest was written. Let one of them finish, then delete the "
                                 "folder's shards and run the other into its own prep.cache_dir")
        entries.append(entry)
    dropped: dict[str, int] = {}
    for e in entries:
        for reason, n in e.get("dropped", {}).items():
            dropped[reason] = dropped.get(reason, 0) + n
    manifest = {
        **header,
        "format": FORMAT,
        "num_shards": num_shards,
        "num_records": sum(e["records"] for e in entries),
        "num_tokens": sum(e["tokens"] for e in entries),
        "num_assistant_tokens": sum(e["assistant_tokens"] for e in entries),
        "bytes": sum(e["bytes"] for e in entries),
        "dropped": dict(sorted(dropped.items())),
        "shards": entries,
    }
    atomic_write_json(directory / MANIFEST, manifest)
    return manifest


# ----------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------
class CacheReader:
    """Random access to the records of one (sub-)cache, memory-mapped through safetensors ``safe_open``.

    ``len(reader)`` records; ``reader[i]`` returns (design.md "Cache → batch contract"):
    ``input_ids`` LongTensor [T], ``loss_mask`` BoolTensor [T], ``labels`` LongTensor [T],
    ``hidden`` [T, H] (stored dtype; bf16 for an fp8 cache, dequantised with its per-row
    scales), ``aux_hidden`` {l: [T, H]}, ``id`` str.

    Args:
        directory: a directory holding ``manifest.json`` (e.g. ``<cache>/train``).
        verify: recompute every shard's sha256 against the manifest on open.

    Raises:
        FileNotFoundError: no manifest (data prep has not finished) or a shard is missing.
        ValueError: unknown format, or (with ``verify``) a shard's checksum does not match.
    """

    def __init__(self, directory: str | os.PathLike, verify: bool = False):
        self.directory = Path(directory)
        path = self.directory / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: run `python -m data_prep` with the same overrides first")
        self.manifest: dict[str, Any] = read_json(path, MANIFEST_FIX)
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{path}: format {self.manifest.get('format')!r} is not {FORMAT!r}")
        self.layers: list[int] = list(self.manifest["layers"])
        self._files = []
        self._scaled: list[bool] = []
        self._offsets: list[list[int]] = []
        self._ids: list[list[str]] = []
        self._starts = [0]
        for entry in self.manifest["shards"]:
            shard = self.directory / entry["file"]
            if not shard.is_file():
                raise FileNotFoundError(f"{shard} listed in {path} is missing")
            if verify and sha256_file(shard) != entry["sha256"]:
                raise ValueError(f"{shard}: sha256 does not match {path}; re-run data prep to rewrite it")
            self._files.append(None)
            self._scaled.append(False)
            self._offsets.append([])
            self._ids.append([])
            self._starts.append(self._starts[-1] + int(entry["records"]))

    @property
    def pad_id(self) -> int:
        return int(self.manifest["pad_id"])

    def __len__(self) -> int:
        return self._starts[-1]

    def _open(self, k: int):
        if self._files[k] is None:
            from safetensors import safe_open

            f = safe_open(str(self.directory / self.manifest["shards"][k]["file"]), framework="pt")
            self._offsets[k] = f.get_tensor("offsets").tolist()
            self._ids[k] = json.loads(f.metadata()["ids"])
            self._files[k] = f
            self._scaled[k] = "hidden_scale" in f.keys()
        return self._files[k]

    def _hidden(self, k: int, key: str, a: int, b: int) -> torch.Tensor:
        """Rows ``a:b`` of hidden-state tensor ``key`` of shard ``k``; fp8 shards are dequantised (bf16)."""
        f = self._open(k)
        x = f.get_slice(key)[a:b]
        if self._scaled[k]:
            from data_prep.fp8 import dequantize_rows

            x = dequantize_rows(x, f.get_slice(key.replace("hidden", "hidden_scale", 1))[a:b])
        return x

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} out of range for a cache of {len(self)} records")
        k = bisect.bisect_right(self._starts, i) - 1
        f = self._open(k)
        r = i - self._starts[k]
        a, b = self._offsets[k][r], self._offsets[k][r + 1]
        return {
            "input_ids": f.get_slice("input_ids")[a:b].long(),
            "loss_mask": f.get_slice("loss_mask")[a:b].bool(),
            "labels": f.get_slice("labels")[a:b].long(),
            "hidden": self._hidden(k, "hidden", a, b),
            "aux_hidden": {l: self._hidden(k, f"aux_hidden.{l}", a, b) for l in self.layers},
            "id": self._ids[k][r],
        }

    def lengths(self) -> list[int]:
        """Token count of every record (from the offsets; no tensor data is read)."""
        out = []
        for k in range(len(self._files)):
            self._open(k)
            o = self._offsets[k]
            out.extend(o[j + 1] - o[j] for j in range(len(o) - 1))
        return out


def collate(records: Sequence[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """Right-pad records into a batch (design.md "Cache → batch contract").

    Returns:
        ``input_ids`` [B, T] long (``pad_id`` on padding), ``attention_mask`` [B, T] bool,
        ``loss_mask`` [B, T] bool (False on padding), ``labels`` [B, T] long (0 on padding),
        ``hidden`` [B, T, H], ``aux_hidden`` {l: [B, T, H]} (zeros on padding, stored dtype),
        ``lengths`` [B] long, ``ids`` list[str]; T = the longest record.

    Raises:
        ValueError: ``records`` is empty or records disagree on their aux layers.
    """
    if not records:
        raise ValueError("collate() got no records")
    B = len(records)
    lengths = torch.as_tensor([len(r["input_ids"]) for r in records], dtype=torch.long)
    T = int(lengths.max())
    H = records[0]["hidden"].shape[-1]
    layers = sorted(records[0]["aux_hidden"])
    batch = {
        "input_ids": torch.full((B, T), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((B, T), dtype=torch.bool),
        "loss_mask": torch.zeros((B, T), dtype=torch.bool),
        "labels": torch.zeros((B, T), dtype=torch.long),
        "hidden": torch.zeros((B, T, H), dtype=records[0]["hidden"].dtype),
        "aux_hidden": {l: torch.zeros((B, T, H), dtype=records[0]["aux_hidden"][l].dtype) for l in layers},
        "lengths": lengths,
        "ids": [r["id"] for r in records],
    }
    for i, r in enumerate(records):
        n = int(lengths[i])
        if sorted(r["aux_hidden"]) != layers:
            raise ValueError(f"record {r['id']!r} has aux layers {sorted(r['aux_hidden'])}, expected {layers}")
        batch["input_ids"][i, :n] = r["input_ids"]
        batch["attention_mask"][i, :n] = True
        batch["loss_mask"][i, :n] = r["loss_mask"]
        batch["labels"][i, :n] = r["labels"]
        batch["hidden"][i, :n] = r["hidden"]
        for l in layers:
            batch["aux_hidden"][l][i, :n] = r["aux_hidden"][l]
    return batch
