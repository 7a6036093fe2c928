"""Issue 28 items 5 and 6 on the tiny base: one tie-break for every ranking in drafting, so the tree
calibrated at one budget is the tree decoded at another even under exact ties; and drafter passes
that cannot contribute to the verified tree are neither run nor counted."""
from __future__ import annotations

import math

import pytest
import torch

import heads
from core.config import compose
from decoding.ctc import build_ctc_tree
from decoding.ranking import greedy_ids, node_order, topk_stable
from decoding.speculative import SpeculativeDecoder
from decoding.tree import DraftTree
from decoding.tree_search import RecordingDrafter, ScoreBudgetDrafter, truncation_order
from decoding.vanilla import greedy_generate


# -- helpers ----------------------------------------------------------------------------------------
def _cut(tree: DraftTree, n: int) -> dict:
    """{token path: score} of ``tree`` cut to its n best nodes (the calibration replay's cut)."""
    keep = truncation_order(tree)[: n - 1]
    return {tuple(tree.token_path(i)[1:]): float(tree.scores[i]) for i in keep}


def _paths(tree: DraftTree) -> dict:
    """{token path below the root: score} of the draft nodes (root excluded)."""
    return {tuple(tree.token_path(i)[1:]): float(tree.scores[i]) for i in range(1, tree.num_nodes)}


def _rank_node(tree: DraftTree, ranks) -> int:
    node = 0
    for r in ranks:
        node = tree.children(node)[r]
    return node


def _build(name, base, **over):
    cfg = compose([f"heads={name}"] + [f"heads.{k}={v}" for k, v in over.items()])
    torch.manual_seed(0)
    return heads.build(cfg.heads, base).eval()


def _tied_lm_head(head):
    """Plant exact ties: every distribution puts the same logit on every third draft id (3 levels)."""
    n = head.num_draft_tokens
    pattern = -(torch.arange(n) % 3).float() * 2.0
    head.draft_lm_head = lambda h: pattern.to(h.device).expand(*h.shape[:-1], n).clone()
    return head


def _started(drafter, base, prompt):
    from decoding.verify import prefill

    _, root, hidden = prefill(base, prompt, **({"layers": drafter.feature_layers}
                                               if getattr(drafter, "feature_layers", None) else {}))
    drafter.reset()
    drafter.start(prompt, hidden)
    return root


# -- topk_stable --------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [-1, 1])
def test_topk_stable_breaks_ties_to_the_lower_index_at_every_k(dim):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (3, 40, 5), generator=g).float()  # exact ties everywhere
    x[0, 7, 0] = float("-inf")
    xs = x.movedim(dim, -1)
    for k in range(1, 41):
        vals, idx = topk_stable(x, k, dim=dim)
        vals, idx = vals.movedim(dim, -1), idx.movedim(dim, -1)
        for row in range(xs.shape[0]):
            for col in range(xs.shape[1]):
                v = xs[row, col].tolist()
                want = sorted(range(len(v)), key=lambda i: (-v[i], i))[:k]
                assert idx[row, col].tolist() == want
                assert vals[row, col].tolist() == [v[i] for i in want]
    # bf16-rounded scores over a wide vocabulary: many ties at every cut; the reference is a stable full sort
    z = torch.randn(6, 3, 5000, generator=g).bfloat16().float()
    z[0, 0, :] = 0.5  # one row all tied
    z[1, 1, 100:] = float("-inf")  # fewer finite entries than k
    for k in (1, 4, 16, 150):
        s_vals, s_idx = z.sort(dim=-1, descending=True, stable=True)
        vals, idx = topk_stable(z, k)
        assert torch.equal(idx, s_idx[..., :k]) and torch.equal(vals, s_vals[..., :k]), k
    z[2, 0, 3] = float("nan")  # NaN ranks first, as torch's sort ranks it
    assert torch.equal(topk_stable(z, 4)[1], z.sort(dim=-1, descending=True, stable=True)[1][..., :4])
    y = torch.randn(4, 100, generator=g)  # no ties: torch.topk's answer
    assert torch.equal(topk_stable(y, 7)[1], y.topk(7).indices)
    with pytest.raises(ValueError, match="k=0"):
        topk_stable(y, 0)


def test_greedy_ids_are_argmax_first_maximum_included():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3000, generator=g).bfloat16()
    x[:, 17] = x.max(dim=-1).values  # ties with the maximum: the lower id wins
    x[5, 2] = float("nan")  # NaN is the maximum for both
    x[6] = 0.0  # an all-tied row
    for logits in (x, x.float(), x[0], x.reshape(4, 16, 3000)):
        assert torch.equal(greedy_ids(logits), logits.argmax(-1))
    assert int(greedy_ids(x[6])) == 0 and int(greedy_ids(x[5])) == 2


def test_node_order_is_score_then_depth_then_canonical():
    scores = [0.0, -1.0, -1.0, -1.0, -2.0, -1.0 - 1e-9]  # the last rounds to -1.0 in float32: a tie
    depths = [0, 1, 1, 2, 2, 2]
    assert node_order(scores, depths) == [1, 2, 3, 5, 4]
    assert node_order(scores, depths, canonical=[0, 2, 1, 3, 4, 5]) == [2, 1, 3, 5, 4]


# -- 5. the tree at a budget n is the larger tree cut to n, under exact ties ---------------------
def test_ctc_tree_at_every_budget_is_the_largest_tree_cut_to_it():
    """Slot logits with many exact ties (3 values): for every cap n, the CTC tree built with
    max_nodes=n equals the tree built with max_nodes=32 cut to its n best nodes (the cut
    calibration replays), i.e. what calibration measured is what decoding verifies."""
    g = torch.Generator().manual_seed(3)
    for trial in range(4):
        logits = torch.randint(0, 3, (4, 21), generator=g).float() * 1.5  # [S, V + 1], class 20 = blank
        big = build_ctc_tree(logits, 7, [6, 5, 4, 3], max_nodes=32)
        assert big.num_nodes > 8
        for n in range(1, 33):
            small = build_ctc_tree(logits, 7, [6, 5, 4, 3], max_nodes=n)
            assert _paths(small) == _cut(big, n), (trial, n)


@pytest.mark.parametrize("name", ["falcon", "falcon_k1"])
def test_falcon_ranks_are_the_same_at_every_top_k(tiny_base, name):
    """Exactly tied draft distributions: the calibration tree (spine with 8 children per depth) and
    a small rank tree (top-2 at most) give each rank path the same token: the rank statistics
    calibration measured are those of the tree decoded."""
    base = tiny_base[0]
    head = _tied_lm_head(_build(name, base))
    k = head.k
    depth = 2 * k
    spine = {"node_children": {("root" if d == 0 else ",".join(["0"] * d)): 8 for d in range(depth)}}
    small_paths = [[0], [1], [0, 0], [0, 1]] + ([[0, 0, 0], [0, 0, 1], [0, 0, 0, 0]] if k > 1 else [])
    big = head.make_drafter(base, falcon_passes=2, falcon_tree=spine)
    small = head.make_drafter(base, falcon_passes=2, falcon_tree={"paths": small_paths})
    prompt = torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(1))
    root = _started(big, base, prompt)
    _started(small, base, prompt)
    tb, ts = big.draft(root), small.draft(root)
    for q in small_paths:
        if len(q) > 2 * k:
            continue
        s, b = _rank_node(ts, q), _rank_node(tb, q)
        assert ts.token_path(s) == tb.token_path(b), q
    # the tie-break is the lower id: the rank-r child of the root holds the r-th lowest tied-top id
    top = sorted(int(head.to_base_ids(torch.tensor([i]))[0]) for i in range(0, head.num_draft_tokens, 3))
    assert [int(tb.tokens[c]) for c in tb.children(0)] == top[:8]


def _eagle3_tied(base):
    head = _build("eagle3", base, layers="[1,2,3]")
    from decoding.eagle3 import Eagle3Drafter

    class Tied(Eagle3Drafter):
        """Log-probabilities in {0, -1, -2} from a hash of the expanded node's token path: massive
        exact ties between siblings and between cousins, the drafter's own ranking unchanged."""

        def _topk(self, h, nodes):
            rows = []
            for u in nodes:
                path, v = [], u
                while v >= 0:
                    path.append(self._node_tok[v])
                    v = self._parents[v]
                seed = sum((i + 1) * t for i, t in enumerate(path)) % 7
                rows.append(-((torch.arange(self.head.num_draft_tokens) * 5 + seed) % 3).float())
            vals, idx = topk_stable(torch.stack(rows), min(self.topk, self.head.num_draft_tokens))
            return vals, self.head.to_base_ids(idx)

    return head, Tied


def test_eagle3_tree_at_a_budget_is_the_calibrated_tree_cut_to_it(tiny_base):
    """EAGLE-3 under exact ties: the tree the planner decodes at budget n (total_tokens n - 1, depth
    and topk capped at n - 1; tree_auto._eagle3_choose) and the config tree with only total_tokens
    = n - 1 both equal the calibration tree (total_tokens 15) cut to its n best nodes, and use no
    more passes than n - 1."""
    base = tiny_base[0]
    head, Tied = _eagle3_tied(base)
    prompt = torch.randint(3, 300, (8,), generator=torch.Generator().manual_seed(2))
    cal = Tied(head, depth=5, topk=4, total_tokens=15)
    root = _started(cal, base, prompt)
    big = cal.draft(root)
    assert big.num_nodes == 16
    for n in range(2, 17):
        for depth, topk in ((min(5, n - 1), min(4, n - 1)), (5, 4)):
            d = Tied(head, depth=depth, topk=topk, total_tokens=n - 1)
            _started(d, base, prompt)
            tree = d.draft(root)
            assert _paths(tree) == _cut(big, n), (n, depth, topk)
            assert tree.drafter_passes <= min(5, n - 1)


# -- 6. passes that cannot contribute are not run, and not counted -------------------------------
def _steps(prompt, out, stats, max_new):
    """(committed context, root, tokens left - 1 = the verifiable depth) of every decoding step."""
    pos = 0
    for e in stats["emitted_per_step"]:
        yield torch.cat([prompt, torch.tensor(out[:pos], dtype=torch.long)]), out[pos], max_new - (pos + 1) - 1
        pos += e


def _template_scores(tree: DraftTree, template) -> list[float]:
    """float32 scores of the template's nodes (rank paths) in a Falcon tree."""
    out = [0.0] * template.num_nodes
    for u, q in enumerate(template.paths):
        if u and template.depths[u] <= tree.max_depth:
            out[u] = float(tree.scores[_rank_node(tree, q)])
    return out


@pytest.mark.parametrize("name", ["falcon", "falcon_k1"])
def test_dynamic_budget_runs_only_the_passes_its_nodes_need(tiny_base, name):
    """Falcon's dynamic tree cut to n every step (eval.tree=dynamic): each step's tree equals the
    step's full tree cut to n, and the step runs exactly the context pass plus each tree pass with a
    block creator that fewer than n - 2 drafted nodes rank above (none at n = 1, the context pass alone
    at n = 2, never one beyond the verifiable depth); drafter_passes counts what ran and the output
    equals vanilla greedy."""
    base, tok, _ = tiny_base
    head = _build(name, base)
    k, eos, max_new = head.k, [tok.eos_token_id], 14
    t = head.make_drafter(base).template
    prompt = torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(4))
    ref, _ = greedy_generate(base, prompt, max_new, eos)
    full_passes = t.num_passes()
    for n in (1, 2, 3, 5, 8, 16):
        rec = RecordingDrafter(ScoreBudgetDrafter(head.make_drafter(base), n))
        out, stats = SpeculativeDecoder(base, rec, eos).generate(prompt, max_new)
        assert out == ref
        assert stats["drafter_passes"] == sum(tr.drafter_passes for tr in rec.trees)
        for tree, (ctx, root, max_depth) in zip(rec.trees, _steps(prompt, out, stats, max_new)):
            fresh = head.make_drafter(base)
            assert _started(fresh, base, ctx) == root
            whole = fresh.draft(root)  # the head's whole tree for this context: every pass
            assert whole.drafter_passes == full_passes
            whole = DraftTree.from_parents(*[x[: int((whole.depths <= max_depth).sum())]
                                             for x in (whole.tokens, whole.parents, whole.scores)][:2],
                                           scores=whole.scores[: int((whole.depths <= max_depth).sum())])
            want_tree = _cut(whole, n)
            assert tree.num_nodes == len(want_tree) + 1 and set(_paths(tree)) == set(want_tree)
            want = 0
            if n > 1 and max_depth >= 1:
                want = 1
                score = _template_scores(whole, t)
                for j, creators in enumerate(t.block_creators(), start=1):
                    if j * k + 1 > max_depth:
                        break
                    drafted = [u for u in range(1, t.num_nodes) if t.depths[u] <= j * k]
                    above = lambda c: sum(1 for v in drafted if score[v] > score[c]  # noqa: E731
                                          or (score[v] == score[c] and t.depths[v] < t.depths[c]))
                    if not any(above(c) < n - 2 for c in creators):
                        break
                    want += 1
            assert tree.drafter_passes == want, (n, max_depth)
            assert want <= max(1, math.ceil(max_depth / k)) if n > 1 else want == 0
        if n == 1:
            assert stats["drafter_passes"] == 0 and stats["tree_nodes"] == 0
        if n == 2:
            assert all(tr.drafter_passes == 1 for tr in rec.trees[:-1])


def test_remaining_budget_limits_every_heads_passes(tiny_base):
    """With R tokens left a step verifies depths <= R - 1 only: the Falcon, EAGLE-3 and CTC drafters
    run no pass beyond it (the last step, R = 1, runs none) and the counts say so; parity holds."""
    base, tok, _ = tiny_base
    eos, max_new = [tok.eos_token_id], 9
    prompt = torch.randint(3, 300, (7,), generator=torch.Generator().manual_seed(6))
    ref, _ = greedy_generate(base, prompt, max_new, eos)
    cases = [(_build("falcon", base), {}, lambda d: min(4, math.ceil(d / 2))),
             (_build("eagle3", base, layers="[1,2,3]"), {"decoding": {"depth": 6, "topk": 3, "total_tokens": 40}},
              lambda d: min(6, d)),
             (_build("ctc", base), {}, lambda d: 1 if d >= 1 else 0)]
    for head, kwargs, most in cases:
        rec = RecordingDrafter(head.make_drafter(base, **kwargs))
        out, stats = SpeculativeDecoder(base, rec, eos).generate(prompt, max_new)
        assert out == ref
        depths = [d for _, _, d in _steps(prompt, out, stats, max_new)]
        passes = [tr.drafter_passes for tr in rec.trees]
        assert all(p <= most(d) for p, d in zip(passes, depths)), (type(head).__name__, passes, depths)
        if not isinstance(head, heads.ctc.CTCHead):  # CTC's slots are one forward: its deeper nodes are trimmed
            assert all(tr.max_depth <= d for tr, d in zip(rec.trees, depths))
        assert stats["drafter_passes"] == sum(passes)
        if depths[-1] == 0:
            assert passes[-1] == 0


def test_eagle3_total_tokens_caps_its_expansions(tiny_base):
    """EAGLE-3 with total_tokens = 2 and depth 6: a node of depth 3 can never be among the best 2,
    so at most 2 passes run per step (the context pass and one expansion), and the tree equals the
    one drafted with total_tokens = 2 at depth 2."""
    base, tok, _ = tiny_base
    head = _build("eagle3", base, layers="[1,2,3]")
    prompt = torch.randint(3, 300, (8,), generator=torch.Generator().manual_seed(2))
    deep = head.make_drafter(base, decoding={"depth": 6, "topk": 3, "total_tokens": 2})
    shallow = head.make_drafter(base, decoding={"depth": 2, "topk": 3, "total_tokens": 2})
    root = _started(deep, base, prompt)
    _started(shallow, base, prompt)
    a, b = deep.draft(root), shallow.draft(root)
    assert a.drafter_passes <= 2 and _paths(a).keys() == _paths(b).keys()
    eos = [tok.eos_token_id]
    out, stats = SpeculativeDecoder(base, deep, eos).generate(prompt, 12)
    assert out == greedy_generate(base, prompt, 12, eos)[0] and stats["drafter_passes"] <= 2 * stats["steps"]


def test_ctc_root_only_budget_runs_no_slot_forward_and_keeps_its_context(tiny_base):
    """CTC with max_nodes = 1 (auto's root-alone choice) runs no drafter forward and counts none;
    its context pairs wait for the next draft, so a later real draft equals a fresh drafter's."""
    base, tok, _ = tiny_base
    head = _build("ctc", base)
    eos = [tok.eos_token_id]
    prompt = torch.randint(3, 300, (8,), generator=torch.Generator().manual_seed(9))
    out, stats = SpeculativeDecoder(base, head.make_drafter(base, max_nodes=1), eos).generate(prompt, 10)
    assert out == greedy_generate(base, prompt, 10, eos)[0]
    assert stats["drafter_passes"] == 0 and stats["tree_nodes"] == 0
    # deferred context: root-only drafts for two steps, then a real one == a fresh drafter on the context
    d = head.make_drafter(base)
    root = _started(d, base, prompt)
    ctx = prompt.tolist()
    from decoding.verify import base_forward, prefill

    for _ in range(2):
        assert d.draft(root, max_nodes=1).drafter_passes == 0
        cache, _, _ = prefill(base, torch.tensor(ctx))
        logits, hidden = base_forward(base, torch.tensor([root]), cache)
        d.accept(torch.tensor([root]), hidden)
        ctx.append(root)
        root = int(logits[-1].argmax())
    fresh = head.make_drafter(base)
    assert _started(fresh, base, torch.tensor(ctx)) == root
    a, b = d.draft(root), fresh.draft(root)
    assert a.drafter_passes == 1
    assert _paths(a).keys() == _paths(b).keys()
    assert all(abs(_paths(a)[p] - _paths(b)[p]) < 1e-5 for p in _paths(b))
