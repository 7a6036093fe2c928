"""Bases other than Llama: every head builds and trains over a Gemma 2, Cohere, Granite, Qwen 3 or Phi-3 base (its layers a
Llama layer sized like the base), and the base's own map of W h to its logits (Gemma 2's final soft-capping,
Cohere's logit_scale, Granite's logits_scaling) is applied wherever draftheads scores hidden states with the
frozen LM head."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import heads
from core.logit_transform import LogitTransform, check_logit_transform, logit_transform
from heads.base import Progress
from losses.falcon import falcon_loss, falcon_loss_fused
from losses.linear_soft_ce import linear_soft_cross_entropy

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=64)


def tiny(kind: str, sliding: bool = False):
    """A random 4-layer base whose forward maps W h: its map is made to bite (a cap below its largest
    logits, a scale far from 1).  A Gemma 2 has full attention in every layer unless ``sliding``."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "gemma2":
        layers = {} if sliding else {"layer_types": ["full_attention"] * TINY["num_hidden_layers"]}
        cfg = tf.Gemma2Config(**TINY, final_logit_softcapping=0.05, **layers)
        model = tf.Gemma2ForCausalLM(cfg)
    elif kind == "cohere":
        cfg = tf.CohereConfig(**{k: v for k, v in TINY.items() if k != "head_dim"}, logit_scale=7.0)
        model = tf.CohereForCausalLM(cfg)
    elif kind == "granite":
        cfg = tf.GraniteConfig(**{k: v for k, v in TINY.items() if k != "head_dim"}, logits_scaling=0.125)
        model = tf.GraniteForCausalLM(cfg)
    elif kind == "qwen3":  # no map; q/k norms, a head_dim of its own
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**TINY))
    elif kind == "phi3":  # no map; fused qkv and gate/up projections
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**{k: v for k, v in TINY.items() if k != "head_dim"}, pad_token_id=0))
    else:
        raise AssertionError(kind)
    model.eval().requires_grad_(False)
    return model


def states(model, T=10, seed=1):
    ids = torch.randint(3, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return ids, model(input_ids=ids, output_hidden_states=True)


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "granite"])
def test_head_lm_head_gives_the_base_logits(kind):
    model = tiny(kind)
    _, out = states(model)
    raw = model.get_output_embeddings()(out.hidden_states[-1])
    assert not torch.allclose(raw, out.logits, atol=1e-3)  # the map bites: W h alone is another distribution
    assert check_logit_transform(model) == logit_transform(model.config) and not logit_transform(model.config).is_identity
    head = heads.build({"type": "falcon"}, model)
    torch.testing.assert_close(head.lm_head(out.hidden_states[-1]), out.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.draft_lm_head(out.hidden_states[-1]), out.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.logits_fp32(out.hidden_states[-1]), out.logits, rtol=1e-5, atol=1e-6)


def test_the_map_values():
    z = torch.tensor([-100.0, -1.0, 0.0, 0.5, 100.0])
    assert torch.equal(LogitTransform()(z), z) and LogitTransform().is_identity
    torch.testing.assert_close(LogitTransform(softcap=2.0)(z), 2.0 * torch.tanh(z / 2.0))
    torch.testing.assert_close(LogitTransform(scale=0.5, softcap=2.0)(z), 2.0 * torch.tanh(0.25 * z))
    z64 = torch.linspace(-5, 5, 41, dtype=torch.float64, requires_grad=True)
    t = LogitTransform(scale=0.7, softcap=1.5)
    out = t(z64)
    (grad,) = torch.autograd.grad(out.sum(), z64)
    torch.testing.assert_close(t.derivative(out.detach()), grad)


def test_a_base_that_changes_its_logits_otherwise_is_refused(tiny_base):
    model = tiny_base[0]
    assert check_logit_transform(model).is_identity  # a Llama: logits = W h
    real = type(model).forward

    def shifted(self, *a, **k):
        out = real(self, *a, **k)
        out.logits = out.logits * 3.0 + 1.0
        return out

    try:
        type(model).forward = shifted
        with pytest.raises(ValueError, match=r"model\.path='my/base'.*not its LM head's product"):
            check_logit_transform(model, "model.path='my/base'")
    finally:
        type(model).forward = real


def test_a_bad_cap_is_named():
    from transformers import Gemma2Config

    with pytest.raises(ValueError, match="final_logit_softcapping"):
        logit_transform(Gemma2Config(**TINY, final_logit_softcapping=-1.0))


@pytest.mark.parametrize("chunk_rows", [3, 256])
def test_fused_soft_ce_through_the_map_matches_autograd(chunk_rows):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(17, 8, generator=g, dtype=torch.float64), torch.randn(30, 8, generator=g, dtype=torch.float64)
    probs = torch.softmax(torch.randn(17, 30, generator=g, dtype=torch.float64), -1)
    t = LogitTransform(scale=1.3, softcap=2.0)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    fused = linear_soft_cross_entropy(x1, w1, probs, chunk_rows=chunk_rows, transform=t)
    (1.7 * fused.loss).backward()
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    z = t(x2 @ w2.T)
    ref = -(probs * F.log_softmax(z, -1)).sum()
    (1.7 * ref).backward()
    torch.testing.assert_close(fused.loss, ref)
    torch.testing.assert_close(fused.lse, torch.logsumexp(z.detach(), -1))
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)
    plain = linear_soft_cross_entropy(x, w, probs, chunk_rows=chunk_rows)
    assert not torch.allclose(plain.loss, ref)  # without the map: another loss


def test_falcon_fused_loss_through_the_map_equals_its_logits_loss():
    g = torch.Generator().manual_seed(2)
    M, H, N = 11, 8, 25
    pred = torch.randn(M, H, generator=g, dtype=torch.float64).float()
    tgt = torch.randn(M, H, generator=g).float()
    w = torch.randn(N, H, generator=g).float()
    t = LogitTransform(softcap=1.5)
    teacher = t(tgt @ w.T)
    ce_mask = torch.rand(M, generator=g) > 0.3
    p1 = pred.clone().requires_grad_()
    loss, parts, ids = falcon_loss_fused(p1, tgt, w, teacher, ce_mask=ce_mask, transform=t)
    loss.backward()
    p2 = pred.clone().requires_grad_()
    ref, ref_parts = falcon_loss(p2, tgt, t(p2 @ w.T), teacher, torch.ones(M, dtype=torch.bool), ce_mask=ce_mask)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for k in ("reg", "kl", "ce"):
        torch.testing.assert_close(parts[k], ref_parts[k], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-4, atol=1e-6)
    assert torch.equal(ids, t(pred @ w.T).argmax(-1))


def test_adadecode_exits_learn_and_decode_the_capped_distribution():
    """The exits' KL teacher is the base's own (soft-capped) distribution, the student its logit lens under the
    same cap (brute force from the base's forward); the decoder scores exits and verifies with those logits."""
    from decoding.adadecode import AdaDecodeDecoder, layerwise_forward

    model = tiny("gemma2")
    ids, out = states(model)
    layers = [1, 2, 3]
    head = heads.build({"type": "adadecode", "layers": layers, "val_gammas": [0.0, 0.5]}, model)
    hs = out.hidden_states
    mask = torch.ones(ids.shape, dtype=torch.bool)
    mask[:, :2] = False
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(mask), "loss_mask": mask, "labels": out.logits.argmax(-1),
             "hidden": hs[-1], "aux_hidden": {l: hs[l] for l in layers}, "lengths": torch.full((2,), ids.shape[1]),
             "ids": ["a", "b"]}
    _, metrics = head.training_loss(batch, Progress())
    t = logit_transform(model.config)
    p = torch.softmax(out.logits.double(), -1)
    for l in layers:
        q = torch.softmax(t(model.lm_head(model.model.norm(hs[l]))).double(), -1)
        kl = (p * (p.log() - q.log())).sum(-1)[mask].mean()
        q_raw = torch.softmax(model.lm_head(model.model.norm(hs[l])).double(), -1)  # the map left out
        kl_raw = (p * (p.log() - q_raw.log())).sum(-1)[mask].mean()
        assert metrics[f"kl_l{l}"] == pytest.approx(float(kl), rel=1e-3, abs=1e-7)
        assert abs(float(kl_raw) - float(kl)) > 10 * (1e-3 * float(kl) + 1e-7)
    dec = AdaDecodeDecoder(model, head, gamma=0.5)
    torch.testing.assert_close(dec.lm_head(hs[-1]), out.logits, rtol=1e-5, atol=1e-6)
    for l in layers:
        torch.testing.assert_close(dec.head_logits(l, hs[l]), head.layer_logits(l, hs[l]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layerwise_forward(model, ids[0]), out.logits[0], rtol=1e-4, atol=1e-5)


HEAD_CFGS = {"falcon": {"type": "falcon"}, "ctc": {"type": "ctc"}, "eagle3": {"type": "eagle3", "layers": [1, 2, 3]},
             "adadecode": {"type": "adadecode", "layers": [1, 2, 3]}}


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "granite", "qwen3", "phi3"])
@pytest.mark.parametrize("head_type", sorted(HEAD_CFGS))
def test_every_head_trains_over_another_base(kind, head_type):
    """Built from a Gemma 2 / Cohere / Granite config (which lack the Llama layer's keys), a head trains one
    step: a finite loss whose gradient reaches every trainable weight."""
    model = tiny(kind)
    ids, out = states(model, T=12)
    hs = out.hidden_states
    mask = torch.ones(ids.shape, dtype=torch.bool)
    mask[:, :2] = False
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(mask), "loss_mask": mask,
             "labels": out.logits.argmax(-1), "hidden": hs[-1], "aux_hidden": {l: hs[l] for l in (1, 2, 3)},
             "lengths": torch.full((2,), ids.shape[1]), "ids": ["a", "b"]}
    head = heads.build(HEAD_CFGS[head_type], model).train()
    loss, _ = head.training_loss(batch, Progress())
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in head.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads)


def test_a_llama_base_keeps_its_own_layer_config(tiny_base):
    from heads.layer_config import draft_layer_config

    base_cfg = tiny_base[0].config
    got = draft_layer_config(base_cfg, "sdpa")
    assert got is not base_cfg and got._attn_implementation == "sdpa"
    assert {k: v for k, v in got.to_dict().items() if k != "_attn_implementation_internal"} == \
        {k: v for k, v in base_cfg.to_dict().items() if k != "_attn_implementation_internal"}


def test_another_base_gives_a_llama_layer_of_its_sizes():
    from transformers import Gemma3TextConfig, LlamaConfig

    from heads.layer_config import draft_layer_config

    cfg = Gemma3TextConfig(**TINY)
    got = draft_layer_config(cfg)
    assert isinstance(got, LlamaConfig) and not got.mlp_bias and not got.attention_bias
    assert (got.hidden_size, got.intermediate_size, got.num_attention_heads, got.num_key_value_heads, got.head_dim) == \
        (32, 64, 2, 1, 16)
    assert got.rope_parameters == cfg.rope_parameters["full_attention"] and got.rms_norm_eps == cfg.rms_norm_eps
    assert got.hidden_act == "silu"


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "granite", "qwen3", "phi3"])
def test_speculative_output_equals_vanilla_greedy_over_another_base(kind):
    from decoding.speculative import SpeculativeDecoder
    from decoding.vanilla import greedy_generate

    base = tiny(kind)
    torch.manual_seed(0)
    head = heads.build({"type": "falcon", "block_size": 1, "glancing": {"enabled": False},
                        "decoding": {"passes": 3, "tree": {"depth_children": [3, 2, 2, 1]}}}, base)
    prompts = torch.randint(3, 90, (8, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ids = base.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=30, do_sample=False,
                            pad_token_id=0, eos_token_id=None)
        out = base(ids, output_hidden_states=True)
    valid = torch.ones_like(ids, dtype=torch.bool)
    loss_mask = valid.clone()
    loss_mask[:, :6] = False
    batch = dict(input_ids=ids, hidden=out.hidden_states[-1], attention_mask=valid, loss_mask=loss_mask,
                 labels=out.logits.argmax(-1))
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    head.train()
    for step in range(60):
        loss, _ = head.training_loss(batch, Progress(step=step, total_steps=60))
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter = head.eval().make_drafter(base)
    accepted = 0
    for prompt in (prompts[0], prompts[3]):
        ref, _ = greedy_generate(base, prompt, 24, [1])
        got, stats = SpeculativeDecoder(base, drafter, [1]).generate(prompt, 24)
        assert got == ref
        accepted += sum(stats["accepted_per_depth"])
    assert accepted > 0


def test_a_sliding_window_base_is_refused_before_decoding():
    from decoding.adadecode import AdaDecodeDecoder
    from decoding.speculative import SpeculativeDecoder

    base = tiny("gemma2", sliding=True)
    head = heads.build({"type": "falcon"}, base)
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM.*not full attention in layers 0 \(DynamicSlidingWindowLayer\)"):
        SpeculativeDecoder(base, head.eval().make_drafter(base), [1])
    exits = heads.build({"type": "adadecode", "layers": [1, 2, 3]}, base)
    with pytest.raises(ValueError, match="not full attention"):
        AdaDecodeDecoder(base, exits, gamma=0.5)
