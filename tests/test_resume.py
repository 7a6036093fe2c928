"""Exact resume (``resume=auto|<path>``): optimizer, LR schedule, RNG and data-loader position.

Single process here (in-process, crash by exception); the two-process ZeRO-3 kill / resume is in
tests/test_distributed.py.  8 steps over 6 batches per epoch, interrupted after step 4's
checkpoint, so the resumed run must continue mid-epoch and then cross into epoch 1.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from _distributed_worker import run_one, write_tiny_cache  # noqa: E402

COMMON = ["train.batch_size=4", "train.max_steps=8", "train.val_every_n_steps=4", "train.scheduler.warmup_steps=3",
          "train.optimizer.lr=0.01", "train.devices=1", "strategy=auto"]


class Crash(RuntimeError):
    pass


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tiny_base, tmp_path_factory):
    work = tmp_path_factory.mktemp("resume")
    cache = write_tiny_cache(work / "cache", tiny_model_dir)
    return work, cache


def _run(work, cache, tiny_model_dir, tiny_base, name, extra=(), crash_at=None):
    import train.run as run_mod
    from lightning.pytorch.callbacks import Callback

    overrides = [*COMMON, f"output_root={work / 'out'}", f"train.cache_dir={cache}", f"train.run_name={name}", *extra]
    if crash_at is None:
        run_one(str(tiny_model_dir), overrides, base=tiny_base)
        return work / "out" / "runs" / "test_dist" / name

    class CrashAfter(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step >= crash_at:
                raise Crash(f"simulated kill after step {crash_at}")

    original = run_mod.build_trainer

    def build_with_crash(cfg, run_dir, callbacks=None, **kwargs):
        return original(cfg, run_dir, [*(callbacks or []), CrashAfter()], **kwargs)

    run_mod.build_trainer = build_with_crash
    try:
        with pytest.raises(Crash):
            run_one(str(tiny_model_dir), overrides, base=tiny_base)
    finally:
        run_mod.build_trainer = original
    return work / "out" / "runs" / "test_dist" / name


def test_resume_auto_is_exact_across_the_epoch_boundary(setup, tiny_model_dir, tiny_base):
    work, cache = setup
    full = _run(work, cache, tiny_model_dir, tiny_base, "full")
    part = _run(work, cache, tiny_model_dir, tiny_base, "part", crash_at=4)
    ckpt = part / "checkpoints" / "last.ckpt"
    assert ckpt.is_file() and not (part / "result.json").exists()
    from train.checkpoint_io import SafetensorsCheckpointIO

    state = SafetensorsCheckpointIO().load_checkpoint(ckpt)
    assert state["global_step"] == 4
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "consumed": 4}]
    assert "rng_states" in state and state["lr_schedulers"][0]["last_epoch"] == 4
    # no temp files left next to the checkpoint (atomic writes)
    assert not [p for p in ckpt.parent.iterdir() if p.name.endswith(".tmp")]

    resumed = _run(work, cache, tiny_model_dir, tiny_base, "part", extra=["resume=auto"])
    assert resumed == part
    a = load_file(full / "last" / "model.safetensors")
    b = load_file(part / "last" / "model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    import json

    ra, rb = (json.loads((d / "result.json").read_text()) for d in (full, part))
    assert ra["global_step"] == rb["global_step"] == 8 and ra["loss"] == rb["loss"]


def test_resume_without_the_data_position_would_differ(setup, tiny_model_dir, tiny_base):
    """Control: resuming from the same checkpoint but restarting the epoch's data gives other weights,
    so the exactness above really depends on the restored data-loader position."""
    import train.data as data_mod

    work, cache = setup
    full = work / "out" / "runs" / "test_dist" / "full"
    if not (full / "last").is_dir():
        pytest.skip("needs the full run of the previous test")
    part = _run(work, cache, tiny_model_dir, tiny_base, "part2", crash_at=4)
    original = data_mod.ShardedBatchSampler.load_state_dict
    data_mod.ShardedBatchSampler.load_state_dict = lambda self, state: None  # forget the position
    try:
        _run(work, cache, tiny_model_dir, tiny_base, "part2", extra=["resume=auto"])
    finally:
        data_mod.ShardedBatchSampler.load_state_dict = original
    a = load_file(full / "last" / "model.safetensors")
    b = load_file(part / "last" / "model.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_resolve_resume(tmp_path):
    from omegaconf import OmegaConf

    from train.resume import resolve_resume
    from train.run import run_dir_for

    def cfg(resume, run_name=None):
        return OmegaConf.create({"resume": resume, "output_root": str(tmp_path), "heads": {"type": "ctc"},
                                 "train": {"run_name": run_name}})

    assert resolve_resume(cfg(None), run_dir_for) == (None, None)
    # auto with nothing to resume: a fresh run (in the named run dir when there is a name)
    assert resolve_resume(cfg("auto"), run_dir_for) == (None, None)
    assert resolve_resume(cfg("auto", "job-7"), run_dir_for) == (None, tmp_path / "runs" / "ctc" / "job-7")
    for name in ("a", "b"):
        (tmp_path / "runs" / "ctc" / name / "checkpoints").mkdir(parents=True)
        (tmp_path / "runs" / "ctc" / name / "checkpoints" / "last.ckpt").write_bytes(b"x")
    import os

    os.utime(tmp_path / "runs" / "ctc" / "a" / "checkpoints" / "last.ckpt", (1, 1))
    b_ck = tmp_path / "runs" / "ctc" / "b" / "checkpoints" / "last.ckpt"
    assert resolve_resume(cfg("auto"), run_dir_for) == (b_ck, b_ck.parent.parent)  # newest run
    assert resolve_resume(cfg("auto", "a"), run_dir_for)[0] == tmp_path / "runs" / "ctc" / "a" / "checkpoints" / "last.ckpt"
    # Lightning's SIGUSR1 checkpoint (Slurm) is used when newer than last.ckpt
    hpc = tmp_path / "runs" / "ctc" / "a" / "hpc_ckpt_3.ckpt"
    hpc.write_bytes(b"y")
    assert resolve_resume(cfg("auto", "a"), run_dir_for)[0] == hpc
    # explicit file / run directory / missing
    assert resolve_resume(cfg(str(b_ck)), run_dir_for) == (b_ck, b_ck.parent.parent)
    assert resolve_resume(cfg(str(b_ck.parent.parent)), run_dir_for)[0] == b_ck
    with pytest.raises(FileNotFoundError, match="resume="):
        resolve_resume(cfg(str(tmp_path / "nope")), run_dir_for)


def test_resumed_worker_loader_continues_the_saved_epoch():
    """A DataLoader with worker processes (train.num_workers >= 1) calls iter(sampler) twice per
    iterator; both must skip the consumed batches (issue 28: the epoch restarted at batch 0)."""
    from train.data import ResumableDataLoader, ShardedBatchSampler

    s = ShardedBatchSampler(6, shuffle=True, seed=5, window=2)
    s.set_epoch(1)
    order = list(s)
    t = ShardedBatchSampler(6, shuffle=True, seed=5, window=2)
    dl = ResumableDataLoader(list(range(6)), batch_size=None, sampler=t, num_workers=1)
    dl.load_state_dict({"epoch": 1, "consumed": 2})
    t.set_epoch(1)  # Lightning, at the resumed epoch's start
    assert [int(x) for x in dl] == order[2:]


def test_sampler_state_skips_consumed_batches():
    from train.data import ResumableDataLoader, ShardedBatchSampler

    s = ShardedBatchSampler(7, 2, 1, shuffle=True, seed=3)
    s.set_epoch(2)
    order = list(s)
    s.consumed = 2
    state = s.state_dict()
    t = ShardedBatchSampler(7, 2, 1, shuffle=True, seed=3)
    dl = ResumableDataLoader(list(range(8)), batch_size=None, sampler=t)
    dl.load_state_dict(state)
    assert t.epoch == 2 and list(t) == order[2:]
    assert list(t) == order[2:]  # every iterator of the saved epoch skips (a worker loader iterates twice)
    t.set_epoch(3)
    u = ShardedBatchSampler(7, 2, 1, shuffle=True, seed=3)
    u.set_epoch(3)
    assert list(t) == list(u)  # the skip ends with its epoch


def test_equal_weights_give_equal_bytes(tiny_base, tmp_path):
    """A file's SHA-256 identifies what it holds (evaluation resume, merges and the auto-tree cache key
    on it): the same tensors and metadata give the same bytes on every save, whatever order the
    safetensors library writes its metadata map in."""
    from safetensors import safe_open
    from safetensors.torch import load

    import heads
    from core.io import safetensors_bytes, sha256_file
    from train.checkpoint_io import dumps, loads

    tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "i": torch.arange(5),
               "h": torch.ones(3).bfloat16()}
    meta = {"format": "draftheads", "head_type": "falcon", "note": "précis", "a": "1", "z": "2"}
    blobs = {safetensors_bytes(tensors, meta) for _ in range(16)}
    assert len(blobs) == 1
    (blob,) = blobs
    assert all(torch.equal(load(blob)[k], v) for k, v in tensors.items())
    (tmp_path / "t.safetensors").write_bytes(blob)
    with safe_open(tmp_path / "t.safetensors", "pt") as fh:
        assert fh.metadata() == meta
    ckpt = {"state_dict": tensors, "global_step": 3, "loops": {"x": [1, 2]}}
    assert len({dumps(ckpt) for _ in range(8)}) == 1 and loads(dumps(ckpt))["loops"] == {"x": [1, 2]}
    head = heads.build({"type": "adadecode", "layers": [1, 2]}, tiny_base[0])
    digests = {sha256_file(heads.save(head, tmp_path / f"h{i}", {"vocab_size": 1}) / "model.safetensors")
               for i in range(8)}
    assert len(digests) == 1


def test_last_checkpoint_is_the_furthest_step_not_the_newest_file(tmp_path):
    """A run folder copied without its times (``cp -r``) gave last.ckpt and Lightning's Slurm checkpoint arbitrary
    mtimes, and the newest file was taken: an older step, repeating training.  The step each records decides."""
    import os

    from train.checkpoint_io import dumps
    from train.resume import last_checkpoint

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    last, hpc = run / "checkpoints" / "last.ckpt", run / "hpc_ckpt_1.ckpt"
    last.write_bytes(dumps({"global_step": 40, "epoch": 0, "state_dict": {"w": torch.zeros(2)}}))
    hpc.write_bytes(dumps({"global_step": 25, "epoch": 0, "state_dict": {"w": torch.ones(2)}}))
    os.utime(last, (1, 1))  # the copy made the further checkpoint the older file
    assert last_checkpoint(run) == last
    hpc.write_bytes(dumps({"global_step": 41, "epoch": 0, "state_dict": {"w": torch.ones(2)}}))
    os.utime(hpc, (0, 0))
    assert last_checkpoint(run) == hpc
    hpc.write_bytes(b"torn")  # an unreadable header: the newest file, whose load then names it
    assert last_checkpoint(run) == hpc
