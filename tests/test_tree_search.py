"""Issue 14: tree search (DP vs brute force), acceptance statistics, dynamic budget, cost-model cache."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from decoding.tree import DraftTree, TreeError
from decoding.tree_search import (AcceptanceStats, ScoreBudgetDrafter, best_rank_trees, check_rank_tree,
                                  choose_budget, choose_rank_tree, expected_tau, greedy_path)


def all_rank_trees(max_nodes: int, max_depth: int, max_rank: int):
    """Every rank tree (prefix-closed, sibling ranks 0..c-1) with <= max_nodes nodes (root incl.)."""
    out = []

    def subtrees(depth: int, budget: int):
        # all child-forests below a node at ``depth`` with <= budget nodes: lists of (rank-relative) paths
        if depth >= max_depth or budget == 0:
            return [[]]
        res = []

        def children(rank: int, budget: int):
            if rank >= max_rank or budget == 0:
                yield [], 0
                return
            yield [], 0  # stop: no child of this rank (hence none beyond)
            for size in range(1, budget + 1):
                for sub in subtrees(depth + 1, size - 1):
                    if len(sub) != size - 1:
                        continue
                    for rest, used in children(rank + 1, budget - size):
                        yield [(rank,)] + [(rank,) + q for q in sub] + rest, size + used

        for forest, _ in children(0, budget):
            res.append(forest)
        return res

    for forest in subtrees(0, max_nodes - 1):
        out.append([()] + forest)
    return out


def test_brute_force_enumeration_counts_trees():
    # unlabelled ordered trees: rank trees with exactly n nodes, no depth/rank cap = Catalan(n-1)
    trees = all_rank_trees(5, 10, 10)
    by_size = [sum(1 for t in trees if len(t) == n) for n in range(1, 6)]
    assert by_size == [1, 1, 2, 5, 14]
    assert len({tuple(sorted(t)) for t in trees}) == len(trees)


@pytest.mark.parametrize("seed", range(6))
def test_dp_is_optimal_against_every_tree(seed):
    rng = random.Random(seed)
    D, R, M = 3, 3, 7
    p = []
    for _ in range(D):
        row = sorted((rng.random() for _ in range(R)), reverse=seed % 2 == 0)  # odd seeds: ranks not sorted
        s = sum(row) or 1.0
        p.append([x / s * rng.uniform(0.3, 1.0) for x in row])
    table = best_rank_trees(p, M)
    trees = all_rank_trees(M, D, R)
    for cap in range(1, D + 1):
        for m in range(1, M + 1):
            brute = max(expected_tau(t, p) for t in trees if len(t) <= m and max(map(len, t)) <= cap)
            assert table.tau[cap][m] == pytest.approx(brute, abs=1e-12)
            paths = table.paths(cap, m)
            assert check_rank_tree(paths) == paths and len(paths) <= m and max(map(len, paths)) <= cap
            assert expected_tau(paths, p) == pytest.approx(brute, abs=1e-12)


def test_chosen_tree_maximises_predicted_speed_and_is_valid():
    p = [[0.6, 0.2, 0.1], [0.5, 0.2], [0.4, 0.1]]
    cost = lambda n: 0.1 + 0.004 * n  # noqa: E731
    draft = lambda depth: 0.01 * depth  # noqa: E731
    sizes = [1, 2, 3, 4, 6, 8]
    ch = choose_rank_tree(p, cost, draft, sizes, max_depth=3)
    check_rank_tree(ch.paths)
    best = max((expected_tau(t, p) / (cost(len(t)) + draft(max(map(len, t)))), t)
               for t in all_rank_trees(8, 3, 3) if len(t) in sizes)
    assert ch.tokens_per_s == pytest.approx(best[0])
    assert ch.speedup == pytest.approx(ch.tokens_per_s * cost(1))
    assert ch.tau == pytest.approx(expected_tau(ch.paths, p))
    fixed = choose_rank_tree(p, cost, draft, sizes, max_depth=3, nodes=4)
    assert len(fixed.paths) == 4 and fixed.tokens_per_s <= ch.tokens_per_s
    zero = choose_rank_tree([[0.0, 0.0]], cost, draft, sizes, max_depth=1)
    assert zero.paths == [()] and zero.tau == 1.0  # nothing is ever accepted: verify the root alone


def test_tau_objective_picks_the_highest_tau_tree_of_the_budget_where_speed_picks_a_cheaper_one():
    """``objective="tau"`` (``eval.tree_objective=tau``): at a fixed budget, the tree of the highest τ over every
    rank tree of that many nodes (brute force), even where a deeper tree's extra drafter pass makes speed prefer
    a shallow one; ``choose_budget`` likewise picks the largest τ(n)."""
    p = [[0.6, 0.2, 0.1], [0.5, 0.2], [0.4, 0.1]]
    cost = lambda n: 0.1 + 0.001 * n  # noqa: E731
    draft = lambda depth: 0.2 * depth  # noqa: E731  a drafter pass dearer than a verification
    speed = choose_rank_tree(p, cost, draft, [1, 2, 4, 6], max_depth=3, nodes=6)
    tau = choose_rank_tree(p, cost, draft, [1, 2, 4, 6], max_depth=3, nodes=6, objective="tau")
    brute = max(expected_tau(t, p) for t in all_rank_trees(6, 3, 3) if len(t) <= 6)
    assert speed.depth == 1 and speed.tau < brute - 0.1
    assert tau.tau == pytest.approx(brute) and expected_tau(tau.paths, p) == pytest.approx(brute) and tau.depth > 1
    assert tau.tokens_per_s == pytest.approx(tau.tau / (cost(len(tau.paths)) + draft(tau.depth)))
    by_nodes = {2: 1.5, 4: 1.9, 8: 2.1}
    assert choose_budget(by_nodes, lambda n: 0.1 * n, 0.0).nodes == 2
    assert choose_budget(by_nodes, lambda n: 0.1 * n, 0.0, objective="tau").nodes == 8
    with pytest.raises(ValueError, match="objective 'fast'"):
        choose_rank_tree(p, cost, draft, [4], 3, objective="fast")


def test_not_a_tree_and_bad_statistics_are_clear_errors():
    with pytest.raises(TreeError, match=r"parent \[0\] is missing"):
        check_rank_tree([[0, 1]])
    with pytest.raises(TreeError, match="sibling rank 0 is missing"):
        check_rank_tree([[1]])
    check_rank_tree([[1]], contiguous=False)
    with pytest.raises(ValueError, match="not a probability"):
        best_rank_trees([[1.5]], 4)
    with pytest.raises(ValueError, match="empty"):
        choose_rank_tree([[0.5]], lambda n: 1.0, lambda d: 0.0, [], 1)
    with pytest.raises(ValueError, match="empty node grid"):
        choose_budget({}, lambda n: 1.0, 0.0)


def _tree():
    # root 5; depth 1: 7 (score -0.1), 8 (-1.0); depth 2 below 7: 9 (-0.3), 4 (-2.0); below 8: 3 (-1.2)
    return DraftTree.from_parents([5, 7, 8, 9, 4, 3], [-1, 0, 0, 1, 1, 2], scores=[0, -0.1, -1.0, -0.3, -2.0, -1.2])


def test_acceptance_statistics_by_rank_and_budget():
    tree = _tree()
    st = AcceptanceStats(budget_sizes=[1, 2, 3, 4, 6])
    assert greedy_path(tree, [7, 4, 1]) == [0, 1, 4]
    assert st.add_step(tree, [7, 4, 1]) == 2  # rank 0 at depth 1, rank 1 at depth 2
    assert st.add_step(tree, [8, 0]) == 1     # rank 1 at depth 1, then its only child misses
    assert st.add_step(tree, [6]) == 0
    assert st.rank_trials == [[3, 3], [2, 1]] and st.rank_hits == [[1, 1], [0, 1]]
    # depth 2 trials: the step through node 1 (two children) and through node 2 (one child: rank 0 only)
    assert st.rank_acceptance() == [[1 / 3, 1 / 3], [0.0, 1.0]]
    # truncation by score: order 7(-0.1), 9(-0.3), 8(-1.0), 3(-1.2), 4(-2.0)
    assert st.budget_tau() == {1: 1.0, 2: 1 + 1 / 3, 3: 1 + 1 / 3, 4: 1 + 2 / 3, 6: 1 + 3 / 3}


def test_score_budget_drafter_keeps_the_best_nodes():
    class Fixed:
        def draft(self, root):
            return _tree()

    for n in range(1, 7):
        got = ScoreBudgetDrafter(Fixed(), n).draft(5)
        want = DraftTree.from_parents([5, 7, 8, 9, 4, 3], [-1, 0, 0, 1, 1, 2], scores=[0, -0.1, -1.0, -0.3, -2.0, -1.2],
                                      max_nodes=n)
        assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()


def test_score_budget_needs_monotone_scores():
    class Bad:
        def draft(self, root):
            return DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 1]), scores=torch.tensor([0.0, -5.0, -1.0]))

    with pytest.raises(TreeError, match="scores above its parent"):
        ScoreBudgetDrafter(Bad(), 2).draft(5)
