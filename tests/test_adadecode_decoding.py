"""AdaDecode's layer-parallel decoding (METHODS.md §3.4): manual layer loop, parity with vanilla
greedy decoding in fp32, and rollback of wrong early predictions (KV cache == a clean cache)."""
from __future__ import annotations

import random

import pytest
import torch

import heads
from decoding.adadecode import AdaDecodeDecoder, layerwise_forward
from decoding.vanilla import greedy_generate
from decoding.verify import new_cache

LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def model():
    """A tiny random Llama (L = 4) with larger weights than ``tiny_base``, whose greedy output is
    varied (the default init repeats one token forever, which would make parity trivial)."""
    from core.tiny import tiny_llama

    return tiny_llama(seed=0, initializer_range=0.2)


@pytest.fixture(scope="module")
def head(model):
    return heads.build({"type": "adadecode", "layers": LAYERS}, model)


def prompts(model, n=3):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, model.config.vocab_size, (int(k),), generator=g) for k in (5, 9, 14)[:n]]


def brute_greedy(model, prompt, n):
    """Greedy decoding by full recomputation (no cache): an independent reference."""
    ids = prompt.clone()
    out = []
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(input_ids=ids[None]).logits[0, -1].argmax())
            out.append(tok)
            ids = torch.cat([ids, torch.tensor([tok])])
    return out


def assert_clean_cache(model, cache, prompt, tokens):
    """Every layer's KV equals a fresh sequential forward over prompt + tokens[:-1]."""
    ref = new_cache(model)
    with torch.no_grad():
        model(input_ids=torch.cat([prompt, torch.tensor(tokens[:-1], dtype=torch.long)])[None], cache=ref, use_cache=True)
    n = prompt.numel() + len(tokens) - 1
    for i in range(model.config.num_hidden_layers):
        assert cache.get_seq_length(i) == n, (i, cache.get_seq_length(i), n)
        torch.testing.assert_close(cache.layers[i].keys, ref.layers[i].keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(cache.layers[i].values, ref.layers[i].values, atol=1e-5, rtol=1e-4)


class PlantedDecoder(AdaDecodeDecoder):
    """Proposes drafts from a known reference continuation: correct or deliberately wrong."""

    def __init__(self, *a, reference, plan, **kw):
        super().__init__(*a, **kw)
        self.reference, self.plan = reference, plan  # plan(gen, layer) -> None | "right" | "wrong"

    def propose(self, layer, h, token):
        action = self.plan(token.gen, layer)
        if action is None or token.gen + 1 >= len(self.reference):
            return None
        right = self.reference[token.gen + 1]
        return right if action == "right" else (right + 1) % self.model.config.vocab_size


def test_manual_layer_loop_reproduces_forward(model):
    ids = prompts(model)[2]
    with torch.no_grad():
        ref = model(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(layerwise_forward(model, ids), ref, atol=1e-5, rtol=1e-4)
    cache = new_cache(model)  # and continuing on a cache, in pieces
    a = layerwise_forward(model, ids[:6], cache)
    b = layerwise_forward(model, ids[6:], cache)
    torch.testing.assert_close(torch.cat([a, b]), ref, atol=1e-5, rtol=1e-4)


def test_no_early_exit_parity(model, head):
    dec = AdaDecodeDecoder(model, head, gamma=1.5, eos_token_ids=[])
    L = model.config.num_hidden_layers
    for p in prompts(model):
        out, st = dec.generate(p, 20)
        assert out == brute_greedy(model, p, 20) and len(set(out)) > 10
        assert st["early_exits"] == 0 and st["layer_steps"] == L * 19 and st["head_evals"] == 19 * len(LAYERS)
        assert st["layer_step_speedup"] == 1.0
        assert_clean_cache(model, dec.last_cache, p, out)


@pytest.fixture(scope="module")
def random_head(model):
    """Heads with random orthogonal T_l: confident-or-not, their early drafts are mostly wrong."""
    h = heads.build({"type": "adadecode", "layers": LAYERS}, model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for lin in h.transforms.values():
            lin.weight.copy_(torch.linalg.qr(torch.randn(lin.weight.shape, generator=g))[0])
    return h


@pytest.mark.parametrize("which", ["logit_lens", "random"])
def test_gamma_zero_parity_heavy_rollback(model, head, random_head, which):
    dec = AdaDecodeDecoder(model, head if which == "logit_lens" else random_head, gamma=0.0, eos_token_ids=[])
    total_rej = total_acc = 0
    for p in prompts(model):
        ref, _ = greedy_generate(model, p, 30, [])
        out, st = dec.generate(p, 30)
        assert out == ref
        assert st["early_exits"] > 0 and st["exits_l1"] == st["early_exits"]  # always the first layer
        total_rej += st["rejected_exits"]
        total_acc += st["accepted_exits"]
        assert st["accepted_exits"] + st["rejected_exits"] <= st["early_exits"]
        assert_clean_cache(model, dec.last_cache, p, out)
    assert total_rej > 30


@pytest.mark.parametrize("max_inflight", [2, 5])
def test_planted_mixed_drafts_parity(model, head, max_inflight):
    """Right and wrong drafts at varying layers: long accepted chains (joint deferred layers)
    interleaved with rollbacks; output and final cache must equal vanilla's."""
    for k, p in enumerate(prompts(model)):
        ref, _ = greedy_generate(model, p, 40, [])
        rng = random.Random(k)
        choices = {}

        def plan(gen, layer):
            if (gen, layer) not in choices:
                r = rng.random()
                choices[(gen, layer)] = None if r < 0.3 else ("wrong" if r < 0.45 else "right")
            return choices[(gen, layer)]

        dec = PlantedDecoder(model, head, reference=ref, plan=plan, max_inflight=max_inflight, eos_token_ids=[])
        out, st = dec.generate(p, 40)
        assert out == ref
        assert st["accepted_exits"] > 5 and st["rejected_exits"] > 0
        assert st["max_inflight_seen"] == max_inflight
        assert st["layer_steps"] < model.config.num_hidden_layers * 39
        assert_clean_cache(model, dec.last_cache, p, out)


def test_planted_wrong_prediction_rolled_back(model, head):
    p = prompts(model)[1]
    ref, _ = greedy_generate(model, p, 16, [])
    k = next(i for i in range(3, 12) if ref[i] not in ref[:i])  # ref[k] can serve as an eos
    # token k-1 exits at layer 1 with a wrong draft; the planted heads then draft two successors of
    # the wrong token (at layers 1 and 2), so four tokens are in flight when it is verified
    plan = lambda gen, layer: {(k - 1, 1): "wrong", (k, 1): "right", (k + 1, 2): "right"}.get((gen, layer))
    # stop right after the rollback: the full model's correction ref[k] is an eos
    dec = PlantedDecoder(model, head, reference=ref, plan=plan, eos_token_ids=[ref[k]])
    out, st = dec.generate(p, 16)
    assert out == ref[:k + 1]
    assert st["rejected_exits"] == 1 and st["accepted_exits"] == 0 and st["max_inflight_seen"] == 4
    assert_clean_cache(model, dec.last_cache, p, out)
    dec = PlantedDecoder(model, head, reference=ref, plan=plan, eos_token_ids=[])
    out, st = dec.generate(p, 16)
    assert out == ref and st["rejected_exits"] == 1 and st["max_inflight_seen"] == 4
    assert_clean_cache(model, dec.last_cache, p, out)


def test_eos_stop_matches_vanilla(model, head):
    p = prompts(model)[0]
    ref, _ = greedy_generate(model, p, 30, [])
    eos = ref[7]
    want, _ = greedy_generate(model, p, 30, [eos])
    plan = lambda gen, layer: "right" if layer == 1 else None
    dec = PlantedDecoder(model, head, reference=ref, plan=plan, eos_token_ids=[eos])
    out, st = dec.generate(p, 30)
    assert out == want and out[-1] == eos
    out, _ = AdaDecodeDecoder(model, head, gamma=0.0, eos_token_ids=[eos]).generate(p, 30)
    assert out == want


def test_make_drafter_and_bad_args(model, head):
    dec = head.make_drafter(model, gamma_schedule=[0.1, 0.2, 0.3], eos_token_ids=[2], num_prompts=5)
    assert dec.gammas == {1: 0.1, 2: 0.2, 3: 0.3} and dec.eos == {2}
    with pytest.raises(ValueError, match="gamma_schedule"):
        head.make_drafter(model, gamma_schedule=[0.1])
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate(prompts(model)[0], 0)
