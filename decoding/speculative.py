"""The generic greedy speculative-decoding loop and the Drafter / Decoder protocols.

Loop (METHODS.md §0 tree attention, §4.1 greedy verification, §5.1 metrics):

1. prefill the prompt; the argmax at its last position is the first emitted token (the root);
2. ``drafter.draft(root)`` proposes a :class:`decoding.tree.DraftTree` rooted at it;
3. the tree is trimmed to what can still be emitted (:func:`trim_tree`): with R tokens left
   in the ``max_new_tokens`` budget, depths > R − 1 are dropped (accepting R − 1 drafts plus the
   bonus token already fills the budget), and no node goes past the context limit
   (``max_position_embeddings``; prompt + budget beyond it is refused before decoding).  A
   drafter that takes draft limits is told that depth first and runs no pass beyond it
   (:func:`draft_tree`);
4. one base forward verifies the tree (:func:`decoding.verify.verify_tree`); the root and the
   accepted path stay in the KV cache, the accepted tokens and the bonus token are emitted up to
   the first eos;
5. ``drafter.accept(tokens, hidden)`` hands the drafter what entered the cache; the bonus token is
   the next root; repeat until eos or ``max_new_tokens`` (so the output equals
   :func:`decoding.vanilla.greedy_generate` token for token).

τ convention (docs/design.md): tokens emitted per verification forward, bonus token included;
the first token, produced by the prefill exactly as in vanilla decoding, is not counted.  The
statistics count only emitted tokens: a draft accepted by verification but cut by an eos before
it is not counted as accepted, so Σ ``emitted_per_step`` = ``new_tokens`` − 1 =
Σ ``accepted_per_depth`` + (steps whose bonus token was emitted) exactly.
"""
from __future__ import annotations

import time
from typing import Iterable, Protocol, runtime_checkable

import torch

from decoding.margins import top2
from decoding.tree import DraftTree
from decoding.vanilla import check_generate_args, context_limit
from decoding.verify import check_full_attention_cache, prefill, verify_tree


@runtime_checkable
class Drafter(Protocol):
    """A tree drafter driven by :class:`SpeculativeDecoder` (see docs/design.md).

    - ``start(prompt_ids [T] long, hidden [T, H])`` after prefill; ``hidden[t]`` is the base
      model's final post-norm hs[-1] at prompt position t (it predicts token t+1).
    - ``draft(root_token: int) -> DraftTree`` rooted at the last emitted token.  Set the tree's
      ``drafter_passes`` to the drafter forwards spent on this step (including those done in
      ``accept``).
    - ``accept(tokens [A+1] long, hidden [A+1, H])``: the root and accepted draft tokens, now in
      the base cache, with their hs[-1] features.
    - optional ``reset()``: called before ``start`` for every prompt.
    - optional ``feature_layers``: list of hidden-state ids; ``hidden`` in ``start``/``accept`` is
      then [hs[ℓ] for ℓ in feature_layers] concatenated ([n, len·H]) instead of hs[-1].
    - optional draft limits (a ``draft`` that takes the keywords): ``draft(root_token, max_depth=D,
      max_nodes=M)`` (either may be None) — only nodes at depth ≤ D will be verified, and only the
      tree's best M nodes (root incl., :func:`decoding.ranking.node_order`) will be kept.  The
      drafter then runs no pass that could only produce nodes outside these limits, and does not
      count it in ``drafter_passes``: it drafts as it would with its depth capped at D (nodes it
      returns deeper than D are trimmed), and may leave out nodes that cannot be among the best M
      (:func:`draft_tree`).
    """

    def start(self, prompt_ids: torch.Tensor, hidden: torch.Tensor) -> None: ...

    def draft(self, root_token: int) -> DraftTree: ...

    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None: ...


@runtime_checkable
class Decoder(Protocol):
    """Anything that decodes one prompt greedily and losslessly, e.g. AdaDecode's layer-skipping
    decoder.  ``generate(prompt_ids [T] long, max_new_tokens) -> (tokens: list[int], stats: dict)``;
    ``tokens`` excludes the prompt and includes a final eos if one was emitted; ``stats`` maps
    names to numbers (or lists of numbers)."""

    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], dict]: ...


def takes_draft_limits(drafter) -> bool:
    """Whether ``drafter.draft`` takes the ``max_depth`` / ``max_nodes`` keywords (:class:`Drafter`)."""
    import inspect

    try:
        params = inspect.signature(drafter.draft).parameters
    except (TypeError, ValueError):
        return False
    return "max_depth" in params and "max_nodes" in params


def draft_tree(drafter, root_token: int, max_depth: int | None = None, max_nodes: int | None = None,
               takes_limits: bool | None = None) -> DraftTree:
    """``drafter.draft(root_token)`` with the draft limits passed when the drafter takes them
    (:func:`takes_draft_limits`, or ``takes_limits`` when the caller knows), so that passes whose
    nodes the tree cannot use (beyond the remaining token budget, outside a node budget) are
    neither run nor counted."""
    if takes_limits is None:
        takes_limits = takes_draft_limits(drafter)
    if takes_limits:
        return drafter.draft(root_token, max_depth=max_depth, max_nodes=max_nodes)
    return drafter.draft(root_token)


class SpeculativeDecoder:
    """Greedy speculative decoding with a tree :class:`Drafter` on a frozen HF base model.

    Args:
        base_model: the frozen HF causal LM (batch size 1; ``DynamicCache``).
        drafter: a :class:`Drafter`.
        eos_token_ids: stop after emitting any of these (the eos is part of the output).

    ``generate`` returns ``(tokens, stats)`` with stats:
    ``new_tokens``; ``prefill_forwards`` (1); ``base_forwards`` (verification forwards);
    ``steps`` (= base_forwards); ``emitted_per_step`` (list, tokens each step emitted, bonus
    included, up to the first eos); ``proposed_per_depth[d-1]`` (steps whose verified, trimmed
    tree reached depth d); ``reached_per_depth[d-1]`` (steps whose tree reached depth d and whose
    depths < d were all accepted and emitted without an eos among them);
    ``accepted_per_depth[d-1]`` (steps that accepted **and emitted** a depth-d token);
    ``tree_nodes`` (total draft nodes verified, root excluded, after trimming);
    ``drafter_passes``; ``drafter_seconds``; ``verify_seconds``; ``seconds`` (wall clock incl.
    prefill).  With e tokens emitted by a step that verification accepted A drafts on, the step
    counts min(A, e) accepted depths and min(A + 1, e) reached depths.

    Raises:
        TypeError: ``drafter`` lacks ``start``/``draft``/``accept``.
        ValueError: a base whose KV cache is not full attention (:func:`decoding.verify.check_full_attention_cache`);
            a drafted tree's root is not the last emitted token; prompt length +
            ``max_new_tokens`` beyond the base's ``max_position_embeddings`` (raised before decoding).
    """

    def __init__(self, base_model, drafter, eos_token_ids: Iterable[int] = ()) -> None:
        if not isinstance(drafter, Drafter):
            raise TypeError(f"{type(drafter).__name__} does not implement start/draft/accept (decoding.speculative.Drafter)")
        check_full_attention_cache(base_model)
        self.base_model = base_model
        self.drafter = drafter
        self.eos_token_ids = [int(e) for e in eos_token_ids]
        # low-precision parity accounting (decoding.margins): per emitted token, the top-2 logits of
        # the verification row that chose it, kept in ``last_trace`` after ``generate``
        self.trace_logits = False
        self.last_trace: list | None = None

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], dict]:
        """Decode one prompt; see the class docstring for the stats."""
        prompt_ids = check_generate_args(prompt_ids, max_new_tokens, self.base_model)
        limit = context_limit(self.base_model)
        eos = set(self.eos_token_ids)
        drafter = self.drafter
        stats = {"prefill_forwards": 1, "base_forwards": 0, "steps": 0, "emitted_per_step": [],
                 "proposed_per_depth": [], "reached_per_depth": [], "accepted_per_depth": [],
                 "tree_nodes": 0, "drafter_passes": 0, "drafter_seconds": 0.0, "verify_seconds": 0.0}

        def grow(d: int) -> None:
            for key in ("proposed_per_depth", "reached_per_depth", "accepted_per_depth"):
                while len(stats[key]) < d:
                    stats[key].append(0)

        t0 = time.perf_counter()
        layers = getattr(drafter, "feature_layers", None)  # passed only when set: verify_tree/prefill keep their plain signature otherwise
        cache, root, hidden = prefill(self.base_model, prompt_ids, **({"layers": layers} if layers else {}))
        out = [root]
        trace = [None] if self.trace_logits else None  # the first token: the prefill's, as vanilla's
        td = time.perf_counter()
        if hasattr(drafter, "reset"):
            drafter.reset()
        drafter.start(prompt_ids, hidden)
        limits = takes_draft_limits(drafter)
        stats["drafter_seconds"] += time.perf_counter() - td
        while root not in eos and len(out) < max_new_tokens:
            # the root sits at position P = cache length; depth d at P + d.  R = max_new_tokens −
            # len(out) tokens remain: a depth-(R−1) draft plus its bonus token fill the budget.
            past = cache.get_seq_length()
            max_depth = max_new_tokens - len(out) - 1
            if limit is not None:
                max_depth = min(max_depth, limit - 1 - past)
            td = time.perf_counter()
            tree = draft_tree(drafter, root, max_depth=max_depth, takes_limits=limits)
            stats["drafter_seconds"] += time.perf_counter() - td
            if not isinstance(tree, DraftTree):
                raise TypeError(f"drafter.draft returned {type(tree).__name__}, expected decoding.tree.DraftTree")
            if tree.root_token != root:
                raise ValueError(f"drafted tree's root token {tree.root_token} is not the last emitted token {root}")
            tree = trim_tree(tree, max_depth)
            tv = time.perf_counter()
            res = verify_tree(self.base_model, cache, tree, **({"layers": layers} if layers else {}))
            stats["verify_seconds"] += time.perf_counter() - tv
            stats["base_forwards"] += 1
            stats["steps"] += 1
            stats["drafter_passes"] += int(tree.drafter_passes)
            stats["tree_nodes"] += tree.num_nodes - 1
            emitted = 0
            stop = False
            for t in res.tokens[1:].tolist() + [res.bonus]:
                out.append(t)
                emitted += 1
                if t in eos or len(out) >= max_new_tokens:
                    stop = True
                    break
            stats["emitted_per_step"].append(emitted)
            if trace is not None:  # emitted token j was the argmax of the row of accepted node j
                trace += top2(res.logits.index_select(0, torch.tensor(res.accepted_nodes[:emitted],
                                                                      device=res.logits.device)))
            # count only what was emitted: drafts after an eos were accepted but never output
            depth, acc = tree.max_depth, res.num_accepted
            grow(depth)
            for d in range(1, depth + 1):
                stats["proposed_per_depth"][d - 1] += 1
                if d <= min(acc + 1, emitted):
                    stats["reached_per_depth"][d - 1] += 1
                if d <= min(acc, emitted):
                    stats["accepted_per_depth"][d - 1] += 1
            if stop:
                break
            td = time.perf_counter()
            drafter.accept(res.tokens, res.hidden)
            stats["drafter_seconds"] += time.perf_counter() - td
            root = res.bonus
        stats["seconds"] = time.perf_counter() - t0
        stats["new_tokens"] = len(out)
        self.last_trace = trace
        return out, stats


def trim_tree(tree: DraftTree, max_depth: int) -> DraftTree:
    """``tree`` without its nodes deeper than ``max_depth`` (the same tree when none are).

    Nodes are in canonical (depth-sorted) order, so the kept nodes are a prefix and keep their
    indices, parents and scores; ``drafter_passes`` is kept (the drafter spent them).

    Args:
        tree: a :class:`DraftTree` with N nodes.
        max_depth: deepest depth to keep (values < 0 act as 0: the root alone).

    Returns:
        A :class:`DraftTree` with the nodes of depth <= ``max_depth``.
    """
    if tree.max_depth <= max_depth:
        return tree
    keep = int((tree.depths <= max(int(max_depth), 0)).sum())
    return DraftTree(tree.tokens[:keep], tree.parents[:keep], tree.depths[:keep],
                     None if tree.scores is None else tree.scores[:keep], tree.drafter_passes)


def tau(stats: dict) -> float:
    """Mean tokens emitted per verification forward, bonus included (1.0 when no step ran)."""
    steps = stats.get("emitted_per_step") or []
    return float(sum(steps) / len(steps)) if steps else 1.0
