"""Tree verification on the base model's KV cache (METHODS.md §0 "Tree attention", §4.1 greedy).

One base-model forward over a :class:`decoding.tree.DraftTree` (root = the last emitted token,
at position P = the cache length) with the tree attention mask and ``P + depth`` position ids
gives the target distribution at every node.  Greedy acceptance walks from the root while some
child's token equals the argmax at the current node; the argmax at the last accepted node is the
bonus token.  The cache then keeps only the root and the accepted path (index-select along the
sequence axis of every layer), so it equals the cache sequential decoding would hold.

The base model is any HF causal LM whose forward takes ``cache=`` (transformers 5), a ready
4-D additive ``attention_mask`` and ``position_ids``, and whose ``hidden_states[-1]`` is the final
post-norm hidden state (docs/design.md "Hidden-state convention").

``layers`` (optional everywhere): hidden-state ids ℓ of the HF ``hidden_states`` tuple; the
returned "hidden" is then the concatenation [hs[ℓ_1] ; hs[ℓ_2] ; ...] ([n, len(layers)·H]) instead
of hs[-1].  A drafter that reads intermediate layers (EAGLE-3) declares them as its
``feature_layers`` and :class:`decoding.speculative.SpeculativeDecoder` passes them here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.ranking import greedy_ids
from decoding.tree import DraftTree


def new_cache(base_model):
    """An empty ``transformers.DynamicCache`` for ``base_model``."""
    from transformers import DynamicCache

    return DynamicCache(config=base_model.config)


def check_full_attention_cache(base_model) -> None:
    """Refuse a base whose KV cache is not plain full attention in every layer.

    Tree verification (and AdaDecode's rollback) cuts and reorders cached positions by index
    (:func:`keep_cache_positions`), which a sliding-window layer (Gemma 2 and 3, Mistral with
    ``sliding_window``) or any other cache layer type does not support.

    Raises:
        ValueError: naming the model class and the layers that are not full attention.
    """
    from transformers.cache_utils import DynamicLayer

    other = [f"{i} ({type(layer).__name__})" for i, layer in enumerate(new_cache(base_model).layers)
             if type(layer) is not DynamicLayer]
    if other:
        shown = ", ".join(other[:4]) + (f" and {len(other) - 4} more" if len(other) > 4 else "")
        raise ValueError(f"the base model ({type(base_model).__name__}) keeps a KV cache that is not full attention in "
                         f"layers {shown}: lossless tree verification here needs full-attention layers, so speculative "
                         "decoding over this base is not supported (its draft heads can still be trained and exported)")


def model_device(base_model) -> torch.device:
    return next(base_model.parameters()).device


@torch.no_grad()
def base_forward(base_model, input_ids: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, layers=None,
                 logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One cached base forward of a single sequence.

    Args:
        input_ids: LongTensor [n] or [1, n].
        cache: the ``DynamicCache``; grows by n positions.
        position_ids: LongTensor [1, n] or None (consecutive after the cache).
        attention_mask: None (causal) or a ready 4-D additive mask [1, 1, n, P+n].
        layers: optional hidden-state ids (module docstring).
        logits_to_keep: 0 = logits at every position; k > 0 = at the last k only (transformers'
            ``logits_to_keep``: a prefill that needs only its last row skips k = T - 1 rows of the
            [V, H] LM-head product, 49152 x 576 multiply-adds each for SmolLM2).

    Returns:
        ``(logits [n, V] (or [k, V]), hidden)`` where hidden is the final post-norm hs[-1] [n, H], or
        [hs[ℓ] for ℓ in layers] concatenated [n, len(layers)·H]; both in the model's dtype.
    """
    ids = input_ids.reshape(1, -1).to(model_device(base_model))
    out = base_model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                     use_cache=True, output_hidden_states=True,
                     **({"logits_to_keep": int(logits_to_keep)} if logits_to_keep else {}))
    if layers:
        return out.logits[0], torch.cat([out.hidden_states[int(l)][0] for l in layers], dim=-1)
    return out.logits[0], out.hidden_states[-1][0]


@torch.no_grad()
def prefill(base_model, prompt_ids: torch.Tensor, layers=None):
    """Run the prompt through the base model.

    Args:
        prompt_ids: LongTensor [T] (T >= 1).
        layers: optional hidden-state ids (module docstring).

    Returns:
        ``(cache, first_token, hidden)``: the ``DynamicCache`` holding T positions, the greedy
        next token (int), and hs[-1] at every prompt position, Tensor [T, H].

    Raises:
        ValueError: the prompt is empty.
    """
    prompt_ids = prompt_ids.reshape(-1)
    if prompt_ids.numel() == 0:
        raise ValueError("empty prompt: need at least one token")
    cache = new_cache(base_model)
    logits, hidden = base_forward(base_model, prompt_ids, cache, layers=layers, logits_to_keep=1)
    return cache, int(greedy_ids(logits[-1])), hidden


def keep_cache_positions(cache, past_length: int, keep: torch.Tensor) -> None:
    """Keep cache positions ``[0, P)`` plus ``P + keep`` (in that order) in every layer; drop the rest.

    Only the K kept tree slots move: they are gathered and written over slots ``[P, P + K)`` (none
    move when they already lead the block), and each layer is then cut to ``P + K`` positions (a
    view, as ``DynamicLayer.crop`` cuts).  The P context positions are neither read nor copied, so
    the cost is O(K) per layer, not O(P + K) as an index-select of the whole layer would be (the
    next step's ``torch.cat`` in ``DynamicLayer.update`` allocates afresh, so the dropped tail is
    never reused).

    Args:
        cache: a ``DynamicCache`` whose layers hold keys/values [B, heads, S, head_dim].
        past_length: P, the cache length before the tree was appended.
        keep: LongTensor [K] of distinct tree-node indices (e.g. the root and the accepted path).

    Raises:
        TypeError: a layer is not a plain (non-sliding) ``DynamicLayer``.
    """
    from transformers.cache_utils import DynamicLayer

    keep = keep.reshape(-1).long()
    k = keep.numel()
    # the kept slots already lead the tree block (the root alone, or the top-ranked path that
    # depth-first order lays out first): nothing moves, every layer is only cut
    prefix = bool((keep == torch.arange(k)).all())
    slots = None if prefix else past_length + keep  # the kept slots' cache positions, once for every layer
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise TypeError(f"cache layer {i} is {type(layer).__name__}; tree verification needs DynamicLayer")
        if not layer.is_initialized or (prefix and layer.keys.shape[-2] == past_length + k):
            continue
        src = None if slots is None else slots.to(layer.keys.device)
        for name in ("keys", "values"):
            t = getattr(layer, name)
            if src is not None:
                t[..., past_length:past_length + k, :] = t.index_select(-2, src)  # a gathered copy, then written
            setattr(layer, name, t[..., :past_length + k, :])


def crop_cache(cache, length: int) -> None:
    """Crop every layer of ``cache`` to its first ``length`` positions."""
    cur = cache.get_seq_length()
    if length < cur:
        cache.crop(length - cur)


@dataclass
class VerifyResult:
    """What one verification step produced.

    Attributes:
        accepted_nodes: node indices root first, then the accepted path (length A+1).
        tokens: LongTensor [A+1] — the root and the accepted draft tokens (now in the cache).
        bonus: the argmax at the last accepted node (the next root), int.
        hidden: Tensor [A+1, H] — hs[-1] (final post-norm) at the accepted nodes; ``hidden[j]``
            predicts the token after ``tokens[j]``.
        logits: Tensor [N, V] — the base logits at every node of the tree.
        num_accepted: A, the accepted draft tokens (excluding root and bonus).
    """

    accepted_nodes: list[int]
    tokens: torch.Tensor
    bonus: int
    hidden: torch.Tensor
    logits: torch.Tensor

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes) - 1


def greedy_accept(tree: DraftTree, predictions: list[int]) -> list[int]:
    """METHODS.md §4.1: from the root, move to the child whose token equals the argmax.

    Args:
        tree: the draft tree.
        predictions: argmax token at every node, list[int] of length N.

    Returns:
        Node indices root first, then the accepted path.  Siblings hold distinct tokens in a
        canonical tree; if not, the first matching child (canonical order) is taken.
    """
    toks = tree.tokens.tolist()
    path = [0]
    node = 0
    while True:
        target = predictions[node]
        nxt = next((c for c in tree.children(node) if toks[c] == target), None)
        if nxt is None:
            return path
        path.append(nxt)
        node = nxt


def depth_first_order(tree: DraftTree) -> torch.Tensor:
    """The tree's nodes depth-first, children in canonical (rank) order: LongTensor [N], root first.

    Verification feeds the nodes in this order so that the top-ranked path (root, first child,
    its first child, ...) occupies consecutive cache slots P, P+1, ...: its rows then attend to one
    contiguous run of keys followed only by masked ones, exactly the keys (in the same columns) a
    one-token step attends to, so their attention sums in the same order (in bf16 a branching,
    breadth-first layout interleaves masked siblings with the path and rounds differently;
    docs/precision_eval.md).  Any order gives the same mathematics: the mask and positions follow
    the nodes.
    """
    out, stack = [], [0]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(reversed(tree.children(node)))
    return torch.tensor(out, dtype=torch.long)


@torch.no_grad()
def verify_tree(base_model, cache, tree: DraftTree, layers=None) -> VerifyResult:
    """Verify ``tree`` with one base forward and keep only the accepted path in ``cache``.

    Args:
        base_model: the frozen HF causal LM.
        cache: its ``DynamicCache`` with P positions (everything before the root).
        tree: the draft tree; ``tree.tokens[0]`` is the last emitted token.
        layers: optional hidden-state ids for ``VerifyResult.hidden`` (module docstring).

    Returns:
        A :class:`VerifyResult`.  Afterwards the cache holds P + A + 1 positions.
    """
    device = model_device(base_model)
    past = cache.get_seq_length()
    # the forward feeds the nodes depth-first (:func:`depth_first_order`); rows are mapped back to node order
    order = depth_first_order(tree)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel())
    mask = tree.attention_mask(past, dtype=base_model.dtype, device=device)
    cols = torch.cat([torch.arange(past), past + order]).to(device)
    mask = mask[:, :, order.to(device)][..., cols]
    pos = tree.position_ids(past, device=device)[:, order.to(device)]
    logits, hidden = base_forward(base_model, tree.tokens[order], cache, position_ids=pos, attention_mask=mask,
                                  layers=layers)
    logits, hidden = logits.index_select(0, inv.to(logits.device)), hidden.index_select(0, inv.to(hidden.device))
    preds = greedy_ids(logits).tolist()
    accepted = greedy_accept(tree, preds)
    idx = torch.tensor(accepted, dtype=torch.long)
    keep_cache_positions(cache, past, inv[idx])  # cache slot P + k holds node order[k]
    return VerifyResult(
        accepted_nodes=accepted,
        tokens=tree.tokens[idx],
        bonus=int(preds[accepted[-1]]),
        hidden=hidden.index_select(0, idx.to(hidden.device)),
        logits=logits,
    )
