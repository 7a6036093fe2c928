"""What a new user trips over (issue 19 items 2, 3, 7, 8, 11, 12, 14): content identities,
report totals from summed counts, typed config errors naming the key, run-name namespaces, plots."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

from core.config import ConfigError, compose
from evaluation.__main__ import main as eval_main, rewrite_argv
from evaluation.plots import make_figure
from evaluation.runner import run_evaluation

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"id": "a", "prompt": "Write a short poem about the sea."}, {"id": "b", "prompt": "def add(a, b):"},
            {"id": "c", "prompt": "Hello there!"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _argv(tiny_model_dir, out, *extra):
    return rewrite_argv([f"model.path={tiny_model_dir}", "model.attn_implementation=eager", f"eval.output_dir={out}",
                         "eval.max_new_tokens=12", "eval.warmup=0", *extra])


# ---------------------------------------------------------------- item 7: typed values, one-line errors
@pytest.mark.parametrize("args,message", [
    (["heads.slots=abc"], 'heads.slots="abc" must be an integer'),
    (["heads=falcon", "heads.num_layers=x"], 'heads.num_layers="x" must be an integer'),
    (["heads=adadecode", "heads.gamma=high"], 'heads.gamma="high" must be a number'),
    (["train.shuffle=1"], "train.shuffle=1 must be true or false"),
    (["prep.layers=3"], "prep.layers=3 must be a list"),
    (["eval.max_new_tokens=1.5"], "eval.max_new_tokens=1.5 must be an integer"),
    (["heads=eagle3", "eval.decoding={topk: abc}"], 'eval.decoding.topk="abc" must be an integer'),
    (["heads=eagle3", "eval.decoding={topK: 8}"], "eval.decoding: unknown key(s) topK for heads=eagle3"),
    (["heads=eagle3", "eval.decoding=3"], "eval.decoding=3 must be a mapping merged over the head's heads.decoding"),
    (["heads=falcon", "heads.decoding.tree={paths: abc}"], "heads.decoding.tree.paths='abc' must be a list of rank paths"),
])
def test_wrong_typed_value_names_the_key(args, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose(args)


def test_numbers_where_numbers_belong_still_compose():
    cfg = compose(["heads=adadecode", "heads.gamma=1", "strategy.timeout_minutes=5", "train.devices=2",
                   "train.batch_size=null", "train.max_tokens=512"])
    assert cfg.heads.gamma == 1 and cfg.train.devices == 2 and cfg.train.batch_size is None


def test_cli_typed_error_is_one_line_exit_2(capsys):
    from train.run import main

    with pytest.raises(SystemExit) as exc:
        main(["heads.slots=abc"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and 'heads.slots="abc"' in err


@pytest.mark.skipif(not NO_CUDA, reason="needs a torch without CUDA")
@pytest.mark.parametrize("args,message", [
    (["eval.device=cuda"], "eval.device=cuda, but this torch sees no CUDA device"),
    (["eval.device=cuda:1"], "eval.device=cuda:1, but this torch sees no CUDA device"),
    (["eval.device=tpu"], "eval.device='tpu' is not valid"),
    (["train.accelerator=gpu"], "train.accelerator=gpu, but this torch sees no CUDA device"),
    # item 8: fp16 on a CPU would silently become bf16-mixed
    (["train.precision=16-mixed"], "train.precision=16-mixed on a CPU: torch has no float16 autocast"),
    (["train.precision=16-true"], "train.precision=16-true on a CPU"),
])
def test_devices_and_precisions_this_machine_lacks_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        compose(args)


@pytest.mark.skipif(not NO_CUDA, reason="needs a torch without CUDA")
def test_eval_cuda_on_cpu_torch_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        eval_main(["checkpoint=oracle", "eval.device=cuda"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("error: eval.device=cuda") and err.count("\n") == 1


def test_variant_values_are_typed_too(tiny_model_dir, tmp_path, capsys):
    rc = eval_main(_argv(tiny_model_dir, tmp_path / "out", "heads=adadecode", "checkpoint=oracle",
                         "eval.variants=[{reference_depth: deep}]"))
    assert rc == 2 and 'eval.variants[0].reference_depth="deep" must be an integer' in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- item 12: run names per head variant
def test_run_names_are_namespaced_per_head_variant(tmp_path):
    from train.resume import resolve_resume
    from train.run import run_dir_for

    dirs = {h: run_dir_for(compose([f"heads={h}", "train.run_name=r1", f"output_root={tmp_path}"]))
            for h in ("falcon", "falcon_noglance", "falcon_k1", "ctc")}
    assert dirs == {h: tmp_path / "runs" / h / "r1" for h in dirs}
    # resume=auto without a run name finds the newest run of this variant only
    k1 = dirs["falcon_k1"] / "checkpoints" / "last.ckpt"
    k1.parent.mkdir(parents=True)
    k1.write_bytes(b"x")
    auto = lambda h: resolve_resume(compose([f"heads={h}", "resume=auto", f"output_root={tmp_path}"]), run_dir_for)  # noqa: E731
    assert auto("falcon_k1") == (k1, dirs["falcon_k1"])
    assert auto("falcon") == (None, None)


# ---------------------------------------------------------------- item 2 + 11: content identity, merge writes the report
def test_shards_with_differently_spelt_checkpoint_merge_and_resume(tiny_base, tiny_model_dir, tmp_path, prompts_file,
                                                                   monkeypatch, capsys):
    """One checkpoint given as an absolute and as a relative path is one identity (its weights'
    SHA-256): the shards merge, ``python -m evaluation.merge`` writes the merged report itself without
    decoding again, and a shard resumes under the other spelling."""
    import heads
    import evaluation.runner as runner

    monkeypatch.chdir(tmp_path)
    cfg = compose(_argv(tiny_model_dir, tmp_path / "a", "checkpoint=ckpt", f"eval.prompts={prompts_file}"))
    torch.manual_seed(0)
    heads.save(heads.build(cfg.heads, tiny_base[0]), tmp_path / "ckpt", tiny_base[2].to_dict())
    common = [f"eval.prompts={prompts_file}"]
    a = run_evaluation(compose(_argv(tiny_model_dir, tmp_path / "a", f"checkpoint={tmp_path / 'ckpt'}",
                                     "eval.num_prompts=2", *common)), base=tiny_base)
    b = run_evaluation(compose(_argv(tiny_model_dir, "b", "checkpoint=ckpt", "eval.prompt_offset=2",
                                     "eval.num_prompts=1", *common)), base=tiny_base)

    def no_decoding(*args, **kwargs):
        raise AssertionError("a finished prompt was decoded again")

    monkeypatch.setattr(runner, "_decode_prompt", no_decoding)
    # resume shard a under the relative spelling: same weights, nothing decoded again
    again = run_evaluation(compose(_argv(tiny_model_dir, tmp_path / "a", "checkpoint=ckpt", "eval.num_prompts=2",
                                         "resume=auto", *common)), base=tiny_base)
    assert [r["id"] for r in again["per_prompt"]] == ["a", "b"]
    from evaluation.merge import main as merge_main

    assert merge_main([str(tmp_path / "all"), str(tmp_path / "a"), "b"]) == 0
    out = capsys.readouterr().out
    assert "merged 3 prompt(s)" in out and "parity: 3/3" in out
    rep = json.loads((tmp_path / "all" / "report.json").read_text())
    assert (tmp_path / "all" / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    assert [r["id"] for r in rep["per_prompt"]] == ["a", "b", "c"] and rep["num_prompts"] == 3
    assert rep["method"]["tokens"] == a["method"]["tokens"] + b["method"]["tokens"]
    assert rep["vanilla"]["tokens"] == a["vanilla"]["tokens"] + b["vanilla"]["tokens"]
    head = json.loads((tmp_path / "all" / "progress.jsonl").read_text().splitlines()[0])
    assert head["weights"]["checkpoint"]["path"] == str(tmp_path / "ckpt")  # recorded, not compared
    # other weights under the same relative path are another identity: refused, naming the path
    from safetensors.torch import load_file, save_file

    w = load_file(tmp_path / "ckpt" / "model.safetensors")
    save_file({k: v + 1 for k, v in w.items()}, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(ValueError, match=f"the weights of checkpoint {tmp_path / 'ckpt'} changed"):
        run_evaluation(compose(_argv(tiny_model_dir, "b", "checkpoint=ckpt", "resume=auto", *common)), base=tiny_base)


# ---------------------------------------------------------------- item 3 + 14: totals from counts, console, plots
def _brute_force_totals(stats_list):
    out = {}
    for k in {k for s in stats_list for k in s}:
        vals = [s[k] for s in stats_list if k in s]
        if k.startswith("max_"):
            out[k] = max(vals)
        elif all(isinstance(v, int) for v in vals) or k in ("seconds",) or k.endswith("_seconds"):
            out[k] = sum(vals)
    return out


def test_adadecode_totals_are_recomputed_from_summed_counts(tiny_base, tiny_model_dir, tmp_path, prompts_file, capsys):
    """Two prompts, two γ variants (issue 19 item 3): every total equals a brute-force sum of the
    per-prompt counts, no per-prompt ratio is ever summed, and the rates come from summed counts."""
    import heads

    args = _argv(tiny_model_dir, tmp_path / "out", "heads=adadecode", "heads.layers=[1,2]",
                 f"checkpoint={tmp_path / 'ckpt'}", f"eval.prompts={prompts_file}", "eval.num_prompts=2",
                 "eval.variants=[{gamma: 0.0}, {gamma: 0.05}]")
    cfg = compose(args)
    torch.manual_seed(0)
    head = heads.build(cfg.heads, tiny_base[0])
    with torch.no_grad():  # a perturbed logit lens: some early exits are right, some rejected
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.4)
    heads.save(head, tmp_path / "ckpt", tiny_base[2].to_dict())
    result = run_evaluation(cfg, base=tiny_base)
    rejected = {}
    for name, rep in result["variants"].items():
        m, rows = rep["method"], rep["per_prompt"]
        stats = [r["stats"] for r in rows]
        assert m["totals"] == pytest.approx(_brute_force_totals(stats))
        for ratio in ("rejection_rate", "early_exit_rate", "layer_steps_per_token", "tokens_per_s",
                      "vanilla_layer_steps_per_token", "layer_step_speedup"):
            assert ratio not in m["totals"]
        acc = sum(s["accepted_exits"] for s in stats)
        rej = sum(s["rejected_exits"] for s in stats)
        new = sum(s["new_tokens"] for s in stats)
        ds = m["decoder_summary"]
        rejected[name] = rej
        assert ds["early_exit_rate"] == pytest.approx(acc / new)
        assert ds["rejection_rate"] == (pytest.approx(rej / (acc + rej)) if acc + rej else None)
        assert ds["layer_steps_per_token"] == pytest.approx(sum(s["layer_steps"] for s in stats)
                                                            / sum(s["new_tokens"] - 1 for s in stats))
        assert m["tokens_per_s"] == pytest.approx(sum(r["method_tokens"] for r in rows)
                                                  / sum(r["method_seconds"] for r in rows))
        assert m["totals"]["max_inflight_seen"] == max(s["max_inflight_seen"] for s in stats)
        # the console and the PNG show AdaDecode's own figures
        from evaluation.report import format_summary

        text = format_summary(rep)
        assert f"rejection rate {ds['rejection_rate'] if ds['rejection_rate'] is None else format(ds['rejection_rate'], '.3f')}".replace("None", "-") in text
        assert "layer steps/token" in text
        assert "tau (bonus incl.)" not in text
        fig = make_figure(rep)
        left, right = fig.axes[:2]
        assert "early exits: rate" in left.get_title() and left.get_ylabel() == "share of emitted tokens"
        assert [round(p.get_height(), 6) for p in left.patches[:2]] == [round(ds["exits_l1"] / new, 6), round(ds["exits_l2"] / new, 6)]
        assert f"[{name}]" in fig._suptitle.get_text()  # per-variant titles
    assert rejected["gamma=0.0"] > 0  # so its two per-prompt rejection rates sum to more than 1
    titles = {make_figure(r)._suptitle.get_text() for r in result["variants"].values()}
    assert len(titles) == 2


def test_speedup_plot_is_labelled(tiny_model_dir, tmp_path, prompts_file):
    """Item 14: y label and bar edges on the speedup histogram, a labelled 1.0 line, the
    conditional acceptance explained in the legend."""
    rep = run_evaluation(compose(_argv(tiny_model_dir, tmp_path / "out", "checkpoint=oracle",
                                       f"eval.prompts={prompts_file}", "eval.reference_depth=2")))
    fig = make_figure(rep)
    left, right = fig.axes[:2]
    assert right.get_ylabel() == "prompts" and right.patches
    assert all(p.get_edgecolor()[3] > 0 and p.get_linewidth() > 0 for p in right.patches)
    assert "1.0 = vanilla speed" in [t.get_text() for t in right.get_legend().get_texts()]
    assert "conditional: given depths < d accepted" in [t.get_text() for t in left.get_legend().get_texts()]
    assert left.get_ylabel() == "acceptance rate"


# ---------------------------------------------------------------- item 10: demo.sh follows the overrides
@pytest.mark.parametrize("extra,root,run", [
    ([], "outputs", "demo"),
    (["output_root=/x/y", "data.max_conversations=50"], "/x/y", "demo"),
    (["output_root=/a", "train.run_name=r2", "output_root=/b"], "/b", "r2"),
])
def test_demo_script_evaluates_the_head_it_trained(tmp_path, extra, root, run):
    """scripts/demo.sh with a stand-in python that records each stage's arguments: the evaluation
    reads the head from the run directory the training stage writes, under the same output_root."""
    import subprocess
    from pathlib import Path

    log = tmp_path / "calls.jsonl"
    fake = tmp_path / "py"
    fake.write_text(f"#!/usr/bin/env python3\nimport json, sys\nopen({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    fake.chmod(0o755)
    script = Path(__file__).resolve().parent.parent / "scripts" / "demo.sh"
    out = subprocess.run(["bash", str(script), *extra], env={**os.environ, "PY": str(fake)}, capture_output=True,
                         text=True, check=True).stdout
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c[:2] for c in calls] == [["-m", "data_prep"], ["-m", "train"], ["-m", "evaluation"]]
    for c in calls:
        assert c[-len(extra):] == extra if extra else True  # the user's arguments reach every stage, last
    from core.config import compose

    train_cfg = compose(calls[1][2:])
    from data_prep.cache import default_cache_dir
    from train.run import run_dir_for

    # one label set for every stage (teacher-forced: the demo's time budget), so training reads the
    # cache that data prep wrote
    assert {compose(c[2:]).labels for c in calls[:2]} == {"teacher_forced"}
    assert default_cache_dir(compose(calls[0][2:])) == default_cache_dir(train_cfg)

    run_dir = run_dir_for(train_cfg)
    eval_cfg = compose(rewrite_argv(calls[2][2:]))
    assert Path(eval_cfg.eval.checkpoint) == run_dir / "best" == Path(root) / "runs" / "ctc" / run / "best"
    assert Path(eval_cfg.eval.output_dir) == Path(root) / "eval" / run
    assert f"report in {root}/eval/{run}/report.json" in out


# ---------------------------------------------------------------- item 4: base identity
def _with_sha(identity, sha):
    from dataclasses import replace

    return replace(identity, sha256=sha)


def test_training_on_a_cache_of_another_base_is_refused(tiny_base, tiny_model_dir, tmp_path, capsys):
    from core.config import UserInputError
    from data_prep.synthetic import write_random_cache
    from train.run import _cache_datamodule, train

    cache = write_random_cache(tmp_path / "cache", tiny_model_dir, n_train=2, n_val=1)
    for split in ("train", "val"):  # the cache records a GGUF base with another SHA-256
        m = json.loads((cache / split / "manifest.json").read_text())
        m["base"]["sha256"] = "b" * 64
        (cache / split / "manifest.json").write_text(json.dumps(m))
    model, tok, identity = tiny_base
    base = (model, tok, _with_sha(identity, "a" * 64))
    args = ["train.logger=none", "train.progress_bar=false", f"output_root={tmp_path}", f"train.cache_dir={cache}",
            "train.run_name=x", "train.max_steps=1"]
    with pytest.raises(UserInputError, match=r"cache .*train was made with another base model .*sha256: b{64} -> a{64}"
                                             r".*train.allow_other_base=true"):
        train(compose(args), base=base)
    assert not (tmp_path / "runs").exists()
    # the explicit override accepts other weights of the same shape ...
    dm = _cache_datamodule(compose(args + ["train.allow_other_base=true"]), tok, base[2].to_dict())
    assert len(dm.train_reader) == 2
    # ... never another vocabulary
    with pytest.raises(UserInputError, match="vocab_size: .* -> 7.*cannot fit"):
        _cache_datamodule(compose(args + ["train.allow_other_base=true"]), tok, {**base[2].to_dict(), "vocab_size": 7})


def test_evaluating_a_head_of_another_base_is_refused(tiny_base, tiny_model_dir, tmp_path, prompts_file):
    import heads
    from core.config import UserInputError

    model, tok, identity = tiny_base
    args = _argv(tiny_model_dir, tmp_path / "out", "heads=ctc", f"checkpoint={tmp_path / 'ckpt'}",
                 f"eval.prompts={prompts_file}", "eval.num_prompts=1")
    heads.save(heads.build(compose(args).heads, model), tmp_path / "ckpt", _with_sha(identity, "b" * 64).to_dict())
    base = (model, tok, _with_sha(identity, "a" * 64))
    with pytest.raises(UserInputError, match=r"head checkpoint .*ckpt was made with another base model.*"
                                             r"eval.allow_other_base=true"):
        run_evaluation(compose(args), base=base)
    assert not (tmp_path / "out").exists()
    rep = run_evaluation(compose(args + ["eval.allow_other_base=true"]), base=base)
    assert rep["info"]["other_base"] == [f"sha256: {'b' * 64} -> {'a' * 64}"] and rep["parity"]["matched"] == 1
    # the same base passes silently
    heads.save(heads.build(compose(args).heads, model), tmp_path / "ckpt", base[2].to_dict())
    assert "other_base" not in run_evaluation(compose(args[:2] + [f"eval.output_dir={tmp_path / 'o2'}"] + args[3:]),
                                              base=base)["info"]


# ---------------------------------------------------------------- item 9: validate first, create directories last
@pytest.mark.parametrize("make_input,message", [
    (lambda d: d, "not found"),  # data.path=<a directory>
    (lambda d: (d / "x.jsonl").write_text('{"a": 1}\n{"id": "2", "text": "no conversations"}\n') and d / "x.jsonl",
     "no usable conversation in .*missing_conversations"),  # not ShareGPT
])
def test_bad_data_prep_input_leaves_no_cache_directory(tiny_model_dir, tmp_path, capsys, make_input, message):
    import re

    from data_prep.__main__ import main

    (tmp_path / "in").mkdir()
    path = make_input(tmp_path / "in")
    with pytest.raises(SystemExit) as exc:
        main([f"model.path={tiny_model_dir}", f"data.path={path}", "labels=teacher_forced", "prep.progress=false",
              f"output_root={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and re.search(message, err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("n_train,n_val,split", [(3, 0, "val split"), (0, 2, "train split")])
def test_training_on_an_empty_split_leaves_no_run_directory(tiny_base, tiny_model_dir, tmp_path, n_train, n_val, split):
    from core.config import UserInputError
    from data_prep.synthetic import write_random_cache
    from train.run import train

    cache = write_random_cache(tmp_path / "cache", tiny_model_dir, n_train=n_train, n_val=n_val)
    cfg = compose(["train.logger=none", "train.progress_bar=false", f"output_root={tmp_path}",
                   f"train.cache_dir={cache}", "train.run_name=x", "train.max_steps=1"])
    with pytest.raises(UserInputError, match=f"the {split} holds? 0 conversations"):
        train(cfg, base=tiny_base)
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- item 13: known noise silenced in one place
def test_known_library_noise_is_silenced_and_the_rest_still_prints():
    """The exact messages a training run printed (Lightning's srun hint, its logger advertisement
    and limit_val_batches echo, the pytree deprecation, DeepSpeed ZeRO's collective FutureWarnings,
    the false sync_dist advice) are silenced by core.quiet; an unrelated warning still prints."""
    import subprocess
    import sys

    script = r'''
import warnings
from core.quiet import silence_known_noise
silence_known_noise()
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
import logging
logging.basicConfig(level=logging.INFO)
rank_zero_warn("The `srun` command is available on your system but is not used. HINT: ...")
rank_zero_warn("It is recommended to use `self.log('val/loss', ..., sync_dist=True)` when logging on epoch level")
rank_zero_warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...")
rank_zero_warn("Checkpoint directory /x/runs/ctc/r1/checkpoints exists and is not empty.")
warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning)
warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use ...", FutureWarning)
rank_zero_info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
rank_zero_info("`Trainer(limit_val_batches=1.0)` was configured so 100% of the batches will be used..")
rank_zero_warn("a warning that matters")
rank_zero_info("an info line that matters")
import os, sys
print("DS_ACCELERATOR=" + os.environ.get("DS_ACCELERATOR", ""), file=sys.stderr)
'''
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "DRAFTHEADS_VERBOSE")}
    err = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stderr
    for noise in ("srun", "sync_dist", "LeafSpec", "all_gather_into_tensor", "reduce_scatter_tensor", "Tip:",
                  "limit_val_batches", "exists and is not empty"):
        assert noise not in err, err
    assert "a warning that matters" in err and "an info line that matters" in err
    if NO_CUDA:
        assert "DS_ACCELERATOR=cpu" in err  # DeepSpeed's "unable to detect" warning on import


