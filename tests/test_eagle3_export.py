"""heads.export: independent readers rebuild each engine's drafter from the exported files alone
(following the key schema of the engine's loader, see heads/export.py) and reproduce draftheads'
draft logits on the tiny base.  No engine runs here."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

LAYERS = [1, 2, 3]
EAGLE3_KEYS = ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"] + [
    f"{p}.weight" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "hidden_norm",
                            "post_attention_layernorm")]


# -- an independent Llama-style reader (plain torch, config values only) ----------------------------
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attn(x, W, pfx, cfg):
    T = x.shape[0]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    q = (x @ W[pfx + "q_proj.weight"].T).view(T, nh, hd).transpose(0, 1)
    k = (x @ W[pfx + "k_proj.weight"].T).view(T, nkv, hd).transpose(0, 1)
    v = (x @ W[pfx + "v_proj.weight"].T).view(T, nkv, hd).transpose(0, 1)
    pos = torch.arange(T)
    q, k = _rope(q, pos, theta), _rope(k, pos, theta)
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    s = q @ k.transpose(-1, -2) / math.sqrt(hd)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(0, 1).reshape(T, nh * hd) @ W[pfx + "o_proj.weight"].T


def _mlp(x, W, pfx):
    return (torch.nn.functional.silu(x @ W[pfx + "gate_proj.weight"].T) * (x @ W[pfx + "up_proj.weight"].T)) @ W[pfx + "down_proj.weight"].T


def read_eagle3(out, base, ids, engine):
    """Draft logits over the target vocabulary [T, V] (−inf off the draft vocabulary) from the
    exported directory alone; the base supplies only what the engine takes from the target (token
    embedding and the hidden states at the layers the config names)."""
    cfg = json.loads((out / "config.json").read_text())
    W = load_file(out / "model.safetensors")
    if engine == "sglang":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        pfx = "midlayer."
        hs_ids = [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]  # SGLang adds 1
        layer_cfg, nbr = cfg, False
        assert cfg["bias"] is False  # SGLang: fc bias = getattr(config, "bias", False)
    else:
        assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
        sc = cfg["speculators_config"]
        assert sc["proposal_methods"][0]["speculative_tokens"] >= 1 and sc["verifier"]["name_or_path"]
        pfx = "layers.0."
        hs_ids = cfg["eagle_aux_hidden_state_layer_ids"]  # vLLM captures the input of layer id
        layer_cfg = cfg["transformer_layer_config"]
        assert "norm_before_residual" in cfg  # vLLM defaults a missing flag to true
        nbr = cfg["norm_before_residual"]
    N, V = cfg["draft_vocab_size"], layer_cfg["vocab_size"]
    if engine != "sglang" and N == V:  # speculators / vLLM: no mapping for a full vocabulary (identity)
        assert "d2t" not in W and "t2d" not in W
        W = {**W, "d2t": torch.zeros(N, dtype=torch.long), "t2d": torch.ones(V, dtype=torch.bool)}
    for key in EAGLE3_KEYS:
        name = key if key in ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d") else pfx + key
        assert name in W, f"missing {name}"
    assert "fc.bias" not in W
    assert W["lm_head.weight"].shape[0] == N and W["d2t"].shape == (N,) and W["t2d"].shape == (V,)
    assert W["fc.weight"].shape[1] == 3 * cfg["target_hidden_size"]
    eps = layer_cfg["rms_norm_eps"]
    with torch.no_grad():
        o = base(input_ids=ids[None], output_hidden_states=True)
    aux = torch.cat([o.hidden_states[i][0] for i in hs_ids], -1)
    emb = base.get_input_embeddings().weight[ids[1:].tolist() + [ids[0].item()]]  # slot t holds x_{t+1}
    h = aux @ W["fc.weight"].T
    hn = _rms(h, W[pfx + "hidden_norm.weight"], eps)
    x = torch.cat([_rms(emb, W[pfx + "input_layernorm.weight"], eps), hn], -1)
    h = (hn if nbr else h) + _attn(x, W, pfx + "self_attn.", layer_cfg)
    h = h + _mlp(_rms(h, W[pfx + "post_attention_layernorm.weight"], eps), W, pfx + "mlp.")
    logits = _rms(h, W["norm.weight"], eps) @ W["lm_head.weight"].T
    full = torch.full((ids.numel(), V), float("-inf"))
    full[:, torch.arange(N) + W["d2t"]] = logits  # engines: target id = d + d2t[d]
    assert bool(W["t2d"][torch.arange(N) + W["d2t"]].all()) and int(W["t2d"].sum()) == N
    return full


def _draftheads_eagle3(head, base, ids):
    from decoding.falcon import DraftKVCache
    from decoding.masks import additive_mask

    with torch.no_grad():
        o = base(input_ids=ids[None], output_hidden_states=True)
        aux = torch.cat([o.hidden_states[l][0] for l in head.layers], -1)
        T = ids.numel()
        toks = torch.cat([ids[1:], ids[:1]])
        h = head.forward_cached(head.fuse(aux)[None], toks[None], torch.arange(T)[None],
                                additive_mask(torch.ones(T, T, dtype=torch.bool).tril(), torch.float32)[None, None],
                                DraftKVCache())[0]
        full = torch.full((T, head.vocab_size), float("-inf"))
        full[:, head.to_base_ids(torch.arange(head.num_draft_tokens))] = head.draft_logits(h)
    return full


def _sharpen(head):
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(p + torch.randn(p.shape, generator=g) * 0.2)


def _save(head, base, directory, identity):
    import heads

    heads.save(head, directory, identity.to_dict())
    return directory


@pytest.mark.parametrize("engine,nbr", [("sglang", False), ("vllm", False), ("vllm", True)])
def test_eagle3_export_reproduces_draft_logits(tiny_base, tmp_path, engine, nbr):
    import heads
    from heads.export import export

    base, _, identity = tiny_base
    head = heads.build({"type": "eagle3", "layers": LAYERS, "norm_before_residual": nbr, "ttt_steps": 3}, base)
    _sharpen(head)
    ckpt = _save(head, base, tmp_path / "ckpt", identity)
    out = export(ckpt, engine, tmp_path / "out")
    ids = torch.randint(3, 300, (11,), generator=torch.Generator().manual_seed(4))
    got = read_eagle3(out, base, ids, engine)
    want = _draftheads_eagle3(head, base, ids)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-4, atol=1e-4)


def test_sglang_refuses_norm_before_residual_and_layer_ids_convention(tiny_base, tmp_path):
    import heads
    from heads.export import ExportError, export

    base, _, identity = tiny_base
    head = heads.build({"type": "eagle3", "layers": LAYERS, "norm_before_residual": True}, base)
    ckpt = _save(head, base, tmp_path / "ckpt", identity)
    with pytest.raises(ExportError, match="norm_before_residual"):
        export(ckpt, "sglang", tmp_path / "o1")
    assert not (tmp_path / "o1").exists()
    head = heads.build({"type": "eagle3", "layers": LAYERS}, base)
    ckpt = _save(head, base, tmp_path / "ckpt2", identity)
    s = json.loads((export(ckpt, "sglang", tmp_path / "s") / "config.json").read_text())
    v = json.loads((export(ckpt, "vllm", tmp_path / "v") / "config.json").read_text())
    assert s["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # layer outputs
    assert v["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # layer inputs = hs ids
    assert v["norm_before_residual"] is False and s["draft_vocab_size"] == v["draft_vocab_size"] == base.config.vocab_size


def read_eagle1(out, base, ids):
    """EAGLE-1 (SGLang LlamaForCausalLMEagle) logits [T, V] from the exported directory alone."""
    cfg = json.loads((out / "config.json").read_text())
    W = load_file(out / "model.safetensors")
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"]
    assert cfg["bias"] is True and "fc.bias" in W  # the fc-bias flag matches the weights
    D, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    for i in range(D):
        for k in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"):
            assert f"layers.{i}.{k}.weight" in W
        assert (f"layers.{i}.input_layernorm.weight" in W) == (i > 0)  # layer 0 has none (EAGLE)
    assert not any(k.startswith(("lm_head", "norm.")) for k in W)
    with torch.no_grad():
        o = base(input_ids=ids[None], output_hidden_states=True)
    f = o.hidden_states[-1][0]
    emb = base.get_input_embeddings().weight[ids[1:].tolist() + [ids[0].item()]]
    h = torch.cat([emb, f], -1) @ W["fc.weight"].T + W["fc.bias"]
    for i in range(D):
        p = f"layers.{i}."
        x = _rms(h, W[p + "input_layernorm.weight"], eps) if i > 0 else h
        h = h + _attn(x, W, p + "self_attn.", cfg)
        h = h + _mlp(_rms(h, W[p + "post_attention_layernorm.weight"], eps), W, p + "mlp.")
    return h @ base.get_output_embeddings().weight.T


@torch.no_grad()
def _falcon_k1_outputs(head, base, ids):
    """The head's teacher-forced outputs f̂ [T, H] over the base's final features of ``ids`` [T]."""
    o = base(input_ids=ids[None], output_hidden_states=True)
    T = ids.numel()
    return head.forward_train(o.hidden_states[-1], torch.cat([ids[1:], ids[:1]])[None], torch.ones(1, T, dtype=torch.bool))[0]


def test_eagle1_export_of_falcon_k1(tiny_base, tmp_path):
    import heads
    from heads.export import export

    base, _, identity = tiny_base
    head = heads.build({"type": "falcon", "block_size": 1, "glancing": {"enabled": False}, "num_layers": 2}, base)
    _sharpen(head)
    ckpt = _save(head, base, tmp_path / "ckpt", identity)
    out = export(ckpt, "eagle1", tmp_path / "out")
    ids = torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(6))
    got = read_eagle1(out, base, ids)
    torch.testing.assert_close(got, head.lm_head(_falcon_k1_outputs(head, base, ids)), rtol=1e-4, atol=1e-4)


def test_eagle1_export_carries_the_draft_vocabulary_as_hot_token_ids(tiny_base, tmp_path):
    """EAGLE-1 has no draft vocabulary: the export writes the head's d2t as FR-Spec's hot-token list
    (``hot_token_ids.json``, named in config.json), and the exported drafter's logits restricted to those
    ids (what SGLang's --speculative-token-map does) are the head's draft-vocabulary logits."""
    import heads
    from heads.export import HOT_TOKENS_FILE, export

    base, _, identity = tiny_base
    V = int(base.config.vocab_size)
    counts = torch.arange(V, dtype=torch.int64) % 97  # a draft vocabulary of 64 scattered ids
    head = heads.build({"type": "falcon", "block_size": 1, "glancing": {"enabled": False}, "num_layers": 2,
                        "draft_vocab_size": 64}, base, label_counts=counts)
    _sharpen(head)
    ckpt = _save(head, base, tmp_path / "ckpt", identity)
    out = export(ckpt, "eagle1", tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    vocab = cfg["draftheads"]["draft_vocab"]
    assert vocab["size"] == 64 and vocab["file"] == HOT_TOKENS_FILE and "hot_token_ids" not in vocab
    hot = json.loads((out / HOT_TOKENS_FILE).read_text())
    assert hot == {"hot_token_ids": head.d2t.tolist(), "size": 64}
    ids = torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(6))
    got = read_eagle1(out, base, ids)[:, torch.tensor(hot["hot_token_ids"])]
    want = head.draft_lm_head(_falcon_k1_outputs(head, base, ids))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    plain = export(_save(heads.build({"type": "falcon", "block_size": 1, "glancing": {"enabled": False}}, base), base,
                         tmp_path / "full", identity), "eagle1", tmp_path / "out_full")
    assert not (plain / HOT_TOKENS_FILE).exists() and "draft_vocab" not in json.loads((plain / "config.json").read_text())["draftheads"]


def test_export_errors(tiny_base, tmp_path, tiny_model_dir):
    import heads
    from core.tiny import save_tiny_model
    from heads.export import ExportError, export, main

    base, _, identity = tiny_base
    k2 = _save(heads.build({"type": "falcon"}, base), base, tmp_path / "k2", identity)
    with pytest.raises(ExportError, match=r"block_size=2.*formats: sglang, vllm"):
        export(k2, "eagle1", tmp_path / "x")
    with pytest.raises(ExportError, match="holds a 'falcon' head"):
        export(k2, "sglang", tmp_path / "x")
    e3 = _save(heads.build({"type": "eagle3", "layers": LAYERS}, base), base, tmp_path / "e3", identity)
    with pytest.raises(ExportError, match="eagle1 exports Falcon"):
        export(e3, "eagle1", tmp_path / "x")
    other = save_tiny_model(tmp_path / "other", seed=0, num_layers=6)
    with pytest.raises(ExportError, match="num_hidden_layers=6.*trained for"):
        export(e3, "vllm", tmp_path / "x", base=str(other))
    # a --base that is no model is one line naming it, never a traceback or the hub's message
    (tmp_path / "cfg_only").mkdir()
    (tmp_path / "cfg_only" / "config.json").write_text('{"model_type": "llama"}')
    for bad, message in ((tmp_path / "nope", "no such file or folder"), (tmp_path / "x_empty", "not a Hugging Face"),
                         (tmp_path / "cfg_only", None)):
        if bad.name == "x_empty":
            bad.mkdir()
        if message is None:  # a config without architectures: compared on sizes, not on a config class name
            with pytest.raises(ExportError, match="vocab_size=32000, but the head was trained"):
                export(e3, "vllm", tmp_path / "x", base=str(bad))
            continue
        with pytest.raises(ExportError, match=f"--base {bad}: {message}"):
            export(e3, "vllm", tmp_path / "x", base=str(bad))
    # the same shape, other weights: an export would pair the head with a base it never saw (vLLM copies the
    # base's embedding into it); refused as training and evaluation refuse it, for --base and a local --verifier
    same_shape = save_tiny_model(tmp_path / "same_shape", seed=5)
    with pytest.raises(ExportError, match=rf"--base {same_shape}: its weights \(sha256 \w+…\) are not the training "
                                          r"base's \(\w+…, .*\); a head drafts for the weights it was trained on"):
        export(e3, "vllm", tmp_path / "x", base=str(same_shape))
    with pytest.raises(ExportError, match=rf"--verifier {same_shape}: its weights"):
        export(e3, "vllm", tmp_path / "x", verifier=str(same_shape))
    assert not (tmp_path / "x").exists()
    assert export(e3, "vllm", tmp_path / "ok", base=str(tiny_model_dir)).is_dir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert main([str(e3), "--format", "vllm", str(tmp_path / "full")]) == 2
    assert main([str(tmp_path / "nope"), "--format", "vllm", str(tmp_path / "y")]) == 2
    here = tmp_path / "here"  # "." from an empty folder: was "[Errno 22] Invalid argument: '.'"
    here.mkdir()
    import os

    cwd = os.getcwd()
    os.chdir(here)
    try:
        assert main([str(e3), "--format", "sglang", "."]) == 0
    finally:
        os.chdir(cwd)
    assert (here / "model.safetensors").is_file() and (here / "config.json").is_file()


def _counts_for(ids, V):
    """Label counts [V] whose top ids.numel() tokens are exactly ``ids`` (the config route of issue 13)."""
    counts = torch.zeros(V, dtype=torch.int64)
    counts[ids] = torch.arange(ids.numel(), 0, -1) + 10
    return counts


def _restricted(base, ids):
    """An eagle3 head built with ``heads.draft_vocab_size`` = |ids| from label counts selecting ``ids``;
    its own LM head is scaled ×5 so it differs from the frozen rows W[d2t] it starts from."""
    import heads

    head = heads.build({"type": "eagle3", "layers": LAYERS, "draft_vocab_size": ids.numel()}, base,
                       label_counts=_counts_for(ids, base.config.vocab_size), counts_source="test")
    assert torch.equal(head.d2t, ids) and int(head.t2d.sum()) == ids.numel()
    torch.testing.assert_close(head.trainable_lm_head.weight, head.lm_head_weight[ids])  # EAGLE-3 init: W[d2t]
    with torch.no_grad():
        head.trainable_lm_head.weight.mul_(5.0)
    return head


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_reduced_draft_vocabulary_export_uses_offsets(tiny_base, tmp_path, engine):
    """d2t in the exports is the engines' offset (target = d + d2t[d]); draft logits land on the
    same base ids as draftheads' own mapping."""
    import heads
    from heads.export import export

    base, _, identity = tiny_base
    ids = torch.sort(torch.randperm(base.config.vocab_size, generator=torch.Generator().manual_seed(8))[:57]).values
    head = _restricted(base, ids)
    _sharpen(head)
    out = export(_save(head, base, tmp_path / "ckpt", identity), engine, tmp_path / "out")
    W = load_file(out / "model.safetensors")
    assert torch.equal(W["d2t"], ids - torch.arange(57)) and int(W["t2d"].sum()) == 57
    tok = torch.randint(3, 300, (8,), generator=torch.Generator().manual_seed(4))
    got, want = read_eagle3(out, base, tok, engine), _draftheads_eagle3(head, base, tok)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    torch.testing.assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("covers", [True, False])
def test_reduced_draft_vocabulary_decodes_losslessly(tiny_base, covers):
    """Parity with vanilla greedy over a reduced draft vocabulary (odd ids) that holds every token
    vanilla emits (covers) or none of them (the drafter can never propose the right token)."""
    from decoding.speculative import SpeculativeDecoder
    from decoding.vanilla import greedy_generate

    base, tok, _ = tiny_base
    prompt = torch.randint(3, 300, (6,), generator=torch.Generator().manual_seed(1))
    ref, _ = greedy_generate(base, prompt, 20, [tok.eos_token_id])
    vocab = set(range(3, 300, 2)) | set(ref) if covers else set(range(3, 300, 2)) - set(ref)
    ids = torch.tensor(sorted(vocab))
    assert set(ref) <= vocab if covers else not set(ref) & vocab
    head = _restricted(base, ids).eval()
    drafter = head.make_drafter(base, decoding={"depth": 4, "topk": 3, "total_tokens": 12})
    out, stats = SpeculativeDecoder(base, drafter, [tok.eos_token_id]).generate(prompt, 20)
    assert out == ref
    if not covers:
        assert sum(stats["accepted_per_depth"]) == 0
    tree = drafter.draft(int(ref[-1]))  # drafting again from the final state: every draft token is a draft-vocabulary id
    assert set(tree.tokens[1:].tolist()) <= vocab
