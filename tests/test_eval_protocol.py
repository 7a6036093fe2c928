"""The evaluation protocol of issue 18 on the tiny model: MT-bench turn 2 after vanilla's turn-1
answer (parity per turn), per-category tables, repeated timing with a spread, summary.md."""
from __future__ import annotations

import json

import pytest

from core.config import compose
from decoding.vanilla import VanillaDecoder, eos_token_ids, greedy_generate
from evaluation.__main__ import main, rewrite_argv
from evaluation.merge import main as merge_main
from evaluation.prompts import Prompt, PromptError, load_prompts, template
from evaluation.progress import prompt_digest, read_progress
from evaluation.runner import ParityError, run_evaluation
from evaluation.turns import follow_up_prompt


@pytest.fixture
def mt_file(tmp_path):
    path = tmp_path / "mt.jsonl"
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Write a poem about the sea.", "Now make it rhyme."]},
        {"question_id": 2, "category": "writing", "turns": ["Describe a cat.", "Shorter, please."]},
        {"question_id": 3, "category": "coding", "turns": ["def add(a, b):", "Add type hints."]},
        {"question_id": 4, "category": "math", "turns": ["What is 2 + 2?", "And 3 + 3?"]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _argv(tiny_model_dir, out, *extra):
    return [f"model.path={tiny_model_dir}", "model.attn_implementation=eager", f"eval.output_dir={out}",
            "eval.max_new_tokens=10", "eval.warmup=0", *extra]


def test_turn_two_holds_vanilla_turn_one_answer_token_for_token(tiny_base, tiny_model_dir, tmp_path, mt_file):
    """Turn 2's prompt = turn 1's prompt + vanilla's answer tokens as generated + the chat template's
    tail; its text is the template rendered over the decoded answer; the runner decodes exactly it."""
    model, tok, _ = tiny_base
    cfg = compose(rewrite_argv(_argv(tiny_model_dir, tmp_path / "out", "checkpoint=oracle", f"eval.prompts={mt_file}",
                                     "eval.turns=2")))
    prompts, _ = load_prompts(cfg.eval, cfg.data, tok)
    eos = eos_token_ids(tok, model)
    rep = run_evaluation(cfg, base=tiny_base)
    _, records, _ = read_progress(tmp_path / "out" / "progress.jsonl")
    assert list(records) == ["1", "1/turn2", "2", "2/turn2", "3", "3/turn2", "4", "4/turn2"]
    for p in prompts:
        answer, _ = greedy_generate(model, p.input_ids, 10, eos)  # fresh vanilla pass
        assert answer == records[p.id]["vanilla"]["tokens"]
        t2 = follow_up_prompt(tok, p, answer, eos)
        kept = answer[:-1] if answer[-1] in eos else answer
        n1 = p.input_ids.numel()
        assert t2.input_ids[:n1].tolist() == p.input_ids.tolist()
        assert t2.input_ids[n1:n1 + len(kept)].tolist() == kept
        text = tok.apply_chat_template(t2.messages, tokenize=False, add_generation_prompt=True)
        assert tok.decode(t2.input_ids.tolist(), skip_special_tokens=False) == text
        assert t2.messages[-1] == {"role": "user", "content": p.follow_ups[0]} and t2.turn == 2
        rec = records[f"{p.id}/turn2"]
        assert rec["prompt_sha256"] == prompt_digest(t2.input_ids)
        assert rec["vanilla"]["tokens"] == greedy_generate(model, t2.input_ids, 10, eos)[0]
    par = rep["parity"]
    assert par["matched"] == par["total"] == 8
    assert {t: (p["matched"], p["total"]) for t, p in rep["parity_per_turn"].items()} == {"1": (4, 4), "2": (4, 4)}
    assert [r["turn"] for r in rep["per_prompt"]] == [1, 2] * 4
    assert rep["per_category"]["writing"]["prompts"] == 4 and rep["per_category"]["math"]["prompts"] == 2
    # group figures come from summed counts: the step-weighted τ of the turns is the overall τ
    groups = rep["per_turn"].values()
    assert sum(g["steps"] for g in groups) == rep["method"]["steps"]
    assert sum(g["tau"] * g["steps"] for g in groups) / rep["method"]["steps"] == pytest.approx(rep["tau"])


class _WrongOnTurnTwo(VanillaDecoder):
    """Vanilla, except that on long prompts (turn 2 here) the last token is corrupted."""

    def __init__(self, base_model, min_len):
        super().__init__(base_model)
        self.min_len = min_len

    def generate(self, prompt_ids, max_new_tokens):
        out, stats = super().generate(prompt_ids, max_new_tokens)
        if prompt_ids.numel() >= self.min_len:
            out = out[:-1] + [(out[-1] + 1) % 300]
        return out, stats


def test_parity_is_checked_and_reported_per_turn(tiny_base, tiny_model_dir, tmp_path, mt_file, caplog):
    model, tok, _ = tiny_base
    cfg = compose(rewrite_argv(_argv(tiny_model_dir, tmp_path / "out", f"eval.prompts={mt_file}", "eval.turns=all",
                                     "eval.fail_on_mismatch=false")))
    prompts, _ = load_prompts(cfg.eval, cfg.data, tok)
    longest_t1 = max(p.input_ids.numel() for p in prompts)
    with caplog.at_level("INFO", logger="evaluation.runner"):
        rep = run_evaluation(cfg, base=tiny_base, decoder=_WrongOnTurnTwo(model, longest_t1 + 1))
    assert "on 4 prompts, 8 turns (max_new_tokens" in caplog.text  # it said "4 prompts", then decoded 8 turns
    per_turn = rep["parity_per_turn"]
    assert (per_turn["1"]["matched"], per_turn["1"]["total"]) == (4, 4)
    assert (per_turn["2"]["matched"], per_turn["2"]["total"]) == (0, 4)
    assert per_turn["2"]["mismatched_ids"] == ["1/turn2", "2/turn2", "3/turn2", "4/turn2"]
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "t1: 4/4" in md and "t2: 0/4" in md


def test_categories_select_and_tabulate(tiny_base, tiny_model_dir, tmp_path, mt_file):
    cfg = compose(rewrite_argv(_argv(tiny_model_dir, tmp_path / "out", "checkpoint=oracle", f"eval.prompts={mt_file}",
                                     "eval.prompts_per_category=1")))
    rep = run_evaluation(cfg, base=tiny_base)
    assert [r["id"] for r in rep["per_prompt"]] == ["1", "3", "4"]
    assert {c: g["prompts"] for c, g in rep["per_category"].items()} == {"writing": 1, "coding": 1, "math": 1}
    for c, g in rep["per_category"].items():
        (row,) = [r for r in rep["per_prompt"] if r["category"] == c]
        assert g["tau"] == pytest.approx(row["tau"])
        assert g["speedup"] == pytest.approx(row["speedup"])
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "## τ / speedup per category" in md and "| coding |" in md


def test_repeats_report_a_spread_and_identical_tokens(tiny_base, tiny_model_dir, tmp_path, mt_file):
    cfg = compose(rewrite_argv(_argv(tiny_model_dir, tmp_path / "out", "checkpoint=oracle", f"eval.prompts={mt_file}",
                                     "eval.repeats=3", "eval.num_prompts=2")))
    rep = run_evaluation(cfg, base=tiny_base)
    t = rep["timing"]
    assert t["repeats"] == 3 and t["identical_tokens"] is True and t["nonidentical_ids"] == []
    sp = t["speedup"]
    assert sp["n"] == 3 and len(sp["values"]) == 3 and sp["std"] is not None and sp["std"] > 0
    assert sp["mean"] == pytest.approx(sum(sp["values"]) / 3)
    for r in rep["per_prompt"]:
        assert len(r["vanilla_seconds_repeats"]) == len(r["method_seconds_repeats"]) == 3
        assert r["vanilla_seconds"] == pytest.approx(sum(r["vanilla_seconds_repeats"]) / 3)
    # speedup of repeat k = Σ method tokens / Σ its seconds ÷ the same for vanilla
    rows = rep["per_prompt"]
    k0 = (sum(r["method_tokens"] for r in rows) / sum(r["method_seconds_repeats"][0] for r in rows)) / (
        sum(r["vanilla_tokens"] for r in rows) / sum(r["vanilla_seconds_repeats"][0] for r in rows))
    assert sp["values"][0] == pytest.approx(k0)
    md = (tmp_path / "out" / "summary.md").read_text()
    assert " ± " in md and "; 3 repeats identical" in md


class _Drifting(VanillaDecoder):
    """A non-deterministic decoder: every call after the first emits one token less."""

    def __init__(self, base_model):
        super().__init__(base_model)
        self.calls = 0

    def generate(self, prompt_ids, max_new_tokens):
        self.calls += 1
        out, stats = super().generate(prompt_ids, max_new_tokens)
        return (out if self.calls == 1 else out[:-1]), stats


def test_repeats_that_decode_other_tokens_fail(tiny_base, tiny_model_dir, tmp_path, mt_file):
    cfg = compose(rewrite_argv(_argv(tiny_model_dir, tmp_path / "out", f"eval.prompts={mt_file}", "eval.repeats=2",
                                     "eval.num_prompts=1")))
    with pytest.raises(ParityError, match="repeats decoded other tokens on ids 1"):
        run_evaluation(cfg, base=tiny_base, decoder=_Drifting(tiny_base[0]))
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["timing"]["identical_tokens"] is False and rep["parity"]["matched"] == 1


def test_multi_turn_shards_merge_and_resume(tiny_base, tiny_model_dir, tmp_path, mt_file, capsys):
    """Shards split by question keep both turns together; the merged run reports all turns and
    decodes nothing again."""
    calls = []

    class Counting(VanillaDecoder):
        def generate(self, prompt_ids, max_new_tokens):
            calls.append(1)
            return super().generate(prompt_ids, max_new_tokens)

    def run(out, *extra):
        argv = _argv(tiny_model_dir, tmp_path / out, "checkpoint=custom", f"eval.prompts={mt_file}", "eval.turns=2",
                     *extra)
        return run_evaluation(compose(rewrite_argv(argv)), base=tiny_base, decoder=Counting(tiny_base[0]))

    a = run("a", "eval.num_prompts=2")
    run("b", "eval.prompt_offset=2", "eval.num_prompts=2")
    assert [r["id"] for r in a["per_prompt"]] == ["1", "1/turn2", "2", "2/turn2"]
    assert merge_main(["--no-report", str(tmp_path / "all"), str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    calls.clear()
    full = run("all", "eval.num_prompts=4", "resume=auto")
    assert not calls and full["parity_per_turn"]["2"]["total"] == 4
    # a first-turn-only run cannot resume a two-turn directory
    with pytest.raises(ValueError, match=r"different model/heads/eval configuration \(eval.turns: '2' -> '1'\)"):
        run("all", "eval.num_prompts=4", "resume=auto", "eval.turns=1")
    # nor can shards of different settings merge: the refusal names the setting, from their config.yaml
    run("c", "eval.prompt_offset=2", "eval.num_prompts=2", "eval.turns=1")
    assert merge_main(["--no-report", str(tmp_path / "ac"), str(tmp_path / "a"), str(tmp_path / "c")]) == 2
    assert "(eval.turns: '2' -> '1') (only eval." in capsys.readouterr().err


def test_template_that_rewrites_the_answer_renders_turn_two_itself(tiny_base):
    """A template that strips the answer cannot hold it token for token: turn 2 is the template's own
    tokenization of the conversation (issue 28: built, not refused; tests/test_eval_resilience.py)."""
    _, tok, _ = tiny_base

    class Stripping:
        def __init__(self, inner):
            self.inner = inner

        def apply_chat_template(self, messages, **kw):
            msgs = [dict(m, content=m["content"].strip()) if m["role"] == "assistant" else m for m in messages]
            return self.inner.apply_chat_template(msgs, **kw)

        def decode(self, *a, **kw):
            return self.inner.decode(*a, **kw)

        def __call__(self, *a, **kw):
            return self.inner(*a, **kw)

    ids = tok(" hi ", add_special_tokens=False)["input_ids"]
    msgs = [{"role": "user", "content": "x"}]

    p = Prompt("q7", msgs, template(tok, msgs), None, ("y",))
    assert follow_up_prompt(tok, p, ids, []).id == "q7/turn2"
    t2 = follow_up_prompt(Stripping(tok), p, ids, [])
    assert t2.rendering == "re-rendered" and t2.input_ids.tolist() == template(Stripping(tok), t2.messages).tolist()


def test_bad_protocol_settings_are_one_line_errors(tiny_model_dir, tmp_path, mt_file, capsys):
    for bad, msg in [("eval.turns=3", "eval.turns=3 must be 1, 2 or all"),
                     ("eval.repeats=0", "eval.repeats=0 must be an integer >= 1")]:
        with pytest.raises(SystemExit) as exc:
            main(_argv(tiny_model_dir, tmp_path / "o", "checkpoint=oracle", f"eval.prompts={mt_file}", bad))
        assert exc.value.code == 2 and msg in capsys.readouterr().err


def test_later_turn_beyond_the_context_is_refused_before_anything_is_written(tiny_base, tiny_model_dir, tmp_path,
                                                                              mt_file):
    """Turn 1 fits max_position_embeddings (2048) with 1010 new tokens; turn 2 (turn 1 + its answer
    at its longest + turn 2 + 1010 new tokens) cannot: refused up front, naming prompt and turn."""
    out = tmp_path / "out"
    argv = _argv(tiny_model_dir, out, "checkpoint=oracle", f"eval.prompts={mt_file}", "eval.max_new_tokens=1010")
    with pytest.raises(ValueError, match=r"eval prompt '1' turn 2 .*exceeds the base model's context limit"):
        run_evaluation(compose(rewrite_argv(argv + ["eval.turns=2"])), base=tiny_base)
    assert not out.exists()


def test_summary_table_takes_speed_from_timing_and_tau_from_quality():
    """evaluation.summary.summary_markdown on compare-style rows: the τ-run tree and the timing tree
    in their own cells (a budget has no depth: -1 is not printed), speed from the timing figures."""
    from evaluation.summary import summary_markdown, tree_text

    assert tree_text({"mode": "auto", "nodes": 16, "depth": -1}) == "auto: 16 nodes"
    assert tree_text({"mode": "auto", "nodes": 1, "depth": 0}) == "auto: 1 node"
    assert tree_text({"mode": "dynamic", "nodes": 9, "depth": 3}) == "dynamic: 9 nodes, depth 3"
    assert tree_text(None) == "-"
    row = {"variant": "ctc", "train_seconds": 1307.4, "train_steps": 201, "train_tokens": 374555, "prompts": 80,
           "tau": 1.41, "acceptance_per_depth": [0.388, 0.024], "base_forwards_per_token": 0.712,
           "tree": {"mode": "auto", "nodes": 16, "depth": -1}, "timing_tree": {"mode": "auto", "nodes": 1, "depth": 0},
           "timing_tau": 1.0, "drafter_time_share": 0.161, "speedup_repeats": {"mean": 0.8417, "std": 0.0035, "n": 3},
           "parity": "80/80", "parity_per_turn": {"1": "40/40", "2": "40/40"}, "identical_repeat_tokens": True,
           "per_category": {"math": {"tau": 1.44, "speedup": 0.84, "prompts": 10}}}
    md = summary_markdown([row])
    assert ("| ctc | 1307 | 201 | 374,555 | 80 | 1.41 | 0.39 | 0.02 | - | 0.712 | auto: 16 nodes | auto: 1 node | "
            "1.00 | 0.16 | 0.84 ± 0.00 (n=3) | 80/80 (t1: 40/40, t2: 40/40); 3 repeats identical |") in md
    assert "| math | 1.44 / 0.84 |" in md
    assert "Early exits" not in md  # no layer-skipping head
    ada = {"variant": "adadecode", "prompts": 80, "parity": "80/80",
           "decoder_summary": {"early_exit_rate": 0.283, "exit_attempt_rate": 0.331, "rejection_rate": 0.146,
                               "layer_steps_per_token": 28.28, "vanilla_layer_steps_per_token": 30,
                               "layer_step_speedup": 1.061}}
    md = summary_markdown([row, ada])
    assert "| adadecode | 0.28 | 0.33 | 0.15 | 28.28 (30) | 1.06× |" in md


def test_a_prompt_holding_special_token_text_is_skipped_with_its_reason(tiny_base, tiny_model_dir, tmp_path):
    """Data prep drops a turn holding a special token's text (the template would encode "<|im_end|>"
    typed by a user as the control token); the evaluation measured heads on such prompts, held-out or
    from a file, turn 1 or a later turn.  They are skipped with that reason; the rest are decoded."""
    _, tok, _ = tiny_base
    path = tmp_path / "p.jsonl"
    rows = [{"id": "ok", "turns": ["Hello there", "and then?"]},
            {"id": "first", "turns": ["say <|im_end|> now", "fine"]},
            {"id": "later", "turns": ["fine", "now <|im_start|>system"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = compose(rewrite_argv(_argv(tiny_model_dir, tmp_path / "out", "checkpoint=oracle", f"eval.prompts={path}")))
    prompts, skipped = load_prompts(cfg.eval, cfg.data, tok)
    assert [p.id for p in prompts] == ["ok"]
    assert [(s["id"], s["reason"].split(",")[0]) for s in skipped] == [
        ("first", "holds the text of the special token '<|im_end|>'"),
        ("later", "holds the text of the special token '<|im_start|>'")]
    path.write_text(json.dumps(rows[1]))
    with pytest.raises(PromptError, match=r"no usable prompts .*1 skipped, first 'first': holds the text"):
        load_prompts(cfg.eval, cfg.data, tok)
