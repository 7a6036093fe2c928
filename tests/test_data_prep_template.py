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
