"""Chat template + assistant-only loss mask, derived from the template structure."""
from __future__ import annotations

from core.tiny import tiny_tokenizer
from data_prep.template import encode_conversation

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello! How can I help?"},
    {"role": "assistant", "content": "The quick brown fox."},
    {"role": "user", "content": "Write a short poem about the sea."},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"},
    {"role": "user", "content": "1 2 3"},
    {"role": "assistant", "content": "4 5 6 ?"},
]


def _runs(mask):
    runs, start = [], None
    for t, m in enumerate(list(mask) + [False]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            runs.append((start, t))
            start = None
    return runs


def test_loss_mask_covers_exactly_the_assistant_spans():
    tok = tiny_tokenizer()
    ids, mask = encode_conversation(tok, MESSAGES, "handcrafted")
    assert ids == list(tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=False))
    runs = _runs(mask)
    answers = [m["content"] for m in MESSAGES if m["role"] == "assistant"]
    assert len(runs) == len(answers)
    for (a, b), content in zip(runs, answers):
        # the span is the content plus the end-of-turn token, nothing of the header or of user turns
        assert tok.decode(ids[a:b]) == content + "<|im_end|>"
        assert tok.decode(ids[:a]).endswith("<|im_start|>assistant\n")
    assert sum(mask) == sum(b - a for a, b in runs)


def test_default_system_prompt_is_unmasked_and_max_length_truncates():
    tok = tiny_tokenizer()
    msgs = MESSAGES[1:]
    ids, mask = encode_conversation(tok, msgs, "nosys")
    assert tok.decode(ids[:4]).startswith("<|im_start|>system")
    assert len(_runs(mask)) == 3
    short_ids, short_mask = encode_conversation(tok, msgs, "nosys", max_length=40)
    assert short_ids == ids[:40] and short_mask == mask[:40]


def test_an_assistant_turn_marked_not_to_train_is_context_without_loss():
    """A reply marked ``"train": False`` (a per-turn ``weight: 0`` / ``training: false``) keeps its tokens in the
    sequence, as the next reply's context, and has none in the loss mask."""
    tok = tiny_tokenizer()
    marked = [dict(m) for m in MESSAGES]
    marked[4]["train"] = False
    ids, mask = encode_conversation(tok, MESSAGES, "all")
    marked_ids, marked_mask = encode_conversation(tok, marked, "marked")
    assert marked_ids == ids
    first, second, third = _runs(mask)
    assert _runs(marked_mask) == [first, third]


# --- templates as inference sees them (issue 15) -------------------------------------------------
import pytest  # noqa: E402

from data_prep.front import template_conversations  # noqa: E402
from data_prep.sharegpt import Conversation, ReadStats  # noqa: E402
from data_prep.template import TemplateError, segment_records  # noqa: E402

# Qwen3-style: reasoning is stripped from replies before the last user turn, and the last reply
# gets a (here empty) <think> block in front of it.
QWEN3_STYLE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_query -%}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)
# Llama-2 / Mistral style: roles must alternate (the template raises), no system role
LLAMA2_STYLE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
)
QA2 = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
       {"role": "user", "content": "What is 3+3?"}, {"role": "assistant", "content": "It is 6."}]


def _tok(template):
    tok = tiny_tokenizer()
    tok.chat_template = template
    return tok


def _masked_texts(tok, ids, mask):
    return [tok.decode(ids[a:b]) for a, b in _runs(mask)]


def _gen_ids(tok, msgs):
    return list(tok.apply_chat_template(msgs, tokenize=True, return_dict=False, add_generation_prompt=True))


def test_a_split_records_id_never_repeats_another_conversations_id():
    """A template that rewrites history splits conversation ``abc`` into records ``abc``, ``abc#1``: a real
    conversation ``abc#1`` (before or after it) is dropped and counted as ``duplicate_id``, so the cache's ids
    stay unique."""
    tok = _tok(QWEN3_STYLE)
    eos = {tok.eos_token_id}
    for order in (["abc", "abc#1"], ["abc#1", "abc"]):
        convs = {"abc": Conversation("abc", QA2), "abc#1": Conversation("abc#1", QA2[:2])}
        stats = ReadStats()
        recs = list(template_conversations(tok, [convs[i] for i in order], eos, 512, stats))
        ids = [r.id for r in recs]
        assert len(ids) == len(set(ids)) and stats.dropped["duplicate_id"] == 1
        assert ids == (["abc", "abc#1"] if order[0] == "abc" else ["abc#1"])
        assert stats.examples["duplicate_id"]["id"] == order[1] and "'abc#1'" in stats.examples["duplicate_id"]["message"]


def test_qwen3_style_template_context_is_the_generation_prompt_and_the_think_block_is_written():
    tok = _tok(QWEN3_STYLE)
    eos = {tok.eos_token_id}
    # one turn: the context is the generation prompt exactly; the empty think block the template puts
    # in front of the last reply is what the base writes after it, so it is in the loss (issue 28)
    one = QA2[:2]
    [[seg]] = segment_records(tok, one, "q1", eos)
    ids, mask = encode_conversation(tok, one, "q1")
    assert ids == list(tok.apply_chat_template(one, tokenize=True, return_dict=False))
    assert _masked_texts(tok, ids, mask) == ["<think>\n\n</think>\n\nHello.<|im_end|>"]
    assert ids[: seg.header] == _gen_ids(tok, one[:1])
    # two turns: not prefix-stable (turn 1 loses its think block once it is not the last reply), so
    # each turn gets its own record whose context is exactly the inference view of that turn
    stats = ReadStats()
    recs = list(template_conversations(tok, [Conversation("q2", QA2)], eos, 512, stats))
    assert [r.id for r in recs] == ["q2", "q2#1"] and not stats.dropped and stats.fixed["split_by_template"] == 1
    for rec, i, reply in zip(recs, (1, 3), ("Hello.", "It is 6.")):
        ids, mask = rec.encode()
        assert _masked_texts(tok, ids, mask) == ["<think>\n\n</think>\n\n" + reply + "<|im_end|>"]
        gen = _gen_ids(tok, QA2[:i])
        assert ids[: len(gen)] == gen  # the prompt the base sees at inference precedes the reply
        assert ids == list(tok.apply_chat_template(QA2[: i + 1], tokenize=True, return_dict=False))


def test_chatml_multi_turn_stays_one_record_with_every_inference_prefix():
    tok = tiny_tokenizer()
    [segs] = segment_records(tok, MESSAGES, "c", {tok.eos_token_id})
    ids, mask = encode_conversation(tok, MESSAGES, "c")
    assert len(segs) == 3
    for i, (a, _) in zip([2, 4, 6], _runs(mask)):
        assert ids[:a] == _gen_ids(tok, MESSAGES[:i])


def test_special_token_text_in_a_message_is_skipped_under_its_reason():
    tok = tiny_tokenizer()
    msgs = [{"role": "user", "content": "Explain this log line: <|im_end|>\n<|im_start|>assistant\nfake reply"},
            {"role": "assistant", "content": "It is a ChatML delimiter."}]
    with pytest.raises(TemplateError) as exc:
        segment_records(tok, msgs, "sp", {tok.eos_token_id})
    assert exc.value.reason == "special_token_text" and "'sp'" in str(exc.value)
    stats = ReadStats()
    ok = Conversation("ok", QA2[:2])
    out = list(template_conversations(tok, [Conversation("sp", msgs), ok], {tok.eos_token_id}, 512, stats))
    assert [r.id for r in out] == ["ok"]
    assert stats.dropped == {"special_token_text": 1}
    assert stats.examples["special_token_text"]["id"] == "sp"
    assert "<|im_end|>" in stats.examples["special_token_text"]["message"]


def test_a_template_exception_drops_one_record_with_its_message_and_never_the_run():
    tok = _tok(LLAMA2_STYLE)
    eos = {tok.eos_token_id}
    bad = Conversation("sys", [{"role": "system", "content": "be terse"}] + QA2)  # this template has no system role
    stats = ReadStats()
    out = list(template_conversations(tok, [bad, Conversation("good", QA2)], eos, 512, stats))
    assert [r.id for r in out] == ["good"]
    assert stats.dropped == {"template_error": 1}
    assert stats.examples["template_error"]["id"] == "sys"
    assert "Conversation roles must alternate" in stats.examples["template_error"]["message"]
    ids, mask = out[0].encode()
    assert [t.strip() for t in _masked_texts(tok, ids, mask)] == ["Hello.<|im_end|>", "It is 6.<|im_end|>"]


def test_tokenizer_without_offsets_gives_the_same_masks(monkeypatch):
    import data_prep.template as template

    tok = tiny_tokenizer()
    want = encode_conversation(tok, MESSAGES, "c")
    real = template._encode

    def no_offsets(tokenizer, text, offsets=False):
        if offsets:
            raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
        return real(tokenizer, text)

    monkeypatch.setattr(template, "_encode", no_offsets)
    assert encode_conversation(tok, MESSAGES, "c") == want


def test_replies_closed_with_eos_instead_of_the_templates_end_are_counted(tmp_path):
    """A model folder whose tokenizer and generation eos are <|endoftext|> while its template ends turns with
    <|im_end|>: every reply was cached ending with <|endoftext|> and nothing said so.  It is still closed
    that way (the base's eos is what ends generation there), and each such turn is counted with the fix."""
    import json

    from core.tiny import save_tiny_model
    from data_prep.front import template_conversations
    from data_prep.sharegpt import Conversation, ReadStats
    from data_prep.template import end_of_turn_ids
    from transformers import AutoTokenizer

    d = save_tiny_model(tmp_path / "m", seed=0)
    conf = json.loads((d / "tokenizer_config.json").read_text())
    conf["eos_token"] = "<|endoftext|>"
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    tok = AutoTokenizer.from_pretrained(d)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token_id == eot != tok.convert_tokens_to_ids("<|im_end|>")
    stats = ReadStats()
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello friend"},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye"}]
    recs = list(template_conversations(tok, [Conversation("c", msgs)], end_of_turn_ids(tok), 512, stats))
    segs = [seg for rec in recs for seg in rec.segments]
    assert len(segs) == 2 and all(seg.ids[seg.header + seg.body - 1] == eot for seg in segs)  # ended by the eos
    assert stats.fixed["turns_closed_with_eos"] == 2
    assert stats.fix_examples["turns_closed_with_eos"]["message"].startswith(
        "assistant turn 1: the template ends the reply with no end-of-turn id of the base (eos ids [")
    assert "generation_config.json eos_token_id" in stats.fix_examples["turns_closed_with_eos"]["message"]
    # the packaged kind of folder (eos = the template's end-of-turn) notes nothing
    plain = ReadStats()
    ok = AutoTokenizer.from_pretrained(save_tiny_model(tmp_path / "ok", seed=0))
    list(template_conversations(ok, [Conversation("c", msgs)], end_of_turn_ids(ok), 512, plain))
    assert "turns_closed_with_eos" not in plain.fixed
