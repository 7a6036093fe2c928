"""EAGLE-3 drafting with an EAGLE-2 dynamic tree (arXiv 2406.16858 §4; EAGLE ``cnets.py``
``Model.topK_genrate``).

The :class:`Eagle3Drafter` implements the ``decoding.speculative.Drafter`` protocol.  It asks the
runtime for the base's hidden states hs[ℓ] at the head's three feature layers through its
``feature_layers`` attribute (``start``/``accept`` then receive them concatenated, [n, 3H]).

With tokens x_0..x_n (x_n = the root, the bonus token) and true features f_0..f_{n−1}:

1. *Context pass*: the slots s = c..n−1, each (fc(f_s), x_{s+1}) at RoPE position s, run
   causally against the drafter's KV cache of slots 0..c−1 (c = slots cached by earlier steps).
   The output at slot n−1 gives the depth-1 distribution; its top-``topk`` tokens are the
   depth-1 nodes, scored by their log-probability.
2. *Expansion* (EAGLE-2): for depth d = 1..depth−1, the ``topk`` depth-d nodes with the highest
   cumulative log-probability are expanded in one forward: node u becomes a slot (h_parent(u),
   token(u)) at position n−1+d, where h_parent(u) is the pre-norm output of the slot that
   produced u's distribution (EAGLE-3 feeds its own hidden state forward, no fc); it sees the
   true slots 0..n−1, its ancestors' slots and itself.  Each yields ``topk`` children
   (cumulative score = parent score + log p).
3. *Reranking*: the ``total_tokens`` draft nodes with the highest cumulative score (ties: smaller
   depth; ancestor-closed since scores fall along a path) form the tree
   (``DraftTree.from_parents(max_nodes=total_tokens + 1)``).
4. The KV of expansion slots and of slot n−1 (which holds the root) is dropped: the cache keeps
   only slots built from committed tokens and features (0..n−2), so ``draft`` may be called again
   with another root; slot n−1 is recomputed with the next context pass.

Draft indices map to base token ids through the head's ``d2t`` (:meth:`heads.base.DraftHead.to_base_ids`).  One step costs ``depth`` drafter
forwards (the context pass plus depth−1 expansions).
"""
from __future__ import annotations

import torch

from decoding.falcon import CommittedFeatures, DraftKVCache
from decoding.masks import additive_mask
from decoding.ranking import as_float32, topk_stable


class Eagle3Drafter(CommittedFeatures):
    """EAGLE-3 tree drafter (module docstring).

    Args:
        head: a :class:`heads.eagle3.Eagle3Head` with the base attached.
        depth: maximum draft depth (≥ 1); EAGLE's ``depth=7`` expansion steps ≙ depth 8 here.
        topk: children per expanded node and nodes expanded per depth (EAGLE's ``top_k``).
        total_tokens: draft nodes kept after reranking (EAGLE's ``total_token``, root excluded).

    Raises:
        ValueError: a parameter < 1.
    """

    def __init__(self, head, depth: int = 8, topk: int = 10, total_tokens: int = 60) -> None:
        for name, v in (("depth", depth), ("topk", topk), ("total_tokens", total_tokens)):
            if int(v) < 1:
                raise ValueError(f"eagle3 decoding.{name} must be >= 1, got {v}")
        self.head = head.eval()
        self.depth, self.topk, self.total_tokens = int(depth), int(topk), int(total_tokens)
        self.feature_layers = list(head.feature_layers)
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.feats: torch.Tensor | None = None
        self.cache = DraftKVCache()
        self.kv_len = 0
        self.last_passes = 0

    @property
    def _device(self) -> torch.device:
        return self.head.fc.weight.device

    def _check_start(self, prompt_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """``hidden`` must be [T, 3H]: hs at the feature layers, concatenated (start/accept are
        :class:`decoding.falcon.CommittedFeatures`')."""
        if hidden.dim() != 2 or hidden.shape[0] != prompt_ids.numel() or hidden.shape[1] != 3 * self.head.hidden_size:
            raise ValueError(f"start: hidden {tuple(hidden.shape)} is not [{prompt_ids.numel()}, 3·{self.head.hidden_size}] "
                             f"(the runtime must pass hs{self.feature_layers})")

    def _topk(self, h: torch.Tensor, nodes: list[int]):
        """Top-``topk`` of the next-token distribution of each expanded node.

        Args:
            h: [K, H] the expanded slots' outputs.  nodes: the K node ids (0 = root); their token
                paths are in ``self._node_tok`` / ``self._parents`` (a seam for reference
                distributions in tests; unused here).

        Returns:
            ``(log-probs [K, k], target ids [K, k])`` on the CPU.
        """
        lp = torch.log_softmax(self.head.draft_logits(h), dim=-1)
        vals, idx = topk_stable(lp, min(self.topk, lp.shape[-1]))  # ties to the lower id, the same at every topk
        return vals.cpu(), self.head.to_base_ids(idx).cpu()

    @torch.no_grad()
    def draft(self, root_token: int, max_depth: int | None = None, max_nodes: int | None = None):
        """A dynamic :class:`decoding.tree.DraftTree` rooted at ``root_token`` (= x_n).

        The tree keeps the best T = ``total_tokens`` draft nodes (T = min(``total_tokens``,
        ``max_nodes`` − 1) with a node budget), drafted at most ``min(depth, max_depth)`` deep.  An
        expansion pass runs only while one of the nodes it expands can still have a child among
        the best T (fewer than T − 1 drafted nodes score above it; so never deeper than T), and
        none runs for T = 0 or ``max_depth`` = 0: those passes could not change the tree, and are
        neither run nor counted.  Expansion picks the ``topk`` best frontier nodes by
        :func:`decoding.ranking.node_order`'s rule, so the tree at a budget n equals a tree drafted
        at a larger budget cut to its best n nodes.
        """
        from decoding.tree import DraftTree

        if self.feats is None:
            raise RuntimeError("Eagle3Drafter.draft called before start()")
        head = self.head
        n = len(self.tokens)
        if self.feats.shape[0] != n:
            raise RuntimeError(f"drafter state out of sync: {n} tokens, {self.feats.shape[0]} features")
        keep = self.total_tokens if max_nodes is None else min(self.total_tokens, int(max_nodes) - 1)
        depth = self.depth if max_depth is None else min(self.depth, int(max_depth))
        if keep < 1 or depth < 1:  # the root alone: no pass can contribute
            self.last_passes = 0
            return DraftTree.from_parents([int(root_token)], [-1], drafter_passes=0)
        dev, dtype = self._device, head.compute_dtype
        c = min(self.kv_len, n)
        self.cache.crop(c)
        toks = torch.tensor(self.tokens[c + 1:] + [int(root_token)], dtype=torch.long, device=dev)
        pos = torch.arange(c, n, device=dev)
        vis = torch.arange(n, device=dev)[None, :] <= pos[:, None]
        out = head.forward_cached(head.fuse(self.feats[c:n])[None], toks[None], pos[None],
                                  additive_mask(vis, dtype)[None, None], self.cache)[0]
        passes = 1
        # node tables (node 0 = root); candidates are read as Python lists, one tolist() per pass
        node_tok, parents, scores, depth_of = [int(root_token)], [-1], [0.0], [0]
        self._node_tok, self._parents = node_tok, parents
        outs = [out[-1:]]  # outputs of every pass that produced distributions
        producer: list[tuple[int, int] | None] = [None]  # (pass, row) of the pre-norm output that produced the node
        anc_slots: list[list[int]] = [[]]  # cache slots of the node's expanded ancestors (root excluded), and its own
        vals, ids = self._topk(out[-1:], [0])
        vals, ids = vals.tolist(), ids.tolist()
        # canonical position key of each node (decoding.ranking): the sibling ranks from the root,
        # siblings by descending score, ties in the drafter's top-k order (DraftTree.from_paths)
        canon: list[tuple[int, ...]] = [()]
        frontier = []
        for r in range(len(vals[0])):
            node_tok.append(ids[0][r]); parents.append(0); scores.append(vals[0][r]); depth_of.append(1)
            producer.append((0, 0)); anc_slots.append([]); frontier.append(len(node_tok) - 1)
        _rank_children(canon, frontier, scores, ())
        for d in range(1, depth):
            s32 = as_float32(scores)
            chosen = sorted(frontier, key=lambda u: (-s32[u], canon[u]))[: self.topk]
            # a child ranks below its parent and everything above it: unless the best node to expand
            # has fewer than T - 1 drafted nodes above it (node_order's rule), no child can enter
            best = (-s32[chosen[0]], d, canon[chosen[0]])
            if sum(1 for v in range(1, len(s32)) if (-s32[v], depth_of[v], canon[v]) < best) >= keep - 1:
                break
            K = len(chosen)
            base_len = self.cache.get_seq_length()
            rows, cols = [], []
            for b, u in enumerate(chosen):
                slot = base_len + b
                anc_slots[u] = anc_slots[parents[u]] + [slot]  # the parent was expanded at depth d − 1
                rows.extend([b] * len(anc_slots[u]))
                cols.extend(anc_slots[u])
            vis = torch.zeros(K, base_len + K, dtype=torch.bool, device=dev)
            vis[:, :n] = True
            vis[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = True
            feats = torch.stack([outs[producer[u][0]][producer[u][1]] for u in chosen])[None]
            t = torch.tensor([node_tok[u] for u in chosen], dtype=torch.long, device=dev)[None]
            p = torch.full((1, K), n - 1 + d, dtype=torch.long, device=dev)
            o = head.forward_cached(feats, t, p, additive_mask(vis, dtype)[None, None], self.cache)[0]
            passes += 1
            outs.append(o)
            vals, ids = self._topk(o, chosen)
            vals, ids = vals.tolist(), ids.tolist()
            frontier = []
            for b, u in enumerate(chosen):
                su, pr = scores[u], (len(outs) - 1, b)
                kids = []
                for r in range(len(vals[b])):
                    node_tok.append(ids[b][r]); parents.append(u); scores.append(su + vals[b][r])
                    depth_of.append(d + 1); producer.append(pr); anc_slots.append(None); frontier.append(len(node_tok) - 1)
                    kids.append(len(node_tok) - 1)
                _rank_children(canon, kids, scores, canon[u])
        self.cache.crop(n - 1)
        self.kv_len = n - 1
        self.last_passes = passes
        return DraftTree.from_parents(node_tok, parents, scores=scores, max_nodes=keep + 1, drafter_passes=passes)


def _rank_children(canon: list, kids: list[int], scores: list[float], parent_key: tuple[int, ...]) -> None:
    """Append the canonical keys of one node's children (``kids`` in the drafter's top-k order,
    node ids in creation order) to ``canon``: parent key + sibling rank, siblings by descending
    score, ties by creation order (as :meth:`decoding.tree.DraftTree.from_paths` orders them)."""
    order = sorted(kids, key=lambda c: (-scores[c], c))
    rank = {c: r for r, c in enumerate(order)}
    for c in kids:
        canon.append(parent_key + (rank[c],))
