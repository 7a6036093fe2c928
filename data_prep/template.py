"""Chat templating and assistant-only loss masks, as inference sees each turn (issue 15).

The ground truth for assistant turn ``i`` is the inference view: the tokens of
``apply_chat_template(messages[:i], add_generation_prompt=True)`` (the prompt the base model sees
when it writes turn i), then the reply, then the end-of-turn token.  Turn i is rendered on its own,
as ``render(messages[:i+1])`` (the template sees turn i as the last message, exactly as at inference
time), and split by the template's structure, never by searching token ids:

* *header*: the generation prompt plus whatever the template puts between it and the reply text
  (Qwen3-style templates put an empty ``<think>\n\n</think>\n\n`` block there; it belongs to the
  prompt and is never in the loss);
* *body*: from the first token holding a character of the reply (found in the rendered text,
  token positions from the fast tokenizer's offsets; a slow tokenizer needs the reply on token
  boundaries) up to and including the first end-of-turn token (an eos id) after the reply;
* *footer*: what follows (e.g. ``\n``).

Turns are then packed into as few sequences ("records") as the template allows: turn i extends the
current record when the record's tokens are a token prefix of turn i's rendering (every
prefix-stable template, e.g. ChatML: one record per conversation); otherwise (templates that
rewrite history, e.g. Qwen3 stripping reasoning from earlier replies) turn i starts a new record
whose context is its own inference view.  Every body is thus preceded by exactly the tokens
inference would see.

Per-record faults raise :class:`TemplateError` with a reason (the caller counts and skips the record):

* ``special_token_text``: a message contains the text of a special token (e.g. ``<|im_end|>``).
  ``apply_chat_template`` would encode it as the real control token at inference time too, so no
  faithful rendering exists; the record is skipped;
* ``template_error``: the template raised (e.g. ``raise_exception`` in a Llama-2/Mistral template);
* ``template_mismatch``: the generation prompt is not a prefix of the rendered turn, the reply
  text is not in the rendering, or no end-of-turn token follows it.

The loss mask is True on assistant bodies only (METHODS.md §0: m_t = 1 on assistant tokens).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


#: reasons a record fails templating (counted like the reader's drop reasons)
TEMPLATE_REASONS = ("special_token_text", "template_error", "template_mismatch")


class TemplateError(ValueError):
    """A record that cannot be templated faithfully.  ``reason`` is one of :data:`TEMPLATE_REASONS`;
    the message names the conversation id."""

    def __init__(self, message: str, reason: str = "template_mismatch"):
        super().__init__(message)
        self.reason = reason


@dataclass
class Segment:
    """The tokens of one turn.  For assistant turns ``ids = header + body + footer``."""

    role: str
    ids: list[int]
    header: int = 0  # tokens before the body (assistant turns)
    body: int = 0    # assistant tokens (loss mask True); 0 for other roles


def _render_text(tokenizer, messages: Sequence[dict], conversation_id: str, add_generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja2 TemplateError from raise_exception, TypeError, ...: one record, never the run
        msg = str(exc).splitlines()[0] if str(exc) else ""
        raise TemplateError(f"conversation {conversation_id!r}: chat template raised {type(exc).__name__}: {msg}",
                            "template_error") from exc


def _encode(tokenizer, text: str, offsets: bool = False):
    # apply_chat_template(tokenize=True) tokenizes the rendered text without adding special tokens
    return tokenizer(text, add_special_tokens=False, return_offsets_mapping=offsets)


def special_token_texts(tokenizer) -> list[str]:
    """The strings of the tokenizer's special tokens (those ``apply_chat_template`` turns into control ids)."""
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            texts.add(str(tok.content))
    return sorted(t for t in texts if t)


def end_of_turn_ids(tokenizer, model=None) -> set[int]:
    """Token ids that end an assistant turn: the tokenizer's eos plus the model's generation eos ids."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    return ids


def _turn_view(tokenizer, messages: Sequence[dict], i: int, conversation_id: str, eos_ids: set[int]
               ) -> tuple[list[int], int, int, int]:
    """Render assistant turn ``i`` as the last message: ``(ids, prompt_len, body_start, body_end)``."""
    gen_text = _render_text(tokenizer, messages[:i], conversation_id, add_generation_prompt=True)
    full_text = _render_text(tokenizer, messages[: i + 1], conversation_id)
    where = f"conversation {conversation_id!r}, assistant turn {i}"
    if not full_text.startswith(gen_text):
        raise TemplateError(f"{where}: the generation prompt is not a prefix of the rendered turn")
    reply = messages[i]["content"].strip()
    pos = full_text.find(reply, len(gen_text))
    if pos < 0:
        raise TemplateError(f"{where}: the reply text is not in the template's rendering (the template rewrites it)")
    try:
        enc = _encode(tokenizer, full_text, offsets=True)
        offs = enc["offset_mapping"]
    except NotImplementedError:  # a slow (Python) tokenizer has no offsets: token counts of text prefixes
        enc, offs = _encode(tokenizer, full_text), None
    ids = list(enc["input_ids"])
    gen_ids = list(_encode(tokenizer, gen_text)["input_ids"])
    if ids[: len(gen_ids)] != gen_ids:
        raise TemplateError(f"{where}: the generation prompt's tokens are not a prefix of the rendered turn's tokens")
    reply_end = pos + len(reply)
    if offs is None:
        head = list(_encode(tokenizer, full_text[:pos])["input_ids"])
        upto = list(_encode(tokenizer, full_text[:reply_end])["input_ids"])
        if ids[: len(head)] != head or ids[: len(upto)] != upto:
            raise TemplateError(f"{where}: the reply does not start or end on a token boundary")
        start = len(head)
        end = next((t + 1 for t in range(len(upto), len(ids)) if ids[t] in eos_ids), None)
    else:
        start = next((t for t in range(len(gen_ids), len(ids)) if offs[t][1] > pos), len(ids))
        end = next((t + 1 for t in range(start, len(ids)) if ids[t] in eos_ids and offs[t][0] >= reply_end), None)
    if end is None or start >= end - 1:
        raise TemplateError(f"{where}: no end-of-turn token (eos ids {sorted(eos_ids)}) after the reply")
    return ids, len(gen_ids), start, end


def segment_records(tokenizer, messages: Sequence[dict], conversation_id: str, eos_ids: Iterable[int],
                    max_length: int | None = None) -> list[list[Segment]]:
    """Template a conversation into records of assistant :class:`Segment` s (module doc).

    Args:
        tokenizer: a fast tokenizer with a chat template.
        messages: normalised ``[{"role", "content"}, ...]`` ending with an assistant turn.
        conversation_id: used in error messages.
        eos_ids: end-of-turn token ids (:func:`end_of_turn_ids`).
        max_length: stop at the first turn whose rendering reaches this many tokens (later
            turns would be truncated away); ``None`` = all turns.

    Returns:
        one list of segments per record (usually one record).  In a record, segment ``k``'s ids
        are ``header + body + footer``: the header holds every token since the previous
        segment (user turns, the generation prompt, a template's empty think block), so the
        concatenation of a record's segments is the rendering of its last turn.

    Raises:
        TemplateError: with ``reason`` in :data:`TEMPLATE_REASONS`.
    """
    eos_ids = set(eos_ids)
    specials = special_token_texts(tokenizer)
    for t, m in enumerate(messages):
        hit = next((sp for sp in specials if sp in m["content"]), None)
        if hit is not None:
            raise TemplateError(f"conversation {conversation_id!r}: turn {t} contains the special-token text {hit!r}",
                                "special_token_text")
    records: list[list[Segment]] = []
    cur: list[int] | None = None
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        ids, prompt_len, start, end = _turn_view(tokenizer, messages, i, conversation_id, eos_ids)
        if max_length is not None and prompt_len >= max_length:
            break
        if cur is not None and ids[: len(cur)] == cur:
            records[-1].append(Segment("assistant", ids[len(cur):], header=start - len(cur), body=end - start))
        else:
            records.append([Segment("assistant", ids, header=start, body=end - start)])
        cur = ids
        if max_length is not None and len(ids) >= max_length:
            break
    if not records:
        raise TemplateError(f"conversation {conversation_id!r}: the first reply starts beyond max_length={max_length}",
                            "no_assistant_tokens")
    return records


def segment_conversation(tokenizer, messages: Sequence[dict], conversation_id: str, eos_ids: Iterable[int],
                         max_length: int | None = None) -> list[Segment]:
    """:func:`segment_records` for a conversation that fits one record (a prefix-stable template).

    Raises:
        TemplateError: as :func:`segment_records`, or ``template_mismatch`` when the template
            needs more than one record for this conversation.
    """
    records = segment_records(tokenizer, messages, conversation_id, eos_ids, max_length)
    if len(records) != 1:
        raise TemplateError(f"conversation {conversation_id!r}: the chat template is not prefix-stable "
                            f"({len(records)} records)")
    return records[0]


def flatten(segments: Sequence[Segment], max_length: int | None = None) -> tuple[list[int], list[bool]]:
    """Concatenate segments into ``(input_ids, loss_mask)``, truncated to ``max_length`` tokens.

    ``loss_mask[t]`` is True iff token t lies in an assistant body.
    """
    ids: list[int] = []
    mask: list[bool] = []
    for seg in segments:
        ids.extend(seg.ids)
        m = [False] * len(seg.ids)
        for j in range(seg.header, seg.header + seg.body):
            m[j] = True
        mask.extend(m)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


def encode_conversation(tokenizer, messages: Sequence[dict], conversation_id: str = "?",
                        max_length: int | None = None, eos_ids: Iterable[int] | None = None
                        ) -> tuple[list[int], list[bool]]:
    """Template + tokenise a conversation: ``(input_ids, loss_mask)`` (lists of length T <= max_length).

    See :func:`segment_conversation` for how assistant spans are found.
    """
    eos = set(eos_ids) if eos_ids is not None else end_of_turn_ids(tokenizer)
    return flatten(segment_conversation(tokenizer, messages, conversation_id, eos, max_length), max_length)
