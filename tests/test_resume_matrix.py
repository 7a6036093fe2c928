"""Stopped anywhere, resumed, equal to the uninterrupted run (issue 11), single process, every head.

Each case trains a head with its default randomness (Falcon feature noise + CSGD glancing) on a
tiny random cache twice: uninterrupted, and stopped then resumed with ``resume=auto``.  Both must
end with bitwise-equal weights (``last/model.safetensors``) and optimizer state (the final
``last.ckpt``), and with the same logged rows (``csv/metrics.csv``: no step twice, none shifted).

Stops: a kill (an exception out of ``Trainer.fit``, nothing saved after it) after a
non-improving validation, mid-window under gradient accumulation, at an epoch end; a SIGTERM /
SIGUSR1 delivered during the optimizer step (the run must checkpoint that whole step, stop
before the next one and, for SIGUSR1 in a Slurm job, requeue).  Budgets: steps and epochs.
Multi-process (DDP / ZeRO-3) cases are in tests/test_resume_distributed.py.
"""
from __future__ import annotations

import csv
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.config import compose
from train.checkpoint_io import SafetensorsCheckpointIO

LAYERS = [1, 2, 3]
HEAD_ARGS = {
    "ctc": ["heads=ctc", "heads.attn_implementation=eager"],
    "falcon": ["heads=falcon"],
    "falcon_k1": ["heads=falcon_k1"],
    "adadecode": ["heads=adadecode", f"heads.layers={LAYERS}"],
    "eagle3": ["heads=eagle3", f"heads.layers={LAYERS}"],
}


class Kill(RuntimeError):
    pass


@pytest.fixture(scope="module")
def caches(tiny_model_dir, tmp_path_factory):
    """Two caches: 16 training conversations (4 batches of 4) and 20 (5 batches: odd, so an epoch
    is not a whole number of accumulation windows unless the sampler pads it)."""
    from data_prep.synthetic import write_random_cache

    root = tmp_path_factory.mktemp("resume_matrix")
    return {n: write_random_cache(root / f"cache{n}", tiny_model_dir, n_train=n, n_val=4, layers=LAYERS,
                                  length_range=(6, 16), shard_size=8) for n in (16, 20)}


def _cfg(tmp, cache, head, name, extra=()):
    return compose([*HEAD_ARGS[head], "train.logger=csv", "train.progress_bar=false", "train.sanity_val_steps=0",
                    f"output_root={tmp}", f"train.cache_dir={cache}", f"train.run_name={name}",
                    "train.log_every_n_steps=1", "train.accelerator=cpu", "train.devices=1", "strategy=auto",
                    "train.batch_size=4", "train.scheduler.warmup_steps=1", "train.optimizer.lr=0.01", *extra])


def _train(tmp, cache, base, head, name, extra=(), callbacks=(), resume=False):
    from train.run import train

    return train(_cfg(tmp, cache, head, name, [*extra, *(["resume=auto"] if resume else [])]), base=base,
                 callbacks=list(callbacks))


def kill_at(step: int, micro: int = 0):
    """Raise :class:`Kill` before micro-batch ``micro`` of the window after optimizer step ``step``."""
    from lightning.pytorch.callbacks import Callback

    class KillAt(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step >= step and batch_idx % trainer.accumulate_grad_batches == micro:
                raise Kill(f"killed at step {trainer.global_step}, batch {batch_idx}")

    return KillAt()


def stop_at(step: int, micro: int = 0):
    """Set ``trainer.should_stop`` (what the ``train.max_time`` Timer and early stopping do) at the end
    of micro-batch ``micro`` of the window after optimizer step ``step``: the run validates there and ends."""
    from lightning.pytorch.callbacks import Callback

    class StopAt(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step >= step and batch_idx % trainer.accumulate_grad_batches == micro:
                trainer.should_stop = True

    return StopAt()


class MicroBatches:
    """Records the conversation ids of every micro-batch a run trains on, in order, as
    ``(epoch, batch index in the epoch, ids)``."""

    def __init__(self) -> None:
        from lightning.pytorch.callbacks import Callback

        seen = self.seen = []

        class Record(Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                seen.append((int(trainer.current_epoch), int(batch_idx), tuple(batch["ids"])))

        self.callback = Record()


def assert_same_micro_batches(full: list, resumed: list, step: int, window: int) -> None:
    """The resumed run trains exactly the uninterrupted run's micro-batches after optimizer step
    ``step`` (the checkpoint's), micro-batch by micro-batch: none repeated, none skipped."""
    done = step * window  # every epoch is a whole number of windows (train.data.ShardedBatchSampler)
    expected = full[done:]
    if resumed != expected:
        from collections import Counter

        a, b = Counter(m[2] for m in expected), Counter(m[2] for m in resumed)
        raise AssertionError(f"resumed micro-batches differ from the uninterrupted run after step {step}: "
                             f"first resumed {resumed[:2]}, expected {expected[:2]}; repeated {sorted(b - a)}, "
                             f"skipped {sorted(a - b)}")


def signal_during_step(step: int, signum: int):
    """Deliver ``signum`` to this process inside optimizer step ``step`` (1-based), between the
    update of the first parameter and the rest (an optimizer pre-hook on the second step call)."""
    from lightning.pytorch.callbacks import Callback

    class SignalInStep(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step + 1 == step:
                os.kill(os.getpid(), signum)

    return SignalInStep()


def _final_state(run_dir: Path) -> tuple[dict, dict]:
    ckpt = SafetensorsCheckpointIO().load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    return load_file(run_dir / "last" / "model.safetensors"), ckpt


def _rows(run_dir: Path) -> list[dict]:
    from train.run import metrics_csv

    rows = list(csv.DictReader(open(metrics_csv(run_dir))))
    drop = ("train/tokens_per_s", "train/assistant_tokens_per_s")  # wall-clock
    # distributed/* rows record each launch (at the step it starts from), not training
    return [{k: v for k, v in r.items() if k not in drop and v != ""} for r in rows
            if not any(k.startswith("distributed/") and v for k, v in r.items())]


def assert_same_run(full: Path, resumed: Path) -> None:
    wa, ca = _final_state(full)
    wb, cb = _final_state(resumed)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"weight {k} differs by {(wa[k] - wb[k]).abs().max():.3g}"
    assert ca["global_step"] == cb["global_step"]
    sa, sb = ca["optimizer_states"][0]["state"], cb["optimizer_states"][0]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for name in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][name]), torch.as_tensor(sb[i][name])), f"optimizer {i}.{name}"
    ra, rb = _rows(full), _rows(resumed)
    steps = [(r["step"], "val" if any(k.startswith("val/") for k in r) else "train") for r in rb]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    assert ra == rb


EPOCHS_ACC2 = ["train.max_steps=-1", "train.accumulate_grad_batches=2"]

CASES = {
    # name: (head, cache, budget + cadence overrides, stop callback factory, resume step expected)
    "ctc-steps-after-nonimproving-val": ("ctc", 16, ["train.max_steps=6", "train.val_every_n_steps=2"],
                                         lambda: kill_at(4), 4),
    "falcon-steps-noise-csgd": ("falcon", 16, ["train.max_steps=6", "train.val_every_n_steps=2"],
                                lambda: kill_at(4), 4),
    "adadecode-epochs-acc2-midwindow": ("adadecode", 20, ["train.max_steps=-1", "train.max_epochs=2",
                                                          "train.accumulate_grad_batches=2",
                                                          "train.val_every_n_steps=2"],
                                        lambda: kill_at(4, micro=1), 4),
    "falcon-epochs-epoch-end": ("falcon", 16, ["train.max_steps=-1", "train.max_epochs=3", "train.val_every_n_steps=4"],
                                lambda: kill_at(4), 4),
    # issue 28: epoch budget, accumulation 2, DataLoader workers (a worker loader calls iter(sampler)
    # twice per epoch: the resume skip was spent on the first, the epoch restarted from batch 0)
    "falcon-epochs-acc2-workers-midepoch-top1": ("falcon", 20, [*EPOCHS_ACC2, "train.max_epochs=3",
                                                                "train.val_every_n_steps=2", "train.save_top_k=1",
                                                                "train.num_workers=1"], lambda: kill_at(5, micro=1), 4),
    # told to stop inside a window (train.max_time, early stopping): no checkpoint of a partial window
    "adadecode-epochs-acc2-stop-midwindow": ("adadecode", 20, [*EPOCHS_ACC2, "train.max_epochs=3",
                                                               "train.val_every_n_steps=2"], lambda: stop_at(5), 4),
}


MATRIX = {  # pytest -m resume_matrix
    "falcon-steps-acc2-midwindow": ("falcon", 20, ["train.max_steps=6", "train.val_every_n_steps=2",
                                                   "train.accumulate_grad_batches=2"], lambda: kill_at(3, micro=1), 2),
    "ctc-epochs-acc2-epoch-end": ("ctc", 16, ["train.max_steps=-1", "train.max_epochs=3", "train.val_every_n_steps=2",
                                              "train.accumulate_grad_batches=2"], lambda: kill_at(2), 2),
    "adadecode-steps-after-nonimproving-val": ("adadecode", 16, ["train.max_steps=6", "train.val_every_n_steps=1"],
                                               lambda: kill_at(5), 5),
    "falcon_k1-epochs-midepoch": ("falcon_k1", 20, ["train.max_steps=-1", "train.max_epochs=2",
                                                    "train.val_every_n_steps=3"], lambda: kill_at(4), 3),
    "eagle3-epochs-acc2-midwindow": ("eagle3", 20, ["train.max_steps=-1", "train.max_epochs=2",
                                                    "train.accumulate_grad_batches=2", "train.val_every_n_steps=2"],
                                     lambda: kill_at(4, micro=1), 4),
    "eagle3-steps-after-nonimproving-val": ("eagle3", 16, ["train.max_steps=5", "train.val_every_n_steps=1"],
                                            lambda: kill_at(3), 3),
    # issue 28: epoch budget x accumulation 2 with DataLoader workers: mid-epoch checkpoints at
    # save_top_k 1 and 10, a stop mid-window, an epoch end (20 conversations: 3 steps an epoch)
    "ctc-epochs-acc2-workers-midepoch-top10": ("ctc", 20, [*EPOCHS_ACC2, "train.max_epochs=2", "train.val_every_n_steps=1",
                                                           "train.save_top_k=10", "train.num_workers=1"],
                                               lambda: kill_at(4), 4),
    "eagle3-epochs-acc2-workers-midwindow-top1": ("eagle3", 20, [*EPOCHS_ACC2, "train.max_epochs=2",
                                                                 "train.val_every_n_steps=2", "train.save_top_k=1",
                                                                 "train.num_workers=1"], lambda: kill_at(3, micro=1), 2),
    "falcon_k1-epochs-acc2-workers-epoch-end": ("falcon_k1", 20, [*EPOCHS_ACC2, "train.max_epochs=3",
                                                                  "train.val_every_n_steps=3", "train.save_top_k=10",
                                                                  "train.num_workers=1"], lambda: kill_at(4, micro=1), 3),
    "falcon-epochs-acc2-stop-midwindow-top10": ("falcon", 16, [*EPOCHS_ACC2, "train.max_epochs=3",
                                                               "train.val_every_n_steps=2", "train.save_top_k=10",
                                                               "train.num_workers=1"], lambda: stop_at(3), 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_killed_and_resumed_equals_uninterrupted(case, caches, tiny_base, tmp_path):
    _kill_case(CASES[case], caches, tiny_base, tmp_path)


@pytest.mark.resume_matrix
@pytest.mark.parametrize("case", list(MATRIX))
def test_resume_matrix_single_process(case, caches, tiny_base, tmp_path):
    _kill_case(MATRIX[case], caches, tiny_base, tmp_path)


def _kill_case(spec, caches, tiny_base, tmp_path):
    head, n, extra, stop, expect_step = spec
    cache = caches[n]
    full_batches, resumed_batches = MicroBatches(), MicroBatches()
    full = _train(tmp_path, cache, tiny_base, head, "full", extra, callbacks=[full_batches.callback])["run_dir"]
    callback = stop()
    if type(callback).__name__ == "StopAt":  # ends the run normally (it exports), mid-window
        _train(tmp_path, cache, tiny_base, head, "part", extra, callbacks=[callback])
    else:
        with pytest.raises(Kill):
            _train(tmp_path, cache, tiny_base, head, "part", extra, callbacks=[callback])
    part = full.parent / "part"
    saved = SafetensorsCheckpointIO().load_checkpoint(part / "checkpoints" / "last.ckpt")
    assert saved["global_step"] == expect_step  # last.ckpt is the newest whole-step save point, not the best one
    window = next((int(x.split("=")[1]) for x in extra if x.startswith("train.accumulate_grad_batches=")), 1)
    (position,) = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert position["consumed"] % window == 0, f"checkpoint inside an accumulation window: {position}"
    _train(tmp_path, cache, tiny_base, head, "part", extra, callbacks=[resumed_batches.callback], resume=True)
    assert_same_micro_batches(full_batches.seen, resumed_batches.seen, expect_step, window)
    assert_same_run(full, part)


@pytest.mark.parametrize("signame,n", [("SIGTERM", 16), ("SIGUSR1", 20)])
def test_signal_during_optimizer_step_checkpoints_whole_step_and_stops(signame, n, caches, tiny_base, tmp_path,
                                                                        monkeypatch):
    """Falcon (noise + CSGD), accumulation 2, step budget; the signal arrives inside step 3.  The
    run checkpoints after step 3 (a validation is due only at 4), stops before step 4 and never
    writes again; for SIGUSR1 inside a Slurm job rank 0 requeues with ``scontrol requeue``.

    With 16 conversations (4 batches, 2 steps an epoch) step 3 is mid-epoch; with 20 (5 batches
    padded to 6, 3 steps an epoch) step 3 ends epoch 0, between validations: that checkpoint used to
    resume into epoch 2 (Lightning's loop state saved at a batch end, before the batch counts as
    completed), skipping epoch 1 (1.5e-2 off)."""
    signum = getattr(signal, signame)
    extra = ["train.max_steps=6", "train.val_every_n_steps=2", "train.accumulate_grad_batches=2"]
    cache = caches[n]
    full = _train(tmp_path, cache, tiny_base, "falcon", "full", extra)["run_dir"]
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/scontrol.log\n")
    (stub / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{stub}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    result = _train(tmp_path, cache, tiny_base, "falcon", "part", extra,
                    callbacks=[signal_during_step(3, signum)])
    assert result["preempted"] is not None and result["preempted"].step == 3 and not result["exports"]
    part = result["run_dir"]
    saved = SafetensorsCheckpointIO().load_checkpoint(part / "checkpoints" / "last.ckpt")
    assert saved["global_step"] == 3
    assert saved["optimizer_states"][0]["state"][0]["step"] == 3  # every parameter's counter: one whole step
    assert {int(s["step"]) for s in saved["optimizer_states"][0]["state"].values()} == {3}
    requeued = (tmp_path / "scontrol.log").read_text().split() if (tmp_path / "scontrol.log").exists() else []
    assert requeued == (["requeue", "4242"] if signame == "SIGUSR1" else [])
    monkeypatch.delenv("SLURM_JOB_ID")
    _train(tmp_path, cache, tiny_base, "falcon", "part", extra, resume=True)
    assert_same_run(full, part)
