"""Issue 31 item 2 on the tiny model: when eval.tree picks the root alone, the report says so plainly
and also gives what the head gives at a small fixed probe tree (decoded on the same prompts, parity
checked), and acceptance.png labels every head type correctly."""
from __future__ import annotations

import json

import torch

import heads
from core.config import compose
from decoding.tree_search import AcceptanceStats
from evaluation.__main__ import rewrite_argv
from evaluation.plots import make_figure, no_acceptance_text
from evaluation.report import format_summary
from evaluation.runner import run_evaluation


def _run(tiny_base, tiny_model_dir, tmp_path, sharegpt, head, *extra):
    cfg = compose(rewrite_argv([f"model.path={tiny_model_dir}", "model.attn_implementation=eager", f"heads={head}",
                                f"output_root={tmp_path / 'root'}", f"eval.output_dir={tmp_path / 'out'}",
                                f"data.path={sharegpt}", "data.heldout_fraction=0.3", "eval.num_prompts=2",
                                "eval.max_new_tokens=10", "eval.warmup=0", "eval.calibration_prompts=3",
                                "eval.tree_grid=[1,2,4,8]", "eval.cost_context_tokens=8",
                                f"checkpoint={tmp_path / 'ckpt'}", *extra]))
    torch.manual_seed(0)
    heads.save(heads.build(cfg.heads, tiny_base[0]), tmp_path / "ckpt", tiny_base[2].to_dict())
    return run_evaluation(cfg, base=tiny_base)


def test_root_alone_is_said_plainly_and_the_head_is_probed_at_a_small_tree(tiny_base, tiny_model_dir, tmp_path,
                                                                           sharegpt, monkeypatch):
    """A Falcon calibration that accepted nothing: auto's rank DP picks the root alone (τ 1 by
    construction).  The head is also decoded at the 4-node probe tree (its top-1 chain, since
    nothing was accepted): parity checked, τ and speedup measured and shown in the console line,
    summary.md and acceptance.png."""
    monkeypatch.setattr(AcceptanceStats, "rank_acceptance", lambda self: [])
    rep = _run(tiny_base, tiny_model_dir, tmp_path, sharegpt, "falcon")
    tree = rep["tree"]
    assert tree["chosen"]["nodes"] == 1 and rep["tau"] == 1.0 and rep["method"]["totals"]["drafter_passes"] == 0
    probe = tree["probe"]
    assert probe["nodes"] == 4 and probe["depth"] == 3 and "top-1 chain" in probe["shape"]
    assert probe["parity"] == {"matched": 2, "total": 2, "mismatched_ids": []}
    assert probe["measured_tau"] >= 1.0 and probe["measured_speedup"] > 0 and probe["drafter_passes_per_step"] > 0
    assert len(probe["acceptance_per_depth"]) == 3
    text = format_summary(rep)
    assert "the root alone" in text and "does not test the head" in text and "4-node probe tree" in text
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "chose the root alone" in md and "4-node probe tree" in md
    fig = make_figure(rep)
    assert "4-node probe tree" in fig.axes[0].get_title()


def test_fallback_root_alone_probes_the_best_small_budget_and_labels_ctc_right(tiny_base, tiny_model_dir, tmp_path,
                                                                              sharegpt, monkeypatch):
    """CTC with eval.tree_fallback and every tree predicted slower: decoding drafts nothing; the probe
    is the best 4-node budget by the same calibration; the plot never calls CTC a non-tree decoder."""
    import evaluation.tree_auto as tree_auto

    real = tree_auto.load_or_measure

    def dear(*a, **k):
        cost = real(*a, **k)
        cost.verify_ms = [1000.0 + 2000.0 * (n - 1) for n in cost.sizes]
        return cost

    monkeypatch.setattr(tree_auto, "load_or_measure", dear)
    monkeypatch.setattr(AcceptanceStats, "budget_tau", lambda self: {1: 1.0, 2: 1.5, 4: 1.8, 8: 2.0})
    rep = _run(tiny_base, tiny_model_dir, tmp_path, sharegpt, "ctc", "eval.tree_fallback=true")
    tree = rep["tree"]
    assert tree["chosen"]["fallback"] == "vanilla" and tree["probe"]["nodes"] == 4
    assert tree["probe"]["decoding"] == {"max_nodes": 4} and tree["probe"]["predicted_tau"] == 1.8
    assert tree["probe"]["parity"]["matched"] == 2
    label = no_acceptance_text({**rep, "tree": {**tree, "probe": None}})
    assert "non-tree" not in label and "root alone" in label and "ctc" in label


def test_no_acceptance_labels_name_the_decoder_kind():
    tree_rep = {"head_type": "ctc", "method": {"totals": {"tree_nodes": 0}}, "tree": {"chosen": {"nodes": 4}}}
    assert "no verified tree held a draft token" in no_acceptance_text(tree_rep)
    other = {"head_type": "adadecode", "method": {"totals": {"new_tokens": 9}}}
    assert "adadecode drafts no token tree" in no_acceptance_text(other)


def test_demo_evaluates_at_a_tree_that_exercises_the_head(tmp_path):
    """scripts/demo.sh (a stand-in python records the stages' arguments): the evaluation fixes an
    8-node tree from the default grid (never the root alone) and the script says which and why."""
    import os
    import subprocess
    from pathlib import Path

    log = tmp_path / "calls.jsonl"
    fake = tmp_path / "py"
    fake.write_text(f"#!/usr/bin/env python3\nimport json, sys\nopen({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    fake.chmod(0o755)
    script = Path(__file__).resolve().parent.parent / "scripts" / "demo.sh"
    out = subprocess.run(["bash", str(script)], env={**os.environ, "PY": str(fake)}, capture_output=True, text=True,
                         check=True).stdout
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    ev = compose(rewrite_argv(calls[-1][2:])).eval
    assert calls[-1][:2] == ["-m", "evaluation"] and ev.tree == "auto" and ev.tree_nodes == 8
    assert 8 in list(ev.tree_grid)
    assert "8-node tree" in out and "exercises the head" in out
