"""The one tie-break of every ranking in drafting (issue 28, item 5).

Drafting ranks in two places: a head's candidates for one position (top-k of a distribution) and
the nodes of a draft tree (which nodes a node budget keeps).  With exactly tied scores torch's
``topk`` returns an order that depends on k (and on the kernel), so a tree calibrated at one
budget (``eval.tree=auto``) would not be the tree decoded at another.  Every ranking in
``decoding`` therefore uses the rules here, at every k, in calibration and decoding alike:

* **candidates** (:func:`topk_stable`): higher score first, ties to the **lower index** (the lower
  draft-vocabulary index, i.e. the lower base token id: ``d2t`` is sorted by id).  The first k of
  the ranking at any k' > k are the ranking at k.
* **tree nodes** (:func:`node_order`, used by :meth:`decoding.tree.DraftTree.from_paths`'
  ``max_nodes``, :func:`decoding.tree_search.truncation_order`, the dynamic budget and EAGLE-3's
  expansion): higher score first (scores compared as the float32 values a tree stores), then
  smaller depth (so a prefix of the order is ancestor-closed whenever scores never increase down a
  path), then canonical tree order (root first, then by (depth, sibling-rank path); siblings by
  descending score, ties in the order the drafter ranked them).  The canonical order of a subtree
  is the restriction of the canonical order of the tree, so cutting a tree of M nodes to its n best
  gives the tree drafted with a budget of n.

Greedy argmax (AdaDecode's exit tokens, verification, vanilla decoding) takes the first maximum, the
lower id: :func:`greedy_ids`.
"""
from __future__ import annotations

from typing import Sequence

import torch


def topk_stable(x: torch.Tensor, k: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of ``x`` along ``dim``, higher first, ties to the lower index.

    Deterministic and prefix-consistent: ``topk_stable(x, k)`` equals the first k entries of
    ``topk_stable(x, k')`` for every k' ≥ k.  Fast path: ``torch.topk`` then a re-sort of the k
    winners by (value desc, index asc); when a row holds more entries equal to its k-th value than
    made the cut (a tie at the boundary), the top k + (ties left out) are ranked the same way, which
    holds every entry at or above the k-th value (a stable full sort only when ``x`` holds a NaN).
    Bf16-derived scores tie often: over a 16k draft vocabulary the full sort made CTC validation
    several times slower.

    Args:
        x: float tensor [..., V, ...] (any float dtype, any device).
        k: how many to keep (1 ≤ k; clipped to the size of ``dim``).
        dim: the dimension to rank along.

    Returns:
        ``(values, indices)``: like ``torch.topk(x, k, dim)`` (values in ``x``'s dtype, int64
        indices), ordered by the rule above.  NaN ranks above every number (torch's sort order).

    Raises:
        ValueError: ``k < 1``.
    """
    if int(k) < 1:
        raise ValueError(f"topk_stable: k={k} must be >= 1")
    dim = dim % x.dim()
    k = min(int(k), x.shape[dim])
    vals, idx = _by_value_then_index(*x.topk(k, dim=dim), dim)
    kth = vals.narrow(dim, k - 1, 1)
    tied_total = (x == kth).sum(dim=dim, keepdim=True)
    tied_kept = (vals == kth).sum(dim=dim, keepdim=True)
    if bool((tied_total > tied_kept).any()):  # a tie across the cut: which tied entries made it is torch's choice
        if bool(torch.isnan(x).any()):  # NaN compares unequal to itself: the stable full sort ranks it
            s_vals, s_idx = x.sort(dim=dim, descending=True, stable=True)  # stable: equal values keep index order
            return s_vals.narrow(dim, 0, k), s_idx.narrow(dim, 0, k)
        # every entry >= the k-th value is among the top k + (tied entries left out): fewer than k lie above
        # it, and the rest are its ties; ranking those few by (value desc, index asc) ranks the whole row
        wide = min(k + int((tied_total - tied_kept).max()), x.shape[dim])
        vals, idx = _by_value_then_index(*x.topk(wide, dim=dim), dim)
        vals, idx = vals.narrow(dim, 0, k), idx.narrow(dim, 0, k)
    return vals, idx


def _by_value_then_index(vals: torch.Tensor, idx: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(vals, idx)`` reordered by value descending, ties by index ascending (sort by index, then
    stably by value)."""
    order = idx.argsort(dim=dim)
    idx, vals = idx.gather(dim, order), vals.gather(dim, order)
    order = vals.argsort(dim=dim, descending=True, stable=True)
    return vals.gather(dim, order), idx.gather(dim, order)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of every row: the index of the first maximum along the last dim, as
    ``logits.argmax(-1)`` (NaN counts as the maximum in both).

    ``max``'s reduction gives the same index and is several times faster than ``argmax`` on bf16 CPU
    logits (issue 27, on the AMX machine, one thread: 0.56 against 2.7 ms over [16, 49152]), which a
    verification step pays on every tree.

    Args:
        logits: float [..., V] (any float dtype, any device).

    Returns:
        int64 [...]: the greedy ids.
    """
    return logits.max(dim=-1).indices


def as_float32(values: Sequence[float]) -> list[float]:
    """``values`` rounded to float32 (as a :class:`decoding.tree.DraftTree` stores scores), as
    Python floats: a ranking on these equals a ranking on the stored tree's ``scores``."""
    return torch.tensor([float(v) for v in values], dtype=torch.float32).tolist() if len(values) else []


def node_order(scores: Sequence[float], depths: Sequence[int], canonical: Sequence[int] | None = None) -> list[int]:
    """Non-root node indices (1..N−1), best first by the tree-node rule (module doc).

    Args:
        scores: [N] node scores (higher is better; node 0, the root, is ignored), compared as float32.
        depths: [N] node depths.
        canonical: [N] each node's position in canonical tree order (default: its index, for a tree
            already in canonical order).

    Returns:
        The N − 1 non-root indices, best first.
    """
    n = len(depths)
    sc = as_float32(scores)
    pos = list(range(n)) if canonical is None else list(canonical)
    return sorted(range(1, n), key=lambda i: (-sc[i], depths[i], pos[i]))
