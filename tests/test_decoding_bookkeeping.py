"""Decoding bookkeeping (issue 12) on tiny Llamas (fp32):

1. a drafter's tree depends only on the committed context: at every verification step the tree
   drafted from the decoder's cached drafter state equals a fresh drafter's tree from the same
   committed tokens and features, for every head (AdaDecode: its per-layer KV cache equals a fresh
   forward over the committed tokens after every verification);
2. statistics count only emitted tokens (eos on the first draft, mid-path, on the bonus token);
3. trees stay inside the ``max_new_tokens`` budget and the context limit; a prompt + budget beyond
   ``max_position_embeddings`` is a clear error before decoding;
4. reference drafters give a prompt the same trees in any prompt order.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import heads
from core.tiny import tiny_llama
from decoding import speculative
from decoding.reference import OracleDrafter, RandomDrafter
from decoding.speculative import SpeculativeDecoder, tau
from decoding.tree import DraftTree
from decoding.vanilla import greedy_generate

ROOT = Path(__file__).resolve().parent.parent
HEADS = ["ctc", "falcon", "falcon_noglance", "falcon_k1"]


@pytest.fixture(scope="module")
def varied():
    """initializer_range=0.3: varied greedy outputs, and head weights of that scale (peaky attention)."""
    return tiny_llama(seed=0, attn_implementation="eager", initializer_range=0.3)


def _prompt(seed: int, n: int = 10, vocab: int = 384) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# -- 1. cached drafter == fresh drafter at every step ----------------------------------------------
class FreshCheck:
    """Wraps a Drafter; at every ``draft`` it also drafts with a fresh drafter started on the whole
    committed context (prompt + accepted tokens, their features) and records both trees."""

    def __init__(self, drafter, make_fresh):
        self.inner, self.make_fresh = drafter, make_fresh
        self.pairs = []  # (n committed tokens, cached tree, fresh tree)

    def reset(self):
        self.inner.reset()

    def start(self, prompt_ids, hidden):
        self.tokens, self.feats = [int(t) for t in prompt_ids.tolist()], hidden.clone()
        self.inner.start(prompt_ids, hidden)

    def accept(self, tokens, hidden):
        self.tokens += [int(t) for t in tokens.tolist()]
        self.feats = torch.cat([self.feats, hidden])
        self.inner.accept(tokens, hidden)

    def draft(self, root_token):
        tree = self.inner.draft(root_token)
        fresh = self.make_fresh()
        fresh.start(torch.tensor(self.tokens), self.feats.clone())
        self.pairs.append((len(self.tokens), tree, fresh.draft(root_token)))
        return tree


def _paths(tree):
    """{token path below the root: node score} (order-free, so near-tied siblings cannot matter)."""
    return {tuple(tree.token_path(i)[1:]): float(tree.scores[i]) for i in range(1, tree.num_nodes)}


def _same(a, b):
    """Same token paths and node scores (cumulative log-probabilities, stored in fp32) to 1e-5."""
    pa, pb = _paths(a), _paths(b)
    return pa.keys() == pb.keys() and all(abs(pa[p] - pb[p]) <= 1e-5 * max(1.0, abs(pb[p])) for p in pa)


@pytest.fixture(scope="module")
def bases64(tiny_base, varied):
    """fp64 copies of both tiny bases.  With initializer_range=0.3 the drafter logits reach |1e3|,
    and fp32 rounding alone (cached chunks vs one forward) moves scores by up to 1e-3 relative even
    for k = 1; in fp64 any difference left is a bookkeeping difference."""
    import copy

    return {"default_init": copy.deepcopy(tiny_base[0]).double(), "init0.3": copy.deepcopy(varied).double()}


@pytest.mark.parametrize("base_kind", ["default_init", "init0.3"])
@pytest.mark.parametrize("name", HEADS)
def test_cached_drafter_equals_fresh_drafter_every_step(bases64, base_kind, name):
    base = bases64[base_kind]
    torch.manual_seed(0)
    head = heads.build(OmegaConf.load(ROOT / "configs" / "heads" / f"{name}.yaml"), base).double().eval()
    wrapped = FreshCheck(head.make_drafter(base), lambda: head.make_drafter(base))
    ref, _ = greedy_generate(base, _prompt(1), 40)
    out, stats = SpeculativeDecoder(base, wrapped).generate(_prompt(1), 40)
    assert out == ref
    bad = [n for n, cached, fresh in wrapped.pairs if not _same(cached, fresh)]
    assert not bad, f"{name}: cached tree != fresh tree at {len(bad)} of {len(wrapped.pairs)} steps (n = {bad})"
    assert len(wrapped.pairs) == stats["steps"] >= 20
    k = getattr(head, "k", 1)
    assert len({n % k for n, _, _ in wrapped.pairs}) == k  # every block alignment was drafted from


def test_falcon_cached_equals_fresh_with_multi_token_acceptance(bases64):
    """Acceptance lengths that keep and that flip n mod k: steps accept 0-3 drafts (the verifier is
    fed the base's own greedy chain at planned depths), so every alignment cache is extended by
    chunks of several slots and re-entered after other alignments were used."""
    varied = bases64["init0.3"]
    torch.manual_seed(0)
    head = heads.build(OmegaConf.load(ROOT / "configs" / "heads" / "falcon.yaml"), varied).double().eval()
    prompt = _prompt(2, 11)
    greedy, _ = greedy_generate(varied, prompt, 60)
    plan = iter([3, 0, 1, 2, 0, 0, 3, 1, 1, 2, 3, 0, 2] * 5)

    class Planted(FreshCheck):
        """Drafts the Falcon tree, then splices the base's greedy chain of a planned length under
        the root (as a new rank-0 branch), so verification accepts exactly that many tokens."""

        def draft(self, root_token):
            tree = super().draft(root_token)
            n_out = len(self.tokens) - prompt.numel() + 1  # emitted tokens incl. the root
            chain = greedy[n_out:n_out + next(plan)]
            paths = [tree.token_path(i)[1:] for i in range(1, tree.num_nodes)]
            return DraftTree.from_paths(root_token, [chain] + paths) if chain else tree

    wrapped = Planted(head.make_drafter(varied), lambda: head.make_drafter(varied))
    out, stats = SpeculativeDecoder(varied, wrapped).generate(prompt, 60)
    assert out == greedy
    assert max(stats["emitted_per_step"]) >= 4 and stats["emitted_per_step"].count(1) >= 3
    bad = [n for n, cached, fresh in wrapped.pairs if not _same(cached, fresh)]
    assert not bad, f"cached tree != fresh tree at {len(bad)} of {len(wrapped.pairs)} steps (n = {bad})"


def test_adadecode_cache_equals_fresh_forward_after_every_verification(varied):
    """AdaDecode's analogue of a drafter state: the base's per-layer KV after each verification
    (rollbacks included) equals a fresh forward over the committed tokens."""
    from decoding.adadecode import AdaDecodeDecoder
    from decoding.verify import new_cache

    head = heads.build({"type": "adadecode", "layers": [1, 2, 3]}, varied)
    prompt = _prompt(3, 9)
    checked = []

    class Checked(AdaDecodeDecoder):
        def _verify(self, inflight, cache, out, st, max_new_tokens):
            nxt = super()._verify(inflight, cache, out, st, max_new_tokens)
            committed = torch.cat([prompt, torch.tensor(out[:-1], dtype=torch.long)])
            ref = new_cache(self.model)
            self.model(input_ids=committed[None], cache=ref, use_cache=True)
            for i in range(self.L):
                assert cache.get_seq_length(i) == committed.numel()
                torch.testing.assert_close(cache.layers[i].keys, ref.layers[i].keys, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(cache.layers[i].values, ref.layers[i].values, atol=1e-5, rtol=1e-4)
            checked.append(len(out))
            return nxt

    dec = Checked(varied, head, gamma=0.0, eos_token_ids=[])
    out, st = dec.generate(prompt, 30)
    assert out == greedy_generate(varied, prompt, 30)[0]
    assert st["rejected_exits"] > 0 and len(checked) >= 5


# -- 2. statistics count only emitted tokens -------------------------------------------------------
def _check_totals(stats):
    """τ × verification forwards = tokens emitted; per-depth counts are consistent."""
    emitted = sum(stats["emitted_per_step"])
    assert emitted == stats["new_tokens"] - 1
    assert tau(stats) * stats["base_forwards"] == pytest.approx(emitted)
    assert sum(stats["accepted_per_depth"]) <= emitted
    for a, r, p in zip(stats["accepted_per_depth"], stats["reached_per_depth"], stats["proposed_per_depth"]):
        assert a <= r <= p


@pytest.fixture(scope="module")
def distinct_greedy(varied):
    """A prompt whose first 12 greedy tokens are distinct (so each can serve as the only eos)."""
    for seed in range(100):
        prompt = _prompt(seed)
        g, _ = greedy_generate(varied, prompt, 12)
        if len(set(g)) == 12:
            return prompt, g
    raise AssertionError("no prompt with 12 distinct greedy tokens")


@pytest.mark.parametrize("eos_at,emitted,accepted,reached", [
    (1, [1], [1, 0, 0, 0], [1, 0, 0, 0]),          # eos = the first draft token of the first step
    (3, [3], [1, 1, 1, 0], [1, 1, 1, 0]),          # eos mid-path (depth 3)
    (5, [5], [1, 1, 1, 1], [1, 1, 1, 1]),          # eos = the first step's bonus token
    (7, [5, 2], [2, 2, 1, 1], [2, 2, 1, 1]),       # eos mid-path of the second step
])
def test_stats_count_only_emitted_tokens_at_eos(varied, distinct_greedy, eos_at, emitted, accepted, reached):
    prompt, g = distinct_greedy
    dec = SpeculativeDecoder(varied, OracleDrafter(varied, depth=4, width=2), [g[eos_at]])
    out, st = dec.generate(prompt, 40)
    assert out == g[:eos_at + 1]
    assert st["emitted_per_step"] == emitted
    assert st["accepted_per_depth"] == accepted and st["reached_per_depth"] == reached
    assert st["proposed_per_depth"] == [len(emitted)] * 4
    _check_totals(st)


@pytest.mark.parametrize("max_new,emitted,proposed", [
    (2, [1], []),                  # one token left: the root alone is verified, its bonus fills the budget
    (3, [2], [1]),                 # two left: depth 1 + bonus (the depth-4 chain is cut to depth 1)
    (8, [5, 2], [2, 1, 1, 1]),     # the second step's chain is cut to depth 1
    (11, [5, 5], [2, 2, 2, 2]),
])
def test_length_cut_trims_the_tree_and_counts_only_emitted(varied, distinct_greedy, max_new, emitted, proposed):
    prompt, g = distinct_greedy
    out, st = SpeculativeDecoder(varied, OracleDrafter(varied, depth=4, width=2)).generate(prompt, max_new)
    assert out == g[:max_new]
    assert st["emitted_per_step"] == emitted
    assert st["proposed_per_depth"] == proposed and st["accepted_per_depth"] == proposed
    assert st["tree_nodes"] == 2 * sum(proposed)  # width 2: the chain node and one wrong sibling per depth
    _check_totals(st)


# -- 3. budget and context limit -------------------------------------------------------------------
def _spy_positions(monkeypatch):
    """Record the largest RoPE position each verification forward feeds (cache length + tree depth)."""
    fed = []
    orig = speculative.verify_tree

    def spy(model, cache, tree):
        fed.append(cache.get_seq_length() + tree.max_depth)
        return orig(model, cache, tree)

    monkeypatch.setattr(speculative, "verify_tree", spy)
    return fed


@pytest.mark.parametrize("max_new", [1, 2, 5, 7, 12])
def test_trees_stay_inside_the_budget(varied, monkeypatch, max_new):
    """Issue 12's case (10-token prompt, oracle chain of depth 4, max_new_tokens=7) and others:
    no verification feeds a position vanilla decoding would not (the last is T + max_new − 2)."""
    fed = _spy_positions(monkeypatch)
    prompt = _prompt(4)
    ref, _ = greedy_generate(varied, prompt, max_new)
    out, st = SpeculativeDecoder(varied, OracleDrafter(varied, depth=4, width=1)).generate(prompt, max_new)
    assert out == ref and len(fed) == st["base_forwards"]
    assert max(fed, default=0) <= prompt.numel() + max_new - 2
    assert st["base_forwards"] == -(-(max_new - 1) // 5)  # the oracle chain is never shortened early


def test_budget_at_the_context_limit(monkeypatch):
    """prompt + max_new_tokens = max_position_embeddings decodes (no position >= the limit is fed);
    one more token is a clear error naming both numbers, for every decoder, before any forward."""
    from decoding.adadecode import AdaDecodeDecoder

    model = tiny_llama(seed=0, attn_implementation="eager", initializer_range=0.3, max_position_embeddings=24)
    fed = _spy_positions(monkeypatch)
    prompt = _prompt(5, 10)
    ref, _ = greedy_generate(model, prompt, 14)
    out, _ = SpeculativeDecoder(model, OracleDrafter(model, depth=4, width=2)).generate(prompt, 14)
    assert out == ref and max(fed) <= 22
    ada = AdaDecodeDecoder(model, heads.build({"type": "adadecode", "layers": [1, 2]}, model), gamma=0.0,
                           eos_token_ids=[])
    assert ada.generate(prompt, 14)[0] == ref
    calls = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1))
    for run in (lambda: greedy_generate(model, prompt, 15),
                lambda: SpeculativeDecoder(model, OracleDrafter(model, depth=4)).generate(prompt, 15),
                lambda: ada.generate(prompt, 15)):
        with pytest.raises(ValueError, match=r"prompt of 10 tokens \+ max_new_tokens=15 = 25 tokens exceeds .*"
                                             r"max_position_embeddings=24"):
            run()
    assert not calls


# -- 4. reference drafters: same trees per prompt in any order -------------------------------------
class Recorder:
    def __init__(self, inner):
        self.inner, self.trees = inner, []

    def reset(self):
        getattr(self.inner, "reset", lambda: None)()

    def start(self, prompt_ids, hidden):
        self.trees.append([])
        self.inner.start(prompt_ids, hidden)

    def accept(self, tokens, hidden):
        self.inner.accept(tokens, hidden)

    def draft(self, root_token):
        tree = self.inner.draft(root_token)
        self.trees[-1].append((tree.tokens.tolist(), tree.parents.tolist()))
        return tree


@pytest.mark.parametrize("kind", ["oracle_shuffle", "random"])
def test_reference_drafters_are_deterministic_per_prompt(varied, kind):
    def make():
        if kind == "random":
            return Recorder(RandomDrafter(384, depth=3, width=3, seed=7))
        return Recorder(OracleDrafter(varied, depth=4, width=3, shuffle=True, miss_prob=0.3, seed=7))

    prompts = [_prompt(s) for s in (11, 12, 13)]
    runs = {}
    for order in ([0, 1, 2], [2, 0, 1]):
        rec = make()
        dec = SpeculativeDecoder(varied, rec)
        for i in order:
            dec.generate(prompts[i], 20)
        runs[tuple(order)] = {i: trees for i, trees in zip(order, rec.trees)}
    a, b = runs.values()
    for i in range(3):
        assert a[i] == b[i], f"prompt {i}: trees depend on which prompts were decoded before it"
    # a warm-up call on another prompt (as the evaluator does) changes nothing either
    rec = make()
    dec = SpeculativeDecoder(varied, rec)
    dec.generate(prompts[0], 20)
    dec.generate(prompts[0], 20)
    assert rec.trees[0] == rec.trees[1]


def test_evaluation_refuses_prompt_beyond_context_before_writing(tmp_path, capsys):
    """python -m evaluation: one-line error naming the prompt, both numbers and the limit; exit 2;
    no output directory."""
    import json

    from core.tiny import save_tiny_model
    from evaluation.__main__ import main

    model_dir = save_tiny_model(tmp_path / "tiny96", seed=0, max_position_embeddings=96)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "short", "prompt": "Hi"}) + "\n"
                       + json.dumps({"id": "long", "prompt": "word " * 10}) + "\n")
    argv = [f"model.path={model_dir}", "model.attn_implementation=eager", f"eval.output_dir={tmp_path / 'out'}",
            "eval.warmup=0", "checkpoint=oracle", f"eval.prompts={prompts}"]
    assert main(argv + ["eval.max_new_tokens=40"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    m = re.fullmatch(r"error: eval prompt 'long': prompt of (\d+) tokens \+ eval\.max_new_tokens=40 = (\d+) tokens "
                     r"exceeds the base model's context limit max_position_embeddings=96; shorten the prompt or "
                     r"lower eval\.max_new_tokens", err)
    assert m and int(m[2]) == int(m[1]) + 40 > 96, err
    assert not (tmp_path / "out").exists()
    # the longest prompt exactly at the limit decodes, with parity
    assert main(argv + [f"eval.max_new_tokens={96 - int(m[1])}"]) == 0
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["parity"]["matched"] == 2
