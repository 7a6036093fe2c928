"""ShareGPT reader: cut-off / corrupt files, bad-record kinds, role mapping, held-out split."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from data_prep.sharegpt import BAD_REASONS, ReadStats, iter_conversations, iter_records, normalize, normalize_records
from data_prep.split import is_heldout


def _rec(i, n_pairs=1):
    conv = []
    for j in range(n_pairs):
        conv += [{"from": "human", "value": f"question {i}.{j} with \"quotes\" {{braces}} [x]"},
                 {"from": "gpt", "value": f"answer {i}.{j} ünïcode ✓"}]
    return {"id": f"r{i}", "conversations": conv}


def test_cut_off_json_array_recovers_exactly_the_complete_records(tmp_path):
    records = [_rec(i, n_pairs=i + 1) for i in range(4)]
    text = json.dumps(records, indent=2, ensure_ascii=False)
    # cut in the middle of the 4th record (inside a nested turn object)
    cut = text.index('"r3"') + 60
    path = tmp_path / "cut.json"
    path.write_bytes(text[:cut].encode("utf-8"))
    stats = ReadStats()
    got = list(iter_records(path, stats))
    assert got == records[:3]
    assert stats.finished and stats.records == 3
    tail = text[text.index('"r3"'):cut]
    tail_start = text.rindex("{", 0, text.index('"r3"'))
    assert stats.unparsed_bytes == len(text[tail_start:cut].encode("utf-8"))
    assert len(tail) > 0


def test_jsonl_with_corrupt_line_and_truncated_tail(tmp_path):
    good = [_rec(i) for i in range(5)]
    lines = [json.dumps(r) for r in good]
    corrupt = '{"id": "bad", "conversations": [{"from": "human", "value": "x"}, BROKEN'
    body = "\n".join(lines[:2] + [corrupt] + lines[2:]) + "\n" + lines[0][:25]
    path = tmp_path / "data.jsonl"
    path.write_text(body, encoding="utf-8")
    stats = ReadStats()
    got = list(iter_records(path, stats))
    assert got == good
    assert stats.unparsed_bytes == len(corrupt.encode()) + 25
    # both regions are counted, and the first is named by line: what a user opens to mend it
    assert stats.unparsed_regions == 2
    assert stats.first_unparsed == {"file": str(path), "line": 3, "after_record": 2, "text": corrupt[:60]}


@pytest.mark.parametrize("chunk", [7, 64, 1 << 22])
def test_the_first_unparsed_region_is_named_by_line_across_reads(tmp_path, monkeypatch, chunk):
    """The line of the first corrupt region is right whatever the read size (the buffer is compacted
    at every read): a JSON array over many lines, a corrupt record in the middle."""
    import data_prep.sharegpt as sg

    monkeypatch.setattr(sg, "_CHUNK_CHARS", chunk)
    good = [_rec(i) for i in range(6)]
    corrupt = '{"id": "bad", "conversations": [oops'
    lines = ["["] + [json.dumps(r) + "," for r in good[:4]] + [corrupt + ","] + [json.dumps(r) + "," for r in good[4:]]
    path = tmp_path / "data.json"
    path.write_text("\n".join(lines)[:-1] + "\n]\n", encoding="utf-8")
    stats = ReadStats()
    assert list(iter_records(path, stats)) == good
    assert stats.unparsed_regions == 1 and stats.unparsed_bytes == len(corrupt)
    assert stats.first_unparsed == {"file": str(path), "line": 6, "after_record": 4, "text": corrupt}


def test_complete_file_has_no_unparsed_bytes(tmp_path):
    records = [_rec(i) for i in range(3)]
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(records))
    stats = ReadStats()
    assert list(iter_records(path, stats)) == records and stats.unparsed_bytes == 0


def test_each_bad_record_kind_is_skipped_and_counted(tmp_path):
    H, G = "human", "gpt"
    bad = {
        "missing_conversations": [{"id": "a"}, {"id": "a2", "conversations": "not a list"}, "not a dict"],
        "non_string_value": [{"id": "b", "conversations": [{"from": H, "value": 3}, {"from": G, "value": "x"}]}],
        "empty_turn": [{"id": "c", "conversations": [{"from": H, "value": "  \n"}, {"from": G, "value": "x"}]}],
        "unknown_role": [{"id": "d", "conversations": [{"from": "robot", "value": "q"}, {"from": G, "value": "x"}]}],
        "no_assistant_turn": [{"id": "e", "conversations": [{"from": H, "value": "q"}]},
                              {"id": "e2", "conversations": []},
                              # leading assistant turns are dropped; nothing with a reply is left
                              {"id": "f", "conversations": [{"from": G, "value": "x"}, {"from": H, "value": "q"}]},
                              {"id": "f2", "conversations": [{"from": "system", "value": "s"}, {"from": G, "value": "x"}]}],
        "misplaced_system": [{"id": "h", "conversations": [{"from": H, "value": "q"}, {"from": "system", "value": "s"},
                                                           {"from": G, "value": "x"}]}],
        "bad_train_flag": [{"id": "i", "conversations": [{"from": H, "value": "q"}, {"from": G, "value": "x", "weight": 0.5}]},
                           {"id": "i2", "conversations": [{"from": H, "value": "q"}, {"from": G, "value": "x", "train": "no"}]}],
        "unsupported_field": [{"id": "j", "conversations": [{"from": H, "value": "q"},
                                                            {"from": G, "value": "x", "tool_calls": [{"id": "c"}]}]}],
    }
    assert set(bad) == set(BAD_REASONS)
    good = [
        {"id": "g1", "conversations": [{"from": "system", "value": "sys"}, {"from": "user", "value": "q"},
                                       {"from": "chatgpt", "value": "a"}, {"from": "human", "value": "trailing"}]},
        {"id": "g2", "conversations": [{"from": "Human", "value": "q"}, {"from": "bard", "value": "a"},
                                       {"from": "human", "value": "q2"}, {"from": "bing", "value": "a2"},
                                       {"from": "human", "value": "q3"}, {"from": "assistant", "value": "a3"}]},
    ]
    records = [r for rs in bad.values() for r in rs] + good
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    stats = ReadStats()
    convs = list(iter_conversations(path, stats))
    assert dict(stats.dropped) == {k: len(v) for k, v in bad.items()}
    # the summary names the first offending record of every reason, with the message
    assert stats.examples["unknown_role"] == {"id": "d", "message": "turn 0: unknown role 'robot'"}
    assert stats.examples["no_assistant_turn"]["id"] == "e" and stats.examples["missing_conversations"]["id"] == "a"
    assert stats.kept == 2 and stats.records == len(records)
    assert [c.id for c in convs] == ["g1", "g2"]
    # roles mapped, the turn after the last assistant turn dropped
    assert [m["role"] for m in convs[0].messages] == ["system", "user", "assistant"]
    assert [m["role"] for m in convs[1].messages] == ["user", "assistant"] * 3


def test_missing_id_gets_positional_id():
    conv = normalize({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}, 7)
    assert conv.id == "record-7"


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        list(iter_conversations(tmp_path / "nope.json"))


def test_heldout_split_is_deterministic_and_close_to_fraction():
    ids = [f"conv{i}" for i in range(4000)]
    held = [i for i in ids if is_heldout(i, 0.1, "salt")]
    assert held == [i for i in ids if is_heldout(i, 0.1, "salt")]
    assert 300 < len(held) < 500
    assert set(held) != {i for i in ids if is_heldout(i, 0.1, "other-salt")}
    assert not any(is_heldout(i, 0.0, "salt") for i in ids) and all(is_heldout(i, 1.0, "salt") for i in ids)
    with pytest.raises(ValueError, match="heldout_fraction"):
        is_heldout("x", 1.5, "salt")


def test_leading_assistant_turns_are_dropped_and_consecutive_roles_merged_and_counted(tmp_path):
    H, G = "human", "gpt"
    records = [
        # a ShareGPT part that starts with the assistant: the leading turns go, the rest is kept
        {"id": "p_1", "conversations": [{"from": G, "value": "tail of an answer"}, {"from": G, "value": "more"},
                                        {"from": H, "value": "next question"}, {"from": G, "value": "answer"}]},
        # two user turns in a row (would crash a Llama-2 style template): merged into one turn
        {"id": "m", "conversations": [{"from": H, "value": "first"}, {"from": H, "value": "second"},
                                      {"from": G, "value": "reply"}, {"from": G, "value": "more reply"}]},
        {"id": "ok", "conversations": [{"from": H, "value": "q"}, {"from": G, "value": "a"}]},
    ]
    path = tmp_path / "parts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    stats = ReadStats()
    convs = {c.id: c.messages for c in iter_conversations(path, stats)}
    assert convs["p_1"] == [{"role": "user", "content": "next question"}, {"role": "assistant", "content": "answer"}]
    assert convs["m"] == [{"role": "user", "content": "first\n\nsecond"},
                          {"role": "assistant", "content": "reply\n\nmore reply"}]
    assert dict(stats.fixed) == {"leading_assistant_dropped": 1, "merged_consecutive_roles": 1,
                                 "role_mapped_gpt_to_assistant": 3, "role_mapped_human_to_user": 3}
    assert stats.kept == 3 and not stats.dropped


def test_messages_format_and_non_utf8_bytes_are_counted(tmp_path):
    rec = {"id": "u1", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "caf\u00e9"},
                                    {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]}
    good = {"id": "u2", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path = tmp_path / "latin1.jsonl"
    path.write_bytes((json.dumps(rec, ensure_ascii=False) + "\n" + json.dumps(good)).encode("latin-1"))
    stats = ReadStats()
    convs = list(iter_conversations(path, stats))
    assert [c.id for c in convs] == ["u1", "u2"]
    assert convs[0].messages[1]["content"] == "caf\ufffd" and convs[0].messages[2]["content"] == "ok"
    assert stats.replaced_bytes == 1 and stats.replaced_records == 1
    stats = ReadStats()
    convs = list(iter_conversations(path, stats, encoding="latin-1"))
    assert convs[0].messages[1]["content"] == "caf\u00e9" and stats.replaced_bytes == 0


def test_a_lone_surrogate_becomes_u_fffd_counted_and_the_record_templates(tmp_path):
    """An escaped half of a surrogate pair ("\\ud83d": an emoji cut by a scraper) is a str no tokenizer
    encodes (the Rust tokenizers raise TypeError) and UTF-8 cannot hold: it is read as U+FFFD and
    counted, as undecodable bytes are, and data prep's templating goes through.  An escaped *pair* is
    one character and stays."""
    from core.tiny import tiny_tokenizer
    from data_prep.template import end_of_turn_ids, segment_records

    recs = [{"id": "cut", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "Sure \ud83d!"}]},
            {"id": "pair", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "ok \U0001F600"}]}]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(recs))  # ensure_ascii: "\ud83d" and "\ud83d\ude00" escapes
    assert "\\ud83d!" in path.read_text() and "\\ud83d\\ude00" in path.read_text()
    stats = ReadStats()
    cut, pair = list(iter_conversations(path, stats))
    assert cut.messages[1]["content"] == "Sure \ufffd!" and pair.messages[1]["content"] == "ok \U0001F600"
    assert stats.fixed["lone_surrogates_replaced"] == 1 and stats.fix_examples["lone_surrogates_replaced"]["id"] == "cut"
    tok = tiny_tokenizer()
    with pytest.raises(TypeError):  # what every record with one did to data prep before
        tok("Sure \ud83d!")
    for conv in (cut, pair):
        assert segment_records(tok, conv.messages, conv.id, set(end_of_turn_ids(tok)), 512)


def test_a_top_level_system_field_is_the_system_turn():
    """LLaMA-Factory's ``{"system": ..., "conversations": [...]}`` lost its system prompt silently: the chat
    template then put the base's default system prompt in its place (axolotl#520's kind)."""
    turns = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "Arr"}]
    conv = normalize({"id": "s0", "system": "You are a pirate.", "conversations": turns}, 0)
    assert conv.messages[0] == {"role": "system", "content": "You are a pirate."} and len(conv.messages) == 3
    assert ("system_field_used", "the record's 'system' field is its system turn") in conv.fixes
    both = normalize({"id": "s1", "system": "A", "conversations": [{"from": "system", "value": "B"}, *turns]}, 1)
    assert both.messages[0]["content"] == "B" and [r for r, _ in both.fixes if r.startswith("system_field")] == [
        "system_field_ignored"]


def test_specforge_turns_and_a_csv_json_column_are_read():
    """SpecForge's ``conversations`` of ``{role, content}`` was dropped as non_string_value; a CSV's
    ``messages`` column (a JSON string) could never be read although the docs list CSV."""
    conv = normalize({"id": "r0", "conversations": [{"role": "user", "content": "q"},
                                                    {"role": "assistant", "content": "a"}]}, 0)
    assert [m["role"] for m in conv.messages] == ["user", "assistant"]
    assert "turn_keys_role_content" in [r for r, _ in conv.fixes]
    row = {"id": "c0", "messages": json.dumps([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])}
    conv = normalize(row, 0)
    assert conv.messages[-1] == {"role": "assistant", "content": "a"} and "json_string_parsed" in [r for r, _ in conv.fixes]


def test_assistant_turns_marked_not_to_train_stay_as_context_without_loss():
    """axolotl's per-turn ``training`` flag and the ShareGPT ``weight`` of OpenHermes-style sets: a turn marked
    0 / false is kept as context with ``"train": False``; null means trained; a conversation whose every reply
    is marked is dropped; turns after the last trained reply are dropped; a flag on a user turn is ignored."""
    H, G = "human", "gpt"
    stats = ReadStats()
    records = [
        {"id": "w", "conversations": [{"from": H, "value": "q1", "weight": None}, {"from": G, "value": "a1", "weight": 0},
                                      {"from": H, "value": "q2", "weight": 1}, {"from": G, "value": "a2", "weight": 1.0},
                                      {"from": H, "value": "q3"}, {"from": G, "value": "a3", "weight": None}]},
        {"id": "t", "messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "training": True},
                                 {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2", "training": False}]},
        {"id": "m", "conversations": [{"from": H, "value": "q"}, {"from": G, "value": "a", "train": True},
                                      {"from": G, "value": "b", "train": False}, {"from": H, "value": "q2"},
                                      {"from": G, "value": "c"}]},
        {"id": "none", "conversations": [{"from": H, "value": "q"}, {"from": G, "value": "a", "weight": 0}]},
    ]
    convs = list(normalize_records(records, stats))
    assert [c.id for c in convs] == ["w", "t", "m"]
    w, t, m = convs
    assert w.messages == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "train": False},
                          {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
                          {"role": "user", "content": "q3"}, {"role": "assistant", "content": "a3"}]
    # the untrained last reply carries no loss, so it and the user turn before it are trailing turns
    assert t.messages == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    # a reply merged from a trained and an untrained part is not trained
    assert m.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a\n\nb", "train": False},
                          {"role": "user", "content": "q2"}, {"role": "assistant", "content": "c"}]
    assert stats.dropped == Counter({"no_assistant_turn": 1})
    assert stats.examples["no_assistant_turn"] == {"id": "none", "message": "every assistant turn is marked not to train"}
    assert stats.fixed["turns_not_trained"] == 2 and stats.fixed["train_flags_ignored"] == 1  # records, as every rule
    assert stats.fixed["trailing_turns_dropped"] == 1


def test_arrays_written_back_to_back_give_every_record(tmp_path):
    """``[...][...]`` (datasets#7037's ``to_json(lines=False)``, ``cat a.json b.json``): the second array was
    decoded as one "record" and its records lost, counted as a single ``missing_conversations``."""
    path = tmp_path / "two.json"
    path.write_text(json.dumps([_rec(0), _rec(1)]) + json.dumps([_rec(2), _rec(3), _rec(4)]) + "\n[" + json.dumps(_rec(5)))
    stats = ReadStats()
    assert [c.id for c in iter_conversations(path, stats)] == ["r0", "r1", "r2", "r3", "r4", "r5"]
    assert stats.records == 6 and not stats.dropped and stats.unparsed_bytes == 0


def test_a_cut_record_with_message_ids_is_unparsed_bytes_not_a_phantom_record(tmp_path):
    """OpenAI / OASST exports give every message an ``id``: resynchronising on "a dict with an id" read the first
    message of a cut record as a record (``missing_conversations``, id ``c1-m0``)."""
    def rec(i):
        return {"id": f"c{i}", "messages": [{"id": f"c{i}-m0", "role": "user", "content": "q"},
                                            {"id": f"c{i}-m1", "role": "assistant", "content": "a long answer"}]}
    cut = json.dumps(rec(1))[:-30]
    path = tmp_path / "cut.jsonl"
    path.write_text(json.dumps(rec(0)) + "\n" + cut + "\n" + json.dumps(rec(2)) + "\n")
    stats = ReadStats()
    assert [c.id for c in iter_conversations(path, stats)] == ["c0", "c2"]
    assert stats.records == 2 and not stats.dropped and stats.unparsed_bytes == len(cut.rstrip(",").encode())


def test_a_raw_control_character_inside_a_string_is_that_character(tmp_path):
    """A tab or newline written raw inside a string (JSON wants ``\\t``; hand edits and ad-hoc writers leave them,
    "Invalid control character at" in many trainers' issues) lost the whole record to ``unparsed_bytes``.  A line
    cut inside a string still costs only that line."""
    good = '{"id": "t", "conversations": [{"from": "human", "value": "a\tb\rc"}, {"from": "gpt", "value": "x\ny"}]}'
    cut = json.dumps(_rec(1))[:50]
    path = tmp_path / "raw.jsonl"
    path.write_text(good + "\n" + cut + "\n" + json.dumps(_rec(2)) + "\n", newline="")
    stats = ReadStats()
    convs = list(iter_conversations(path, stats))
    assert [c.id for c in convs] == ["t", "r2"] and stats.unparsed_bytes == len(cut)
    assert convs[0].messages == [{"role": "user", "content": "a\tb\rc"}, {"role": "assistant", "content": "x\ny"}]


def test_an_empty_system_turn_is_no_system_prompt():
    """``{"from": "system", "value": ""}`` (SlimOrca / OpenHermes-style exports) dropped the whole record as
    ``empty_turn``, although an empty top-level ``system`` field already read as no system prompt."""
    fixed = Counter()
    conv = normalize({"id": "e", "system": "Be brief.", "conversations": [
        {"from": "system", "value": " "}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}, 0, fixed=fixed)
    assert conv.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"},
                             {"role": "assistant", "content": "a"}]
    assert fixed["empty_system_dropped"] == 1 and fixed["system_field_used"] == 1
    conv = normalize({"id": "m", "messages": [{"role": "system", "content": ""}, {"role": "user", "content": "q"},
                                              {"role": "assistant", "content": "a"}]}, 0)
    assert conv.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    bad = normalize({"id": "u", "conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "a"}]}, 0)
    assert bad == "empty_turn" and bad.message == "turn 0: empty user turn"


@pytest.mark.parametrize("content,said", [
    ([{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": "x.png"}}],
     "turn 0: 'content' holds a part of type 'image_url'; only {'type': 'text', 'text': ...} parts are read"),
    (None, "turn 0: 'content' is missing or null"), (42, "turn 0: 'content' is of type int, not a string"),
    ([], "turn 0: 'content' is an empty list, not a string")])
def test_a_turn_that_is_not_text_is_dropped_saying_what_it_holds(content, said):
    """An image part (LLaVA / OpenAI vision records) was dropped as "'content' is missing or not a string", which
    sent the user looking for a missing key."""
    out = normalize({"id": "v", "messages": [{"role": "user", "content": content},
                                             {"role": "assistant", "content": "A cat."}]}, 0)
    assert out == "non_string_value" and out.message.startswith(said)


def test_system_field_and_id_are_cleaned_or_refused_like_turn_text():
    """A lone surrogate in the ``system`` field or the id crashed templating and the split's hashing with a
    traceback naming no record; a non-string ``system`` was dropped silently (the record trained without it)."""
    turns = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    conv = normalize({"id": "r\ud83d", "system": "You are \ud83d helpful", "conversations": turns}, 0)
    assert conv.id == "r\ufffd" and conv.messages[0] == {"role": "system", "content": "You are \ufffd helpful"}
    assert "lone_surrogates_replaced" in dict(conv.fixes)
    fixed = Counter()
    assert "lone_surrogates_replaced" in dict(normalize({"id": "x\udc00", "conversations": turns}, 0, fixed=fixed).fixes)
    assert fixed["lone_surrogates_replaced"] == 1  # the summary counts what the record lists
    drop = normalize({"id": "s", "system": ["You are a pirate."], "conversations": turns}, 0)
    assert drop == "non_string_value" and drop.message == "the record's 'system' field is a list, not a string"
    nan = float("nan")  # pandas' null in every column of a frame that has it anywhere
    conv = normalize({"id": nan, "conversation_id": "cid", "system": nan,
                      "conversations": [turns[0], {**turns[1], "weight": nan}]}, 3)
    assert conv.id == "cid" and conv.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert normalize({"id": "", "conversations": turns}, 7).id == "record-7"


@pytest.mark.parametrize("where,record", [
    ("turn 1: 'tool_calls'", {"messages": [{"role": "user", "content": "Weather in Paris?"}, {
        "role": "assistant", "content": "Let me check.", "tool_calls": [{"type": "function", "function": {"name": "w"}}]}]}),
    ("turn 1: 'reasoning_content'", {"messages": [{"role": "user", "content": "2+2?"},
                                                  {"role": "assistant", "content": "4", "reasoning_content": "Add."}]}),
    ("the record's 'tools'", {"tools": [{"type": "function"}], "conversations": [
        {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}),
])
def test_tool_calls_and_reasoning_refuse_the_record(where, record):
    """speculators#561's kind: a reply's tool call (or its reasoning, or the prompt's tool schema) was dropped
    silently, so the drafter trained on "Let me check." as the whole reply."""
    drop = normalize({"id": "t", **record}, 0)
    assert drop == "unsupported_field" and drop.message.startswith(f"{where} holds tool calls")
    empty = {"id": "e", "tools": None, "messages": [{"role": "user", "content": "q"}, {
        "role": "assistant", "content": "a", "tool_calls": [], "reasoning_content": None, "function_call": float("nan")}]}
    assert normalize(empty, 0).messages[-1] == {"role": "assistant", "content": "a"}  # a shared column's empty cells


def test_turns_keyed_both_ways_count_only_the_other_layout():
    turns = [{"role": "user", "content": "q"}, {"from": "gpt", "value": "a"}, {"role": "user", "content": "q2"},
             {"from": "gpt", "value": "a2"}]
    conv = normalize({"id": "m", "conversations": turns}, 0)
    assert [r for r, _ in conv.fixes if r.startswith("turn_keys")] == ["turn_keys_role_content"]
    assert [m["content"] for m in conv.messages] == ["q", "a", "q2", "a2"]


def test_gemini_model_and_openai_developer_roles_are_read():
    """Gemini / Gemma chat data name the assistant ``model`` and OpenAI's newer exports name the system message
    ``developer``: both were dropped as ``unknown_role``.  Now mapped and counted, in data prep and evaluation
    prompts alike (one role table, :data:`data_prep.sharegpt.ROLE_MAP`)."""
    fixed = Counter()
    conv = normalize({"id": "g", "messages": [{"role": "developer", "content": "Be brief."},
                                              {"role": "user", "content": "q"}, {"role": "model", "content": "a"}]},
                     0, fixed=fixed)
    assert conv.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"},
                             {"role": "assistant", "content": "a"}]
    assert fixed == Counter({"role_mapped_developer_to_system": 1, "role_mapped_model_to_assistant": 1})
    bad = normalize({"id": "t", "messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "a"}]}, 0)
    assert bad == "unknown_role"  # a tool result is still no assistant reply


def test_evaluation_prompts_read_the_developer_role(tmp_path):
    from evaluation.prompts import read_jsonl_records

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "d", "messages": [{"role": "developer", "content": "Be brief."},
                                                     {"role": "user", "content": "Hi"}]}) + "\n")
    assert read_jsonl_records(f)[0]["messages"] == [{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Hi"}]


def test_lmsys_chat_1m_conversation_key_is_read():
    """lmsys-chat-1m keeps its turns under ``conversation`` ({role, content}): every record was dropped as
    ``missing_conversations``.  Read from there when neither ``conversations`` nor ``messages`` holds a list, in
    data prep and evaluation prompts alike."""
    rec = {"conversation_id": "c1", "model": "vicuna-13b", "turn": 1, "language": "English",
           "conversation": [{"content": "Hi", "role": "user"}, {"content": "Hello!", "role": "assistant"}]}
    fixed = Counter()
    conv = normalize(rec, 0, fixed=fixed)
    assert conv.id == "c1" and conv.messages == [{"role": "user", "content": "Hi"},
                                                  {"role": "assistant", "content": "Hello!"}]
    assert fixed == Counter({"conversation_key_read": 1})
    both = normalize({**rec, "messages": [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]}, 0)
    assert both.messages[0]["content"] == "A"  # a record's own messages come first
    assert normalize({"id": "x", "conversation": "not turns"}, 0) == "missing_conversations"


def test_evaluation_prompts_read_the_conversation_key(tmp_path):
    from evaluation.prompts import read_jsonl_records

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"conversation_id": "c1", "conversation": [
        {"content": "Hi", "role": "user"}, {"content": "Hello!", "role": "assistant"},
        {"content": "More?", "role": "user"}]}) + "\n")
    got = read_jsonl_records(f)[0]
    assert got["id"] == "c1" and got["messages"] == [{"role": "user", "content": "Hi"}]
    assert got["follow_ups"] == ("More?",)
