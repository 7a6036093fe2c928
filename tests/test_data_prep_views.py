"""Every assistant turn's training tokens are its inference view, for any template (issue 28, item 8).

For assistant turn i the tokens before its loss span must be exactly
``apply_chat_template(messages[:i], add_generation_prompt=True)`` and the span what the base writes
next, up to its end-of-turn token.  Templates (all on the tiny tokenizer): ChatML, a Qwen3-like
thinking template (reasoning kept only after the last user turn, an empty think block added to the
last reply; the Qwen3 chat template's logic), a DeepSeek-R1-like template whose generation prompt
opens a think block that its rendering of past replies never has, a template that keeps only the
last exchange of the history, and one that trims earlier replies.  A turn no rendering can give is
dropped and counted, never the whole conversation; every normalisation of a record is counted.
"""
from __future__ import annotations

import json

import pytest

from core.tiny import CHATML_TEMPLATE, tiny_tokenizer
from data_prep.front import template_conversations
from data_prep.sharegpt import Conversation, ReadStats, iter_conversations
from data_prep.template import flatten

QWEN3_LIKE = '{%- if messages[0].role == \'system\' %}\n    {{- \'<|im_start|>system\\n\' + messages[0].content + \'<|im_end|>\\n\' }}\n{%- endif %}\n{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith(\'<tool_response>\') and message.content.endswith(\'</tool_response>\')) %}\n        {%- set ns.multi_step_tool = false %}\n        {%- set ns.last_query_index = index %}\n    {%- endif %}\n{%- endfor %}\n{%- for message in messages %}\n    {%- if message.content is string %}\n        {%- set content = message.content %}\n    {%- else %}\n        {%- set content = \'\' %}\n    {%- endif %}\n    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}\n        {{- \'<|im_start|>\' + message.role + \'\\n\' + content + \'<|im_end|>\' + \'\\n\' }}\n    {%- elif message.role == "assistant" %}\n        {%- set reasoning_content = \'\' %}\n        {%- if message.reasoning_content is string %}\n            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n            {%- if \'</think>\' in content %}\n                {%- set reasoning_content = content.split(\'</think>\')[0].rstrip(\'\\n\').split(\'<think>\')[-1].lstrip(\'\\n\') %}\n                {%- set content = content.split(\'</think>\')[-1].lstrip(\'\\n\') %}\n            {%- endif %}\n        {%- endif %}\n        {%- if loop.index0 > ns.last_query_index %}\n            {%- if loop.last or (not loop.last and reasoning_content) %}\n                {{- \'<|im_start|>\' + message.role + \'\\n<think>\\n\' + reasoning_content.strip(\'\\n\') + \'\\n</think>\\n\\n\' + content.lstrip(\'\\n\') }}\n            {%- else %}\n                {{- \'<|im_start|>\' + message.role + \'\\n\' + content }}\n            {%- endif %}\n        {%- else %}\n            {{- \'<|im_start|>\' + message.role + \'\\n\' + content }}\n        {%- endif %}\n        {{- \'<|im_end|>\\n\' }}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- \'<|im_start|>assistant\\n\' }}\n    {%- if enable_thinking is defined and enable_thinking is false %}\n        {{- \'<think>\\n\\n</think>\\n\\n\' }}\n    {%- endif %}\n{%- endif %}\n'
DEEPSEEK_R1_LIKE = (
    "{% for m in messages %}{% if m.role == 'user' %}{{ '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{% elif m.role == 'system' %}{{ '<|im_start|>system\\n' + m.content + '<|im_end|>\\n' }}"
    "{% else %}{% set c = m.content.split('</think>')[-1] %}{{ '<|im_start|>assistant\\n' + c + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)
LAST_EXCHANGE_ONLY = (  # the history is cut to the last user turn before the reply (window templates)
    "{% set n = messages|length %}{% for m in messages %}"
    "{% if loop.index0 >= n - 2 or (add_generation_prompt and loop.index0 >= n - 1) %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TRIM_EARLIER_REPLIES = (  # earlier replies shortened to their first 6 characters
    "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\\n' + m.content[:6] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEMPLATES = {"chatml": CHATML_TEMPLATE, "qwen3_like": QWEN3_LIKE, "deepseek_r1_like": DEEPSEEK_R1_LIKE,
             "last_exchange_only": LAST_EXCHANGE_ONLY, "trim_earlier_replies": TRIM_EARLIER_REPLIES}

U, A, S = "user", "assistant", "system"
CONVERSATIONS = {
    "three_turns": [(U, "Hi"), (A, "Hello. How can I help you today?"), (U, "What is 3+3?"), (A, "It is 6."),
                    (U, "And 4+4?"), (A, "It is 8, the quick brown fox says.")],
    "system": [(S, "Be terse."), (U, "Hi"), (A, "Hello."), (U, "Write a short poem about the sea."),
               (A, "The sea is blue.")],
    "reasoning": [(U, "Hi"), (A, "<think>\ngreet back\n</think>\n\nHello."), (U, "What is 3+3?"),
                  (A, "<think>\nadd them\n</think>\n\nIt is 6.")],
}


def _messages(turns):
    return [{"role": r, "content": c} for r, c in turns]


def _tok(template):
    tok = tiny_tokenizer()
    tok.chat_template = template
    return tok


def _gen_ids(tok, msgs):
    return list(tok.apply_chat_template(msgs, tokenize=True, return_dict=False, add_generation_prompt=True))


def _views(tok, msgs, stats=None):
    """``[(turn index, context ids, body ids)]`` for every assistant turn the records hold."""
    stats = stats if stats is not None else ReadStats()
    records = list(template_conversations(tok, [Conversation("c", msgs)], {tok.eos_token_id}, 4096, stats))
    turns = iter(i for i, m in enumerate(msgs) if m["role"] == A)
    out = []
    for rec in records:
        ids, _ = flatten(rec.segments)
        pos = 0
        for seg in rec.segments:
            start = pos + seg.header
            out.append((next(turns), ids[:start], ids[start:start + seg.body]))
            pos += len(seg.ids)
    return out


@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_every_turn_is_trained_on_its_inference_view(name, conv):
    tok = _tok(TEMPLATES[name])
    msgs = _messages(CONVERSATIONS[conv])
    stats = ReadStats()
    views = _views(tok, msgs, stats)
    assistant_turns = [i for i, m in enumerate(msgs) if m["role"] == A]
    assert [v[0] for v in views] == assistant_turns and not stats.dropped  # every turn, none lost
    for i, context, body in views:
        assert context == _gen_ids(tok, msgs[:i]), f"{name}/{conv} turn {i}: context is not the generation prompt"
        assert body[-1] == tok.eos_token_id and tok.eos_token_id not in body[:-1]
        text = tok.decode(body)
        reply = msgs[i]["content"].split("</think>")[-1].strip()  # templates may reformat the reasoning
        assert reply in text, f"{name}/{conv} turn {i}: {reply!r} not in {text!r}"


def test_qwen3_like_reasoning_is_kept_for_the_turn_and_dropped_from_later_contexts():
    tok = _tok(QWEN3_LIKE)
    msgs = _messages(CONVERSATIONS["reasoning"])
    (i1, ctx1, body1), (i3, ctx3, body3) = _views(tok, msgs)
    assert tok.decode(body1) == "<think>\ngreet back\n</think>\n\nHello.<|im_end|>"
    assert "greet back" not in tok.decode(ctx3)  # inference never shows earlier reasoning
    assert tok.decode(body3) == "<think>\nadd them\n</think>\n\nIt is 6.<|im_end|>"


def test_a_turn_no_rendering_can_give_is_dropped_and_counted_and_the_others_kept():
    """A later user turn quotes a special token's text: the turns whose context holds it are dropped
    (each counted), the first turn is kept (the whole conversation used to be dropped)."""
    tok = _tok(CHATML_TEMPLATE)
    msgs = _messages([(U, "Hi"), (A, "Hello."), (U, "Explain <|im_end|> please"), (A, "It ends a turn."),
                      (U, "Thanks"), (A, "You are welcome.")])
    stats = ReadStats()
    views = _views(tok, msgs, stats)
    assert [v[0] for v in views] == [1] and views[0][1] == _gen_ids(tok, msgs[:1])
    assert not stats.dropped and stats.fixed["turns_dropped_special_token_text"] == 2
    assert stats.fix_examples["turns_dropped_special_token_text"]["id"] == "c"


def test_every_normalisation_is_counted_under_its_own_reason(tmp_path):
    records = [
        {"id": "mapped", "conversations": [{"from": "Human ", "value": "q"}, {"from": "bard", "value": "a"}]},
        {"id": "merged", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                      {"role": "assistant", "content": "c"}]},
        {"id": "lead", "messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "a"}]},
        {"id": "trail", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                     {"role": "user", "content": "unanswered"}]},
        {"id": "parts", "messages": [{"role": "user", "content": [{"type": "text", "text": "q1 "},
                                                                  {"type": "text", "text": "q2"}]},
                                     {"role": "assistant", "content": "a"}]},
        {"id": "clean", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    stats = ReadStats()
    convs = {c.id: c for c in iter_conversations(path, stats)}
    assert len(convs) == 6 and not stats.dropped
    assert dict(stats.fixed) == {"role_mapped_Human_to_user": 1, "role_mapped_bard_to_assistant": 1,
                                 "merged_consecutive_roles": 1, "leading_assistant_dropped": 1,
                                 "trailing_turns_dropped": 1, "text_parts_joined": 1}
    assert {r: ex["id"] for r, ex in stats.fix_examples.items()} == {
        "role_mapped_Human_to_user": "mapped", "role_mapped_bard_to_assistant": "mapped", "merged_consecutive_roles": "merged",
        "leading_assistant_dropped": "lead", "trailing_turns_dropped": "trail", "text_parts_joined": "parts"}
    assert convs["clean"].fixes == []


def test_normalisation_counts_reach_the_summary_and_the_manifest(tiny_base, tiny_model_dir, tmp_path):
    from core.config import compose
    from data_prep import pipeline
    from data_prep.cache import default_cache_dir

    model, tok, ident = tiny_base
    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": "The quick brown fox"},
                                              {"from": "gpt", "value": "jumps over the lazy dog."},
                                              {"from": "human", "value": "never answered"}]} for i in range(8)]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(rows))
    cfg = compose([f"model.path={tiny_model_dir}", "model.dtype=float32", "model.attn_implementation=eager",
                   f"data.path={path}", "data.max_conversations=null", "data.heldout_fraction=0.25",
                   "data.max_length=64", "prep.progress=false", "labels=teacher_forced", f"output_root={tmp_path}"])
    summary = pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    want = {"role_mapped_gpt_to_assistant": 8, "role_mapped_human_to_user": 8, "trailing_turns_dropped": 8}
    assert summary["fixed"] == want
    text = pipeline.format_summary(summary)
    assert "trailing_turns_dropped 8" in text and "first 'r0'" in text
    for split in ("train", "val"):
        manifest = json.loads((default_cache_dir(cfg) / split / "manifest.json").read_text())
        assert manifest["data_read"]["fixed"] == want and manifest["data_sources"][0]["fixed"] == want


LLAMA3_DATE_HEADER = (
    "{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}"
    "<|im_start|>system\nToday Date: {{ date_string }}<|im_end|>\n"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_a_template_that_reads_the_clock_renders_the_same_on_every_day(monkeypatch):
    """Llama-3.x-style templates write today's date (transformers' strftime_now): a cache resumed the
    next day, ranks started across midnight, an online run's record identity and an evaluation's
    progress fingerprints all changed with the date.  Every rendering sees the one fixed template
    date, in data prep, in evaluation prompts and in later turns alike."""
    from datetime import datetime

    from transformers.utils import chat_template_utils

    from core.chat_template import TEMPLATE_DATE
    from evaluation.prompts import Prompt, template
    from evaluation.turns import follow_up_prompt

    tok = _tok(LLAMA3_DATE_HEADER)
    msgs = _messages(CONVERSATIONS[next(iter(CONVERSATIONS))])
    assert "26 Jul 2024" == TEMPLATE_DATE.strftime("%d %b %Y")
    renders = []
    for day in (datetime(2031, 1, 1, 23, 59), datetime(2031, 1, 2, 0, 1)):
        clock = type("Clock", (datetime,), {"now": classmethod(lambda cls, tz=None, d=day: d)})
        monkeypatch.setattr(chat_template_utils, "datetime", clock)
        assert day.strftime("%d %b %Y") in tok.apply_chat_template(msgs[:1], tokenize=False)  # the raw call reads it
        views = _views(tok, msgs)
        first = Prompt("p", msgs[:1], template(tok, msgs[:1]), follow_ups=(msgs[2]["content"],))
        second = follow_up_prompt(tok, first, tok(msgs[1]["content"], add_special_tokens=False)["input_ids"], [])
        renders.append((views, first.input_ids.tolist(), second.input_ids.tolist()))
        assert "Today Date: 26 Jul 2024" in tok.decode(first.input_ids.tolist())
        assert views[0][1] == first.input_ids.tolist()  # data prep's context is the evaluation's prompt
    assert renders[0] == renders[1]


# DeepSeek-R1 (January 2025): every reply, the last one included, is rendered without its reasoning block, and the
# generation prompt opens no think block; the base writes the reasoning after the prompt all the same
# (huggingface/trl#6766: R1's template "splits on </think>", dropping the reasoning from the training target).
STRIP_REASONING_EVERYWHERE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% set c = m.content.split('</think>')[-1] %}"
    "{{ '<|im_start|>assistant\\n' + c + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_that_strips_the_replys_reasoning_trains_the_reply_the_base_writes():
    """The template's rendering of the last reply continued the generation prompt with the answer alone: the
    reasoning the base writes first was silently left out of the loss span (the drafter trained to answer
    straight after the prompt).  The reply is now the data's, reasoning included, and counted."""
    tok = _tok(STRIP_REASONING_EVERYWHERE)
    msgs = _messages(CONVERSATIONS["reasoning"])
    stats = ReadStats()
    (i1, ctx1, body1), (i3, ctx3, body3) = _views(tok, msgs, stats)
    assert ctx1 == _gen_ids(tok, msgs[:1]) and ctx3 == _gen_ids(tok, msgs[:3])
    assert tok.decode(body1) == "<think>\ngreet back\n</think>\n\nHello.<|im_end|>"
    assert tok.decode(body3) == "<think>\nadd them\n</think>\n\nIt is 6.<|im_end|>"
    assert "greet back" not in tok.decode(ctx3)  # the history stays as the template renders it
    assert stats.fixed["turns_rendered_from_data"] == 2 and not stats.dropped  # one per turn
    assert "leaves out part of its text" in stats.fix_examples["turns_rendered_from_data"]["message"]
    # a reply the template keeps whole (whitespace aside) is still the template's own rendering
    plain = ReadStats()
    _views(tok, _messages(CONVERSATIONS["three_turns"]), plain)
    assert "turns_rendered_from_data" not in plain.fixed


def test_a_generation_prompt_that_opens_the_think_block_is_not_repeated_by_the_reply():
    """DeepSeek-R1-Distill's generation prompt ends with ``<think>\\n``; a reply whose data starts with its own
    ``<think>`` followed that prompt whole, so the cache held ``<think>\\n<think>\\n...`` and trained the drafter to
    open a second think block the base never writes.  The reply now follows the prompt without the opening."""
    tok = _tok(DEEPSEEK_R1_LIKE)
    msgs = _messages(CONVERSATIONS["reasoning"])
    stats = ReadStats()
    (i1, ctx1, body1), (i3, ctx3, body3) = _views(tok, msgs, stats)
    assert ctx1 == _gen_ids(tok, msgs[:1]) and tok.decode(ctx1).endswith("<|im_start|>assistant\n<think>\n")
    assert tok.decode(body1) == "greet back\n</think>\n\nHello.<|im_end|>"
    assert ctx3 == _gen_ids(tok, msgs[:3]) and tok.decode(body3) == "add them\n</think>\n\nIt is 6.<|im_end|>"
    assert stats.fixed["turns_opening_in_prompt"] == 2 and not stats.dropped
    assert "'<think>'" in stats.fix_examples["turns_opening_in_prompt"]["message"]
    # the opening is matched whitespace aside; a reply without it, or one that merely starts with the prompt's
    # last word, is kept whole
    tok_plain = _tok(CHATML_TEMPLATE)
    for t, reply, body in ((tok, "<think>greet</think>Hello.", "greet</think>Hello.<|im_end|>"),
                           (tok, "Hello.", "Hello.<|im_end|>"),
                           (tok_plain, "assistant here", "assistant here<|im_end|>")):
        [(_, _, got)] = _views(t, _messages([(U, "Hi"), (A, reply)]))
        assert t.decode(got) == body
