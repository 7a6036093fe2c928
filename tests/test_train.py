"""Tests of the generic training package (train/): batching, module, CheckpointIO, export, config.

A small but real head is defined here (a linear probe on the cached final hidden state that
predicts the cached greedy labels) so these tests do not depend on the method heads.
"""
from __future__ import annotations

import csv
import math

import pytest

from train.run import metrics_csv
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf, open_dict

import heads
from core.config import ConfigError, compose
from heads.base import DraftHead, Progress

H_LAYER_AUX = 2


@heads.register
class ProbeHead(DraftHead):
    """Linear probe: logits [B,T,V] = Linear_{H->V}(hidden) + frozen LM head(hidden); CE on ``labels``."""

    head_type = "test_probe"
    monitor_metric = "loss"
    monitor_mode = "min"

    def __init__(self, cfg, base_config):
        super().__init__(cfg, base_config)
        torch.manual_seed(int(cfg.get("init_seed", 0)))
        self.proj = torch.nn.Linear(self.hidden_size, self.vocab_size)
        self.norm = torch.nn.LayerNorm(self.hidden_size)

    def logits(self, batch):
        h = batch["hidden"].float()
        return self.proj(self.norm(h))

    def _ce(self, batch):
        logits = self.logits(batch)
        m = batch["loss_mask"].bool()
        ce = F.cross_entropy(logits[m], batch["labels"][m], reduction="none")
        acc = (logits[m].argmax(-1) == batch["labels"][m]).float()
        return ce, acc

    def training_loss(self, batch, progress: Progress):
        ce, acc = self._ce(batch)
        return ce.mean(), {"loss": float(ce.mean()), "acc": float(acc.mean()), "progress": progress.step / progress.total_steps}

    @torch.no_grad()
    def validation_metrics(self, batch):
        ce, acc = self._ce(batch)
        n = torch.tensor(float(ce.numel()))
        return {"loss": torch.stack([ce.sum().cpu(), n]), "acc": torch.stack([acc.sum().cpu(), n]),
                "batch_mean": ce.mean()}


@pytest.fixture(scope="module")
def tiny_cache(tiny_model_dir, tmp_path_factory):
    """A tiny cache in the real format (features and greedy labels from the tiny model)."""
    from data_prep.synthetic import write_random_cache

    return write_random_cache(tmp_path_factory.mktemp("train_cache"), tiny_model_dir, n_train=24, n_val=9,
                              layers=[H_LAYER_AUX], length_range=(6, 24), shard_size=7)


def _cfg(tmp_path, cache, **train):
    args = ["train.logger=csv", "train.progress_bar=false", "train.sanity_val_steps=0", f"output_root={tmp_path}",
            f"train.cache_dir={cache}", "train.run_name=t", "train.log_every_n_steps=1", "train.accelerator=cpu",
            "train.devices=1", "train.scheduler.warmup_steps=2", "train.optimizer.lr=0.02"]
    args += [f"train.{k}={v}" for k, v in train.items()]
    cfg = compose(args)
    with open_dict(cfg):
        cfg.heads = OmegaConf.create({"type": "test_probe", "init_seed": 0})
    return cfg


def _batches(cache, pad_id=2, batch_size=4):
    from data_prep.cache import CacheReader, collate

    reader = CacheReader(cache / "val")
    return [collate([reader[i] for i in range(j, min(j + batch_size, len(reader)))], pad_id)
            for j in range(0, len(reader), batch_size)]


# ---------------------------------------------------------------------------------------------
def test_make_batches_budget_coverage_determinism():
    from train.data import make_batches

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 50, (200,), generator=g).tolist()
    b = make_batches(lengths, batch_size=16, max_tokens=120, seed=3, bucket_size=4)
    assert sorted(i for batch in b for i in batch) == list(range(200))
    for batch in b:
        assert len(batch) <= 16
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 120
    assert b == make_batches(lengths, batch_size=16, max_tokens=120, seed=3, bucket_size=4)
    assert b != make_batches(lengths, batch_size=16, max_tokens=120, seed=4, bucket_size=4)
    # length-aware: far less padding than random batches of the same sizes
    pad = sum(len(x) * max(lengths[i] for i in x) - sum(lengths[i] for i in x) for x in b)
    perm = torch.randperm(200, generator=g).tolist()
    rand, k = [], 0
    for x in b:
        rand.append(perm[k:k + len(x)])
        k += len(x)
    pad_rand = sum(len(x) * max(lengths[i] for i in x) - sum(lengths[i] for i in x) for x in rand)
    assert pad < 0.5 * pad_rand
    # fixed batch size, no shuffle: consecutive chunks
    assert make_batches([5] * 7, 3, None, shuffle=False) == [[0, 1, 2], [3, 4, 5], [6]]
    # a record over the budget forms its own batch, and training says so (it was silent)
    assert make_batches([10, 2, 2], None, 5, shuffle=False) == [[0], [1, 2]]
    from train.data import over_token_budget

    assert over_token_budget([10, 2, 7], 5) == ("train.max_tokens=5: 2 of 3 training conversations are longer (up to "
                                               "10 tokens); each of those is a batch of its own, over the budget")
    assert over_token_budget([10, 2], 10) is None and over_token_budget([10], None) is None
    with pytest.raises(ValueError, match="length < 1"):
        make_batches([3, 0], 2, None)


def test_sharded_sampler_matches_single_process_accumulation():
    from train.data import ShardedBatchSampler

    single = ShardedBatchSampler(10, 1, 0, shuffle=True, seed=5)
    ranks = [ShardedBatchSampler(10, 2, r, shuffle=True, seed=5) for r in range(2)]
    for epoch in (0, 1):
        for s in (single, *ranks):
            s.set_epoch(epoch)
        order = list(single)
        r0, r1 = list(ranks[0]), list(ranks[1])
        assert len(r0) == len(r1) == 5 == len(ranks[0])
        # optimizer step s at world size 2 sees the global batches order[2s], order[2s+1]
        assert [x for pair in zip(r0, r1) for x in pair] == order
    single.set_epoch(0)
    e0 = list(single)
    single.set_epoch(1)
    assert list(single) != e0 and sorted(list(single)) == sorted(e0)
    # validation padding is flagged by indices >= num_batches, and every rank gets as many batches
    v = [list(ShardedBatchSampler(5, 3, r, shuffle=False, mark_padding=True)) for r in range(3)]
    assert v == [[0, 3], [1, 4], [2, 5]]  # 5 = padding (>= num_batches)


def test_checkpoint_io_roundtrip_exact(tmp_path):
    import random

    import numpy as np
    from lightning.fabric.utilities.seed import _collect_rng_states

    from train.checkpoint_io import SafetensorsCheckpointIO
    from train.module import WarmupDecay

    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([p, torch.nn.Parameter(torch.randn(3))], lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupDecay("cosine", 2, 10, 0.1))
    for _ in range(3):
        p.sum().backward()
        opt.step()
        sched.step()
    random.random(), np.random.rand()
    ckpt = {
        "epoch": 1, "global_step": 3, "pytorch-lightning_version": "2.6.6",
        "state_dict": {"head.w": torch.randn(4, 3), "head.bf": torch.randn(5).bfloat16(),
                       "head.i": torch.arange(3), "head.view": p.data[1:], "head.empty": torch.zeros(0)},
        "optimizer_states": [opt.state_dict()], "lr_schedulers": [sched.state_dict()],
        "rng_states": _collect_rng_states(include_cuda=False),
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 2, "completed": 1}}}},
        "callbacks": {"ModelCheckpoint{'monitor': 'val/loss'}": {"best_model_score": torch.tensor(0.5),
                                                                 "best_k_models": {"a.ckpt": torch.tensor(1.0)},
                                                                 "dirpath": "/x", "kth_value": float("inf")}},
        "misc": {1: (1, 2.5, None, True, "s"), "dtype": torch.bfloat16, "size": torch.Size([2, 3]),
                 "np": np.float32(1.5), "nan": float("nan")},
    }
    io = SafetensorsCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint(ckpt, path)
    assert path.read_bytes()[:8] != b"PK\x03\x04"  # not a torch.save zip / pickle
    back = io.load_checkpoint(path)

    def same(a, b, where="ckpt"):
        assert type(a) is type(b), where
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
        elif isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), where
        elif isinstance(a, dict):
            assert list(a) == list(b), where
            for k in a:
                same(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"{where}[{i}]")
        elif isinstance(a, float) and math.isnan(a):
            assert math.isnan(b), where
        else:
            assert a == b, where

    same(ckpt, back)
    # the loaded states restore the optimizer and scheduler exactly
    opt2 = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()), torch.nn.Parameter(torch.zeros(3))])
    opt2.load_state_dict(back["optimizer_states"][0])
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, WarmupDecay("cosine", 2, 10, 0.1))
    sched2.load_state_dict(back["lr_schedulers"][0])
    assert sched2.get_last_lr() == sched.get_last_lr()
    # RNG states restore the streams
    from lightning.fabric.utilities.seed import _set_rng_states

    expected = (torch.rand(3), random.random(), np.random.rand())
    _set_rng_states(back["rng_states"])
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1] and np.random.rand() == expected[2]
    # atomic: a failing write leaves the previous file intact and no temporary behind
    before = path.read_bytes()
    with pytest.raises(TypeError, match=r"checkpoint\.bad"):
        io.save_checkpoint({"bad": object()}, path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    bogus = tmp_path / "x.ckpt"
    bogus.write_bytes(b"\x00" * 16)
    with pytest.raises(OSError, match=r"x.ckpt: not a readable checkpoint \(not a safetensors file"):
        io.load_checkpoint(bogus)


def test_validation_aggregation_equals_brute_force(tiny_base, tiny_cache, tmp_path):
    from train.data import CacheDataModule
    from train.module import DraftHeadModule
    from train.run import build_trainer

    cfg = _cfg(tmp_path, tiny_cache, batch_size=4)
    model = tiny_base[0]
    module = DraftHeadModule(cfg.heads, cfg.train, base_model=model)
    assert not any(p is model.model.embed_tokens.weight for p in module.parameters())
    assert set(module.state_dict()) == {"head.proj.weight", "head.proj.bias", "head.norm.weight", "head.norm.bias"}
    dm = CacheDataModule(tiny_cache, pad_id=2, batch_size=4, seed=0)
    trainer, _ = build_trainer(cfg, tmp_path / "run")
    (res,) = trainer.validate(module, datamodule=dm, verbose=False)
    # brute force over the whole held-out split, record by record
    from data_prep.cache import CacheReader

    reader = CacheReader(tiny_cache / "val")
    ce_sum, correct, n = 0.0, 0.0, 0
    batch_means = []
    with torch.no_grad():
        for b in _batches(tiny_cache, batch_size=4):
            logits = module.head.logits(b)
            m = b["loss_mask"]
            ce = F.cross_entropy(logits[m], b["labels"][m], reduction="none").double()
            ce_sum += float(ce.sum())
            correct += float((logits[m].argmax(-1) == b["labels"][m]).sum())
            n += int(m.sum())
            batch_means.append(float(ce.mean()))
    assert n == sum(int(reader[i]["loss_mask"].sum()) for i in range(len(reader)))
    assert res["val/loss"] == pytest.approx(ce_sum / n, rel=1e-5)
    assert res["val/acc"] == pytest.approx(correct / n, rel=1e-6)
    assert res["val/batch_mean"] == pytest.approx(sum(batch_means) / len(batch_means), rel=1e-5)
    assert abs(ce_sum / n - sum(batch_means) / len(batch_means)) > 1e-4  # the test can tell the two apart


def test_train_loss_decreases_and_exports_roundtrip(tiny_base, tiny_cache, tmp_path):
    from train.checkpoint_io import SafetensorsCheckpointIO
    from train.run import train

    cfg = _cfg(tmp_path, tiny_cache, batch_size=4, max_steps=24, val_every_n_steps=8, save_top_k=1)
    result = train(cfg, base=tiny_base)
    run_dir = result["run_dir"]
    assert run_dir == tmp_path / "runs" / "test_probe" / "t"
    assert OmegaConf.load(run_dir / "config.yaml").train.max_steps == 24
    rows = list(csv.DictReader(open(metrics_csv(run_dir))))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    vals = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(losses) == 24 and len(vals) == 3
    assert sum(losses[-4:]) / 4 < 0.7 * sum(losses[:4]) / 4
    assert vals[-1] < vals[0]
    assert any(r.get("train/tokens_per_s") for r in rows) and any(r.get("train/assistant_tokens_per_s") for r in rows)
    # the scheduler: warmup then linear decay to 0 at max_steps
    lrs = [float(r["train/lr"]) for r in rows if r.get("train/lr")]
    assert lrs[0] == pytest.approx(0.02 / 3) and lrs[2] == pytest.approx(0.02) and lrs[-1] < 0.02 * 0.1

    ckpt_cb = result["checkpoint_callback"]
    best_ckpt = SafetensorsCheckpointIO().load_checkpoint(ckpt_cb.best_model_path)
    assert float(ckpt_cb.best_model_score) == pytest.approx(min(vals))
    batch = _batches(tiny_cache)[0]
    for name in ("best", "last"):
        d = run_dir / name
        assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]
        head, meta = heads.load(d, base_model=tiny_base[0])
        assert meta["head_type"] == "test_probe" and meta["extra"]["checkpoint"] == name
        if name == "last":
            ref = result["module"].head
            assert meta["extra"]["global_step"] == 24
        else:
            from train.module import DraftHeadModule

            ref = DraftHeadModule(cfg.heads, cfg.train, base_model=tiny_base[0])
            ref.load_state_dict(best_ckpt["state_dict"])
            ref = ref.head
            assert meta["extra"]["score"] == pytest.approx(min(vals))
        with torch.no_grad():
            assert torch.equal(head.logits(batch), ref.logits(batch))
    # the last resume checkpoint resumes: Lightning restores the step and the optimizer
    last_ckpt = SafetensorsCheckpointIO().load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert last_ckpt["global_step"] == 24 and "rng_states" in last_ckpt
    # a fresh run into the same directory refuses (nothing is overwritten); resume=auto is the way on
    from core.config import UserInputError

    before = (run_dir / "best" / "model.safetensors").read_bytes()
    with pytest.raises(UserInputError, match=r"already holds a run \(best/model.safetensors, checkpoints/.*resume=auto"):
        train(cfg, base=tiny_base)
    assert (run_dir / "best" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == sorted(
        p.name for p in (run_dir / "checkpoints").iterdir() if "-v" not in p.name)
    assert last_ckpt["optimizer_states"][0]["state"][0]["step"] == 24


def test_bad_head_value_is_a_user_error_before_any_run_dir(tiny_base, tiny_cache, tmp_path):
    """A bad ``heads`` value (caught by the head's constructor) is a one-line UserInputError, raised
    before the run directory is created."""
    from core.config import UserInputError
    from train.run import train

    cfg = _cfg(tmp_path, tiny_cache, max_steps=1)
    with open_dict(cfg):
        cfg.heads = OmegaConf.create({"type": "falcon", "glancing": {"glanced_in_loss": "maybe"}})
    with pytest.raises(UserInputError, match="heads.glancing.glanced_in_loss: must be true or false"):
        train(cfg, base=tiny_base)
    assert not (tmp_path / "runs").exists()


def test_train_config_errors():
    for bad, match in [("train.optimizer.lr=0", "lr"), ("train.scheduler.name=step", "scheduler.name"),
                       ("train.logger=tensorboard", "train.logger"), ("train.no_such_key=1", "no_such_key"),
                       ("train.grad_clip.algorithm=l2", "algorithm"), ("train.max_tokens=0", "max_tokens"),
                       ("train.run_name=a/b", "run_name"), ("train.precision=8-bit", "precision"),
                       ("train.optimizer.betas=[0.9,1.5]", "betas"), ("train.devices=zero", "devices")]:
        with pytest.raises(ConfigError, match=match):
            compose([bad])
    with pytest.raises(ConfigError, match="both null"):
        compose(["train.batch_size=null"])
    cfg = compose(["train.max_tokens=4096", "train.batch_size=null", "train.logger=none", "train.precision=bf16-mixed"])
    assert cfg.train.max_tokens == 4096


def test_resume_at_epoch_end_is_exact(tiny_base, tiny_cache, tmp_path):
    """12 steps in one go == 6 steps, stop, resume from last.ckpt to 12 (6 batches per epoch)."""
    import lightning.pytorch as pl

    from train.run import train

    class StopAt(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 6:
                trainer.should_stop = True

    common = dict(batch_size=4, max_steps=12, val_every_n_steps=6, save_top_k=1)
    full = train(_cfg(tmp_path / "a", tiny_cache, **common), base=tiny_base)
    assert full["trainer"].num_training_batches == 6
    part = train(_cfg(tmp_path / "b", tiny_cache, **common), base=tiny_base, callbacks=[StopAt()])
    assert part["trainer"].global_step == 6
    last = part["run_dir"] / "checkpoints" / "last.ckpt"
    resumed = train(_cfg(tmp_path / "c", tiny_cache, **common), base=tiny_base, ckpt_path=str(last))
    assert resumed["trainer"].global_step == 12
    a, c = full["module"].head.state_dict(), resumed["module"].head.state_dict()
    assert not torch.equal(a["proj.weight"], part["module"].head.state_dict()["proj.weight"])
    for k in a:
        assert torch.equal(a[k], c[k]), k


def test_cli_bad_key_exits_2(capsys):
    from train.run import main

    with pytest.raises(SystemExit) as exc:
        main(["train.optimizer.lrr=1"])
    assert exc.value.code == 2 and "train.optimizer.lrr" in capsys.readouterr().err


def test_loggers(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    from train.run import build_loggers

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no credentials anywhere: offline
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    cfg = compose(["train.logger=wandb"])
    loggers = build_loggers(cfg, tmp_path)
    assert isinstance(loggers[0], CSVLogger) and isinstance(loggers[1], WandbLogger) and len(loggers) == 2
    import os

    assert os.environ["WANDB_MODE"] in ("offline", "dryrun") and loggers[1]._offline
    assert loggers[1]._experiment is None  # nothing started before training
    assert build_loggers(compose(["train.logger=none"]), tmp_path) == []



def test_warmup_decay_schedule():
    from train.module import WarmupDecay

    cos = WarmupDecay("cosine", warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [cos(s) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert cos(4) == pytest.approx(1.0) and cos(14) == pytest.approx(0.1) and cos(40) == pytest.approx(0.1)
    assert cos(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way: cos(pi/2)
    lin = WarmupDecay("linear", 0, 10)
    assert lin(0) == 1.0 and lin(5) == pytest.approx(0.5) and lin(10) == 0.0
    assert WarmupDecay("constant", 1, 10)(7) == 1.0
    with pytest.raises(ValueError, match="unknown schedule"):
        WarmupDecay("step", 0, 10)


def test_draft_vocab_train_export_and_errors(tiny_base, tiny_cache, tmp_path):
    """``heads.draft_vocab_size`` through ``python -m train``'s code path: the mapping comes from
    the cache's training labels (scanned: this cache has no counts file), is exported with the head
    and reloads; N > V and unscannable caches are one-line UserInputErrors before any run dir."""
    import shutil

    import heads as heads_mod
    from core.config import UserInputError
    from data_prep.label_counts import scan_split
    from heads.draft_vocab import select_d2t
    from train.run import train

    V = tiny_base[0].config.vocab_size
    for bad, match in ([V + 1, f"draft_vocab_size={V + 1}"], [1, "draft_vocab_size=1"]):
        cfg = _cfg(tmp_path / "bad", tiny_cache, max_steps=1)
        with open_dict(cfg):
            cfg.heads = OmegaConf.create({"type": "falcon", "draft_vocab_size": bad})
        with pytest.raises(UserInputError, match=match):
            train(cfg, base=tiny_base)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_cache, broken)
    shard = sorted((broken / "train").glob("shard-*.safetensors"))[0]
    shard.unlink()
    cfg = _cfg(tmp_path / "bad", broken, max_steps=1)
    with open_dict(cfg):
        cfg.heads = OmegaConf.create({"type": "ctc", "draft_vocab_size": 64})
    with pytest.raises((UserInputError, FileNotFoundError), match=shard.name):
        train(cfg, base=tiny_base)
    assert not (tmp_path / "bad" / "runs").exists()

    cfg = _cfg(tmp_path, tiny_cache, max_steps=2, val_every_n_steps=2)
    with open_dict(cfg):
        cfg.heads = OmegaConf.create({"type": "ctc", "draft_vocab_size": 64, "attn_implementation": "eager"})
    result = train(cfg, base=tiny_base)
    head, meta = heads_mod.load(result["run_dir"] / "last", base_model=tiny_base[0])
    counts = scan_split(tiny_cache / "train")
    assert torch.equal(head.d2t, select_d2t(counts, 64))
    assert meta["head"]["draft_vocab"]["cache"] == str(tiny_cache)
    assert meta["head"]["draft_vocab"]["train_coverage"] == pytest.approx(float(counts[head.d2t].sum() / counts.sum()))
    rows = list(csv.DictReader(open(metrics_csv(result["run_dir"]))))
    assert any(r.get("train/oov_rate") not in (None, "") for r in rows)


def test_tokens_seen_replays_the_training_order(tiny_cache):
    """train.data.tokens_seen equals the tokens the train loader really yields, step by step across
    epoch boundaries (1 process), and the two ranks' batches of a 2-process run (each rank's sampler)."""
    from train.data import CacheDataModule, ShardedBatchSampler, record_lengths, tokens_seen

    dm = CacheDataModule(tiny_cache, pad_id=2, batch_size=3, seed=1)
    dm.setup()
    lengths, batches = record_lengths(dm.train_reader), dm.train_batches
    loader = dm.train_dataloader()
    per_step = []
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        per_step += [int(b["attention_mask"].sum()) for b in loader]
    n = len(per_step)
    assert n == 3 * len(batches) and len(set(per_step)) > 1
    for steps in (0, 1, len(batches) - 1, len(batches), len(batches) + 2, n):
        assert tokens_seen(lengths, batches, steps, seed=1) == sum(per_step[:steps]), steps
    # two ranks, accumulation window 2: a step is 2 micro-batches on each rank
    ranks = [ShardedBatchSampler(len(batches), 2, r, True, 1, window=2) for r in range(2)]
    seen = 0
    for epoch in range(2):
        for s in ranks:
            s.set_epoch(epoch)
            seen += sum(lengths[i] for b in s for i in batches[b])
    steps = 2 * len(ranks[0]) // 2
    assert tokens_seen(lengths, batches, steps, seed=1, world_size=2, window=2) == seen
    with pytest.raises(ValueError, match="steps=-1"):
        tokens_seen(lengths, batches, -1, seed=1)
