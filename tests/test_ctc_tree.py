"""CTC drafting trees (decoding/ctc.py): collapse, best-first alignments, trie, cap, acceptance."""
from __future__ import annotations

import itertools
import math

import torch

from decoding.ctc import accepted_length, best_alignments, build_ctc_tree, ctc_collapse, expand_topk

B = 9  # blank id in these tests (V = 9)


def test_collapse_rules():
    assert ctc_collapse([1, 1, B, 2], B) == [1, 2]          # repeats merged, blank dropped
    assert ctc_collapse([1, B, 1], B) == [1, 1]             # 'a ε a' keeps both a's
    assert ctc_collapse([B, B, B], B) == []
    assert ctc_collapse([3, 3, 3, B, B, 4, 4], B) == [3, 4]
    assert ctc_collapse([B, 5, B, B, 5, 5], B) == [5, 5]


def test_best_alignments_is_exact_descending_enumeration():
    torch.manual_seed(0)
    ks = [3, 2, 2, 3]
    logp = [sorted(torch.randn(k).tolist(), reverse=True) for k in ks]
    ids = [list(range(10 * j, 10 * j + k)) for j, k in enumerate(ks)]
    got = list(best_alignments(logp, ids))
    full = sorted(((sum(logp[j][r[j]] for j in range(4)), [ids[j][r[j]] for j in range(4)])
                   for r in itertools.product(*[range(k) for k in ks])), key=lambda x: -x[0])
    assert len(got) == len(full) == math.prod(ks)
    assert sorted(tuple(a) for _, a in got) == sorted(tuple(a) for _, a in full)
    scores = [s for s, _ in got]
    assert all(a >= b - 1e-12 for a, b in zip(scores, scores[1:]))
    assert all(abs(a - b[0]) < 1e-9 for a, b in zip(scores, full))


def _logits_from_probs(rows):
    """rows: per slot a dict {class: prob}; the rest of the mass spread over unlisted classes."""
    out = torch.full((len(rows), B + 1), -30.0)
    for s, row in enumerate(rows):
        for c, p in row.items():
            out[s, c] = math.log(p)
    return out


def test_tree_collapse_merge_and_positions():
    # slot candidates (top-2 each): slot1 {1: .6, B: .4}, slot2 {1: .7, 2: .3}, slot3 {B: .9, 1: .1}
    logits = _logits_from_probs([{1: 0.6, B: 0.4}, {1: 0.7, 2: 0.3}, {B: 0.9, 1: 0.1}])
    tree = build_ctc_tree(logits, root_token=7, topk=[2, 2, 2], max_nodes=64)
    # alignments and collapses:
    #  1 1 ε -> [1]     ; ε 1 ε -> [1] (identical candidate, merged)
    #  1 2 ε -> [1, 2]  ; ε 2 ε -> [2]
    #  1 1 1 -> [1]     ; ε 1 1 -> [1] ; 1 2 1 -> [1, 2, 1] ; ε 2 1 -> [2, 1]
    paths = {tuple(tree.token_path(i)[1:]) for i in range(1, tree.num_nodes)}
    assert paths == {(1,), (1, 2), (2,), (1, 2, 1), (2, 1)}
    assert tree.num_nodes == 6
    assert tree.tokens[0] == 7 and tree.parents[0] == -1
    for i in range(1, tree.num_nodes):  # depth = path length; parent = prefix
        tp = tree.token_path(i)
        assert int(tree.depths[i]) == len(tp) - 1
        assert tree.token_path(int(tree.parents[i])) == tp[:-1]
    assert tree.position_ids(10).tolist() == [[10 + int(d) for d in tree.depths]]
    # the best node first among the root's children: [1] (p = .6*.7*.9 + ...) before [2]
    first = tree.children(0)[0]
    assert int(tree.tokens[first]) == 1


def test_a_blank_a_keeps_repeat_and_root_not_merged():
    logits = _logits_from_probs([{4: 0.9}, {B: 0.9}, {4: 0.9}])
    tree = build_ctc_tree(logits, root_token=4, topk=1)
    assert tree.token_path(tree.num_nodes - 1) == [4, 4, 4]  # root 4, then 'a ε a' -> 4 4
    assert tree.max_depth == 2


def test_all_blank_gives_root_only_tree():
    logits = _logits_from_probs([{B: 0.99}, {B: 0.99}])
    tree = build_ctc_tree(logits, root_token=3, topk=1)
    assert tree.num_nodes == 1


def test_node_cap_keeps_best_nodes_and_ancestors():
    torch.manual_seed(1)
    logits = torch.randn(6, B + 1) * 3
    full = build_ctc_tree(logits, 0, [4, 3, 3, 2, 2, 2], max_nodes=10_000)
    capped = build_ctc_tree(logits, 0, [4, 3, 3, 2, 2, 2], max_nodes=8)
    assert capped.num_nodes == 8 < full.num_nodes
    best = {tuple(full.token_path(i)): float(full.scores[i]) for i in range(1, full.num_nodes)}
    kept = {tuple(capped.token_path(i)) for i in range(1, capped.num_nodes)}
    threshold = sorted(best.values(), reverse=True)[6]
    assert all(best[k] >= threshold - 1e-6 for k in kept)
    for k in kept:  # ancestors kept
        assert all(k[:d] in kept for d in range(2, len(k)))


def test_accepted_length_walks_the_tree():
    logits = _logits_from_probs([{1: 0.6, 2: 0.4}, {3: 0.9}, {B: 0.9}])
    tree = build_ctc_tree(logits, 0, [2, 1, 1])
    assert accepted_length(tree, [1, 3, 5]) == 2
    assert accepted_length(tree, [2, 3]) == 2
    assert accepted_length(tree, [2, 4]) == 1
    assert accepted_length(tree, [5]) == 0
    assert accepted_length(tree, []) == 0


def test_expand_topk():
    assert expand_topk([10, 6, 4], 6) == [10, 6, 4, 4, 4, 4]
    assert expand_topk(3, 2) == [3, 3]
    assert expand_topk([10, 6, 4, 3, 2, 2], 4) == [10, 6, 4, 3]
