"""The finite-value guard across ranks (issue 28, item 1): a NaN on one rank stops every rank.

In process: the agreement itself (a rank whose own values are finite still stops when another
rank's flag is set, with the same message).  Two processes (one launch, about 20 s):
a NaN in rank 1's micro-batch features under DDP, and a NaN in one element of rank 1's gradient
while the loss stays finite under DeepSpeed ZeRO-3 (where DeepSpeed would skip the update with a
log line only), each end both ranks with the same :class:`core.finite.NonFiniteError` naming the step
and rank 1's conversations, instead of leaving rank 0 waiting in a collective.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from core.finite import NonFiniteError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def test_a_rank_with_finite_values_stops_when_another_rank_is_not_finite(monkeypatch):
    """Rank 0's batch is finite, rank 1's is not: rank 0 raises too, naming rank 1 and its conversations."""
    from train import finite

    class Strategy:
        root_device = torch.device("cpu")

        def reduce(self, t, reduce_op):  # the max over rank 0 (this process) and rank 1 (flag set)
            assert reduce_op == "max"
            return torch.maximum(t, torch.ones_like(t))

    trainer = SimpleNamespace(world_size=2, strategy=Strategy(), global_step=4, current_epoch=1)
    rank1 = {"bad": True, "detail": "micro-batch 1: loss nan", "window": [["c7", "c9"], ["c2"]]}
    monkeypatch.setattr(finite, "_gather", lambda obj, tr: [obj, rank1])
    with pytest.raises(NonFiniteError, match=r"non-finite training batch in optimizer step 5 \(epoch 1\): rank 1: "
                                             r"micro-batch 1: loss nan, conversations \[\['c7', 'c9'\], \['c2'\]\]"):
        finite.check_window("training batch", trainer, False, "", [["c1", "c3"]])
    trainer.strategy.reduce = lambda t, reduce_op: t  # nobody's flag set: no stop
    finite.check_window("training batch", trainer, False, "", [["c1"]])


@pytest.fixture(scope="module")
def cache(tiny_model_dir, tmp_path_factory):
    from data_prep.synthetic import write_random_cache

    return write_random_cache(tmp_path_factory.mktemp("nf_dist") / "cache", tiny_model_dir, n_train=12, n_val=4,
                              layers=[1, 2, 3], length_range=(6, 14), shard_size=8)


def test_a_non_finite_value_on_one_rank_stops_every_rank(cache, tiny_model_dir, tmp_path):
    from test_resume_distributed import HEAD_ARGS, _launch

    cases = {"ddp": ("batch", "training batch"), "deepspeed_zero3": ("grad", "gradient")}
    plan = [{"overrides": [*HEAD_ARGS["falcon"], f"strategy={s}", f"train.run_name=nf-{s}"],
             "poison": {"kind": kind, "rank": 1, "step": 2}, "expect_error": str(tmp_path / s)}
            for s, (kind, _) in cases.items()]
    common = ["--model-dir", str(tiny_model_dir), f"output_root={tmp_path / 'out'}", f"train.cache_dir={cache}",
              "train.batch_size=2", "train.max_steps=4", "train.val_every_n_steps=2", "train.scheduler.warmup_steps=1"]
    _launch([*common, "--plan", json.dumps(plan)], tmp_path)
    for s, (_, what) in cases.items():
        messages = [Path(f"{tmp_path / s}.rank{r}.txt").read_text() for r in (0, 1)]
        assert messages[0] == messages[1], s  # one agreed error on every rank
        assert messages[0].startswith(f"non-finite {what} in optimizer step 2 ") and "rank 1: " in messages[0], messages[0]
        assert "conversations [[" in messages[0], messages[0]
        if s == "ddp":  # rank 0's own batch was finite; under ZeRO-3 the norm DeepSpeed all-reduces is everyone's
            assert "rank 0: " not in messages[0], messages[0]
        assert not (tmp_path / "out" / "runs" / "falcon" / f"nf-{s}" / "last").exists()
