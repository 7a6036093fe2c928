"""Precision per stage (issue 26, first half) and one feature definition (issue 28 item 2).

* ``core.precision``: which CPUs have native bf16, what ``auto`` resolves to (one line), refusals
  naming the key, all before anything is written;
* data prep: the compute dtype is recorded in the cache (config.yaml, manifest ``features``) and
  in its hash;
* online features equal the cache the same settings build - labels exactly, hidden states bit for
  bit in the stored dtype - in fp32 and in bf16 compute; a GPU no longer casts the base to bf16,
  the head's autocast does not reach the base; a cache of another compute dtype is refused;
* training: ``train.precision=auto`` resolves and is recorded; every head trains under bf16-mixed
  on a CPU; a resumed run keeps the precision it recorded.

The suite pins ``DRAFTHEADS_BF16=slow`` (tests/conftest.py); tests here set the level they need.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from core import precision
from core.config import ConfigError, UserInputError, compose
from data_prep import cache as cache_mod
from data_prep import pipeline

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_data_prep import _conversations  # noqa: E402

PREP = ["labels=teacher_forced", "data.max_conversations=null", "data.heldout_fraction=0.25", "data.max_length=96",
        "prep.layers=[1,2,3]", "prep.progress=false", "prep.shard_size=4", "prep.batch_tokens=150",
        "model.attn_implementation=eager"]


@pytest.fixture(autouse=True)
def _fresh_notes():
    precision._SAID.clear()  # each test sees its own one-line notes
    yield
    precision._SAID.clear()


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("precision_data") / "data.json"
    path.write_text(json.dumps(_conversations(22)))
    return path


def _cfg(model_dir, data_file, out, *extra):
    return compose([f"model.path={model_dir}", f"data.path={data_file}", f"output_root={out}", *PREP, *extra])


def _base(model_dir, dtype: str):
    from core.base_model import load_base_model

    return load_base_model({"path": str(model_dir), "dtype": dtype, "attn_implementation": "eager"})


# ----------------------------------------------------------------------------------------------
# detection and resolution
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vendor, flags, machine, mkldnn, level", [
    ("AuthenticAMD", {"avx512f", "avx512_bf16"}, "x86_64", True, "native"),          # Zen 4 / 5
    ("GenuineIntel", {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "x86_64", True, "native"),  # AMX
    ("GenuineIntel", {"avx512f", "avx512_bf16"}, "x86_64", True, "slow"),            # Cooper Lake / AMX hidden
    ("AuthenticAMD", {"avx512f", "avx512_bf16"}, "x86_64", False, "slow"),           # no oneDNN bf16 path
    ("AuthenticAMD", {"avx2", "fma"}, "x86_64", False, "none"),                      # Zen 3
    ("", {"asimd", "bf16"}, "aarch64", False, "native"),
    ("", {"asimd"}, "aarch64", False, "none"),
])
def test_cpu_bf16_level(vendor, flags, machine, mkldnn, level):
    got = precision.classify_cpu(vendor, flags, machine, mkldnn)
    assert got.level == level and got.device == "cpu" and got.reason


def test_env_override_and_its_bad_value(monkeypatch):
    monkeypatch.setenv(precision.BF16_ENV, "native")
    assert precision.bf16_support("cpu").native
    monkeypatch.setenv(precision.BF16_ENV, "fast")
    with pytest.raises(ValueError, match=r"DRAFTHEADS_BF16='fast'.*native, slow, none"):
        precision.bf16_support("cpu")


@pytest.mark.parametrize("level, dtype, prec", [("native", "bfloat16", "bf16-mixed"), ("slow", "float32", "32-true"),
                                                ("none", "float32", "32-true")])
def test_auto_resolves_by_level_with_one_line(monkeypatch, capsys, level, dtype, prec):
    monkeypatch.setenv(precision.BF16_ENV, level)
    assert precision.resolve_dtype("auto", "model.dtype", "cpu") == dtype
    assert precision.resolve_train_precision("auto", "cpu") == prec
    err = capsys.readouterr().err.splitlines()
    assert err == [f"draftheads: model.dtype=auto -> {dtype} on cpu ($DRAFTHEADS_BF16={level})",
                   f"draftheads: train.precision=auto -> {prec} on cpu ($DRAFTHEADS_BF16={level})"]
    precision.resolve_dtype("auto", "model.dtype", "cpu")
    assert capsys.readouterr().err == ""  # once per process
    assert precision.resolve_dtype("auto", "model.dtype", "cpu", check=False) == dtype


@pytest.mark.parametrize("flags, refused", [({"avx2", "avx512_bf16"}, True), ({"avx512_fp16", "avx512_bf16"}, False),
                                             ({"amx_bf16", "amx_fp16"}, False), ({"asimdhp", "bf16"}, False), (set(), True)])
def test_fp16_is_refused_where_the_cpu_emulates_it(monkeypatch, flags, refused):
    """An fp16 evaluation on a CPU without fp16 arithmetic crawled at 2.1 tokens/s (10x slower than fp32) with
    only an INFO line; now it is one error, as bf16 is where it is emulated."""
    monkeypatch.setattr(precision, "_cpuinfo", lambda: ("AuthenticAMD", set(flags)))
    if refused:
        with pytest.raises(ConfigError, match=r"^eval.dtype=float16 on this CPU .*emulated.*use eval.dtype=float32"):
            precision.resolve_dtype("float16", "eval.dtype", "cpu", auto_ok=False)
        with pytest.raises(ConfigError, match=r"^model.dtype=float16 .*use model.dtype=auto"):
            precision.resolve_dtype("float16", "model.dtype", "cpu")
    else:
        assert precision.resolve_dtype("float16", "eval.dtype", "cpu", auto_ok=False) == "float16"
    assert precision.resolve_dtype("float16", "model.dtype", "cpu", check=False) == "float16"  # reading a record


def test_explicit_bf16_warns_where_slow_and_is_refused_where_emulated(monkeypatch, capsys):
    monkeypatch.setenv(precision.BF16_ENV, "slow")
    assert precision.resolve_dtype("bfloat16", "model.dtype") == "bfloat16"
    assert precision.resolve_train_precision("bf16-mixed", "cpu") == "bf16-mixed"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all("not expected to be faster" in line for line in err)
    monkeypatch.setenv(precision.BF16_ENV, "none")
    with pytest.raises(ConfigError, match=r"^model.dtype=bfloat16 on cpu: .*use model.dtype=auto or float32"):
        precision.resolve_dtype("bfloat16", "model.dtype")
    with pytest.raises(ConfigError, match=r"^train.precision=bf16-true on cpu"):
        precision.resolve_train_precision("bf16-true", "cpu")
    assert precision.resolve_train_precision("32-true", "cpu") == "32-true"
    assert precision.resolve_dtype("float32", "model.dtype") == "float32"


def test_wrong_precision_strings_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"model.dtype='bf16' is not valid; choices: auto, float32"):
        compose(["model.dtype=bf16"])
    with pytest.raises(ConfigError, match=r"train.precision='bf16-mix' is not valid"):
        compose(["train.precision=bf16-mix"])
    with pytest.raises(ConfigError, match=r"model.dtype='fp8' is not valid"):
        precision.resolve_dtype("fp8", "model.dtype")
    with pytest.raises(ConfigError, match=r"eval.dtype='auto' is not valid"):  # eval.dtype keeps its meaning
        compose(["eval.dtype=auto"])


# ----------------------------------------------------------------------------------------------
# data prep: the compute dtype is recorded and hashed; refusals write nothing
# ----------------------------------------------------------------------------------------------
def test_data_prep_bf16_without_support_is_refused_before_anything_is_written(tiny_model_dir, data_file, tmp_path,
                                                                            monkeypatch, capsys):
    from data_prep.__main__ import main

    monkeypatch.setenv(precision.BF16_ENV, "none")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main([f"model.path={tiny_model_dir}", f"data.path={data_file}", f"output_root={out}", *PREP,
              "model.dtype=bfloat16"])
    assert exc.value.code == 2 and not out.exists()
    assert "error: model.dtype=bfloat16 on cpu" in capsys.readouterr().err
    cfg = _cfg(tiny_model_dir, data_file, out, "model.dtype=bfloat16")
    with pytest.raises(ConfigError, match="model.dtype=bfloat16"):
        pipeline.prepare(cfg, rank=0, world=1, out=None)
    assert not out.exists()


def test_data_prep_auto_on_native_bf16_records_and_hashes_its_compute_dtype(tiny_model_dir, data_file, tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv(precision.BF16_ENV, "native")
    cfg = _cfg(tiny_model_dir, data_file, tmp_path)  # model.dtype: auto (the default)
    assert cfg.model.dtype == "auto"
    with pytest.raises(ValueError, match="given a base in torch.float32 but model.dtype resolves to bfloat16"):
        pipeline.prepare(cfg, *_base(tiny_model_dir, "float32"), rank=0, world=1, out=None)
    pipeline.prepare(cfg, *_base(tiny_model_dir, "bfloat16"), rank=0, world=1, out=None)
    root = cache_mod.default_cache_dir(cfg)
    manifest = json.loads((root / "train" / "manifest.json").read_text())
    assert manifest["features"] == {"compute_dtype": "bfloat16", "attn_implementation": "eager", "final_layer": 4,
                                    "layers": [1, 2, 3], "storage_dtype": "bfloat16", "labels": "teacher_forced"}
    assert OmegaConf.load(root / "config.yaml").model.dtype == "bfloat16"  # what ran, not "auto"
    assert cache_mod.default_cache_dir(_cfg(tiny_model_dir, data_file, tmp_path, "model.dtype=bfloat16")) == root
    fp32 = cache_mod.default_cache_dir(_cfg(tiny_model_dir, data_file, tmp_path, "model.dtype=float32"))
    assert fp32 != root
    monkeypatch.setenv(precision.BF16_ENV, "slow")  # the same auto config on a CPU without native bf16: fp32
    assert cache_mod.default_cache_dir(cfg) == fp32


# ----------------------------------------------------------------------------------------------
# one feature definition: online == cache, bit for bit
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def caches(tiny_model_dir, data_file, tmp_path_factory):
    """``{compute dtype: (cfg, base, cache root)}``: a cache prepared in fp32 and one in bf16."""
    out = {}
    for compute in ("float32", "bfloat16"):
        work = tmp_path_factory.mktemp(f"cache_{compute}")
        cfg = _cfg(tiny_model_dir, data_file, work, f"model.dtype={compute}", "train.batch_size=4")
        base = _base(tiny_model_dir, compute)
        pipeline.prepare(cfg, *base, rank=0, world=1, out=None)
        out[compute] = (cfg, base, cache_mod.default_cache_dir(cfg))
    return out


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_online_features_equal_the_cache_bit_for_bit(caches, compute):
    """Other batches (training batches of 4 against data prep's 150-token forward batches), same bits."""
    from train import online
    from train.data import CacheDataModule, open_split

    cfg, (model, tok, ident), root = caches[compute]
    offline = CacheDataModule(root, 2, batch_size=4, seed=0, train_reader=open_split(root, "train"),
                              val_reader=open_split(root, "val"))
    offline.setup("fit")
    dm, features = online.online_datamodule(cfg, model, tok, ident.to_dict())
    dm.setup("fit")
    assert features.compute_dtype == getattr(torch, compute)
    n = 0
    for ref_loader, tok_loader in ((offline.train_dataloader(), dm.train_dataloader()),
                                   (offline.val_dataloader(), dm.val_dataloader())):
        for ref, tokens in zip(ref_loader, tok_loader):
            got = features(tokens)
            assert got["ids"] == ref["ids"]
            assert torch.equal(got["labels"], ref["labels"])
            assert got["hidden"].dtype == ref["hidden"].dtype == torch.bfloat16
            assert torch.equal(got["hidden"], ref["hidden"])
            assert sorted(got["aux_hidden"]) == [1, 2, 3]
            for l in (1, 2, 3):
                assert torch.equal(got["aux_hidden"][l], ref["aux_hidden"][l]), l
            n += 1
    assert n == len(offline.train_batches) + len(offline.val_batches) > 4


def test_bf16_and_fp32_caches_differ_and_record_it(caches):
    """The two caches are different data (so they must not share a hash): same ids and tokens,
    features that differ, each manifest naming its compute dtype."""
    from train.data import open_split

    (c32, _, r32), (c16, _, r16) = caches["float32"], caches["bfloat16"]
    assert r32 != r16 and cache_mod.cache_hash(c32) != cache_mod.cache_hash(c16)
    a, b = open_split(r32, "train"), open_split(r16, "train")
    assert a.manifest["features"]["compute_dtype"] == "float32" and b.manifest["features"]["compute_dtype"] == "bfloat16"
    assert [a[i]["id"] for i in range(len(a))] == [b[i]["id"] for i in range(len(b))]
    assert all(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) for i in range(len(a)))
    assert any(not torch.equal(a[i]["hidden"], b[i]["hidden"]) for i in range(len(a)))


def test_online_base_keeps_the_definition_dtype_on_a_gpu():
    """Issue 28: ``BaseFeatures.to(cuda)`` cast the base to bf16 whatever ``model.dtype`` said."""
    from train.online import BaseFeatures

    class Stub(torch.nn.Module):  # records the cast instead of making it (no GPU here)
        dtype = torch.float32
        config = SimpleNamespace(num_hidden_layers=2)
        calls: list = []

        def to(self, *args, **kwargs):
            self.calls.append(kwargs)
            return self

    stub = Stub()
    BaseFeatures(stub, [], "bfloat16").to("cuda")
    assert stub.calls and stub.calls[-1].get("dtype") in (None, torch.float32)


def test_online_features_ignore_the_heads_autocast(caches):
    """A bf16-mixed training step runs under autocast; the base inside it must still run in the
    definition's dtype (fp32 here), or online features are bf16 features."""
    from train.online import BaseFeatures, collate_tokens
    from train.data import open_split

    cfg, (model, _, _), root = caches["float32"]
    reader = open_split(root, "train")
    recs = [{k: reader[i][k] for k in ("id", "input_ids", "loss_mask")} for i in range(3)]
    batch = collate_tokens(recs, 2)
    features = BaseFeatures(model, [2], "float32")
    ref = features(dict(batch))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = features(dict(batch))
    assert torch.equal(got["labels"], ref["labels"])
    assert torch.equal(got["hidden"], ref["hidden"]) and torch.equal(got["aux_hidden"][2], ref["aux_hidden"][2])


def test_offline_training_on_a_cache_of_another_compute_dtype(caches, tmp_path, monkeypatch):
    """Explicit ``model.dtype`` against a cache computed in another dtype: refused with the
    difference before any run directory exists; ``auto`` takes the cache's dtype."""
    from train.run import resolve_run_precision, train

    cfg16, base16, root16 = caches["bfloat16"]
    _, base32, _ = caches["float32"]
    args = [f"model.path={cfg16.model.path}", f"output_root={tmp_path}", f"train.cache_dir={root16}", "heads=ctc",
            "train.run_name=r", "train.max_steps=1", "train.logger=none", "train.progress_bar=false"]
    cfg = compose([*args, "model.dtype=float32"])
    with pytest.raises(UserInputError, match=r"compute_dtype: 'bfloat16' -> 'float32'.*pass model.dtype=bfloat16"):
        train(cfg, base=base32)
    assert not (tmp_path / "runs").exists()
    resolved, cache_def = resolve_run_precision(compose(args), None, online=False)
    assert resolved.model.dtype == "bfloat16" and cache_def.compute_dtype == "bfloat16"


def test_hybrid_cache_of_another_compute_dtype_is_refused(caches, tmp_path):
    from train.online import HybridCache, feature_header

    cfg32, (model, _, ident), _ = caches["float32"]
    cfg16 = caches["bfloat16"][0]
    header = feature_header(cfg32, model, ident.to_dict(), 2)
    assert header["features"]["compute_dtype"] == "float32"
    HybridCache(tmp_path / "hy", cfg32, header).prepare()
    with pytest.raises(UserInputError, match=r"model.dtype: 'float32' -> 'bfloat16'"):
        HybridCache(tmp_path / "hy", cfg16, header)


# ----------------------------------------------------------------------------------------------
# training precision
# ----------------------------------------------------------------------------------------------
HEADS = {"ctc": ["heads.anchors_per_seq=4", "heads.val_anchors_per_seq=4"], "falcon": [], "falcon_k1": [],
         "eagle3": ["heads.layers=[1,2,3]", "heads.ttt_steps=2"], "adadecode": ["heads.layers=[1,2,3]"]}


@pytest.mark.parametrize("name", sorted(HEADS))
def test_every_head_trains_under_auto_bf16_mixed_on_a_native_cpu(caches, tmp_path, monkeypatch, name):
    """``train.precision=auto`` on a CPU with native bf16 -> bf16-mixed, for every head: finite
    losses, weights that moved, and the run's config.yaml / export recording what ran."""
    from safetensors.torch import load_file

    import heads
    from train.run import train

    monkeypatch.setenv(precision.BF16_ENV, "native")
    cfg32, base, root = caches["float32"]
    cfg = compose([f"model.path={cfg32.model.path}", f"output_root={tmp_path}", f"train.cache_dir={root}",
                   f"heads={name}", *HEADS[name], "heads.draft_vocab_size=null", "train.run_name=r", "train.max_steps=3",
                   "train.val_every_n_steps=3", "train.batch_size=4", "train.logger=csv", "train.progress_bar=false",
                   "train.sanity_val_steps=0", "train.optimizer.lr=0.01", "train.scheduler.warmup_steps=0",
                   "train.devices=1", "strategy=auto"])
    assert cfg.train.precision == "auto" and cfg.model.dtype == "auto"
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in heads.build(cfg.heads, base[0]).trainable_state_dict().items()}
    result = train(cfg, base=base)
    assert str(result["trainer"].precision) == "bf16-mixed"
    recorded = OmegaConf.load(result["run_dir"] / "config.yaml")
    assert recorded.train.precision == "bf16-mixed" and recorded.model.dtype == "float32"  # the cache's dtype
    meta = json.loads((result["run_dir"] / "last" / "config.json").read_text())
    assert meta["extra"]["precision"] == "bf16-mixed"
    assert meta["extra"]["features"]["compute_dtype"] == "float32" and meta["extra"]["features"]["source"] == "offline"
    import csv

    rows = list(csv.DictReader(open(result["run_dir"] / "csv" / "metrics.csv")))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    weights = load_file(result["run_dir"] / "last" / "model.safetensors")
    assert any(not torch.equal(weights[k], init[k].float()) for k in init if k in weights)


def test_bf16_training_without_support_is_refused_before_the_run_dir(caches, tmp_path, monkeypatch):
    from train.run import train

    monkeypatch.setenv(precision.BF16_ENV, "none")
    cfg32, base, root = caches["float32"]
    cfg = compose([f"model.path={cfg32.model.path}", f"output_root={tmp_path}", f"train.cache_dir={root}",
                   "heads=ctc", "train.run_name=r", "train.precision=bf16-mixed", "train.logger=none"])
    with pytest.raises(ConfigError, match=r"^train.precision=bf16-mixed on cpu"):
        train(cfg, base=base)
    assert not (tmp_path / "runs").exists()


def test_a_resumed_run_keeps_the_precision_it_recorded(tmp_path, monkeypatch):
    from train.resume import check_resume_config
    from train.run import resolve_run_precision

    monkeypatch.setenv(precision.BF16_ENV, "native")
    run = tmp_path / "run"
    run.mkdir()
    base = compose(["train.features=online", "labels=teacher_forced"])
    for was, expect in (("auto", "32-true"), ("32-true", "32-true"), ("bf16-mixed", "bf16-mixed")):
        recorded = precision.with_values(base, {"train.precision": was, "model.dtype": "float32"})
        (run / "config.yaml").write_text(OmegaConf.to_yaml(recorded))
        cfg, _ = resolve_run_precision(base, run, online=True)
        assert (cfg.train.precision, cfg.model.dtype) == (expect, "float32"), was
        check_resume_config(cfg, run)  # the resolved settings are the recorded ones: accepted
    fresh, _ = resolve_run_precision(base, None, online=True)
    assert (fresh.train.precision, fresh.model.dtype) == ("bf16-mixed", "bfloat16")


@pytest.mark.parametrize("level", ["none", "slow", "native"])
def test_bench_decoding_says_when_its_bf16_cost_is_not_the_fast_path(monkeypatch, capsys, level):
    """benchmarks/bench_decoding.py --cost-only --dtypes ...,bfloat16 records this CPU's bf16 level and
    warns when it is emulated or slow, so an emulated bf16 c(n) is never read as the machine's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import bench_decoding

    monkeypatch.setenv(precision.BF16_ENV, level)
    assert bench_decoding._bf16_warning() == {"level": level, "reason": f"${precision.BF16_ENV}={level}"}
    err = capsys.readouterr().err
    assert (f"warning: bf16 on this CPU is {level}" in err) == (level != "native")
