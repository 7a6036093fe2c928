"""train.features=online under 2 processes (gloo, CPU): DDP and ZeRO-3 with 2 ranks equal 1 rank
accumulating 2 batches, as the offline set-up does (tests/test_distributed.py).  Every rank holds
the whole frozen base and runs it on its own batches; ZeRO-3 partitions only the head."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from _distributed_worker import run_one  # noqa: E402
from test_data_prep import _conversations  # noqa: E402
from test_distributed import launch  # noqa: E402

pytestmark = pytest.mark.slow  # multi-process, like tests/test_distributed.py (still in `make test`)

COMMON = ["labels=teacher_forced", "data.max_conversations=null", "data.heldout_fraction=0.25",
          "data.max_length=96", "prep.layers=[2]", "train.features=online", "train.batch_size=2",
          "train.max_steps=4", "train.val_every_n_steps=2", "train.scheduler.warmup_steps=1",
          "train.optimizer.lr=0.01", "train.grad_clip.value=0.05"]


def test_online_two_ranks_equal_one_rank_accumulating_two(tiny_model_dir, tiny_base, tmp_path):
    data = tmp_path / "data.json"
    data.write_text(json.dumps(_conversations(22)))
    common = ["--model-dir", str(tiny_model_dir), f"model.path={tiny_model_dir}", f"data.path={data}",
              f"output_root={tmp_path / 'out'}", *COMMON]
    plan = [["strategy=ddp", "train.run_name=ddp"], ["strategy=deepspeed_zero3", "train.run_name=zero3"]]
    launch(2, [*common, "--plan", json.dumps(plan)], tmp_path)
    run_one(str(tiny_model_dir), [*common[2:], "strategy=auto", "train.devices=1", "train.accumulate_grad_batches=2",
                                  "train.run_name=single"], base=tiny_base)
    runs = tmp_path / "out" / "runs" / "test_dist"
    single = load_file(runs / "single" / "last" / "model.safetensors")
    init = __import__("heads").build({"type": "test_dist", "init_seed": 0}, tiny_base[0]).trainable_state_dict()
    assert max(float((single[k] - init[k]).abs().max()) for k in init) > 1e-3  # training moved the weights
    for name in ("ddp", "zero3"):
        res = json.loads((runs / name / "result.json").read_text())
        assert res["world_size"] == 2 and res["global_step"] == 4
        w = load_file(runs / name / "last" / "model.safetensors")
        assert sorted(w) == sorted(single)
        for k in single:
            torch.testing.assert_close(w[k], single[k], rtol=1e-5, atol=1e-6, msg=f"{name} {k}")
