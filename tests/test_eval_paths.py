"""Relative paths in an evaluation (prompts file, base model folder, head checkpoint) are one
identity with their absolute spelling, and the recorded ``config.yaml`` re-runs from any directory:
``python -m evaluation.merge`` rebuilds the report from the first shard's config (issue 19 item 2,
the same kind as the checkpoint paths)."""
from __future__ import annotations

import json
import os
import re

import pytest

from core.config import compose
from evaluation.merge import main as merge_main
from evaluation.runner import run_evaluation


def test_shards_with_relative_paths_merge_from_another_directory(tiny_base, tiny_model_dir, tmp_path, monkeypatch,
                                                                  capsys):
    import heads

    work, other = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    other.mkdir()
    (work / "prompts.jsonl").write_text("\n".join(json.dumps({"id": i, "prompt": p}) for i, p in
                                                  [("a", "Hello there!"), ("b", "def add(a, b):")]) + "\n")
    os.symlink(tiny_model_dir, work / "base")
    monkeypatch.chdir(work)

    def argv(*extra):
        return [f"eval.output_dir={tmp_path / 'shard' / extra[0]}", "model.attn_implementation=eager",
                "eval.max_new_tokens=6", "eval.warmup=0", "eval.num_prompts=1", *extra[1:]]

    cfg = compose(argv("x", f"model.path={tiny_model_dir}"))
    torch_seed = __import__("torch").manual_seed(0)  # noqa: F841
    heads.save(heads.build(cfg.heads, tiny_base[0]), work / "ckpt", tiny_base[2].to_dict())
    # shard 0: everything relative to `work`; shard 1: the same files spelt absolutely
    run_evaluation(compose(argv("0", "model.path=base", "eval.prompts=prompts.jsonl", "eval.checkpoint=ckpt")),
                   base=tiny_base)
    run_evaluation(compose(argv("1", f"model.path={work / 'base'}", f"eval.prompts={work / 'prompts.jsonl'}",
                                f"eval.checkpoint={work / 'ckpt'}", "eval.prompt_offset=1")), base=tiny_base)
    saved = (tmp_path / "shard" / "0" / "config.yaml").read_text()
    assert f"prompts: {work / 'prompts.jsonl'}" in saved and f"checkpoint: {work / 'ckpt'}" in saved
    monkeypatch.chdir(other)  # the merge runs elsewhere: shard 0's relative paths must still resolve
    capsys.readouterr()
    assert merge_main([str(tmp_path / "all"), str(tmp_path / "shard" / "0"), str(tmp_path / "shard" / "1")]) == 0
    assert "merged 2 prompt(s)" in capsys.readouterr().out
    rep = json.loads((tmp_path / "all" / "report.json").read_text())
    assert [r["id"] for r in rep["per_prompt"]] == ["a", "b"] and rep["parity"]["matched"] == 2


def test_a_checkpoint_that_is_not_one_is_named_before_the_base_loads(tmp_path, monkeypatch):
    """A missing path, a training run's folder (the user meant its best/) and a folder without the
    weights are each one clear error, before any base is loaded; the export says the same."""
    import core.base_model
    from evaluation.__main__ import rewrite_argv
    from heads.export import read_checkpoint

    monkeypatch.setattr(core.base_model, "load_base_model", lambda *a, **k: pytest.fail("the base was loaded"))
    run = tmp_path / "runs" / "ctc" / "r1"
    (run / "best").mkdir(parents=True)
    (run / "best" / "model.safetensors").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    cases = {tmp_path / "nope": "no such directory", run: "is a training run's folder: pass " + str(run / "best"),
             tmp_path / "empty": "has no model.safetensors",
             run / "best" / "model.safetensors": f"is a file: pass the folder that holds it ({run / 'best'})"}
    for path, message in cases.items():
        cfg = compose(rewrite_argv([f"checkpoint={path}", f"eval.output_dir={tmp_path / 'out'}"]))
        with pytest.raises(FileNotFoundError, match=re.escape(message)):
            run_evaluation(cfg)
        with pytest.raises(FileNotFoundError, match=re.escape(message)):
            read_checkpoint(path)
    bad = compose(rewrite_argv(["checkpoint=oracle", f"eval.output_dir={tmp_path / 'out'}",
                                f"eval.variants=[{{name: a, checkpoint: {tmp_path / 'nope'}}}]"]))
    with pytest.raises(FileNotFoundError, match=re.escape(f"eval.variants[0]: checkpoint {tmp_path / 'nope'}: no such directory")):
        run_evaluation(bad)
    # another head's checkpoint (SGLang's silent EAGLE-for-EAGLE-3 mix-up, sgl-project/sglang#21272): named, no load
    from safetensors.torch import save_file
    import torch

    falcon = tmp_path / "falcon_best"
    falcon.mkdir()
    save_file({"w": torch.zeros(2)}, str(falcon / "model.safetensors"))
    (falcon / "config.json").write_text(json.dumps({"head_type": "falcon"}))
    for argv in (["heads=eagle3", f"checkpoint={falcon}"],
                 ["heads=ctc", "checkpoint=oracle", f"eval.variants=[{{name: a, checkpoint: {falcon}}}]"]):
        cfg = compose(rewrite_argv([*argv, f"eval.output_dir={tmp_path / 'out'}"]))
        with pytest.raises(ValueError, match=re.escape(f"checkpoint {falcon} holds a 'falcon' head but heads.type=")):
            run_evaluation(cfg)
    # a torn weights file or a config.json that is not JSON: named, where a library traceback came (the export too)
    (falcon / "model.safetensors").write_bytes(b"\xff" * 64)
    for call in (lambda: run_evaluation(compose(rewrite_argv(["heads=falcon", f"checkpoint={falcon}",
                                                               f"eval.output_dir={tmp_path / 'out'}"]))),
                 lambda: read_checkpoint(falcon)):
        with pytest.raises(ValueError, match=re.escape(f"checkpoint {falcon}: model.safetensors is not a readable "
                                                       "safetensors file (")):
            call()
    save_file({"w": torch.zeros(2)}, str(falcon / "model.safetensors"))
    (falcon / "config.json").write_text("{head_type: falcon")
    with pytest.raises(ValueError, match=re.escape(f"checkpoint {falcon}: config.json is not a head config (JSONDecodeError")):
        read_checkpoint(falcon)


def test_a_prompt_offset_past_the_prompts_is_refused_before_the_base_loads(tiny_model_dir, tmp_path, monkeypatch):
    import core.base_model
    from evaluation.prompts import PromptError

    def no_load(*_a, **_k):
        raise AssertionError("the base was loaded")

    monkeypatch.setattr(core.base_model, "load_base_model", no_load)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "prompt": "Hello"}) for i in "abc") + "\n")
    cfg = compose([f"model.path={tiny_model_dir}", f"eval.prompts={prompts}", "eval.prompt_offset=3",
                   f"eval.output_dir={tmp_path / 'out'}", "eval.checkpoint=oracle"])
    with pytest.raises(PromptError, match=r"eval.prompt_offset=3 is past the 3 usable prompt\(s\) of .*prompts.jsonl; "
                                          r"use an offset below 3"):
        run_evaluation(cfg)
    assert not (tmp_path / "out").exists()


def test_an_output_dir_holding_results_is_refused_before_the_base_loads(tiny_model_dir, tmp_path, monkeypatch):
    """Before, the refusal came after the base had loaded, c(n) was measured and the tree calibrated (27 s on
    SmolLM2), and left their files behind."""
    import core.base_model

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "prompt": "Hello"}) for i in "ab") + "\n")
    argv = [f"model.path={tiny_model_dir}", "model.attn_implementation=eager", f"eval.prompts={prompts}",
            "eval.checkpoint=oracle", "eval.max_new_tokens=4", "eval.warmup=0", f"eval.output_dir={tmp_path / 'out'}"]
    run_evaluation(compose(argv))
    monkeypatch.setattr(core.base_model, "load_base_model", lambda *a, **k: pytest.fail("the base was loaded"))
    with pytest.raises(ValueError, match=r"progress.jsonl already holds results of 2 prompt\(s\): pass resume=auto"):
        run_evaluation(compose(argv))
    with pytest.raises(ValueError, match=r"different model/heads/eval configuration \(eval.max_new_tokens: 4 -> 5\)"):
        run_evaluation(compose([*argv, "eval.max_new_tokens=5", "resume=auto"]))


def test_prompt_settings_that_would_silently_mislead_are_refused(tiny_model_dir, tmp_path):
    from core.base_model import load_tokenizer
    from evaluation.prompts import PromptError, load_prompts, read_jsonl_records

    with pytest.raises(PromptError, match=re.escape(f"eval.prompts={str(tmp_path)!r} is a folder: name the JSONL file")):
        read_jsonl_records(tmp_path)  # was "file not found"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "prompt": "Hello"}) for i in "abc") + "\n")
    cfg = compose([f"model.path={tiny_model_dir}", f"eval.prompts={prompts}", "eval.prompts_per_category=1"])
    with pytest.raises(PromptError, match=r"eval.prompts_per_category=1: .*p.jsonl has no 'category' field, so it would "
                                          r"keep the first 1 prompt\(s\) of the whole set; use eval.num_prompts"):
        load_prompts(cfg.eval, cfg.data, load_tokenizer(cfg.model))
