"""The front half of data prep: read → normalise → held-out split → template → loss masks.

Everything here runs on the tokenizer alone (no base model), so ``python -m data_prep`` validates
the data before it loads the model or creates a directory, and online training can reuse it
(:func:`iter_templated`).

* :func:`read_split` reads the sources (:mod:`data_prep.sources`), keeps the first
  ``data.max_conversations`` normalised conversations, and splits them by root id
  (:func:`data_prep.split.root_id`, unless ``data.split_key=id``).
* :func:`template_conversations` renders each conversation as inference sees every turn
  (:func:`data_prep.template.segment_records`) and counts every record it skips in the same
  :class:`~data_prep.sharegpt.ReadStats` (reason, first id, message).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

from core.config import UserInputError
from data_prep.sharegpt import Conversation, ReadStats
from data_prep.sources import SourceSpec, mix, source_specs, warn_replacements
from data_prep.split import RootCounter, is_heldout, root_id
from data_prep.template import Segment, TemplateError, flatten, segment_records

SPLITS = ("train", "val")
SPLIT_KEYS = ("root", "id")


@dataclass
class SplitConversations:
    """Conversations read for one data config, divided by the held-out split.

    Attributes:
        train, val: normalised conversations in mixture order.
        stats: the counts of all sources together (reader, normalisation and, once
            :func:`template_conversations` ran, templating).
        sources: the sources with their own counts (:meth:`SourceSpec.describe` goes to the manifest).
    """

    train: list[Conversation] = field(default_factory=list)
    val: list[Conversation] = field(default_factory=list)
    stats: ReadStats = field(default_factory=ReadStats)
    sources: list[SourceSpec] = field(default_factory=list)


@dataclass
class TemplatedConversation:
    """One training sequence: a conversation, or one record of it when its template is not
    prefix-stable (``id = "<conversation id>#<k>"``, k >= 1 for the later records).

    Attributes:
        id: record id stored in the cache.
        conversation_id: the source conversation's id.
        segments: assistant segments (:func:`data_prep.template.segment_records`).
        messages: the source conversation's normalised messages (shared by its records; what
            regeneration renders later turns from, :func:`data_prep.labels.regenerate`).
    """

    id: str
    conversation_id: str
    segments: list[Segment]
    messages: list[dict] | None = None
    turns_past_max_length: int = 0  # assistant turns after this record that data.max_length left untemplated

    def encode(self, max_length: int | None = None) -> tuple[list[int], list[bool]]:
        """``(input_ids, loss_mask)`` — lists of length T <= max_length; mask True on assistant bodies."""
        return flatten(self.segments, max_length)


def split_of(conversation_id: str, data_cfg) -> str:
    """``"val"`` when the conversation is held out, else ``"train"`` (keyed by root id by default)."""
    key = str(data_cfg.get("split_key", "root"))
    if key not in SPLIT_KEYS:
        raise UserInputError(f"data.split_key={key!r} is not valid; choices: {', '.join(SPLIT_KEYS)}")
    cid = root_id(conversation_id) if key == "root" else conversation_id
    return "val" if is_heldout(cid, float(data_cfg.heldout_fraction), str(data_cfg.split_salt)) else "train"


class Splitter:
    """:func:`split_of` over one pass of the sources, with the root-id guard: under
    ``data.split_key=root`` a root that gathers more than ``MAX_PARTS_PER_ROOT`` conversations of one
    source is refused (:class:`data_prep.split.RootCounter`).  Every reader of the split — data prep's
    :func:`read_split`, online training's :func:`iter_templated` and the evaluation's
    :func:`heldout_prompts` — goes through one, so they agree on what they accept.

    Raises (from ``__call__``):
        UserInputError: an invalid ``data.split_key``, or a root id gathering too many conversations
            (source, root, first and last id named, and the fix ``data.split_key=id``).
    """

    def __init__(self, data_cfg) -> None:
        self.data_cfg = data_cfg
        self._roots = RootCounter() if str(data_cfg.get("split_key", "root")) == "root" else None

    def __call__(self, source: str, conversation_id: str) -> str:
        if self._roots is not None:
            try:
                self._roots.add(source, conversation_id)
            except ValueError as exc:
                raise UserInputError(str(exc)) from None
        return split_of(conversation_id, self.data_cfg)


def _first_drop(stats: ReadStats) -> str:
    if not stats.examples:
        return ""
    reason, ex = next(iter(sorted(stats.examples.items(), key=lambda kv: -stats.dropped[kv[0]])))
    return f"; most common: {reason} ({stats.dropped[reason]}), first {ex['id']!r}: {ex['message']}"


def _unparsed(stats: ReadStats) -> str:
    """Where a source's unparsed bytes are (:attr:`ReadStats.first_unparsed`), for the no-usable-conversation error:
    a file none of whose records decoded (single-quoted "JSON", a Python dump, another encoding) reads 0 records."""
    first = stats.first_unparsed
    if not stats.unparsed_bytes or first is None:
        return ""
    return (f"; {stats.unparsed_bytes:,} bytes in {stats.unparsed_regions} region(s) are not JSON records, the first "
            f"at line {first['line']}: {first['text']!r}"
            + (" (NUL characters: UTF-16 text? set data.encoding=utf-16)" if "\x00" in first["text"] else ""))


def read_split(data_cfg) -> SplitConversations:
    """Read the first ``data.max_conversations`` normalised conversations of the (mixed) sources and split them.

    Raises:
        UserInputError: a source cannot be read, or a source read to its end yielded no usable
            conversation (named, with its drop counts and first offending record), or under
            ``data.split_key=root`` one root id gathers more than ``MAX_PARTS_PER_ROOT`` conversations
            (:class:`Splitter`) — raised before anything is written.
    """
    out = SplitConversations(sources=source_specs(data_cfg))
    limit = data_cfg.get("max_conversations")
    exhausted = set(range(len(out.sources)))
    split = Splitter(data_cfg)
    for k, conv in mix(out.sources):
        getattr(out, split(out.sources[k].name, conv.id)).append(conv)
        if limit is not None and len(out.train) + len(out.val) >= int(limit):
            exhausted = {j for j, s in enumerate(out.sources) if s.stats.finished}
            break
    for spec in out.sources:
        out.stats.merge(spec.stats)
    out.stats.finished = all(s.stats.finished for s in out.sources)
    warn_replacements(out.sources)
    for j in sorted(exhausted):
        spec = out.sources[j]
        if spec.taken == 0:
            raise UserInputError(f"no usable conversation in {spec.name} (records read {spec.stats.records}, "
                                 f"dropped {dict(sorted(spec.stats.dropped.items()))}{_first_drop(spec.stats)}{_unparsed(spec.stats)}); "
                                 "check data.path / data.sources and data.format")
    return out


def template_conversations(tokenizer, convs: Iterable[Conversation], eos_ids: Iterable[int], max_length: int,
                           stats: ReadStats) -> Iterator[TemplatedConversation]:
    """Template conversations (:func:`data_prep.template.segment_records`); skipped records are counted in
    ``stats`` by reason with the first id and message, and never raise.  A kept conversation that
    lost turns counts one ``turns_dropped_<reason>`` per turn, a turn rendered otherwise than by the template
    one ``turns_closed_with_eos`` or ``turns_rendered_from_data`` (:func:`data_prep.template._turn_view`), one
    split into several records counts ``split_by_template`` (``stats.fixed``, first id in ``stats.fix_examples``)."""
    eos = set(eos_ids)
    emitted: set[str] = set()  # record ids yielded: a split record's ``<id>#<k>`` may be another conversation's id
    for conv in convs:
        dropped: list[TemplateError] = []
        past: list[int] = []
        notes: list[tuple[int, str, str]] = []
        try:
            records = segment_records(tokenizer, conv.messages, conv.id, eos, max_length, dropped_turns=dropped,
                                      past_max_length=past, notes=notes)
        except TemplateError as exc:
            stats.drop(exc.reason, conv.id, str(exc))
            continue
        ids = [conv.id if k == 0 else f"{conv.id}#{k}" for k in range(len(records))]
        taken = next((i for i in ids if i in emitted), None)
        if taken is not None:
            stats.drop("duplicate_id", conv.id, f"its record id {taken!r} is an earlier record's (a template that rewrites "
                                                "history splits a conversation into records <id>, <id>#1, ...)")
            continue
        emitted.update(ids)
        for exc in dropped:  # the conversation is kept without the turns no rendering can give
            stats.fix(f"turns_dropped_{exc.reason}", conv.id, str(exc))
        for i, rule, note in notes:  # kept, but rendered otherwise than the template renders them
            stats.fix(rule, conv.id, f"assistant turn {i}: {note}")
        if len(records) > 1:
            stats.fix("split_by_template", conv.id, f"{len(records)} records: the template rewrites earlier turns")
        for k, segs in enumerate(records):
            yield TemplatedConversation(ids[k], conv.id, segs, conv.messages,
                                        len(past) if k == len(records) - 1 else 0)


def template_split(tokenizer, data: SplitConversations, eos_ids: Iterable[int], max_length: int
                   ) -> dict[str, list[TemplatedConversation]]:
    """``{split: [TemplatedConversation]}`` for both splits; drops counted in ``data.stats``.

    Raises:
        UserInputError: no conversation could be templated (first offending record named).
    """
    out = {s: list(template_conversations(tokenizer, getattr(data, s), eos_ids, max_length, data.stats)) for s in SPLITS}
    if not any(out.values()):
        raise UserInputError(f"no usable conversation after templating (records read {data.stats.records}, dropped "
                             f"{dict(sorted(data.stats.dropped.items()))}{_first_drop(data.stats)})")
    return out


def iter_templated(data_cfg, tokenizer, eos_ids: Iterable[int], split: str = "train",
                   stats: ReadStats | None = None) -> Iterator[TemplatedConversation]:
    """Stream one split's templated conversations (for online training; no base model needed).

    Reads the sources lazily (``data.max_conversations`` caps the conversations read over both
    splits, as in :func:`read_split`); ``stats`` collects the counts.

    Raises:
        UserInputError: as :func:`read_split` for the split key and root ids (:class:`Splitter`), when
            the reading reaches the offending conversation.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; choices: {SPLITS}")
    stats = stats if stats is not None else ReadStats()
    specs = source_specs(data_cfg)
    limit = data_cfg.get("max_conversations")
    split_by_id = Splitter(data_cfg)

    def convs() -> Iterator[Conversation]:
        n = 0
        for k, conv in mix(specs):
            n += 1
            if split_by_id(specs[k].name, conv.id) == split:
                yield conv
            if limit is not None and n >= int(limit):
                break
        for s in specs:
            stats.merge(s.stats)

    yield from template_conversations(tokenizer, convs(), eos_ids, int(data_cfg.max_length), stats)


def heldout_prompts(data_cfg, limit: int | None = None) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """Yield ``(id, messages)`` for held-out conversations: the messages up to and including the
    first user turn (after an optional system turn), ready for ``apply_chat_template(...,
    add_generation_prompt=True)``.  Scans all sources (not capped by ``max_conversations``);
    the split is by root id, so these are never in any training cache.

    Args:
        data_cfg: the ``data`` config section.
        limit: stop after this many prompts (``None`` = all).

    Raises:
        UserInputError: as :func:`read_split` for the split key and root ids (:class:`Splitter`).
    """
    n = 0
    specs = source_specs(data_cfg)
    split = Splitter(data_cfg)
    for k, conv in mix(specs):
        if split(specs[k].name, conv.id) != "val":
            continue
        first_user = next(i for i, m in enumerate(conv.messages) if m["role"] == "user")
        yield conv.id, conv.messages[: first_user + 1]
        n += 1
        if limit is not None and n >= limit:
            return
