"""scripts/compare.py (issue 18): the whole comparison on the tiny model, a tiny budget and two
shards; an unregistered head is skipped; a second run resumes (every stage skipped); an
interrupted evaluation stage continues without decoding finished prompts again."""
from __future__ import annotations

import json
import sys

import pytest
import yaml

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import compare  # noqa: E402

from tests.test_data_prep import _conversations  # noqa: E402


@pytest.fixture
def tiny_setup(tmp_path, tiny_model_dir):
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(_conversations(16)))
    mt = tmp_path / "mt.jsonl"
    rows = [{"question_id": q, "category": c, "turns": [f"Question {q}: say something.", "Shorter."]}
            for q, c in [(1, "writing"), (2, "writing"), (3, "math"), (4, "math"), (5, "coding")]]
    mt.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = yaml.safe_load((ROOT / "configs" / "compare.yaml").read_text())
    cfg.update(
        output_dir=str(tmp_path / "cmp"),
        common=[f"model.path={tiny_model_dir}", "model.attn_implementation=eager", f"data.path={data}",
                "data.heldout_fraction=0.25"],  # the split: every stage's, evaluation's calibration included
        prep=["labels=teacher_forced", "data.max_conversations=null", "data.max_length=96", "prep.shard_size=4",
              "prep.batch_tokens=400", "model.dtype=float32"],
        train_max_time=2,
        train=["train.batch_size=4", "train.max_steps=1000", "train.val_every_n_steps=2", "train.logger=csv",
               "train.sanity_val_steps=0", "train.accelerator=cpu", "train.devices=1", "train.scheduler.warmup_steps=1"],
        heads_to_run=["ctc", "ctc_ce", "notyet"])
    for name in ("ctc", "ctc_ce"):  # a ctc key: under train it would reach every head (eagle3 has none)
        cfg["heads"][name]["overrides"] = list(cfg["heads"][name]["overrides"]) + ["heads.attn_implementation=eager"]
    cfg["heads"]["notyet"] = {"head": "notyet", "overrides": [], "eval": []}  # a head with no config or module yet
    cfg["eval"].update(prompts=str(mt), prompts_per_category=2, max_new_tokens=8, shards=2, timing_per_category=1,
                       repeats=2, timing_threads=1, overrides=["eval.warmup=0"])
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, tmp_path / "cmp"


def test_compare_driver_end_to_end_and_resume(tiny_setup, capsys):
    """ctc and ctc with loss=ce form one evaluation group: the variants of one run (one vanilla pass);
    the timing run sizes their auto trees, and the τ/parity shards decode with the same trees."""
    config, out = tiny_setup
    assert compare.main(["--config", str(config)]) == 0
    printed = capsys.readouterr().out
    assert "[skip] notyet: heads=notyet is not available yet" in printed
    ran = [line.split()[2] for line in printed.splitlines() if line.startswith("[run ] eval-")]
    assert ran == [f"eval-ctc+ctc_ce-{s}" for s in ("timing", "shards", "merge", "report")]  # timing first
    group = out / "eval" / "ctc+ctc_ce"
    for name in ("ctc", "ctc_ce"):
        rep = json.loads((group / "quality" / name / "report.json").read_text())
        # 5 questions, 2 per category -> 1, 2, 3, 4, 5 (coding has one), both turns, from two shards
        assert rep["num_prompts"] == 10 and rep["parity"]["matched"] == 10
        assert rep["checkpoint"].endswith(f"compare-{name}/best") or rep["checkpoint"].endswith(f"compare-{name}/last")
        assert {t: p["total"] for t, p in rep["parity_per_turn"].items()} == {"1": 5, "2": 5}
        assert {c: g["prompts"] for c, g in rep["per_category"].items()} == {"writing": 4, "math": 4, "coding": 2}
        shards = [json.loads((group / f"shard{k}" / name / "report.json").read_text()) for k in (0, 1)]
        assert [r["id"] for r in shards[0]["per_prompt"]] == ["1", "1/turn2", "2", "2/turn2", "3", "3/turn2"]
        assert [r["id"] for r in shards[1]["per_prompt"]] == ["4", "4/turn2", "5", "5/turn2"]
        timing = json.loads((group / "timing" / name / "report.json").read_text())
        assert timing["num_prompts"] == 6 and timing["timing"]["repeats"] == 2 and timing["timing"]["identical_tokens"]
        # tau at one node budget for every head (quality_overrides: eval.tree_nodes=16 tree_objective=tau), from the
        # timing threads' cached cost model (1 here); the timing run decodes with the auto tree
        assert rep["tree"]["applied"] and rep["tree"]["statistics"]["plan_threads"] == timing["threads"] == 1
        assert rep["tree"]["chosen"]["nodes"] == 16 and rep["tree"]["objective"] == "tau" and timing["tree"]["mode"] == "auto"
        same = lambda c: {k: v for k, v in c.items() if k != "reused"}  # noqa: E731
        assert same(rep["tree"]["cost_model"]) == same(timing["tree"]["cost_model"])  # one measurement
        assert rep["tree"]["cost_model"]["reused"] or timing["tree"]["cost_model"]["reused"]  # read from the cache
        assert rep["tree"]["statistics"]["path"] == timing["tree"]["statistics"]["path"]  # one calibration
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["rows"]
    assert [r["variant"] for r in rows] == ["ctc", "ctc_ce"]
    for row in rows:
        assert row["speedup_repeats"]["n"] == 2 and row["train_steps"] > 0
        assert row["tree"]["nodes"] == 16 and row["timing_tree"]["mode"] == "auto"
        assert row["tree_matches_timing"] is (row["timing_tree"]["nodes"] == 16)
        assert row["timing_tau"] is not None and set(row["per_category"]["math"]) >= {"tau", "speedup", "timing_prompts"}
        # tokens seen: the replayed training batches (16 conversations of at most 96 tokens, batch 4)
        assert 0 < row["train_tokens"] <= row["train_steps"] * 4 * 96
        assert row["train_seconds"] >= 2 and row["evaluated_step"] <= row["train_steps"]
        assert row["parity_per_turn"] == {"1": "5/5", "2": "5/5"}
    md = (out / "summary.md").read_text()
    assert "| ctc |" in md and "| ctc_ce |" in md and "t2: 5/5" in md and "| math |" in md
    assert (out / "val_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # both heads' τ against tokens
    assert "| tree (τ runs) | timing tree | τ (timing) |" in md and "auto: 16 nodes" in md
    budget = (out / "budget.md").read_text()  # equal tokens and equal wall clock, from the run records
    for row in rows:
        rec = json.loads((out / "runs" / "ctc" / f"compare-{row['variant']}" / "record.json").read_text())
        assert f"| {row['variant']} | {rec['tokens_seen']:,} | {rec['train_seconds']:.0f} |" in budget

    # run again: every stage is skipped, nothing is decoded or trained
    assert compare.main(["--config", str(config)]) == 0
    ran = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[run ]")]
    assert ran == [f"[run ] summary of ctc, ctc_ce -> {out / 'summary.md'}"]  # only the summary is rewritten

    # an interrupted timing stage: its marker gone, a prompt's record lost -> only that is decoded again
    (out / "stages" / "eval-ctc+ctc_ce-timing.done").unlink()
    prog = group / "timing" / "progress.jsonl"
    lines = prog.read_text().splitlines()
    prog.write_text("\n".join(lines[:-1]) + "\n")
    assert compare.main(["--config", str(config)]) == 0
    assert "[run ] eval-ctc+ctc_ce-timing" in capsys.readouterr().out
    assert len(prog.read_text().splitlines()) == len(lines)
    log = (out / "logs" / "eval-ctc+ctc_ce-timing.log").read_text()
    assert "resuming: 5 prompt turn(s) already decoded" in log

    # a finished stage is not skipped under other settings: every later stage would build on its outputs
    cfg = yaml.safe_load(config.read_text())
    cfg["heads"]["ctc_ce"]["overrides"] = cfg["heads"]["ctc_ce"]["overrides"] + ["heads.draft_vocab_size=32"]
    changed = config.parent / "changed.yaml"
    changed.write_text(yaml.safe_dump(cfg))
    stamps = {p: p.stat().st_mtime_ns for p in (out / "stages").iterdir()}
    assert compare.main(["--config", str(changed)]) == 2
    err = capsys.readouterr().err
    assert "error: stage train-ctc_ce finished earlier with other settings (" in err and "'heads.draft_vocab_size=32'" in err
    assert f"delete {out / 'stages' / 'train-ctc_ce.done'}" in err
    assert {p: p.stat().st_mtime_ns for p in (out / "stages").iterdir()} == stamps


def test_compare_driver_bad_config_is_one_line_error(tiny_setup, capsys):
    config, out = tiny_setup
    assert compare.main(["--config", str(config), "eval.shards=0"]) == 2
    assert "eval.shards=0 must be an integer >= 1" in capsys.readouterr().err
    assert compare.main(["--config", str(config), "nope=1"]) == 2
    assert "'nope=1': not a key=value override" in capsys.readouterr().err
    assert compare.main(["--config", str(config), "heads_to_run=[notyet]"]) == 2
    # every stage's overrides are composed now: a bad key surfaced only when its stage started, hours later
    for arg, said in [("heads.ctc.overrides=[heads.nosuch=1]", "training of ctc (train, train_budget, heads.ctc.overrides): "),
                      ("eval.overrides=[eval.nosuch=1]", "evaluation of ctc (eval.overrides"),
                      ("common=[model.nosuch=1]", "prep: ")]:
        assert compare.main(["--config", str(config), arg]) == 2
        err = capsys.readouterr().err
        assert said in err and "nosuch" in err, err
    assert compare.main(["--config", str(config), "heads_to_run=ctc"]) == 2  # a string, read letter by letter
    assert "heads_to_run='ctc' must be a list of names under heads, e.g. 'heads_to_run=[ctc]'" in capsys.readouterr().err
    # a malformed prompts file is named by line before data prep starts (the evaluation reads it hours later)
    bad = out.parent / "bad_questions.jsonl"
    bad.write_text('{"question_id": 1, "category": "writing", "turns": []}\n')
    assert compare.main(["--config", str(config), f"eval.prompts={bad}"]) == 2
    assert f"{bad}:1:" in capsys.readouterr().err
    # a split key in one stage's overrides only: evaluation would calibrate on another dataset's held-out split
    for prep in (["labels=teacher_forced", "data.heldout_fraction=0.1"], {"tf": ["data.path=other.json"]}):
        cfg = yaml.safe_load(config.read_text())
        cfg["prep"] = prep
        config.write_text(yaml.safe_dump(cfg))
        assert compare.main(["--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert "define the train/held-out split" in err and "put them in common" in err, err
        assert ("prep: data.heldout_fraction=0.1" if isinstance(prep, list) else "prep.tf: data.path=other.json") in err
    assert not out.exists()  # nothing written before the configuration is valid


def test_compare_driver_parallel_training_and_stage_selection(tiny_setup, capsys, monkeypatch):
    """train_parallel=P trains heads in groups of P, cpu_count // P threads each; `stages` picks
    what runs; a failed stage of a group does not lose its neighbour's marker."""
    config, out = tiny_setup
    monkeypatch.setattr(compare.os, "cpu_count", lambda: 4)
    assert compare.main(["--config", str(config), "--dry-run", "stages=[train]", "train_parallel=2",
                         "heads_to_run=[ctc,ctc_ce]"]) == 0
    ran = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[run ]")]
    assert ran == ["[run ] train-ctc [OMP_NUM_THREADS=2]", "[run ] train-ctc_ce [OMP_NUM_THREADS=2]"]
    # P > C: one thread each; the last, smaller group is pinned to ceil(g*C/P) CPUs (same share per head)
    monkeypatch.setattr(compare.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(compare.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(compare.os, "sched_setaffinity", lambda pid, cpus: None, raising=False)
    assert compare.main(["--config", str(config), "--dry-run", "stages=[train]", "train_parallel=4",
                         "heads_to_run=[ctc,ctc_ce,falcon,falcon_k1,eagle3,adadecode]"]) == 0
    ran = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[run ]")]
    assert ran == [f"[run ] train-{n} [OMP_NUM_THREADS=1]" for n in ("ctc", "ctc_ce", "falcon", "falcon_k1")] + \
        [f"[run ] train-{n} [OMP_NUM_THREADS=1] [CPUs [0]]" for n in ("eagle3", "adadecode")]
    assert compare.main(["--config", str(config), "stages=[]"]) == 2
    assert compare.main(["--config", str(config), "stages=[train,deploy]"]) == 2
    assert "stages=['train', 'deploy']: expected a non-empty subset of" in capsys.readouterr().err
    assert compare.main(["--config", str(config), "train_parallel=0"]) == 2

    monkeypatch.undo()
    cfg = compare.load_config(config, [])
    drv = compare.Driver(cfg)
    if hasattr(compare.os, "sched_setaffinity"):
        cpu = min(compare.os.sched_getaffinity(0))
        shown = [sys.executable, "-c", "import os; print('cpus', sorted(os.sched_getaffinity(0)))"]
        assert drv.run_stages([("pinned", [shown])], cpus=[cpu]) == [0]
        assert f"cpus [{cpu}]" in (out / "logs" / "pinned.log").read_text()
    py = sys.executable
    show = [py, "-c", "import os; print('threads', os.environ['OMP_NUM_THREADS'])"]
    with pytest.raises(SystemExit) as exc:
        drv.run_stages([("ok", [show]), ("bad", [[py, "-c", "raise SystemExit(3)"]])], threads=2)
    assert exc.value.code == 3
    assert (out / "stages" / "ok.done").is_file() and not (out / "stages" / "bad.done").exists()
    assert "threads 2" in (out / "logs" / "ok.log").read_text()
    assert drv.run_stages([("ok", [show])]) == [0]  # done earlier: skipped
    with pytest.raises(compare.UserInputError, match="stage ok finished earlier with other settings"):
        drv.run_stages([("ok", [[py, "-c", "raise SystemExit(5)"]])])  # ... unless its command changed


def test_compare_driver_two_caches_and_a_token_budget(tiny_setup, capsys):
    """``prep`` as a map builds one cache per name (each its own stage and directory); a head trains
    on the cache its ``cache`` entry names (default the first); ``train_budget`` replaces the wall
    clock by an equal token budget; a head naming no such cache, or no budget at all, is refused."""
    config, out = tiny_setup
    cfg = yaml.safe_load(config.read_text())
    cfg["prep"] = {"regen": cfg["prep"] + ["labels=regenerate"], "tf": cfg["prep"]}
    cfg["heads"]["ctc_ce"]["cache"] = "tf"
    cfg.update(train_max_time=None, train_budget=["train.max_epochs=1", "train.max_steps=-1"],
               heads_to_run=["ctc", "ctc_ce"])
    config.write_text(yaml.safe_dump(cfg))
    assert compare.main(["--config", str(config), "--dry-run", "stages=[prep,train]"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[2] for ln in lines if ln.startswith("[run ]")] == ["prep-regen", "prep-tf", "train-ctc",
                                                                         "train-ctc_ce"]
    cmds = {ln.split()[2]: lines[i + 1] for i, ln in enumerate(lines) if ln.startswith("[run ]")}
    assert f"prep.cache_dir={out / 'caches' / 'regen'}" in cmds["prep-regen"] and "labels=regenerate" in cmds["prep-regen"]
    assert f"prep.cache_dir={out / 'caches' / 'tf'}" in cmds["prep-tf"]
    assert f"train.cache_dir={out / 'caches' / 'regen'}" in cmds["train-ctc"]
    assert f"train.cache_dir={out / 'caches' / 'tf'}" in cmds["train-ctc_ce"]
    for name in ("train-ctc", "train-ctc_ce"):
        assert "train.max_epochs=1 train.max_steps=-1" in cmds[name] and "train.max_time" not in cmds[name]
    assert not out.exists()
    assert compare.main(["--config", str(config), "heads.ctc_ce.cache=nope"]) == 2
    assert "heads.ctc_ce.cache='nope': not a cache of prep (have regen, tf)" in capsys.readouterr().err
    assert compare.main(["--config", str(config), "train_budget=[]"]) == 2
    assert "no training budget" in capsys.readouterr().err
    # a cache no selected head trains on is not built
    assert compare.main(["--config", str(config), "--dry-run", "stages=[prep]", "heads_to_run=[ctc_ce]"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[2] for ln in lines if ln.startswith("[run ]")] == ["prep-tf"]
    assert "[compare] prep-regen: skipped, no head in heads_to_run trains on cache 'regen'" in lines


def test_record_config_dry_run(tmp_path, capsys):
    """configs/record.yaml (issue 27) loads and plans two caches, one epoch per head, one head at a
    time, log-spaced validation and every head evaluated on all 80 questions (a stand-in prompts file:
    the record's MT-bench path is relative to the repository's parent).  The output directory is a fresh
    one: the record's own (outputs/record) holds whatever stages this checkout already ran."""
    mt = tmp_path / "mt.jsonl"
    mt.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Hi.", "More."]}) + "\n")
    assert compare.main(["--config", str(ROOT / "configs" / "record.yaml"), "--dry-run", f"eval.prompts={mt}",
                         f"output_dir={tmp_path / 'record'}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ran = [ln.split()[2] for ln in lines if ln.startswith("[run ]")]
    assert ran[:2] == ["prep-teacher_forced", "prep-regenerated"]
    assert [r for r in ran if r.startswith("train-")] == ["train-falcon_k1", "train-eagle3", "train-eagle3_ttt3",
                                                          "train-ctc", "train-ctc_ce", "train-falcon", "train-adadecode", "train-falcon_k1_regen"]
    cmds = {ln.split()[2]: lines[i + 1] for i, ln in enumerate(lines[:-1]) if ln.startswith("[run ]")}
    assert "labels=regenerate" in cmds["prep-regenerated"] and "prep.dtype=float8_e4m3fn" in cmds["prep-regenerated"]
    # sized to fit 24 hours of 2 cores (docs/training.md "What the one command costs"), both caches alike
    for stage in ("prep-teacher_forced", "prep-regenerated", "train-falcon_k1", "train-falcon_k1_regen"):
        assert "data.max_conversations=9200 data.max_length=512" in cmds[stage]
    assert "prep.gen_batch_size=16" in cmds["prep-regenerated"] and "gen_batch_size" not in cmds["prep-teacher_forced"]
    assert "train.val_schedule=log" in cmds["train-eagle3"] and "train.max_epochs=1" in cmds["train-eagle3"]
    assert "caches/regenerated" in cmds["train-falcon_k1_regen"] and "caches/teacher_forced" in cmds["train-ctc"]
    assert "heads.loss=ce" in cmds["train-ctc_ce"] and "heads=ctc " in cmds["train-ctc_ce"]
    assert "heads.ttt_steps=3" in cmds["train-eagle3_ttt3"] and "heads.ttt_steps" not in cmds["train-eagle3"]


def test_heads_without_a_validation_tau_do_not_stop_the_summary(tmp_path, capsys):
    """AdaDecode is monitored by its loss: a comparison of such heads alone has no τ curve to draw,
    which is said ([skip]) and must not raise before summary.md is written."""
    mt = tmp_path / "mt.jsonl"  # the config's MT-bench path lies outside the repository
    mt.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Hi.", "More."]}) + "\n")
    cfg = compare.load_config(ROOT / "configs" / "compare.yaml",
                              [f"output_dir={tmp_path}", "heads_to_run=[adadecode]", f"eval.prompts={mt}"])
    driver = compare.Driver(cfg)
    run = driver.run_dir("adadecode")
    run.mkdir(parents=True)
    (run / "record.json").write_text(json.dumps(
        {"validations": [{"step": 1, "tokens_seen": 100, "metrics": {"loss": 2.0}}]}))
    assert driver.plot_val_curves(["adadecode"]) is None
    assert "[skip] validation τ curves: no validation τ" in capsys.readouterr().out
    assert driver.budget_table(["adadecode"]) is None
    assert "[skip] budget table: no run record with a validation τ" in capsys.readouterr().out
    assert not (tmp_path / "val_curves.png").exists()
    (run / "record.json").write_text(json.dumps(
        {"validations": [{"step": 1, "tokens_seen": 100, "metrics": {"loss": 2.0, "sim_tau": 1.2}}]}))
    assert driver.plot_val_curves(["adadecode"]) == tmp_path / "val_curves.png"
    assert "[done] validation τ curves of adadecode" in capsys.readouterr().out
    broken = driver.run_dir("ctc")  # a record cut off mid-write by hand: named, skipped, not a crash
    broken.mkdir(parents=True)
    (broken / "record.json").write_text('{"validations": [{"step": 1, "tokens_')
    assert driver.budget_table(["ctc", "adadecode"]) == tmp_path / "budget.md"
    assert driver.plot_val_curves(["ctc", "adadecode"]) == tmp_path / "val_curves.png"
    printed = capsys.readouterr().out
    assert "[skip] budget table: ctc:" in printed and "cannot read a run record" in printed
    assert "[skip] validation τ curves: ctc:" in printed
    assert "| adadecode |" in (tmp_path / "budget.md").read_text()
    driver.summarize(["adadecode"])  # trained, not evaluated yet: said, and no summary of nothing
    printed = capsys.readouterr().out
    assert "[skip] summary: adadecode has no evaluation report yet" in printed
    assert "[skip] summary: no head has an evaluation report yet (run the eval stage first); summary.md not written" \
        in printed and "[run ] summary" not in printed
    assert not (tmp_path / "summary.md").exists()


def test_stopping_the_driver_stops_its_stage_and_a_second_driver_is_refused(tmp_path, capsys):
    """Killing the driver left its training running alone (PPID 1), and a rerun would have started a second
    one into the same run folder."""
    import os
    import signal
    import subprocess
    import textwrap
    import time

    out = tmp_path / "cmp"
    (out / "stages").mkdir(parents=True)
    marker = tmp_path / "child_stopped"
    child = textwrap.dedent(f"""
        import signal, sys, time, pathlib
        def stop(signum, frame):
            pathlib.Path({str(marker)!r}).write_text(str(signum)); sys.exit(130)
        signal.signal(signal.SIGTERM, stop)
        print("handler " + "installed", flush=True)  # split: the log's command line must not match
        time.sleep(60)
    """)
    driver = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / 'scripts')!r}); sys.path.insert(0, {str(ROOT)!r})
        import compare
        from omegaconf import OmegaConf
        drv = compare.Driver(OmegaConf.create({{"output_dir": {str(out)!r}}}))
        with compare.driver_lock(drv.out):
            drv.run_stages([("long", [[sys.executable, "-c", {child!r}]])])
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], stderr=subprocess.PIPE, text=True)
    log = out / "logs" / "long.log"
    for _ in range(300):
        if log.is_file() and "handler installed" in log.read_text():
            break
        time.sleep(0.1)
    with pytest.raises(compare.UserInputError, match=r"another scripts/compare.py is running on .*cmp"):
        with compare.driver_lock(out):
            pass
    os.kill(proc.pid, signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert marker.read_text() == str(int(signal.SIGTERM))  # the stage got the signal and stopped itself
    assert "stopped by signal 15" in err and "error: stage long failed" in err and proc.returncode != 0
    assert not (out / "stages" / "long.done").exists()
    with compare.driver_lock(out):  # released with the driver
        pass
