"""Conversation sources: local ShareGPT / ``messages`` JSON(L) files, anything ``datasets`` loads, and mixtures.

One source is a ``data`` section (``data.path`` + options) or one entry of ``data.sources``.
How ``path`` is read (``data.reader``):

* ``auto`` (default): ``null`` (the packaged ShareGPT file) and local ``.json`` / ``.jsonl``
  files, compressed or not (``.jsonl.gz``, ``.json.bz2``, ``.jsonl.xz``), go through the tolerant streaming reader
  (:func:`data_prep.sharegpt.iter_records`: truncated or corrupt files, ``data.encoding``); everything else through
  ``datasets``;
* ``datasets``: always through ``datasets``:
  a directory written by ``Dataset.save_to_disk`` → :func:`datasets.load_from_disk`;
  a ``.json`` / ``.jsonl`` / ``.parquet`` / ``.arrow`` / ``.csv`` file (``.json`` / ``.jsonl`` / ``.csv`` also
  compressed: ``.csv.gz``) → ``load_dataset(<builder>, data_files=path, split="train")``; another directory or a hub id → ``load_dataset(path,
  split=data.split)``; ``data.streaming=true`` iterates without materialising the set.

Every record then goes through the same :func:`data_prep.sharegpt.normalize` (``data.format``:
``sharegpt | messages | auto``) and per-reason counting.

Mixtures (``data.sources=[{path, weight, max, ...}, ...]``, each entry may override ``format``,
``split``, ``streaming``, ``encoding``, ``reader``): conversations are interleaved
deterministically by smooth weighted round robin — the next conversation comes from the source
with the smallest ``(taken + 1) / weight`` (ties: the earlier source) among those not exhausted
and below their ``max`` — so the mixture is the same on every run and machine.

An id seen before (the same file listed twice, a record repeated in a file) is dropped and counted as
``duplicate_id`` in its source's counts: the held-out split, the cache's records and the evaluation's
results are all keyed by id.
"""
from __future__ import annotations

import codecs
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from core.config import UserInputError
from core.io import names_a_local_path
from data_prep.sharegpt import (COMPRESSED_SUFFIXES, FORMATS, Conversation, ReadStats, UnreadableFile, iter_records,
                                normalize_records, open_binary, resolve_path)

log = logging.getLogger(__name__)

READERS = ("auto", "tolerant", "datasets")
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
_SOURCE_KEYS = ("path", "weight", "max", "format", "split", "streaming", "encoding", "reader")


@dataclass
class SourceSpec:
    """One conversation source (see the module doc for how ``path`` is read)."""

    path: str | None
    format: str = "auto"
    split: str = "train"
    streaming: bool = False
    encoding: str = "utf-8"
    reader: str = "auto"
    weight: float = 1.0
    max: int | None = None
    #: ids of records without one: ``<id_prefix><index>`` (``record-<k>-`` for source k of a mixture)
    id_prefix: str = "record-"
    stats: ReadStats = field(default_factory=ReadStats)
    taken: int = 0

    @property
    def name(self) -> str:
        return self.path if self.path is not None else "the packaged ShareGPT file"

    def describe(self) -> dict[str, Any]:
        """What the cache manifest records about this source (deterministic)."""
        return {"path": self.path, "format": self.format, "split": self.split, "weight": self.weight,
                "max": self.max, "conversations": self.taken, "records_read": self.stats.records,
                "dropped": dict(sorted(self.stats.dropped.items())), "fixed": dict(sorted(self.stats.fixed.items()))}


def source_specs(data_cfg) -> list[SourceSpec]:
    """The sources of a ``data`` config section: ``data.sources`` if set, else ``data.path``.

    Raises:
        UserInputError: a bad ``format``/``reader``/``weight``/``max`` or an unknown key (named).
    """
    base = {k: data_cfg.get(k) for k in ("format", "split", "streaming", "encoding", "reader") if data_cfg.get(k) is not None}
    entries = data_cfg.get("sources")
    if entries is None:
        raw = [{"path": data_cfg.get("path")}]
        where = ["data"]
    else:
        if isinstance(entries, str) or hasattr(entries, "items"):  # list() would read a string letter by letter
            raise UserInputError(f"data.sources={entries!r} must be a list of sources, e.g. 'data.sources=[{{path: "
                                 "a.jsonl}}, {path: b.jsonl, weight: 2}]' (one source: data.path=...)")
        raw = list(entries)
        where = [f"data.sources[{i}]" for i in range(len(raw))]
        if not raw:
            raise UserInputError("data.sources is an empty list; give at least one {path: ...} or set it to null")
    specs = []
    for k, (w, entry) in enumerate(zip(where, raw)):
        entry = dict(entry) if hasattr(entry, "items") else {"path": entry}
        unknown = sorted(set(entry) - set(_SOURCE_KEYS))
        if unknown:
            raise UserInputError(f"{w}: unknown key(s) {unknown}; allowed: {list(_SOURCE_KEYS)}")
        opts = {**base, **{k: v for k, v in entry.items() if v is not None}}
        for key, kind in (("weight", float), ("max", int)):
            try:
                if opts.get(key) is not None and (isinstance(opts[key], bool) or kind(opts[key]) != float(opts[key])):
                    raise ValueError
            except (TypeError, ValueError):
                raise UserInputError(f"{w}.{key}={opts[key]!r} must be a number"
                                     + (" (a whole one)" if kind is int else "")) from None
        spec = SourceSpec(path=None if opts.get("path") is None else str(opts["path"]),
                          format=str(opts.get("format", "auto")), split=str(opts.get("split", "train")),
                          streaming=bool(opts.get("streaming", False)), encoding=str(opts.get("encoding", "utf-8")),
                          reader=str(opts.get("reader", "auto")), weight=float(opts.get("weight", 1.0)),
                          max=None if opts.get("max") is None else int(opts["max"]),
                          id_prefix=f"record-{k}-" if len(raw) > 1 else "record-")
        if spec.format not in FORMATS:
            raise UserInputError(f"{w}.format={spec.format!r} is not valid; choices: {', '.join(FORMATS)}")
        if spec.reader not in READERS:
            raise UserInputError(f"{w}.reader={spec.reader!r} is not valid; choices: {', '.join(READERS)}")
        if not spec.weight > 0:
            raise UserInputError(f"{w}.weight={spec.weight!r} must be > 0")
        if spec.max is not None and spec.max < 1:
            raise UserInputError(f"{w}.max={spec.max!r} must be >= 1 or null")
        specs.append(spec)
    return specs


def data_suffix(path: str | Path) -> str:
    """The suffix that says what a data file holds, lower case: ``.jsonl`` for ``a.jsonl`` and ``a.JSONL.gz`` alike
    (a compressed file's own suffix is one of :data:`data_prep.sharegpt.COMPRESSED_SUFFIXES`)."""
    p = Path(path)
    if p.suffix.lower() in COMPRESSED_SUFFIXES:
        p = p.with_suffix("")
    return p.suffix.lower()


def _is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and any((p / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json"))


_DATA_SUFFIXES = (*_BUILDERS, ".txt", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar")


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of ``exc``'s cause/context chain (datasets wraps the reader's error)."""
    seen = {id(exc)}
    while (nxt := exc.__cause__ or exc.__context__) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        exc = nxt
    return exc


def _load_error(spec: SourceSpec, p: Path, exc: BaseException, after: int | None = None) -> UserInputError:
    """One line for a source ``datasets`` could not load or read: its innermost error, and, where the files
    of one source disagree on their columns, what to do about it."""
    cause = _root_cause(exc)
    first = lambda e: str(e).splitlines()[0] if str(e) else ""  # noqa: E731
    text = f"{type(cause).__name__}: {first(cause)}" if cause is not exc else f"{type(exc).__name__}: {first(exc)}"
    where = f" after {after} rows" if after else ""
    if type(cause).__name__ == "CastError" or "column names don't match" in str(cause):
        return UserInputError(f"data.path={spec.path!r}: its files do not share one set of columns{where} (e.g. "
                              "'conversations' in one, 'messages' in another), which one datasets source cannot hold; "
                              f"list each file as its own data.sources entry ({text[:300]})")
    has_files = p.is_dir() and any(data_suffix(f) in _BUILDERS for f in p.iterdir() if f.is_file())
    if p.is_dir() and not has_files:
        return UserInputError(f"data.path={spec.path!r}: data files not found in this directory (neither a saved "
                              f"dataset nor files datasets can load: {text[:300]})")
    return UserInputError(f"data.path={spec.path!r}: datasets could not {'read' if after is not None else 'load'} "
                          f"it{where} ({text[:300]})")


def _csv_as_written(path: Path, encoding: str = "utf-8") -> dict:
    """``load_dataset("csv")`` options that keep every cell as the text written: pandas would read the ids
    ``007`` and ``7`` both as 7 (``7.0`` beside an empty cell) and ``NA`` as null.  Every column of the header
    is a string (the turn lists are JSON text either way); an empty cell is ``""``; the file is decoded with
    ``data.encoding`` (``datasets`` would assume UTF-8)."""
    import csv
    import io

    import datasets

    sig = "utf-8-sig" if codecs.lookup(encoding).name == "utf-8" else encoding  # a byte-order mark, as elsewhere
    with open_binary(path) as raw, io.TextIOWrapper(raw, newline="", encoding=sig, errors="replace") as fh:
        header = next(csv.reader(fh), [])  # a .csv.gz is read decompressed (datasets decompresses it too)
    opts = {"encoding": sig}
    if not header or len(set(header)) != len(header):  # let datasets report it
        return opts
    return {**opts, "features": datasets.Features({name: datasets.Value("string") for name in header}),
            "keep_default_na": False}


def _datasets_rows(spec: SourceSpec) -> Iterator[dict]:
    import datasets

    p = Path(spec.path)
    try:
        if _is_saved_dataset(p):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if spec.split not in ds:
                    raise UserInputError(f"data.path={spec.path!r}: no split {spec.split!r} (has {sorted(ds)}); set data.split")
                ds = ds[spec.split]
            if spec.streaming:
                ds = ds.to_iterable_dataset()
        elif p.is_file():
            builder = _BUILDERS.get(data_suffix(p))
            if builder is None or (builder not in ("json", "csv") and data_suffix(p) != p.suffix.lower()):
                raise UserInputError(f"data.path={spec.path!r}: unsupported file type {''.join(p.suffixes[-2:])!r} "
                                     f"(supported: {', '.join(sorted(_BUILDERS))}, .json / .jsonl / .csv also compressed "
                                     f"{' / '.join(COMPRESSED_SUFFIXES)}, or a saved dataset directory)")
            ds = datasets.load_dataset(builder, data_files=str(p), split="train", streaming=spec.streaming,
                                       **(_csv_as_written(p, spec.encoding) if builder == "csv" else {}))
        else:
            if not p.exists() and names_a_local_path(spec.path, _DATA_SUFFIXES):
                raise UserInputError(f"data.path={spec.path!r}: no such file or directory")
            ds = datasets.load_dataset(spec.path, split=spec.split, streaming=spec.streaming)
    except UserInputError:
        raise
    except Exception as exc:  # datasets raises many types (DatasetNotFoundError, ValueError, OSError, ...)
        raise _load_error(spec, p, exc) from exc
    rows = iter(ds)
    while True:
        try:  # a streamed dataset reads (and casts) its files only now
            row = next(rows)
        except StopIteration:
            break
        except Exception as exc:
            raise _load_error(spec, p, exc, after=spec.stats.records) from exc
        spec.stats.records += 1
        yield row
    spec.stats.finished = True


def iter_source(spec: SourceSpec) -> Iterator[Conversation]:
    """Stream the normalised conversations of one source; counts go to ``spec.stats``.

    Raises:
        UserInputError: the file / directory / dataset does not exist or cannot be loaded, or
            ``data.encoding`` is unknown (the message names the source).
    """
    use_tolerant = spec.reader == "tolerant" or (
        spec.reader == "auto" and (spec.path is None or (Path(spec.path).is_file()
                                                         and data_suffix(spec.path) in (".json", ".jsonl"))))
    if use_tolerant:
        try:
            codecs.lookup(spec.encoding)
        except LookupError:
            raise UserInputError(f"data.encoding={spec.encoding!r} is not a known text encoding") from None
        try:
            with resolve_path(spec.path) as p:
                yield from normalize_records(iter_records(p, spec.stats, spec.encoding), spec.stats, spec.format,
                                             spec.id_prefix)
        except (FileNotFoundError, UnreadableFile) as exc:
            raise UserInputError(str(exc)) from None
    else:
        if spec.path is None:
            raise UserInputError("data.reader=datasets needs data.path")
        yield from normalize_records(_datasets_rows(spec), spec.stats, spec.format, spec.id_prefix)


def mix(specs: list[SourceSpec]) -> Iterator[tuple[int, Conversation]]:
    """Interleave the sources' conversations deterministically (module doc); yield ``(source index, conversation)``.
    A conversation whose id an earlier one had is dropped and counted (``duplicate_id``)."""
    iters = [iter_source(s) for s in specs]
    live = [True] * len(specs)
    seen: dict[str, str] = {}  # id -> the source that gave it first
    while True:
        best = None
        for k, s in enumerate(specs):
            if not live[k] or (s.max is not None and s.taken >= s.max):
                continue
            key = (s.taken + 1) / s.weight
            if best is None or key < best[0]:
                best = (key, k)
        if best is None:
            return
        k = best[1]
        conv = next(iters[k], None)
        if conv is None:
            live[k] = False
            continue
        if conv.id in seen:
            where = "" if seen[conv.id] == specs[k].name else f" of {seen[conv.id]}"
            specs[k].stats.drop("duplicate_id", conv.id, f"the id of an earlier conversation{where}")
            continue
        seen[conv.id] = specs[k].name
        specs[k].taken += 1
        yield k, conv


def warn_replacements(specs: list[SourceSpec]) -> None:
    """Warn once per source whose bytes were not valid in its ``data.encoding``."""
    for s in specs:
        if s.stats.replaced_bytes:
            log.warning("%s: %d bytes are not valid %s and were decoded as U+FFFD (%d records affected); "
                        "set data.encoding to the file's encoding (e.g. data.encoding=cp1252)",
                        s.name, s.stats.replaced_bytes, s.encoding, s.stats.replaced_records)
