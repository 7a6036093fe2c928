"""Training to convergence, the training side (issue 27): validation log-spaced in tokens seen and
resumable, ``best/`` chosen by validation τ (not by loss), the run record and the τ plot."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.config import ConfigError, compose


@pytest.fixture(scope="module")
def cache(tiny_model_dir, tmp_path_factory):
    from data_prep.synthetic import write_random_cache

    return write_random_cache(tmp_path_factory.mktemp("vs") / "cache", tiny_model_dir, n_train=10, n_val=3,
                              length_range=(6, 30))


def _args(cache, out, name, *extra):
    return ["heads=ctc", "heads.attn_implementation=eager", "train.logger=csv", "train.progress_bar=false",
            "train.sanity_val_steps=0", f"output_root={out}", f"train.cache_dir={cache}", f"train.run_name={name}",
            "train.accelerator=cpu", "train.devices=1", "train.batch_size=2", "train.max_tokens=40", *extra]


def _replayed_tokens(result) -> list[int]:
    """Tokens seen after each optimizer step, replayed from the sampler (train.data.tokens_seen)."""
    from train.data import record_lengths, tokens_seen

    trainer = result["trainer"]
    dm = trainer.datamodule
    lengths = record_lengths(dm.train_reader)
    return [tokens_seen(lengths, dm.train_batches, s, seed=0) for s in range(trainer.global_step + 1)]


def test_next_threshold_and_due_rule():
    from train.val_schedule import log_due, next_threshold

    assert next_threshold(100, 99, 2.0) == 100
    assert next_threshold(100, 100, 2.0) == 200 and next_threshold(100, 450, 2.0) == 800
    assert next_threshold(1, 1, 1.01) == 2  # always grows by at least one token
    assert log_due(100, 100, 3, 0, 50, 10) and not log_due(99, 100, 3, 0, 50, 10)
    assert log_due(0, 100, 50, 0, 50, 1000)  # at most every_n_steps apart
    assert log_due(0, 100, 10, 9, 50, 10)  # the last step
    with pytest.raises(ValueError):
        next_threshold(10, 0, 1.0)


@pytest.mark.parametrize("args,message", [
    (["train.val_schedule=often"], "train.val_schedule"),
    (["train.val_factor=1"], "train.val_factor=1 must be a number > 1"),
    (["train.val_first_tokens=0"], "train.val_first_tokens=0 must be an integer >= 1"),
    (["train.save_top_k=0"], "train.save_top_k=0 must be an integer >= 1, or -1"),
    (["train.verify_cache=never"], "train.verify_cache"),
])
def test_bad_schedule_values_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        compose(args)
    compose(["train.save_top_k=-1", "train.val_schedule=log", "train.verify_cache=full"])


def test_runs_recorded_before_the_schedule_keys_still_resume():
    from train.resume import changed_run_keys

    now = {"train": {"val_schedule": "steps", "val_first_tokens": 32768, "val_factor": 2.0, "max_steps": 5}}
    assert changed_run_keys({"train": {"max_steps": 5}}, now) == {}
    now["train"]["val_schedule"] = "log"
    assert set(changed_run_keys({"train": {"max_steps": 5}}, now)) == {"train.val_schedule"}


def test_best_is_the_highest_tau_checkpoint_while_the_loss_keeps_falling(tiny_base, cache, tmp_path, monkeypatch):
    """Planted validation metrics: the loss falls at every validation, τ peaks at the third and then
    falls (EAGLE-3's curve).  best/ must be the τ peak's checkpoint, not the lowest loss; the record
    lists every validation with the tokens the sampler really fed."""
    from safetensors.torch import load_file

    from train.checkpoint_io import SafetensorsCheckpointIO
    from train.module import DraftHeadModule
    from train.run import train

    planted = {2: (5.0, 1.10), 4: (4.0, 1.60), 6: (3.0, 1.40), 8: (2.0, 1.20)}

    def planted_validation(self):
        loss, tau = planted[int(self.global_step)]
        return {"loss": loss, "sim_tau": tau}

    monkeypatch.setattr(DraftHeadModule, "aggregated_validation", planted_validation)
    result = train(compose(_args(cache, tmp_path, "planted", "train.max_steps=8", "train.val_every_n_steps=2",
                                 "train.save_top_k=-1", "train.optimizer.lr=0.01")), base=tiny_base)
    run_dir = result["run_dir"]
    best = json.loads((run_dir / "best" / "config.json").read_text())["extra"]
    assert best["global_step"] == 4 and best["score"] == pytest.approx(1.60) and best["monitor"] == "val/sim_tau"
    in_ckpt = SafetensorsCheckpointIO().load_checkpoint(run_dir / "checkpoints" / "step0000004.ckpt")["state_dict"]
    exported, last = load_file(run_dir / "best" / "model.safetensors"), load_file(run_dir / "last" / "model.safetensors")
    for k, v in exported.items():
        assert torch.equal(v, in_ckpt[f"head.{k}"]), k
    assert any(not torch.equal(exported[k], last[k]) for k in exported)  # not the final (lowest-loss) weights
    record = json.loads((run_dir / "record.json").read_text())
    tokens = _replayed_tokens(result)
    assert [(v["step"], v["metrics"]["loss"], v["metrics"]["sim_tau"], v["tokens_seen"]) for v in record["validations"]] \
        == [(s, loss, tau, tokens[s]) for s, (loss, tau) in planted.items()]
    assert record["best"]["step"] == 4 and record["monitor"] == "val/sim_tau" and record["tokens_seen"] == tokens[8]
    assert record["checkpoints"] == [f"step{s:07d}.ckpt" for s in planted]  # save_top_k=-1 keeps every one
    assert (run_dir / "val_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_log_schedule_follows_tokens_seen_and_survives_resume(tiny_base, tiny_model_dir, cache, tmp_path):
    """val_schedule=log validates where the replayed tokens seen first reach first·2^k, at most
    every_n_steps apart and at the last step; a run killed mid-way and resumed validates at the
    same steps with the same counts."""
    from lightning.pytorch.callbacks import Callback

    import train.run as run_mod
    from train.run import train

    extra = ("train.max_steps=14", "train.val_every_n_steps=6", "train.val_schedule=log", "train.val_first_tokens=30",
             "train.val_factor=2.0")
    full = train(compose(_args(cache, tmp_path, "full", *extra)), base=tiny_base)
    tokens = _replayed_tokens(full)
    expected, threshold, last = [], 30, 0
    for s in range(1, 15):
        if tokens[s] >= threshold or s - last >= 6 or s == 14:
            expected.append(s)
            last = s
            while threshold <= tokens[s]:
                threshold *= 2
    record = json.loads((full["run_dir"] / "record.json").read_text())
    assert [v["step"] for v in record["validations"]] == expected
    assert [v["tokens_seen"] for v in record["validations"]] == [tokens[s] for s in expected]
    assert len(expected) >= 4 and expected[-1] == 14  # dense early, then every <= 6 steps

    crash_at = expected[2] + 1  # killed after the third validation's checkpoint

    class Crash(RuntimeError):
        pass

    class CrashAfter(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step >= crash_at:
                raise Crash

    original = run_mod.build_trainer
    run_mod.build_trainer = lambda cfg, run_dir, callbacks=None, **kw: original(cfg, run_dir, [*(callbacks or []),
                                                                                             CrashAfter()], **kw)
    try:
        with pytest.raises(Crash):
            train(compose(_args(cache, tmp_path, "part", *extra)), base=tiny_base)
    finally:
        run_mod.build_trainer = original
    part_record = json.loads((tmp_path / "runs" / "ctc" / "part" / "record.json").read_text())
    assert [v["step"] for v in part_record["validations"]] == [s for s in expected if s <= crash_at]
    resumed = train(compose(_args(cache, tmp_path, "part", *extra, "resume=auto")), base=tiny_base)
    again = json.loads((resumed["run_dir"] / "record.json").read_text())
    assert [(v["step"], v["tokens_seen"]) for v in again["validations"]] == \
        [(v["step"], v["tokens_seen"]) for v in record["validations"]]
    assert again["tokens_seen"] == record["tokens_seen"] == tokens[14]
    # wall-clock in training batches: rising at every validation, and the resumed run keeps the killed
    # run's seconds (its first validations are the killed run's own entries, later ones add to them)
    for rec in (record, again):
        seconds = [v["train_seconds"] for v in rec["validations"]]
        assert all(b > a > 0 for a, b in zip(seconds, seconds[1:])) and rec["train_seconds"] >= seconds[-1]
    before = [v["train_seconds"] for v in part_record["validations"]]
    assert [v["train_seconds"] for v in again["validations"][:len(before)]] == before
    assert again["validations"][len(before)]["train_seconds"] > before[-1]
    # the share of the machine that clock ran on, kept across the resume (train.budget compares on it)
    for rec in (record, part_record, again):
        assert rec["threads"] == [torch.get_num_threads()] and rec["world_size"] == [1]


def test_learning_curves_of_several_heads_share_one_plot(tmp_path):
    """plot_curves draws every run with a validation τ (a run without one is left out) and refuses
    records with no τ at all, naming the runs."""
    from train.val_schedule import plot_curves

    def rec(taus):
        return {"validations": [{"step": k + 1, "tokens_seen": 1000 * 2 ** k, "metrics": {"loss": 1.0, "sim_tau": t}}
                                for k, t in enumerate(taus)]}

    no_tau = {"validations": [{"step": 1, "tokens_seen": 10, "metrics": {"loss": 2.0}}]}
    drawn = plot_curves({"ctc": rec([1.1, 1.3, 1.5]), "adadecode": no_tau, "eagle3": rec([1.0, 1.2]),
                         "planted": {"validations": []}}, tmp_path / "curves.png")
    assert drawn == ["ctc", "eagle3"]
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="adadecode"):
        plot_curves({"adadecode": no_tau}, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_train_seconds_unknown_after_resuming_a_checkpoint_without_them():
    """A checkpoint written before train_seconds was recorded resumes with the time unknown (None),
    never with a count that silently starts at the resume; a fresh run starts at zero."""
    from train.val_schedule import ValidationSchedule

    sched = ValidationSchedule("log", 10, 32, 2.0)
    sched.load_state_dict({"tokens_seen": 500, "threshold": 512, "last_val_step": 3, "validations": []})
    assert sched.train_seconds is None and sched.state_dict()["train_seconds"] is None
    sched.on_train_batch_start(None, None, {}, 0)
    assert sched.train_seconds is None
    fresh = ValidationSchedule("log", 10, 32, 2.0)
    fresh.load_state_dict({"tokens_seen": 0, "validations": []})
    assert fresh.train_seconds == 0.0
    fresh.load_state_dict({"tokens_seen": 500, "train_seconds": 12.5, "validations": []})
    assert fresh.train_seconds == 12.5


def test_machine_share_is_unknown_after_resuming_a_checkpoint_without_it_and_kept_per_segment():
    """A checkpoint written before threads / world_size were kept resumes with them unknown (None in
    the record), never claiming the resumed segment's share for the steps before it; a checkpoint that
    kept world_size as one int adds each new segment's rank count to a list."""
    from types import SimpleNamespace

    import torch

    from train.val_schedule import ValidationSchedule

    def resume(state, world_size):
        sched = ValidationSchedule("log", 10, 32, 2.0)
        sched.load_state_dict(state)
        sched.on_train_start(SimpleNamespace(world_size=world_size, max_steps=100), SimpleNamespace())
        return sched

    base = {"tokens_seen": 500, "threshold": 512, "last_val_step": 3, "validations": [], "train_seconds": 4.0}
    old = resume(base, 1)
    assert old.record()["threads"] is None and old.record()["world_size"] is None
    assert old.state_dict()["threads"] is None and old.state_dict()["world_size"] is None
    again = resume(old.state_dict(), 1)  # and it stays unknown across later resumes
    assert again.record()["threads"] is None and again.record()["world_size"] is None
    n = torch.get_num_threads()
    one_int = resume(dict(base, threads=[n], world_size=1), 2)
    assert one_int.record()["threads"] == [n] and one_int.record()["world_size"] == [1, 2]
    fresh = resume({}, 1)
    assert fresh.record()["threads"] == [n] and fresh.record()["world_size"] == [1]


def test_best_survives_a_run_folder_moved_between_launches(tiny_base, cache, tmp_path, monkeypatch):
    """Lightning forgets the top-k scores when a checkpoint's dirpath is not the run's: a run moved (or
    renamed) and resumed made the first validation after the resume best/, whatever its τ."""
    from train.module import DraftHeadModule
    from train.run import train

    planted = {2: 1.60, 4: 1.20, 6: 1.30, 8: 1.10}
    monkeypatch.setattr(DraftHeadModule, "aggregated_validation",
                        lambda self: {"loss": 1.0, "sim_tau": planted[int(self.global_step)]})
    common = ["train.val_every_n_steps=2", "train.save_top_k=-1", "train.optimizer.lr=0.01"]
    first = train(compose(_args(cache, tmp_path, "first", "train.max_steps=8", *common)), base=tiny_base)["run_dir"]
    # as if stopped after step 4: its checkpoint is the last one, the later ones and the exports are gone
    import shutil

    ckpts = first / "checkpoints"
    shutil.copy(ckpts / "step0000004.ckpt", ckpts / "last.ckpt")
    for gone in (ckpts / "step0000006.ckpt", ckpts / "step0000008.ckpt", first / "best", first / "last"):
        shutil.rmtree(gone) if gone.is_dir() else gone.unlink()
    moved = first.parent / "moved"
    first.rename(moved)
    result = train(compose(_args(cache, tmp_path, "moved", "train.max_steps=8", "resume=auto", *common)), base=tiny_base)
    assert result["run_dir"] == moved and result["trainer"].global_step == 8
    best = json.loads((moved / "best" / "config.json").read_text())["extra"]
    assert best["global_step"] == 2 and best["score"] == pytest.approx(1.60)
    assert Path(best["source"]).parent == moved / "checkpoints"
    record = json.loads((moved / "record.json").read_text())
    assert record["best"]["step"] == 2
