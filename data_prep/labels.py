"""Greedy distilled labels and hidden states from the frozen base model.

* :func:`forward_features` — one batched teacher-forced forward pass: hidden states of the
  requested layers (HF convention, design.md: ``hs[L]`` is the final post-norm state) and the
  greedy label ``argmax_v z_t`` at every position (the base's prediction of token t+1).
  The LM head is applied in chunks so the [B, T, V] logits tensor is never materialised.
* :func:`regenerate` — ``labels=regenerate`` (METHODS.md §0 Rec.): every assistant turn is
  rewritten by the base model's own greedy decoding (batched, left-padded, KV cache kept across
  a conversation's turns, finished rows dropped: :func:`greedy_generate`), given the conversation
  so far, up to ``data.max_length`` tokens per turn by default.  Features then come from a teacher-forced
  pass over the regenerated conversation, so labels equal what the base really emits.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch

from data_prep.template import Segment


def _pad_right(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


@torch.inference_mode()
def forward_features(model, seqs: Sequence[Sequence[int]], pad_id: int, layers: Sequence[int],
                     head_chunk: int = 2048) -> list[dict]:
    """Teacher-forced features for a batch of token sequences (:func:`data_prep.features.teacher_forced`).

    Args:
        model: a frozen HF causal LM (``model.base_model`` returns ``hidden_states``;
            ``model.get_output_embeddings()`` is the LM head W).
        seqs: B token-id lists (right-padded internally with ``pad_id``).
        pad_id: the tokenizer's pad id.
        layers: hidden-state indices to return (0..L; L = final post-norm).
        head_chunk: tokens per LM-head matmul when computing the argmax.

    Returns:
        one dict per sequence (length T_i): ``labels`` LongTensor [T_i] (argmax of the logits at
        each position), ``hidden`` ``{l: FloatTensor [T_i, H]}`` in the model's dtype (the compute
        dtype, ``model.dtype``) and ``logits_finite`` BoolTensor [T_i] (False where a logit is NaN /
        ±inf: the label is undefined).
    """
    from data_prep.features import teacher_forced

    ids, attn = _pad_right(seqs, pad_id)
    device = next(model.parameters()).device
    labels, hs, finite = teacher_forced(model, ids.to(device), attn.to(device), head_chunk)
    lengths = [len(s) for s in seqs]
    return [{"labels": labels[i, :n].cpu(), "logits_finite": finite[i, :n].cpu(),
             "hidden": {l: hs[l][i, :n].cpu() for l in layers}} for i, n in enumerate(lengths)]


#: one row's KV cache for the tokens fed so far: per layer ``(keys, values)``, each [H_kv, n, D]
RowPast = list


def _batch_cache(pasts: Sequence[RowPast | None], lengths: Sequence[int], C: int):
    """A DynamicCache [B, H_kv, C, D] with row r's ``lengths[r]`` past columns right-aligned (others zero, masked)."""
    from transformers import DynamicCache

    ref = next(p for p in pasts if p is not None)
    cache = DynamicCache()
    for l, (k0, v0) in enumerate(ref):
        K = k0.new_zeros((len(pasts), k0.shape[0], C, k0.shape[-1]))
        V = v0.new_zeros((len(pasts), v0.shape[0], C, v0.shape[-1]))
        for r, p in enumerate(pasts):
            if p is not None and lengths[r]:
                K[r, :, C - lengths[r]:] = p[l][0]
                V[r, :, C - lengths[r]:] = p[l][1]
        cache.update(K, V, l)
    return cache


def _row_past(cache, row: int, cols: torch.Tensor) -> RowPast:
    return [(layer.keys[row][:, cols].clone(), layer.values[row][:, cols].clone()) for layer in cache.layers]


@torch.inference_mode()
def greedy_generate(model, prompts: Sequence[Sequence[int]], pad_id: int, eos_ids: set[int],
                    max_new_tokens: int | Sequence[int], past: Sequence[RowPast | None] | None = None,
                    keep_past: bool = False, on_tokens=None):
    """Batched greedy decoding with a KV cache, optionally continuing from per-row caches.

    Row r's context is ``past[r]`` (the KV of tokens fed earlier, e.g. the previous turns of a
    conversation) followed by ``prompts[r]``.  One prefill feeds the new tokens (left-padded,
    the pasts right-aligned in front of them, every pad masked out, position ids counted per
    row), then one single-token step per new token, each feeding ``argmax_v logits`` back.  A
    row stops after emitting any id in ``eos_ids`` or after its budget and is dropped from the
    batch (its KV-cache row too, ``DynamicCache.batch_select_indices``); the loop ends when no
    row is left.  Each row's tokens equal batch-1 greedy decoding of its full context
    (tests/test_data_prep.py checks it against ``model.generate``).

    Args:
        model: frozen HF causal LM.
        prompts: B non-empty token-id lists (the new tokens after each row's past).
        pad_id: id used for padding (masked out).
        eos_ids: end-of-turn ids.
        max_new_tokens: step budget, one int or one per row (each >= 1).
        past: optional per-row :data:`RowPast` (``None`` entries = no past).
        keep_past: also return each row's KV after generation: past + prompt + generated
            tokens except the last one (which was emitted, not fed).
        on_tokens: optional callback ``f(n)`` after every decoding step (n = tokens emitted).

    Returns:
        per prompt the generated ids (up to and including the first eos, at most its budget);
        with ``keep_past``, ``(generated, pasts)``.
    """
    device = next(model.parameters()).device
    B = len(prompts)
    budgets = [int(max_new_tokens)] * B if isinstance(max_new_tokens, int) else [int(b) for b in max_new_tokens]
    past = list(past) if past is not None else [None] * B
    plen = [0 if p is None else int(p[0][0].shape[1]) for p in past]
    C, M = max(plen), max(len(p) for p in prompts)
    ids = torch.full((B, M), pad_id, dtype=torch.long)
    attn = torch.zeros((B, C + M), dtype=torch.long)
    pos = torch.zeros((B, M), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, M - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        attn[i, C - plen[i]: C] = 1
        attn[i, C + M - len(p):] = 1
        pos[i, M - len(p):] = torch.arange(plen[i], plen[i] + len(p))
    ids, attn, pos = ids.to(device), attn.to(device), pos.to(device)
    cache = _batch_cache(past, plen, C) if C else None
    eos = torch.as_tensor(sorted(eos_ids), dtype=torch.long, device=device)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values if getattr(out, "cache", None) is None else out.cache
    last_pos = pos[:, -1:]
    rows = list(range(B))            # batch row -> prompt index (finished rows are dropped)
    result: list[list[int]] = [[] for _ in range(B)]
    pasts: list[RowPast | None] = [None] * B
    while rows:
        nxt = out.logits[:, -1].argmax(-1)
        fin = torch.isin(nxt, eos)
        for j, (r, tok) in enumerate(zip(rows, nxt.tolist())):
            result[r].append(tok)
            if len(result[r]) >= budgets[r]:
                fin[j] = True
        if on_tokens is not None:
            on_tokens(len(rows))
        if bool(fin.any()):
            if keep_past:
                for j in fin.nonzero().squeeze(1).tolist():
                    pasts[rows[j]] = _row_past(cache, j, attn[j].bool())
            keep = (~fin).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            # drop finished rows from the batch: fewer rows per step, same per-row computation
            cache.batch_select_indices(keep)
            attn, last_pos, nxt = attn[keep], last_pos[keep], nxt[keep]
            rows = [rows[i] for i in keep.tolist()]
        attn = torch.cat([attn, attn.new_ones((len(rows), 1))], dim=1)
        last_pos = last_pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=last_pos, cache=cache,
                    use_cache=True, logits_to_keep=1)
        cache = out.past_key_values if getattr(out, "cache", None) is None else out.cache
    return (result, pasts) if keep_past else result


@dataclass
class _State:
    segments: list[Segment]
    ids: list[int]        # tokens so far (regenerated)
    mask: list[bool]
    next_seg: int = 0
    done: bool = False
    past: RowPast | None = None  # KV of ids[:fed]
    fed: int = 0


@torch.inference_mode()
def regenerate(model, tokenizer, conversations: Sequence[list[Segment]], eos_ids: set[int], max_new_tokens: int | None,
               max_length: int, batch_size: int = 16, on_generated=None, stats: Counter | None = None
               ) -> list[tuple[list[int], list[bool]]]:
    """Greedily regenerate every assistant turn with the base model (``labels=regenerate``).

    Turns are processed in order; at each assistant turn all conversations that reach it are
    batched (sorted by context length) through :func:`greedy_generate`, which continues each
    conversation from the KV cache kept since its previous turn (only the new tokens — the
    last reply's end-of-turn, the template's footer, the next user turn and header — are
    prefilled).  The generated body replaces the original one, up to and including the first
    end-of-turn token; the template's header and footer tokens and the user turns are kept.

    Budget: a turn may generate up to ``max_new_tokens`` tokens (``None`` = full length: up to
    ``max_length`` minus its context).  A turn cut by the budget is counted in
    ``stats["truncated_turns"]``, keeps its tokens without an end-of-turn it did not generate,
    and ends its conversation (later turns would follow a cut response); so does reaching
    ``max_length`` tokens.

    Args:
        model, tokenizer: the frozen base and its tokenizer.
        conversations: per record, its template segments (:func:`data_prep.template.segment_records`).
        eos_ids: end-of-turn ids (generation stops at any of them).
        max_new_tokens: generation budget per assistant turn, or ``None`` (full length).
        max_length: token budget per conversation.
        batch_size: conversations per :func:`greedy_generate` call.
        on_generated: optional callback ``f(n_tokens)`` after every decoding step (progress in tokens).
        stats: optional counter; ``truncated_turns`` and ``generated_tokens`` are added.

    Returns:
        per conversation ``(input_ids, loss_mask)`` of the regenerated conversation, truncated
        to ``max_length``; the mask is True on generated tokens.
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    stats = stats if stats is not None else Counter()
    states = [_State(segs, [], []) for segs in conversations]
    while True:
        pending = []
        for k, st in enumerate(states):
            if st.next_seg >= len(st.segments) or len(st.ids) >= max_length:
                st.done, st.past = True, None
            if not st.done:
                seg = st.segments[st.next_seg]
                if len(st.ids) + seg.header >= max_length:
                    st.done, st.past = True, None
                else:
                    pending.append(k)
        if not pending:
            break
        pending.sort(key=lambda k: len(states[k].ids) + states[k].segments[states[k].next_seg].header)
        for b in range(0, len(pending), batch_size):
            group = pending[b: b + batch_size]
            contexts = [states[k].ids + states[k].segments[states[k].next_seg].ids[: states[k].segments[states[k].next_seg].header]
                        for k in group]
            budgets = [max_length - len(c) if max_new_tokens is None else min(max_new_tokens, max_length - len(c))
                       for c in contexts]
            gen, pasts = greedy_generate(model, [c[states[k].fed:] for k, c in zip(group, contexts)], pad_id, eos_ids,
                                         budgets, past=[states[k].past for k in group], keep_past=True,
                                         on_tokens=on_generated)
            stats["generated_tokens"] += sum(len(g) for g in gen)
            for k, c, g, past in zip(group, contexts, gen, pasts):
                st = states[k]
                seg = st.segments[st.next_seg]
                finished = bool(g) and g[-1] in eos_ids
                st.mask.extend([False] * (len(c) - len(st.ids)) + [True] * len(g))
                st.ids = c + g
                st.past, st.fed = past, len(st.ids) - 1
                if finished:
                    footer = seg.ids[seg.header + seg.body:]
                    st.ids.extend(footer)
                    st.mask.extend([False] * len(footer))
                    st.next_seg += 1
                else:
                    stats["truncated_turns"] += 1
                    st.done, st.past = True, None
    return [(st.ids[:max_length], st.mask[:max_length]) for st in states]
