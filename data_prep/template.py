"""Chat templating and assistant-only loss masks, as inference sees each turn (issues 15, 28).

The ground truth for assistant turn ``i`` is the inference view: the tokens of
``apply_chat_template(messages[:i], add_generation_prompt=True)`` (the prompt the base model reads
when it writes turn i), then the turn as the base writes it, up to and including its end-of-turn
token.  Every turn is rendered on its own (:func:`_turn_view`), for any template:

* *header*: exactly the generation prompt's tokens (never in the loss);
* *body*: what follows the prompt in the template's rendering of turn i as the last message,
  ``render(messages[:i+1])`` (Qwen3-style templates write an empty ``<think>\n\n</think>\n\n``
  block there: the base writes it after the generation prompt, so it is in the loss), up to and
  including the first end-of-turn token (an eos id) after the reply text; a template whose
  rendering does not continue its own generation prompt, or leaves out part of the reply's text
  (DeepSeek-R1 strips the reasoning block from every reply), gets the prompt + the reply text + an
  end-of-turn token instead.  Token positions come from the fast tokenizer's offsets (a slow
  tokenizer needs the reply on token boundaries);
* *footer*: what follows in the rendering (e.g. ``\n``).

Turns are then packed into as few sequences ("records") as the template allows: turn i extends the
current record when the record's tokens are a token prefix of turn i's view (every prefix-stable
template, e.g. ChatML: one record per conversation); otherwise (templates that rewrite history,
e.g. Qwen3 stripping reasoning from earlier replies, templates that trim earlier turns) turn i
starts a new record whose context is its own inference view.  Every body is thus preceded by
exactly the tokens inference would see.

Per-turn faults raise :class:`TemplateError` with a reason.  A turn no rendering can give its
inference view is dropped and counted (``turns_dropped_<reason>`` in the data-prep summary and the
manifest), the conversation's other turns are kept; a conversation none of whose turns can be
templated is dropped under the first turn's reason:

* ``special_token_text``: the turn or a message before it contains the text of a special token
  (e.g. ``<|im_end|>``).  ``apply_chat_template`` would encode it as the real control token at
  inference time too, so no faithful rendering exists;
* ``template_error``: the template raised (e.g. ``raise_exception`` in a Llama-2/Mistral template);
* ``template_mismatch``: neither view continues the generation prompt's tokens with an
  end-of-turn token.

The loss mask is True on assistant bodies only (METHODS.md §0: m_t = 1 on assistant tokens).  An assistant
turn marked ``"train": False`` (:func:`data_prep.sharegpt.normalize`) is context, like a user turn: it gets no
segment, and its tokens are in the next trained turn's header.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from core.chat_template import apply_chat_template
from data_prep.sharegpt import trained_turn


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
    turn: int = -1   # the assistant turn's index in the conversation's messages


def _render_text(tokenizer, messages: Sequence[dict], conversation_id: str, add_generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    try:
        return apply_chat_template(tokenizer, messages, tokenize=False, add_generation_prompt=add_generation_prompt)
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


def pad_token_id(tokenizer, eos_ids=()) -> int:
    """The id that pads a batch: the tokenizer's pad token, else its eos, else the smallest of the
    base's end-of-turn ids ``eos_ids`` (a tokenizer with neither token, whose eos comes from
    ``generation_config.json``).  Padded positions are masked by length everywhere, so any of these
    gives the same features.

    Raises:
        UserInputError: none of the three exists (the tokenizer and the base name no token to pad with).
    """
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    if eos_ids:
        return min(int(e) for e in eos_ids)
    from core.config import UserInputError

    raise UserInputError(f"{type(tokenizer).__name__} has no pad or eos token and the base's generation config "
                         "names no eos id: set the tokenizer's pad_token (tokenizer_config.json)")


def _eos_text(tokenizer, eos_ids: set[int]) -> str | None:
    """The text of an end-of-turn token (the tokenizer's eos when it is one of ``eos_ids``)."""
    eid = tokenizer.eos_token_id if tokenizer.eos_token_id in eos_ids else (min(eos_ids) if eos_ids else None)
    return None if eid is None else tokenizer.convert_ids_to_tokens(int(eid))


def _reply_view(tokenizer, text: str, gen_ids: list[int], gen_len: int, reply: str, eos_ids: set[int]
                ) -> tuple[list[int], int] | None:
    """Tokens of ``text`` (the prompt ``text[:gen_len]`` + a reply) and the end of the reply's span,
    or None when ``text`` does not continue the prompt's tokens or has no end-of-turn after it.

    The span runs from the end of the prompt to the first end-of-turn token at or after the reply
    text (anything a template writes in front of the reply, e.g. an empty think block, is part of
    what the base writes after the generation prompt, so it is in the span)."""
    pos = text.find(reply, gen_len) if reply else -1
    reply_end = pos + len(reply) if pos >= 0 else gen_len
    try:
        enc = _encode(tokenizer, text, offsets=True)
        offs = enc["offset_mapping"]
    except NotImplementedError:  # a slow (Python) tokenizer has no offsets: token counts of text prefixes
        enc, offs = _encode(tokenizer, text), None
    ids = list(enc["input_ids"])
    if ids[: len(gen_ids)] != gen_ids:
        return None
    if offs is None:
        upto = list(_encode(tokenizer, text[:reply_end])["input_ids"])
        if ids[: len(upto)] != upto:
            return None
        first = max(len(upto), len(gen_ids))
        end = next((t + 1 for t in range(first, len(ids)) if ids[t] in eos_ids), None)
    else:
        end = next((t + 1 for t in range(len(gen_ids), len(ids)) if ids[t] in eos_ids and offs[t][0] >= reply_end),
                   None)
    if end is None or end - len(gen_ids) < 2:  # the reply, not an end-of-turn alone
        return None
    return ids, end


def _keeps_reply(text: str, gen_len: int, reply: str) -> bool:
    """Whether ``text`` (a rendering of the reply after the generation prompt ``text[:gen_len]``) holds the
    reply's text whole, whitespace aside (templates trim replies or reformat a think block's newlines); a template
    that strips a reasoning block from every reply, the last included (DeepSeek-R1's), does not."""
    return "".join(reply.split()) in "".join(text[gen_len:].split())


def _after_opening(gen_text: str, past_text: str, content: str) -> str:
    """``content`` without the opening the generation prompt already wrote: a prompt that opens the reply
    (DeepSeek-R1-Distill's ``<｜Assistant｜><think>\\n``) is followed by the rest of a reply that starts with
    that opening, not by the whole reply, which would repeat it.  The opening is the longest tail of the
    prompt's own text (``gen_text`` past ``past_text``, the rendering of the messages before the turn) that
    starts after whitespace and, trailing whitespace aside, begins the reply; ``content`` unchanged when none does."""
    if not gen_text.startswith(past_text):
        return content
    head, text = gen_text[len(past_text):], content.lstrip()
    for k in range(len(head)):
        if k and not head[k - 1].isspace():
            continue
        tail = head[k:].rstrip()
        if tail and text.startswith(tail):
            rest = text[len(tail):]
            return rest.lstrip() if len(tail) < len(head) - k else rest  # the prompt holds the whitespace after it
    return content


def _turn_view(tokenizer, messages: Sequence[dict], i: int, conversation_id: str, eos_ids: set[int],
               specials: Sequence[str] = ()) -> tuple[list[int], int, int, str | None]:
    """Assistant turn ``i`` as inference sees it: ``(ids, prompt_len, body_end, note)``.

    ``ids[:prompt_len]`` are exactly the tokens of ``apply_chat_template(messages[:i],
    add_generation_prompt=True)`` (what the base reads when it writes turn i), ``ids[prompt_len:
    body_end]`` the turn as the base writes it, up to and including its end-of-turn token, and
    ``ids[body_end:]`` the template's footer.  The reply is the template's own rendering of turn i
    as the last message (``render(messages[:i+1])``, so a template's formatting of the reply, e.g.
    Qwen3's think block, is kept) when that rendering continues the generation prompt; else the
    prompt followed by the reply text and an end-of-turn token (templates whose generation prompt
    differs from how they render a past reply, or whose rendering leaves out part of the reply's text).
    ``note`` is None, or ``(rule, message)`` saying why the template's own rendering, which does continue
    the prompt, was not used (counted by the caller under ``rule``, never silent): ``turns_closed_with_eos``,
    it ends the reply with no end-of-turn id of the base (a ``generation_config.json`` that lacks the
    template's end-of-turn token), so the reply is closed with the eos token instead;
    ``turns_rendered_from_data``, it leaves out part of the reply's text (DeepSeek-R1's template strips
    the reasoning block from every reply, the last one included, while the base writes it).  Where the prompt
    itself opens the reply (DeepSeek-R1-Distill's ``<think>\\n``), the data's reply follows it without that
    opening (:func:`_after_opening`; ``turns_opening_in_prompt``).

    Raises:
        TemplateError: ``special_token_text`` (the turn or its context holds a special token's text),
            ``template_error`` (the template raised) or ``template_mismatch`` (neither view works).
    """
    where = f"conversation {conversation_id!r}, assistant turn {i}"
    for t, m in enumerate(messages[: i + 1]):
        hit = next((sp for sp in specials if sp in m["content"]), None)
        if hit is not None:
            raise TemplateError(f"{where}: turn {t} contains the special-token text {hit!r}", "special_token_text")
    gen_text = _render_text(tokenizer, messages[:i], conversation_id, add_generation_prompt=True)
    gen_ids = list(_encode(tokenizer, gen_text)["input_ids"])
    full_text = _render_text(tokenizer, messages[: i + 1], conversation_id)
    reply = messages[i]["content"].strip()
    eos_text = _eos_text(tokenizer, eos_ids)
    own = full_text.startswith(gen_text)
    note = None
    if own and not _keeps_reply(full_text, len(gen_text), reply):
        own = False  # the template's rendering leaves out part of the reply: what the base writes is the data's reply
        note = ("turns_rendered_from_data",
                "the template's rendering of the reply leaves out part of its text (e.g. a reasoning block it strips "
                f"from every reply), so the reply as the data has it follows the generation prompt, closed with "
                f"{eos_text!r}")
    candidates = [full_text] if own else []
    if eos_text is not None:
        content = messages[i]["content"]
        if not own:  # a prompt that opens the reply (a think block) is followed by the rest of it, not all of it
            content = _after_opening(gen_text, _render_text(tokenizer, messages[:i], conversation_id), content)
            if content != messages[i]["content"] and note is None:
                note = ("turns_opening_in_prompt", "the generation prompt opens the reply with what the data's reply "
                        f"starts with ({messages[i]['content'][:len(messages[i]['content']) - len(content)].strip()!r}); "
                        "the reply follows the prompt without it")
        candidates.append(gen_text + content + eos_text)
    for k, text in enumerate(candidates):
        view = _reply_view(tokenizer, text, gen_ids, len(gen_text), reply, eos_ids)
        if view is not None:
            ids, end = view
            return ids, len(gen_ids), end, note
        if k == 0 and own:
            note = ("turns_closed_with_eos",
                    f"the template ends the reply with no end-of-turn id of the base (eos ids {sorted(eos_ids)}); "
                    f"closed with {eos_text!r} instead: if the template's own end-of-turn token ends the base's "
                    "replies, add it to the model folder's generation_config.json eos_token_id")
    raise TemplateError(f"{where}: neither the template's rendering of the turn nor the generation prompt followed by "
                        f"the reply continues the prompt's tokens with an end-of-turn token (eos ids {sorted(eos_ids)})")


def _past(messages: Sequence[dict], start: int, out: list | None) -> None:
    """Append to ``out`` (when given) the indices of the trained assistant turns from message ``start`` on."""
    if out is not None:
        out.extend(j for j in range(start, len(messages)) if trained_turn(messages[j]))


def segment_records(tokenizer, messages: Sequence[dict], conversation_id: str, eos_ids: Iterable[int],
                    max_length: int | None = None, dropped_turns: list | None = None,
                    past_max_length: list | None = None, notes: list | None = None) -> list[list[Segment]]:
    """Template a conversation into records of assistant :class:`Segment` s (module doc).

    Args:
        tokenizer: a fast tokenizer with a chat template.
        messages: normalised ``[{"role", "content"}, ...]`` ending with an assistant turn.
        conversation_id: used in error messages.
        eos_ids: end-of-turn token ids (:func:`end_of_turn_ids`).
        max_length: stop at the first turn whose rendering reaches this many tokens (later
            turns would be truncated away); ``None`` = all turns.
        dropped_turns: optional list; each assistant turn that no rendering can give its inference
            view is skipped (the other turns are kept) and appended as a :class:`TemplateError`.
            Without it such a turn raises (nothing is dropped uncounted).
        past_max_length: optional list; receives the message index of each assistant turn not templated
            because an earlier turn's rendering reached ``max_length`` (counted, not silently gone).
        notes: optional list; receives ``(message index, rule, note)`` for each turn templated otherwise than
            by the template's own rendering of it (:func:`_turn_view`).

    Returns:
        one list of segments per record (usually one record).  In a record, segment ``k``'s ids
        are ``header + body + footer``: the header holds every token since the previous
        segment (the previous footer, user turns, the generation prompt), so the tokens before each
        body are exactly its turn's generation prompt, and the concatenation of a record's
        segments is the view of its last turn.

    Raises:
        TemplateError: with ``reason`` in :data:`TEMPLATE_REASONS` when no assistant turn can be
            templated (the first turn's error), or ``no_assistant_tokens``.
    """
    eos_ids = set(eos_ids)
    specials = special_token_texts(tokenizer)
    records: list[list[Segment]] = []
    cur: list[int] | None = None
    errors: list[TemplateError] = []
    for i, msg in enumerate(messages):
        if not trained_turn(msg):
            continue
        try:
            ids, prompt_len, end, note = _turn_view(tokenizer, messages, i, conversation_id, eos_ids, specials)
        except TemplateError as exc:
            errors.append(exc)
            continue
        if max_length is not None and prompt_len >= max_length:
            _past(messages, i, past_max_length)
            break
        if note is not None and notes is not None:
            notes.append((i, *note))
        if cur is not None and ids[: len(cur)] == cur:
            records[-1].append(Segment("assistant", ids[len(cur):], header=prompt_len - len(cur), body=end - prompt_len,
                                       turn=i))
        else:
            records.append([Segment("assistant", ids, header=prompt_len, body=end - prompt_len, turn=i)])
        cur = ids
        if max_length is not None and len(ids) >= max_length:
            _past(messages, i + 1, past_max_length)
            break
    if not records:
        if errors:
            raise errors[0]
        raise TemplateError(f"conversation {conversation_id!r}: the first reply starts beyond max_length={max_length}",
                            "no_assistant_tokens")
    if errors and dropped_turns is None:  # a caller that does not count dropped turns gets none dropped
        raise errors[0]
    if dropped_turns is not None:
        dropped_turns.extend(errors)
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
