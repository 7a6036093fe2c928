"""AdaDecode heads and loss (METHODS.md §3.2-3.3) on the tiny Llama: logit-lens init, KL, metrics."""
from __future__ import annotations


import pytest
import torch

import heads
from heads.base import Progress
from losses.adadecode import adadecode_loss, kl_per_token

LAYERS = [1, 2, 3]  # the tiny model has L = 4


@pytest.fixture(scope="module")
def model(tiny_base):
    return tiny_base[0]


def make_head(model, **cfg):
    return heads.build({"type": "adadecode", "layers": LAYERS, "val_gammas": [0.0, 0.02, 0.05, 1.5], **cfg}, model)


def forward_states(model, ids):
    """hs (HF hidden states) and the pre-norm final residual for ids [B, T]."""
    captured = {}

    def grab(module, inputs, output):
        captured["pre"] = inputs[0]

    hook = model.model.norm.register_forward_hook(grab)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    hook.remove()
    return out, captured["pre"]


def make_batch(model, B=2, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (B, T), generator=g)
    out, pre = forward_states(model, ids)
    hs = out.hidden_states
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, :3] = False
    mask[1, -2:] = False
    return {
        "input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.bool), "loss_mask": mask,
        "labels": out.logits.argmax(-1), "hidden": hs[-1], "aux_hidden": {l: hs[l] for l in LAYERS},
        "lengths": torch.full((B,), T), "ids": [f"c{i}" for i in range(B)],
    }, out, pre


def test_init_is_logit_lens_and_param_count(model):
    head = make_head(model)
    batch, out, _ = make_batch(model)
    assert torch.allclose(out.logits, head.lm_head(out.hidden_states[-1]), atol=1e-5)  # METHODS §0 assert
    for l in LAYERS:
        z = head.layer_logits(l, batch["aux_hidden"][l])
        lens = model.lm_head(model.model.norm(out.hidden_states[l]))
        assert torch.allclose(z, lens, atol=1e-5), l
    H, V = model.config.hidden_size, model.config.vocab_size
    rep = head.cfg["param_counts"]
    assert rep["per_head"] == H * H == head.transforms["1"].weight.numel()
    assert rep["full_lm_head"] == V * H and rep["total"] == 3 * H * H
    assert sum(p.numel() for p in head.parameters() if p.requires_grad) == 3 * H * H


def tiny_gemma():
    """A random 4-layer Gemma: its final RMSNorm scales by (1 + w), not w."""
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    cfg = GemmaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    base = GemmaForCausalLM(cfg).eval()
    with torch.no_grad():
        base.model.norm.weight.normal_(0, 0.5)
    return base


@pytest.mark.parametrize("base_kind", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_exits_use_the_norm_decoding_applies(model, base_kind, dtype):
    """The exits train on the final norm the AdaDecode decoder applies (the base's own module): a
    Gemma base's (1 + w) RMSNorm included, and a bf16 base's rounded as the base rounds it."""
    import copy

    base = copy.deepcopy(model if base_kind == "llama" else tiny_gemma()).to(dtype)
    head = make_head(base)
    h = torch.randn(3, 5, base.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        want = base.model.norm(h)
        assert torch.equal(head.final_norm(h), want)
        T = head.transforms["2"]  # the head's own dtype (fp32): the exit's input is normalised in it
        assert torch.equal(head.layer_features(2, h), T(base.model.norm(h.to(T.weight.dtype))).float())
    assert not any(k.startswith("base_norm") for k in head.trainable_state_dict())
    assert not any(n.startswith("base_norm") for n, _ in head.named_parameters())


def test_kl_zero_when_head_equals_final_layer(model):
    head = make_head(model)
    batch, out, pre = make_batch(model)
    # every head reads the final layer's pre-norm residual: with T = I it equals the final head
    batch["aux_hidden"] = {l: pre for l in LAYERS}
    loss, metrics = head.training_loss(batch, Progress())
    assert abs(float(loss.detach())) < 1e-5 and all(abs(metrics[f"kl_l{l}"]) < 1e-5 for l in LAYERS)
    t = out.logits
    assert float(adadecode_loss(t, {1: t.clone()})[0]) == pytest.approx(0.0, abs=1e-6)


def test_loss_matches_brute_force(model):
    head = make_head(model, layer_weights=[1.0, 0.5, 2.0], chunk_tokens=5)
    batch, out, _ = make_batch(model)
    loss, metrics = head.training_loss(batch, Progress())
    m = batch["loss_mask"]
    expected = 0.0
    for l, w in zip(LAYERS, [1.0, 0.5, 2.0]):
        p = torch.softmax(out.logits.double(), -1)
        q = torch.softmax(model.lm_head(model.model.norm(out.hidden_states[l])).double(), -1)
        kl = (p * (p.log() - q.log())).sum(-1)[m].mean()
        assert metrics[f"kl_l{l}"] == pytest.approx(float(kl), rel=1e-4)
        expected += w * float(kl)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-4)
    assert float(kl_per_token(out.logits, out.logits + 3.0).abs().max()) < 1e-5  # shift-invariant


def test_fused_training_gradients_match_autograd_through_the_logits(model):
    """training_loss takes its gradients in the forward (linear_soft_cross_entropy); they equal
    autograd through the textbook per-layer KL of layer_logits, with a trained (non-identity) T_ℓ."""
    head = make_head(model, layer_weights=[1.0, 0.5, 2.0], chunk_tokens=5)
    with torch.no_grad():
        for i, T in enumerate(head.transforms.values()):
            T.weight.add_(0.05 * torch.randn(T.weight.shape, generator=torch.Generator().manual_seed(i)))
    batch, out, _ = make_batch(model, seed=2)
    loss, _ = head.training_loss(batch, Progress())
    loss.backward()
    fused = {k: T.weight.grad.clone() for k, T in head.transforms.items()}
    head.zero_grad()
    m = batch["loss_mask"]
    ref = sum(w * kl_per_token(out.logits[m], head.layer_logits(l, batch["aux_hidden"][l][m])).mean()
              for l, w in zip(LAYERS, [1.0, 0.5, 2.0]))
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for k, T in head.transforms.items():
        assert float(fused[k].abs().max()) > 0, k
        torch.testing.assert_close(fused[k], T.weight.grad, rtol=1e-4, atol=1e-7)


def test_training_reduces_loss_and_grads_only_on_transforms(model):
    head = make_head(model, chunk_tokens=7)
    batch, _, _ = make_batch(model, seed=1)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    first = None
    for _ in range(6):
        loss, _ = head.training_loss(batch, Progress())
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(head.training_loss(batch, Progress())[0]) < 0.8 * first
    assert not head.lm_head_weight.requires_grad and head.lm_head_weight.grad is None


def test_missing_layer_is_named(model):
    head = make_head(model)
    batch, _, _ = make_batch(model)
    del batch["aux_hidden"][2]
    with pytest.raises(KeyError, match=r"candidate layer 2 .*prep.layers=\[1,2,3\]"):
        head.training_loss(batch, Progress())


def test_bad_config_is_named(model):
    with pytest.raises(ValueError, match="heads.layers"):
        make_head(model, layers=[2, 4])
    with pytest.raises(ValueError, match="gamma_schedule"):
        make_head(model, gamma_schedule=[0.5])


def test_validation_metrics_match_brute_force(model):
    head = make_head(model, gamma=0.03, chunk_tokens=4)
    batch, out, _ = make_batch(model, B=3, T=10, seed=2)
    vm = head.validation_metrics(batch)
    m = batch["loss_mask"]
    labels = batch["labels"][m]
    conf, arg = {}, {}
    for l in LAYERS:
        p = torch.softmax(model.lm_head(model.model.norm(out.hidden_states[l])), -1)[m]
        conf[l], arg[l] = p.max(-1)
    n = int(m.sum())
    L = model.config.num_hidden_layers
    for g in [0.0, 0.02, 0.05, 1.5]:
        for l in LAYERS:
            ex = conf[l] >= g
            s, c = vm[f"exit_l{l}_g{g:g}"].tolist()
            assert (s, c) == (float(ex.sum()), float(n))
            s, c = vm[f"mismatch_l{l}_g{g:g}"].tolist()
            assert (s, c) == (float((ex & (arg[l] != labels)).sum()), float(ex.sum()))
        # brute-force policy: first confident layer
        exits = wrong = 0
        saved = cost = 0.0
        for t in range(n):
            e = next((l for l in LAYERS if conf[l][t] >= g), None)
            if e is None:
                cost += 1.0
                continue
            exits += 1
            ok = bool(arg[e][t] == labels[t])
            wrong += not ok
            saved += (L - e) / L
            cost += e / L if ok else (e + L) / L
        assert vm[f"policy_g{g:g}_exit"].tolist() == [exits, n]
        assert vm[f"policy_g{g:g}_reject"].tolist() == [wrong, exits]
        assert vm[f"policy_g{g:g}_saved"][0].item() == pytest.approx(saved, abs=1e-5)
        assert vm[f"policy_g{g:g}_cost"][0].item() == pytest.approx(cost, abs=1e-5)
    conf_pol = head._policy(torch.stack([conf[l] for l in LAYERS]),
                            torch.stack([arg[l] == labels for l in LAYERS]), [0.03] * 3)
    assert vm["exit_rate"].tolist() == conf_pol["exit"].tolist()
    assert vm["reject_rate"].tolist() == conf_pol["reject"].tolist()
    s, c = vm["sim_layer_speedup"].tolist()
    assert s / c == pytest.approx(1.0 / (vm["sim_cost"][0] / vm["sim_cost"][1]).item(), rel=1e-6)
    assert vm["loss"][1].item() == n
    g0 = vm["policy_g0_exit"].tolist()
    assert g0 == [n, n]  # γ = 0: every token exits at the first candidate layer
    assert vm["policy_g1.5_exit"].tolist() == [0, n]


def test_gamma_slope_schedule(model):
    head = make_head(model, gamma=0.8, gamma_slope=0.1)
    assert head.gammas == pytest.approx({1: 0.7, 2: 0.8, 3: 0.9})
    head = make_head(model, gamma=0.8, gamma_schedule=[0.9, 0.5, 0.6])
    assert head.gammas == {1: 0.9, 2: 0.5, 3: 0.6}
    # the sweep's corner (γ 0.95, slope 0.1) gave the top layer γ 1.05: a threshold no confidence reaches
    head = make_head(model, gamma=0.95, gamma_slope=0.1)
    assert head.gammas == pytest.approx({1: 0.85, 2: 0.95, 3: 1.0})
    for bad in ({"gamma": 1.5}, {"gamma_schedule": [0.5, 1.2, 0.9]}):
        with pytest.raises(ValueError, match=r"in \[0, 1\] \(.*exit threshold"):
            make_head(model, **bad)


def test_save_load_roundtrip(model, tmp_path):
    head = make_head(model)
    with torch.no_grad():
        head.transforms["2"].weight.add_(0.01)
    heads.save(head, tmp_path / "ck", {"source": "tiny", "vocab_size": model.config.vocab_size})
    loaded, meta = heads.load(tmp_path / "ck", base_model=model)
    assert meta["head"]["param_counts"]["per_head"] == model.config.hidden_size ** 2
    assert sorted(loaded.state_dict()) == ["transforms.1.weight", "transforms.2.weight", "transforms.3.weight"]
    assert torch.equal(loaded.transforms["2"].weight, head.transforms["2"].weight)


def test_every_rank_runs_the_same_number_of_chunk_forwards(model, monkeypatch):
    """Under ZeRO-3 each chunk forward gathers the head's parameters with a collective, so a rank
    with fewer tokens must run as many chunk forwards as the rank with the most (the extra ones
    empty): with another rank holding 40 tokens (10 chunks of 4), this rank's 16 tokens run 10
    chunk forwards in training and validation, and the loss and metrics are unchanged."""
    head = make_head(model, chunk_tokens=4)
    batch, _, _ = make_batch(model)
    loss0, metrics0 = head.training_loss(batch, Progress())
    val0 = head.validation_metrics(batch)
    n = int(batch["loss_mask"].sum())
    assert list(head._chunk_starts(n, "cpu")) == list(range(0, n, 4))  # no process group: local chunks

    import torch.distributed as dist

    def all_reduce(t, op=None):
        t.copy_(torch.maximum(t, torch.tensor([10])))  # the other rank's 40 tokens -> 10 chunks

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    calls = []
    for name in ("_chunk_stats", "_chunk_kl_fused"):  # validation's and training's chunk forwards
        monkeypatch.setattr(head, name, lambda *a, real=getattr(head, name), **k: (calls.append(a[0].shape[0]),
                                                                                   real(*a, **k))[1])
    loss, metrics = head.training_loss(batch, Progress())
    assert calls == [4] * (n // 4) + [n % 4] + [0] * (10 - n // 4 - 1)
    assert float(loss.detach()) == pytest.approx(float(loss0.detach()), rel=1e-6) and metrics == pytest.approx(metrics0, rel=1e-6)
    calls.clear()
    val = head.validation_metrics(batch)
    assert len(calls) == 10 and all(torch.allclose(val[k], val0[k]) for k in val0)
