"""Issue 28 item 4 on the tiny model: a multi-turn evaluation always reports.  Later turns under chat
templates that rewrite earlier turns are built by the template itself; a turn no template can
render is skipped and listed with its reason; a failure in the middle (a decoder's exception,
Ctrl-C) still writes the report of what was decoded, and resume=auto continues past it."""
from __future__ import annotations

import copy
import json

import pytest

from core.config import compose
from decoding.vanilla import VanillaDecoder, eos_token_ids
from evaluation.__main__ import rewrite_argv
from evaluation.progress import prompt_digest, read_progress
from evaluation.prompts import Prompt, PromptError, load_prompts, template
from evaluation.runner import run_evaluation
from evaluation.turns import follow_up_prompt

_HEAD = ("{% if loop.first and messages[0]['role'] != 'system' %}"
         "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}")
_GEN = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
TEMPLATES = {
    # keeps only the conversation's last user turn (drops all earlier content)
    "drop": "{% for message in messages[-1:] %}" + _HEAD
            + "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}{% endfor %}" + _GEN,
    # trims earlier answers (whitespace and all but their first 12 characters)
    "trim": "{% for message in messages %}" + _HEAD
            + "{% set c = message['content'] | trim %}{% if message['role'] == 'assistant' %}{% set c = c[:12] %}{% endif %}"
            + "{{'<|im_start|>' + message['role'] + '\n' + c + '<|im_end|>\n'}}{% endfor %}" + _GEN,
}
# renders one user turn only, and refuses a conversation that mentions a cat
SINGLE_TURN = ("{% if messages | length > 1 %}{{ raise_exception('this template takes a single user turn') }}{% endif %}"
               + TEMPLATES["drop"])
NO_CATS = ("{% for m in messages %}{% if 'cat' in m['content'] and messages | length > 1 %}"
           "{{ raise_exception('no cats after turn 1') }}{% endif %}{% endfor %}"
           "{% for message in messages %}" + _HEAD
           + "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}{% endfor %}" + _GEN)


@pytest.fixture
def mt_file(tmp_path):
    path = tmp_path / "mt.jsonl"
    rows = [{"question_id": 1, "category": "writing", "turns": ["Write a poem about the sea.", "Now make it rhyme.",
                                                                "And shorter."]},
            {"question_id": 2, "category": "writing", "turns": ["Describe a cat.", "Shorter, please."]},
            {"question_id": 3, "category": "math", "turns": ["What is 2 + 2?", "And 3 + 3?"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _planted(tiny_base, chat_template):
    model, tok, identity = tiny_base
    tok = copy.deepcopy(tok)
    tok.chat_template = chat_template
    return model, tok, identity


def _cfg(tiny_model_dir, out, *extra):
    return compose(rewrite_argv([f"model.path={tiny_model_dir}", "model.attn_implementation=eager",
                                 f"eval.output_dir={out}", "eval.max_new_tokens=8", "eval.warmup=0",
                                 "checkpoint=oracle", *extra]))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_templates_that_rewrite_earlier_turns_give_the_templates_own_prompt(tiny_base, tiny_model_dir, tmp_path,
                                                                            mt_file, name):
    """Turn k > 1 is the template applied to the conversation with vanilla's answers; every turn
    is decoded (parity per turn), nothing is skipped, and each later turn's prompt is exactly the
    template's tokenization of that conversation."""
    base = _planted(tiny_base, TEMPLATES[name])
    model, tok, _ = base
    out = tmp_path / "out"
    rep = run_evaluation(_cfg(tiny_model_dir, out, f"eval.prompts={mt_file}", "eval.turns=all"), base=base)
    assert rep["complete"] and rep["skipped_prompts"] == [] and rep["error"] is None
    assert rep["parity"]["matched"] == rep["parity"]["total"] == 7
    assert [r["id"] for r in rep["per_prompt"]] == ["1", "1/turn2", "1/turn3", "2", "2/turn2", "3", "3/turn2"]
    _, records, _ = read_progress(out / "progress.jsonl")
    eos = eos_token_ids(tok, model)
    prompts, _ = load_prompts(_cfg(tiny_model_dir, out, f"eval.prompts={mt_file}").eval, {}, tok)
    for p in prompts:
        unit = p
        while unit.follow_ups:
            unit = follow_up_prompt(tok, unit, records[unit.id]["vanilla"]["tokens"], eos)
            assert unit.rendering == "re-rendered"
            assert unit.input_ids.tolist() == template(tok, unit.messages).tolist()
            assert records[unit.id]["prompt_sha256"] == prompt_digest(unit.input_ids)
    assert (out / "summary.md").is_file() and (out / "acceptance.png").is_file()


def test_a_turn_no_template_can_render_is_skipped_with_its_reason_and_resume_passes_it(tiny_base, tiny_model_dir,
                                                                                      tmp_path, mt_file):
    base = _planted(tiny_base, NO_CATS)
    out = tmp_path / "out"
    cfg = _cfg(tiny_model_dir, out, f"eval.prompts={mt_file}", "eval.turns=all")
    rep = run_evaluation(cfg, base=base)
    assert rep["complete"] and [r["id"] for r in rep["per_prompt"]] == ["1", "1/turn2", "1/turn3", "2", "3", "3/turn2"]
    skipped = rep["skipped_prompts"]
    assert len(skipped) == 1 and skipped[0]["id"] == "2/turn2" and skipped[0]["ids"] == ["2/turn2"]
    assert "no cats after turn 1" in skipped[0]["reason"]
    assert rep["parity"]["matched"] == rep["parity"]["total"] == 6
    assert "2/turn2" in (out / "summary.md").read_text()

    lines = (out / "progress.jsonl").read_text().count("\n")  # resume: nothing left to decode, the skip listed again
    again = run_evaluation(_cfg(tiny_model_dir, out, f"eval.prompts={mt_file}", "eval.turns=all", "resume=auto"),
                           base=base)
    assert again["skipped_prompts"] == skipped and [r["id"] for r in again["per_prompt"]] == \
        [r["id"] for r in rep["per_prompt"]]
    assert (out / "progress.jsonl").read_text().count("\n") == lines
    # a single-turn template: every later turn (and those after it) skipped, first turns all decoded
    rep1 = run_evaluation(_cfg(tiny_model_dir, tmp_path / "single", f"eval.prompts={mt_file}", "eval.turns=all"),
                          base=_planted(tiny_base, SINGLE_TURN))
    assert [r["id"] for r in rep1["per_prompt"]] == ["1", "2", "3"]
    assert [s["ids"] for s in rep1["skipped_prompts"]] == [["1/turn2", "1/turn3"], ["2/turn2"], ["3/turn2"]]
    assert all("single user turn" in s["reason"] for s in rep1["skipped_prompts"])


class _FailsOn(VanillaDecoder):
    """Vanilla greedy decoding that raises ``exc`` on its ``when``-th call."""

    def __init__(self, model, when, exc):
        super().__init__(model)
        self.when, self.exc, self.calls = when, exc, 0

    def generate(self, ids, n):
        self.calls += 1
        if self.calls == self.when:
            raise self.exc
        return super().generate(ids, n)


@pytest.mark.parametrize("exc", [RuntimeError("drafter blew up"), KeyboardInterrupt()])
def test_a_failure_in_the_middle_reports_what_was_decoded_and_resume_finishes(tiny_base, tiny_model_dir, tmp_path,
                                                                              mt_file, exc, caplog):
    model = tiny_base[0]
    out = tmp_path / "out"
    argv = [f"eval.prompts={mt_file}", "eval.turns=all"]
    with pytest.raises(type(exc)), caplog.at_level("ERROR", logger="evaluation.runner"):
        run_evaluation(_cfg(tiny_model_dir, out, *argv), base=tiny_base, decoder=_FailsOn(model, 4, exc))
    part = json.loads((out / "report.json").read_text())
    assert part["complete"] is False and type(exc).__name__ in part["error"]
    assert [r["id"] for r in part["per_prompt"]] == ["1", "1/turn2", "1/turn3"]
    assert part["stopped_at"] == "2" and part["pending_prompts"] == ["2", "3"]
    # the console names the prompt turn the failure struck (the exception's own message does not)
    assert "evaluation stopped while decoding prompt '2' (" in caplog.text
    assert part["parity"]["total"] == 3 and part["parity"]["matched"] == 3
    # the default output folder carries the launch time: the hint names this one, or resume=auto starts anew
    assert "incomplete" in (out / "summary.md").read_text()
    assert f"again with eval.output_dir={out} resume=auto" in (out / "summary.md").read_text()
    resumed = _FailsOn(model, 0, exc)
    rep = run_evaluation(_cfg(tiny_model_dir, out, *argv, "resume=auto"), base=tiny_base, decoder=resumed)
    assert rep["complete"] and rep["parity"]["matched"] == rep["parity"]["total"] == 7
    assert resumed.calls == 4  # only the prompt turns the first run had not finished


def test_follow_up_prompt_extends_when_it_can_and_refuses_only_an_unrenderable_turn(tiny_base):
    _, tok, _ = tiny_base
    ids = tok(" hi ", add_special_tokens=False)["input_ids"]
    msgs = [{"role": "user", "content": "x"}]
    p = Prompt("q7", msgs, template(tok, msgs), None, ("y",))
    t2 = follow_up_prompt(tok, p, ids, [])
    assert t2.id == "q7/turn2" and t2.rendering == "extended"
    assert t2.input_ids[:p.input_ids.numel() + len(ids)].tolist() == p.input_ids.tolist() + ids
    trim = copy.deepcopy(tok)
    trim.chat_template = TEMPLATES["trim"]
    t2 = follow_up_prompt(trim, Prompt("q7", msgs, template(trim, msgs), None, ("y",)), ids, [])
    assert t2.rendering == "re-rendered" and t2.input_ids.tolist() == template(trim, t2.messages).tolist()
    single = copy.deepcopy(tok)
    single.chat_template = SINGLE_TURN
    with pytest.raises(PromptError, match="'q7/turn2'.*single user turn"):
        follow_up_prompt(single, Prompt("q7", msgs, template(single, msgs), None, ("y",)), ids, [])
