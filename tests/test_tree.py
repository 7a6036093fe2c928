"""Draft token trees: trie merging, canonical order, caps, masks (brute force on small cases)."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from decoding.tree import DraftTree, TreeError


def _node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    return [tuple(tree.token_path(i)[1:]) for i in range(tree.num_nodes)]


def test_from_paths_merges_identical_prefixes():
    paths = [[1, 2, 3], [1, 2, 4], [1, 5], [6], [1, 2, 3], []]
    tree = DraftTree.from_paths(9, paths)
    # every distinct non-empty prefix is exactly one node, plus the root
    prefixes = {tuple(p[:k]) for p in paths for k in range(len(p) + 1)}
    assert sorted(_node_paths(tree)) == sorted(prefixes)
    assert tree.num_nodes == 7
    assert tree.tokens.tolist() == [9, 1, 6, 2, 5, 3, 4]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 3, 3]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 3, 3]
    assert tree.max_depth == 3 and tree.root_token == 9
    assert tree.children(1) == [3, 4] and tree.path(6) == [0, 1, 3, 6]


def test_scores_order_siblings_and_cap_keeps_ancestors():
    paths = [[1, 2], [3, 4], [3, 5], [1, 6]]
    scores = [0.1, 0.9, 0.5, 0.05]
    tree = DraftTree.from_paths(0, paths, scores)
    # siblings by descending best path score: 3 (0.9) before 1 (0.1)
    assert tree.tokens.tolist() == [0, 3, 1, 4, 5, 2, 6]
    assert torch.allclose(tree.scores[1:], torch.tensor([0.9, 0.1, 0.9, 0.5, 0.1, 0.05]))
    capped = DraftTree.from_paths(0, paths, scores, max_nodes=4)
    assert capped.num_nodes == 4
    assert sorted(_node_paths(capped)) == sorted([(), (3,), (3, 4), (3, 5)])
    assert DraftTree.from_paths(0, paths, scores, max_nodes=1).num_nodes == 1
    assert DraftTree.from_paths(0, paths, max_depth=1).max_depth == 1


def test_random_tries_brute_force():
    rng = random.Random(0)
    for trial in range(30):
        paths = [[rng.randrange(4) for _ in range(rng.randrange(0, 5))] for _ in range(rng.randrange(1, 8))]
        scores = [rng.random() for _ in paths]
        cap = rng.randrange(1, 12)
        tree = DraftTree.from_paths(7, paths, scores, max_nodes=cap)
        got = _node_paths(tree)
        assert len(set(got)) == len(got), "duplicate node"
        all_prefixes = {tuple(p[:k]) for p in paths for k in range(len(p) + 1)}
        assert set(got) <= all_prefixes
        assert tree.num_nodes == min(cap, len(all_prefixes))
        # ancestor closed, canonical order: by depth, then by parent order, then descending score
        for i in range(1, tree.num_nodes):
            p = int(tree.parents[i])
            assert got[p] == got[i][:-1]
        keys = [(int(tree.depths[i]), tree.path(i)[:-1], -float(tree.scores[i])) for i in range(1, tree.num_nodes)]
        assert keys == sorted(keys)
        # kept nodes are the best-scoring ones: brute-force score = max over paths through the prefix
        best = {q: max(s for p, s in zip(paths, scores) if tuple(p[: len(q)]) == q) for q in all_prefixes if q}
        kept = [best[q] for q in got[1:]]
        dropped = [best[q] for q in all_prefixes - set(got) if q]
        if kept and dropped:
            assert min(kept) >= max(dropped)


def test_attention_mask_and_positions_brute_force():
    tree = DraftTree.from_paths(5, [[1, 2, 3], [1, 4], [6, 7]])
    past = 3
    mask = tree.attention_mask(past, dtype=torch.float32)
    n = tree.num_nodes
    assert mask.shape == (1, 1, n, past + n) and mask.dtype == torch.float32
    neg = torch.finfo(torch.float32).min
    for i, j in itertools.product(range(n), range(past + n)):
        visible = j < past or (j - past) in tree.path(i)
        assert mask[0, 0, i, j].item() == (0.0 if visible else neg), (i, j)
    assert tree.position_ids(past).tolist() == [[past + int(d) for d in tree.depths]]
    assert tree.attention_mask(0, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_chain_and_from_parents_reorders_and_merges():
    chain = DraftTree.chain(4, [5, 6, 7])
    assert chain.parents.tolist() == [-1, 0, 1, 2] and chain.tokens.tolist() == [4, 5, 6, 7]
    # parents given out of canonical order, with a duplicate sibling (token 8 twice under root)
    tokens = [1, 9, 8, 8, 3, 4]
    parents = [-1, 2, 0, 0, 3, 0]
    tree = DraftTree.from_parents(tokens, parents)
    assert sorted(_node_paths(tree)) == sorted([(), (8,), (4,), (8, 9), (8, 3)])
    assert tree.scores is None


@pytest.mark.parametrize("tokens,parents", [
    ([1, 2], [0, 0]),  # no root
    ([1, 2, 3], [-1, 2, 0]),  # a parent after its child: the constructor refuses, from_parents reorders
])
def test_bad_trees_raise(tokens, parents):
    if parents[0] != -1:
        with pytest.raises(TreeError, match="root"):
            DraftTree.from_parents(tokens, parents)
        with pytest.raises(TreeError):
            DraftTree(torch.tensor(tokens), torch.tensor(parents))
    else:
        with pytest.raises(TreeError, match="precede"):
            DraftTree(torch.tensor(tokens), torch.tensor(parents))
        assert DraftTree.from_parents(tokens, parents).num_nodes == 3


def test_cycle_and_score_mismatch_raise():
    with pytest.raises(TreeError, match="cycle"):
        DraftTree.from_parents([0, 1, 2], [-1, 2, 1])
    with pytest.raises(TreeError, match="scores"):
        DraftTree.from_paths(0, [[1], [2]], scores=[1.0])
    with pytest.raises(TreeError, match="max_nodes"):
        DraftTree.from_paths(0, [[1]], max_nodes=0)
