"""Sources through ``datasets`` (parquet, arrow, saved directories, json), the messages format, mixtures,
root-id splitting and fail-fast reading (issue 15)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.config import UserInputError, compose
from data_prep.front import heldout_prompts, iter_templated, read_split, split_of
from data_prep.split import root_id


def _sharegpt(i, prefix="s"):
    return {"id": f"{prefix}{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                                    {"from": "gpt", "value": f"answer {i}"}]}


def _messages(i, prefix="m"):
    return {"id": f"{prefix}{i}", "messages": [{"role": "user", "content": f"question {i}"},
                                              {"role": "assistant", "content": f"answer {i}"}]}


def _data_cfg(*extra):
    return compose(["data.max_conversations=null", "data.heldout_fraction=0.0", *extra]).data


def _ids(data):
    return [c.id for c in data.train + data.val]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The same 6 records (one bad) in every on-disk form."""
    import datasets

    root = tmp_path_factory.mktemp("sources")
    rows = [_messages(i) for i in range(5)] + [{"id": "bad", "messages": [{"role": "user", "content": "no reply"}]}]
    ds = datasets.Dataset.from_list(rows)
    out = {"parquet": root / "d.parquet", "arrow_dir": root / "saved", "jsonl": root / "d.jsonl",
           "dict_dir": root / "saved_dict"}
    ds.to_parquet(str(out["parquet"]))
    ds.save_to_disk(str(out["arrow_dir"]))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(out["dict_dir"]))
    out["jsonl"].write_text("\n".join(json.dumps(r) for r in rows))
    out["arrow"] = next(Path(out["arrow_dir"]).glob("*.arrow"))
    out["data_dir"] = root / "data_dir"  # a plain data directory: load_dataset(path), the hub-id code path
    out["data_dir"].mkdir()
    ds.to_parquet(str(out["data_dir"] / "train-00000.parquet"))
    return out


@pytest.mark.parametrize("kind,extra", [("parquet", []), ("arrow_dir", []), ("arrow", []), ("jsonl", []), ("data_dir", []),
                                        ("jsonl", ["data.reader=datasets"]), ("parquet", ["data.streaming=true"]),
                                        ("dict_dir", ["data.split=test"])])
def test_every_format_reads_the_same_conversations_with_the_same_counts(written, kind, extra):
    data = read_split(_data_cfg(f"data.path={written[kind]}", *extra))
    want = ["m0", "m1"] if "data.split=test" in extra else [f"m{i}" for i in range(5)]
    assert _ids(data) == want
    assert data.train[0].messages == [{"role": "user", "content": "question 0"}, {"role": "assistant", "content": "answer 0"}]
    if "data.split=test" not in extra:
        assert data.stats.records == 6 and data.stats.dropped == {"no_assistant_turn": 1}
        assert data.stats.examples["no_assistant_turn"]["id"] == "bad"


def test_format_is_enforced_when_given(written):
    with pytest.raises(UserInputError, match="no usable conversation in .*missing_conversations"):
        read_split(_data_cfg(f"data.path={written['parquet']}", "data.format=sharegpt"))


def test_mixture_is_deterministic_weighted_capped_and_recorded(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.json"
    a.write_text("\n".join(json.dumps(_sharegpt(i, "a")) for i in range(10)))
    b.write_text(json.dumps([_messages(i, "b") for i in range(10)]))
    cfg = _data_cfg(f"data.sources=[{{path: {a}, weight: 2}}, {{path: {b}, max: 3}}]", "data.max_conversations=8")
    data = read_split(cfg)
    # smooth weighted round robin: next from the source with the smallest (taken + 1) / weight
    assert _ids(data) == ["a0", "a1", "b0", "a2", "a3", "b1", "a4", "a5"]
    assert _ids(read_split(cfg)) == _ids(data)
    assert [s.describe()["conversations"] for s in data.sources] == [6, 2]
    capped = read_split(_data_cfg(f"data.sources=[{{path: {a}, weight: 2}}, {{path: {b}, max: 3}}]"))
    assert _ids(capped).count("a9") == 1 and [c.id for c in capped.train if c.id.startswith("b")] == ["b0", "b1", "b2"]


def test_a_source_without_usable_conversations_is_named(tmp_path):
    a, bad = tmp_path / "a.jsonl", tmp_path / "bad.jsonl"
    a.write_text(json.dumps(_sharegpt(0)))
    bad.write_text(json.dumps({"id": "x1", "conversations": [{"from": "robot", "value": "q"}]}))
    with pytest.raises(UserInputError, match=r"bad\.jsonl.*unknown_role.*'x1'.*unknown role 'robot'"):
        read_split(_data_cfg(f"data.sources=[{{path: {a}}}, {{path: {bad}}}]"))
    with pytest.raises(UserInputError, match="nope.parquet"):
        read_split(_data_cfg(f"data.path={tmp_path / 'nope.parquet'}"))


@pytest.mark.parametrize("text,where", [
    ("{'id': 'a', 'conversations': [{'from': 'human', 'value': 'q'}]}\n", r"line 1: .\{'id': 'a'"),  # a Python dump
    (json.dumps(_sharegpt(0)).encode("utf-16"), r"line 1: .*UTF-16 text\? set data\.encoding=utf-16")])
def test_a_file_with_no_json_record_says_where_its_text_is_not_json(tmp_path, text, where):
    """A file none of whose text decoded said "records read 0, dropped {}" and nothing of the bytes it skipped
    (counted in unparsed_bytes), so the user had nothing to look at."""
    path = tmp_path / "nojson.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UserInputError, match=r"nojson\.jsonl \(records read 0, dropped \{\}; \d+ bytes in 1 region\(s\) "
                                             r"are not JSON records, the first at " + where):
        read_split(_data_cfg(f"data.path={path}"))


@pytest.mark.parametrize("path", ["tp/missing.json", "missing.JSONL", "data/sub/missing", "nope.parquet"])
def test_a_missing_relative_file_is_named_without_asking_the_hub(path, monkeypatch, tmp_path):
    """A relative path that can only be a local file (a data suffix, or folders) and is not there is
    refused as a missing file at once: never handed to the hub as a dataset id (retries, then a
    misleading ConnectionError)."""
    import datasets

    def hub(*args, **kwargs):
        raise AssertionError(f"asked the hub for {args}")

    monkeypatch.setattr(datasets, "load_dataset", hub)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserInputError, match=f"data.path='{path}': no such file or directory"):
        read_split(_data_cfg(f"data.path={path}"))


def test_heldout_split_keeps_the_parts_of_one_conversation_together():
    assert root_id("QWJhYvA_0") == "QWJhYvA" and root_id("abc_12") == "abc" and root_id("record-3") == "record-3"
    cfg_root = _data_cfg("data.heldout_fraction=0.3")
    cfg_id = _data_cfg("data.heldout_fraction=0.3", "data.split_key=id")
    roots = [f"conv{i}" for i in range(60)]
    by_root = {r: {split_of(f"{r}_{k}", cfg_root) for k in range(4)} for r in roots}
    assert all(len(s) == 1 for s in by_root.values())
    assert {s.pop() for s in by_root.values()} == {"train", "val"}
    # keyed by the full id (the old behaviour), parts of one conversation land on both sides
    assert any(len({split_of(f"{r}_{k}", cfg_id) for k in range(4)}) == 2 for r in roots)


def test_enumerated_ids_under_one_root_are_refused_until_split_key_is_id(tmp_path):
    """FastChat-style ids ``identity_0`` ... share the root ``identity``: keyed by root, the whole source
    would land on one side of the split.  More conversations under one root than any ShareGPT conversation
    has parts is refused by name, before anything is written; ``data.split_key=id`` reads them all, and a
    ShareGPT conversation of many parts is still one root."""
    from data_prep.split import MAX_PARTS_PER_ROOT

    n = MAX_PARTS_PER_ROOT + 1
    enumerated = tmp_path / "identity.jsonl"
    enumerated.write_text("\n".join(json.dumps(_sharegpt(i, prefix="identity_")) for i in range(n)))
    with pytest.raises(UserInputError, match=rf"identity\.jsonl: {n} conversations share the root id 'identity' "
                                             r"\('identity_0' \.\.\. 'identity_256'\).*set data.split_key=id"):
        read_split(_data_cfg("data.heldout_fraction=0.3", f"data.path={enumerated}"))
    # every reader of the split refuses them alike: online training's stream (of the side the root is not
    # on, so nothing reaches the tokenizer) and the held-out prompts
    other = "train" if split_of("identity_0", _data_cfg("data.heldout_fraction=0.3")) == "val" else "val"
    for read in (lambda cfg: list(iter_templated(cfg, None, [], split=other)), lambda cfg: list(heldout_prompts(cfg))):
        with pytest.raises(UserInputError, match=r"share the root id 'identity'.*set data.split_key=id"):
            read(_data_cfg("data.heldout_fraction=0.3", f"data.path={enumerated}"))
    assert len(list(heldout_prompts(_data_cfg("data.heldout_fraction=0.3", f"data.path={enumerated}",
                                              "data.split_key=id")))) > 0
    data = read_split(_data_cfg("data.heldout_fraction=0.3", f"data.path={enumerated}", "data.split_key=id"))
    assert len(data.train) + len(data.val) == n and data.train and data.val  # both sides, as ids hash apart
    parts = tmp_path / "parts.jsonl"
    parts.write_text("\n".join(json.dumps(_sharegpt(k, prefix="QWJhYvA_")) for k in range(89)))  # ShareGPT V3's largest
    data = read_split(_data_cfg("data.heldout_fraction=0.3", f"data.path={parts}"))
    assert len(data.train) + len(data.val) == 89 and not (data.train and data.val)  # one conversation, one side


@pytest.mark.parametrize("kind", ["parquet", "arrow_dir"])
def test_python_m_data_prep_runs_on_a_parquet_file_or_a_saved_dataset(written, kind, tiny_model_dir, tmp_path):
    from data_prep.__main__ import main
    from data_prep.cache import CacheReader

    summary = main([f"model.path={tiny_model_dir}", "model.dtype=float32", f"data.path={written[kind]}",
                    "data.heldout_fraction=0.3", "labels=teacher_forced", "prep.progress=false",
                    f"output_root={tmp_path / 'out'}"])
    assert summary["complete"] and summary["conversations"] == 5 and summary["dropped"] == {"no_assistant_turn": 1}
    readers = [CacheReader(Path(summary["cache_dir"]) / split) for split in ("train", "val")]
    assert sorted(r[i]["id"] for r in readers for i in range(len(r))) == [f"m{i}" for i in range(5)]
    assert readers[0].manifest["data_sources"][0]["path"] == str(written[kind])


def test_id_less_records_of_a_mixture_get_ids_unique_across_sources(tmp_path):
    """A record without an id is named by its position; two id-less sources both had ``record-0`` ...,
    so their held-out prompts collided in the evaluation (results are kept per id).  In a mixture the
    generated id names the source (``record-<source>-<index>``); one source keeps ``record-<index>``."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path, tag in ((a, "a"), (b, "b")):
        rows = [{k: v for k, v in _sharegpt(i, prefix=tag).items() if k != "id"} for i in range(4)]
        path.write_text("\n".join(json.dumps(r) for r in rows))
    mixed = _ids(read_split(_data_cfg(f"data.sources=[{{path: {a}}}, {{path: {b}}}]")))
    assert sorted(mixed) == sorted([f"record-0-{i}" for i in range(4)] + [f"record-1-{i}" for i in range(4)])
    assert sorted(_ids(read_split(_data_cfg(f"data.path={a}")))) == [f"record-{i}" for i in range(4)]
    prompts = [pid for pid, _ in heldout_prompts(_data_cfg(f"data.sources=[{{path: {a}}}, {{path: {b}}}]",
                                                           "data.heldout_fraction=1.0"))]
    assert len(prompts) == len(set(prompts)) == 8


@pytest.mark.parametrize("sources,said", [
    ("m.jsonl", "data.sources='m.jsonl' must be a list of sources"),
    ("{path: m.jsonl}", "data.sources={'path': 'm.jsonl'} must be a list of sources"),
    ("[{path: m.jsonl, weight: abc}]", "data.sources[0].weight='abc' must be a number"),
    ("[{path: m.jsonl, max: ten}]", "data.sources[0].max='ten' must be a number (a whole one)"),
    ("[{path: m.jsonl, max: 2.5}]", "data.sources[0].max=2.5 must be a number (a whole one)")])
def test_a_malformed_data_sources_is_one_line_before_any_read(sources, said):
    """A string was read letter by letter (each letter sent to the Hub, the error naming data.path='m'); a
    wrong-typed weight or max was a traceback."""
    from data_prep.sources import source_specs

    with pytest.raises(UserInputError) as exc:
        source_specs(compose([f"data.sources={sources}"]).data)
    assert str(exc.value).startswith(said), str(exc.value)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_folder_of_files_with_different_columns_is_one_line_that_says_so(tmp_path, streaming):
    """datasets#7322-style: one file of ``conversations``, one of ``messages`` in one folder.  Not a traceback
    from the streamed rows, and not "data files not found" when the files are there."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps(_sharegpt(0)))
    (folder / "b.jsonl").write_text(json.dumps(_messages(1)))
    with pytest.raises(UserInputError, match=r"data.path='.*mixed': its files do not share one set of columns.*"
                                             r"list each file as its own data.sources entry"):
        read_split(_data_cfg(f"data.path={folder}", f"data.streaming={str(streaming).lower()}"))
    (folder / "c.jsonl").write_text(json.dumps(_messages(2)))  # the mixture the message asks for reads them all
    spec = ", ".join(f"{{path: {folder / n}}}" for n in ("a.jsonl", "b.jsonl", "c.jsonl"))
    assert sorted(_ids(read_split(_data_cfg(f"data.sources=[{spec}]")))) == ["m1", "m2", "s0"]


@pytest.mark.parametrize("suffix", ["parquet", "arrow"])
def test_a_columnar_file_mixing_sharegpt_and_role_content_turns_keeps_both(tmp_path, suffix):
    """Arrow holds one struct for every turn of a column: a ShareGPT turn gets ``role``/``content`` = null and a
    SpecForge turn ``from``/``value`` = null.  Each record is read by the keys it fills."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sf = {"id": "sf", "conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    table = pa.Table.from_pylist([_sharegpt(0), sf])
    path = tmp_path / f"mixed.{suffix}"
    if suffix == "parquet":
        pq.write_table(table, path)
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:  # datasets' arrow
            writer.write_table(table)
    data = read_split(_data_cfg(f"data.path={path}"))
    assert sorted(_ids(data)) == ["s0", "sf"] and not data.stats.dropped
    conv = next(c for c in data.train + data.val if c.id == "sf")
    assert conv.messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert data.stats.fixed["turn_keys_role_content"] == 1


def test_a_csv_is_read_as_written(tmp_path):
    """pandas' type guessing read the ids ``007`` and ``7`` both as ``7.0`` (one conversation then dropped as a
    duplicate, and every id differed from the same data saved as JSONL) and the system prompt ``NA`` as null."""
    import csv

    turns = json.dumps([{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}])
    path = tmp_path / "ids.csv"
    with open(path, "w", newline="") as fh:
        csv.writer(fh).writerows([["id", "system", "conversations"], ["007", "", turns], ["7", "NA", turns],
                                  ["", "", turns], ["12", "", turns]])
    data = read_split(_data_cfg(f"data.path={path}"))
    convs = {c.id: c for c in data.train + data.val}
    assert list(convs) == ["007", "7", "record-2", "12"] and not data.stats.dropped
    assert convs["7"].messages[0] == {"role": "system", "content": "NA"}
    assert convs["007"].messages[0] == {"role": "user", "content": "q"}


@pytest.mark.parametrize("column,role,text", [("conversations", "from", "value"), ("messages", "role", "content")])
def test_a_sequence_of_turn_dicts_column_is_read_by_row(tmp_path, column, role, text):
    """``datasets`` returns a column declared ``Sequence({"from", "value"})`` as one list per key; it was refused
    as "no 'conversations' list", which did not say why.  ``data.format=auto`` finds a ``messages`` one too."""
    import datasets

    features = datasets.Features({"id": datasets.Value("string"), column: datasets.Sequence(
        {role: datasets.Value("string"), text: datasets.Value("string")})})
    rows = {"id": ["q0"], column: [{role: ["user" if role == "role" else "human", "assistant" if role == "role" else "gpt"],
                                    text: ["Hi", "Hello."]}]}
    path = tmp_path / f"seq-{column}.parquet"
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))
    data = read_split(_data_cfg(f"data.path={path}"))
    assert [c.messages for c in data.train + data.val] == [[{"role": "user", "content": "Hi"},
                                                            {"role": "assistant", "content": "Hello."}]]
    assert data.stats.fixed["columnar_turns_read"] == 1 and not data.stats.dropped


def test_a_csv_in_another_encoding_is_read_with_data_encoding(tmp_path):
    """``datasets`` decoded every CSV as UTF-8: ``data.encoding`` reached only the JSON reader."""
    import csv
    import io

    turns = json.dumps([{"from": "human", "value": "Caf\u00e9 ?"}, {"from": "gpt", "value": "Oui, caf\u00e9."}],
                       ensure_ascii=False)
    buf = io.StringIO()
    csv.writer(buf).writerows([["id", "conversations"], ["c1", turns]])
    path = tmp_path / "latin1.csv"
    path.write_bytes(buf.getvalue().encode("latin-1"))
    data = read_split(_data_cfg(f"data.path={path}", "data.encoding=latin-1"))
    assert [c.messages for c in data.train + data.val] == [[{"role": "user", "content": "Caf\u00e9 ?"},
                                                            {"role": "assistant", "content": "Oui, caf\u00e9."}]]


@pytest.mark.parametrize("name,extra", [("d.jsonl.gz", []), ("d.json.gz", []), ("d.jsonl.bz2", []), ("d.jsonl.xz", []),
                                        ("gzipped-but-named.jsonl", []), ("d.jsonl.gz", ["data.reader=datasets"]),
                                        ("d.csv.gz", [])])
def test_a_compressed_file_is_read_decompressed(tmp_path, name, extra):
    """A ``.jsonl.gz`` (dumps and hub files often ship gzipped) was refused as "unsupported file
    type '.gz'", and a ``.csv.gz`` had its header read as compressed bytes."""
    import bz2
    import csv
    import gzip
    import io
    import lzma

    rows = [_sharegpt(0), _messages(1)]
    if name.endswith(".csv.gz"):
        buf = io.StringIO()
        csv.writer(buf).writerows([["id", "messages"]] + [[r["id"], json.dumps(r["messages"])] for r in rows[1:]])
        text, want = buf.getvalue(), ["m1"]
    else:
        text = json.dumps(rows) if ".json." in name else "\n".join(json.dumps(r) for r in rows)
        want = ["s0", "m1"]
    pack = {".bz2": bz2.compress, ".xz": lzma.compress}.get(Path(name).suffix, gzip.compress)
    path = tmp_path / name
    path.write_bytes(pack(text.encode()))
    data = read_split(_data_cfg(f"data.path={path}", *extra))
    assert _ids(data) == want and not data.stats.dropped and data.stats.unparsed_bytes == 0
    assert data.train[-1].messages == [{"role": "user", "content": "question 1"}, {"role": "assistant", "content": "answer 1"}]


def test_a_cut_or_unreadable_compressed_file(tmp_path):
    """A gzip cut off mid-stream keeps its complete records and counts the cut one, as a cut plain file does; a zstd
    file (no reader here) or corrupt compressed data is one line naming the file."""
    import gzip
    import hashlib

    rows = [_sharegpt(i) for i in range(3)]
    for r in rows:  # text that does not compress away: cutting the stream's end cuts the last record
        r["conversations"][1]["value"] = "".join(hashlib.sha256(f"{r['id']}{k}".encode()).hexdigest() for k in range(4))
    packed = gzip.compress("\n".join(json.dumps(r) for r in rows).encode())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed[:-60])
    data = read_split(_data_cfg(f"data.path={cut}"))
    assert _ids(data) == ["s0", "s1"] and data.stats.unparsed_bytes > 0
    assert data.stats.first_unparsed["line"] == 3 and data.stats.first_unparsed["text"].startswith('{"id": "s2"')
    zst = tmp_path / "d.jsonl.zst"
    zst.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 16)
    with pytest.raises(UserInputError, match=r"d\.jsonl\.zst: zstd-compressed.*zstd -d"):
        read_split(_data_cfg(f"data.path={zst}"))
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(packed[:12] + b"\xff" * 12 + packed[24:])
    with pytest.raises(UserInputError, match=r"bad\.jsonl\.gz: cannot be read past line 1 .*corrupt"):
        read_split(_data_cfg(f"data.path={bad}"))


def test_pandas_to_csv_of_a_list_column_is_read_as_its_literal(tmp_path):
    """``DataFrame.to_csv`` writes a list-of-dicts column as Python's repr (``[{'from': 'human', ...}]``), not JSON:
    every record was dropped as ``missing_conversations`` ("no 'conversations' list").  It is now parsed with
    ``ast.literal_eval`` (literals only: a cell holding code stays text and is dropped as before)."""
    import pandas as pd

    turns = [{"from": "human", "value": "It's \"quoted\", isn't it?"}, {"from": "gpt", "value": "Yes: None, True."}]
    code = "[__import__('os').getcwd()]"  # a cell that is code, not a literal
    pd.DataFrame({"id": ["p0", "p1"], "conversations": [turns, code]}).to_csv(tmp_path / "chats.csv", index=False)
    data = read_split(_data_cfg(f"data.path={tmp_path / 'chats.csv'}"))
    assert [c.messages for c in data.train + data.val] == [[{"role": "user", "content": "It's \"quoted\", isn't it?"},
                                                            {"role": "assistant", "content": "Yes: None, True."}]]
    assert data.stats.fixed["python_repr_parsed"] == 1
    assert dict(data.stats.dropped) == {"missing_conversations": 1}
