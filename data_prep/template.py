"""Chat templating and assistant-only loss masks from the template's structure.

The conversation is rendered with the tokenizer's own ``apply_chat_template``.  Token spans are
found by rendering prefixes turn by turn (never by searching the text):

* turn ``i`` owns the tokens between ``render(messages[:i])`` and ``render(messages[:i+1])``;
* an assistant turn's *header* (e.g. ``<|im_start|>assistant\\n``) ends where
  ``render(messages[:i], add_generation_prompt=True)`` ends;
* its *body* is what the model emits: the content up to and including the last end-of-turn
  token (an eos id) of the span; what follows it is the template's *footer* (e.g. ``\\n``).

The loss mask is True on assistant bodies only (METHODS.md §0: m_t = 1 on assistant tokens).
Every prefix rendering must be a token prefix of the next; a template for which this fails
raises :class:`TemplateError` naming the conversation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


class TemplateError(ValueError):
    """The chat template is not prefix-stable for a conversation (names the conversation id)."""


@dataclass
class Segment:
    """The tokens of one turn.  For assistant turns ``ids = header + body + footer``."""

    role: str
    ids: list[int]
    header: int = 0  # tokens before the body (assistant turns)
    body: int = 0    # assistant tokens (loss mask True); 0 for other roles


def _render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = False) -> list[int]:
    if not messages:
        return []
    out = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=False,
                                        add_generation_prompt=add_generation_prompt)
    return list(out)


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


def segment_conversation(tokenizer, messages: Sequence[dict], conversation_id: str, eos_ids: Iterable[int],
                         max_length: int | None = None) -> list[Segment]:
    """Split the templated conversation into per-turn :class:`Segment` s.

    Args:
        tokenizer: a tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]``.
        conversation_id: used in error messages.
        eos_ids: end-of-turn token ids (:func:`end_of_turn_ids`).
        max_length: stop after the first turn that reaches this many tokens (later turns
            would be truncated away); ``None`` = all turns.

    Returns:
        the segments; their concatenation equals ``apply_chat_template(messages[:k])`` for
        the ``k`` turns returned.

    Raises:
        TemplateError: a prefix rendering is not a prefix of the next rendering, or an
            assistant turn has no end-of-turn token.
    """
    eos_ids = set(eos_ids)
    segments: list[Segment] = []
    prev: list[int] = []
    for i, msg in enumerate(messages):
        full = _render(tokenizer, messages[: i + 1])
        if full[: len(prev)] != prev:
            raise TemplateError(f"conversation {conversation_id!r}: chat template is not prefix-stable at turn {i}")
        ids = full[len(prev):]
        if msg["role"] == "assistant":
            gen = _render(tokenizer, messages[:i], add_generation_prompt=True)
            if gen[: len(prev)] != prev or full[: len(gen)] != gen:
                raise TemplateError(
                    f"conversation {conversation_id!r}: generation prompt is not a prefix of assistant turn {i}")
            header = len(gen) - len(prev)
            ends = [j for j in range(header, len(ids)) if ids[j] in eos_ids]
            if not ends:
                raise TemplateError(f"conversation {conversation_id!r}: assistant turn {i} has no end-of-turn token "
                                    f"(eos ids {sorted(eos_ids)})")
            segments.append(Segment("assistant", ids, header=header, body=ends[-1] + 1 - header))
        else:
            segments.append(Segment(msg["role"], ids))
        prev = full
        if max_length is not None and len(prev) >= max_length:
            break
    return segments


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
