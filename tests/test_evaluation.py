"""`python -m evaluation` on the tiny model: reports, parity failure exit, prompt sources, heads."""
from __future__ import annotations

import json
import re

import pytest
import torch

from core.config import compose
from decoding.vanilla import VanillaDecoder
from evaluation.__main__ import main, rewrite_argv
from evaluation.prompts import PromptError, read_jsonl_prompts, read_jsonl_records
from evaluation.merge import main as merge_main, merge_progress
from evaluation.progress import write_progress
from evaluation.runner import ParityError, run_evaluation


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"question_id": 81, "turns": ["Write a short poem about the sea.", "second turn is ignored"]},
        {"id": "p2", "prompt": "def add(a, b):"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"},
                      {"role": "assistant", "content": "ignored"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def _argv(tiny_model_dir, tmp_path, *extra):
    return [f"model.path={tiny_model_dir}", "model.attn_implementation=eager", f"eval.output_dir={tmp_path / 'out'}",
            f"output_root={tmp_path / 'root'}",
            "eval.max_new_tokens=12", "eval.warmup=0", *extra]


def test_read_jsonl_prompts_fields(prompts_file):
    got = read_jsonl_prompts(prompts_file)
    assert [g[0] for g in got] == ["81", "p2", "line3"]
    assert got[0][1] == [{"role": "user", "content": "Write a short poem about the sea."}]
    assert got[1][1] == [{"role": "user", "content": "def add(a, b):"}]
    assert got[2][1][-1] == {"role": "user", "content": "Hello!"} and len(got[2][1]) == 2
    assert len(read_jsonl_prompts(prompts_file, limit=2)) == 2


def test_bad_prompt_files_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{not json}\n')
    with pytest.raises(PromptError, match=r"bad.jsonl:2: invalid JSON"):
        read_jsonl_prompts(bad)
    bad.write_text('{"turns": ["ok"]}\n{"answer": "x"}\n')
    with pytest.raises(PromptError, match=r"bad.jsonl:2: no prompt field.*answer"):
        read_jsonl_prompts(bad)
    with pytest.raises(PromptError, match="not found"):
        read_jsonl_prompts(tmp_path / "missing.jsonl")
    bad.write_bytes(b'{"turns": ["ok"]}\n{"turns": ["caf\xff"]}\n')
    with pytest.raises(PromptError, match=r"bad.jsonl:2: not UTF-8 text \(byte 0xff"):
        read_jsonl_prompts(bad)
    bad.write_text('{"turns": ["line\u2028separator"]}\n', encoding="utf-8")
    assert read_jsonl_prompts(bad)[0][1][0]["content"] == "line\u2028separator"
    # half of a surrogate pair cannot be tokenized: named with its field, before the base loads
    bad.write_text('{"turns": ["ok"]}\n{"turns": ["fine", "cut \\ud83d"]}\n')
    with pytest.raises(PromptError, match=r"bad.jsonl:2: turns\[1\] holds a lone UTF-16 surrogate"):
        read_jsonl_prompts(bad)
    bad.write_text('{"turns": ["a \\ud83d\\ude00"]}\n')  # a whole pair is one character
    assert read_jsonl_prompts(bad)[0][1][0]["content"] == "a \U0001F600"
    # results and resume are kept per id: a repeated id is refused by line, not found mid-run
    bad.write_text('{"id": "q1", "turns": ["a"]}\n{"id": "q2", "turns": ["b"]}\n{"id": "q1", "turns": ["c"]}\n')
    with pytest.raises(PromptError, match=r"bad.jsonl:3: id 'q1' is also the id of line 1"):
        read_jsonl_prompts(bad)


def test_prompt_ids_and_fields_read_as_data_prep_reads_them(tmp_path):
    """A null id field is skipped (the next one, else line<N>); an id that is another prompt's turn key
    (``<id>/turn<k>``) is refused by line before any decoding; Alpaca's ``input`` joins its instruction and a
    top-level ``system`` field is the system turn (LLaMA-Factory); ``messages`` are normalised as data prep
    does (leading replies dropped, consecutive turns of one role joined)."""
    f = tmp_path / "p.jsonl"
    rows = [{"question_id": None, "id": "x1", "turns": ["a"]}, {"question_id": None, "turns": ["b"]},
            {"id": "alp", "instruction": "Translate to French.", "input": "The quick brown fox", "output": "..."},
            {"id": "lf", "system": "Answer in one word.", "conversations": [{"from": "human", "value": "Hello!"},
                                                                           {"from": "gpt", "value": "Hi"}]},
            {"id": "msg", "messages": [{"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "A"},
                                       {"role": "user", "content": "B"}, {"role": "assistant", "content": "r"},
                                       {"role": "user", "content": "C"}, {"role": "user", "content": "D"}]}]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    got = {r["id"]: r for r in read_jsonl_records(f)}
    assert list(got) == ["x1", "line2", "alp", "lf", "msg"]
    assert got["alp"]["messages"] == [{"role": "user", "content": "Translate to French.\nThe quick brown fox"}]
    assert got["lf"]["messages"] == [{"role": "system", "content": "Answer in one word."},
                                     {"role": "user", "content": "Hello!"}]
    assert got["msg"]["messages"] == [{"role": "user", "content": "A\n\nB"}] and got["msg"]["follow_ups"] == ("C\n\nD",)
    f.write_text(json.dumps({"id": "q1", "turns": ["a", "b"]}) + "\n" + json.dumps({"id": "q1/turn2", "turns": ["c"]}))
    with pytest.raises(PromptError, match=r"p.jsonl:2: id 'q1/turn2' is the key of turn 2 of line 1's prompt 'q1'"):
        read_jsonl_records(f)


def test_nan_fields_read_as_null_as_data_prep_reads_them(tmp_path):
    """A NaN (pandas' null, written by ``json.dumps`` of a DataFrame row) in an id, ``system``, ``category``,
    ``input`` or prompt field reads as absent, as data prep's :func:`data_prep.sharegpt.is_null` reads it: before,
    a NaN system was refused, a NaN id became the prompt id ``'nan'`` (so two such lines clashed) and a NaN
    ``prompt`` beside ``turns`` was not skipped."""
    nan = float("nan")
    rows = [{"question_id": nan, "id": "x1", "system": nan, "category": nan, "turns": ["a"]},
            {"id": nan, "turns": ["b"]}, {"id": nan, "turns": ["c"]},
            {"id": "alp", "instruction": "Translate to French.", "input": nan},
            {"id": "t", "turns": nan, "prompt": "d"}]
    f = tmp_path / "nan.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))  # json.dumps writes the NaN literal, json.loads reads it
    got = {r["id"]: r for r in read_jsonl_records(f)}
    assert list(got) == ["x1", "line2", "line3", "alp", "t"]
    assert got["x1"]["messages"] == [{"role": "user", "content": "a"}] and got["x1"]["category"] is None
    assert got["alp"]["messages"] == [{"role": "user", "content": "Translate to French."}]
    assert got["t"]["messages"] == [{"role": "user", "content": "d"}] and got["t"]["follow_ups"] == ()
    f.write_text(json.dumps({"id": "s", "system": 3, "turns": ["a"]}))  # a non-null non-string is still refused
    with pytest.raises(PromptError, match=r"nan.jsonl:1: field 'system' must be a string"):
        read_jsonl_records(f)


def test_an_empty_system_message_is_no_system_prompt_as_data_prep_reads_it(tmp_path):
    """An empty system message refused the prompt file ("is an empty system turn") while data prep drops the turn."""
    f = tmp_path / "sys.jsonl"
    f.write_text(json.dumps({"id": "s", "messages": [{"role": "system", "content": ""}, {"role": "system", "content": "Hi."},
                                                     {"role": "user", "content": "q"}]}) + "\n")
    assert read_jsonl_records(f)[0]["messages"] == [{"role": "system", "content": "Hi."}, {"role": "user", "content": "q"}]


def test_a_raw_tab_inside_a_prompt_string_is_a_tab_as_data_prep_reads_it(tmp_path):
    """A raw tab inside a string (JSON wants ``\\t``) refused the file ("invalid JSON (Invalid control character
    at)") while data prep reads it as a tab."""
    f = tmp_path / "tab.jsonl"
    f.write_text('{"id": "t", "turns": ["col1\tcol2"]}\n')
    assert read_jsonl_records(f)[0]["messages"] == [{"role": "user", "content": "col1\tcol2"}]


def test_cli_oracle_report(tiny_model_dir, tmp_path, prompts_file, capsys):
    assert rewrite_argv(["checkpoint=x", "heads=ctc"]) == ["eval.checkpoint=x", "heads=ctc"]
    rc = main(_argv(tiny_model_dir, tmp_path, "checkpoint=oracle", f"eval.prompts={prompts_file}",
                    "eval.reference_depth=3", "eval.reference_width=2"))
    assert rc == 0
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} >= {"report.json", "acceptance.png", "config.yaml"}
    assert (out / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    assert "checkpoint: oracle" in (out / "config.yaml").read_text()
    rep = json.loads((out / "report.json").read_text())
    assert rep["parity"] == {"matched": 3, "total": 3, "mismatched_ids": [], "checked": True}
    assert [p["id"] for p in rep["per_prompt"]] == ["81", "p2", "line3"]
    for p in rep["per_prompt"]:
        assert p["match"] and p["method_tokens"] == p["vanilla_tokens"]
    m = rep["method"]
    steps, tokens = m["steps"], m["tokens"]
    # every step but a prompt's last accepts the whole depth-3 chain; τ = emitted / steps
    assert rep["tau"] == pytest.approx((tokens - 3) / steps)
    assert rep["tau"] > 3.0
    assert rep["acceptance_per_depth"] == [1.0, 1.0, 1.0]
    assert rep["base_forwards_per_token"]["vanilla"] == 1.0
    assert rep["base_forwards_per_token"]["method"] == pytest.approx((steps + 3) / tokens)
    assert rep["drafter_passes_per_step"] == 3.0
    assert "bonus token included" in rep["tau_convention"]
    assert "parity: 3/3" in capsys.readouterr().out


def test_random_drafter_tau_near_one(tiny_model_dir, tmp_path, prompts_file):
    cfg = compose(rewrite_argv(_argv(tiny_model_dir, tmp_path, "checkpoint=random", f"eval.prompts={prompts_file}",
                                     "eval.num_prompts=2")))
    rep = run_evaluation(cfg)
    assert rep["parity"]["matched"] == 2 and rep["num_prompts"] == 2
    assert rep["tau"] < 1.2


def test_variants_share_one_vanilla_pass(tiny_model_dir, tmp_path, prompts_file, capsys):
    """Two reference drafters in one run: one vanilla decode per prompt, a report per variant."""
    variants = "eval.variants=[{name: orc, checkpoint: oracle}, {checkpoint: random, reference_depth: 2}]"
    rc = main(_argv(tiny_model_dir, tmp_path, "checkpoint=oracle", f"eval.prompts={prompts_file}",
                    "eval.reference_depth=3", "eval.reference_width=2", variants))
    assert rc == 0
    out = tmp_path / "out"
    orc = json.loads((out / "orc" / "report.json").read_text())
    rnd = json.loads((out / "checkpoint=random,reference_depth=2" / "report.json").read_text())
    assert orc["vanilla"] == rnd["vanilla"]  # the same vanilla pass
    assert orc["parity"]["matched"] == rnd["parity"]["matched"] == 3
    assert orc["acceptance_per_depth"] == [1.0, 1.0, 1.0] and orc["tau"] > 3.0
    assert rnd["info"]["reference_depth"] == 2 and rnd["tau"] < 1.2
    assert (orc["eval"]["reference_depth"], rnd["eval"]["reference_depth"]) == (3, 2)  # the settings each ran with
    assert orc["speedup"] == pytest.approx(orc["method"]["tokens_per_s"] / orc["vanilla"]["tokens_per_s"])
    summary = json.loads((out / "summary.json").read_text())
    assert [r["variant"] for r in summary["variants"]] == ["orc", "checkpoint=random,reference_depth=2"]
    assert summary["variants"][0]["tau"] == orc["tau"] and summary["variants"][1]["parity"] == "3/3"
    printed = capsys.readouterr().out
    assert "== orc" in printed and printed.count("parity: 3/3") == 2
    # evaluation.summary over the run's top folder: one row per variant (it had no report.json to read)
    from evaluation.summary import main as summary_main

    assert summary_main([str(tmp_path / "table"), f"heads={out}"]) == 0
    rows = json.loads((tmp_path / "table" / "summary.json").read_text())["rows"]
    assert [(r["variant"], r["tau"]) for r in rows] == [("heads/orc", orc["tau"]),
                                                         ("heads/checkpoint=random,reference_depth=2", rnd["tau"])]
    assert summary_main([str(tmp_path / "table"), f"heads={out},{out / 'orc'}"]) == 2  # timing: not a variants run
    assert "is an eval.variants run (variants orc, checkpoint=random,reference_depth=2) but its timing folder" in \
        capsys.readouterr().err
    # an OUT_DIR through a file, and a report.json that is no report: one error line each, not a traceback
    (tmp_path / "afile").write_text("x")
    assert summary_main([str(tmp_path / "afile" / "t"), f"a={out / 'orc'}"]) == 2
    assert f"error: OUT_DIR {tmp_path / 'afile' / 't'} cannot be written: {tmp_path / 'afile'} is a file" in \
        capsys.readouterr().err
    # the run's own folder as OUT_DIR overwrote the summary.json that lists its variants
    before = (out / "summary.json").read_bytes()
    assert summary_main([str(out), f"v={out}"]) == 2
    assert f"error: OUT_DIR {out} is an evaluation's folder (it holds " in capsys.readouterr().err
    assert (out / "summary.json").read_bytes() == before
    for bad in (f"a={out},{out / 'orc'},{out}", f"={out}", "a="):  # a third folder or no name was dropped silently
        assert summary_main([str(tmp_path / "t3"), bad]) == 2
        assert "give NAME=QUALITY_DIR[,TIMING_DIR]" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "report.json").write_text("{}")
    assert summary_main([str(tmp_path / "t2"), f"a={tmp_path / 'empty'}"]) == 2
    assert "report.json: not an evaluation report (no method, checkpoint, base_forwards_per_token)" in \
        capsys.readouterr().err
    from evaluation.merge import main as merge_main

    assert merge_main(["--no-reprot", str(out / "orc"), str(out / "orc")]) == 2
    assert "error: unknown option '--no-reprot' (the only option is --no-report)" in capsys.readouterr().err
    assert not (tmp_path / "--no-reprot").exists()


@pytest.mark.parametrize("variants, message", [
    ("[{gama: 0.5}]", r"variants\[0\]: unknown eval key\(s\) gama"),
    ("[{checkpoint: oracle}, {checkpoint: oracle}]", "duplicate variant name 'checkpoint=oracle'"),
    ("[oracle]", r"variants\[0\]='oracle': expected a non-empty mapping"),
    ("[{name: a}, {name: b, max_new_tokens: 4}]", r"variants\[1\]: max_new_tokens cannot differ between variants"),
    ("[{dtype: bfloat16, checkpoint: oracle}]", r"variants\[0\]: dtype cannot differ"),
])
def test_bad_variants_are_clear_errors(tiny_model_dir, tmp_path, prompts_file, capsys, variants, message):
    rc = main(_argv(tiny_model_dir, tmp_path, "checkpoint=oracle", f"eval.prompts={prompts_file}",
                    f"eval.variants={variants}"))
    assert rc == 2
    assert re.search(message, capsys.readouterr().err)


class _CorruptOne(VanillaDecoder):
    """A Decoder that changes one prompt's last token: parity must fail naming that prompt."""

    def __init__(self, base_model, bad_len):
        super().__init__(base_model)
        self.bad_len = bad_len

    def generate(self, prompt_ids, max_new_tokens):
        toks, stats = super().generate(prompt_ids, max_new_tokens)
        if prompt_ids.numel() == self.bad_len:
            toks = toks[:-1] + [(toks[-1] + 1) % 300]
        return toks, stats


def test_parity_failure_names_prompt_and_exits_nonzero(tiny_base, tiny_model_dir, tmp_path, prompts_file, monkeypatch):
    from evaluation import runner
    from evaluation.prompts import load_prompts

    cfg = compose(rewrite_argv(_argv(tiny_model_dir, tmp_path, f"eval.prompts={prompts_file}")))
    prompts, _ = load_prompts(cfg.eval, cfg.data, tiny_base[1])
    bad = _CorruptOne(tiny_base[0], prompts[1].input_ids.numel())
    with pytest.raises(ParityError, match="ids p2"):
        run_evaluation(cfg, base=tiny_base, decoder=bad)
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["parity"]["mismatched_ids"] == ["p2"] and rep["parity"]["matched"] == 2
    row = rep["per_prompt"][1]
    assert row["first_mismatch"] == row["vanilla_tokens"] - 1 and row["method_output"] != row["vanilla_output"]
    # the CLI turns it into exit status 1 (a stand-in decoder, so no checkpoint folder "x" to check)
    monkeypatch.setattr("heads.registry.check_checkpoint_dir", lambda path, head_type=None: path)
    monkeypatch.setattr(runner, "build_decoder", lambda cfg, model, eos, dev, identity=None: (_CorruptOne(model, bad.bad_len), {
        "checkpoint": "x", "head_type": "custom", "decoder": "_CorruptOne"}))
    assert main(_argv(tiny_model_dir, tmp_path, "checkpoint=x", f"eval.prompts={prompts_file}",
                      f"eval.output_dir={tmp_path / 'out2'}")) == 1


def test_non_tree_decoder_and_sharegpt_heldout_prompts(tiny_base, tiny_model_dir, tmp_path):
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Question number {i}?"},
                                               {"from": "gpt", "value": "Answer."}]} for i in range(40)]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(convs))
    cfg = compose(rewrite_argv(_argv(tiny_model_dir, tmp_path, f"data.path={data}", "data.heldout_fraction=0.2",
                                     "eval.num_prompts=3")))
    rep = run_evaluation(cfg, base=tiny_base, decoder=VanillaDecoder(tiny_base[0]))
    from data_prep.split import is_heldout

    want = [c["id"] for c in convs if is_heldout(c["id"], 0.2, str(cfg.data.split_salt))][:3]
    assert [p["id"] for p in rep["per_prompt"]] == want and len(want) == 3
    assert rep["parity"]["matched"] == 3 and rep["tau"] is None and rep["acceptance_per_depth"] is None
    assert rep["base_forwards_per_token"]["method"] == rep["base_forwards_per_token"]["vanilla"] == 1.0


def test_missing_checkpoint_is_a_clear_error(tiny_model_dir, tmp_path, prompts_file, capsys, monkeypatch):
    import core.base_model

    monkeypatch.setattr(core.base_model, "load_base_model", lambda *a, **k: pytest.fail("the base was loaded"))
    assert main(_argv(tiny_model_dir, tmp_path, f"eval.prompts={prompts_file}")) == 2
    assert "eval.checkpoint is required" in capsys.readouterr().err
    assert main(_argv(tiny_model_dir, tmp_path, f"checkpoint={tmp_path / 'nope'}", f"eval.prompts={prompts_file}")) == 2


@pytest.mark.parametrize("head,overrides", [
    ("ctc", []), ("falcon", []), ("falcon_k1", []), ("adadecode", ["heads.layers=[1,2]"]),
    ("eagle3", ["heads.layers=[1,2,3]", "eval.decoding={depth: 3, topk: 3}"]),
])
def test_untrained_registered_heads_keep_parity(tiny_base, tiny_model_dir, tmp_path, prompts_file, head, overrides):
    """End to end through heads.save / heads.load / make_drafter: every shipped head is lossless."""
    import heads

    cfg = compose(rewrite_argv(_argv(tiny_model_dir, tmp_path, f"heads={head}", *overrides,
                                     f"checkpoint={tmp_path / 'ckpt'}", f"eval.prompts={prompts_file}",
                                     "eval.num_prompts=2")))
    torch.manual_seed(0)
    built = heads.build(cfg.heads, tiny_base[0])
    heads.save(built, tmp_path / "ckpt", tiny_base[2].to_dict())
    rep = run_evaluation(cfg, base=tiny_base)
    assert rep["parity"] == {"matched": 2, "total": 2, "mismatched_ids": [], "checked": True}
    assert rep["head_type"] == cfg.heads.type


def test_sampling_evaluation_reports_exits_and_marks_parity_unchecked(tiny_base, tiny_model_dir, tmp_path,
                                                                       prompts_file, capsys):
    """eval.temperature > 0: AdaDecode samples against vanilla ancestral sampling (same seed, same run);
    the tree decoders are greedy-only and refuse with a clear error."""
    import heads

    common = ["heads=adadecode", "heads.layers=[1,2]", f"checkpoint={tmp_path / 'ckpt'}", f"eval.prompts={prompts_file}",
              "eval.num_prompts=2", "eval.temperature=0.9", "eval.gamma=0.0"]
    cfg = compose(rewrite_argv(_argv(tiny_model_dir, tmp_path, *common)))
    heads.save(heads.build(cfg.heads, tiny_base[0]), tmp_path / "ckpt", tiny_base[2].to_dict())
    # the command line of the evaluation names no heads.* key: the head's settings are its checkpoint's
    assert main(_argv(tiny_model_dir, tmp_path, *[c for c in common if not c.startswith("heads.")])) == 0
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["temperature"] == 0.9 and rep["parity"]["checked"] is False and rep["parity"]["matched"] is None
    assert all(p["match"] is None for p in rep["per_prompt"])
    summary = rep["method"]["decoder_summary"]
    assert summary["temperature"] == 0.9 and summary["early_exits"] > 0  # γ = 0: every token exits early
    assert "parity: not checked (temperature 0.9" in capsys.readouterr().out

    rc = main(_argv(tiny_model_dir, tmp_path, "checkpoint=oracle", f"eval.prompts={prompts_file}", "eval.temperature=0.5",
                f"eval.output_dir={tmp_path / 'greedy'}"))
    assert rc == 2 and "decodes greedily only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(_argv(tiny_model_dir, tmp_path, "checkpoint=oracle", "eval.temperature=-1"))
    assert exc.value.code == 2 and "eval.temperature=-1" in capsys.readouterr().err


class _Counting(VanillaDecoder):
    """Counts generate calls; raises on call number ``crash_at`` (a crash mid-evaluation)."""

    def __init__(self, base_model, crash_at=None):
        super().__init__(base_model)
        self.calls, self.crash_at = 0, crash_at

    def generate(self, prompt_ids, max_new_tokens):
        self.calls += 1
        if self.calls == self.crash_at:
            raise RuntimeError("simulated crash")
        return super().generate(prompt_ids, max_new_tokens)


def test_interrupted_evaluation_resumes_without_redecoding(tiny_base, tiny_model_dir, tmp_path, prompts_file):
    argv = _argv(tiny_model_dir, tmp_path, "checkpoint=custom", f"eval.prompts={prompts_file}")
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_evaluation(compose(rewrite_argv(argv)), base=tiny_base, decoder=_Counting(tiny_base[0], crash_at=3))
    progress = tmp_path / "out" / "progress.jsonl"
    lines = progress.read_text().splitlines()
    assert len(lines) == 3 and [json.loads(x)["id"] for x in lines[1:]] == ["81", "p2"]
    part = json.loads((tmp_path / "out" / "report.json").read_text())  # what was decoded is reported (issue 28)
    assert part["complete"] is False and [r["id"] for r in part["per_prompt"]] == ["81", "p2"]
    with progress.open("a") as f:
        f.write('{"id": "line3", "vanilla": {"tok')  # a torn write: that prompt is decoded again

    config_before = (tmp_path / "out" / "config.yaml").read_text()
    with pytest.raises(ValueError, match="pass resume=auto"):  # nothing written is overwritten
        run_evaluation(compose(rewrite_argv(argv + ["eval.warmup=1"])), base=tiny_base, decoder=_Counting(tiny_base[0]))
    assert (tmp_path / "out" / "config.yaml").read_text() == config_before
    # the refusal names what differs (the recorded config.yaml against this command), and only that
    with pytest.raises(ValueError, match=r"different model/heads/eval configuration \(eval.max_new_tokens: \d+ -> 5\); "):
        run_evaluation(compose(rewrite_argv(argv + ["resume=auto", "eval.max_new_tokens=5"])), base=tiny_base,
                       decoder=_Counting(tiny_base[0]))
    dec = _Counting(tiny_base[0])
    rep = run_evaluation(compose(rewrite_argv(argv + ["resume=auto"])), base=tiny_base, decoder=dec)
    assert dec.calls == 1  # only the unfinished prompt
    assert rep["parity"]["matched"] == 3 and [r["id"] for r in rep["per_prompt"]] == ["81", "p2", "line3"]
    assert rep["vanilla"]["tokens"] == sum(r["vanilla_tokens"] for r in rep["per_prompt"])
    assert len(progress.read_text().splitlines()) == 4
    # fewer prompts reuse the finished ones (num_prompts is not part of the fingerprint)
    dec = _Counting(tiny_base[0])
    rep = run_evaluation(compose(rewrite_argv(argv + ["resume=auto", "eval.num_prompts=2"])), base=tiny_base, decoder=dec)
    assert dec.calls == 0 and rep["num_prompts"] == 2
    # a prompt whose text changed under the same id is not silently reused, and the finished results are
    # not overwritten by an empty report (they were: report.json then said num_prompts 0)
    out = tmp_path / "out"
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    prompts_file.write_text(prompts_file.read_text().replace("short poem", "long poem"))
    dec = _Counting(tiny_base[0])
    with pytest.raises(ValueError, match="prompt '81' is not the prompt these results were decoded for"):
        run_evaluation(compose(rewrite_argv(argv + ["resume=auto"])), base=tiny_base, decoder=dec)
    assert dec.calls == 0 and {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_a_changed_later_turn_leaves_the_finished_results_as_they_are(tiny_base, tiny_model_dir, tmp_path):
    """Turn 2 is built from turn 1's answer, so its prompt is checked when reached, after turn 1's result
    was reused: the refusal there writes nothing either."""
    prompts = tmp_path / "mt.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "writing",
                                   "turns": ["Write a short poem about the sea.", "Now make it rhyme."]}) + "\n")
    argv = _argv(tiny_model_dir, tmp_path, "checkpoint=custom", f"eval.prompts={prompts}", "eval.turns=all")
    run_evaluation(compose(rewrite_argv(argv)), base=tiny_base, decoder=_Counting(tiny_base[0]))
    out = tmp_path / "out"
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert json.loads(before["report.json"])["complete"] is True
    prompts.write_text(prompts.read_text().replace("make it rhyme", "make it longer"))
    dec = _Counting(tiny_base[0])
    with pytest.raises(ValueError, match=r"prompt '1#2' is not the prompt these results were decoded for|"
                                         r"prompt '1.*' is not the prompt"):
        run_evaluation(compose(rewrite_argv(argv + ["resume=auto"])), base=tiny_base, decoder=dec)
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    # config.yaml is the resumed command's (resume: auto), written before decoding starts; nothing else changed
    assert dec.calls == 0 and after.pop("config.yaml") != before.pop("config.yaml") and after == before


def test_progress_fingerprint_tracks_checkpoint_weights_not_output_dir(tmp_path):
    from evaluation.progress import Progress, progress_fingerprint

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"v1")
    fp = lambda *a: progress_fingerprint(compose(rewrite_argv([f"checkpoint={ckpt}", *a])))  # noqa: E731
    base = fp()
    assert fp("eval.output_dir=/elsewhere", "eval.threads=1") == base
    assert fp("eval.max_new_tokens=7")[0] != base[0] and fp("eval.num_prompts=3") == base
    # a key added later (eval.tree_fallback) at its off default keeps older progress files resumable; on, it counts
    from omegaconf import open_dict

    old = compose(rewrite_argv([f"checkpoint={ckpt}"]))
    with open_dict(old):
        del old.eval["tree_fallback"]  # a config written before the key existed
    assert progress_fingerprint(old) == base and fp("eval.tree_fallback=true")[0] != base[0]
    v = "eval.variants=[{name: a, tree_fallback: false}]"
    assert fp(v) == fp("eval.variants=[{name: a}]") != fp("eval.variants=[{name: a, tree_fallback: true}]")
    progress = Progress(tmp_path / "progress.jsonl", base, None)
    progress.append({"id": "a", "prompt_sha256": "h", "vanilla": {}, "methods": []})
    (ckpt / "model.safetensors").write_bytes(b"v2")  # retrained in place
    assert fp()[1] != base[1] and fp()[0] == base[0]
    with pytest.raises(ValueError, match=f"weights of checkpoint {ckpt} changed"):
        Progress(tmp_path / "progress.jsonl", fp(), "auto")
    assert list(Progress(tmp_path / "progress.jsonl", base, "auto").records) == ["a"]


def test_sharded_evaluation_merges_and_resumes_without_redecoding(tiny_base, tiny_model_dir, tmp_path, prompts_file,
                                                                  capsys):
    """eval.prompt_offset shards the prompts; ``python -m evaluation.merge`` gathers the shards'
    records into a new directory, and resuming there with the full num_prompts reports every prompt,
    decoding none again."""
    def run(out, *extra, dec=None):
        argv = _argv(tiny_model_dir, tmp_path, "checkpoint=custom", f"eval.prompts={prompts_file}",
                     f"eval.output_dir={tmp_path / out}", *extra)
        return run_evaluation(compose(rewrite_argv(argv)), base=tiny_base, decoder=dec or _Counting(tiny_base[0]))

    a = run("a", "eval.num_prompts=2")
    b = run("b", "eval.prompt_offset=2", "eval.num_prompts=5")
    assert [r["id"] for r in a["per_prompt"]] == ["81", "p2"] and [r["id"] for r in b["per_prompt"]] == ["line3"]
    assert merge_main(["--no-report", str(tmp_path / "all"), str(tmp_path / "a"), str(tmp_path / "b"),
                       str(tmp_path / "a")]) == 0
    assert "merged 3 prompt(s)" in capsys.readouterr().out
    dec = _Counting(tiny_base[0])
    full = run("all", "eval.num_prompts=3", "resume=auto", dec=dec)
    assert dec.calls == 0 and [r["id"] for r in full["per_prompt"]] == ["81", "p2", "line3"]
    assert full["vanilla"]["tokens"] == a["vanilla"]["tokens"] + b["vanilla"]["tokens"]
    assert full["parity"]["matched"] == 3
    # its time line reported only the empty resume pass ("decoding 0.0 s"); the shards' timed decoding is kept
    ph = full["phases"]
    assert ph["turns_decoded_earlier"] == 3 and a["phases"]["turns_decoded_earlier"] == 0
    assert ph["timed_decoding_seconds"] == pytest.approx(a["phases"]["timed_decoding_seconds"]
                                                         + b["phases"]["timed_decoding_seconds"])
    assert ph["timed_decoding_seconds"] > ph["decoding_seconds"]  # the resume pass decoded nothing
    from evaluation.status import phases_line

    assert "3 turn(s) decoded by earlier launches or merged shards; timed decoding over every turn" in phases_line(ph)
    # the shards are untouched, and the merged directory is not overwritten by an unrelated merge
    assert len((tmp_path / "a" / "progress.jsonl").read_text().splitlines()) == 3
    assert merge_main([str(tmp_path / "all"), str(tmp_path / "b")]) == 2
    assert "already holds results and is not one of the shards" in capsys.readouterr().err


def test_merge_refuses_shards_of_different_runs(tmp_path):
    """Shards with another configuration, other checkpoint weights or another prompt under the same
    id are refused, naming the shard, and nothing is written."""
    def rec(pid, sha):
        return {"id": pid, "prompt_sha256": sha, "vanilla": {}, "methods": []}

    def shard(name, fingerprint="f", weights=None, records=(rec("p1", "h1"),)):
        d = tmp_path / name
        d.mkdir()
        write_progress(d / "progress.jsonl", {"fingerprint": fingerprint, "weights": weights or {"c": "w"}}, records)
        return d

    a = shard("a")
    cases = [(shard("cfg", fingerprint="g"), "ran a different model/heads/eval configuration"),
             (shard("w", weights={"c": "w2"}), "other checkpoint weights"),
             (shard("p", records=[rec("p1", "h2")]), "prompt 'p1' holds different prompts")]
    for other, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            merge_progress(tmp_path / "out", [a, other])
        assert str(other) in str(err.value) or "p1" in str(err.value)
        assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="no progress.jsonl"):
        merge_progress(tmp_path / "out", [a, tmp_path / "missing"])
    (tmp_path / "bad").mkdir()
    bad = tmp_path / "bad" / "progress.jsonl"
    for text, message in [('{"fingerprint": "f"}\n{"id": 1}\n', r"progress.jsonl:2: not a prompt record \(missing prompt_sha256"),
                          ('{"id": "p1", "prompt_sha256": "h"}\n', r"progress.jsonl:1: not a progress header"),
                          ('[1, 2]\n', r"progress.jsonl:1: not a progress header"),
                          (b'{"fingerprint": "f"}\n\xff\n', r"progress.jsonl: not UTF-8")]:
        bad.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ValueError, match=message):
            merge_progress(tmp_path / "out", [bad.parent])
    assert not (tmp_path / "out").exists()
    # a torn last line is dropped and reported; OUT_DIR that is a file is a clear error
    (a / "progress.jsonl").write_text((a / "progress.jsonl").read_text() + '{"id": "p2", "prom')
    out = merge_progress(tmp_path / "out", [a, a])
    assert out["prompts"] == 1 and out["torn"] == [str(a)] and out["duplicates"] == 0
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        merge_progress(tmp_path / "afile", [a])


def test_merge_with_report_checks_shard_configs_before_writing(tmp_path, capsys):
    """A shard whose config.yaml is missing or unreadable stops the merge-with-report before the
    merged progress.jsonl is written (the error names the file); --no-report still merges."""
    d = tmp_path / "a"
    d.mkdir()
    write_progress(d / "progress.jsonl", {"fingerprint": "f", "weights": {"c": "w"}},
                   [{"id": "p1", "prompt_sha256": "h1", "vanilla": {}, "methods": []}])
    assert merge_main([str(tmp_path / "out"), str(d)]) == 2
    assert "no config.yaml to rebuild the evaluation from" in capsys.readouterr().err
    (d / "config.yaml").write_text("eval: [unclosed\n")
    assert merge_main([str(tmp_path / "out"), str(d)]) == 2
    assert f"{d / 'config.yaml'}: unreadable config" in capsys.readouterr().err
    assert not (tmp_path / "out" / "progress.jsonl").exists()
    assert merge_main(["--no-report", str(tmp_path / "out"), str(d)]) == 0
    assert (tmp_path / "out" / "progress.jsonl").is_file()


def test_a_bad_prompt_file_is_refused_before_the_base_loads(tmp_path, capsys, monkeypatch):
    """The prompt file is read before the base model: a missing or bad file costs no model load, and
    the missing file's error says where MT-bench's questions come from."""
    import core.base_model

    def no_load(*a, **k):
        raise AssertionError("the base loaded before the prompt file was read")

    monkeypatch.setattr(core.base_model, "load_base_model", no_load)
    rc = main(["checkpoint=oracle", f"eval.prompts={tmp_path / 'missing.jsonl'}", f"eval.output_dir={tmp_path / 'o'}"])
    err = capsys.readouterr().err
    assert rc != 0 and "file not found" in err and "fastchat/llm_judge/data/mt_bench/question.jsonl" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "turns": ["x"]}\n{"id": "a", "turns": ["y"]}\n')
    rc = main(["checkpoint=oracle", f"eval.prompts={bad}", f"eval.output_dir={tmp_path / 'o'}"])
    assert rc != 0 and "bad.jsonl:2: id 'a' is also the id of line 1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_eval_dtype_bf16_without_bf16_instructions_is_refused_by_its_own_key(tmp_path, capsys, monkeypatch):
    """eval.dtype is what the user set: its refusal names eval.dtype (it named model.dtype, which the
    user never set and whose advice, model.dtype=float32, changed nothing), before the base loads."""
    import core.base_model
    from core import precision

    monkeypatch.setenv(precision.BF16_ENV, "none")
    monkeypatch.setattr(core.base_model, "load_base_model", lambda *a, **k: pytest.fail("the base loaded"))
    rc = main(["checkpoint=oracle", "eval.dtype=bfloat16", f"eval.output_dir={tmp_path / 'o'}"])
    err = capsys.readouterr().err
    assert rc != 0 and "error: eval.dtype=bfloat16 on cpu" in err and err.rstrip().endswith("use eval.dtype=float32")
    assert "model.dtype" not in err


def test_prompt_records_are_read_as_data_prep_reads_messages(tmp_path):
    """The prompt reader disagreed with data prep: an empty user message was evaluated, OpenAI text parts and
    ShareGPT's ``human`` were refused, a messages record's later user turns were silently never decoded
    under eval.turns=all, and a UTF-8 byte-order mark was refused."""
    path = tmp_path / "p.jsonl"
    rows = [
        {"id": "parts", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                                                   {"type": "text", "text": "there"}]}]},
        {"id": "human", "messages": [{"role": "human", "content": "Hi"}, {"role": "gpt", "content": "Hello!"},
                                     {"role": "Human", "content": "And then?"}]},
    ]
    path.write_bytes("\ufeff".encode() + "\n".join(json.dumps(r) for r in rows).encode())
    recs = {r["id"]: r for r in read_jsonl_records(path)}
    assert recs["parts"]["messages"] == [{"role": "user", "content": "Hello there"}] and recs["parts"]["follow_ups"] == ()
    assert recs["human"]["messages"] == [{"role": "user", "content": "Hi"}]
    assert recs["human"]["follow_ups"] == ("And then?",)  # decoded as turn 2 with eval.turns=all
    for bad, said in [({"messages": [{"role": "user", "content": "  "}]}, r"field 'messages'\[0\] is an empty user turn"),
                      ({"messages": [{"role": "robot", "content": "x"}]}, r"unknown role 'robot'"),
                      ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]},
                       r"\[1\] is a system turn that is not the first"),
                      ({"messages": "hello"}, r"must be a list of \{role, content\} messages"),
                      ({"conversations": "hello"}, r"field 'conversations' must be a list"),
                      ({"prompt": "hi", "tools": [{"type": "function"}]}, r"the record's 'tools' holds tool calls"),
                      ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a",
                                                                        "tool_calls": [{"id": "c"}]}]},
                       r"turn 1: 'tool_calls' holds tool calls")]:
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(PromptError, match=rf"{re.escape(str(path))}:1: .*{said}"):
            read_jsonl_records(path)


def test_summary_pairs_timing_and_quality_reports_by_weights(tmp_path):
    """The same path with other weights was paired (τ of one head beside the speed of another); a copy of
    the same weights elsewhere was refused.  Reports now record the checkpoint's SHA-256."""
    from evaluation.summary import check_same_checkpoint

    q = {"checkpoint": "ck/best", "checkpoint_sha256": "a" * 64}
    check_same_checkpoint("h", q, "q", {"checkpoint": "copy/best", "checkpoint_sha256": "a" * 64}, "t")  # a copy
    with pytest.raises(ValueError, match=r"h: timing report t evaluated other weights \(ck/best, sha256 bbbbbbbbbbbb…\) "
                                         r"than q \(ck/best, sha256 aaaaaaaaaaaa…\)"):
        check_same_checkpoint("h", q, "q", {"checkpoint": "ck/best", "checkpoint_sha256": "b" * 64}, "t")
    with pytest.raises(ValueError, match="evaluated other/best, not ck/best like q"):  # reports without the digest
        check_same_checkpoint("h", {"checkpoint": "ck/best"}, "q", {"checkpoint": "other/best"}, "t")


def test_prompt_records_pick_their_chat_list_as_data_prep_does(tmp_path):
    """A ``conversations`` list kept as a JSON string was evaluated as one literal user prompt (the whole
    conversation, replies included); no_robots' ``prompt`` beside ``messages`` lost the system turn and turn 2;
    an empty id was used as the id where data prep takes the next."""
    path = tmp_path / "p.jsonl"
    rows = [{"id": "js", "conversations": json.dumps([{"from": "human", "value": "q0"}, {"from": "gpt", "value": "a0"},
                                                      {"from": "human", "value": "q1"}])},
            {"prompt": "Write a haiku.", "prompt_id": "nr", "id": "", "messages": [
                {"role": "system", "content": "Terse poet."}, {"role": "user", "content": "Write a haiku."},
                {"role": "assistant", "content": "x"}, {"role": "user", "content": "Another."}]},
            {"id": "np", "messages": None, "prompt": "Just this."}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    got = {r["id"]: r for r in read_jsonl_records(path)}
    assert list(got) == ["js", "nr", "np"]
    assert got["js"]["messages"] == [{"role": "user", "content": "q0"}] and got["js"]["follow_ups"] == ("q1",)
    assert got["nr"]["messages"] == [{"role": "system", "content": "Terse poet."},
                                     {"role": "user", "content": "Write a haiku."}]
    assert got["nr"]["follow_ups"] == ("Another.",)
    assert got["np"]["messages"] == [{"role": "user", "content": "Just this."}]
