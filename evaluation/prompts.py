"""Evaluation prompts: held-out ShareGPT first turns, or any JSONL file of prompts.

Every prompt becomes chat messages ending in a user turn and is templated with the tokenizer's
chat template plus the generation prompt (``add_generation_prompt=True``), so the model answers
as the assistant, exactly as at data-prep time.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from core.chat_template import apply_chat_template
from data_prep.sharegpt import (TURN_LIST_KEYS, body_turns, is_null, message_role, replace_lone_surrogates, turn_keys,
                                turn_list, turn_text, unsupported_field)
from data_prep.template import special_token_texts

#: prompt fields, in the order they are looked for: a chat list before a single prompt string, as data prep reads a
#: record holding both (HuggingFaceH4/no_robots and ultrachat_200k keep ``prompt`` beside the whole ``messages``)
AUTO_FIELDS = ("turns", "conversations", "messages", "conversation", "prompt", "instruction", "question", "text")
#: chat-list fields: a list of turns, or that list kept as a JSON string (a CSV column), as data prep reads them
CHAT_FIELDS = TURN_LIST_KEYS
ID_FIELDS = ("question_id", "id", "prompt_id", "conversation_id")


class PromptError(ValueError):
    """A prompt file or record is unusable; the message names the file and line."""


@dataclass
class Prompt:
    """One templated prompt: ``id`` (str), ``messages`` (chat messages), ``input_ids`` LongTensor [T].

    ``category`` is the record's ``category`` field (MT-bench; None when absent); ``follow_ups``
    the record's later user turns (MT-bench ``turns[1:]``, decoded with ``eval.turns`` > 1, see
    :mod:`evaluation.turns`); ``turn`` the 1-based user turn this prompt ends in; ``rendering``
    how its tokens were built: ``template`` (the chat template over the messages), ``extended``
    or ``re-rendered`` (a later turn, :func:`evaluation.turns.follow_up_prompt`).
    """

    id: str
    messages: list[dict[str, str]]
    input_ids: torch.Tensor
    category: str | None = None
    follow_ups: tuple[str, ...] = ()
    turn: int = 1
    rendering: str = "template"


def turn_id(prompt_id: str, turn: int) -> str:
    """The progress/record id of a prompt's ``turn`` (1-based): the prompt id for turn 1 (so
    first-turn results keep their ids), ``<id>/turn<k>`` after."""
    return str(prompt_id) if turn == 1 else f"{prompt_id}/turn{turn}"


def _chat_messages(value: list, key: str, where: str) -> list[dict[str, str]]:
    """A ``messages`` prompt field read as data prep reads a ``messages`` record
    (:func:`data_prep.sharegpt.normalize`): roles mapped (``human`` -> user, ``gpt`` -> assistant), text
    parts joined, an empty system turn dropped, leading assistant turns dropped, consecutive turns of one role joined
    by a blank line; an unknown role, an empty user or assistant turn or a system turn after the first is refused, by
    message."""
    msgs = []
    for j, m in enumerate(value):
        role_key, text_key = turn_keys(m, "role")  # {role, content}, or a ShareGPT {from, value} as data prep reads
        text = turn_text(m.get(text_key)) if isinstance(m, dict) else None
        if text is None or role_key not in m:
            raise PromptError(f"{where}: field {key!r}[{j}] must be a {{role, content}} message or a ShareGPT "
                              "{from, value} turn (the text a string or a list of text parts)")
        role = message_role(m[role_key])
        if role is None:
            raise PromptError(f"{where}: field {key!r}[{j}] has the unknown role {m[role_key]!r} (user, assistant, "
                              "system, or ShareGPT's human, gpt)")
        if not text.strip():
            if role == "system":  # no system prompt, as data prep reads it (empty_system_dropped)
                continue
            raise PromptError(f"{where}: field {key!r}[{j}] is an empty {role} turn")
        if role == "system" and msgs:  # after a kept turn (an empty system turn before it is dropped)
            raise PromptError(f"{where}: field {key!r}[{j}] is a system turn that is not the first")
        msgs.append({"role": role, "content": text})
    return msgs[: 1 if msgs and msgs[0]["role"] == "system" else 0] + body_turns(msgs)[0]  # as data prep


def _prompt_field(rec: dict, field: str | None) -> str | None:
    """``field``, else the first of :data:`AUTO_FIELDS` the record holds non-null (None or NaN: :func:`is_null`),
    else None."""
    return field or next((k for k in AUTO_FIELDS if not is_null(rec.get(k))), None)


def _field_value(rec: dict, key: str) -> Any:
    """``rec[key]``; a chat list kept as a JSON string parsed (:func:`data_prep.sharegpt.turn_list`)."""
    return turn_list(rec[key])[0] if key in CHAT_FIELDS else rec[key]


def _follow_ups(rec: dict, field: str | None, where: str) -> tuple[str, ...]:
    """The user turns after the first: an MT-bench style record's later ``turns`` (strings), or a
    ``messages`` record's later user messages (its assistant messages are not used: every turn is
    answered by the base, as MT-bench's turn 2 follows the model's own answer)."""
    key = _prompt_field(rec, field)
    value = _field_value(rec, key) if key in rec else None
    if isinstance(value, list) and value and isinstance(value[0], dict):
        users = [m["content"] for m in _chat_messages(value, key, where) if m["role"] == "user"]
        return tuple(users[1:])
    if not (isinstance(value, list) and value and isinstance(value[0], str)):
        return ()
    for j, t in enumerate(value[1:], start=1):
        if not isinstance(t, str) or not t.strip():
            raise PromptError(f"{where}: field {key!r}[{j}] must be a non-empty string (a follow-up user turn)")
    return tuple(value[1:])


def _messages_from_record(rec: Any, field: str | None, where: str) -> list[dict[str, str]]:
    if not isinstance(rec, dict):
        raise PromptError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    key = _prompt_field(rec, field)
    if key is None or key not in rec:
        raise PromptError(f"{where}: no prompt field (looked for {field or ', '.join(AUTO_FIELDS)}; "
                          f"record keys: {', '.join(map(str, rec))})")
    value = _field_value(rec, key)
    if unsupported := unsupported_field(rec, value if isinstance(value, list) else []):
        raise PromptError(f"{where}: {unsupported} holds tool calls, tool schemas or reasoning, which the evaluation "
                          "does not render (data prep refuses such records too: unsupported_field)")
    if key in CHAT_FIELDS or (isinstance(value, list) and value and isinstance(value[0], dict)):
        if not isinstance(value, list):
            raise PromptError(f"{where}: field {key!r} must be a list of {{role, content}} messages")
        msgs = _chat_messages(value, key, where)
        first_user = next((j for j, m in enumerate(msgs) if m["role"] == "user"), None)
        if first_user is None:
            raise PromptError(f"{where}: field {key!r} holds no user message")
        return msgs[: first_user + 1]  # up to and including the first user turn
    if isinstance(value, list):  # MT-bench style: the first turn
        if not value or not isinstance(value[0], str):
            raise PromptError(f"{where}: field {key!r} must be a non-empty list of strings")
        value = value[0]
    if not isinstance(value, str) or not value.strip():
        raise PromptError(f"{where}: field {key!r} must be a non-empty string")
    extra = rec.get("input") if key == "instruction" and not is_null(rec.get("input")) else None
    if extra is not None and not isinstance(extra, str):
        raise PromptError(f"{where}: field 'input' must be a string (Alpaca's input, appended to the instruction)")
    if extra and extra.strip():  # Alpaca / LLaMA-Factory: the user turn is "instruction\ninput"
        value = f"{value}\n{extra}"
    return [{"role": "user", "content": value}]


def _with_system(rec: dict, msgs: list[dict[str, str]], where: str) -> list[dict[str, str]]:
    """``msgs`` with the record's top-level ``system`` string (LLaMA-Factory's layouts) as their system turn,
    as data prep reads it (``system_field_used``), unless they have one already."""
    system = rec.get("system")
    if is_null(system) or (isinstance(system, str) and not system.strip()):
        return msgs
    if not isinstance(system, str):
        raise PromptError(f"{where}: field 'system' must be a string (the system prompt)")
    if msgs and msgs[0]["role"] == "system":
        return msgs
    return [{"role": "system", "content": system}, *msgs]


def _lone_surrogate(value: Any, path: str = "") -> str | None:
    """Where (``turns[1]``, ``messages[0].content``) the first string of a decoded JSON value holding a
    lone UTF-16 surrogate is, else None."""
    if isinstance(value, str):
        return (path or "the record") if replace_lone_surrogates(value)[1] else None
    if isinstance(value, dict):
        children = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        children = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next((found for where, v in children if (found := _lone_surrogate(v, where))), None)


def special_text(specials: Sequence[str], messages: Sequence[dict[str, str]], follow_ups: Sequence[str] = ()) -> str | None:
    """The first special token's text (``<|im_end|>``) in a prompt's messages or later turns, else None.
    ``apply_chat_template`` would encode it as the control token, so the prompt is not the text it
    shows: data prep drops such turns (``special_token_text``, :mod:`data_prep.template`), and the
    evaluation skips such prompts with that reason rather than measure heads on them."""
    texts = [m["content"] for m in messages] + list(follow_ups)
    return next((sp for sp in specials for t in texts if sp in t), None)


def read_jsonl_prompts(path: str | Path, field: str | None = None, limit: int | None = None
                       ) -> list[tuple[str, list[dict[str, str]]]]:
    """Read ``(id, messages)`` from a JSONL file (one JSON object per non-blank line).

    See :func:`read_jsonl_records` (the same records with category and follow-up turns).
    """
    return [(r["id"], r["messages"]) for r in read_jsonl_records(path, field, limit)]


def read_jsonl_records(path: str | Path, field: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """Read ``{"id", "messages", "category", "follow_ups"}`` from a JSONL file (one JSON object per
    non-blank line).

    The id is the first of ``question_id`` / ``id`` / ``prompt_id`` / ``conversation_id``, else
    ``line<N>`` (null, NaN and ``""`` skipped; a NaN ``system``, ``category`` or ``input`` reads as absent,
    as data prep reads pandas' nulls).  The prompt is ``field`` (or the first of :data:`AUTO_FIELDS` present
    and non-null): a string, a list of strings (the first is taken: MT-bench ``turns``), or a list of chat
    messages, or that list as a JSON string (up to the first user message).  ``category`` is the record's ``category`` (a string, else None);
    ``follow_ups`` the later strings of a list-of-strings prompt field (MT-bench turns 2..n).

    Raises:
        PromptError: the file is missing or a line is not valid / has no prompt / has an empty
            follow-up turn or a non-string category / holds a lone UTF-16 surrogate (``"\\ud83d"``:
            half of a character, which no tokenizer encodes) / repeats an earlier line's id (results
            are kept per id); names the line.
    """
    path = Path(path)
    if path.is_dir():
        raise PromptError(f"eval.prompts={str(path)!r} is a folder: name the JSONL file of prompts in it "
                          "(one JSON object a line)")
    if not path.is_file():
        raise PromptError(f"eval.prompts={str(path)!r}: file not found (MT-bench's is FastChat's "
                          "fastchat/llm_judge/data/mt_bench/question.jsonl, docs/glossary.md; "
                          "leave eval.prompts unset for held-out ShareGPT first turns)")
    out: list[dict[str, Any]] = []
    lines: dict[str, int] = {}  # id -> its line
    try:
        raw = path.read_bytes().decode("utf-8").removeprefix("\ufeff")  # a byte-order mark, as data prep reads it
    except UnicodeDecodeError as exc:
        lineno = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise PromptError(f"{path}:{lineno}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})") from None
    for lineno, line in enumerate(raw.split("\n"), start=1):  # not splitlines: JSON may hold U+2028
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line, strict=False)  # a raw tab inside a string is a tab, as data prep reads it
        except json.JSONDecodeError as exc:
            if lineno == 1 and line.lstrip().startswith("["):  # a JSON array file, not JSON Lines
                raise PromptError(f"{path}: a JSON array; eval.prompts reads JSON Lines, one JSON object a line "
                                  f"(python -c \"import json; [print(json.dumps(r)) for r in json.load(open('{path.name}'))]\" "
                                  "> prompts.jsonl)") from None
            raise PromptError(f"{where}: invalid JSON ({exc.msg})") from None
        half = _lone_surrogate(rec)
        if half:
            raise PromptError(f"{where}: {half} holds a lone UTF-16 surrogate (an escaped \\ud800-\\udfff without "
                              "its other half: a character cut in two), which no tokenizer can encode; fix the text")
        pid = next((str(rec[k]) for k in ID_FIELDS if isinstance(rec, dict) and not is_null(rec.get(k)) and rec[k] != ""),
                   f"line{lineno}")
        if pid in lines:
            raise PromptError(f"{where}: id {pid!r} is also the id of line {lines[pid]}; prompt ids must be unique "
                              "(each prompt's results and resume are kept by id)")
        lines[pid] = lineno
        msgs = _with_system(rec, _messages_from_record(rec, field, where), where)
        cat = None if is_null(rec.get("category")) else rec.get("category")
        if cat is not None and not isinstance(cat, str):
            raise PromptError(f"{where}: field 'category' must be a string, got {type(cat).__name__}")
        out.append({"id": pid, "messages": msgs, "category": cat, "follow_ups": _follow_ups(rec, field, where)})
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise PromptError(f"{path}: no prompts")
    for rec in out:  # a later turn's results are kept as <id>/turn<k> (evaluation.turns.turn_id)
        for k in range(2, len(rec["follow_ups"]) + 2):
            if (key := turn_id(rec["id"], k)) in lines:
                raise PromptError(f"{path}:{lines[key]}: id {key!r} is the key of turn {k} of line {lines[rec['id']]}'s "
                                  f"prompt {rec['id']!r} (each turn's results are kept by <id>/turn<k>); rename it")
    return out


def template(tokenizer, messages: list[dict[str, str]]) -> torch.Tensor:
    """Chat-template ``messages`` with the generation prompt: LongTensor [T]."""
    ids = apply_chat_template(tokenizer, messages, tokenize=True, return_dict=False, add_generation_prompt=True)
    return torch.tensor(list(ids), dtype=torch.long)


def load_prompts(eval_cfg, data_cfg, tokenizer, records: list[dict[str, Any]] | None = None
                 ) -> tuple[list[Prompt], list[dict[str, Any]]]:
    """The evaluation prompts, templated.

    Args:
        eval_cfg: the ``eval`` section (``prompts``, ``prompt_field``, ``num_prompts``,
            ``prompt_offset``, ``max_prompt_tokens``, ``prompts_per_category``: keep only the
            first N usable prompts of each ``category``, in file order, before offset and count).
        data_cfg: the ``data`` section (ShareGPT path and held-out split) used when
            ``eval.prompts`` is null.
        tokenizer: the base tokenizer (with a chat template).
        records: ``eval.prompts``'s :func:`read_jsonl_records`, when the caller read them already
            (the evaluation does, before the base loads, so a bad file costs no model load).

    Returns:
        ``(prompts, skipped)``: usable prompts ``prompt_offset .. prompt_offset + num_prompts − 1``
        (after skipping over-long ones); ``skipped`` lists ``{"id", "prompt_tokens", "reason"}`` for
        prompts longer than ``max_prompt_tokens`` and ``{"id", "reason"}`` for prompts holding a special
        token's text (:func:`special_text`).

    Raises:
        PromptError: as :func:`read_jsonl_records`; two prompts share an id; no usable prompt.
    """
    limit = eval_cfg.get("num_prompts")
    offset = int(eval_cfg.get("prompt_offset") or 0)
    if eval_cfg.get("prompts"):
        raw = records if records is not None else read_jsonl_records(eval_cfg.prompts, eval_cfg.get("prompt_field"))
        source = str(eval_cfg.prompts)
    else:
        from data_prep.pipeline import heldout_prompts

        raw = ({"id": pid, "messages": m, "category": None, "follow_ups": ()} for pid, m in heldout_prompts(data_cfg))
        source = "sharegpt-heldout"
    max_len = eval_cfg.get("max_prompt_tokens")
    per_cat = eval_cfg.get("prompts_per_category")
    taken: dict[str | None, int] = {}
    prompts, skipped = [], []
    specials = special_token_texts(tokenizer)
    seen: set[str] = set()
    for rec in raw:
        pid, messages = rec["id"], rec["messages"]
        if pid in seen:  # a JSONL file is checked line by line as it is read; a mixture's sources here
            raise PromptError(f"{source}: two prompts have the id {pid!r} (two sources holding the same ids?); "
                              "prompt ids must be unique (each prompt's results and resume are kept by id)")
        seen.add(pid)
        if per_cat is not None and taken.get(rec["category"], 0) >= int(per_cat):
            continue
        hit = special_text(specials, messages, rec["follow_ups"])
        if hit is not None:
            skipped.append({"id": pid, "reason": f"holds the text of the special token {hit!r}, which the template "
                                                  "would encode as the control token (data prep drops such turns)"})
            continue
        ids = template(tokenizer, messages)
        if max_len is not None and ids.numel() > int(max_len):
            skipped.append({"id": pid, "prompt_tokens": int(ids.numel()), "reason": "longer than eval.max_prompt_tokens"})
            continue
        taken[rec["category"]] = taken.get(rec["category"], 0) + 1
        prompts.append(Prompt(pid, messages, ids, rec["category"], tuple(rec["follow_ups"])))
        if limit is not None and len(prompts) >= offset + int(limit):
            break
    if per_cat is not None and set(taken) == {None}:  # one "category" of everything: N prompts, silently
        raise PromptError(f"eval.prompts_per_category={per_cat}: {source} has no 'category' field, so it would keep "
                          f"the first {per_cat} prompt(s) of the whole set; use eval.num_prompts instead")
    usable = len(prompts)
    prompts = prompts[offset:]
    if not prompts:
        if usable:  # the set has prompts: the offset is past them (skipped ones are not the reason)
            raise PromptError(f"eval.prompt_offset={offset} is past the {usable} usable prompt(s) of {source}"
                              f"{f' ({len(skipped)} more skipped)' if skipped else ''}; use an offset below {usable}")
        why = f"; {len(skipped)} skipped, first {skipped[0]['id']!r}: {skipped[0]['reason']}" if skipped else ""
        raise PromptError(f"no usable prompts from {source} (eval.prompt_offset={offset}{why})")
    return prompts, skipped
