"""CTC-drafter decoding: slot distributions → lossless verification tree (METHODS.md §2.5–§2.6).

One drafter forward yields S slot distributions over V+1 classes (class V = blank).  The tree is
built as METHODS.md §2.6 "Inference" and §2.5 "Rec. (lossless)" prescribe:

1. top-k per slot (``topk[s]`` candidates for slot s, the blank allowed; ties to the lower class
   id, :func:`decoding.ranking.topk_stable`);
2. a *sparse rank-tree*: alignments c_1..c_S (one candidate per slot) are enumerated best-first
   by the product of their slot probabilities (sum of log-probs), without enumerating the full
   Π_s topk[s] lattice;
3. each alignment is CTC-collapsed (merge adjacent repeats, then drop blanks: "a a ε b" → "a b",
   "a ε a" → "a a"); the bonus (root) token is *not* part of the label sequence, so c_1 equal to
   the root is kept;
4. collapsed candidates are merged into a trie (identical candidates and shared prefixes merge;
   a node's score is the best alignment through it) by :meth:`decoding.tree.DraftTree.from_paths`,
   which recomputes depths (hence positions ``P + depth``) and the tree mask from the trie, so no
   spliced-out node leaves a RoPE gap;
5. at most ``max_nodes`` nodes (root included) are kept, the best-scoring ones.

The same :func:`build_ctc_tree` runs in validation (``sim_tau``) and in decoding.
"""
from __future__ import annotations

import heapq
from typing import Sequence

import torch

from decoding.masks import additive_mask
from decoding.ranking import topk_stable
from decoding.tree import DraftTree
from decoding.verify import crop_cache

__all__ = ["ctc_collapse", "best_alignments", "build_ctc_tree", "build_ctc_trees", "accepted_length",
           "expand_topk", "CTCDrafter"]


def ctc_collapse(alignment: Sequence[int], blank: int) -> list[int]:
    """CTC collapse of one alignment: merge adjacent repeats, then drop blanks.

    Args:
        alignment: token ids c_1..c_S (ints; ``blank`` marks the blank class).
        blank: the blank id (V).
    Returns:
        the collapsed token list (may be empty).
    """
    out: list[int] = []
    prev = None
    for c in alignment:
        c = int(c)
        if c != prev and c != blank:
            out.append(c)
        prev = c
    return out


def expand_topk(topk: int | Sequence[int], num_slots: int) -> list[int]:
    """Per-slot top-k list of length S: an int applies to every slot; a shorter list repeats its
    last entry, a longer one is cut to its first S entries (so a sweep over S can keep one
    ``topk``).  Raises ValueError on an empty list or a value < 1."""
    ks = [int(topk)] * num_slots if isinstance(topk, int) else [int(k) for k in topk]
    if not ks or min(ks) < 1:
        raise ValueError(f"topk must be >= 1 per slot, got {topk!r}")
    return (ks + [ks[-1]] * (num_slots - len(ks)))[:num_slots]


def best_alignments(top_logp: list[list[float]], top_ids: list[list[int]]):
    """Yield ``(score, alignment)`` over the per-slot candidate lattice in non-increasing score.

    Best-first search over rank vectors r (r_s = rank of the candidate chosen at slot s); the
    score is Σ_s top_logp[s][r_s] (log of the product of slot probabilities).  Each vector has a
    unique parent (decrement its last non-zero rank), so every alignment is produced once, and
    because candidates are sorted by descending probability a parent never scores below a child.

    Args:
        top_logp: per slot, candidate log-probs sorted descending (lists of floats).
        top_ids: per slot, the matching class ids.
    """
    s = len(top_logp)
    start = (0,) * s
    heap = [(-sum(lp[0] for lp in top_logp), start, 0)]
    while heap:
        neg, ranks, last = heapq.heappop(heap)
        yield -neg, [top_ids[i][ranks[i]] for i in range(s)]
        for i in range(last, s):
            r = ranks[i] + 1
            if r < len(top_logp[i]):
                child = ranks[:i] + (r,) + ranks[i + 1:]
                heapq.heappush(heap, (neg + top_logp[i][ranks[i]] - top_logp[i][r], child, i))


def _tree_from_candidates(root_token: int, top_logp, top_ids, blank: int, max_nodes: int,
                          max_alignments: int) -> DraftTree:
    paths: list[list[int]] = []
    scores: list[float] = []
    seen_nodes: set[tuple[int, ...]] = set()
    cut: float | None = None  # the score at which max_nodes - 1 distinct nodes were first seen
    for n_done, (score, alignment) in enumerate(best_alignments(top_logp, top_ids), start=1):
        if cut is not None and score < cut:
            break
        path = ctc_collapse(alignment, blank)
        if path:
            paths.append(path)
            scores.append(score)
            for d in range(1, len(path) + 1):
                seen_nodes.add(tuple(path[:d]))
        # Alignments arrive best first, so once max_nodes-1 distinct trie nodes are seen nothing
        # that scores lower can enter the capped tree; alignments tied with the cut still can (by
        # depth and canonical order, decoding.ranking), so they are enumerated too: the capped
        # tree is then the best max_nodes of every tree drafted with a larger cap.
        if n_done >= max_alignments:
            break
        if cut is None and len(seen_nodes) >= max_nodes - 1:
            cut = score
    return DraftTree.from_paths(root_token, paths, scores=scores, max_nodes=max_nodes)


def build_ctc_trees(slot_logits: torch.Tensor, root_tokens: Sequence[int], topk: int | Sequence[int],
                    max_nodes: int = 64, max_alignments: int = 4096, d2t: torch.Tensor | None = None) -> list[DraftTree]:
    """Verification trees for a batch of anchors (METHODS.md §2.6 "Inference", §2.5 "Rec.").

    Args:
        slot_logits: [A, S, V+1] slot logits (any float dtype), class V = blank.
        root_tokens: A root (bonus) token ids.
        topk: per-slot candidate counts (int or list, see :func:`expand_topk`).
        max_nodes: cap on tree nodes, root included (>= 1).
        max_alignments: safety cap on enumerated alignments per anchor.
        d2t: with a draft vocabulary, int64 [N] mapping class i < N (of ``slot_logits`` [A, S, N+1])
            to its base token id (:mod:`heads.draft_vocab`); the tree then holds base ids only.
    Returns:
        A :class:`DraftTree` per anchor (root-only when every alignment collapses to nothing).
    """
    if slot_logits.dim() != 3:
        raise ValueError(f"slot_logits must be [A, S, V+1], got {tuple(slot_logits.shape)}")
    a, s, c = slot_logits.shape
    if len(root_tokens) != a:
        raise ValueError(f"{len(root_tokens)} root tokens for {a} anchors")
    ks = expand_topk(topk, s)
    kmax = min(max(ks), c)
    logp = torch.log_softmax(slot_logits.detach().float(), dim=-1)
    vals, ids = topk_stable(logp, kmax, dim=-1)  # [A, S, kmax], sorted descending, ties to the lower id
    blank = c - 1
    if d2t is not None:  # draft index → base id; the blank becomes -1 (no token id is negative)
        if d2t.numel() != c - 1:
            raise ValueError(f"d2t has {d2t.numel()} entries but slot_logits have {c - 1} token classes")
        is_blank = ids == c - 1
        ids = torch.where(is_blank, torch.full_like(ids, -1), d2t.to(ids.device)[ids.clamp(max=c - 2)])
        blank = -1
    vals, ids = vals.cpu().tolist(), ids.cpu().tolist()
    trees = []
    for i in range(a):
        top_logp = [vals[i][j][: ks[j]] for j in range(s)]
        top_ids = [ids[i][j][: ks[j]] for j in range(s)]
        trees.append(_tree_from_candidates(int(root_tokens[i]), top_logp, top_ids, blank, max_nodes, max_alignments))
    return trees


def build_ctc_tree(slot_logits: torch.Tensor, root_token: int, topk, max_nodes: int = 64,
                   max_alignments: int = 4096, d2t: torch.Tensor | None = None) -> DraftTree:
    """One anchor's tree: ``slot_logits`` [S, V+1]; see :func:`build_ctc_trees`."""
    return build_ctc_trees(slot_logits.unsqueeze(0), [root_token], topk, max_nodes, max_alignments, d2t)[0]


def accepted_length(tree: DraftTree, greedy: Sequence[int]) -> int:
    """Greedy acceptance (METHODS.md §4.1) teacher-forced against a known greedy continuation.

    From the root, move to the child whose token equals ``greedy[d]`` at depth d+1, while one
    exists.  Returns the number of accepted draft tokens (excl. root and bonus); the tokens
    emitted by that verification step are this + 1 (the bonus).
    """
    toks = tree.tokens.tolist()
    node, depth = 0, 0
    while depth < len(greedy):
        nxt = next((ch for ch in tree.children(node) if toks[ch] == int(greedy[depth])), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


class CTCDrafter:
    """Decoding-time CTC drafter (the ``decoding.speculative.Drafter`` protocol).

    Keeps its own KV cache (a transformers ``DynamicCache`` for the head's single decoder layer)
    over the fused context pairs u_τ = Linear([Emb(x_{τ+1}); f_τ]) at RoPE position τ, exactly
    as the head was trained (see :mod:`heads.ctc`).  ``draft(root)`` appends the pending pairs
    (the last one pairs the newest feature with the root), runs the S slot queries at positions
    t+1..t+S in one forward (the slots attend to the cache and to each other), removes the slot
    entries from the cache again, and returns :func:`build_ctc_tree`'s tree.

    Args:
        head: a :class:`heads.ctc.CTCHead` with the base attached.
        topk: per-slot candidate counts.  max_nodes: tree cap (root included).
        max_alignments: enumeration safety cap per step.
    """

    def __init__(self, head, topk, max_nodes: int = 64, max_alignments: int = 4096) -> None:
        self.head = head
        self.topk = expand_topk(topk if isinstance(topk, int) else list(topk), head.num_slots)
        self.max_nodes = int(max_nodes)
        self.max_alignments = int(max_alignments)
        if self.max_nodes < 1:
            raise ValueError(f"max_nodes={max_nodes} must be >= 1")
        self.reset()

    def reset(self) -> None:
        """Forget every prompt: empty cache, no pending pairs."""
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self._feats: torch.Tensor | None = None  # [k, H] features not yet paired into the cache
        self._next_tokens: list[int] = []  # the k-1 tokens that follow them (the root completes)

    def _param(self) -> torch.Tensor:
        return next(self.head.parameters())

    def start(self, prompt_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """After prefill: ``prompt_ids`` [T] long, ``hidden`` [T, H] (f_t predicts x_{t+1})."""
        if hidden.shape[0] != prompt_ids.shape[0]:
            raise ValueError(f"prompt has {prompt_ids.shape[0]} tokens but {hidden.shape[0]} features")
        self.reset()
        self._feats = hidden.detach()
        self._next_tokens = [int(t) for t in prompt_ids.reshape(-1)[1:].tolist()]

    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """After verification: root + accepted tokens [A+1] and their features [A+1, H].

        When the step's draft ran no forward (a root-only budget), the pairs still pending from
        before are kept and completed by the root ``tokens[0]``; the next draft runs them all."""
        toks = [int(t) for t in tokens.reshape(-1).tolist()]
        if self._feats is not None:  # nothing drafted since the last accept: extend the pending pairs
            self._feats = torch.cat([self._feats, hidden.detach().to(self._feats.device, self._feats.dtype)])
            self._next_tokens = self._next_tokens + toks
        else:
            self._feats = hidden.detach()
            self._next_tokens = toks[1:]

    @torch.no_grad()
    def draft(self, root_token: int, max_depth: int | None = None, max_nodes: int | None = None) -> DraftTree:
        """Propose the verification tree rooted at ``root_token`` (one slot forward).

        With a root-only budget (``max_nodes`` = 1 — the drafter's own or the one passed — or
        ``max_depth`` = 0) no forward runs and none is counted: the root alone, ``drafter_passes``
        0, and the pending context pairs wait for the next draft.  Otherwise the tree keeps at
        most ``min(self.max_nodes, max_nodes)`` nodes."""
        if self._feats is None:
            raise RuntimeError("CTCDrafter.draft called before start()")
        cap = self.max_nodes if max_nodes is None else min(self.max_nodes, int(max_nodes))
        if cap <= 1 or (max_depth is not None and max_depth < 1):
            return DraftTree([int(root_token)], [-1], [0], drafter_passes=0)
        head = self.head
        p = self._param()
        feats = self._feats.to(device=p.device, dtype=p.dtype)
        nxt = torch.tensor(self._next_tokens + [int(root_token)], dtype=torch.long, device=p.device)
        past = self.cache.get_seq_length()
        k = nxt.numel()
        # 1) extend the context cache with the pending pairs (causal among themselves).
        ctx = head.fuse(nxt, feats).unsqueeze(0)  # [1, k, H]
        pos = torch.arange(past, past + k, device=p.device).unsqueeze(0)
        vis = torch.ones(k, past + k, dtype=torch.bool, device=p.device)
        vis[:, past:] = torch.ones(k, k, dtype=torch.bool, device=p.device).tril()
        head.run_layer(ctx, additive_mask(vis[None, None], ctx.dtype), pos, cache=self.cache)
        self._feats, self._next_tokens = None, []
        # 2) slot queries at t+1..t+S (t = past + k - 1), seeing the whole cache and each other.
        t = past + k - 1
        s = head.num_slots
        q = head.slot_inputs(nxt[-1:], feats[-1:])  # [1, S, H]
        spos = torch.arange(t + 1, t + 1 + s, device=p.device).unsqueeze(0)
        svis = torch.ones(1, 1, s, t + 1 + s, dtype=torch.bool, device=p.device)
        out = head.run_layer(q, additive_mask(svis, q.dtype), spos, cache=self.cache)
        crop_cache(self.cache, t + 1)
        logits = head.slot_logits(out)[0]  # [S, V+1] ([S, N+1] over a draft vocabulary)
        d2t = head.d2t if head.draft_vocab_size is not None else None
        return build_ctc_tree(logits, int(root_token), self.topk, cap, self.max_alignments, d2t)
