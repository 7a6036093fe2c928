"""Multi-turn evaluation prompts (Spec-Bench / MT-bench conventions).

MT-bench's turn 2 is asked after the model's own turn-1 answer.  In a lossless comparison that
answer is vanilla greedy decoding's (every lossless method produces the same tokens), so turn 2's
prompt is identical for every method and is built once from the vanilla pass of turn 1.

The prompt is the chat template applied to the conversation so far with the vanilla answers, by
:func:`core.follow_up.follow_up` (the rule regeneration's later turns use too): the previous prompt,
the answer tokens as generated and the template's tail where the template extends the previous prompt
(``rendering`` "extended"), else the template's tokenization of the whole conversation (it rewrites
earlier turns: ``rendering`` "re-rendered").  Only a turn the template cannot render at all (it raises) has no correct prompt: that
turn, and the later turns that depend on it, are skipped and listed with the reason
(:func:`follow_up_prompt` raises :class:`evaluation.prompts.PromptError`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from core.follow_up import follow_up
from evaluation.prompts import Prompt, PromptError, turn_id



def follow_up_prompt(tokenizer, prompt: Prompt, answer_tokens: Sequence[int], eos_ids: Sequence[int]) -> Prompt:
    """The next turn's prompt after ``prompt`` was answered with ``answer_tokens`` (module doc).

    Args:
        tokenizer: the base tokenizer (with the chat template used for ``prompt``).
        prompt: a prompt with at least one pending ``follow_ups`` entry.
        answer_tokens: the answer to ``prompt`` (vanilla greedy's token ids, as generated; a
            trailing token in ``eos_ids`` is dropped).
        eos_ids: end-of-sequence token ids of the base model.

    Returns:
        A :class:`Prompt` with id :func:`turn_id` ``(base id, turn + 1)``, messages extended by the
        assistant answer (decoded text) and the next user turn, and the remaining ``follow_ups``.
        ``input_ids`` LongTensor [T'] = ``prompt.input_ids`` + answer tokens + template tail when
        the template extends the previous prompt by the answer verbatim (``rendering`` =
        "extended"); else the template's tokenization of the whole conversation (``rendering`` =
        "re-rendered": the template rewrites earlier turns).

    Raises:
        PromptError: ``prompt`` has no follow-up turn, or the chat template cannot render the
            conversation (it raises, e.g. a template for single-turn use only) or renders it empty;
            the message names the turn and the template's error.
    """
    base_id = prompt.id.rsplit("/turn", 1)[0] if prompt.turn > 1 else prompt.id
    if not prompt.follow_ups:
        raise PromptError(f"prompt {prompt.id!r}: no follow-up turn after turn {prompt.turn}")
    new_id = turn_id(base_id, prompt.turn + 1)
    user = {"role": "user", "content": prompt.follow_ups[0]}
    try:
        nxt = follow_up(tokenizer, prompt.messages, prompt.input_ids.reshape(-1).tolist(), answer_tokens, [user],
                        eos_ids)
    except Exception as exc:  # noqa: BLE001 — jinja's TemplateError, a template's raise_exception, ...
        raise PromptError(f"prompt {new_id!r}: the chat template cannot render this conversation "
                          f"({type(exc).__name__}: {exc})") from exc
    if not nxt.ids:
        raise PromptError(f"prompt {new_id!r}: the chat template renders this conversation empty")
    messages = list(prompt.messages) + [{"role": "assistant", "content": nxt.answer_text}, user]
    return Prompt(new_id, messages, torch.tensor(nxt.ids, dtype=torch.long), prompt.category,
                  tuple(prompt.follow_ups[1:]), prompt.turn + 1,
                  rendering="extended" if nxt.extended else "re-rendered")


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


def length_bound(tokenizer, prompt: Prompt, turn: int, max_new_tokens: int) -> int | None:
    """An upper bound on the tokens of ``prompt``'s ``turn`` prompt plus its answer (before any
    decoding): the template rendered with empty assistant answers for the earlier turns, plus
    ``max_new_tokens`` per answered and the generated turn (+1 per turn for a token merge at the
    answer's edges).  None when the template cannot render the conversation (that turn is then
    skipped with the template's error when it comes: :func:`follow_up_prompt`)."""
    from evaluation.prompts import template

    messages = list(prompt.messages)
    for t in prompt.follow_ups[:turn - 1]:
        messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": t}]
    try:
        n = int(template(tokenizer, messages).numel())
    except Exception:  # noqa: BLE001 — jinja's TemplateError, a template's raise_exception, ...
        return None
    return n + turn * (int(max_new_tokens) + 1)
