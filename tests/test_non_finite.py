"""Nothing non-finite passes a boundary (issue 28, item 1): data prep, fp8 storage, training, export.

Built for the kind: NaN, +inf and -inf; in the final hidden state, an intermediate cached layer
and the logits behind the labels; at the first, a middle and the last position.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.config import UserInputError, compose
from core.finite import NonFiniteError
from data_prep import pipeline
from data_prep.cache import CacheReader, default_cache_dir

VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
WORDS = ["The quick brown fox", "jumps over the lazy dog.", "Hello! How can I help you today?",
         "Please write a short poem about the sea.", "def add(a, b):", "return a + b", "1 2 3 4 5"]


def _conversations(n: int) -> list[dict]:
    return [{"id": f"conv-{i}", "conversations": [
        {"from": "human", "value": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2))},
        {"from": "gpt", "value": " ".join(WORDS[(2 * i + k) % len(WORDS)] for k in range(1 + i % 3))}]}
        for i in range(n)]


def _cfg(model_dir, data_file, out, *extra):
    return compose([f"model.path={model_dir}", "model.dtype=float32", "model.attn_implementation=eager",
                    f"data.path={data_file}", "data.max_conversations=null", "data.heldout_fraction=0.25",
                    "data.max_length=96", "prep.shard_size=4", "prep.batch_tokens=400", "prep.progress=false",
                    "prep.layers=[1,3]", "labels=teacher_forced", f"output_root={out}", *extra])


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("nonfinite") / "data.json"
    path.write_text(json.dumps(_conversations(12)))
    return path


# ---------------------------------------------------------------------------------------------
# data prep
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(VALUES))
def test_data_prep_drops_and_counts_every_non_finite_conversation(kind, tiny_base, tiny_model_dir, data_file,
                                                                    tmp_path, monkeypatch):
    """One conversation per (what, where): the final state hs[L], a cached intermediate layer and the
    logits behind the labels, each at the first, a middle and the last position.  Each is dropped and
    counted under its reason; every kept record is finite and equals a fresh forward."""
    model, tok, ident = tiny_base
    value = VALUES[kind]
    cases = [(what, where) for what in ("final", "aux", "logits") for where in ("first", "middle", "last")]
    poison = {f"conv-{i}": case for i, case in enumerate(cases)}
    real = pipeline.forward_features

    def poisoned(model_, seqs, pad_id, layers, **kw):
        out = real(model_, seqs, pad_id, layers, **kw)
        for seq, f in zip(seqs, out):
            for cid, (what, where) in poison.items():
                if seq == ids_of[cid]:
                    T = len(seq)
                    t = {"first": 0, "middle": T // 2, "last": T - 1}[where]
                    if what == "logits":
                        f["logits_finite"] = f["logits_finite"].clone()
                        f["logits_finite"][t] = False
                    else:
                        layer = 4 if what == "final" else 1
                        f["hidden"][layer] = f["hidden"][layer].clone()
                        f["hidden"][layer][t, 5] = value
        return out

    cfg = _cfg(tiny_model_dir, data_file, tmp_path, "prep.dtype=float32")
    templated = pipeline.template_split(tok, pipeline.read_split(cfg.data), pipeline.end_of_turn_ids(tok, model), 96)
    ids_of = {c.id: c.encode(96)[0] for split in templated.values() for c in split}
    monkeypatch.setattr(pipeline, "forward_features", poisoned)
    summary = pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    assert summary["dropped"].get("non_finite_hidden") == 6 and summary["dropped"].get("non_finite_labels") == 3
    assert summary["drop_examples"]["non_finite_hidden"]["id"] in poison
    root = default_cache_dir(cfg)
    manifests = [json.loads((root / s / "manifest.json").read_text()) for s in ("train", "val")]
    assert sum(m["dropped"].get("non_finite_hidden", 0) for m in manifests) == 6
    assert sum(m["dropped"].get("non_finite_labels", 0) for m in manifests) == 3
    kept = 0
    for split in ("train", "val"):
        reader = CacheReader(root / split)
        for i in range(len(reader)):
            rec = reader[i]
            assert rec["id"] not in poison
            assert all(torch.isfinite(t).all() for t in (rec["hidden"], *rec["aux_hidden"].values()))
            kept += 1
    assert kept == 12 - len(poison)


def test_storage_dtype_overflow_is_its_own_reason():
    """A finite fp32 state beyond fp16's range would be stored as inf: dropped under
    ``hidden_overflows_storage_dtype`` for fp16, kept for bf16 / fp32 / fp8 (which saturates)."""
    h = torch.zeros(5, 8)
    h[2, 3] = 1e5
    rec = {"hidden": {4: h}, "logits_finite": torch.ones(5, dtype=torch.bool)}
    reason, where = pipeline.non_finite_reason(rec, torch.float16)
    assert reason == "hidden_overflows_storage_dtype" and where["position"] == 2 and where["layer"] == 4
    for dt in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        assert pipeline.non_finite_reason(rec, dt) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_labels_equal_argmax_and_isfinite_with_ties_and_non_finite_rows(dtype):
    """data_prep.features.greedy_labels (max + amin) against the brute force it replaces
    (argmax, isfinite().all()) on rows built to break it: ties (first id wins, also across a
    whole 49,152-wide row of equal values), NaN, +inf, -inf, a +inf tie, and random rows."""
    from data_prep.features import greedy_labels

    g = torch.Generator().manual_seed(0)
    z = torch.randn(16, 49152, generator=g).to(dtype)
    z[0] = 0.0                                          # every id ties: label 0
    z[1, 5], z[1, 40000] = 50.0, 50.0                   # a tie far apart: label 5
    z[2, 30000:30002] = 60.0                            # adjacent tie
    z[3, 123] = float("nan")
    z[4, 7] = float("inf")
    z[5, 49151] = float("-inf")                         # the last id: seen only by the minimum
    z[6, 9], z[6, 10] = float("inf"), float("inf")
    z[7, 0] = float("-inf")
    z[7, 3] = 70.0
    labels, finite = greedy_labels(z)
    assert torch.equal(labels, z.argmax(-1))
    assert torch.equal(finite, torch.isfinite(z).all(-1))
    assert labels[:3].tolist() == [0, 5, 30000] and labels[6] == 9 and labels[7] == 3
    assert finite.tolist() == [True] * 3 + [False] * 5 + [True] * 8


def test_e2e_poisoned_conversation_is_counted_and_the_head_trains_and_exports_finite(tiny_base, tiny_model_dir,
                                                                                       tmp_path):
    """The base forward of one conversation yields NaN from one of its tokens on (an embedding output
    poisoned for that token id): data prep drops and counts it, and a Falcon head trained on the
    cache and exported holds finite weights only."""
    from train.run import train

    model, tok, ident = tiny_base
    convs = _conversations(12)
    poisoned_text = "Quixotic zebras yodel"
    convs[5]["conversations"][0]["value"] += " " + poisoned_text
    others = {t for i, c in enumerate(convs) if i != 5 for turn in c["conversations"] for t in tok(turn["value"]).input_ids}
    candidates = [t for t in tok(" " + poisoned_text).input_ids if t not in others]
    assert candidates, "the poisoned text must hold a token no other conversation has"
    bad_token = candidates[0]
    data_file = tmp_path / "data.json"
    data_file.write_text(json.dumps(convs))
    emb = model.get_input_embeddings()
    hook = emb.register_forward_hook(
        lambda m, inp, out: out.masked_fill((inp[0] == bad_token)[..., None], float("nan")))
    try:
        cfg = _cfg(tiny_model_dir, data_file, tmp_path, "data.heldout_fraction=0.2")
        summary = pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    finally:
        hook.remove()
    assert summary["dropped"].get("non_finite_hidden") == 1
    assert summary["drop_examples"]["non_finite_hidden"]["id"] == "conv-5"
    assert "non_finite_hidden 1" in pipeline.format_summary(summary)
    cache = default_cache_dir(cfg)
    run = train(compose(["heads=falcon", "heads.attn_implementation=eager", "train.logger=csv",
                         "train.progress_bar=false", "train.sanity_val_steps=0", f"output_root={tmp_path}",
                         f"train.cache_dir={cache}", "train.run_name=e2e", "train.accelerator=cpu", "train.devices=1",
                         "train.batch_size=2", "train.max_steps=4", "train.val_every_n_steps=2",
                         "train.scheduler.warmup_steps=1", "train.optimizer.lr=0.01", "prep.layers=[1,3]"]),
                 base=tiny_base)
    for name in ("best", "last"):
        weights = load_file(run["exports"][name] / "model.safetensors")
        assert weights and all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())


# ---------------------------------------------------------------------------------------------
# fp8 storage and conversion
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(VALUES))
@pytest.mark.parametrize("col", [0, 3, 7])
def test_fp8_refuses_non_finite_and_never_spreads_it(kind, col):
    from data_prep.fp8 import quantize_rows

    x = torch.randn(3, 8)
    x[1, col] = VALUES[kind]
    with pytest.raises(NonFiniteError, match=r"non-finite.*\[1, %d\]" % col):
        quantize_rows(x)


def test_fp8_saturates_every_finite_row():
    """Huge, tiny (max/448 underflows float32) and mixed rows all come back finite, within e4m3's step."""
    from data_prep.fp8 import dequantize_rows, quantize_rows

    x = torch.tensor([[3.0e38, -1.0e38, 1.0, 0.0],
                      [1e-44, -1e-45, 0.0, 1e-44],
                      [65504.0, -7.0, 1e-30, 448.0],
                      [0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize_rows(x)
    back = dequantize_rows(q, scale, torch.float32)
    assert torch.isfinite(back).all() and torch.isfinite(scale).all()
    rowmax = x.abs().amax(-1, keepdim=True)
    assert ((back - x).abs() <= rowmax * 2 ** -4 + 1e-37).all()


def test_fp8_conversion_refuses_a_non_finite_source_naming_conversation_and_token(tiny_model_dir, tmp_path):
    from data_prep.synthetic import write_random_cache
    from data_prep.fp8_convert import convert_cache

    src = write_random_cache(tmp_path / "src", tiny_model_dir, n_train=6, n_val=2, layers=[1], shard_size=4)
    shard = src / "train" / "shard-00001.safetensors"
    from safetensors import safe_open

    with safe_open(str(shard), framework="pt") as f:
        meta = f.metadata()
    t = load_file(shard)
    ids = json.loads(meta["ids"])
    row = int(t["offsets"][1]) + 2  # token 2 of the shard's second conversation
    t["aux_hidden.1"][row, 4] = float("inf")
    save_file(t, shard, metadata=meta)
    from data_prep import cache as C

    entry = json.loads((src / "train" / "shard-00001.json").read_text())
    manifest = json.loads((src / "train" / "manifest.json").read_text())
    manifest["shards"][1].update(sha256=C.sha256_file(shard), bytes=shard.stat().st_size)
    (src / "train" / "manifest.json").write_text(json.dumps(manifest))
    entry.update(sha256=C.sha256_file(shard))
    (src / "train" / "shard-00001.json").write_text(json.dumps(entry))
    with pytest.raises(UserInputError, match=rf"aux_hidden.1.*inf.*conversation '{ids[1]}', token 2"):
        convert_cache(src, tmp_path / "fp8", out=None)
    assert not (tmp_path / "fp8" / "train" / "manifest.json").exists()


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------
class _Poisoned:
    """A cache reader whose record ``index`` holds ``value`` in ``key`` at position ``where``."""

    def __init__(self, reader, index: int, key: str, where: str, value: float) -> None:
        self.reader, self.index, self.key, self.where, self.value = reader, index, key, where, value
        self.directory, self.manifest = reader.directory, reader.manifest

    def __len__(self):
        return len(self.reader)

    def lengths(self):
        return self.reader.lengths()

    def __getitem__(self, i):
        rec = self.reader[i]
        if i == self.index:
            T = len(rec["input_ids"])
            t = {"first": 0, "middle": T // 2, "last": T - 1}[self.where]
            target = rec["hidden"] if self.key == "hidden" else rec["aux_hidden"][1]
            target = target.clone()
            target[t, 2] = self.value
            if self.key == "hidden":
                rec["hidden"] = target
            else:
                rec["aux_hidden"] = {**rec["aux_hidden"], 1: target}
        return rec


def _train_cfg(tmp, cache, *extra, head=("heads=falcon", "heads.attn_implementation=eager")):
    return compose([*head, "train.logger=csv", "train.progress_bar=false",
                    "train.sanity_val_steps=0", f"output_root={tmp}", f"train.cache_dir={cache}", "train.run_name=r",
                    "train.accelerator=cpu", "train.devices=1", "train.batch_size=2", "train.max_steps=6",
                    "train.val_every_n_steps=3", "train.scheduler.warmup_steps=1", "train.optimizer.lr=0.01", *extra])


@pytest.fixture(scope="module")
def train_cache(tiny_model_dir, tmp_path_factory):
    from data_prep.synthetic import write_random_cache

    return write_random_cache(tmp_path_factory.mktemp("nf_train") / "cache", tiny_model_dir, n_train=8, n_val=2,
                              layers=[1], length_range=(6, 12), shard_size=4)


@pytest.mark.parametrize("key,where,kind", [("hidden", "first", "nan"), ("aux", "middle", "inf"),
                                            ("hidden", "last", "-inf")])
def test_training_stops_on_non_finite_features_or_loss_naming_step_and_conversation(key, where, kind, train_cache, tiny_base,
                                                                          tmp_path):
    from train.data import CacheDataModule, open_split
    from train.run import train

    readers = {s: open_split(train_cache, s) for s in ("train", "val")}
    poisoned = _Poisoned(readers["train"], 3, key, where, VALUES[kind])
    dm = CacheDataModule(train_cache, readers["train"].pad_id, batch_size=2, train_reader=poisoned,
                         val_reader=readers["val"])
    # the final state hs[L]: Falcon; the intermediate layer hs[1]: an AdaDecode exit reads it
    head = ("heads=falcon", "heads.attn_implementation=eager") if key == "hidden" else ("heads=adadecode", "heads.layers=[1]")
    cfg = _train_cfg(tmp_path, train_cache, head=head)
    with pytest.raises(NonFiniteError, match=r"non-finite training batch in optimizer step \d+ \(epoch \d+\).*"
                                             rf"hs\[{'L' if key == 'hidden' else 1}\] of conversation 'train3' is "
                                             rf"{kind} at token \d+.*conversations \[\[.*'train3'") as err:
        train(cfg, base=tiny_base, datamodule=dm)
    assert "rank 0" in str(err.value)
    run = tmp_path / "runs" / cfg.choices.heads / "r"
    assert not (run / "last").exists()  # nothing exported
    # the message says what there is to go back to (it claimed a checkpoint where none was written yet)
    last = run / "checkpoints" / "last.ckpt"
    assert (f"its last checkpoint ({last}) holds finite weights" if last.is_file()
            else "no checkpoint was written before it") in str(err.value)
    for ck in (run / "checkpoints").glob("*.ckpt"):  # every checkpoint written holds finite weights
        from train.checkpoint_io import SafetensorsCheckpointIO

        state = SafetensorsCheckpointIO().load_checkpoint(ck)["state_dict"]
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_training_stops_on_a_non_finite_loss_from_finite_features(train_cache, tiny_base, tmp_path):
    """Finite features whose loss overflows (3e38 in one state): the step stops on the loss itself."""
    from train.data import CacheDataModule, open_split
    from train.run import train

    readers = {s: open_split(train_cache, s) for s in ("train", "val")}
    dm = CacheDataModule(train_cache, readers["train"].pad_id, batch_size=2,
                         train_reader=_Poisoned(readers["train"], 5, "hidden", "middle", 3e38), val_reader=readers["val"])
    with pytest.raises(NonFiniteError, match=r"non-finite training batch in optimizer step \d+ .*micro-batch \d+: loss "
                                             r"(nan|inf|-inf), conversations \[\[.*'train5'"):
        train(_train_cfg(tmp_path, train_cache), base=tiny_base, datamodule=dm)


@pytest.mark.parametrize("kind", ["inf", "nan"])
def test_training_stops_on_a_non_finite_gradient_that_clipping_would_hide(kind, train_cache, tiny_base, tmp_path):
    """A finite loss with a non-finite gradient (injected after backward in step 2): Falcon clips by
    value 0.5, which turned an inf into 0.5 and trained on; now the step stops, naming the parameter."""
    from lightning.pytorch.callbacks import Callback

    from train.run import train

    class Inject(Callback):
        def on_after_backward(self, trainer, pl_module):
            if trainer.global_step == 1:
                p = next(p for p in pl_module.head.parameters() if p.grad is not None)
                p.grad.view(-1)[0] = VALUES[kind]

    with pytest.raises(NonFiniteError, match=r"non-finite gradient in optimizer step 2 .*gradient of head\.\S+ .*"
                                             r"conversations \[\["):
        train(_train_cfg(tmp_path, train_cache), base=tiny_base, callbacks=[Inject()])


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(VALUES))
def test_heads_save_and_engine_export_refuse_a_non_finite_weight(kind, tiny_base, tmp_path):
    import heads
    from heads.export import ExportError, export
    from omegaconf import OmegaConf

    model, _, ident = tiny_base
    cfg = OmegaConf.to_container(compose(["heads=eagle3", "heads.layers=[1,2,3]"]).heads, resolve=True)
    head = heads.build(cfg, model)
    with torch.no_grad():
        head.fc.weight[3, 1] = VALUES[kind]
    with pytest.raises(NonFiniteError, match=r"'fc.weight' \[\d+, \d+\] has 1 non-finite value\(s\) \(first "
                                             + ("nan" if kind == "nan" else kind.replace("+", "")) + r" at \[3, 1\]\)"):
        heads.save(head, tmp_path / "bad", ident.to_dict())
    assert not (tmp_path / "bad").exists()
    # a checkpoint written elsewhere (or before this guard) with a non-finite weight: the engine export refuses it
    with torch.no_grad():
        head.fc.weight[3, 1] = 0.0
    heads.save(head, tmp_path / "ok", ident.to_dict())
    state = load_file(tmp_path / "ok" / "model.safetensors")
    state["midlayer.mlp.down_proj.weight"][0, 0] = VALUES[kind]
    save_file(state, tmp_path / "ok" / "model.safetensors")
    with pytest.raises(ExportError, match=r"'layers.0.mlp.down_proj.weight'.*non-finite"):
        export(tmp_path / "ok", "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_stop_message_names_the_checkpoint_to_go_back_to_or_says_there_is_none(tmp_path):
    from types import SimpleNamespace

    from train.finite import NonFiniteError, stop

    ckpt = tmp_path / "last.ckpt"
    for exists in (False, True):
        if exists:
            ckpt.write_bytes(b"x")
        trainer = SimpleNamespace(world_size=1, global_step=1, current_epoch=0,
                                  checkpoint_callback=SimpleNamespace(last_model_path=str(ckpt)))
        with pytest.raises(NonFiniteError) as err:
            stop("loss", trainer, {"bad": True, "detail": "micro-batch 0: loss nan", "window": [["c1"]]})
        said = str(err.value)
        assert ("its last checkpoint" in said) == exists and ("no checkpoint was written before it" in said) != exists
        assert "step 2 (epoch 0): rank 0: micro-batch 0: loss nan, conversations [['c1']]" in said
