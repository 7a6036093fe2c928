"""Choosing a draft tree for the hardware: acceptance statistics + cost model → expected tokens/s.

Head-agnostic: everything here works on :class:`decoding.tree.DraftTree` objects (node ranks are
sibling positions in canonical order, node scores are cumulative draft log-probabilities) and on
plain numbers; a head plugs in by turning the chosen *rank tree* or *node budget* into its
drafter's settings (see :mod:`evaluation.tree_auto`).

Model (Sequoia, arXiv 2402.12374 §3.1, "positional acceptance"): the candidate of sibling rank r at
depth d is accepted with probability ``p[d][r]`` given that its parent was accepted, independently
of the rest of the path.  A rank tree T (a set of rank paths, closed under prefixes, siblings with
contiguous ranks 0..c−1) then emits in expectation

    τ(T) = E[accepted + 1] = 1 + Σ_{u ∈ T, u ≠ root} Π_{v on the path root→u} p[depth v][rank v]

tokens per verification step (bonus included), and one step costs c(n) + drafter(T) where
n = |T| (root included) is the number of tokens verified.  The speed is τ(T) / (c(n) + drafter(T)).

* :func:`best_rank_trees` — Sequoia-style dynamic program: for every node budget m ≤ M and depth
  cap D the tree maximising τ (exact under the model; tested against brute-force enumeration).
* :class:`AcceptanceStats` — the two statistics measured by replaying the greedy continuation
  through drafted trees: ``p[d][r]`` (for the rank DP) and τ(n) for the tree truncated to its n
  best nodes by draft score (EAGLE-2's re-ranking by cumulative draft probability, arXiv
  2406.16858 §4; also CTC's candidate budget ``max_nodes``, which keeps the best-scoring nodes).
* :func:`choose_rank_tree` / :func:`choose_budget` — maximise predicted tokens/s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from decoding.ranking import node_order
from decoding.speculative import draft_tree, trim_tree
from decoding.tree import DraftTree, TreeError

RankPath = tuple[int, ...]


# ---------------------------------------------------------------------------------------------
# Expected acceptance of a rank tree
# ---------------------------------------------------------------------------------------------
def check_rank_tree(paths: Sequence[Sequence[int]], contiguous: bool = True) -> list[RankPath]:
    """Validate a rank tree given as rank paths (the root ``()`` optional).

    Args:
        paths: rank paths below the root.
        contiguous: also require every node's children to take ranks 0..c−1.

    Returns:
        the paths as tuples, root first, in canonical (depth, path) order.

    Raises:
        TreeError: a path's prefix is missing (not a tree), a rank is negative, a path repeats, or
            (``contiguous``) a node's children do not take ranks 0..c−1.
    """
    seen: set[RankPath] = set()
    for p in paths:
        if not isinstance(p, (list, tuple)) or not all(isinstance(r, int) for r in p):
            raise TreeError(f"rank path {p!r} is not a list of integer ranks")
        p = tuple(int(r) for r in p)
        if any(r < 0 for r in p):
            raise TreeError(f"rank path {list(p)} has a negative rank")
        if p in seen and p:
            raise TreeError(f"rank path {list(p)} appears twice")
        seen.add(p)
    seen.add(())
    for p in seen:
        if p and p[:-1] not in seen:
            raise TreeError(f"rank path {list(p)}: its parent {list(p[:-1])} is missing (not a tree)")
        if contiguous and p and p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
            raise TreeError(f"rank path {list(p)}: sibling rank {p[-1] - 1} is missing (ranks must be 0..c-1)")
    return sorted(seen, key=lambda q: (len(q), q))


def expected_tau(paths: Sequence[Sequence[int]], p: Sequence[Sequence[float]]) -> float:
    """τ(T) = 1 + Σ_u Π p[d][r] over the non-root nodes of the rank tree (see module doc).

    Args:
        paths: rank paths (validated by :func:`check_rank_tree`).
        p: ``p[d-1][r]`` = acceptance probability of the rank-r child at depth d (given its parent
            was accepted); missing entries count as 0.
    """
    reach: dict[RankPath, float] = {(): 1.0}
    total = 1.0
    for q in check_rank_tree(paths)[1:]:
        d, r = len(q), q[-1]
        pr = p[d - 1][r] if d - 1 < len(p) and r < len(p[d - 1]) else 0.0
        reach[q] = reach[q[:-1]] * float(pr)
        total += reach[q]
    return total


@dataclass
class RankTreeTable:
    """Result of :func:`best_rank_trees`: ``tau[D][m]`` and ``paths(D, m)`` for depth cap D ≥ 1 and
    at most m nodes (root included, 1 ≤ m ≤ M)."""

    max_nodes: int
    max_depth: int
    tau: dict[int, list[float]]
    _tables: dict[int, tuple] = field(repr=False, default_factory=dict)

    def paths(self, depth_cap: int, nodes: int) -> list[RankPath]:
        """The optimal rank tree (root first, canonical order) with ≤ ``nodes`` nodes, depth ≤ ``depth_cap``."""
        V, choice = self._tables[depth_cap]
        out: list[RankPath] = [()]

        def expand(prefix: RankPath, d: int, m: int, r: int) -> None:
            # distribute m nodes among the children of ``prefix`` (depth d) with ranks >= r
            while m > 0:
                j = choice[d][m][r]
                if j == 0:
                    return
                child = prefix + (r,)
                out.append(child)
                expand(child, d + 1, j - 1, 0)
                m, r = m - j, r + 1

        expand((), 0, nodes - 1, 0)
        return sorted(out, key=lambda q: (len(q), q))


def best_rank_trees(p: Sequence[Sequence[float]], max_nodes: int, max_depth: int | None = None) -> RankTreeTable:
    """Sequoia-style dynamic program over rank trees (module doc; Sequoia §3.1, Algorithm 1).

    For a node at depth d that is accepted, let V_d(m) be the best expected number of accepted
    nodes strictly below it using at most m nodes, and W_d(m, r) the best for its children of
    rank ≥ r:  W_d(m, r) = max(W_d(m−1, r), max_{1≤j≤m} p[d+1][r]·(1 + V_{d+1}(j−1)) + W_d(m−j, r+1)),
    V_d(m) = W_d(m, 0), with W = 0 at depth cap D or beyond the last measured rank.  τ = 1 + V_0(M−1).

    Args:
        p: ``p[d-1][r]`` acceptance of the rank-r child at depth d (probabilities in [0, 1]).
        max_nodes: M, the largest node budget (root included, ≥ 1).
        max_depth: D cap (default: ``len(p)``).  Tables are built for every cap 1..D.

    Returns:
        :class:`RankTreeTable`; ``tau[D][m]`` is τ of the best tree with ≤ m nodes and depth ≤ D.

    Raises:
        ValueError: ``max_nodes < 1``, no depth, or a probability outside [0, 1].
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes={max_nodes} must be >= 1 (the root)")
    D_all = len(p) if max_depth is None else min(int(max_depth), len(p))
    if D_all < 1:
        raise ValueError("best_rank_trees: no acceptance statistics (empty p)")
    for d, row in enumerate(p[:D_all]):
        for r, x in enumerate(row):
            if not 0.0 <= float(x) <= 1.0 or math.isnan(float(x)):
                raise ValueError(f"acceptance p[{d}][{r}]={x} is not a probability")
    M = max_nodes - 1  # nodes below the root
    tau: dict[int, list[float]] = {}
    tables: dict[int, tuple] = {}
    for D in range(1, D_all + 1):
        # V[d][m], choice[d][m][r] = nodes given to rank r's subtree (0 = stop)
        V = [[0.0] * (M + 1) for _ in range(D + 1)]
        choice = [[[0] * (len(p[d]) + 1 if d < D else 1) for _ in range(M + 1)] for d in range(D + 1)]
        for d in range(D - 1, -1, -1):
            probs = [float(x) for x in p[d]]
            R = len(probs)
            W = [[0.0] * (R + 1) for _ in range(M + 1)]
            for r in range(R - 1, -1, -1):
                pr = probs[r]
                for m in range(1, M + 1):
                    best, arg = W[m - 1][r], choice[d][m - 1][r] if m > 1 else 0
                    if best < 0.0:
                        best, arg = 0.0, 0
                    for j in range(1, m + 1):
                        v = pr * (1.0 + V[d + 1][j - 1]) + W[m - j][r + 1]
                        if v > best + 1e-12:
                            best, arg = v, j
                    W[m][r] = best
                    # W(m−1, r) is realisable with m nodes too; rebuild that choice when kept
                    choice[d][m][r] = arg
            for m in range(M + 1):
                V[d][m] = W[m][0]
        tables[D] = (V, choice)
        tau[D] = [float("nan")] + [1.0 + V[0][m - 1] for m in range(1, max_nodes + 1)]
    return RankTreeTable(max_nodes=max_nodes, max_depth=D_all, tau=tau, _tables=tables)


# ---------------------------------------------------------------------------------------------
# Acceptance statistics
# ---------------------------------------------------------------------------------------------
def greedy_path(tree: DraftTree, continuation: Sequence[int]) -> list[int]:
    """Nodes (root first) accepted when the base model's greedy continuation after the root is
    ``continuation``: from the root, the child whose token is the next greedy token (§4.1)."""
    toks = tree.tokens.tolist()
    path, node = [0], 0
    for t in continuation:
        nxt = next((c for c in tree.children(node) if toks[c] == int(t)), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path


def truncation_order(tree: DraftTree) -> list[int]:
    """Non-root nodes best first by draft score (ties: smaller depth, then canonical order: the
    one rule of :func:`decoding.ranking.node_order`) — the order in which
    ``DraftTree.from_paths(max_nodes=...)`` keeps nodes, so a tree cut to its n best nodes here is
    the tree drafted with a budget of n; every prefix of it is ancestor-closed when scores never
    increase down a path (cumulative log-probabilities)."""
    n = tree.num_nodes
    if tree.scores is None:
        return list(range(1, n))
    return node_order(tree.scores.tolist(), tree.depths.tolist())


@dataclass
class AcceptanceStats:
    """Per-head acceptance statistics, accumulated step by step with :meth:`add_step`.

    Attributes:
        rank_trials: ``[d-1][r]`` steps whose accepted path reached depth d−1 at a node that had a
            rank-r child (the trials of p[d][r]).
        rank_hits: ``[d-1][r]`` of those, steps that accepted the rank-r child.
        budget_sizes: node budgets n (root incl.) for the score-truncated τ(n).
        budget_accepted: per budget, Σ accepted tokens over steps when each tree is cut to its n
            best nodes by score.
        steps: steps recorded.  ``drafter_passes``, ``drafter_seconds``: totals of the drafter.
        max_tree_nodes: the largest drafted tree (τ(n) is exact only for n up to it).
    """

    budget_sizes: list[int]
    rank_trials: list[list[int]] = field(default_factory=list)
    rank_hits: list[list[int]] = field(default_factory=list)
    budget_accepted: list[int] = field(default_factory=list)
    steps: int = 0
    drafter_passes: int = 0
    drafter_seconds: float = 0.0
    max_tree_nodes: int = 1

    def __post_init__(self) -> None:
        self.budget_sizes = sorted({int(n) for n in self.budget_sizes})
        if not self.budget_sizes or self.budget_sizes[0] < 1:
            raise ValueError(f"budget sizes must be a non-empty list of node counts >= 1, got {self.budget_sizes}")
        if not self.budget_accepted:
            self.budget_accepted = [0] * len(self.budget_sizes)

    def add_step(self, tree: DraftTree, continuation: Sequence[int]) -> int:
        """Record one drafted tree against the greedy ``continuation`` after its root; returns the
        accepted draft tokens A (its depth-d node on the path has rank = sibling position)."""
        path = greedy_path(tree, continuation)
        for d in range(len(path)):
            if d >= len(continuation):
                break  # the next greedy token is unknown: no trial
            kids = tree.children(path[d])
            if not kids:
                break
            while len(self.rank_trials) <= d:
                self.rank_trials.append([])
                self.rank_hits.append([])
            trials, hits = self.rank_trials[d], self.rank_hits[d]
            while len(trials) < len(kids):
                trials.append(0)
                hits.append(0)
            for r in range(len(kids)):
                trials[r] += 1
            if d + 1 < len(path):
                hits[kids.index(path[d + 1])] += 1
        order = truncation_order(tree)
        pos = {u: i for i, u in enumerate(order)}  # node kept iff pos < n - 1
        for b, n in enumerate(self.budget_sizes):
            a = 0
            for u in path[1:]:
                if pos[u] >= n - 1:
                    break
                a += 1
            self.budget_accepted[b] += a
        self.steps += 1
        self.max_tree_nodes = max(self.max_tree_nodes, tree.num_nodes)
        return len(path) - 1

    # -- derived ----------------------------------------------------------------------------------
    def rank_acceptance(self) -> list[list[float]]:
        """p[d-1][r] = hits / trials (ranks never tried are cut off)."""
        out = []
        for trials, hits in zip(self.rank_trials, self.rank_hits):
            out.append([h / t for h, t in zip(hits, trials) if t > 0])
        while out and not out[-1]:
            out.pop()
        return out

    def budget_tau(self) -> dict[int, float]:
        """τ(n) = 1 + mean accepted tokens with each tree cut to its n best nodes by draft score."""
        if not self.steps:
            return {}
        return {n: 1.0 + a / self.steps for n, a in zip(self.budget_sizes, self.budget_accepted)}

    def drafter_seconds_per_pass(self) -> float | None:
        return self.drafter_seconds / self.drafter_passes if self.drafter_passes else None

    def to_dict(self) -> dict:
        return {"steps": self.steps, "rank_trials": self.rank_trials, "rank_hits": self.rank_hits,
                "budget_sizes": self.budget_sizes, "budget_accepted": self.budget_accepted,
                "drafter_passes": self.drafter_passes, "drafter_seconds": self.drafter_seconds,
                "max_tree_nodes": self.max_tree_nodes,
                "rank_acceptance": self.rank_acceptance(), "budget_tau": {str(k): v for k, v in self.budget_tau().items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "AcceptanceStats":
        return cls(budget_sizes=list(d["budget_sizes"]), rank_trials=[list(x) for x in d["rank_trials"]],
                   rank_hits=[list(x) for x in d["rank_hits"]], budget_accepted=list(d["budget_accepted"]),
                   steps=int(d["steps"]), drafter_passes=int(d["drafter_passes"]),
                   drafter_seconds=float(d["drafter_seconds"]), max_tree_nodes=int(d["max_tree_nodes"]))


# ---------------------------------------------------------------------------------------------
# Choice by predicted tokens/s
# ---------------------------------------------------------------------------------------------
@dataclass
class TreeChoice:
    """A chosen tree: ``nodes`` (root incl.), ``depth``, predicted ``tau`` and step time (s),
    ``tokens_per_s`` = τ / step time, ``speedup`` against one vanilla step c(1), the rank
    ``paths`` (rank-tree mode) and every candidate considered (``candidates``: dicts)."""

    nodes: int
    depth: int
    tau: float
    step_seconds: float
    tokens_per_s: float
    speedup: float
    paths: list[RankPath] | None = None
    candidates: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("nodes", "depth", "tau", "step_seconds", "tokens_per_s", "speedup")}
        if self.paths is not None:
            d["paths"] = [list(q) for q in self.paths]
        d["candidates"] = self.candidates
        return d


#: what a tree search maximises: ``speed`` = predicted tokens/s τ / (c(n) + drafter), the default (Sequoia §3);
#: ``tau`` = predicted τ alone (verification and drafter cost ignored; ties to the cheaper step), the tree of
#: a "τ at n nodes" quality figure (EAGLE-2 / Sequoia report τ at a fixed node budget)
TREE_OBJECTIVES = ("speed", "tau")


def _better(objective: str, tau: float, tps: float, best: "TreeChoice | None") -> bool:
    """Whether a candidate of predicted ``tau`` and ``tps`` tokens/s beats ``best`` under ``objective``."""
    if best is None:
        return True
    if objective == "tau":
        return tau > best.tau * (1 + 1e-9) or (tau >= best.tau * (1 - 1e-9) and tps > best.tokens_per_s * (1 + 1e-9))
    return tps > best.tokens_per_s * (1 + 1e-9)


def _check_objective(objective: str) -> None:
    if objective not in TREE_OBJECTIVES:
        raise ValueError(f"tree search: objective {objective!r} is not one of {', '.join(TREE_OBJECTIVES)}")


def choose_rank_tree(p: Sequence[Sequence[float]], verify_seconds: Callable[[int], float],
                     drafter_seconds: Callable[[int], float], sizes: Sequence[int], max_depth: int,
                     nodes: int | None = None, objective: str = "speed") -> TreeChoice:
    """The rank tree maximising τ(T) / (c(n) + drafter(depth)) over n ∈ ``sizes`` and depth ≤ ``max_depth``
    (``objective="speed"``), or τ(T) alone (``"tau"``, :data:`TREE_OBJECTIVES`: with ``nodes`` fixed, the
    highest-τ tree of that budget; the reported step time and speed are still the cost model's).

    Args:
        p: rank acceptance ``p[d-1][r]``.
        verify_seconds: c(n), seconds of one verification forward over n tokens.
        drafter_seconds: drafter seconds per step for a tree of the given depth (e.g. passes · cost/pass).
        sizes: candidate node counts n (root incl.).
        max_depth: the drafter's depth cap.
        nodes: fix n (only the shape is chosen).
        objective: one of :data:`TREE_OBJECTIVES`.

    Raises:
        ValueError: empty ``sizes``, no acceptance statistics or an unknown ``objective``.
    """
    _check_objective(objective)
    grid = sorted({int(n) for n in ([nodes] if nodes else sizes)})
    if not grid or grid[0] < 1:
        raise ValueError(f"tree search: empty or invalid node grid {list(sizes)}")
    table = best_rank_trees(p, max(grid), max_depth)
    base = verify_seconds(1)
    best: TreeChoice | None = None
    cands = []
    for n in grid:
        for D in range(1, table.max_depth + 1):
            tau = table.tau[D][n]
            paths = table.paths(D, n)
            depth = max(len(q) for q in paths)
            if depth < D:
                continue  # the same tree as a smaller cap
            step = verify_seconds(len(paths)) + drafter_seconds(depth)
            tps = tau / step
            cands.append({"nodes": len(paths), "depth": depth, "tau": tau, "tokens_per_s": tps})
            if _better(objective, tau, tps, best):
                best = TreeChoice(nodes=len(paths), depth=depth, tau=tau, step_seconds=step, tokens_per_s=tps,
                                  speedup=tps * base, paths=paths)
    if best is None:  # every budget gives the root alone (nothing is ever accepted)
        step = verify_seconds(1) + drafter_seconds(0)
        best = TreeChoice(nodes=1, depth=0, tau=1.0, step_seconds=step, tokens_per_s=1.0 / step,
                          speedup=base / step, paths=[()])
    best.candidates = cands
    return best


def choose_budget(tau_by_nodes: dict[int, float], verify_seconds: Callable[[int], float],
                  drafter_step_seconds: float | Callable[[int], float], nodes: int | None = None,
                  objective: str = "speed") -> TreeChoice:
    """The node budget n maximising τ(n) / (c(n) + drafter) (CTC's ``max_nodes``, the dynamic
    score-truncated tree's n*); ``tau_by_nodes`` from :meth:`AcceptanceStats.budget_tau`.
    ``drafter_step_seconds`` is the drafter's seconds per step, or a function of n when the
    drafter's work depends on the budget (EAGLE-3 expands at most n − 1 levels).

    ``objective="tau"`` maximises τ(n) alone (:data:`TREE_OBJECTIVES`).

    Raises:
        ValueError: no budget (empty grid), ``nodes`` not among the measured budgets, or an unknown ``objective``.
    """
    _check_objective(objective)
    if not tau_by_nodes:
        raise ValueError("tree search: empty node grid (no measured budget)")
    if nodes is not None and int(nodes) not in tau_by_nodes:
        raise ValueError(f"tree search: node budget {nodes} was not calibrated (have {sorted(tau_by_nodes)})")
    base = verify_seconds(1)
    best: TreeChoice | None = None
    cands = []
    for n in sorted(tau_by_nodes):
        if nodes is not None and n != int(nodes):
            continue
        step = verify_seconds(n) + (drafter_step_seconds(n) if callable(drafter_step_seconds) else drafter_step_seconds)
        tps = tau_by_nodes[n] / step
        cands.append({"nodes": n, "tau": tau_by_nodes[n], "tokens_per_s": tps})
        if _better(objective, tau_by_nodes[n], tps, best):
            best = TreeChoice(nodes=n, depth=-1, tau=tau_by_nodes[n], step_seconds=step, tokens_per_s=tps,
                              speedup=tps * base)
    best.candidates = cands
    return best


# ---------------------------------------------------------------------------------------------
# Drafter wrappers
# ---------------------------------------------------------------------------------------------
class _DrafterWrapper:
    """Delegates the ``decoding.speculative.Drafter`` protocol (reset / start / accept) to
    ``self.drafter``; subclasses change :meth:`draft`.  Every other attribute, among them the
    protocol's optional ones (``feature_layers``: the hidden-state ids EAGLE-3 reads), is the
    wrapped drafter's, so a wrapper never changes what the runtime hands the drafter."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter

    def __getattr__(self, name: str):
        if name == "drafter":  # not set yet (e.g. during unpickling/copy): no recursion
            raise AttributeError(name)
        return getattr(self.drafter, name)

    def reset(self) -> None:
        if hasattr(self.drafter, "reset"):
            self.drafter.reset()

    def start(self, prompt_ids, hidden) -> None:
        self.drafter.start(prompt_ids, hidden)

    def accept(self, tokens, hidden) -> None:
        self.drafter.accept(tokens, hidden)


class ScoreBudgetDrafter(_DrafterWrapper):
    """EAGLE-2-style dynamic tree (arXiv 2406.16858 §4 "re-ranking"): the wrapped drafter's tree is
    cut, every step, to its ``max_nodes`` best nodes (root included) by draft score — the
    cumulative draft log-probability — so the tree's shape follows the drafter's confidence in
    the current context while its size n* is set by the cost model.

    Args:
        drafter: a ``decoding.speculative.Drafter`` whose trees carry ``scores`` that never
            increase down a path (Falcon / CTC: cumulative log-probabilities).
        max_nodes: n* (≥ 1).

    Raises:
        ValueError: ``max_nodes < 1``.  TreeError (at draft time): a tree without scores.
    """

    def __init__(self, drafter, max_nodes: int) -> None:
        if int(max_nodes) < 1:
            raise ValueError(f"max_nodes={max_nodes} must be >= 1")
        super().__init__(drafter)
        self.max_nodes = int(max_nodes)

    def __getattr__(self, name):  # head, template, ... of the wrapped drafter
        if name == "drafter":
            raise AttributeError(name)
        return getattr(self.drafter, name)

    def draft(self, root_token: int, max_depth: int | None = None, max_nodes: int | None = None) -> DraftTree:
        """The wrapped drafter's tree (drafted with depth cap ``max_depth`` and the node budget, so
        it runs no pass whose nodes the cut drops), cut to its best ``min(self.max_nodes,
        max_nodes)`` nodes among those at depth ≤ ``max_depth``."""
        budget = self.max_nodes if max_nodes is None else min(self.max_nodes, int(max_nodes))
        tree = draft_tree(self.drafter, root_token, max_depth=max_depth, max_nodes=budget)
        if max_depth is not None:
            tree = trim_tree(tree, max_depth)
        if tree.num_nodes <= budget:
            return tree
        if tree.scores is None:
            raise TreeError(f"{type(self.drafter).__name__} drafts trees without scores: no dynamic budget possible")
        keep = [0] + sorted(truncation_order(tree)[: budget - 1])
        index = {old: new for new, old in enumerate(keep)}
        par = tree.parents.tolist()
        orphan = next((u for u in keep[1:] if par[u] not in index), None)
        if orphan is not None:
            raise TreeError(f"{type(self.drafter).__name__}: node {orphan} scores above its parent; the dynamic budget "
                            "needs scores that never increase down a path (cumulative log-probabilities)")
        return DraftTree(tree.tokens[keep], [-1] + [index[par[u]] for u in keep[1:]], tree.depths[keep],
                         tree.scores[keep], drafter_passes=tree.drafter_passes)


class RootOnlyDrafter:
    """Drafts the root alone and never runs a head: :class:`decoding.speculative.SpeculativeDecoder`
    then verifies one token per base forward, i.e. vanilla greedy decoding (τ = 1, no drafter
    cost).  ``eval.tree_fallback`` decodes with it when the cost model predicts every tree slower
    than vanilla decoding (:func:`evaluation.tree_auto.plan_tree`)."""

    def start(self, prompt_ids, hidden) -> None:
        """Nothing to set up: no head runs."""

    def draft(self, root_token: int, max_depth: int | None = None, max_nodes: int | None = None) -> DraftTree:
        """The one-node tree ``[root_token]``, built with 0 drafter passes."""
        return DraftTree([int(root_token)], [-1], [0], drafter_passes=0)

    def accept(self, tokens, hidden) -> None:
        """Nothing to keep: no head runs."""


class RecordingDrafter(_DrafterWrapper):
    """Wraps a drafter and keeps every drafted tree (``trees``), for calibration replays."""

    def __init__(self, drafter) -> None:
        super().__init__(drafter)
        self.trees: list[DraftTree] = []

    def reset(self) -> None:
        self.trees = []
        super().reset()

    def draft(self, root_token: int, max_depth: int | None = None, max_nodes: int | None = None) -> DraftTree:
        tree = draft_tree(self.drafter, root_token, max_depth=max_depth, max_nodes=max_nodes)
        self.trees.append(tree)
        return tree
