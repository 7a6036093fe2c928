"""What the base reads after it wrote an answer: the next turn's prompt, as a chat server builds it.

One rule serves the evaluation's multi-turn prompts (:func:`evaluation.turns.follow_up_prompt`) and
regeneration's later turns (:func:`data_prep.labels.regenerate`), so a regenerated conversation's
turn k is trained on exactly the context the evaluation decodes it from.

The conversation so far is rendered with the answer as decoded text (its trailing end-of-turn token
dropped: the template closes the turn itself).  Where that rendering extends the previous prompt by
the answer verbatim (prefix-stable templates such as ChatML), the new prompt is the previous prompt's
tokens, the answer's tokens exactly as generated and the template's tokens for the rest (closing the
turn, the next messages, the generation prompt): what a server with a session KV cache sees, never a
re-tokenized answer.  Where the template rewrites earlier turns (Qwen3 strips reasoning from earlier
replies, window templates drop them, a DeepSeek-R1-style generation prompt opens a think block its
rendering of past replies lacks), no prompt can hold the answer token for token, and the prompt is
the template's own tokenization of the whole conversation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from core.chat_template import apply_chat_template


@dataclass(frozen=True)
class FollowUp:
    """The next prompt after an answer (:func:`follow_up`).

    Attributes:
        ids: the prompt's token ids.
        answer_text: the answer as the conversation now holds it (decoded, end-of-turn dropped).
        extended: True when ``ids`` = previous prompt + answer tokens (as generated, end-of-turn
            dropped) + the template's tail; False when the template rewrote earlier turns and
            ``ids`` is its tokenization of the whole conversation.
        tail: the template's tokens after the answer (``ids[len(prompt) + len(answer):]``) when
            ``extended``, else empty.
    """

    ids: list[int]
    answer_text: str
    extended: bool
    tail: list[int]


def follow_up(tokenizer, messages: Sequence[dict], prompt_ids: Iterable[int], answer_ids: Iterable[int],
              next_messages: Sequence[dict], eos_ids: Iterable[int]) -> FollowUp:
    """The prompt that follows ``messages`` answered with ``answer_ids`` and then ``next_messages``.

    Args:
        tokenizer: the base tokenizer with its chat template.
        messages: the conversation the answer replies to (``[{"role", "content"}]``, ending with the
            turn before the answer); ``prompt_ids`` is its rendering with the generation prompt.
        prompt_ids: the token ids the base read before writing the answer.
        answer_ids: the answer as generated (a trailing token in ``eos_ids`` is dropped).
        next_messages: the messages after the answer (e.g. the next user turn).  Empty: the
            conversation ends with the answer, rendered without a generation prompt (``tail`` is then
            the template's closing tokens, e.g. ChatML's ``<|im_end|>\\n``).
        eos_ids: the base's end-of-turn token ids.

    Returns:
        :class:`FollowUp`.

    Raises:
        whatever the chat template raises for this conversation (jinja's ``TemplateError`` from
        ``raise_exception``, ``TypeError``, ...): callers name the record and turn.
    """
    answer = [int(t) for t in answer_ids]
    eos = {int(e) for e in eos_ids}
    while answer and answer[-1] in eos:
        answer.pop()
    answer_text = tokenizer.decode(answer, skip_special_tokens=False)
    conversation = list(messages) + [{"role": "assistant", "content": answer_text}] + list(next_messages)
    generation_prompt = bool(next_messages)
    head_text = apply_chat_template(tokenizer, list(messages), tokenize=False, add_generation_prompt=True)
    full_text = apply_chat_template(tokenizer, conversation, tokenize=False, add_generation_prompt=generation_prompt)
    if full_text.startswith(head_text + answer_text):
        tail = list(tokenizer(full_text[len(head_text) + len(answer_text):], add_special_tokens=False)["input_ids"])
        return FollowUp([int(t) for t in prompt_ids] + answer + tail, answer_text, True, tail)
    # the rendered text tokenized as apply_chat_template(tokenize=True) does (no special tokens added)
    ids = tokenizer(full_text, add_special_tokens=False)["input_ids"]
    return FollowUp([int(t) for t in ids], answer_text, False, [])
