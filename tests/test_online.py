"""train.features=online|hybrid (train/online.py) and fp8 cache storage (data_prep/fp8.py), issue 17.

The reference is always the offline path: a data-prep cache of the same conversations (its batch
dict), or an uninterrupted run.  Tiny Llama, tiny ShareGPT file, single process (the 2-rank DDP
check is in tests/test_online_distributed.py).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.config import UserInputError, compose
from data_prep import cache as cache_mod
from data_prep import fp8, pipeline
from train.data import CacheDataModule, open_split
from train import online

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from _distributed_worker import run_one  # noqa: E402  (registers the test_dist head)
from test_data_prep import WORDS, _conversations  # noqa: E402

ONLINE = ["labels=teacher_forced", "data.max_conversations=null", "data.heldout_fraction=0.25", "data.max_length=96",
          "prep.layers=[2]", "prep.progress=false", "prep.shard_size=4", "prep.batch_tokens=150"]
TRAIN = ["train.batch_size=3", "train.val_every_n_steps=3", "train.scheduler.warmup_steps=2",
         "train.optimizer.lr=0.01", "train.devices=1", "strategy=auto"]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("online_data") / "data.json"
    path.write_text(json.dumps(_conversations(22)))
    return path


def _cfg(tiny_model_dir, data_file, out, *extra):
    return compose([f"model.path={tiny_model_dir}", "model.dtype=float32", "model.attn_implementation=eager",
                    f"data.path={data_file}", f"output_root={out}", *ONLINE, *extra])


def _setup(dm):
    dm.setup("fit")
    return dm


# ----------------------------------------------------------------------------------------------
# online batch == offline batch
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_online_batch_equals_offline_batch(tiny_base, tiny_model_dir, data_file, tmp_path, dtype):
    model, tok, ident = tiny_base
    cfg = _cfg(tiny_model_dir, data_file, tmp_path, f"prep.dtype={dtype}", "train.batch_size=4")
    pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    root = cache_mod.default_cache_dir(cfg)
    offline = _setup(CacheDataModule(root, 2, batch_size=4, seed=0, train_reader=open_split(root, "train"),
                                     val_reader=open_split(root, "val")))
    dm, features = online.online_datamodule(cfg, model, tok, ident.to_dict())
    _setup(dm)
    assert dm.train_batches == offline.train_batches and dm.val_batches == offline.val_batches
    n = 0
    for split, a_loader, b_loader in (("train", offline.train_dataloader(), dm.train_dataloader()),
                                      ("val", offline.val_dataloader(), dm.val_dataloader())):
        for ref, tokens in zip(a_loader, b_loader):
            assert "hidden" not in tokens
            got = features(tokens)
            assert got["ids"] == ref["ids"]
            for key in ("input_ids", "attention_mask", "loss_mask", "labels", "lengths"):
                assert torch.equal(got[key], ref[key]), (split, key)
            assert got["hidden"].dtype == ref["hidden"].dtype == (torch.bfloat16)
            assert sorted(got["aux_hidden"]) == sorted(ref["aux_hidden"]) == [2]
            for a, b in ((got["hidden"], ref["hidden"]), (got["aux_hidden"][2], ref["aux_hidden"][2])):
                a, b = a.float(), b.float()
                # within the storage dtype's resolution (batch composition changes fp32 sums by ~1e-7,
                # which can move a value across one rounding boundary); padding stays exactly zero
                step = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -3
                tol = step * b.abs().amax(-1, keepdim=True) + 1e-6
                assert bool(((a - b).abs() <= tol).all()), split
                assert float((a == b).float().mean()) > 0.99
                assert not bool(a[~ref["attention_mask"]].any())
            n += 1
    assert n == len(offline.train_batches) + len(offline.val_batches)


# ----------------------------------------------------------------------------------------------
# training runs: online, hybrid, hybrid killed mid-epoch and resumed
# ----------------------------------------------------------------------------------------------
class Crash(RuntimeError):
    pass


def _train(tiny_model_dir, tiny_base, data_file, work: Path, name: str, *extra, crash_at=None):
    """Train the test_dist head; returns (run_dir, [(epoch, batch_idx, had_hidden, ids)])."""
    import train.run as run_mod
    from lightning.pytorch.callbacks import Callback

    seen = []

    class Record(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if crash_at is not None and trainer.global_step >= crash_at:
                raise Crash(f"simulated kill after step {crash_at}")
            seen.append((trainer.current_epoch, batch_idx, "hidden" in batch, tuple(batch["ids"])))

    original = run_mod.build_trainer
    run_mod.build_trainer = lambda cfg, run_dir, callbacks=None, **kw: original(cfg, run_dir, [*(callbacks or []), Record()], **kw)
    overrides = [f"model.path={tiny_model_dir}", "model.dtype=float32", f"data.path={data_file}",
                 f"output_root={work}", f"train.run_name={name}", *ONLINE, *TRAIN, *extra]
    try:
        if crash_at is None:
            run_one(str(tiny_model_dir), overrides, base=tiny_base)
        else:
            with pytest.raises(Crash):
                run_one(str(tiny_model_dir), overrides, base=tiny_base)
    finally:
        run_mod.build_trainer = original
    return work / "runs" / "test_dist" / name, seen


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "last" / "model.safetensors")


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tiny_base, data_file, tmp_path_factory):
    work = tmp_path_factory.mktemp("online_runs")
    epochs = ["train.max_steps=18", "train.max_epochs=-1"]
    out = {"work": work}
    out["online"] = _train(tiny_model_dir, tiny_base, data_file, work, "online", "train.features=online", *epochs)
    out["hybrid"] = _train(tiny_model_dir, tiny_base, data_file, work, "hybrid", "train.features=hybrid",
                           f"train.cache_dir={work / 'hy_cache'}", *epochs)
    return out


def test_hybrid_second_epoch_reads_the_cache_and_equals_online(runs, tiny_base):
    (on_dir, on_seen), (hy_dir, hy_seen) = runs["online"], runs["hybrid"]
    assert [s[3] for s in on_seen] == [s[3] for s in hy_seen]  # the same batches in the same order
    assert {s[0] for s in hy_seen} == {0, 1, 2}
    assert not any(s[2] for s in on_seen)  # online: every batch computed by the base
    assert all(s[2] == (s[0] > 0) for s in hy_seen)  # hybrid: epoch 0 computed, later epochs read
    # identical features -> identical losses at every step and identical final weights
    from train.run import metrics_csv
    import csv

    loss = lambda d: [r["train/loss"] for r in csv.DictReader(open(metrics_csv(d))) if r.get("train/loss")]  # noqa: E731
    assert loss(on_dir) == loss(hy_dir) and len(loss(on_dir)) == len(on_seen)
    a, b = _weights(on_dir), _weights(hy_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the hybrid cache is a complete data-prep cache: one intact shard per batch, readable offline
    cache = runs["work"] / "hy_cache"
    for split in ("train", "val"):
        reader = cache_mod.CacheReader(cache / split, verify=True)
        assert reader.manifest["mode"] == "hybrid" and reader.manifest["layers"] == [2]
    n_train = len({s[1] for s in hy_seen})
    assert cache_mod.CacheReader(cache / "train").manifest["num_shards"] == n_train


def test_hybrid_cached_batch_gives_the_online_loss(runs, tiny_base, tiny_model_dir, data_file):
    """Batch for batch, with the same head weights, the cached batch and the online batch give the same loss."""
    import heads
    from heads.base import Progress

    model = tiny_base[0]
    cfg = _cfg(tiny_model_dir, data_file, runs["work"], *TRAIN, "train.features=hybrid",
               f"train.cache_dir={runs['work'] / 'hy_cache'}")
    dm, features = online.online_datamodule(cfg, model, tiny_base[1], tiny_base[2].to_dict())
    _setup(dm)
    head = heads.build({"type": "test_dist", "init_seed": 3}, model)
    cached = dm.train_dataloader().dataset
    assert all(cached.cache.has("train", k) for k in range(len(dm.train_batches)))
    for k in range(len(dm.train_batches)):
        from_cache = cached[k]
        assert "hidden" in from_cache and "hybrid_shard" not in from_cache
        fresh = features(online.collate_tokens([dm.train_reader[i] for i in dm.train_batches[k]], dm.pad_id))
        p = Progress(step=0, total_steps=1, epoch=0, total_epochs=1)
        assert torch.equal(head.training_loss(from_cache, p)[0], head.training_loss(fresh, p)[0])


def test_hybrid_killed_mid_epoch_resumes_to_the_same_weights(runs, tiny_model_dir, tiny_base, data_file):
    work = runs["work"]
    common = ["train.features=hybrid", f"train.cache_dir={work / 'kill_cache'}", "train.max_steps=18",
              "train.max_epochs=-1"]
    part, seen = _train(tiny_model_dir, tiny_base, data_file, work, "killed", *common, crash_at=4)
    assert (part / "checkpoints" / "last.ckpt").is_file() and seen and all(s[0] == 0 for s in seen)
    shards = work / "kill_cache" / "train"
    written = sorted(shards.glob("shard-*.safetensors"))
    assert len(written) == 4 and not (shards / "manifest.json").exists()  # mid-epoch: 4 of the epoch's batches
    # a torn shard (its bytes no longer match the sidecar) and a stray temp file from a killed write
    written[1].write_bytes(written[1].read_bytes()[:100])
    (shards / ".shard-00005.safetensors.tmp-1").write_bytes(b"partial")
    resumed, seen2 = _train(tiny_model_dir, tiny_base, data_file, work, "killed", *common, "resume=auto")
    assert resumed == part
    a, b = _weights(runs["hybrid"][0]), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    reader = cache_mod.CacheReader(shards, verify=True)  # every shard intact, one per batch
    names = sorted(p.name for p in shards.glob("shard-*.safetensors"))
    assert names == [f"shard-{k:05d}.safetensors" for k in range(reader.manifest["num_shards"])]
    ref = cache_mod.CacheReader(work / "hy_cache" / "train")
    assert [reader[i]["id"] for i in range(len(reader))] == [ref[i]["id"] for i in range(len(ref))]


# ----------------------------------------------------------------------------------------------
# bad input: one-line errors before anything is written
# ----------------------------------------------------------------------------------------------
def _train_cfg(tiny_model_dir, data_file, out, *extra):
    from omegaconf import OmegaConf, open_dict

    cfg = _cfg(tiny_model_dir, data_file, out, *TRAIN, "train.logger=csv", "train.run_name=bad", *extra)
    if not any(e.startswith("heads=") for e in extra):
        with open_dict(cfg):
            cfg.heads = OmegaConf.create({"type": "test_dist", "init_seed": 0})
    return cfg


@pytest.mark.parametrize("extra, match", [
    (["train.features=online", "labels=regenerate"], "labels=regenerate needs the base's regenerated text"),
    (["train.features=hybrid", "labels=regenerate"], "python -m data_prep labels=regenerate"),
    (["train.features=online", "prep.layers=[7]"], r"not intermediate layers of the base .*L=4"),
    (["train.features=hybrid", "data.max_length=4096"],
     r"data.max_length=4096 exceeds the base model's context \(max_position_embeddings=2048\)"),
    (["train.features=online", "heads=adadecode", "heads.layers=[1,3]", "prep.layers=[2]"],
     r"reads hidden states hs\[1, 3\] .* prep.layers=\[1,3\]"),
])
def test_online_bad_input_is_one_line_before_training(tiny_base, tiny_model_dir, data_file, tmp_path, extra, match):
    from train.run import train

    cfg = _train_cfg(tiny_model_dir, data_file, tmp_path, *extra)
    with pytest.raises(UserInputError, match=match):
        train(cfg, base=tiny_base)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


def test_hybrid_cache_of_another_config_is_refused(tiny_base, tiny_model_dir, data_file, tmp_path):
    model, tok, ident = tiny_base
    cache_dir = tmp_path / "hy"
    cfg = _cfg(tiny_model_dir, data_file, tmp_path, *TRAIN, "train.features=hybrid", f"train.cache_dir={cache_dir}")
    dm, features = online.online_datamodule(cfg, model, tok, ident.to_dict())
    _setup(dm)
    features(next(iter(dm.train_dataloader())))  # writes one shard
    assert len(list((cache_dir / "train").glob("shard-*.safetensors"))) == 1
    before = sorted(p.name for p in cache_dir.rglob("*"))
    for change, key in (("train.batch_size=2", "batching.batch_size: 3 -> 2"), ("prep.dtype=float16", "prep.dtype"),
                        ("data.max_length=64", "data.max_length: 96 -> 64")):
        other = _cfg(tiny_model_dir, data_file, tmp_path, *TRAIN, "train.features=hybrid",
                     f"train.cache_dir={cache_dir}", change)
        with pytest.raises(UserInputError, match=f"hybrid cache {cache_dir} was written under other settings .*{key}"):
            online.online_datamodule(other, model, tok, ident.to_dict())
    # an offline cache directory is not a hybrid cache either
    offline_dir = tmp_path / "offline"
    (offline_dir / "train").mkdir(parents=True)
    other = _cfg(tiny_model_dir, data_file, tmp_path, *TRAIN, "train.features=hybrid", f"train.cache_dir={offline_dir}")
    with pytest.raises(UserInputError, match="not a hybrid cache"):
        online.online_datamodule(other, model, tok, ident.to_dict())
    assert sorted(p.name for p in cache_dir.rglob("*")) == before


def test_fp8_on_a_torch_without_it_is_refused_before_writing(tiny_base, tiny_model_dir, data_file, tmp_path, monkeypatch):
    from train.run import train

    model, tok, ident = tiny_base
    monkeypatch.delattr(torch, "float8_e4m3fn")
    cfg = _cfg(tiny_model_dir, data_file, tmp_path, "prep.dtype=float8_e4m3fn")
    with pytest.raises(UserInputError, match=r"prep.dtype=float8_e4m3fn needs torch.float8_e4m3fn.*prep.dtype=bfloat16"):
        pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    with pytest.raises(UserInputError, match="float8_e4m3fn"):
        train(_train_cfg(tiny_model_dir, data_file, tmp_path, "prep.dtype=float8_e4m3fn", "train.features=online"),
              base=tiny_base)
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------------------------
# fp8 storage
# ----------------------------------------------------------------------------------------------
def test_fp8_rows_error_bound_and_cache_roundtrip(tmp_path):
    g = torch.Generator().manual_seed(0)
    # rows whose magnitudes span 6 orders (residual streams do), one outlier channel, one zero row
    x = torch.randn(64, 96, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    x[5, 7] = 2000.0
    x[9] = 0
    q, s = fp8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (64,)
    back = fp8.dequantize_rows(q, s, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, plus bf16 rounding of the result
    assert bool(((back - x).abs() <= 2.0 ** -4 * x.abs() + 2.0 ** -9 * amax + 1e-30).all())
    assert torch.equal(back[9], torch.zeros(96)) and float(s[9]) == 1.0
    # a single global scale (no per-row scale) loses the small rows entirely
    glob = (x / (x.abs().max() / 448)).to(torch.float8_e4m3fn).float() * (x.abs().max() / 448)
    assert float((glob[:8] == 0).float().mean()) > 0.9
    # the cache stores q and the scales; reading gives exactly storage_roundtrip (bf16)
    recs = [{"id": "a", "input_ids": torch.arange(40), "loss_mask": torch.ones(40, dtype=torch.bool),
             "labels": torch.arange(40), "hidden": {4: x[:40], 2: x[40:] .repeat(2, 1)[:40]}},
            {"id": "b", "input_ids": torch.arange(24), "loss_mask": torch.ones(24, dtype=torch.bool),
             "labels": torch.arange(24), "hidden": {4: x[40:], 2: x[:24]}}]
    for name in ("float8_e4m3fn", "bfloat16"):
        d = tmp_path / name
        d.mkdir()
        tensors = cache_mod.build_shard_tensors(recs, [2], 4, fp8.storage_dtype(name))
        entry = cache_mod.write_shard(d, 0, tensors, ["a", "b"], {"config_hash": "t", "dropped": {}})
        cache_mod.write_manifest(d, 1, {"config_hash": "t", "layers": [2], "final_layer": 4, "pad_id": 0})
        reader = cache_mod.CacheReader(d, verify=True)
        for i, r in enumerate(recs):
            assert torch.equal(reader[i]["hidden"], fp8.storage_roundtrip(r["hidden"][4], name))
            assert torch.equal(reader[i]["aux_hidden"][2], fp8.storage_roundtrip(r["hidden"][2], name))
        if name == "float8_e4m3fn":
            assert sorted(tensors) == ["aux_hidden.2", "aux_hidden_scale.2", "hidden", "hidden_scale", "input_ids",
                                       "labels", "loss_mask", "offsets"]
            fp8_bytes = entry["bytes"]
        else:
            # fp8 + one fp32 scale per row: (H + 4) / 2H of bf16's hidden bytes
            assert fp8_bytes < 0.6 * entry["bytes"]


def test_online_auto_draft_vocab_is_the_full_vocabulary_and_explicit_n_is_refused(
        tiny_base, tiny_model_dir, data_file, tmp_path, monkeypatch):
    """Online training has no label counts before the base runs: ``heads.draft_vocab_size=auto``
    (the configs' default) trains over the full vocabulary, and an explicit N is a one-line error
    before anything is written.  AUTO_SIZE is lowered below the tiny vocabulary (V=384) so that
    ``auto`` would otherwise ask for a subset."""
    import heads.draft_vocab as dv
    from train.run import train

    monkeypatch.setattr(dv, "AUTO_SIZE", 64)
    with pytest.raises(UserInputError, match="heads.draft_vocab_size"):
        train(_train_cfg(tiny_model_dir, data_file, tmp_path / "n", "train.features=online", "heads=ctc",
                         "heads.draft_vocab_size=64"), base=tiny_base)
    assert not (tmp_path / "n" / "runs").exists()
    cfg = _train_cfg(tiny_model_dir, data_file, tmp_path / "auto", "train.features=online", "heads=ctc",
                     "train.max_steps=1")
    assert cfg.heads.draft_vocab_size == "auto"
    train(cfg, base=tiny_base)
    exported = json.loads(next((tmp_path / "auto" / "runs").glob("*/bad/last/config.json")).read_text())
    assert exported["head"]["draft_vocab_size"] is None


def test_online_records_are_the_cache_records_when_a_turn_is_dropped(tiny_base, tiny_model_dir, tmp_path):
    """A conversation whose later user turn holds the text of a special token loses that turn, not the
    conversation, in data prep (``turns_dropped_special_token_text``); the online records are the
    cache's records, id for id and token for token, that conversation's first turn included."""
    model, tok, ident = tiny_base
    convs = _conversations(12)
    convs.insert(5, {"id": "special-turn", "conversations": [
        {"from": "human", "value": WORDS[0]}, {"from": "gpt", "value": " ".join(WORDS[1:4])},
        {"from": "human", "value": f"{WORDS[4]} <|im_end|> {WORDS[5]}"}, {"from": "gpt", "value": WORDS[6]}]})
    path = tmp_path / "data.json"
    path.write_text(json.dumps(convs))
    cfg = _cfg(tiny_model_dir, path, tmp_path)
    pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    root = cache_mod.default_cache_dir(cfg)
    records = online.tokenize_split(cfg, tok, model)
    seen = set()
    for split in ("train", "val"):
        reader = open_split(root, split)
        cached = {r["id"]: r for r in (reader[i] for i in range(len(reader)))}
        got = {r["id"]: r for r in records[split].records}
        assert sorted(got) == sorted(cached), split
        for cid, r in got.items():
            assert torch.equal(r["input_ids"], cached[cid]["input_ids"]) and torch.equal(r["loss_mask"], cached[cid]["loss_mask"])
        seen |= set(got)
    assert "special-turn" in seen  # kept without its second turn, as data prep keeps it
