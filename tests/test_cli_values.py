"""Values a command line gives that the shell or OmegaConf would turn into something else: an empty value
(an unset shell variable) read as null, ``~`` left unexpanded in ``key=~/x``, and ``heads.*`` overrides an
evaluation would ignore (faults a new user's trials found)."""
from __future__ import annotations

import os

import pytest

from core.config import ConfigError, compose


@pytest.mark.parametrize("item", ["data.path=", "eval.prompts=", "prep.cache_dir= "])
def test_an_empty_value_is_refused_not_read_as_the_default(item):
    """``data.path=$UNSET`` read the packaged ShareGPT; ``eval.prompts=$UNSET`` the held-out prompts, silently."""
    key = item.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key} is empty \(.*an unset shell variable\): give a value, or "
                                          rf"{key}=null for the default$"):
        compose([item])
    assert compose([f"{key}=null"]) is not None


def test_a_tilde_path_is_the_home_directory():
    """``prep.cache_dir=~/c`` was checked in $HOME but written to ./~/c (bash leaves ~ in key=~/x)."""
    cfg = compose(["prep.cache_dir=~/dh_cache", "data.path=~/m.jsonl", "output_root=~/o"])
    home = os.path.expanduser("~")
    assert (cfg.prep.cache_dir, cfg.data.path, cfg.output_root) == (f"{home}/dh_cache", f"{home}/m.jsonl", f"{home}/o")


def test_an_evaluation_refuses_heads_overrides(capsys):
    """``python -m evaluation ... heads.decoding.passes=1`` decoded with the checkpoint's 4 passes while its
    config.yaml said 1."""
    from evaluation.__main__ import main

    assert main(["heads=falcon_k1", "checkpoint=heads_of_record/falcon_k1_smollm2", "heads.decoding.passes=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("error: heads.decoding.passes=1: an evaluation reads the head's settings from its checkpoint "
                   "(config.json), so heads.* would be ignored; set the decoding keys with eval.* (eval.falcon_passes, "
                   "eval.falcon_tree, eval.topk, eval.max_nodes, eval.gamma, or eval.decoding={...})")


def test_eval_prompts_read_sharegpt_turns_and_name_a_json_array(tmp_path):
    """A ShareGPT JSONL (what data prep reads) had "no prompt field"; a JSON array file was "invalid JSON"."""
    import json

    from evaluation.prompts import PromptError, read_jsonl_records

    g = tmp_path / "g.jsonl"
    g.write_text(json.dumps({"id": "g0", "conversations": [{"from": "human", "value": "What is 1+1?"},
                                                            {"from": "gpt", "value": "2"},
                                                            {"from": "human", "value": "And 2+2?"}]}) + "\n")
    (rec,) = read_jsonl_records(g)
    assert rec["messages"] == [{"role": "user", "content": "What is 1+1?"}] and rec["follow_ups"] == ("And 2+2?",)
    a = tmp_path / "a.json"
    a.write_text(json.dumps([{"question_id": 1, "turns": ["Say 1"]}], indent=2))
    with pytest.raises(PromptError, match=rf"^{a}: a JSON array; eval.prompts reads JSON Lines, one JSON object a line"):
        read_jsonl_records(a)
