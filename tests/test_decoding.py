"""Tree verification, KV-cache compaction, and speculative == vanilla parity on a tiny Llama (fp32).

The tiny model uses ``initializer_range=0.3`` so that its greedy outputs vary (with the default
0.02 a random Llama repeats one token, which would make parity trivially true).
"""
from __future__ import annotations

import random

import pytest
import torch

from core.tiny import tiny_llama
from decoding.reference import OracleDrafter, RandomDrafter
from decoding.speculative import Decoder, Drafter, SpeculativeDecoder, tau
from decoding.tree import DraftTree
from decoding.vanilla import greedy_generate
from decoding.verify import base_forward, greedy_accept, keep_cache_positions, prefill, verify_tree

V = 384


@pytest.fixture(scope="module", params=["eager", "sdpa"])
def model(request):
    return tiny_llama(seed=0, attn_implementation=request.param, initializer_range=0.3)


@pytest.fixture(scope="module")
def eager_model():
    return tiny_llama(seed=0, attn_implementation="eager", initializer_range=0.3)


def _prompt(seed: int, n: int = 11) -> torch.Tensor:
    return torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(seed))


def _sequential(model, ids: list[int]):
    """Logits [T, V] and hidden [T, H] of a one-token-at-a-time cached pass, and the cache."""
    cache, _, _ = prefill(model, torch.tensor(ids[:1]))
    logits, hidden = [], []
    first = model(input_ids=torch.tensor([ids[:1]]), output_hidden_states=True)
    logits.append(first.logits[0, -1])
    hidden.append(first.hidden_states[-1][0, -1])
    for t in ids[1:]:
        lg, hs = base_forward(model, torch.tensor([t]), cache)
        logits.append(lg[-1])
        hidden.append(hs[-1])
    return torch.stack(logits), torch.stack(hidden), cache


def _random_tree(root: int, seed: int, greedy: list[int] | None = None) -> DraftTree:
    rng = random.Random(seed)
    paths = [[rng.randrange(V) for _ in range(rng.randrange(1, 5))] for _ in range(6)]
    if greedy:  # a path that follows the greedy continuation for a while, below some siblings
        paths.append(greedy)
        paths += [greedy[:k] + [rng.randrange(V)] for k in range(len(greedy))]
    scores = [rng.random() for _ in paths]
    return DraftTree.from_paths(root, paths, scores)


def test_hidden_state_is_post_norm(eager_model):
    out = eager_model(_prompt(0)[None], output_hidden_states=True)
    torch.testing.assert_close(eager_model.lm_head(out.hidden_states[-1]), out.logits)


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_logits_equal_sequential_logits(model, seed):
    prompt = _prompt(seed)
    cache, root, hidden = prefill(model, prompt)
    tree = _random_tree(root, seed)
    assert tree.num_nodes > 8 and tree.max_depth >= 3
    res = verify_tree(model, cache, tree)
    for node in range(tree.num_nodes):
        ids = prompt.tolist() + tree.token_path(node)
        ref = model(input_ids=torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(res.logits[node], ref, atol=1e-4, rtol=1e-4, msg=f"node {node}")


def test_greedy_accept_brute_force():
    rng = random.Random(3)
    for _ in range(50):
        tree = DraftTree.from_paths(0, [[rng.randrange(3) for _ in range(rng.randrange(1, 4))] for _ in range(5)])
        preds = [rng.randrange(3) for _ in range(tree.num_nodes)]
        got = greedy_accept(tree, preds)
        toks = tree.tokens.tolist()
        # brute force: a node is acceptable iff every edge on its path matches the parent's argmax
        ok = [i for i in range(tree.num_nodes)
              if all(toks[b] == preds[a] for a, b in zip(tree.path(i), tree.path(i)[1:]))]
        deepest = max(ok, key=lambda i: int(tree.depths[i]))
        assert got == tree.path(got[-1]) and len(got) - 1 == int(tree.depths[deepest])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cache_after_acceptance_equals_sequential_cache(model, seed):
    prompt = _prompt(seed)
    greedy, _ = greedy_generate(model, prompt, 7)
    cache, root, _ = prefill(model, prompt)
    assert root == greedy[0]
    # greedy continuation (minus the last token so the bonus is real) hidden below random siblings
    tree = _random_tree(root, seed, greedy=greedy[1:5])
    res = verify_tree(model, cache, tree)
    assert res.num_accepted == 4 and res.tokens.tolist() == greedy[:5] and res.bonus == greedy[5]
    assert res.accepted_nodes != list(range(5)), "test should exercise a non-contiguous accepted path"
    ref_logits, ref_hidden, ref_cache = _sequential(model, prompt.tolist() + greedy[:5])
    assert cache.get_seq_length() == ref_cache.get_seq_length() == len(prompt) + 5
    for i, (a, b) in enumerate(zip(cache.layers, ref_cache.layers)):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-4, rtol=1e-4, msg=f"layer {i} keys")
        torch.testing.assert_close(a.values, b.values, atol=1e-4, rtol=1e-4, msg=f"layer {i} values")
    torch.testing.assert_close(res.hidden, ref_hidden[len(prompt):], atol=1e-4, rtol=1e-4)
    # decoding continues correctly from the compacted cache
    lg, _ = base_forward(model, torch.tensor([res.bonus]), cache)
    assert int(lg[-1].argmax()) == greedy[6]


@pytest.mark.parametrize("keep", [[0], [0, 1, 2], [0, 2, 5], [0, 4, 1, 3], [3, 0], [0, 1, 2, 3, 4, 5]])
def test_keep_cache_positions_equals_a_gather_of_the_whole_layer(keep):
    """The compaction moves only the kept tree slots; the cache must equal a full index-select of
    positions [0, P) + P + keep in every layer, in any order of ``keep``, and grow correctly after."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(len(keep))
    past, n = 7, 6
    cache = DynamicCache()
    full = []
    for i in range(3):
        k, v = torch.randn(1, 2, past + n, 4, generator=gen), torch.randn(1, 2, past + n, 4, generator=gen)
        cache.update(k.clone(), v.clone(), i)
        full.append((k, v))
    keep_cache_positions(cache, past, torch.tensor(keep))
    idx = torch.cat([torch.arange(past), past + torch.tensor(keep)])
    assert cache.get_seq_length() == past + len(keep)
    for i, (k, v) in enumerate(full):
        torch.testing.assert_close(cache.layers[i].keys, k.index_select(-2, idx), rtol=0, atol=0)
        torch.testing.assert_close(cache.layers[i].values, v.index_select(-2, idx), rtol=0, atol=0)
        new_k = torch.randn(1, 2, 1, 4, generator=gen)
        kk, _ = cache.layers[i].update(new_k, new_k.clone())
        torch.testing.assert_close(kk, torch.cat([k.index_select(-2, idx), new_k], dim=-2), rtol=0, atol=0)


def test_vanilla_matches_hf_generate(eager_model):
    prompt = _prompt(5)
    ours, stats = greedy_generate(eager_model, prompt, 20)
    hf = eager_model.generate(prompt[None], max_new_tokens=20, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == hf and stats["base_forwards"] == 19 and stats["new_tokens"] == 20


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_parity_random_drafter_tau_near_one(model, seed):
    prompt = _prompt(seed)
    ref, _ = greedy_generate(model, prompt, 24)
    drafter = RandomDrafter(V, depth=3, width=3, seed=seed)
    assert isinstance(drafter, Drafter)
    out, stats = SpeculativeDecoder(model, drafter).generate(prompt, 24)
    assert out == ref
    assert tau(stats) < 1.2
    assert stats["base_forwards"] == stats["steps"] == len(stats["emitted_per_step"])
    assert 1 + sum(stats["emitted_per_step"]) == stats["new_tokens"] == 24


@pytest.mark.parametrize("depth,width,shuffle,miss", [(4, 1, False, 0.0), (5, 3, True, 0.0), (4, 3, True, 0.35)])
def test_parity_oracle_drafter(model, depth, width, shuffle, miss):
    for seed in range(3):
        prompt = _prompt(10 + seed)
        ref, _ = greedy_generate(model, prompt, 30)
        dec = SpeculativeDecoder(model, OracleDrafter(model, depth, width, shuffle, miss, seed=seed))
        assert isinstance(dec, Decoder)
        out, stats = dec.generate(prompt, 30)
        assert out == ref, f"prompt seed {seed}"
        acc, prop = stats["accepted_per_depth"], stats["proposed_per_depth"]
        if miss == 0.0:
            # every step accepts the whole chain: τ = depth + 1 except the truncated last step
            assert stats["emitted_per_step"][:-1] == [depth + 1] * (stats["steps"] - 1)
            assert tau(stats) >= depth + 1 - depth / stats["steps"]
            assert acc == prop
            assert stats["base_forwards"] == -(-29 // (depth + 1))
        else:
            assert 1.0 < tau(stats) < depth + 1
            assert all(a <= p for a, p in zip(acc, prop)) and acc[0] > 0


def test_eos_and_max_new_tokens_stop_like_vanilla(eager_model):
    prompt = _prompt(7)
    full, _ = greedy_generate(eager_model, prompt, 40)
    for stop_at in (0, 3, 9, 17):
        eos = full[stop_at]
        first = full.index(eos)
        ref, _ = greedy_generate(eager_model, prompt, 40, eos_token_ids=[eos])
        assert ref == full[: first + 1]
        out, stats = SpeculativeDecoder(eager_model, OracleDrafter(eager_model, 5, 2), [eos]).generate(prompt, 40)
        assert out == ref and stats["new_tokens"] == first + 1
    for max_new in (1, 2, 6, 7, 13):
        ref, _ = greedy_generate(eager_model, prompt, max_new)
        assert ref == full[:max_new]
        out, stats = SpeculativeDecoder(eager_model, OracleDrafter(eager_model, 5, 2)).generate(prompt, max_new)
        assert out == ref
        assert stats["base_forwards"] == -(-(max_new - 1) // 6)


def test_bad_inputs_raise(eager_model):
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_generate(eager_model, _prompt(0), 0)
    with pytest.raises(ValueError, match="prompt_ids"):
        greedy_generate(eager_model, torch.zeros(0, dtype=torch.long), 4)
    with pytest.raises(TypeError, match="Drafter"):
        SpeculativeDecoder(eager_model, object())

    class WrongRoot(RandomDrafter):
        def draft(self, root_token):
            return DraftTree.chain(root_token + 1, [1])

    with pytest.raises(ValueError, match="root token"):
        SpeculativeDecoder(eager_model, WrongRoot(V)).generate(_prompt(0), 5)


@pytest.mark.slow
def test_real_model_tree_logits_and_oracle_parity():
    """SmolLM2-135M (packaged GGUF, fp32): tree logits = one-sequence logits; oracle parity."""
    from core.base_model import load_base_model

    model, tok, _ = load_base_model({"path": None, "dtype": "float32", "attn_implementation": "eager"})
    prompt = torch.tensor(tok.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                                  tokenize=True, return_dict=False, add_generation_prompt=True))
    ref, _ = greedy_generate(model, prompt, 12)
    cache, root, _ = prefill(model, prompt)
    tree = DraftTree.from_paths(root, [ref[1:5], [ref[1], 11, 12], [13, 14]])
    res = verify_tree(model, cache, tree)
    assert res.tokens.tolist() == ref[:5] and res.bonus == ref[5]
    for node in range(tree.num_nodes):
        full = model(input_ids=torch.tensor([prompt.tolist() + tree.token_path(node)])).logits[0, -1]
        torch.testing.assert_close(res.logits[node], full, atol=1e-3, rtol=1e-4, msg=f"node {node}")
    out, stats = SpeculativeDecoder(model, OracleDrafter(model, 4, 2)).generate(prompt, 12)
    assert out == ref and stats["emitted_per_step"] == [5, 5, 1]  # 1 (prefill) + 5 + 5 + 1 = 12
