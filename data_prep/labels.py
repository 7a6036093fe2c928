"""Greedy distilled labels and hidden states from the frozen base model.

* :func:`forward_features` — one batched teacher-forced forward pass: hidden states of the
  requested layers (HF convention, design.md: ``hs[L]`` is the final post-norm state) and the
  greedy label ``argmax_v z_t`` at every position (the base's prediction of token t+1).
  The LM head is applied in chunks so the [B, T, V] logits tensor is never materialised.
* :func:`regenerate` — ``labels=regenerate`` (METHODS.md §0 Rec.): every assistant turn is
  rewritten by the base model's own greedy decoding (batched, left-padded, KV cache:
  :func:`greedy_generate`), given the conversation so far.  Features then come from a teacher-forced
  pass over the regenerated conversation, so labels equal what the base really emits.
"""
from __future__ import annotations

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
    """Teacher-forced features for a batch of token sequences.

    Args:
        model: a frozen HF causal LM (``model.base_model`` returns ``hidden_states``;
            ``model.get_output_embeddings()`` is the LM head W).
        seqs: B token-id lists (right-padded internally with ``pad_id``).
        pad_id: the tokenizer's pad id.
        layers: hidden-state indices to return (0..L; L = final post-norm).
        head_chunk: tokens per LM-head matmul when computing the argmax.

    Returns:
        one dict per sequence (length T_i): ``labels`` LongTensor [T_i] (argmax of the logits at
        each position) and ``hidden`` ``{l: FloatTensor [T_i, H]}`` in the model's dtype.
    """
    ids, attn = _pad_right(seqs, pad_id)
    device = next(model.parameters()).device
    out = model.base_model(input_ids=ids.to(device), attention_mask=attn.to(device), output_hidden_states=True,
                           use_cache=False)
    hs = out.hidden_states
    head = model.get_output_embeddings()
    final = hs[-1]
    lengths = [len(s) for s in seqs]
    flat = torch.cat([final[i, :n] for i, n in enumerate(lengths)])
    labels = torch.cat([head(flat[j: j + head_chunk]).argmax(-1) for j in range(0, flat.shape[0], head_chunk)])
    results = []
    start = 0
    for i, n in enumerate(lengths):
        results.append({"labels": labels[start: start + n].cpu(),
                        "hidden": {l: hs[l][i, :n].cpu() for l in layers}})
        start += n
    return results


@torch.inference_mode()
def greedy_generate(model, prompts: Sequence[Sequence[int]], pad_id: int, eos_ids: set[int], max_new_tokens: int
                    ) -> list[list[int]]:
    """Batched greedy decoding with a KV cache (left-padded prompts).

    One prefill over the left-padded prompts (position ids from the attention mask, logits only
    at the last position), then one single-token step per new token, each feeding
    ``argmax_v logits`` back.  A row stops after emitting any id in ``eos_ids``; the loop stops
    when all rows stopped or after ``max_new_tokens`` steps.

    Args:
        model: frozen HF causal LM.
        prompts: B token-id lists.
        pad_id: id used for left padding (masked out).
        eos_ids: end-of-turn ids.
        max_new_tokens: step budget.

    Returns:
        per prompt the generated ids (up to and including the first eos, at most ``max_new_tokens``).
    """
    device = next(model.parameters()).device
    B, T = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        attn[i, T - len(p):] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    eos = torch.as_tensor(sorted(eos_ids), dtype=torch.long, device=device)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values if getattr(out, "cache", None) is None else out.cache
    last_pos = pos[:, -1:]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    generated = []
    for step in range(max_new_tokens):
        nxt = out.logits[:, -1].argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        generated.append(nxt)
        done = done | torch.isin(nxt, eos)
        if bool(done.all()) or step + 1 == max_new_tokens:
            break
        attn = torch.cat([attn, attn.new_ones((B, 1))], dim=1)
        last_pos = last_pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=last_pos, cache=cache,
                    use_cache=True, logits_to_keep=1)
        cache = out.past_key_values if getattr(out, "cache", None) is None else out.cache
    gen = torch.stack(generated, 1).cpu().tolist() if generated else [[] for _ in prompts]
    result = []
    for row in gen:
        body = []
        for tok in row:
            body.append(tok)
            if tok in eos_ids:
                break
        result.append(body)
    return result


@dataclass
class _State:
    segments: list[Segment]
    ids: list[int]        # tokens so far (regenerated)
    mask: list[bool]
    next_seg: int = 0
    done: bool = False


@torch.inference_mode()
def regenerate(model, tokenizer, conversations: Sequence[list[Segment]], eos_ids: set[int], max_new_tokens: int,
               max_length: int, batch_size: int = 16, on_generated=None) -> list[tuple[list[int], list[bool]]]:
    """Greedily regenerate every assistant turn with the base model (``labels=regenerate``).

    Turns are processed in order; at each assistant turn all conversations that reach it are
    batched (sorted by context length, left-padded) through :func:`greedy_generate`.  The generated body replaces the original one, up to and including the first
    end-of-turn token; the template's header and footer tokens and the user/system turns are
    kept.  A conversation ends early when a turn emits no end-of-turn token within
    ``max_new_tokens`` (its remaining turns would follow a cut response) or when it reaches
    ``max_length`` tokens.

    Args:
        model, tokenizer: the frozen base and its tokenizer.
        conversations: per conversation, its template segments (:func:`segment_conversation`).
        eos_ids: end-of-turn ids (generation stops at any of them).
        max_new_tokens: generation budget per assistant turn.
        max_length: token budget per conversation.
        batch_size: conversations per :func:`greedy_generate` call.
        on_generated: optional callback ``f(n_tokens)`` after each generation batch (progress).

    Returns:
        per conversation ``(input_ids, loss_mask)`` of the regenerated conversation, truncated
        to ``max_length``; the mask is True on generated tokens.
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    states = [_State(segs, [], []) for segs in conversations]
    while True:
        # advance every state through its non-assistant segments up to the next assistant turn
        pending = []
        for k, st in enumerate(states):
            while not st.done and st.next_seg < len(st.segments) and st.segments[st.next_seg].role != "assistant":
                seg = st.segments[st.next_seg]
                st.ids.extend(seg.ids)
                st.mask.extend([False] * len(seg.ids))
                st.next_seg += 1
            if st.next_seg >= len(st.segments) or len(st.ids) >= max_length:
                st.done = True
            if not st.done:
                seg = st.segments[st.next_seg]
                if len(st.ids) + seg.header >= max_length:
                    st.done = True
                else:
                    pending.append(k)
        if not pending:
            break
        pending.sort(key=lambda k: len(states[k].ids) + states[k].segments[states[k].next_seg].header)
        for b in range(0, len(pending), batch_size):
            group = pending[b: b + batch_size]
            prompts = [states[k].ids + states[k].segments[states[k].next_seg].ids[: states[k].segments[states[k].next_seg].header]
                       for k in group]
            budget = min(max_new_tokens, max_length - min(len(p) for p in prompts))
            gen = greedy_generate(model, prompts, pad_id, eos_ids, budget)
            if on_generated is not None:
                on_generated(sum(len(g) for g in gen))
            for k, p, g in zip(group, prompts, gen):
                st = states[k]
                seg = st.segments[st.next_seg]
                body = g
                finished = bool(body) and body[-1] in eos_ids
                st.ids = p + body
                st.mask.extend([False] * seg.header + [True] * len(body))
                if finished:
                    footer = seg.ids[seg.header + seg.body:]
                    st.ids.extend(footer)
                    st.mask.extend([False] * len(footer))
                    st.next_seg += 1
                else:
                    st.done = True
    return [(st.ids[:max_length], st.mask[:max_length]) for st in states]
