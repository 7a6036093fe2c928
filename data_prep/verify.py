"""A cache split's shards checked against its manifest: sizes every time, SHA-256 once per file version.

Training reads shards memory-mapped; a damaged shard (a torn copy, a bad disk, an edited file)
would train silently on garbage - NaN losses, NaN exported weights, exit 0.  So before training
:func:`verify_split` checks every shard its manifest lists:

* **always** (a ``stat`` per shard, free): the file exists and its size is the manifest's ``bytes``;
* **SHA-256 once per version of the file**: a shard is hashed and compared with the manifest's
  ``sha256`` unless the split's stamp records that this very file - same size, same modification
  time (ns), same inode - was already hashed to the manifest's SHA-256.  A passing shard is added
  to the stamp (written atomically).  Anything that rewrites a shard (data prep, a copy, an edit)
  changes its mtime or inode, so the next start hashes it again; a 40 GB cache is hashed at its
  first training start and not on every resume.
* ``full=True`` (``train.verify_cache=full``) ignores the stamp and hashes every shard.

Stamps live outside the cache, in ``<$DRAFTHEADS_CACHE or ~/.cache/draftheads>/verified/<hash of
the split's absolute path>.json`` (so training never writes into a cache: it stays the bytes data
prep wrote, and read-only caches get stamps too), and only for splits of at least
:data:`STAMP_MIN_BYTES` (a smaller split is hashed faster than a stamp is worth).

What the stamp cannot see: bytes that change on disk without the file's mtime/inode changing
(silent media corruption after the first check).  ``train.verify_cache=full`` covers that.
When the stamp directory cannot be written, every start hashes again (and says so once).

A mismatch raises :class:`CacheIntegrityError` naming the shard, what differs, and the data prep
command that rewrites it (:func:`rebuild_hint`: data prep re-hashes every shard it finds and
rewrites the ones that do not match their sidecar, with one warning line each).
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import UserInputError
from core.io import MANIFEST_FIX, atomic_write_json, read_json, sha256_file

STAMP_FORMAT = "draftheads-verified-v1"
#: splits smaller than this (bytes of all shards) are hashed at every start, without a stamp
STAMP_MIN_BYTES = 64 << 20


class CacheIntegrityError(UserInputError):
    """A cache shard does not match its manifest (missing, other size, other SHA-256)."""


@dataclass
class VerifyReport:
    """What :func:`verify_split` did: shards checked, hashed now, trusted from the stamp, bytes hashed, seconds."""

    shards: int = 0
    hashed: int = 0
    stamped: int = 0
    bytes_hashed: int = 0
    seconds: float = 0.0
    stamp_written: bool = True
    stamp: Path | None = None  # the stamp file (None: the split is below STAMP_MIN_BYTES)


def _file_key(st: os.stat_result) -> dict[str, int]:
    return {"bytes": int(st.st_size), "mtime_ns": int(st.st_mtime_ns), "inode": int(st.st_ino)}


def stamp_path(directory: str | os.PathLike, stamp_dir: str | os.PathLike | None = None) -> Path:
    """Where the stamp of split ``directory`` lives: ``<stamp_dir>/<sha256(absolute path)[:24]>.json``,
    ``stamp_dir`` defaulting to ``core.base_model.default_cache_dir() / "verified"``."""
    import hashlib

    if stamp_dir is None:
        from core.base_model import default_cache_dir

        stamp_dir = default_cache_dir() / "verified"
    key = hashlib.sha256(str(Path(directory).resolve()).encode()).hexdigest()[:24]
    return Path(stamp_dir) / f"{key}.json"


def _read_stamp(path: Path) -> dict[str, Any]:
    try:
        stamp = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(stamp, dict) or stamp.get("format") != STAMP_FORMAT or not isinstance(stamp.get("shards"), dict):
        return {}
    return stamp["shards"]


def verify_split(directory: str | os.PathLike, manifest: dict[str, Any] | None = None, full: bool = False,
                 cache_root: str | os.PathLike | None = None,
                 stamp_dir: str | os.PathLike | None = None) -> VerifyReport:
    """Check every shard of the split ``directory`` against its manifest (module docstring).

    Args:
        directory: a split directory holding ``manifest.json`` (``<cache>/train``).
        manifest: its parsed manifest (read from ``directory`` when None).
        full: hash every shard, ignoring the stamp.
        cache_root: the cache directory whose ``config.yaml`` gives the rebuild command (default:
            ``directory``'s parent).
        stamp_dir: where stamps live (:func:`stamp_path`).

    Returns:
        A :class:`VerifyReport`.

    Raises:
        CacheIntegrityError: a listed shard is missing, has another size than the manifest's
            ``bytes``, or another SHA-256 than its ``sha256``; the message names the shard and how to
            rebuild it.  Nothing is written in that case.
    """
    directory = Path(directory)
    if manifest is None:
        manifest = read_json(directory / "manifest.json", MANIFEST_FIX)
    root = Path(cache_root) if cache_root is not None else directory.parent
    start = time.perf_counter()
    report = VerifyReport()
    entries = manifest.get("shards", [])
    use_stamp = sum(int(e.get("bytes") or 0) for e in entries) >= STAMP_MIN_BYTES
    where = stamp_path(directory, stamp_dir) if use_stamp else None
    stamp = _read_stamp(where) if where is not None and not full else {}
    report.stamp = where
    new_stamp: dict[str, Any] = {}
    for entry in entries:
        path = directory / str(entry["file"])
        report.shards += 1
        try:
            st = path.stat()
        except FileNotFoundError:
            raise CacheIntegrityError(f"cache shard {path} listed in {directory / 'manifest.json'} is missing; "
                                      f"{rebuild_hint(root)}") from None
        want_bytes, want_sha = entry.get("bytes"), entry.get("sha256")
        if want_bytes is not None and int(st.st_size) != int(want_bytes):
            raise CacheIntegrityError(f"cache shard {path} has {st.st_size} bytes but its manifest "
                                      f"({directory / 'manifest.json'}) records {want_bytes}: the file is damaged or "
                                      f"was changed after data prep; {rebuild_hint(root)}")
        if not want_sha:
            continue  # a manifest without checksums: sizes are all there is to compare
        key = {**_file_key(st), "sha256": str(want_sha)}
        if stamp.get(path.name) == key:
            report.stamped += 1
            new_stamp[path.name] = key
            continue
        got = sha256_file(path)
        report.hashed += 1
        report.bytes_hashed += int(st.st_size)
        if got != want_sha:
            raise CacheIntegrityError(f"cache shard {path} does not match its manifest ({directory / 'manifest.json'}): "
                                      f"sha256 {got[:16]}… instead of {str(want_sha)[:16]}…; the file is damaged or was "
                                      f"changed after data prep; {rebuild_hint(root)}")
        after = path.stat()  # rewritten while being hashed: do not vouch for the new version
        if _file_key(after) == _file_key(st):
            new_stamp[path.name] = key
    if where is not None and (report.hashed or set(new_stamp) != set(stamp)):
        try:
            atomic_write_json(where, {"format": STAMP_FORMAT, "split": str(directory.resolve()), "shards": new_stamp})
        except OSError:
            report.stamp_written = False
    report.seconds = time.perf_counter() - start
    return report


def verify_cache(cache_dir: str | os.PathLike, readers: dict[str, Any], full: bool = False,
                 out=None, quiet: bool = False) -> dict[str, VerifyReport]:
    """:func:`verify_split` for every split reader (``{"train": CacheReader, "val": ...}``) of ``cache_dir``;
    prints one line to ``out`` (stderr by default; nothing with ``quiet``) when a split large enough
    for a stamp was hashed, or its stamp could not be written.

    Raises:
        CacheIntegrityError: see :func:`verify_split`.
    """
    reports = {}
    for split, reader in readers.items():
        directory = Path(getattr(reader, "directory", Path(cache_dir) / split))
        reports[split] = verify_split(directory, getattr(reader, "manifest", None), full=full, cache_root=cache_dir)
    large = [r for r in reports.values() if r.stamp is not None]
    hashed = sum(r.hashed for r in large)
    unwritable = [r for r in large if not r.stamp_written]
    if (hashed or unwritable) and not quiet:
        stream = out if out is not None else sys.stderr
        gb = sum(r.bytes_hashed for r in large) / 1e9
        text = (f"draftheads: verified {hashed} cache shard(s) of {cache_dir} against their manifest SHA-256 "
                f"({gb:.2f} GB in {sum(r.seconds for r in large):.1f} s)")
        if unwritable:
            text += f"; cannot write the stamp {unwritable[0].stamp}, so the next start hashes them again"
        else:
            text += "; later starts check sizes only until a shard changes"
        print(text, file=stream)
    return reports


def rebuild_hint(cache_root: str | os.PathLike) -> str:
    """How to rebuild a cache's damaged shards: the data prep command that wrote ``cache_root``
    (recreated from its ``config.yaml``: the group options and keys that differ from the defaults,
    plus ``prep.cache_dir``) when it can be recreated exactly, else the general instruction."""
    root = Path(cache_root)
    command = rebuild_command(root)
    if command is not None:
        return f"rebuild it with `{command}` (data prep rewrites every shard that does not match its checksum)"
    return (f"rebuild it by re-running the data prep command that made {root} (python -m data_prep with the same "
            f"overrides and prep.cache_dir={root}); data prep rewrites every shard that does not match its checksum")


def rebuild_command(cache_root: str | os.PathLike) -> str | None:
    """``python -m data_prep <args>`` that resumes the cache at ``cache_root``, or None.

    The arguments are the recorded config's group options and cache-defining keys that differ
    from a default composition, plus ``prep.cache_dir=<cache_root>``; returned only when composing
    them gives the recorded cache hash (so the command is known to address this cache).
    """
    from omegaconf import OmegaConf

    from core.config import compose, flatten_dotted
    from data_prep.cache import cache_defining_config, cache_hash

    root = Path(cache_root)
    path = root / "config.yaml"
    if not path.is_file():
        return None
    try:
        recorded = OmegaConf.load(path)
        want = cache_hash(recorded)
        defaults = compose([])
        choices = dict(recorded.get("choices") or {})
        argv = [f"{g}={choices[g]}" for g in ("model", "data", "prep")
                if g in choices and str(choices[g]) != str(defaults.choices.get(g))]
        base = flatten_dotted(cache_defining_config(compose(argv)))
        for key, value in flatten_dotted(cache_defining_config(recorded)).items():
            if key not in base or base[key] != value:
                argv.append(f"{key}={_dotlist_value(value)}")
        argv.append(f"prep.cache_dir={root}")
        if cache_hash(compose(argv)) != want:
            return None
    except Exception:  # an old or hand-made config: fall back to the general instruction
        return None
    return "python -m data_prep " + " ".join(shlex.quote(a) for a in argv)


def _dotlist_value(value: Any) -> str:
    """``value`` as omegaconf's dotlist parser reads it back (strings that YAML would retype are quoted)."""
    import yaml

    if isinstance(value, str):
        try:
            if yaml.safe_load(value) == value:
                return value
        except yaml.YAMLError:
            pass
        return json.dumps(value)
    return json.dumps(value, separators=(",", ":"))
