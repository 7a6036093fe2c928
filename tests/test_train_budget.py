"""train.max_time: a wall-clock budget that stops training and survives resume (issue 18)."""
from __future__ import annotations

import json

import pytest

from core.config import ConfigError, compose
from tests.test_train import ProbeHead, _cfg, tiny_cache  # noqa: F401  (registers the probe head; fixture)


def test_max_time_stops_training_and_is_kept_on_resume(tiny_base, tiny_cache, tmp_path):  # noqa: F811
    from train.checkpoint_io import SafetensorsCheckpointIO
    from train.run import train

    common = dict(batch_size=4, max_steps=100000, val_every_n_steps=6, save_top_k=1, max_time=2.0)
    res = train(_cfg(tmp_path, tiny_cache, **common), base=tiny_base)
    trainer = res["trainer"]
    steps = trainer.global_step
    assert 6 <= steps < 100000  # stopped by the clock, not the step budget
    timer = next(c for c in trainer.callbacks if type(c).__name__ == "Timer")
    assert timer.time_elapsed("train") >= 2.0
    assert (res["run_dir"] / "last" / "model.safetensors").is_file()
    extra = json.loads((res["run_dir"] / "last" / "config.json").read_text())["extra"]
    assert extra["train_seconds"] == pytest.approx(timer.time_elapsed("train"), abs=0.5) and extra["global_step"] == steps
    ckpt = SafetensorsCheckpointIO().load_checkpoint(res["run_dir"] / "checkpoints" / "last.ckpt")
    saved = next(v for k, v in ckpt["callbacks"].items() if "Timer" in k)["time_elapsed"]["train"]
    assert saved > 0
    # resuming (the budget cannot change on resume) continues the clock: the spent budget stops the
    # run at once instead of granting another max_time
    more = train(_cfg(tmp_path, tiny_cache, **common), base=tiny_base,
                 ckpt_path=str(res["run_dir"] / "checkpoints" / "last.ckpt"))
    t2 = next(c for c in more["trainer"].callbacks if type(c).__name__ == "Timer")
    assert t2.time_elapsed("train") >= saved
    assert more["trainer"].global_step - ckpt["global_step"] <= 1


@pytest.mark.parametrize("bad", ["train.max_time=0", "train.max_time=-5", "train.max_time=soon"])
def test_bad_max_time_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="train.max_time"):
        compose([bad])
