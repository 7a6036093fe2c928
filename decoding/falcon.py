"""Falcon drafting: the custom decoding tree and the batched semi-autoregressive drafter.

METHODS.md §1.1 (inference alignment), §1.2 (relaxed mask at drafting time), §1.5 (tree).

**Tree template** (:class:`FalconTreeTemplate`, data from ``heads.decoding.tree``): a static tree
of *ranks*.  A node is a path (a_1..a_d) of ranks; the depth-d node is the a_d-th most likely token
of slot (d−1) mod k of the block whose outputs produce depth d: the block created by the node's
depth-k⌊(d−1)/k⌋ ancestor (the root block when that depth is 0).  So the slot-1 nodes of a block
share one distribution across all their slot-0 siblings.  The tree is truncated at depth m·k
(m = ``passes``, the drafter forwards per step incl. the context pass).  Given as exactly one of

* ``node_children``: ``{path: n_children}``, path = comma-separated ranks (``"root"`` or ``""``
  for the root, ``"0"``, ``"0,1"``, ...); a node's children take ranks 0..n−1;
* ``depth_children``: ``[c_1, c_2, ...]``, every depth-(d−1) node gets c_d children;
* ``paths``: explicit rank paths ``[[0], [1], [0, 0], ...]`` (missing prefixes are added).

**Drafter** (:class:`FalconDrafter`, the ``decoding.speculative.Drafter`` protocol).  Slot t holds
(f_t, x_{t+1}) at RoPE position t.  With tokens x_0..x_n (x_n = the root, the bonus token) and
true features f_0..f_{n−1}:

1. *Context pass* (pass 0): the last k slots [n−k..n−1] are the **root block** (one fully
   visible block, §1.2 Rec.); all earlier slots form k-blocks aligned to it, block-causal (the
   training mask of §1.2, shifted so that a block ends at n−1).  The root block's k outputs
   f̂_n..f̂_{n+k−1} give depths 1..k.  Only the slots not cached yet are run, in one forward.
2. *Tree pass* j = 1..m−1: every depth-jk node with descendants becomes a block of k slots
   (f̂ of its producing block, the tokens at depths (j−1)k+1..jk on its path) at positions
   n−k+jk..n+jk−1.  All of a pass's blocks go through **one** forward with a 4-D mask: each block
   sees the true-feature slots, its ancestor blocks and all of its own members.
3. The KV of tree passes is dropped after drafting: the cache keeps only positions computed from
   true features (minus the root block, recomputed next step as part of the new chunk).

So one step costs ≤ m drafter forwards and proposes up to k tokens per block per forward (k = 1 is
the EAGLE-1-style tree drafter, one token per block per forward).

**Cached state depends only on the committed context** (issue 12; METHODS §1.1, §1.2).  The
block alignment is set by n mod k, which changes with every step's acceptance length.  A slot's
KV at layers >= 1 depends on which later slots share its block, so a slot computed under one
alignment is invalid under another (issue 12 measured layer-1 keys off by up to 6.5 on the tiny
base, k = 2).  We **recompute what the alignment changes**: the drafter keeps one KV cache per
alignment r = n mod k (k caches; one for k = 1, EAGLE's single cache).  Cache r holds slots
[0, c_r) computed with blocks that end at positions ≡ r − 1 (mod k); c_r ≡ r (mod k) is a block
boundary and every cached block was complete (committed) when it was computed, so each cached
slot equals what one fresh forward over the committed context computes.  A step with n ≡ r
extends cache r by the slots [c_r, n) in its context pass.  So the tree is a function of the
committed tokens x_0..x_n and features f_0..f_{n−1} alone (tested: cached drafter == fresh drafter
at every step).  The alignment is the one METHODS prescribes: the root block is the last k
context slots, and every context block has the training mask's shape (§1.2, blocks aligned at 0)
up to a shift of positions, which RoPE attention does not see; only the first block
[0, n mod k) is partial.  Cost: each slot runs through the decoder layers at most once per
alignment (at most k times per committed token instead of once; the LM head still reads only the
last k slots), and the context pass stays one forward per step.  The other option, a training
mask whose cached states stay valid under any alignment, would change Falcon's objective (§1.2);
we keep §1.2's mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from decoding.masks import additive_mask
from decoding.ranking import as_float32, topk_stable


# ---------------------------------------------------------------------------------------------
# Tree template
# ---------------------------------------------------------------------------------------------
def _parse_path(key: Any) -> tuple[int, ...]:
    if isinstance(key, (list, tuple)):
        return tuple(int(x) for x in key)
    s = str(key).strip()
    if s in ("", "root"):
        return ()
    try:
        return tuple(int(x) for x in s.split(","))
    except ValueError:
        raise ValueError(f"heads.decoding.tree.node_children: key {key!r} is not a comma-separated rank path") from None


@dataclass
class FalconTreeTemplate:
    """A static rank tree in canonical order (root first, then by (depth, rank path)).

    Attributes:
        paths: list of rank tuples; ``paths[0] == ()`` is the root.
        parents: list[int], ``parents[0] = -1``.
        depths: list[int].
        ranks: list[int], the node's rank in its producing distribution (root: -1).
        block_size: k.
    """

    paths: list[tuple[int, ...]]
    parents: list[int]
    depths: list[int]
    ranks: list[int]
    block_size: int

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], block_size: int, max_depth: int | None = None) -> "FalconTreeTemplate":
        """Build from rank paths (prefix closure added, duplicates merged, truncated at ``max_depth``).

        Raises:
            ValueError: a negative rank, or block_size < 1.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        closed: set[tuple[int, ...]] = {()}
        for p in paths:
            p = tuple(int(x) for x in p)
            if any(x < 0 for x in p):
                raise ValueError(f"heads.decoding.tree: negative rank in path {list(p)}")
            if max_depth is not None:
                p = p[:max_depth]
            for d in range(1, len(p) + 1):
                closed.add(p[:d])
        ordered = sorted(closed, key=lambda q: (len(q), q))
        index = {p: i for i, p in enumerate(ordered)}
        parents = [-1] + [index[p[:-1]] for p in ordered[1:]]
        return cls(paths=ordered, parents=parents, depths=[len(p) for p in ordered],
                   ranks=[-1] + [p[-1] for p in ordered[1:]], block_size=block_size)

    @classmethod
    def from_config(cls, tree_cfg: dict[str, Any], block_size: int, passes: int) -> "FalconTreeTemplate":
        """Build from the ``heads.decoding.tree`` section, truncated at depth ``passes·block_size``.

        Raises:
            ValueError: not exactly one of ``node_children`` / ``depth_children`` / ``paths`` set,
                or a malformed entry (the message names the key).
        """
        given = {k: v for k, v in (tree_cfg or {}).items() if v is not None and k in ("node_children", "depth_children", "paths")}
        if len(given) != 1:
            raise ValueError("heads.decoding.tree: set exactly one of node_children, depth_children, paths "
                             f"(got {sorted(given) or 'none'})")
        max_depth = passes * block_size
        kind, spec = next(iter(given.items()))
        paths: list[tuple[int, ...]] = []
        if kind == "paths":
            paths = [tuple(int(x) for x in p) for p in spec]
        elif kind == "depth_children":
            frontier: list[tuple[int, ...]] = [()]
            for d, c in enumerate(spec, start=1):
                if int(c) < 0:
                    raise ValueError(f"heads.decoding.tree.depth_children[{d - 1}] = {c} must be >= 0")
                if d > max_depth:
                    break
                frontier = [p + (r,) for p in frontier for r in range(int(c))]
                paths.extend(frontier)
        else:
            children = {}
            for key, n in dict(spec).items():
                if int(n) < 0:
                    raise ValueError(f"heads.decoding.tree.node_children[{key!r}] = {n} must be >= 0")
                children[_parse_path(key)] = int(n)
            stack: list[tuple[int, ...]] = [()]
            while stack:
                p = stack.pop()
                if len(p) >= max_depth:
                    continue
                for r in range(children.get(p, 0)):
                    paths.append(p + (r,))
                    stack.append(p + (r,))
            # a key no parent's children reach (root: 2 gives ranks 0 and 1, so '5' is none of them) would be
            # ignored silently; keys past the depth cap are cut, as documented
            made = set(paths)
            unreachable = [k for k in children if k and len(k) <= max_depth and k not in made]
            if unreachable:
                raise ValueError(f"heads.decoding.tree.node_children: paths {unreachable} are not reachable from the root "
                                 "(a node's children are ranks 0 .. n-1 of its entry)")
        return cls.from_paths(paths, block_size, max_depth=max_depth)

    # -- derived structure --------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def top_k(self) -> int:
        """How many candidates each slot distribution needs: max rank + 1."""
        return max(self.ranks) + 1 if self.num_nodes > 1 else 1

    def ancestor_at_depth(self, node: int, depth: int) -> int:
        while self.depths[node] > depth:
            node = self.parents[node]
        return node

    def anchor(self, node: int) -> int:
        """The node whose block produces ``node``'s distribution: its depth-k⌊(d−1)/k⌋ ancestor."""
        d = self.depths[node]
        return self.ancestor_at_depth(node, self.block_size * ((d - 1) // self.block_size))

    def slot(self, node: int) -> int:
        """The slot (d−1) mod k of the producing block."""
        return (self.depths[node] - 1) % self.block_size

    def pass_of(self, node: int) -> int:
        """0-based drafter pass producing ``node`` (⌈d/k⌉ − 1)."""
        return (self.depths[node] - 1) // self.block_size

    def block_creators(self) -> list[list[int]]:
        """Per tree pass j = 1.. : the depth-jk nodes that have descendants (each makes one block)."""
        k = self.block_size
        has_child = [False] * self.num_nodes
        for p in self.parents[1:]:
            has_child[p] = True
        out: list[list[int]] = []
        for j in range(1, self.max_depth // k + 1):
            creators = [u for u in range(1, self.num_nodes) if self.depths[u] == j * k and has_child[u]]
            if not creators:
                break
            out.append(creators)
        return out

    def num_passes(self) -> int:
        """Drafter forwards per step: the context pass plus the non-empty tree passes."""
        return 1 + len(self.block_creators())


# ---------------------------------------------------------------------------------------------
# Drafter KV store
# ---------------------------------------------------------------------------------------------
class DraftKVCache:
    """A minimal append-and-crop KV store for the drafter's decoder layers.

    It implements the one method transformers' attention calls, ``update(key, value,
    layer_idx, ...)``: key/value [B, KVH, Q, hd] are appended per layer and the full [B, KVH, S, hd]
    are returned.  :meth:`crop` keeps the first ``length`` positions of every layer.
    """

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx in self.keys:
            key = torch.cat([self.keys[layer_idx], key], dim=-2)
            value = torch.cat([self.values[layer_idx], value], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = key, value
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.keys[layer_idx].shape[-2]) if layer_idx in self.keys else 0

    def crop(self, length: int) -> None:
        for d in (self.keys, self.values):
            for i in list(d):
                d[i] = d[i][..., :length, :]


# ---------------------------------------------------------------------------------------------
# Drafter
# ---------------------------------------------------------------------------------------------
class CommittedFeatures:
    """The committed context a feature-level drafter keeps between steps (Falcon, EAGLE-3):
    ``tokens`` (list of ids) and ``feats`` [T, F] one base feature row per committed token, in the
    head's compute dtype on its device.  A subclass defines ``reset()`` (which must clear both),
    ``_device`` and, if its feature width is fixed, :meth:`_check_start`."""

    def _check_start(self, prompt_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """Raises ValueError unless ``hidden`` is [T, F] with T = len(prompt_ids)."""
        if hidden.dim() != 2 or hidden.shape[0] != prompt_ids.numel():
            raise ValueError(f"start: hidden {tuple(hidden.shape)} does not match prompt length {prompt_ids.numel()}")

    def start(self, prompt_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """After prefill: prompt_ids [T] long, hidden [T, F] their features (the drafter resets)."""
        prompt_ids = torch.as_tensor(prompt_ids).reshape(-1)
        self._check_start(prompt_ids, hidden)
        self.reset()
        self.tokens = [int(x) for x in prompt_ids.tolist()]
        self.feats = hidden.detach().to(self._device, self.head.compute_dtype)

    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """After verification: tokens [A+1] (root + accepted), hidden [A+1, F] their features.

        Raises:
            ValueError: ``hidden`` has another row count than ``tokens``.
        """
        tokens = torch.as_tensor(tokens).reshape(-1)
        if hidden.shape[0] != tokens.numel():
            raise ValueError(f"accept: {tokens.numel()} tokens but hidden {tuple(hidden.shape)}")
        self.tokens.extend(int(x) for x in tokens.tolist())
        self.feats = torch.cat([self.feats, hidden.detach().to(self.feats.device, self.feats.dtype)], dim=0)


class FalconDrafter(CommittedFeatures):
    """Falcon's tree drafter for :class:`decoding.speculative.SpeculativeDecoder` (see module doc).

    Args:
        head: a :class:`heads.falcon.FalconHead` with the base attached.
        passes: drafter forwards per step m (default: ``head.cfg["decoding"]["passes"]``).
        tree: a tree section dict (default: ``head.cfg["decoding"]["tree"]``).

    Attributes:
        template: the :class:`FalconTreeTemplate`.
        caches: ``{r: DraftKVCache}``, one per block alignment r = n mod k (see module doc);
            the first ``kv_lens[r]`` slots of cache r are valid context slots.
        last_passes: drafter forwards of the last :meth:`draft`; ``total_passes``, ``steps`` totals;
            ``context_slots``: context slots run through the decoder layers in total (each slot at
            most once per alignment).
    """

    def __init__(self, head, passes: int | None = None, tree: dict | None = None) -> None:
        self.head = head.eval()  # inference: no dropout (LSTM fuse)
        self.k = head.k
        dec = head.cfg["decoding"]
        self.passes = int(passes if passes is not None else dec["passes"])
        self.template = FalconTreeTemplate.from_config(tree if tree is not None else dec["tree"], self.k, self.passes)
        if self.template.top_k > head.num_draft_tokens:
            raise ValueError(f"the Falcon tree needs top-{self.template.top_k} candidates; the draft vocabulary has "
                             f"{head.num_draft_tokens}")
        t = self.template
        self._anchor = [0] + [t.anchor(u) for u in range(1, t.num_nodes)]
        self._slot = [0] + [t.slot(u) for u in range(1, t.num_nodes)]
        self._creators = t.block_creators()
        # per pass j: the nodes it produces (depths jk+1..(j+1)k), so a pass visits only its own
        self._pass_nodes = [[u for u in range(1, t.num_nodes) if t.pass_of(u) == j] for j in range(self.passes)]
        self.reset()

    # -- protocol --------------------------------------------------------------------------------
    def reset(self) -> None:
        self.tokens: list[int] = []
        self.feats: torch.Tensor | None = None
        self.caches: dict[int, DraftKVCache] = {r: DraftKVCache() for r in range(self.k)}
        self.kv_lens: dict[int, int] = {r: 0 for r in range(self.k)}
        self.context_slots = 0
        self.last_passes = 0
        self.total_passes = 0
        self.steps = 0

    @property
    def _device(self) -> torch.device:
        return self.head.layers[0].mlp.down_proj.weight.device

    @torch.no_grad()
    def draft(self, root_token: int, max_depth: int | None = None, max_nodes: int | None = None):
        """Draft a :class:`decoding.tree.DraftTree` rooted at ``root_token`` (= x_n).

        Args:
            root_token: x_n.
            max_depth: only depths ≤ this are verified (the remaining token budget): the template
                is cut there and no pass beyond it runs (0: the root alone, no pass).
            max_nodes: only the tree's best ``max_nodes`` nodes (root incl.; the dynamic budget
                n*, :class:`decoding.tree_search.ScoreBudgetDrafter`) are kept: a tree pass runs only
                if one of its block creators can still have a child among them (fewer than
                ``max_nodes`` − 2 drafted nodes score above it), and ``max_nodes`` = 1 runs none.

        Passes not run are not counted (``drafter_passes``, ``last_passes``); the nodes they would
        produce are left out of the tree.
        """
        from decoding.tree import DraftTree

        if self.feats is None:
            raise RuntimeError("FalconDrafter.draft called before start()")
        head, k, t = self.head, self.k, self.template
        n = len(self.tokens)
        if self.feats.shape[0] != n:
            raise RuntimeError(f"drafter state out of sync: {n} tokens, {self.feats.shape[0]} features")
        self.steps += 1
        budget = None if max_nodes is None else int(max_nodes) - 1  # draft nodes the tree keeps
        if n < k or t.num_nodes == 1 or (max_depth is not None and max_depth < 1) or (budget is not None and budget < 1):
            self.last_passes = 0
            return DraftTree.from_parents([int(root_token)], [-1], drafter_passes=0)
        dev, dtype = self._device, head.compute_dtype
        toks = torch.tensor(self.tokens[1:] + [int(root_token)], dtype=torch.long, device=dev)  # x_{t+1} per slot t

        # pass 0: context slots [c, n) with the root block [n−k, n) fully visible, on the cache of
        # this step's block alignment (its slots were computed with the same blocks: module doc)
        align = n % k
        cache = self.caches[align]
        c = min(self.kv_lens[align], n - k)
        cache.crop(c)
        self.context_slots += n - c
        pos = torch.arange(c, n, device=dev)
        blk = torch.div(pos - n, k, rounding_mode="floor")
        vis = torch.cat([torch.ones(n - c, c, dtype=torch.bool, device=dev), blk[None, :] <= blk[:, None]], dim=1)
        out = head(self.feats[c:n][None], toks[c:n][None], pos[None], additive_mask(vis, dtype)[None, None], cache=cache)
        passes = 1
        K = t.top_k
        block_feats: dict[int, torch.Tensor] = {0: out[0, -k:]}
        lp = torch.log_softmax(head.draft_lm_head(out[0, -k:]).float(), dim=-1)  # [k, N]: draft vocabulary
        top_lp, top_id = topk_stable(lp, K)  # ties to the lower id, the same ranks at every K
        top_id = head.to_base_ids(top_id)  # d2t: draft index → base id
        # candidates as Python lists ([slot][rank]): the tree is assembled in Python, and one
        # tolist() per pass replaces a tensor element read per node
        block_top: dict[int, tuple[list, list]] = {0: (top_lp.tolist(), top_id.tolist())}
        block_range: dict[int, tuple[int, int]] = {}
        block_anc: dict[int, list[int]] = {0: []}

        N = t.num_nodes
        node_tok = [int(root_token)] + [0] * (N - 1)
        node_score = [0.0] * N

        def assign(j: int) -> None:  # the nodes of pass j (depths jk+1..(j+1)k), parents first
            for u in self._pass_nodes[j]:
                vals, ids = block_top[self._anchor[u]]
                s, r = self._slot[u], t.ranks[u]
                node_tok[u] = ids[s][r]
                node_score[u] = node_score[t.parents[u]] + vals[s][r]

        assign(0)
        for j, creators in enumerate(self._creators, start=1):
            if max_depth is not None and j * k + 1 > max_depth:
                break  # pass j produces depths jk+1..(j+1)k: none would be verified
            if budget is not None and not self._can_enter(creators, [u for q in self._pass_nodes[:j] for u in q],
                                                          node_score, t.depths, budget):
                break  # no child of this pass (nor of a later one) can be among the best max_nodes
            base_len = cache.get_seq_length()
            nb = len(creators)
            feats = torch.stack([block_feats[t.anchor(u)] for u in creators])  # [nb, k, H]
            b_toks = []
            for u in creators:
                path = []
                v = u
                for _ in range(k):
                    path.append(node_tok[v])
                    v = t.parents[v]
                b_toks.append(path[::-1])
            b_toks_t = torch.tensor(b_toks, dtype=torch.long, device=dev)
            Q = nb * k
            vis = torch.zeros(Q, base_len + Q, dtype=torch.bool, device=dev)
            vis[:, :n] = True
            for b, u in enumerate(creators):
                rows = slice(b * k, (b + 1) * k)
                anc = block_anc[t.anchor(u)] + ([t.anchor(u)] if t.anchor(u) != 0 else [])
                block_anc[u] = anc
                for a in anc:
                    s0, s1 = block_range[a]
                    vis[rows, s0:s1] = True
                vis[rows, base_len + b * k: base_len + (b + 1) * k] = True
                block_range[u] = (base_len + b * k, base_len + (b + 1) * k)
            p = (n - k + j * k + torch.arange(k, device=dev)).repeat(nb)
            o = head(feats.reshape(1, Q, -1), b_toks_t.reshape(1, Q), p[None],
                     additive_mask(vis, dtype)[None, None], cache=cache)[0].view(nb, k, -1)
            passes += 1
            lp = torch.log_softmax(head.draft_lm_head(o).float(), dim=-1)
            top_lp, top_id = topk_stable(lp, K)
            top_lp, top_id = top_lp.tolist(), head.to_base_ids(top_id).tolist()
            for b, u in enumerate(creators):
                block_feats[u] = o[b]
                block_top[u] = (top_lp[b], top_id[b])
            assign(j)
        # keep only slots computed from true features, and of those only the complete blocks: the
        # root block [n−k, n) is recomputed by the next step of this alignment, as an inner block
        cache.crop(n - k)
        self.kv_lens[align] = n - k
        self.last_passes = passes
        self.total_passes += passes
        deepest = passes * k if max_depth is None else min(passes * k, int(max_depth))
        m = sum(1 for d in t.depths if d <= deepest)  # template nodes are depth-sorted: the drafted prefix
        return DraftTree.from_parents(node_tok[:m], t.parents[:m], scores=node_score[:m], drafter_passes=passes)

    @staticmethod
    def _can_enter(creators: list[int], drafted: list[int], score: list[float], depths: list[int], budget: int) -> bool:
        """Whether a child of one of ``creators`` can be among the ``budget`` best draft nodes
        (:func:`decoding.ranking.node_order`): a child ranks below its creator and below every
        node that ranks above the creator, so it can enter only when fewer than ``budget`` − 1
        of the ``drafted`` nodes rank above some creator: score strictly above, or the same score at
        a smaller depth (a lower bound on the creator's rank: a tie at the same depth is counted as
        not above, so a pass is never skipped that could contribute)."""
        sc = as_float32([score[u] for u in drafted])
        dep = [depths[u] for u in drafted]
        for c, dc in zip(as_float32([score[u] for u in creators]), [depths[u] for u in creators]):
            if sum(1 for v, dv in zip(sc, dep) if v > c or (v == c and dv < dc)) < budget - 1:
                return True
        return False
