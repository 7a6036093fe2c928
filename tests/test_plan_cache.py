"""Issue 31 items 5 and 6 on the tiny model: every reuse of a cached measurement (c(n), calibration,
drafter cost) says where it came from, how old it is and the load it was measured under; a
prediction far from the measurement warns and names the cache to delete; calibration shows a
progress bar, resumes after an interrupt, and the report counts the time of every phase."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from core.config import compose
from decoding import cost_model
from decoding.tree_search import AcceptanceStats
from decoding.vanilla import eos_token_ids
from evaluation.__main__ import rewrite_argv
from evaluation.methods import build_decoder
from evaluation.prompts import load_prompts
from evaluation.runner import run_evaluation
from evaluation.tree_auto import plan_tree, prediction_warnings
from tests.test_tree_auto import _save_head


def _cfg(tiny_model_dir, tmp_path, sharegpt, *extra, head="ctc", root="root"):
    return compose(rewrite_argv([f"model.path={tiny_model_dir}", "model.attn_implementation=eager", f"heads={head}",
                                 f"output_root={tmp_path / root}", f"eval.output_dir={tmp_path / 'out'}",
                                 f"data.path={sharegpt}", "data.heldout_fraction=0.3", "eval.num_prompts=2",
                                 "eval.max_new_tokens=8", "eval.warmup=0", "eval.calibration_prompts=4",
                                 "eval.tree_grid=[1,2,4]", "eval.cost_context_tokens=8",
                                 f"checkpoint={tmp_path / 'ckpt'}", *extra]))


def test_cost_model_reuse_names_file_age_and_load(tiny_base, tmp_path, caplog):
    model, _, identity = tiny_base
    with caplog.at_level(logging.INFO, logger="decoding.cost_model"):
        a = cost_model.load_or_measure(model, identity, tmp_path, [1, 2], context_tokens=8, repeats=1)
        assert not any("reusing" in r.message for r in caplog.records)
        b = cost_model.load_or_measure(model, identity, tmp_path, [1, 2], context_tokens=8, repeats=1)
    saved = json.loads(open(a.path).read())
    assert saved["load"]["cpus"] and saved["load"]["threads"] == torch.get_num_threads()
    assert saved["load"]["loadavg"] is None or len(saved["load"]["loadavg"]) == 3
    assert not a.reused and b.reused and b.load == saved["load"]
    line = next(r.message for r in caplog.records if "reusing" in r.message)
    assert a.path in line and "measured" in line and " ago" in line and "CPUs" in line and "delete" in line


def test_calibration_and_drafter_cost_reuse_are_logged_and_phases_counted(tiny_base, tiny_model_dir, tmp_path,
                                                                           sharegpt, caplog, capfd):
    cfg = _cfg(tiny_model_dir, tmp_path, sharegpt)
    _save_head(cfg, tiny_base, tmp_path)
    with caplog.at_level(logging.INFO):
        first = run_evaluation(cfg, base=tiny_base)
    err = capfd.readouterr().err
    assert "calibrating ctc" in err and "prompt" in err and "measuring c(n)" in err  # the progress bars
    ph = first["phases"]
    assert ph["cost_model_seconds"] > 0 and ph["calibration_seconds"] > 0 and ph["decoding_seconds"] > 0
    assert ph["planning_seconds"] >= ph["cost_model_seconds"] + ph["calibration_seconds"]
    assert not any("reusing" in r.message for r in caplog.records)
    cal_file = first["tree"]["statistics"]["path"]
    assert json.loads(open(cal_file).read())["load"]["cpus"]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        again = run_evaluation(_cfg(tiny_model_dir, tmp_path, sharegpt, f"eval.output_dir={tmp_path / 'out2'}"),
                               base=tiny_base)
    reuse = [r.message for r in caplog.records if "reusing the cached" in r.message]
    assert any("cost model" in m and first["tree"]["cost_model"]["path"] in m for m in reuse)
    assert any("ctc calibration" in m and cal_file in m for m in reuse)
    assert any("drafter cost" in m and cal_file in m for m in reuse)
    assert again["phases"]["cost_model_seconds"] == 0 and again["phases"]["calibration_seconds"] == 0
    assert again["tree"]["cost_model"]["reused"] and again["tree"]["statistics"]["reused"]
    assert "## Time" in (tmp_path / "out2" / "summary.md").read_text()


def test_a_prediction_far_from_the_measurement_warns_naming_the_cache(tiny_base, tiny_model_dir, tmp_path, sharegpt,
                                                                      monkeypatch, caplog):
    """A planted calibration that promises τ(n) = 3 (an untrained head accepts ~nothing): the
    measured τ is far below; the report and the log warn and name the calibration file."""
    monkeypatch.setattr(AcceptanceStats, "budget_tau", lambda self: {1: 1.0, 2: 3.0, 4: 3.0})
    cfg = _cfg(tiny_model_dir, tmp_path, sharegpt)
    _save_head(cfg, tiny_base, tmp_path)
    with caplog.at_level(logging.WARNING):
        rep = run_evaluation(cfg, base=tiny_base)
    tree = rep["tree"]
    assert tree["predicted_tau"] == 3.0 and tree["measured_tau"] < 2.25
    warns = tree["warnings"]
    assert any("measured tau" in w and tree["statistics"]["path"] in w and "delete" in w for w in warns)
    assert any(tree["statistics"]["path"] in r.message for r in caplog.records if r.levelno == logging.WARNING)
    # within 25 %: no warning
    ok = dict(tree, measured_tau=tree["predicted_tau"] * 1.2, measured_speedup=tree["predicted_speedup"] * 0.8)
    assert prediction_warnings(ok) == []
    slow = dict(ok, measured_speedup=tree["predicted_speedup"] * 0.5)
    assert any("measured speedup" in w and tree["cost_model"]["path"] in w for w in prediction_warnings(slow))


class _Stop(Exception):
    pass


def test_interrupted_calibration_resumes_with_the_prompts_not_yet_calibrated(tiny_base, tiny_model_dir, tmp_path,
                                                                               sharegpt):
    """Ctrl-C (planted: a callback raising after the 2nd of 4 calibration prompts) keeps the prompts
    calibrated so far; the next plan decodes only the other 2 and gives the statistics of one
    uninterrupted calibration."""
    model, tok, identity = tiny_base
    cfg = _cfg(tiny_model_dir, tmp_path, sharegpt, "eval.tree=auto")
    _save_head(cfg, tiny_base, tmp_path)
    eos = eos_token_ids(tok, model)
    prompts, _ = load_prompts(cfg.eval, cfg.data, tok)

    def plan(c, on_prompt=None):
        dec, info = build_decoder(c, model, eos, torch.device("cpu"), identity=identity)
        return plan_tree(c, dec, info, model, identity, tok, prompts, eos, on_prompt=on_prompt)[1]["tree_choice"]

    seen = []

    def stop_after_two(k, stats):
        seen.append(k)
        if k == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        plan(cfg, stop_after_two)
    partial = list((tmp_path / "root" / "calibration").glob("*.partial.json"))
    assert seen == [1, 2] and len(partial) == 1 and json.loads(partial[0].read_text())["done"] == 2
    seen.clear()
    resumed = plan(cfg, lambda k, s: seen.append(k))
    assert seen == [3, 4] and not partial[0].exists()
    whole = plan(_cfg(tiny_model_dir, tmp_path, sharegpt, "eval.tree=auto", root="fresh"))
    strip = lambda d: {k: v for k, v in d.items() if k not in ("drafter_seconds",)}  # noqa: E731
    a = json.loads(open(resumed["statistics"]["path"]).read())["stats"]
    b = json.loads(open(whole["statistics"]["path"]).read())["stats"]
    assert strip(a) == strip(b) and a["steps"] > 0
    # what the plan derives from the statistics alone is equal too; the chosen tree is not compared: it also
    # weighs c(n) and the drafter's cost, timings that the two roots measure separately (on a loaded
    # machine an untrained head's equal-tau trees can swap)
    for key in ("rank_acceptance", "budget_tau", "steps", "held_out_prompts"):
        assert resumed["statistics"][key] == whole["statistics"][key], key


def test_the_cost_model_key_names_the_cpu(tiny_base, monkeypatch):
    """c(n) measured on one CPU sized the trees of another sharing output_root (TensorRT-LLM#17664's kind)."""
    import core.precision
    from decoding.cost_model import cost_key

    model, _, identity = tiny_base
    here = cost_key(identity, model, [1, 2], 16, 3)
    assert here["device"] == f"cpu ({core.precision.cpu_identity()})"
    monkeypatch.setattr(core.precision, "cpu_identity", lambda: "AMD EPYC (family 25 model 1) [avx512f avx2]")
    other = cost_key(identity, model, [1, 2], 16, 3)
    assert other["device"] == "cpu (AMD EPYC (family 25 model 1) [avx512f avx2])" and other != here
