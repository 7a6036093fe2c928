"""Stopped, resumed, equal to uninterrupted: two processes (DDP, DeepSpeed ZeRO-3 on CPU/gloo).

One subprocess pair (``tests/_resume_worker.py``) trains every case's uninterrupted run and its
stopped run, a second pair resumes them all with ``resume=auto`` (two interpreter start-ups for
the whole group).  Compared
bitwise: the exported weights, the optimizer state (DDP: the checkpoint's; ZeRO: every rank's
shard), and the logged rows.

Default cases (representative): Falcon under DDP with its default randomness (per-rank RNG
states), killed mid-run; AdaDecode with an extra frozen parameter under ZeRO-3 at accumulation 2,
SIGTERM to rank 0 only inside the optimizer step that ends epoch 0, between validations (that
checkpoint used to resume into epoch 2; the frozen parameter's gather is part of every save).
The rest of the matrix (every head incl. EAGLE-3 and Falcon k=1, DDP and ZeRO-3, both budgets,
accumulation 1 and 2, kills and signals) runs with ``pytest -m resume_matrix``.
"""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_distributed import launch  # noqa: E402

WORKER = ROOT / "tests" / "_resume_worker.py"
LAYERS = [1, 2, 3]
HEAD_ARGS = {
    "ctc": ["heads=ctc", "heads.attn_implementation=eager"],
    "falcon": ["heads=falcon"],
    "adadecode": ["heads=adadecode", f"heads.layers={LAYERS}"],
    "adadecode_frozen": ["heads=adadecode", f"heads.layers={LAYERS}", "heads.type=adadecode_frozen"],
    "eagle3": ["heads=eagle3", f"heads.layers={LAYERS}", "heads.ttt_steps=3"],
    "falcon_k1": ["heads=falcon_k1"],
}


@pytest.fixture(scope="module")
def cache(tiny_model_dir, tmp_path_factory):
    from data_prep.synthetic import write_random_cache

    root = tmp_path_factory.mktemp("resume_dist")
    return write_random_cache(root / "cache", tiny_model_dir, n_train=20, n_val=4, layers=LAYERS,
                              length_range=(6, 16), shard_size=8)


def _launch(worker_args, work, allow_rc=(0,)):
    import test_distributed

    original = test_distributed.WORKER
    test_distributed.WORKER = WORKER
    try:
        return launch(2, worker_args, work, allow_rc=allow_rc)
    finally:
        test_distributed.WORKER = original


def _rows(run_dir: Path) -> list[dict]:
    rows = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
    drop = ("train/tokens_per_s", "train/assistant_tokens_per_s")
    return [{k: v for k, v in r.items() if k not in drop and v != ""} for r in rows
            if not any(k.startswith("distributed/") and v for k, v in r.items())]


def _optimizer_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    from train.checkpoint_io import SafetensorsCheckpointIO, loads

    ckpt_path = run_dir / "checkpoints" / "last.ckpt"
    ckpt = SafetensorsCheckpointIO().load_checkpoint(ckpt_path)
    out: dict[str, torch.Tensor] = {}

    def walk(obj, where):
        if isinstance(obj, torch.Tensor):
            out[where] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{where}.{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{where}[{i}]")
        elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
            out[where] = torch.tensor(obj)

    if "zero" in ckpt:
        for shard in sorted((ckpt_path.parent / ckpt["zero"]["shards"]).glob("rank-*.safetensors")):
            walk(loads(shard.read_bytes())["optimizer"], shard.name)
    else:
        walk(ckpt["optimizer_states"], "optimizer")
    out["global_step"] = torch.tensor(ckpt["global_step"])
    return out


CASES = {
    # name: (head, strategy + budget overrides, stop spec); a kill must be the last case of a group
    # 20 conversations in batches of 2 on 2 ranks: 5 batches a rank, padded to 6 = 3 optimizer steps
    # an epoch at accumulation 2, so the signal in step 3 stops at epoch 0's end, between validations
    "zero3-adadecode-frozen-acc2-sigterm-epoch-end": ("adadecode_frozen", [
        "strategy=deepspeed_zero3", "train.max_steps=6", "train.val_every_n_steps=2", "train.accumulate_grad_batches=2"],
        {"kind": "signal", "step": 3, "signal": "SIGTERM", "ranks": [0]}),
    "ddp-falcon-kill": ("falcon", ["strategy=ddp", "train.max_steps=6", "train.val_every_n_steps=2"],
                        {"kind": "kill", "step": 3}),
}
ZERO3_EPOCHS_ACC2 = ["strategy=deepspeed_zero3", "train.max_steps=-1", "train.max_epochs=2",
                     "train.accumulate_grad_batches=2", "train.num_workers=1"]
MATRIX = [{  # groups: at most one kill each, last
    "zero3-falcon-sigusr1-both-ranks": ("falcon", ["strategy=deepspeed_zero3", "train.max_steps=6",
                                                   "train.val_every_n_steps=3"],
                                        {"kind": "signal", "step": 4, "signal": "SIGUSR1", "ranks": [0, 1]}),
    "ddp-adadecode-sigterm-acc2": ("adadecode", ["strategy=ddp", "train.max_steps=6", "train.val_every_n_steps=2",
                                                 "train.accumulate_grad_batches=2"],
                                   {"kind": "signal", "step": 3, "signal": "SIGTERM", "ranks": [1]}),
    "zero3-adadecode-epochs-epoch-end": ("adadecode", ["strategy=deepspeed_zero3", "train.max_steps=-1",
                                                       "train.max_epochs=3", "train.val_every_n_steps=3"],
                                         {"kind": "kill", "step": 3}),
}, {
    "ddp-ctc-epochs-acc2-midwindow": ("ctc", ["strategy=ddp", "train.max_steps=-1", "train.max_epochs=2",
                                              "train.accumulate_grad_batches=2", "train.val_every_n_steps=1"],
                                      {"kind": "kill", "step": 2, "micro": 1}),
}, {  # every launch stays about as long as the groups above (tests/test_distributed.launch: 240 s limit)
    "zero3-eagle3-steps-sigterm-midepoch": ("eagle3", ["strategy=deepspeed_zero3", "train.max_steps=6",
                                                       "train.val_every_n_steps=2"],
                                            {"kind": "signal", "step": 3, "signal": "SIGTERM", "ranks": [1]}),
    "ddp-eagle3-epochs-acc2-sigusr1-epoch-end": ("eagle3", ["strategy=ddp", "train.max_steps=-1", "train.max_epochs=2",
                                                            "train.accumulate_grad_batches=2",
                                                            "train.val_every_n_steps=2"],
                                                 {"kind": "signal", "step": 3, "signal": "SIGUSR1", "ranks": [0, 1]}),
    "zero3-falcon_k1-steps-acc2-signal-at-validation": ("falcon_k1", [
        "strategy=deepspeed_zero3", "train.max_steps=5", "train.val_every_n_steps=1", "train.accumulate_grad_batches=2"],
        {"kind": "signal", "step": 4, "signal": "SIGTERM", "ranks": [0]}),
}, {  # issue 28: epoch budget x accumulation 2 under ZeRO-3 with DataLoader workers, micro-batch ids
    # compared (3 optimizer steps an epoch): a signal at a mid-epoch step (save_top_k 1), at an epoch
    # end (save_top_k 10), a stop inside a window, a kill inside a window after a mid-epoch checkpoint
    "zero3-falcon-epochs-acc2-workers-sigterm-midepoch-top1": ("falcon", [
        *ZERO3_EPOCHS_ACC2, "train.val_every_n_steps=3", "train.save_top_k=1"],
        {"kind": "signal", "step": 4, "signal": "SIGTERM", "ranks": [0]}),
    "zero3-eagle3-epochs-acc2-workers-kill-midwindow-top10": ("eagle3", [
        *ZERO3_EPOCHS_ACC2, "train.val_every_n_steps=2", "train.save_top_k=10"],
        {"kind": "kill", "step": 5, "micro": 1}),
}, {
    "zero3-ctc-epochs-acc2-workers-sigterm-epoch-end-top10": ("ctc", [
        *ZERO3_EPOCHS_ACC2, "train.val_every_n_steps=2", "train.save_top_k=10"],
        {"kind": "signal", "step": 3, "signal": "SIGTERM", "ranks": [1]}),
    "zero3-adadecode-epochs-acc2-workers-stop-midwindow": ("adadecode", [
        *ZERO3_EPOCHS_ACC2, "train.val_every_n_steps=2"], {"kind": "stop", "step": 3, "micro": 0}),
}]


def _run_group(cases: dict, cache, tiny_model_dir, tmp_path) -> None:
    """Every case's uninterrupted and stopped run in one process pair (a kill ends it, so at most
    the last case kills), then every resume in a second pair; compare each case."""
    common = ["--model-dir", str(tiny_model_dir), f"output_root={tmp_path / 'out'}", f"train.cache_dir={cache}",
              "train.batch_size=2", "train.scheduler.warmup_steps=1", "train.optimizer.lr=0.01"]
    kills = [n for n, (_, _, stop) in cases.items() if stop["kind"] == "kill"]
    assert len(kills) <= 1 and (not kills or kills[0] == list(cases)[-1]), "a kill must be the last case"
    first, second = [], []
    micro = tmp_path / "micro"
    micro.mkdir(exist_ok=True)
    for name, (head, overrides, stop) in cases.items():
        args = [*HEAD_ARGS[head], *overrides]
        first += [{"overrides": [*args, f"train.run_name={name}-full"], "record": str(micro / f"{name}-full")},
                  {"overrides": [*args, f"train.run_name={name}-part"], "stop": stop}]
        second.append({"overrides": [*args, f"train.run_name={name}-part", "resume=auto"],
                       "record": str(micro / f"{name}-resumed")})
    _launch([*common, "--plan", json.dumps(first)], tmp_path, allow_rc=(17,) if kills else (0,))
    runs = tmp_path / "out" / "runs"
    done = {}
    for name, (_, overrides, stop) in cases.items():
        part = next(iter(sorted(runs.glob(f"*/{name}-part"))), runs / name)
        # a run told to stop (kind "stop") ends normally and exports; killed / pre-empted ones do not
        assert (stop["kind"] == "stop" or not (part / "last").exists()) and (part / "checkpoints" / "last.ckpt").is_file(), name
        done[name] = _whole_windows_done(part, _window(overrides), name)
    _launch([*common, "--plan", json.dumps(second)], tmp_path)
    for name in cases:
        (full,), (part,) = sorted(runs.glob(f"*/{name}-full")), sorted(runs.glob(f"*/{name}-part"))
        _compare(name, full, part)
        for rank in (0, 1):
            _compare_micro_batches(f"{name} rank {rank}", _micro_batches(micro / f"{name}-full", rank),
                                   _micro_batches(micro / f"{name}-resumed", rank), done[name])


def _window(overrides) -> int:
    return next((int(x.split("=")[1]) for x in overrides if x.startswith("train.accumulate_grad_batches=")), 1)


def _whole_windows_done(run_dir: Path, window: int, name: str) -> int:
    """Micro-batches per rank that ``last.ckpt``'s weights hold (its step x the window); its data
    position must be that many (whole accumulation windows only)."""
    from train.checkpoint_io import SafetensorsCheckpointIO

    ckpt = SafetensorsCheckpointIO().load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    (position,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert position["consumed"] % window == 0, f"{name}: checkpoint inside an accumulation window: {position}"
    return int(ckpt["global_step"]) * window


def _micro_batches(prefix: Path, rank: int) -> list:
    path = Path(f"{prefix}.rank{rank}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _compare_micro_batches(name: str, full: list, resumed: list, done: int) -> None:
    """Micro-batch by micro-batch: the resumed run trains the uninterrupted run's, after the first ``done``."""
    assert resumed, f"{name}: the resumed run recorded no micro-batch"
    assert resumed == full[done:], (f"{name}: resumed micro-batches differ after {done}: first resumed "
                                    f"{resumed[:2]}, expected {full[done:done + 2]}")


def _compare(name: str, full: Path, part: Path) -> None:
    wa, wb = load_file(full / "last" / "model.safetensors"), load_file(part / "last" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{name}: weight {k} differs by {(wa[k] - wb[k]).abs().max():.3g}"
    oa, ob = _optimizer_tensors(full), _optimizer_tensors(part)
    assert oa.keys() == ob.keys()
    for k in oa:
        assert torch.equal(oa[k], ob[k]), f"{name}: optimizer state {k} differs"
    assert _rows(full) == _rows(part), name


def test_two_process_stop_and_resume_is_exact(cache, tiny_model_dir, tmp_path):
    _run_group(CASES, cache, tiny_model_dir, tmp_path)


@pytest.mark.resume_matrix
@pytest.mark.parametrize("group", range(len(MATRIX)))
def test_two_process_resume_matrix(group, cache, tiny_model_dir, tmp_path):
    _run_group(MATRIX[group], cache, tiny_model_dir, tmp_path)
