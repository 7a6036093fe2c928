"""DeepSpeed ZeRO through Lightning on CPU (gloo): two processes, compared with DDP.

Each multi-process run is a subprocess pair (``tests/_distributed_worker.py``; Lightning's DDP
would otherwise re-launch pytest) with RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT set like torchrun does.  One process pair trains DDP, ZeRO-2 and ZeRO-3 in turn
(6 optimizer steps each, the same seeded batches), ZeRO-2 with the optimizer offloaded to CPU, then a ZeRO-3 run that is hard-killed after
step 3's checkpoint; a second pair resumes it with ``resume=auto``.

No DeepSpeed C++ op is compiled: :class:`train.strategies.CPUZeroStrategy` skips the
shared-memory comm op (inference-only) and the module's optimizer is ``torch.optim.AdamW``.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from train.run import metrics_csv
import torch
from safetensors.torch import load_file

import heads

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "_distributed_worker.py"
COMMON = ["train.batch_size=2", "train.max_steps=6", "train.val_every_n_steps=3", "train.scheduler.warmup_steps=2",
          "train.optimizer.lr=0.01", "train.grad_clip.value=0.05", "train.grad_clip.algorithm=value"]
RUNS = {"ddp": "ddp", "zero2": "deepspeed_zero2", "zero3": "deepspeed_zero3"}
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, args: list[str], cwd: Path, timeout: float = 240, allow_rc=(0,)) -> list[str]:
    """Start ``world`` worker processes like torchrun would; return their logs.  Fails on a bad exit."""
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        log = open(cwd / f"rank{rank}.{len(list(cwd.glob('rank*.log')))}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), *args], cwd=cwd, env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    texts = [Path(log.name).read_text() for log in logs]
    for rank, (code, text) in enumerate(zip(codes, texts)):
        assert code in allow_rc, f"rank {rank} exited {code}:\n{text[-4000:]}"
    return texts


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """Run directories of the DDP / ZeRO-2 / ZeRO-3 runs and of the killed + resumed ZeRO-3 run."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _distributed_worker import write_tiny_cache

    work = tmp_path_factory.mktemp("dist")
    cache = write_tiny_cache(work / "cache", tiny_model_dir)
    common = ["--model-dir", str(tiny_model_dir), f"output_root={work / 'out'}", f"train.cache_dir={cache}", *COMMON]
    plan = [[f"strategy={s}", f"train.run_name={name}"] for name, s in RUNS.items()]
    plan.append(["strategy=deepspeed_zero2", "strategy.offload_optimizer=true", "train.run_name=zero2_offload"])
    plan.append(["strategy=deepspeed_zero3", "train.run_name=zero3_resumed"])
    launch(2, [*common, "--plan", json.dumps(plan), "--kill-after-step", "3"], work, allow_rc=(17,))
    killed = work / "out" / "runs" / "test_dist" / "zero3_resumed"
    assert not (killed / "result.json").exists() and (killed / "checkpoints" / "last.ckpt").is_file()
    launch(2, [*common, "strategy=deepspeed_zero3", "train.run_name=zero3_resumed", "resume=auto"], work)
    return {name: work / "out" / "runs" / "test_dist" / name for name in [*RUNS, "zero2_offload", "zero3_resumed"]}


def _result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def _weights(run_dir: Path, which: str = "last") -> dict[str, torch.Tensor]:
    return load_file(run_dir / which / "model.safetensors")


def test_zero2_zero3_match_ddp(runs):
    ref = _result(runs["ddp"])
    assert ref["strategy"] == "DDPStrategy" and ref["world_size"] == 2 and ref["global_step"] == 6
    w_ref = _weights(runs["ddp"])
    for name in ("zero2", "zero3", "zero2_offload"):
        res = _result(runs[name])
        assert res["strategy"] == "CPUZeroStrategy" and res["world_size"] == 2 and res["global_step"] == 6
        assert res["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6)
        w = _weights(runs[name])
        assert sorted(w) == sorted(w_ref)
        for k in w_ref:
            torch.testing.assert_close(w[k], w_ref[k], rtol=1e-5, atol=1e-6, msg=f"{name} {k}")


def test_training_moved_the_weights(runs, tiny_base):
    """The comparison above is not vacuous: the trained weights differ from the initial ones."""
    sys.path.insert(0, str(ROOT / "tests"))
    import _distributed_worker  # noqa: F401  (registers test_dist)
    import heads

    model, _, _ = tiny_base
    init = heads.build({"type": "test_dist", "init_seed": 0}, model).trainable_state_dict()
    trained = _weights(runs["ddp"])
    assert sorted(init) == sorted(trained)
    assert max(float((init[k] - trained[k]).abs().max()) for k in init) > 1e-3


def test_zero3_really_shards(runs):
    """Each rank holds only its partition of every parameter (ds_tensor), the two halves the whole."""
    parts = [json.loads((runs["zero3"] / f"zero3_rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(parts[0]) == sorted(parts[1]) and len(parts[0]) == 6
    for name in parts[0]:
        (local0, full), (local1, full1) = parts[0][name], parts[1][name]
        assert full == full1 and 0 < local0 < full and 0 < local1 < full
        assert local0 + local1 >= full  # the last partition may carry alignment padding


def test_zero3_export_equals_ddp_export_and_loads(runs, tiny_base):
    """The consolidated ZeRO-3 export is the single-process format (heads.load reads it) and equals DDP's."""
    sys.path.insert(0, str(ROOT / "tests"))
    import _distributed_worker  # noqa: F401
    import heads

    for which in ("last", "best"):
        z3, ddp = runs["zero3"] / which, runs["ddp"] / which
        assert sorted(p.name for p in z3.iterdir()) == ["config.json", "model.safetensors"]
        a, b = load_file(z3 / "model.safetensors"), load_file(ddp / "model.safetensors")
        assert sorted(a) == sorted(b)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    # only the head's own weights: the borrowed frozen base weights are never saved
    w = _weights(runs["zero3"])
    assert not any(k.endswith(("embed_weight", "lm_head_weight")) or "base_norm" in k for k in w)
    head, meta = heads.load(runs["zero3"] / "last", base_model=tiny_base[0])
    assert meta["head_type"] == "test_dist"
    for k, v in head.trainable_state_dict().items():
        torch.testing.assert_close(v, w[k])


def test_zero3_kill_and_resume_is_exact(runs):
    """6 steps in one go == 3 steps, hard kill, resume=auto, 3 more steps (weights, loss, step)."""
    full, resumed = _result(runs["zero3"]), _result(runs["zero3_resumed"])
    assert resumed["global_step"] == 6
    assert resumed["loss"] == full["loss"]
    a, b = _weights(runs["zero3"]), _weights(runs["zero3_resumed"])
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the checkpoint is pickle-free: a safetensors main file plus one safetensors shard per rank
    ckpts = runs["zero3_resumed"] / "checkpoints"
    shard_dirs = sorted(p for p in ckpts.iterdir() if p.name.startswith("last.ckpt.zero-"))
    assert len(shard_dirs) == 1  # older shard sets of last.ckpt were removed after the commit
    assert sorted(p.name for p in shard_dirs[0].iterdir()) == [
        "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]


def test_zero_stage_and_world_size_are_logged(runs):
    """train.strategies.DistributedInfo logs the set-up to every logger (CSV here; W&B the same way)."""
    import csv

    for name, stage in (("ddp", 0), ("zero2", 2), ("zero3", 3)):
        rows = list(csv.DictReader(open(metrics_csv(runs[name]))))
        info = [r for r in rows if r.get("distributed/zero_stage")]
        assert info, f"{name}: no distributed/* metrics in {list(rows[0])}"
        assert float(info[0]["distributed/zero_stage"]) == stage
        assert float(info[0]["distributed/world_size"]) == 2
        assert any(r.get("train/tokens_per_s") for r in rows)


@pytest.fixture(scope="module")
def vocab_runs(tiny_model_dir, tmp_path_factory):
    """DDP and ZeRO-3 runs of the test head with a draft vocabulary of 64 of the tiny V = 384
    tokens (counts scanned from the shards: the random cache has no counts file)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _distributed_worker import write_tiny_cache

    work = tmp_path_factory.mktemp("dist_vocab")
    cache = write_tiny_cache(work / "cache", tiny_model_dir)
    common = ["--model-dir", str(tiny_model_dir), f"output_root={work / 'out'}", f"train.cache_dir={cache}",
              "--draft-vocab-size", "64", *COMMON]
    plan = [["strategy=ddp", "train.run_name=ddp_dv"], ["strategy=deepspeed_zero3", "train.run_name=zero3_dv"]]
    launch(2, [*common, "--plan", json.dumps(plan)], work)
    return cache, {name: work / "out" / "runs" / "test_dist" / name for name in ("ddp_dv", "zero3_dv")}


def test_draft_vocab_zero3_matches_ddp_and_stores_the_mapping(vocab_runs, tiny_base):
    from data_prep.label_counts import scan_split
    from heads.draft_vocab import select_d2t

    import _distributed_worker  # noqa: F401  (registers test_dist)

    cache, runs = vocab_runs
    expect = select_d2t(scan_split(cache / "train"), 64)
    ref = _result(runs["ddp_dv"])
    res = _result(runs["zero3_dv"])
    assert res["global_step"] == ref["global_step"] == 6
    assert res["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6)
    w_ref, w = _weights(runs["ddp_dv"]), _weights(runs["zero3_dv"])
    assert sorted(w) == sorted(w_ref) and {"d2t", "t2d"} <= set(w)
    for k in w_ref:
        torch.testing.assert_close(w[k], w_ref[k], rtol=1e-5, atol=1e-6, msg=k)
    assert torch.equal(w["d2t"], expect) and int(w["t2d"].sum()) == 64
    head, meta = heads.load(runs["zero3_dv"] / "last", base_model=tiny_base[0])
    assert meta["head"]["draft_vocab_size"] == 64 and meta["head"]["draft_vocab"]["cache"] == str(cache)
    assert 0 < meta["head"]["draft_vocab"]["train_coverage"] <= 1
    torch.testing.assert_close(head.draft_lm_head_rows, tiny_base[0].lm_head.weight[expect])
