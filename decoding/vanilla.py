"""Vanilla greedy decoding with a KV cache: the reference every speculative decoder must equal.

Stop rule (shared by every decoder in ``decoding/``): generation stops after emitting a token in
``eos_token_ids`` (the eos is included in the output) or after ``max_new_tokens`` tokens.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable

import torch

from decoding.ranking import greedy_ids
from decoding.verify import base_forward, new_cache


def eos_token_ids(tokenizer=None, base_model=None) -> list[int]:
    """The eos ids to stop on: the tokenizer's eos plus the model's generation-config eos id(s)."""
    ids: set[int] = set()
    for src in (getattr(tokenizer, "eos_token_id", None),
                getattr(getattr(base_model, "generation_config", None), "eos_token_id", None)):
        if src is None:
            continue
        ids.update(int(i) for i in (src if isinstance(src, (list, tuple)) else [src]))
    return sorted(ids)


def context_limit(base_model) -> int | None:
    """The base model's context limit in positions: ``config.max_position_embeddings`` of the model, or of
    a ``PretrainedConfig`` passed instead (None when the config does not state one)."""
    limit = getattr(getattr(base_model, "config", base_model), "max_position_embeddings", None)
    return int(limit) if limit else None


def check_context_limit(base_model, prompt_length: int, max_new_tokens: int, what: str = "",
                        budget_key: str = "max_new_tokens") -> None:
    """Refuse a prompt whose full sequence cannot fit the base model's context.

    Rule (shared by every decoder in ``decoding/`` and checked by the evaluator before it writes
    anything): prompt length T plus ``max_new_tokens`` N must be <= ``max_position_embeddings``,
    i.e. the whole generated sequence fits the positions the model was trained on.  Nothing is
    truncated silently.

    Args:
        prompt_length: T (tokens).  max_new_tokens: N.
        what: a prefix for the message (e.g. the prompt's id); budget_key: the name N is given under.

    Raises:
        ValueError: T + N > max_position_embeddings; the message names T, N and the limit.
    """
    limit = context_limit(base_model)
    if limit is not None and prompt_length + max_new_tokens > limit:
        raise ValueError(f"{what}prompt of {prompt_length} tokens + {budget_key}={max_new_tokens} = "
                         f"{prompt_length + max_new_tokens} tokens exceeds the base model's context limit "
                         f"max_position_embeddings={limit}; shorten the prompt or lower {budget_key}")


def check_generate_args(prompt_ids: torch.Tensor, max_new_tokens: int, base_model=None) -> torch.Tensor:
    """Validate a single prompt [T] (or [1, T]) and ``max_new_tokens``; return the prompt as [T] long.

    With ``base_model``, also :func:`check_context_limit` (T + max_new_tokens <= max_position_embeddings).

    Raises:
        ValueError: a bad ``max_new_tokens``, an empty or batched prompt, or one beyond the context limit.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
    prompt_ids = torch.as_tensor(prompt_ids)
    if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
        prompt_ids = prompt_ids[0]
    if prompt_ids.dim() != 1 or prompt_ids.numel() == 0:
        raise ValueError(f"prompt_ids must be one non-empty sequence [T], got shape {tuple(prompt_ids.shape)}")
    if base_model is not None:
        check_context_limit(base_model, int(prompt_ids.numel()), max_new_tokens)
    return prompt_ids.long()


@torch.no_grad()
def greedy_generate(base_model, prompt_ids: torch.Tensor, max_new_tokens: int,
                    eos_token_ids: Iterable[int] = ()) -> tuple[list[int], dict]:
    """KV-cached greedy decoding of one prompt.

    Args:
        base_model: the frozen HF causal LM.
        prompt_ids: LongTensor [T].
        max_new_tokens: at most this many new tokens (>= 1).
        eos_token_ids: stop after emitting any of these (the eos is part of the output).

    Returns:
        ``(tokens, stats)``: the generated token ids (prompt excluded) and
        ``{"new_tokens", "base_forwards" (excluding prefill), "prefill_forwards": 1, "seconds"}``.

    Raises:
        ValueError: bad ``prompt_ids`` or ``max_new_tokens``, or prompt + ``max_new_tokens`` beyond
            ``max_position_embeddings`` (:func:`check_context_limit`).
    """
    return _generate(base_model, prompt_ids, max_new_tokens, eos_token_ids, lambda logits: int(greedy_ids(logits)))


@torch.no_grad()
def sample_generate(base_model, prompt_ids: torch.Tensor, max_new_tokens: int, eos_token_ids: Iterable[int] = (),
                    temperature: float = 1.0, generator: torch.Generator | None = None) -> tuple[list[int], dict]:
    """KV-cached ancestral sampling of one prompt: x_t ~ softmax(logits_t / temperature).

    The distribution every lossless sampling decoder must reproduce (METHODS.md §4.2); same
    arguments, stop rule and stats as :func:`greedy_generate`, plus ``temperature`` (> 0) and the
    ``generator`` that supplies all randomness.

    Raises:
        ValueError: bad ``prompt_ids``, ``max_new_tokens`` or ``temperature``.
    """
    from decoding.sampling import sample, warp

    return _generate(base_model, prompt_ids, max_new_tokens, eos_token_ids,
                     lambda logits: sample(warp(logits, temperature), generator))


def _generate(base_model, prompt_ids, max_new_tokens: int, eos_token_ids: Iterable[int],
              pick: Callable[[torch.Tensor], int]) -> tuple[list[int], dict]:
    """The KV-cached decoding loop shared by greedy and ancestral sampling: ``pick`` maps the last
    position's logits [V] to the next token; stop rule and stats as :func:`greedy_generate`."""
    prompt_ids = check_generate_args(prompt_ids, max_new_tokens, base_model)
    eos = set(int(e) for e in eos_token_ids)
    t0 = time.perf_counter()
    cache = new_cache(base_model)
    logits, _ = base_forward(base_model, prompt_ids, cache, logits_to_keep=1)  # only the last row is read
    token = pick(logits[-1])
    out = [token]
    forwards = 0
    while token not in eos and len(out) < max_new_tokens:
        logits, _ = base_forward(base_model, torch.tensor([token]), cache)
        forwards += 1
        token = pick(logits[-1])
        out.append(token)
    seconds = time.perf_counter() - t0
    return out, {"new_tokens": len(out), "base_forwards": forwards, "prefill_forwards": 1, "seconds": seconds}


@torch.no_grad()
def replay_step_logits(base_model, prompt_ids: torch.Tensor, tokens, position: int) -> torch.Tensor:
    """The logits vanilla decoding's step ``position`` computed, recomputed exactly as
    :func:`_generate` computes them: the same prefill, then one-token forwards of ``tokens[:position]``.

    Args:
        prompt_ids: LongTensor [T]; tokens: the generated ids (at least ``position`` of them).
        position: 0 = the prefill's last row (it chose ``tokens[0]``); p = the step after ``tokens[p-1]``.

    Returns:
        logits [V] in the model's dtype (equal bit for bit to the run's on a deterministic device;
        its argmax is the token vanilla decoding emitted at ``position``).
    """
    prompt_ids = check_generate_args(prompt_ids, 1)
    cache = new_cache(base_model)
    logits, _ = base_forward(base_model, prompt_ids, cache, logits_to_keep=1)
    for t in list(tokens)[:position]:
        logits, _ = base_forward(base_model, torch.tensor([int(t)]), cache)
    return logits[-1]


class VanillaDecoder:
    """:func:`greedy_generate` as a Decoder object (``generate(prompt_ids, max_new_tokens)``)."""

    def __init__(self, base_model, eos_token_ids: Iterable[int] = ()) -> None:
        self.base_model = base_model
        self.eos_token_ids = list(eos_token_ids)

    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], dict]:
        return greedy_generate(self.base_model, prompt_ids, max_new_tokens, self.eos_token_ids)
