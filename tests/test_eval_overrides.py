"""Per-head decoding overrides of the ``eval`` section (``eval.topk``, ``eval.falcon_tree``,
``eval.gamma``...) and ``eval.variants`` entries are checked like every other key: a wrong value
is a ConfigError naming the key before anything runs (issue 19 item 7, the null-default keys)."""
from __future__ import annotations

import pytest

from core.config import ConfigError, compose
from evaluation.methods import variant_configs


@pytest.mark.parametrize("args,message", [
    (["eval.max_nodes=abc"], 'eval.max_nodes="abc" must be an integer >= 1'),
    (["eval.max_nodes=0"], "eval.max_nodes=0 must be an integer >= 1"),
    (["eval.topk=abc"], 'eval.topk="abc" must be an integer >= 1 or a non-empty list'),
    (["eval.topk=[4,0]"], r"eval.topk=\[4, 0\] must be an integer >= 1 or a non-empty list"),
    (["eval.max_alignments=1.5"], "eval.max_alignments=1.5 must be an integer >= 1"),
    (["heads=falcon", "eval.falcon_passes=x"], 'eval.falcon_passes="x" must be an integer >= 1'),
    (["heads=falcon", "eval.falcon_tree=abc"], 'eval.falcon_tree="abc" must be a mapping'),
    (["heads=falcon", "eval.falcon_tree={depth_children: [a]}"], "eval.falcon_tree: invalid literal"),
    (["heads=falcon", "eval.falcon_tree={depth_children: [2], paths: [[0]]}"], "eval.falcon_tree: set exactly one"),
    (["heads=falcon", "eval.falcon_tree={node_children: {x: 2}}"], "eval.falcon_tree.node_children: key 'x'"),
    (["heads=adadecode", "eval.gamma=high"], r'eval.gamma="high" must be a number in \[0, 1\]'),
    (["heads=adadecode", "eval.gamma=true"], r"eval.gamma=true must be a number in \[0, 1\]"),
    # a confidence never exceeds 1: no layer would ever exit (it decoded with 0 exits, exit 0)
    (["heads=adadecode", "eval.gamma=1.5"], r"eval.gamma=1.5 must be a number in \[0, 1\] \(an exit threshold"),
    (["heads=adadecode", "eval.gamma_schedule=[0.5,1.2,0.9]"], r"must be a non-empty list of numbers in \[0, 1\]"),
    (["heads=adadecode", "eval.gamma_schedule=abc"], 'eval.gamma_schedule="abc" must be a non-empty list'),
    (["heads=adadecode", "eval.max_inflight=0"], "eval.max_inflight=0 must be an integer >= 1"),
    (["eval.variants=abc"], "eval.variants='abc' must be null or a list of mappings"),
    (["eval.variants=[]"], r"eval.variants=\[\] lists no variant"),  # acted as null: the run's own section
    # a key another head's decoder reads: this head would ignore it, and a sweep over it only repeats
    (["heads=ctc", "eval.gamma=0.5"], "eval.gamma=0.5 applies to adadecode heads only .* heads.type=ctc"),
    (["heads=ctc", "eval.falcon_passes=2"], "eval.falcon_passes=2 applies to falcon heads only"),
    (["heads=falcon_k1", "eval.topk=3"], "eval.topk=3 applies to ctc heads only .* heads.type=falcon"),
    (["heads=eagle3", "eval.max_inflight=2"], "eval.max_inflight=2 applies to adadecode heads only"),
    # a new user's smoke test: the calibration decoded one token per prompt (the prefill's) and the tree search
    # failed after the base loaded with "empty node grid (no measured budget)"
    (["heads=falcon_k1", "eval.max_new_tokens=1"], "eval.max_new_tokens=1 leaves eval.tree=auto's calibration no draft"),
    (["heads=ctc", "eval.calibration_max_new_tokens=1"], "eval.calibration_max_new_tokens=1 must be >= 2"),
    (["eval.calibration_prompts=0"], "eval.calibration_prompts=0 must be >= 1$"),  # was "must lie in [1, None]"
    # the configured tree is decoded as it is: a node budget beside it was silently ignored
    (["heads=ctc", "eval.tree=config", "eval.tree_nodes=4"], "eval.tree_nodes=4 sizes the tree of eval.tree=auto or "
                                                             "dynamic; eval.tree=config .* would ignore it"),
])
def test_bad_decoding_override_names_the_key(args, message):
    with pytest.raises(ConfigError, match=message):
        compose(args)


def test_good_decoding_overrides_compose():
    compose(["eval.topk=3", "eval.max_nodes=16", "eval.max_alignments=64"])
    for one_token in (["heads=adadecode"], ["eval.checkpoint=oracle"], ["eval.tree=config"],
                      ["eval.calibration_max_new_tokens=2"]):  # no calibration, or a calibration that verifies
        compose(["eval.max_new_tokens=1", *one_token])
    compose(["eval.topk=[4,2]"])
    compose(["heads=falcon", "eval.falcon_passes=2", "eval.falcon_tree={depth_children: [2, 1]}"])
    compose(["heads=adadecode", "eval.gamma=1", "eval.gamma_schedule=[0.5, 0.6, 0.7]", "eval.max_inflight=2"])


@pytest.mark.parametrize("args,variants,message", [
    (["heads=adadecode"], "[{gamma: abc}]", r'eval.variants\[0\].gamma="abc" must be a number'),
    (["heads=adadecode"], "[{gamma: 0.5}, {max_inflight: 0}]", r"eval.variants\[1\].max_inflight=0 must be an integer"),
    (["heads=falcon"], "[{falcon_tree: {depth_children: [a]}}]", r"eval.variants\[0\].falcon_tree: invalid literal"),
    (["checkpoint=oracle"], "[{reference_depth: 0}]", r"eval.variants\[0\]: eval.reference_depth=0 must be >= 1"),
    (["heads=ctc"], "[{gamma: 0.3}, {gamma: 0.9}]", r"eval.variants\[0\].gamma=0.3 applies to adadecode heads only"),
])
def test_bad_variant_entry_names_the_variant_and_key(args, variants, message):
    cfg = compose([a.replace("checkpoint=", "eval.checkpoint=") for a in args] + [f"eval.variants={variants}"])
    with pytest.raises(ValueError, match=message):
        variant_configs(cfg)


@pytest.mark.parametrize("variants,names", [
    ("[{topk: [1, 1, 1]}, {topk: [2, 1]}]", ["topk=1_1_1", "topk=2_1"]),  # was topk=_1,_1,_1_ (the list's repr)
    ("[{max_nodes: 8, topk: 3}]", ["max_nodes=8,topk=3"]),
])
def test_variant_names_of_list_values_are_readable(variants, names):
    cfg = compose(["heads=ctc", f"eval.variants={variants}"])
    assert [name for name, _ in variant_configs(cfg)] == names


def test_cli_bad_override_is_one_line_exit_2_before_any_output(tmp_path, tiny_model_dir, capsys):
    from evaluation.__main__ import main

    out = tmp_path / "e"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello there!"}\n')
    with pytest.raises(SystemExit) as exc:  # the old code decoded with the override ignored (oracle) or crashed later
        main(["heads=falcon", "checkpoint=oracle", "eval.falcon_tree=abc", f"eval.output_dir={out}",
              f"model.path={tiny_model_dir}", "model.attn_implementation=eager", f"eval.prompts={prompts}",
              "eval.max_new_tokens=4", "eval.warmup=0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "eval.falcon_tree" in err
    assert not out.exists()


@pytest.mark.parametrize("args,message", [
    (["heads.gamma_schedule=abc"], "heads.gamma_schedule='abc' must be a list of numbers"),
    (["heads.layer_weights=[a,b,c]"], r"heads.layer_weights=\['a', 'b', 'c'\] must be a list of numbers"),
    (["heads.val_gammas=[a]"], r"heads.val_gammas=\['a'\] must be a list of numbers"),  # passed compose before
    (["heads.layers=[a]"], r"heads.layers=\['a'\] must be a list of integers"),
    (["heads.layers=[1.5]"], r"heads.layers=\[1.5\] must be a list of integers"),
])
def test_adadecode_list_keys_name_the_key(args, message):
    """The same kind in the ``heads`` section: AdaDecode's list-valued keys said
    "could not convert string to float: 'a'" (or nothing, for val_gammas) without the key."""
    with pytest.raises(ConfigError, match=message):
        compose(["heads=adadecode", *args])
