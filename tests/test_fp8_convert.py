"""``python -m data_prep.fp8_convert``: an fp8 copy of an existing cache without a base forward (issue 17).

The reference is the source cache itself (tiny Llama, tiny ShareGPT file, bf16 data prep): the copy's
ids, tokens, labels and masks are bit-identical, its hidden states are exactly the source's
quantised per row (:func:`data_prep.fp8.storage_roundtrip`) and within the e4m3 bound of them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from core.config import UserInputError, compose
from data_prep import cache as cache_mod
from data_prep import fp8, fp8_convert, label_counts, pipeline
from train.data import CacheDataModule, open_split

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_data_prep import _conversations  # noqa: E402

PREP = ["labels=teacher_forced", "data.max_conversations=null", "data.heldout_fraction=0.25", "data.max_length=96",
        "prep.layers=[2]", "prep.progress=false", "prep.shard_size=4", "prep.batch_tokens=150", "prep.dtype=bfloat16"]


@pytest.fixture(scope="module")
def source(tiny_base, tiny_model_dir, tmp_path_factory) -> tuple[Path, object]:
    """A complete bf16 cache of 22 tiny conversations (several shards per split) and its config."""
    work = tmp_path_factory.mktemp("fp8_convert_src")
    data = work / "data.json"
    data.write_text(json.dumps(_conversations(22)))
    cfg = compose([f"model.path={tiny_model_dir}", "model.dtype=float32", "model.attn_implementation=eager",
                   f"data.path={data}", f"output_root={work}", f"prep.cache_dir={work / 'bf16'}", *PREP])
    model, tok, ident = tiny_base
    pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    return work / "bf16", cfg


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("fp8_convert_dst") / "fp8"
    fp8_convert.convert_cache(source[0], dst, out=None)
    return dst


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_copy_is_the_source_quantised_row_by_row(source, converted):
    src = source[0]
    for split in ("train", "val"):
        a, b = cache_mod.CacheReader(src / split), cache_mod.CacheReader(converted / split, verify=True)
        assert len(a) == len(b) > 0
        assert [e["records"] for e in a.manifest["shards"]] == [e["records"] for e in b.manifest["shards"]]
        for key in ("num_records", "num_tokens", "num_assistant_tokens", "dropped", "layers", "final_layer", "pad_id",
                    "base", "labels", "split"):
            assert a.manifest[key] == b.manifest[key], key
        assert b.manifest["dtypes"]["hidden"] == "float8_e4m3fn" and b.manifest["dtypes"]["hidden_scale"] == "float32"
        assert b.manifest["converted_from"]["dtype"] == "bfloat16"
        for i in range(len(a)):
            ra, rb = a[i], b[i]
            assert ra["id"] == rb["id"]
            for key in ("input_ids", "loss_mask", "labels"):
                assert torch.equal(ra[key], rb[key]), key
            for x, y in ((ra["hidden"], rb["hidden"]), *((ra["aux_hidden"][l], rb["aux_hidden"][l]) for l in a.layers)):
                assert x.dtype == y.dtype == torch.bfloat16
                # exactly what the reader of a cache written in fp8 from these values returns
                assert torch.equal(y, fp8.storage_roundtrip(x, "float8_e4m3fn"))
                # the e4m3 bound: 2^-4 relative on normals, plus the bf16 rounding of the result and
                # e4m3's subnormal step (2^-9 of the row max)
                xf, yf = x.float(), y.float()
                amax = xf.abs().amax(-1, keepdim=True)
                assert bool(((yf - xf).abs() <= 2.0 ** -4 * xf.abs() + 2.0 ** -9 * amax + 2.0 ** -8 * yf.abs()).all())
        # the label counts are the source's (labels copied bit for bit)
        assert torch.equal(label_counts.load_counts(converted / split, scan=False), label_counts.load_counts(src / split))
    # half the bytes (H = 64 here: (H + 4) / 2H of bf16's hidden bytes plus the token columns)
    summary = json.loads((converted / "summary.json").read_text())
    assert summary["bytes"] < 0.6 * json.loads((src / "summary.json").read_text())["bytes"]
    marker = json.loads((converted / fp8_convert.MARKER).read_text())
    for kind in ("hidden", "aux_hidden"):
        e = marker["errors"][kind]
        assert 0 < e["mean_err_over_rowmax"] < e["max_err_over_rowmax"] <= 2.0 ** -4 + 2.0 ** -8
        assert e["values"] == summary["tokens"] * 64


def test_config_hash_is_data_preps_for_fp8(source, converted):
    """The copy is the cache ``python -m data_prep ... prep.dtype=float8_e4m3fn`` defines."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(source[1], {"prep": {"dtype": "float8_e4m3fn"}})
    want = cache_mod.cache_hash(cfg)
    assert want != cache_mod.cache_hash(source[1])
    for split in ("train", "val"):
        assert json.loads((converted / split / "manifest.json").read_text())["config_hash"] == want
    saved = OmegaConf.load(converted / "config.yaml")
    assert saved.prep.dtype == "float8_e4m3fn" and cache_mod.cache_hash(saved) == want


def test_batches_equal_the_source_within_fp8_tolerance(source, converted):
    dms = []
    for root in (source[0], converted):
        dm = CacheDataModule(root, 2, batch_size=3, seed=0, train_reader=open_split(root, "train"),
                             val_reader=open_split(root, "val"))
        dm.setup()
        dms.append(dm)
    assert dms[0].train_batches == dms[1].train_batches and dms[0].val_batches == dms[1].val_batches
    n = 0
    for la, lb in ((dms[0].train_dataloader(), dms[1].train_dataloader()),
                   (dms[0].val_dataloader(), dms[1].val_dataloader())):
        for a, b in zip(la, lb):
            assert a["ids"] == b["ids"]
            for key in ("input_ids", "attention_mask", "loss_mask", "labels", "lengths"):
                assert torch.equal(a[key], b[key]), key
            for x, y in ((a["hidden"], b["hidden"]), (a["aux_hidden"][2], b["aux_hidden"][2])):
                x, y = x.float(), y.float()
                assert bool(((y - x).abs() <= 2.0 ** -3 * x.abs().amax(-1, keepdim=True) + 1e-6).all())
                assert not bool(y[~a["attention_mask"]].any())
                assert float((x == y).float().mean()) < 1.0  # it is a different (lossy) storage
            n += 1
    assert n == len(dms[0].train_batches) + len(dms[0].val_batches)


def test_the_converted_cache_trains(source, converted, tiny_base, tmp_path):
    from train.run import train

    cfg = compose([f"model.path={source[1].model.path}", "model.dtype=float32", "heads=ctc",
                   "heads.attn_implementation=eager", "heads.anchors_per_seq=8", "heads.val_anchors_per_seq=8",
                   "train.logger=csv", "train.progress_bar=false", "train.sanity_val_steps=0",
                   f"output_root={tmp_path}", f"train.cache_dir={converted}", "train.run_name=t",
                   "train.accelerator=cpu", "train.devices=1", "train.batch_size=4", "train.max_steps=3",
                   "train.val_every_n_steps=3", "train.scheduler.warmup_steps=1", "train.optimizer.lr=0.01"])
    out = train(cfg, base=tiny_base)
    vals = out["module"].validation_results
    assert int(out["trainer"].global_step) == 3 and torch.isfinite(torch.tensor(vals["loss"]))
    assert vals["sim_tau"] >= 1.0
    assert (out["run_dir"] / "last" / "model.safetensors").is_file()


def test_an_interrupted_conversion_resumes_to_the_same_bytes(source, converted, tmp_path, monkeypatch):
    dst = tmp_path / "fp8"
    real = cache_mod.write_shard
    calls = []

    def crash_after_two(*a, **k):
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(cache_mod, "write_shard", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        fp8_convert.convert_cache(source[0], dst, out=None)
    monkeypatch.setattr(cache_mod, "write_shard", real)
    assert not (dst / "train" / "manifest.json").exists()
    # a torn shard (killed mid-write by something other than this process) is rewritten, not trusted
    torn = dst / "train" / "shard-00001.safetensors"
    torn.write_bytes(torn.read_bytes()[:100])
    summary = fp8_convert.convert_cache(source[0], dst, out=None)
    n_train = summary["splits"]["train"]["shards"]
    assert summary["splits"]["train"]["converted"] == n_train - 1  # shard 0 was kept, shard 1 rewritten
    got, want = _tree(dst), _tree(converted)
    assert sorted(got) == sorted(want)
    assert all(got[k] == want[k] for k in want if k != "config.yaml")  # config.yaml names its own cache_dir
    # the error summary covers every shard, also those converted before the interruption
    assert json.loads((dst / fp8_convert.MARKER).read_text())["errors"] == \
        json.loads((converted / fp8_convert.MARKER).read_text())["errors"]
    # a second run converts nothing
    assert fp8_convert.convert_cache(source[0], dst, out=None)["splits"]["train"]["converted"] == 0


def _refused(src, dst, match, before=None):
    with pytest.raises(UserInputError, match=match):
        fp8_convert.convert_cache(src, dst, out=None)
    if before is not None:
        assert _tree(dst) == before


def test_refusals_name_the_file_and_write_nothing(source, converted, tmp_path, monkeypatch):
    src = source[0]
    # already fp8
    _refused(converted, tmp_path / "a", r"fp8/train/manifest.json: the cache is already stored in float8_e4m3fn")
    assert not (tmp_path / "a").exists()
    # a foreign, non-empty output directory
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    _refused(src, foreign, r"output .*foreign is not empty and holds no fp8_conversion.json", _tree(foreign))
    # the conversion of another source
    other = tmp_path / "other_src"
    import shutil

    shutil.copytree(src, other)
    (other / "val" / "manifest.json").write_text((other / "val" / "manifest.json").read_text().replace('"split"', '"split" ', 1))
    before = _tree(converted)
    _refused(other, converted, r"fp8_conversion.json records a conversion of another source", before)
    # the output inside the source, or the source itself
    _refused(src, src / "fp8", r"overlap")
    assert not (src / "fp8").exists()
    _refused(src, src, r"overlap")
    # an incomplete source
    (other / "val" / "manifest.json").unlink()
    _refused(other, tmp_path / "b", r"other_src/val/manifest.json not found")
    # a corrupt source shard
    shutil.copytree(src, tmp_path / "corrupt")
    shard = tmp_path / "corrupt" / "train" / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    _refused(tmp_path / "corrupt", tmp_path / "c", r"corrupt/train/shard-00000.safetensors: sha256 does not match")
    # a torch without float8
    monkeypatch.delattr(torch, "float8_e4m3fn")
    _refused(src, tmp_path / "d", r"needs torch.float8_e4m3fn")
    for name in "abcd":
        assert not (tmp_path / name).exists()


def test_cli_exit_codes(source, tmp_path, capsys):
    assert fp8_convert.main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: source cache") and "missing" in err[0]
    assert fp8_convert.main([str(source[0]), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "bytes per token" in out and "fp8 vs source hidden: max |err|/row max" in out


# ----------------------------------------------------------------------------------------------
# benchmarks/bench_fp8_tau.py
# ----------------------------------------------------------------------------------------------
def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_fp8_tau

    return bench_fp8_tau


def test_ctc_per_depth_top1_is_the_collapsed_greedy_path():
    """Slot argmaxes [a a ε b ε ε] collapse to [a b]: depths 1, 2 hit targets [a b c], depth 3 misses."""
    from types import SimpleNamespace

    V, blank = 7, 7
    rows = [[1, 1, blank, 2, blank, blank], [blank, 3, 3, 3, 4, 5], [blank] * 6, [2, 1, 2, 1, 2, 1]]
    targets = torch.tensor([[1, 2, 3], [3, 4, 5], [1, 1, 1], [2, 1, 9]])
    logits = torch.full((4, 6, V + 1), -5.0)
    for a, row in enumerate(rows):
        for s, c in enumerate(row):
            logits[a, s, c] = 5.0
    d2t = torch.tensor([10, 11, 12, 13, 14, 15, 16])  # draft index i scores base token 10 + i
    head = SimpleNamespace(head_type="ctc", cfg={"val_anchors_per_seq": 4},
                           forward_batch=lambda batch, step, n: {"slot_logits": logits, "targets": targets + 10},
                           to_base_ids=lambda ids: d2t[ids])
    p = _bench().slot_predictions(head, {})
    assert torch.equal(p["argmax"], torch.tensor(rows))
    # anchor 0: [1 2] vs [1 2 3] -> 1 1 0; anchor 1: [3 4 5] -> 1 1 1; anchor 2: [] -> 0 0 0;
    # anchor 3: [2 1 2 1 2 1] vs [2 1 9] -> 1 1 0
    assert p["hits"].tolist() == [3, 3, 1] and p["counts"].tolist() == [4, 4, 4]
    agree = _bench().agreement([p["argmax"]], [torch.tensor(rows[:3] + [[2, 1, 2, 1, 2, blank]])], [None])
    assert agree == {"agree_slot0": 1.0, "agree_slot1": 1.0, "agree_slot2": 1.0, "agree_slot3": 1.0,
                     "agree_slot4": 1.0, "agree_slot5": 0.75}


def test_bench_fp8_tau_runs_on_a_tiny_cache(source, tmp_path):
    """Both runs see the same batches, the recomputed diagonal equals the trainer's logged validation
    (the benchmark raises otherwise), and the fp8 split's argmaxes mostly agree with the source's."""
    result = _bench().main(["--cache", str(source[0]), "--fp8-cache", str(tmp_path / "fp8"), "--head", "falcon_k1",
                            "--steps", "2", "--batch-size", "4", "--warmup", "1", "--lr", "0.01",
                            "--model-path", str(source[1].model.path), "--work", str(tmp_path / "work"),
                            "--out", str(tmp_path / "out"), "model.dtype=float32",
                            "heads.attn_implementation=eager", "train.accelerator=cpu"])
    m = result["matrix"]
    assert set(m) == {"source", "fp8"} and set(m["source"]) == {"source", "fp8"}
    assert result["train_steps"] == {"source": 2, "fp8": 2}
    for trained in m:
        for val in m[trained]:
            assert m[trained][val]["sim_tau"] >= 1.0 and 0.0 <= m[trained][val]["top1_slot0"] <= 1.0
    assert 0.8 < m["source"]["fp8"]["agree_slot0"] <= 1.0
    assert (tmp_path / "out" / "bench_fp8_tau_falcon_k1.json").is_file()
    # part 2 alone on the exported head of the source run reproduces that row
    run = tmp_path / "work" / "runs" / "falcon_k1" / "fp8tau-falcon_k1-source" / "last"
    given = _bench().main(["--cache", str(source[0]), "--fp8-cache", str(tmp_path / "fp8"), "--head", "falcon_k1",
                           "--head-dir", str(run), "--batch-size", "4", "--model-path", str(source[1].model.path),
                           "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "model.dtype=float32",
                           "heads.attn_implementation=eager"])
    assert set(given["matrix"]) == {"given"}
    for val in ("source", "fp8"):
        for key, v in m["source"][val].items():
            assert given["matrix"]["given"][val][key] == pytest.approx(v, rel=1e-5, abs=1e-6), (val, key)
