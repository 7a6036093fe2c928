"""Multi-turn evaluation prompts (Spec-Bench / MT-bench conventions).

MT-bench's turn 2 is asked after the model's own turn-1 answer.  In a lossless comparison that
answer is vanilla greedy decoding's (every lossless method produces the same tokens), so turn 2's
prompt is identical for every method and is built once from the vanilla pass of turn 1.

The prompt is what a chat server with a session KV cache sees: the turn-1 prompt tokens, then
the answer tokens exactly as generated (a trailing end-of-sequence token dropped, since the
template closes the assistant turn itself), then the base tokenizer's chat template for the
rest of the conversation (closing the assistant turn, the next user turn, the generation
prompt).  The answer is never re-tokenized, so turn 2 contains turn 1's answer token for token;
the text of the whole prompt equals the template rendered over the decoded answer.
"""
from __future__ import annotations

from typing import Sequence

import torch

from evaluation.prompts import Prompt, PromptError


def turn_id(prompt_id: str, turn: int) -> str:
    """The progress/record id of a prompt's ``turn`` (1-based): the prompt id for turn 1 (so
    first-turn results keep their ids), ``<id>/turn<k>`` after."""
    return str(prompt_id) if turn == 1 else f"{prompt_id}/turn{turn}"


def _render(tokenizer, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def follow_up_prompt(tokenizer, prompt: Prompt, answer_tokens: Sequence[int], eos_ids: Sequence[int]) -> Prompt:
    """The next turn's prompt after ``prompt`` was answered with ``answer_tokens``.

    Args:
        tokenizer: the base tokenizer (with the chat template used for ``prompt``).
        prompt: a prompt with at least one pending ``follow_ups`` entry.
        answer_tokens: the answer to ``prompt`` (vanilla greedy's token ids, as generated; a
            trailing token in ``eos_ids`` is dropped).
        eos_ids: end-of-sequence token ids of the base model.

    Returns:
        A :class:`Prompt` with id :func:`turn_id` ``(base id, turn + 1)``, messages extended by the
        assistant answer (decoded text) and the next user turn, ``input_ids`` LongTensor [T'] =
        ``prompt.input_ids`` + answer tokens + template tail, and the remaining ``follow_ups``.

    Raises:
        PromptError: ``prompt`` has no follow-up turn, or the chat template does not render the
            assistant message verbatim after the previous turn (it rewrites history, e.g.
            strips reasoning or whitespace), so no prompt can contain the answer token for token;
            the message names the prompt.
    """
    if not prompt.follow_ups:
        raise PromptError(f"prompt {prompt.id!r}: no follow-up turn after turn {prompt.turn}")
    answer = [int(t) for t in answer_tokens]
    eos = {int(e) for e in eos_ids}
    while answer and answer[-1] in eos:
        answer.pop()
    answer_text = tokenizer.decode(answer, skip_special_tokens=False)
    head_text = _render(tokenizer, prompt.messages)
    messages = list(prompt.messages) + [{"role": "assistant", "content": answer_text},
                                        {"role": "user", "content": prompt.follow_ups[0]}]
    full_text = _render(tokenizer, messages)
    base_id = prompt.id.rsplit("/turn", 1)[0] if prompt.turn > 1 else prompt.id
    if not full_text.startswith(head_text + answer_text):
        raise PromptError(f"prompt {turn_id(base_id, prompt.turn + 1)!r}: the chat template does not render the "
                          "turn-1 answer verbatim after the turn-1 prompt, so turn 2 cannot hold it token for token")
    tail = tokenizer(full_text[len(head_text) + len(answer_text):], add_special_tokens=False)["input_ids"]
    ids = torch.cat([prompt.input_ids.reshape(-1), torch.tensor(answer + list(tail), dtype=torch.long)])
    return Prompt(turn_id(base_id, prompt.turn + 1), messages, ids, prompt.category, tuple(prompt.follow_ups[1:]),
                  prompt.turn + 1)


def turns_to_run(setting, prompt: Prompt) -> int:
    """How many turns of ``prompt`` ``eval.turns`` asks for: 1, 2 or ``all`` (every turn it has).

    Raises:
        ValueError: ``setting`` is none of 1, 2, ``all``.
    """
    if str(setting) == "all":
        return 1 + len(prompt.follow_ups)
    if str(setting) in ("1", "2"):
        return min(int(setting), 1 + len(prompt.follow_ups))
    raise ValueError(f"eval.turns={setting!r}: expected 1, 2 or all")


def length_bound(tokenizer, prompt: Prompt, turn: int, max_new_tokens: int) -> int:
    """An upper bound on the tokens of ``prompt``'s ``turn`` prompt plus its answer (before any
    decoding): the template rendered with empty assistant answers for the earlier turns, plus
    ``max_new_tokens`` per answered and the generated turn (+1 per turn for a token merge at the
    answer's edges)."""
    from evaluation.prompts import template

    messages = list(prompt.messages)
    for t in prompt.follow_ups[:turn - 1]:
        messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": t}]
    return int(template(tokenizer, messages).numel()) + turn * (int(max_new_tokens) + 1)
