"""Draft token trees and their tree-attention masks (METHODS.md §0 "Tree attention for verification").

A :class:`DraftTree` holds N nodes.  Node 0 is the **root**: the last emitted token (the bonus
token of the previous step, or the first token after prefill), which is not yet in the base
model's KV cache.  Every other node is a draft token whose parent precedes it.  Nodes are in the
canonical order "root first, then by (depth, path)", where a node's path is the tuple of sibling
ranks from the root and siblings are ranked by descending score (ties: first seen first).

With P tokens in the cache, node i sits at position ``P + depth[i]`` and attends to the P cached
tokens, itself and its ancestors, so one base forward yields p(· | prefix + path(i)) at every
node (SpecInfer / Medusa / EAGLE tree attention).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from decoding.masks import additive_mask
from decoding.ranking import node_order


class TreeError(ValueError):
    """A malformed draft tree (bad parent indices, root, shapes)."""


def _as_list(path) -> list[int]:
    if isinstance(path, torch.Tensor):
        return [int(t) for t in path.reshape(-1).tolist()]
    return [int(t) for t in path]


@dataclass(eq=False)
class DraftTree:
    """A draft token tree in canonical order.

    Attributes:
        tokens: LongTensor [N], token ids; ``tokens[0]`` is the root.
        parents: LongTensor [N], parent node index; ``parents[0] == -1``, ``parents[i] < i``.
        depths: LongTensor [N], depth (root 0, a child is its parent's depth + 1).
        scores: optional FloatTensor [N], drafter scores (higher is better); informative only.
        drafter_passes: number of drafter forward passes that built the tree (for reports).

    Raises:
        TreeError: on construction, if the fields are inconsistent (see :meth:`validate`).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor = None  # type: ignore[assignment]
    scores: torch.Tensor | None = None
    drafter_passes: int = 1
    _children: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1).cpu()
        self.parents = torch.as_tensor(self.parents, dtype=torch.long).reshape(-1).cpu()
        if self.depths is None:
            depths = [0] * len(self.parents)
            for i in range(1, len(self.parents)):
                p = int(self.parents[i])
                if not 0 <= p < i:
                    raise TreeError(f"node {i} has parent {p}; parents must precede their children")
                depths[i] = depths[p] + 1
            self.depths = torch.tensor(depths, dtype=torch.long)
        else:
            self.depths = torch.as_tensor(self.depths, dtype=torch.long).reshape(-1).cpu()
        if self.scores is not None:
            self.scores = torch.as_tensor(self.scores, dtype=torch.float32).reshape(-1).cpu()
        self.validate()

    # ------------------------------------------------------------------ checks and accessors
    def validate(self) -> None:
        """Check shapes, root, parent order and depths; raise :class:`TreeError` naming the node."""
        n = self.tokens.numel()
        if n < 1:
            raise TreeError("a draft tree needs at least the root node")
        for name, t in (("parents", self.parents), ("depths", self.depths)):
            if t.numel() != n:
                raise TreeError(f"{name} has {t.numel()} entries, tokens has {n}")
        if self.scores is not None and self.scores.numel() != n:
            raise TreeError(f"scores has {self.scores.numel()} entries, tokens has {n}")
        if int(self.parents[0]) != -1 or int(self.depths[0]) != 0:
            raise TreeError("node 0 must be the root: parents[0] == -1 and depths[0] == 0")
        par = self.parents.tolist()
        dep = self.depths.tolist()
        for i in range(1, n):
            if not 0 <= par[i] < i:
                raise TreeError(f"node {i} has parent {par[i]}; parents must precede their children")
            if dep[i] != dep[par[i]] + 1:
                raise TreeError(f"node {i} has depth {dep[i]}, its parent {par[i]} has depth {dep[par[i]]}")
            if dep[i] < dep[i - 1]:
                raise TreeError(f"node {i} (depth {dep[i]}) follows a deeper node; nodes must be ordered by depth")
        if (self.tokens < 0).any():
            raise TreeError(f"negative token id at node {int((self.tokens < 0).nonzero()[0])}")

    @property
    def num_nodes(self) -> int:
        """N, the number of nodes including the root."""
        return int(self.tokens.numel())

    @property
    def max_depth(self) -> int:
        """The deepest node's depth (0 for a root-only tree)."""
        return int(self.depths.max())

    @property
    def root_token(self) -> int:
        return int(self.tokens[0])

    def children(self, node: int) -> list[int]:
        """Child node indices of ``node``, in canonical (sibling-rank) order."""
        if self._children is None:
            ch: list[list[int]] = [[] for _ in range(self.num_nodes)]
            for i, p in enumerate(self.parents.tolist()[1:], start=1):
                ch[p].append(i)
            self._children = ch
        return self._children[node]

    def path(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` (both included)."""
        out = [node]
        par = self.parents.tolist()
        while par[out[-1]] >= 0:
            out.append(par[out[-1]])
        return out[::-1]

    def token_path(self, node: int) -> list[int]:
        """Token ids from the root to ``node`` (both included)."""
        toks = self.tokens.tolist()
        return [toks[i] for i in self.path(node)]

    def ancestor_matrix(self) -> torch.Tensor:
        """BoolTensor [N, N]: ``A[i, j]`` is True iff node j is node i or one of its ancestors."""
        n = self.num_nodes
        anc = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            anc[i] |= anc[p]
        return anc

    # ------------------------------------------------------------------ base-model inputs
    def position_ids(self, past_length: int, device=None) -> torch.Tensor:
        """LongTensor [1, N]: ``past_length + depth`` (RoPE positions of the nodes)."""
        return (self.depths + int(past_length)).unsqueeze(0).to(device)

    def attention_mask(self, past_length: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """Additive 4-D tree attention mask [1, 1, N, P+N] in ``dtype``.

        0 where a node may attend (the P cached positions, itself and its ancestors) and
        ``torch.finfo(dtype).min`` elsewhere; this is the format transformers' eager and SDPA
        attention take as a ready 4-D mask (added to the attention scores).
        """
        n, p = self.num_nodes, int(past_length)
        visible = torch.cat([torch.ones(n, p, dtype=torch.bool), self.ancestor_matrix()], dim=1)
        return additive_mask(visible, dtype).view(1, 1, n, p + n).to(device)

    # ------------------------------------------------------------------ construction
    @classmethod
    def chain(cls, root_token: int, tokens: Sequence[int] | torch.Tensor) -> "DraftTree":
        """A single path: root followed by ``tokens`` (each node the child of the previous)."""
        toks = [int(root_token)] + _as_list(tokens)
        return cls(torch.tensor(toks), torch.arange(-1, len(toks) - 1))

    @classmethod
    def from_paths(
        cls,
        root_token: int,
        paths: Iterable[Sequence[int] | torch.Tensor],
        scores: Sequence[float] | torch.Tensor | None = None,
        max_nodes: int | None = None,
        max_depth: int | None = None,
        drafter_passes: int = 1,
    ) -> "DraftTree":
        """Merge candidate token paths into a trie below ``root_token``.

        Args:
            root_token: the last emitted token (node 0).
            paths: candidate continuations, each a sequence of token ids *below* the root (the
                root is not repeated).  Identical prefixes are merged; empty paths are ignored.
            scores: one score per path (higher is better), e.g. a CTC candidate's log-probability.
                Default: earlier paths are better.  A node's score is the best score of the paths
                through it, so an ancestor never scores below its descendants.
            max_nodes: keep at most this many nodes including the root: the best-scoring nodes,
                ties broken by smaller depth then canonical order (:func:`decoding.ranking.node_order`;
                ancestor-closed when scores never increase down a path, as a path's best score does).
            max_depth: truncate every path to this many tokens.
            drafter_passes: recorded on the tree for reports.

        Returns:
            A canonical :class:`DraftTree` (root first, then by (depth, path); siblings by
            descending score).

        Raises:
            TreeError: ``scores`` and ``paths`` differ in length, or ``max_nodes < 1``.
        """
        paths = [_as_list(p) for p in paths]
        if scores is None:
            path_scores = [-float(i) for i in range(len(paths))]
        else:
            path_scores = [float(s) for s in (scores.tolist() if isinstance(scores, torch.Tensor) else scores)]
            if len(path_scores) != len(paths):
                raise TreeError(f"{len(paths)} paths but {len(path_scores)} scores")
        if max_nodes is not None and max_nodes < 1:
            raise TreeError(f"max_nodes={max_nodes} must be >= 1 (the root)")
        # trie: node -> {token: child}; node attributes in insertion order
        tok: list[int] = [int(root_token)]
        par: list[int] = [-1]
        dep: list[int] = [0]
        best: list[float] = [float("inf")]
        kids: list[dict[int, int]] = [{}]
        for path, s in zip(paths, path_scores):
            if max_depth is not None:
                path = path[:max_depth]
            node = 0
            for t in path:
                child = kids[node].get(t)
                if child is None:
                    child = len(tok)
                    tok.append(t)
                    par.append(node)
                    dep.append(dep[node] + 1)
                    best.append(s)
                    kids.append({})
                    kids[node][t] = child
                else:
                    best[child] = max(best[child], s)
                node = child
        # canonical order of the whole trie: BFS, siblings by (-score, insertion order)
        order: list[int] = []
        frontier = [0]
        while frontier:
            order.extend(frontier)
            nxt: list[int] = []
            for node in frontier:
                ch = list(kids[node].values())
                ch.sort(key=lambda c: (-best[c], c))
                nxt.extend(ch)
            frontier = nxt
        if max_nodes is not None and len(tok) > max_nodes:
            # the budget keeps the best nodes by decoding.ranking's one rule (score, depth, canonical
            # order), so a trie cut to n here equals a larger one cut to n by tree_search.truncation_order
            canon = [0] * len(tok)
            for pos, o in enumerate(order):
                canon[o] = pos
            kept = {0, *node_order(best, dep, canon)[: max_nodes - 1]}
            order = [o for o in order if o in kept]  # the canonical order of a subtree is the restriction
        new_index = {old: new for new, old in enumerate(order)}
        tokens = torch.tensor([tok[o] for o in order], dtype=torch.long)
        parents = torch.tensor([-1] + [new_index[par[o]] for o in order[1:]], dtype=torch.long)
        depths = torch.tensor([dep[o] for o in order], dtype=torch.long)
        sc = None
        if scores is not None:
            sc = torch.tensor([best[o] if o else float("inf") for o in order], dtype=torch.float32)
        return cls(tokens, parents, depths, sc, drafter_passes)

    @classmethod
    def from_parents(
        cls,
        tokens: Sequence[int] | torch.Tensor,
        parents: Sequence[int] | torch.Tensor,
        scores: Sequence[float] | torch.Tensor | None = None,
        max_nodes: int | None = None,
        drafter_passes: int = 1,
    ) -> "DraftTree":
        """Build a canonical tree from explicit parent pointers in any order.

        Args:
            tokens: [N] token ids; node 0 must be the root.
            parents: [N] parent indices (``-1`` for the root only); must form a tree.
            scores: optional [N] node scores (higher is better); default: earlier nodes better.
            max_nodes, drafter_passes: as in :meth:`from_paths`.

        Duplicate siblings (same parent, same token) are merged (their subtrees too).

        Raises:
            TreeError: a parent index is out of range, node 0 is not the only root, or the
                parents contain a cycle.
        """
        toks = _as_list(tokens)
        pars = _as_list(parents)
        n = len(toks)
        if len(pars) != n or n == 0:
            raise TreeError(f"tokens has {n} entries, parents has {len(pars)}")
        if pars[0] != -1 or any(p == -1 for p in pars[1:]):
            raise TreeError("node 0 must be the only root (parents[0] == -1, all others >= 0)")
        if any(not 0 <= p < n for p in pars[1:]):
            raise TreeError(f"parent index out of range in {pars}")
        if scores is None:
            node_scores = [-float(i) for i in range(n)]
        else:
            node_scores = [float(s) for s in _as_list_float(scores)]
            if len(node_scores) != n:
                raise TreeError(f"{n} nodes but {len(node_scores)} scores")
        paths = []
        for i in range(1, n):
            path, j, seen = [], i, set()
            while j != 0:
                if j in seen:
                    raise TreeError(f"parents contain a cycle through node {j}")
                seen.add(j)
                path.append(toks[j])
                j = pars[j]
            paths.append(path[::-1])
        tree = cls.from_paths(toks[0], paths, node_scores[1:], max_nodes=max_nodes, drafter_passes=drafter_passes)
        if scores is None:
            tree.scores = None
        return tree


def _as_list_float(x) -> list[float]:
    if isinstance(x, torch.Tensor):
        return [float(v) for v in x.reshape(-1).tolist()]
    return [float(v) for v in x]
