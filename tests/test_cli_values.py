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


@pytest.mark.parametrize("args,shown", [
    (["train.optimizer.eps=.nan"], "train.optimizer.eps=NaN"),
    (["train.optimizer.weight_decay=.nan"], "train.optimizer.weight_decay=NaN"),
    (["train.scheduler.min_lr_ratio=.nan"], "train.scheduler.min_lr_ratio=NaN"),
    (["train.grad_clip.value=.inf"], "train.grad_clip.value=Infinity"),
    (["train.optimizer.lr=.inf"], "train.optimizer.lr=Infinity"),
    (["train.val_factor=.inf"], "train.val_factor=Infinity"),
    (["train.max_time=.inf"], "train.max_time=Infinity"),
    (["strategy.timeout_minutes=.nan"], "strategy.timeout_minutes=NaN"),
    (["eval.temperature=.nan"], "eval.temperature=NaN"),
    (["heads.aux_weight=-.inf"], "heads.aux_weight=-Infinity"),
    (["heads=adadecode", "heads.gamma_slope=.nan"], "heads.gamma_slope=NaN"),
    (["heads=adadecode", "heads.layer_weights=[1.0,.nan,1.0]"], "heads.layer_weights=[1.0, NaN, 1.0]"),
    (["data.heldout_fraction=.nan"], "data.heldout_fraction=NaN")])
def test_a_non_finite_number_is_refused(args, shown):
    """YAML reads ``.nan`` / ``.inf`` as floats, and NaN passes every range check (``nan < 0`` is false): eps,
    weight decay, min_lr_ratio or a clip value of NaN trained NaN weights (then blamed on the data by the
    non-finite stop), eval.temperature=NaN decoded greedily while the report recorded no parity check,
    train.val_factor=.inf died with an OverflowError at the first validation, train.max_time=.inf and a NaN
    strategy.timeout_minutes when the Trainer was built."""
    import re

    with pytest.raises(ConfigError, match="^" + re.escape(shown) + " must be finite"):
        compose(args)


def test_check_range_refuses_a_non_finite_value_from_a_config_file():
    """A NaN written into a YAML file (no override to type-check) is refused by the section's range check."""
    from omegaconf import OmegaConf

    from core.config import check_range

    cfg = OmegaConf.create({"train": {"optimizer": {"eps": float("nan")}}})
    with pytest.raises(ConfigError, match=r"^train.optimizer.eps=nan must be a finite number$"):
        check_range(cfg, "train.optimizer.eps", 0.0)


def test_train_max_time_beyond_a_timedelta_is_refused():
    """``train.max_time=1e15`` passed the check and overflowed ``timedelta`` when the Trainer was built."""
    with pytest.raises(ConfigError, match=r"^train.max_time=1000000000000000.0 must be a number of seconds > 0 "
                                          r"\(at most 86400000000000, Python's longest timedelta\)"):
        compose(["train.max_time=1e15"])
    assert compose(["train.max_time=86400"]).train.max_time == 86400


@pytest.mark.parametrize("value", ["-1", "null", "4294967296"])
def test_a_seed_outside_numpys_range_is_refused(value):
    """``seed=-1`` / ``seed=null`` passed compose and python -m train died in Lightning's seed_everything with a
    ValueError / TypeError traceback."""
    with pytest.raises(ConfigError, match=r"^seed=.* must be an integer in \[0, 4294967295\]"):
        compose([f"seed={value}"])
    assert compose(["seed=4294967295"]).seed == 4294967295


@pytest.mark.parametrize("key", ["train.cache_dir", "prep.cache_dir", "data.path", "eval.prompts", "eval.output_dir",
                                 "eval.checkpoint", "output_root", "resume", "train.run_name"])
def test_a_path_or_name_that_reads_as_a_number_stays_text(key, tmp_path, monkeypatch):
    """``train.cache_dir=2024`` (a folder named 2024) arrived as the integer 2024: ``Path(2024)`` was a TypeError
    traceback when training opened the cache; ``train.run_name=2024`` and ``resume=2024`` were refused as no
    name or path."""
    monkeypatch.chdir(tmp_path)
    from omegaconf import OmegaConf

    assert OmegaConf.select(compose([f"{key}=2024"]), key) == "2024"
    assert OmegaConf.select(compose([f"{key}=1e3"]), key) == "1e3"  # as typed, not 1000.0


def test_output_root_null_is_refused():
    """``output_root=null`` passed compose and every stage died on ``Path(None)`` (a TypeError traceback)."""
    with pytest.raises(ConfigError, match=r"^output_root=None must be a folder path"):
        compose(["output_root=null"])


@pytest.mark.parametrize("args,said", [
    (["heads=falcon", "heads.fuse=lstm", "heads.lstm_layers=0"], r"heads\.lstm_layers: must be an int >= 1 with fuse=lstm"),
    (["heads=falcon", "heads.fuse=lstm", "heads.lstm_dropout=1.5"], r"heads\.lstm_dropout: must lie in \[0, 1\)"),
    (["eval.tree_grid=[true, 4]"], r"eval\.tree_grid=\[True, 4\]: node counts must be integers >= 1"),
])
def test_values_refused_only_after_the_base_loaded_are_refused_at_compose(args, said):
    """nn.LSTM refused these only when the head was built, after the base had loaded; YAML's ``true`` (a bool, an
    int to Python) was taken as a tree of one node."""
    with pytest.raises(ConfigError, match=said):
        compose(args)
    assert compose(["heads=falcon", "heads.lstm_layers=0"]).heads.lstm_layers == 0  # unused with fuse=linear
