"""AdaDecode end to end on a tiny cache: `train` (Lightning, CSV logger) -> exported checkpoint ->
`evaluation` (parity vs vanilla greedy, AdaDecode stats)."""
from __future__ import annotations

import csv
import json

import pytest

from train.run import metrics_csv
import torch

import heads

LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def varied_base(tmp_path_factory):
    """A tiny Llama folder whose greedy output is varied (larger init), loaded like the real base."""
    from core.base_model import load_base_model
    from core.tiny import save_tiny_model

    d = save_tiny_model(tmp_path_factory.mktemp("tiny_varied"), seed=0, initializer_range=0.2)
    return d, load_base_model({"path": str(d), "dtype": "float32"})


def test_train_then_evaluate(varied_base, tmp_path):
    from core.config import compose
    from data_prep.synthetic import write_random_cache
    from evaluation.runner import run_evaluation
    from train.run import train

    model_dir, base = varied_base
    model = base[0]
    cache = tmp_path / "cache"
    write_random_cache(cache, model_dir, n_train=16, n_val=6, layers=LAYERS, length_range=(8, 24),
                       mask_start=lambda T, g: 2, shard_size=16)
    common = [f"model.path={model_dir}", "heads=adadecode", f"heads.layers={LAYERS}", "heads.val_gammas=[0.0,0.2]",
              f"output_root={tmp_path}"]
    cfg = compose(common + [
        "train.logger=csv", "train.progress_bar=false", "train.sanity_val_steps=0", f"train.cache_dir={cache}",
        "train.run_name=t", "train.log_every_n_steps=1", "train.accelerator=cpu", "train.devices=1",
        "train.batch_size=4", "train.max_steps=12", "train.val_every_n_steps=4", "train.scheduler.warmup_steps=1",
        "train.optimizer.lr=0.01"])
    result = train(cfg, base=base)
    rows = list(csv.DictReader(open(metrics_csv(result["run_dir"]))))
    vals = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(vals) == 3 and vals[-1] < vals[0]
    last = [r for r in rows if r.get("val/sim_cost")][-1]
    for key in ("val/exit_rate", "val/reject_rate", "val/layers_saved", "val/policy_g0_exit", "val/mismatch_l2_g0.2"):
        assert last.get(key), key
    assert float(last["val/policy_g0_exit"]) == 1.0  # γ = 0: every token exits
    meta = json.loads((result["run_dir"] / "best" / "config.json").read_text())
    assert meta["head"]["param_counts"]["per_head"] == model.config.hidden_size ** 2
    loaded, _ = heads.load(result["run_dir"] / "best", base_model=model)
    assert not torch.equal(loaded.transforms["1"].weight, torch.eye(model.config.hidden_size))

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": t}) for i, t in
                                 enumerate(["Hello! How can I help you today?", "def add(a, b):", "The quick brown fox"])))
    ecfg = compose(common + [f"eval.checkpoint={result['run_dir'] / 'best'}", f"eval.prompts={prompts}",
                             "eval.max_new_tokens=24", "eval.gamma=0.0", "eval.max_inflight=3", "eval.warmup=0",
                             f"eval.output_dir={tmp_path / 'eval'}"])
    report = run_evaluation(ecfg, base=base)
    assert report["parity"] == {"matched": 3, "total": 3, "mismatched_ids": [], "checked": True}
    from core.io import sha256_file  # the head's identity in the report: summaries pair runs by it

    assert report["checkpoint_sha256"] == sha256_file(result["run_dir"] / "best" / "model.safetensors")
    summary = report["method"]["decoder_summary"]
    assert summary["early_exits"] > 0 and summary["gammas"] == {"1": 0.0, "2": 0.0, "3": 0.0}
    assert summary["max_inflight"] == 3
    assert summary["accepted_exits"] + summary["rejected_exits"] <= summary["early_exits"]
    tokens = sum(r["method_tokens"] for r in report["per_prompt"])
    assert summary["new_tokens"] == tokens
    assert summary["early_exit_rate"] == pytest.approx(summary["accepted_exits"] / tokens)
    assert summary["exit_attempt_rate"] == pytest.approx((summary["accepted_exits"] + summary["rejected_exits"]) / tokens)


def test_cache_without_the_head_layers_fails_before_training(varied_base, tmp_path):
    from core.config import UserInputError, compose
    from data_prep.synthetic import write_random_cache
    from train.run import train

    model_dir, base = varied_base
    cache = write_random_cache(tmp_path / "cache", model_dir, n_train=4, n_val=2, layers=[1])
    cfg = compose([f"model.path={model_dir}", "heads=adadecode", "heads.layers=[1,2]", f"output_root={tmp_path}",
                   f"train.cache_dir={cache}", "train.logger=csv", "train.run_name=t", "train.accelerator=cpu",
                   "train.devices=1", "train.max_steps=2"])
    with pytest.raises(UserInputError, match=r"reads hidden states hs\[2\] but cache \S+ holds layers \[1\]; "
                                             r"prepare a cache with prep.layers=\[1,2\] "
                                             r"\(python -m data_prep prep.layers=\[1,2\] \.\.\.\)"):
        train(cfg, base=base)  # the suggested override is one shell word, pasteable as printed
    assert not (tmp_path / "runs" / "adadecode" / "t" / "checkpoints").exists()
