"""heads.export carries what each serving engine needs (issue 30), on the tiny base, no engine run:
the verifier as a loadable HF folder or hub id, the base's embedding bit for bit where speculators
needs it, layer ids that vLLM and SGLang each read right from the ``sglang`` layout, the engine
versions / layer-id rule / embedding / dtype in the metadata, and bad targets refused before any
write.  The engines themselves run in tests/test_engines.py (``pytest -m engines``)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.test_eagle3_export import LAYERS, _draftheads_eagle3, _save, _sharpen, read_eagle3


def _eagle3(tiny_base, tmp_path, name="ckpt", **cfg):
    import heads

    base, _, identity = tiny_base
    head = heads.build({"type": "eagle3", "layers": LAYERS, **cfg}, base)
    _sharpen(head)
    return head, _save(head, base, tmp_path / name, identity)


def _with_source(ckpt, source, sha=None):
    """Rewrite the checkpoint's recorded training base (as a head trained on that base records it)."""
    meta = json.loads((ckpt / "config.json").read_text())
    meta["base"].update(source=str(source), sha256=sha)
    (ckpt / "config.json").write_text(json.dumps(meta))
    return ckpt


def _fake_gguf(tmp_path, tiny_model_dir, monkeypatch):
    """A .gguf file whose conversion is already in the (temporary) draftheads cache: the folder
    ``core.base_model.convert_gguf`` returns for it without converting (keyed by its SHA-256)."""
    from core.io import sha256_file

    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "dhcache"))
    gguf = tmp_path / "gguf" / "tiny.Q4.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF tiny stand-in")
    sha = sha256_file(gguf)
    folder = tmp_path / "dhcache" / "models" / f"tiny.Q4-{sha[:16]}"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": sha}))
    return gguf, sha, folder


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_verifier_is_an_absolute_hf_folder_never_a_gguf(tiny_base, tiny_model_dir, tmp_path, monkeypatch, fmt):
    """A head trained on a GGUF base records the GGUF's converted HF folder (absolute, loadable
    by AutoConfig as speculators loads it), also once the GGUF file is gone (found by SHA-256)."""
    from transformers import AutoConfig

    from heads.export import export

    gguf, sha, folder = _fake_gguf(tmp_path, tiny_model_dir, monkeypatch)
    _, ckpt = _eagle3(tiny_base, tmp_path)
    _with_source(ckpt, gguf, sha)
    cfg = json.loads((export(ckpt, fmt, tmp_path / "a") / "config.json").read_text())
    ver = cfg["speculators_config"]["verifier"]["name_or_path"]
    assert ver == str(folder.resolve()) and not ver.endswith(".gguf")
    assert AutoConfig.from_pretrained(ver).num_hidden_layers == tiny_base[0].config.num_hidden_layers
    gguf.unlink()
    cfg = json.loads((export(ckpt, fmt, tmp_path / "b") / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(folder.resolve())
    assert cfg["draftheads"]["engines"]["speculators"]["verifier"] == str(folder.resolve())


def test_verifier_relative_folder_becomes_absolute_and_hub_id_is_kept(tiny_base, tiny_model_dir, tmp_path, monkeypatch):
    from heads.export import ExportError, export, main

    _, ckpt = _eagle3(tiny_base, tmp_path)
    monkeypatch.chdir(tiny_model_dir.parent)
    rel = tiny_model_dir.name
    cfg = json.loads((export(ckpt, "vllm", tmp_path / "rel", base=rel) / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tiny_model_dir.resolve())
    _with_source(ckpt, rel)  # a head whose training base was given as a relative folder
    cfg = json.loads((export(ckpt, "vllm", tmp_path / "rel2") / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tiny_model_dir.resolve())
    # a hub id is recorded as given; the embedding still comes from the local training base
    out = export(ckpt, "vllm", tmp_path / "hub", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert torch.equal(load_file(out / "model.safetensors")["embed_tokens.weight"],
                       tiny_base[0].get_input_embeddings().weight)
    for bad in ("./no_such_folder", str(tmp_path / "missing.gguf"), str(ckpt / "config.json")):
        with pytest.raises(ExportError):
            export(ckpt, "vllm", tmp_path / "bad", verifier=bad)
        assert not (tmp_path / "bad").exists()
    assert main([str(ckpt), "--format", "vllm", str(tmp_path / "bad"), "--verifier", "./nope"]) == 2
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("fmt", ["sglang", "eagle1"])
def test_verifier_on_a_format_that_records_none_is_refused(tiny_base, tmp_path, fmt):
    """--verifier was silently dropped by the formats whose config records no verifier."""
    from heads.export import ExportError, export, main

    _, ckpt = _eagle3(tiny_base, tmp_path)
    with pytest.raises(ExportError, match=f"--verifier applies to --format vllm or speculators only; a --format {fmt}"):
        export(ckpt, fmt, tmp_path / "out", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert main([str(ckpt), "--format", fmt, str(tmp_path / "out"), "--verifier", "x/y"]) == 2
    assert not (tmp_path / "out").exists()


def test_speculators_layout_carries_the_base_embedding_bit_identical(tiny_base, tmp_path):
    """speculators reads embed_tokens.weight from the export only (a missing one stays zero):
    it is written, bit for bit the base's, in both names of the layout; the sglang layout has
    none (SGLang's worker sets the target's)."""
    from heads.export import export

    base = tiny_base[0]
    _, ckpt = _eagle3(tiny_base, tmp_path)
    want = base.get_input_embeddings().weight
    files = {}
    for fmt in ("vllm", "speculators"):
        W = load_file(export(ckpt, fmt, tmp_path / fmt) / "model.safetensors")
        assert W["embed_tokens.weight"].dtype == want.dtype and torch.equal(W["embed_tokens.weight"], want)
        files[fmt] = W
    assert files["vllm"].keys() == files["speculators"].keys()
    assert all(torch.equal(files["vllm"][k], files["speculators"][k]) for k in files["vllm"])
    assert "embed_tokens.weight" not in load_file(export(ckpt, "sglang", tmp_path / "s") / "model.safetensors")


def _vllm_layer_ids(cfg):
    """vLLM 0.32 ``gpu_model_runner._get_eagle3_aux_layers_from_config``: the top-level key first,
    then ``eagle_config``'s; vLLM captures the input of layer l (= hs[l])."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids and isinstance(cfg.get("eagle_config"), dict):
        ids = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    return list(ids)


def _sglang_layer_ids(cfg):
    """SGLang >= 0.4.9 ``model_runner`` + ``set_eagle3_layers_to_capture``: eagle_config's ids, + 1."""
    return [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]


def test_sglang_layout_is_read_at_the_head_layers_by_vllm_and_sglang(tiny_base, tmp_path):
    """vLLM also serves the sglang layout: each engine's own rule lands on the head's hs layers,
    and drafting from the layers vLLM reads reproduces the head's logits."""
    from heads.export import export

    head, ckpt = _eagle3(tiny_base, tmp_path)
    out = export(ckpt, "sglang", tmp_path / "s")
    cfg = json.loads((out / "config.json").read_text())
    assert _vllm_layer_ids(cfg) == _sglang_layer_ids(cfg) == LAYERS
    vcfg = json.loads((export(ckpt, "vllm", tmp_path / "v") / "config.json").read_text())
    assert _vllm_layer_ids(vcfg) == LAYERS
    # draft logits with the layers vLLM picks from the sglang layout
    as_vllm = tmp_path / "s_as_vllm"
    as_vllm.mkdir()
    (as_vllm / "model.safetensors").symlink_to(out / "model.safetensors")
    cfg_v = dict(cfg, eagle_config={"eagle_aux_hidden_state_layer_ids": [l - 1 for l in _vllm_layer_ids(cfg)]})
    (as_vllm / "config.json").write_text(json.dumps(cfg_v))
    ids = torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(3))
    got, want = read_eagle3(as_vllm, tiny_base[0], ids, "sglang"), _draftheads_eagle3(head, tiny_base[0], ids)
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators"])
def test_export_metadata_names_engine_versions_layer_rule_embedding_dtype(tiny_base, tmp_path, fmt):
    from heads.export import export

    _, ckpt = _eagle3(tiny_base, tmp_path)
    out = export(ckpt, fmt, tmp_path / "o")
    cfg = json.loads((out / "config.json").read_text())
    # every file is readable as config.json is (an engine may run as another user): not 0600
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert len(set(modes.values())) == 1 and modes["model.safetensors"] & 0o044, modes
    engines = cfg["draftheads"]["engines"]
    assert cfg["draftheads"]["format"] == fmt
    assert set(engines) == ({"sglang", "vllm"} if fmt == "sglang" else {"vllm", "speculators"})
    for name, e in engines.items():
        assert {"versions", "layer_ids", "embedding", "dtype"} <= set(e), name
        key = e["layer_ids"]["key"]
        where = cfg
        for part in key.split("."):
            where = where[part]
        assert where == e["layer_ids"]["value"], (name, key)  # the metadata states what the file holds
    assert "0.32.0" in engines["vllm"]["versions"] and engines["vllm"]["layer_ids"]["value"] == LAYERS
    if fmt == "sglang":
        assert "0.5.23" in engines["sglang"]["versions"] and engines["sglang"]["layer_ids"]["value"] == [0, 1, 2]
        assert "not 0.4.6 - 0.4.8" in engines["sglang"]["versions"]  # ids ignored, fc with a bias
    else:
        assert "0.9.0" in engines["speculators"]["versions"] and cfg["dtype"] == "float32"


def test_bad_export_target_fails_before_writing(tiny_base, tmp_path, capsys):
    import heads
    from heads.export import ExportError, export, main

    base, _, identity = tiny_base
    _, e3 = _eagle3(tiny_base, tmp_path)
    falcon = _save(heads.build({"type": "falcon"}, base), base, tmp_path / "falcon", identity)
    before = sorted(p.name for p in tmp_path.iterdir())
    for ckpt, fmt, match in ((e3, "tensorrt", "formats are"), (e3, "eagle1", "eagle1 exports Falcon"),
                             (falcon, "speculators", "holds a 'falcon' head"), (falcon, "vllm", "holds a 'falcon' head")):
        with pytest.raises(ExportError, match=match):
            export(ckpt, fmt, tmp_path / "x")
    with pytest.raises(SystemExit):
        main([str(e3), "--format", "tensorrt", str(tmp_path / "x")])
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no temporary directory


def test_full_vocabulary_head_has_no_mapping_in_the_speculators_layout(tiny_base, tmp_path):
    """draft_vocab_size = V: speculators builds no d2t/t2d buffers (it reported them as unexpected
    keys) and vLLM no draft_id_to_target_id parameter, so the layout leaves them out; the sglang
    layout keeps them (SGLang maps through hot_token_id = d2t + arange, the identity here)."""
    from heads.export import export

    head, ckpt = _eagle3(tiny_base, tmp_path)
    V = tiny_base[0].config.vocab_size
    assert head.num_draft_tokens == V
    for fmt in ("vllm", "speculators"):
        out = export(ckpt, fmt, tmp_path / fmt)
        assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == V
        assert not {"d2t", "t2d"} & set(load_file(out / "model.safetensors"))
    W = load_file(export(ckpt, "sglang", tmp_path / "s") / "model.safetensors")
    assert torch.equal(W["d2t"], torch.zeros(V, dtype=torch.long)) and bool(W["t2d"].all())
