"""Lossless adaptive layer-parallel decoding with AdaDecode heads (METHODS.md §3.4, greedy).

The base model is stepped **layer by layer** (``model.model.layers[i]`` with rotary
``position_embeddings`` from ``model.model.rotary_emb``, a 4-D additive causal mask and one HF
``DynamicCache`` whose layers have their own lengths).

State.  The committed prefix has KV at every layer.  In-flight tokens u_1..u_r sit at consecutive
positions with depths d_1 ≥ … ≥ d_r (layers done; hidden state = hs[d]).  u_1 is always a verified
token; u_{j+1} is the early prediction ("draft") made by u_j's head.  Layer i's cache therefore
holds exactly the positions whose depth is > i.

Loop (one iteration = one *sequential layer step*):

1. The contiguous in-flight suffix at the minimum depth d (it always contains the newest token)
   goes through layer d **jointly** — the deferred upper layers of earlier early-exited tokens run
   batched with the newest token's layers (layer parallelism).
2. If the newest token has just reached a candidate layer ℓ and its head's max probability
   max softmax(W·T_ℓ·norm(hs[ℓ])) ≥ γ_ℓ, its argmax becomes its draft successor, which starts at
   depth 0 at once (unless the draft is an eos, would be the last token allowed, or
   ``max_inflight`` tokens are already in flight).
3. When the minimum depth reaches L, every in-flight token is at L (the suffix absorbed each
   group on its way up): p*_j = softmax(W·norm(hs[L]_j)) verifies u_{j+1} = argmax p*_j in order.
   On the first mismatch, u_{j+1..r} are discarded, every layer's KV is cropped to positions
   ≤ pos(u_j), and argmax p*_j is emitted; the newest token's full-model argmax is emitted likewise.
   The emitted token restarts at depth 0.

Without a cap on in-flight tokens, γ = 0 (every token exits at the first candidate layer) would
never bring any token to depth L; ``max_inflight`` (default 8) bounds the unverified chain.

The output equals vanilla greedy decoding token for token (exact arithmetic; tested in fp32).
Stop rule: that of :func:`decoding.vanilla.greedy_generate` (eos included, or ``max_new_tokens``).

Temperature τ > 0 (§3.4 sampling): the exit decision is unchanged (the head's untempered max
probability ≥ γ_ℓ), but the draft is *sampled* from the tempered head distribution
q = softmax(z^(ℓ)/τ); verification accepts it with probability min(1, p*/q) and otherwise emits a
sample from norm(max(0, p* − q)) and rolls back (:func:`decoding.sampling.verify_draft`); a token
without a draft successor samples from p* = softmax(W·norm(hs[L])/τ).  Every emitted token is then
distributed exactly as in :func:`decoding.vanilla.sample_generate` (tested statistically).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from core.logit_transform import logit_transform
from decoding.margins import top2
from decoding.ranking import greedy_ids
from decoding.sampling import sample, verify_draft, warp
from decoding.vanilla import check_generate_args
from decoding.verify import check_full_attention_cache, new_cache, prefill


def _inner(model):
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def causal_mask(past: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """4-D additive causal mask [1, 1, n, past+n] for n new tokens after ``past`` cached ones
    (0 = visible, ``finfo(dtype).min`` = hidden)."""
    cols = torch.arange(past + n, device=device)
    rows = torch.arange(n, device=device) + past
    visible = cols.unsqueeze(0) <= rows.unsqueeze(1)
    mask = torch.zeros(n, past + n, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.view(1, 1, n, past + n)


@torch.no_grad()
def layer_step(model, index: int, h: torch.Tensor, start: int, cache) -> torch.Tensor:
    """Run decoder layer ``index`` on n consecutive tokens at positions start..start+n-1.

    Args:
        model: the HF Llama-family causal LM.
        index: 0-based layer index i (takes hs[i] to hs[i+1]).
        h: [1, n, H] hidden states hs[i] (model dtype).
        start: position of the first token; must equal layer i's cache length.
        cache: ``DynamicCache``; layer i grows by n positions.

    Returns:
        [1, n, H] hs[i+1].

    Raises:
        RuntimeError: layer i's cache length is not ``start`` (bookkeeping bug).
    """
    have = cache.get_seq_length(index)
    if have != start:
        raise RuntimeError(f"layer {index} cache holds {have} positions, expected {start}")
    inner = _inner(model)
    n = h.shape[1]
    position_ids = torch.arange(start, start + n, device=h.device).unsqueeze(0)
    pos_emb = inner.rotary_emb(h, position_ids)
    mask = causal_mask(start, n, h.dtype, h.device)
    return inner.layers[index](h, attention_mask=mask, position_ids=position_ids, cache=cache,
                               use_cache=True, position_embeddings=pos_emb)


@torch.no_grad()
def layerwise_forward(model, input_ids: torch.Tensor, cache=None) -> torch.Tensor:
    """Full forward of one sequence through :func:`layer_step` (no early exit): ids [T] -> logits [T, V].

    Appends to ``cache`` (a fresh ``DynamicCache`` if None).  Used to check the manual loop
    against ``model(input_ids).logits``.
    """
    cache = new_cache(model) if cache is None else cache
    inner = _inner(model)
    ids = input_ids.reshape(1, -1).to(next(model.parameters()).device)
    start = cache.get_seq_length(0)
    h = inner.embed_tokens(ids)
    for i in range(model.config.num_hidden_layers):
        h = layer_step(model, i, h, start, cache)
    return logit_transform(model.config)(model.get_output_embeddings()(inner.norm(h)))[0]


@dataclass
class _Token:
    id: int
    pos: int          # sequence position
    gen: int          # index among the generated tokens
    depth: int        # decoder layers done
    h: torch.Tensor   # [H] hs[depth]
    draft: int | None = None
    draft_layer: int | None = None
    draft_q: torch.Tensor | None = None  # [V] float32 proposal the draft was sampled from (τ > 0)


class AdaDecodeDecoder:
    """Decoder protocol object (docs/design.md): ``generate(prompt_ids, max_new_tokens)``.

    Args:
        base_model: frozen HF Llama-family causal LM (``model.model.layers``, ``rotary_emb``,
            ``norm``, ``embed_tokens``; ``lm_head``).
        head: a :class:`heads.adadecode.AdaDecodeHead` (its ``layers`` and ``transforms``).
        gamma: threshold γ for every candidate layer (overrides the head config), or None.
        gamma_schedule: per-layer thresholds aligned with ``head.layers`` (overrides ``gamma``).
        max_inflight: cap on in-flight tokens (>= 1; 1 disables early exit); None = head config.
        eos_token_ids: stop ids; None = the model's generation-config / config eos id(s).
        temperature: 0 = greedy (token-for-token equal to vanilla greedy decoding); > 0 = lossless
            sampling at this temperature (distributed as :func:`decoding.vanilla.sample_generate`).
        seed: seed of the decoder's ``torch.Generator`` (all sampling randomness; τ > 0 only).

    Raises:
        ValueError: a schedule of the wrong length, ``max_inflight`` < 1, ``temperature`` < 0, or a base whose
            KV cache is not full attention (:func:`decoding.verify.check_full_attention_cache`).
    """

    def __init__(self, base_model, head, gamma: float | None = None, gamma_schedule: Sequence[float] | None = None,
                 max_inflight: int | None = None, eos_token_ids: Iterable[int] | None = None,
                 temperature: float = 0.0, seed: int = 0) -> None:
        check_full_attention_cache(base_model)  # rollback cuts cached positions by index
        self.model = base_model
        inner = _inner(base_model)
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        head_module, self.logit_map = base_model.get_output_embeddings(), logit_transform(base_model.config)
        # the base's logits of a post-norm hidden state: its LM head, then its own map (Gemma 2's soft-capping...)
        self.lm_head = lambda h: self.logit_map(head_module(h))
        self.L = int(base_model.config.num_hidden_layers)
        self.exit_layers = list(head.layers)
        if gamma_schedule is not None:
            sched = [float(g) for g in gamma_schedule]
            if len(sched) != len(self.exit_layers):
                raise ValueError(f"gamma_schedule={sched} needs one threshold per layer {self.exit_layers}")
            self.gammas = dict(zip(self.exit_layers, sched))
        elif gamma is not None:
            self.gammas = {layer: float(gamma) for layer in self.exit_layers}
        else:
            self.gammas = dict(head.gammas)
        self.max_inflight = int(max_inflight if max_inflight is not None else head.cfg["max_inflight"])
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight={self.max_inflight} must be >= 1")
        p = next(base_model.parameters())
        self.transforms = {layer: head.transforms[str(layer)].weight.detach().to(p.device, p.dtype)
                           for layer in self.exit_layers}
        # draft vocabulary (issue 13): the exits score only W[d2t] (N rows) and map back through d2t;
        # verification below still uses the full LM head, so the output is unchanged
        self.d2t = head.d2t.detach().to(p.device) if head.draft_vocab_size is not None else None
        self.exit_weight = (head_module.weight.detach().index_select(0, self.d2t) if self.d2t is not None
                            else head_module.weight.detach())
        self.vocab_size = int(head_module.weight.shape[0])
        if eos_token_ids is None:
            src = getattr(getattr(base_model, "generation_config", None), "eos_token_id", None)
            src = base_model.config.eos_token_id if src is None else src
            eos_token_ids = [] if src is None else (src if isinstance(src, (list, tuple)) else [src])
        self.eos = {int(e) for e in eos_token_ids}
        self.temperature = float(temperature or 0.0)
        if self.temperature < 0:
            raise ValueError(f"temperature={temperature!r} must be >= 0 (0 = greedy)")
        self.generator = torch.Generator(device=p.device)
        self.generator.manual_seed(int(seed))
        self.last_cache = None
        # low-precision parity accounting (decoding.margins): per emitted token, the top-2 logits of
        # the full-model row that chose it (None for the prefill's first token), in ``last_trace``
        self.trace_logits = False
        self.last_trace: list | None = None

    # -- pieces --------------------------------------------------------------------------------
    def head_logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """z^(ℓ) = W·T_ℓ·norm(h) for h [..., H] (model dtype) -> [..., V], or [..., N] over the draft
        vocabulary (W = W[d2t], column i = base token ``d2t[i]``), under the base's logit map."""
        return self.logit_map((self.norm(h) @ self.transforms[layer].T) @ self.exit_weight.T)

    def propose(self, layer: int, h: torch.Tensor, token: _Token) -> int | None:
        """The early-exit decision at candidate ``layer`` for the newest token (hidden h [H]):
        None if the head's max softmax < γ_ℓ; else its argmax (τ = 0), or a sample from the
        tempered head distribution q (τ > 0), which is stored as ``token.draft_q`` for
        verification.  (Tests override this to plant drafts.)

        With a draft vocabulary the confidence is the max of the *subset* softmax (a labelled
        deviation from the paper, whose head is full-vocabulary: see docs/draft_vocab.md), the draft is mapped
        back through ``d2t``, and at τ > 0 the proposal q is the subset distribution placed on the
        base vocabulary (zero outside), which §4.2's chain rule verifies losslessly."""
        z = self.head_logits(layer, h).float()
        zmax, arg = z.max(-1)
        conf = torch.exp(zmax - torch.logsumexp(z, -1))
        if float(conf) < self.gammas[layer]:
            return None
        if self.temperature == 0:
            return int(arg) if self.d2t is None else int(self.d2t[arg])
        q = warp(z, self.temperature)
        if self.d2t is None:
            token.draft_q = q
            return sample(q, self.generator)
        token.draft_q = torch.zeros(self.vocab_size, dtype=q.dtype, device=q.device).index_copy(0, self.d2t, q)
        return int(self.d2t[sample(q, self.generator)])

    def _start(self, token_id: int, pos: int, gen: int) -> _Token:
        ids = torch.tensor([token_id], device=self.embed.weight.device)
        return _Token(token_id, pos, gen, 0, self.embed(ids)[0])

    # -- the loop ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], dict]:
        """Greedy decoding of one prompt [T]; returns ``(tokens, stats)``.

        ``tokens``: generated ids (prompt excluded; eos included if emitted), equal to vanilla
        greedy decoding.  ``stats`` (all numbers): ``new_tokens``; ``layer_steps`` (sequential
        decoder-layer calls after prefill) and ``layer_steps_per_token`` = layer_steps /
        (new_tokens − 1) against vanilla's L (``vanilla_layer_steps_per_token``), their ratio
        ``layer_step_speedup``; ``token_layer_computations`` (Σ tokens per layer call, incl.
        discarded work); ``early_exits`` (drafts proposed), ``accepted_exits``, ``rejected_exits``,
        ``early_exit_rate`` = accepted_exits / new_tokens (share of emitted tokens predicted early),
        ``rejection_rate`` = rejected / (accepted + rejected), ``discarded_exits`` (drafts thrown
        away unverified because an earlier in-flight token was rejected); per layer ``exits_l<ℓ>`` and
        ``accepted_l<ℓ>``; ``head_evals``; ``max_inflight_seen``; ``seconds``, ``tokens_per_s``.
        The final cache is kept as ``self.last_cache`` (prompt + tokens[:-1] at every layer).

        Raises:
            ValueError: bad ``prompt_ids`` / ``max_new_tokens``, or T + ``max_new_tokens`` beyond the
                base's ``max_position_embeddings`` (:func:`decoding.vanilla.check_context_limit`).
        """
        prompt_ids = check_generate_args(prompt_ids, max_new_tokens, self.model)
        t0 = time.perf_counter()
        L = self.L
        cache, first, hidden = prefill(self.model, prompt_ids)
        if self.temperature > 0:
            first = sample(warp(self.lm_head(hidden[-1]), self.temperature), self.generator)
        P = int(prompt_ids.numel())
        out = [first]
        self._trace = [None] if self.trace_logits and self.temperature == 0 else None
        st = {"layer_steps": 0, "token_layer_computations": 0, "early_exits": 0, "accepted_exits": 0,
              "rejected_exits": 0, "head_evals": 0, "max_inflight_seen": 1}
        for layer in self.exit_layers:
            st[f"exits_l{layer}"] = 0
            st[f"accepted_l{layer}"] = 0
        exit_set = set(self.exit_layers)
        inflight: list[_Token] = []
        if first not in self.eos and max_new_tokens > 1:
            inflight = [self._start(first, P, 0)]
        while inflight:
            d = inflight[-1].depth
            if d == L:
                inflight = self._verify(inflight, cache, out, st, max_new_tokens)
                continue
            j = len(inflight) - 1
            while j > 0 and inflight[j - 1].depth == d:
                j -= 1
            group = inflight[j:]
            h = torch.stack([t.h for t in group]).unsqueeze(0)
            h = layer_step(self.model, d, h, group[0].pos, cache)[0]
            st["layer_steps"] += 1
            st["token_layer_computations"] += len(group)
            for t, hi in zip(group, h):
                t.h, t.depth = hi, d + 1
            newest = inflight[-1]
            if newest.draft is None and d + 1 in exit_set and len(inflight) < self.max_inflight:
                st["head_evals"] += 1
                tok = self.propose(d + 1, newest.h, newest)
                if tok is not None:
                    newest.draft, newest.draft_layer = int(tok), d + 1
                    st["early_exits"] += 1
                    st[f"exits_l{d + 1}"] += 1
                    gen = newest.gen + 1
                    if newest.draft not in self.eos and gen < max_new_tokens - 1:
                        inflight.append(self._start(newest.draft, newest.pos + 1, gen))
                        st["max_inflight_seen"] = max(st["max_inflight_seen"], len(inflight))
        seconds = time.perf_counter() - t0
        self.last_cache = cache
        self.last_trace = self._trace
        n = len(out)
        judged = st["accepted_exits"] + st["rejected_exits"]
        st.update({
            "new_tokens": n, "prefill_forwards": 1, "discarded_exits": st["early_exits"] - judged,
            "layer_steps_per_token": st["layer_steps"] / max(n - 1, 1),
            "vanilla_layer_steps_per_token": float(L),
            "layer_step_speedup": (L * (n - 1) / st["layer_steps"]) if st["layer_steps"] else 1.0,
            "early_exit_rate": st["accepted_exits"] / n,
            "rejection_rate": st["rejected_exits"] / judged if judged else 0.0,
            "seconds": seconds, "tokens_per_s": n / seconds if seconds > 0 else 0.0,
        })
        return out, st

    def summarize(self, stats: Sequence[dict]) -> dict:
        """Exact totals over several :meth:`generate` stats (the evaluator's ``decoder_summary``):
        ``early_exit_rate`` = Σ accepted_exits / Σ new_tokens, ``rejection_rate`` = Σ rejected /
        Σ (accepted + rejected), ``layer_steps_per_token`` = Σ layer_steps / Σ (new_tokens − 1)
        against vanilla's L, ``layer_step_speedup`` = L / that, and per-layer exit / accept counts;
        ``exit_attempt_rate`` = Σ (accepted + rejected) / Σ new_tokens is the share of emitted tokens
        that were predicted early (head confidence ≥ γ) and verified, right or wrong: validation's
        early-exit rate measured in decoding."""
        tot = {k: sum(int(s.get(k, 0)) for s in stats) for k in
               ["new_tokens", "layer_steps", "token_layer_computations", "early_exits", "accepted_exits",
                "rejected_exits", "head_evals"] + [f"{a}_l{l}" for l in self.exit_layers for a in ("exits", "accepted")]}
        steps_base = sum(max(int(s.get("new_tokens", 0)) - 1, 0) for s in stats)
        judged = tot["accepted_exits"] + tot["rejected_exits"]
        per_tok = tot["layer_steps"] / steps_base if steps_base else None
        tot.update({
            "discarded_exits": tot["early_exits"] - judged, "gammas": {str(l): g for l, g in self.gammas.items()},
            "max_inflight": self.max_inflight, "temperature": self.temperature,
            "early_exit_rate": tot["accepted_exits"] / tot["new_tokens"] if tot["new_tokens"] else None,
            "exit_attempt_rate": judged / tot["new_tokens"] if tot["new_tokens"] else None,
            "rejection_rate": tot["rejected_exits"] / judged if judged else None,
            "layer_steps_per_token": per_tok, "vanilla_layer_steps_per_token": self.L,
            "layer_step_speedup": self.L / per_tok if per_tok else None,
        })
        return tot

    def _target(self, logits: torch.Tensor, t: _Token) -> tuple[int, bool]:
        """The token emitted after in-flight token ``t`` from its full-model logits [V], and
        whether ``t``'s draft was accepted: greedy (argmax, METHODS §4.1) or, at τ > 0, the chain
        rule of §4.2 against the stored proposal (a sample from p* when ``t`` has no draft)."""
        if self.temperature == 0:
            f = int(greedy_ids(logits))
            return f, t.draft is not None and t.draft == f
        p = warp(logits, self.temperature)
        if t.draft is None:
            return sample(p, self.generator), False
        if t.draft_q is None:
            raise RuntimeError("a draft without its proposal distribution at temperature > 0")
        return verify_draft(p, t.draft_q, t.draft, self.generator)

    def _verify(self, inflight: list[_Token], cache, out: list[int], st: dict, max_new_tokens: int) -> list[_Token]:
        """All in-flight tokens are at depth L: verify the draft chain (greedy §4.1 or sampling
        §4.2), roll back on the first rejection, emit; return the new in-flight list ([] = finished)."""
        if any(t.depth != self.L for t in inflight):
            raise RuntimeError("verification with tokens below the last layer (bookkeeping bug)")
        h = torch.stack([t.h for t in inflight])
        logits = self.lm_head(self.norm(h))
        last = inflight[-1]
        for i, t in enumerate(inflight):
            f, accepted = self._target(logits[i], t)
            if self._trace is not None:  # the row that chose the token emitted next (greedy only)
                self._trace += top2(logits[i])
            if accepted:
                st["accepted_exits"] += 1
                st[f"accepted_l{t.draft_layer}"] += 1
                out.append(f)
                if i + 1 < len(inflight):
                    continue  # u_{i+1} is confirmed and already in the cache
                last = t
                break
            if t.draft is not None:
                st["rejected_exits"] += 1
            drop = len(inflight) - 1 - i
            if drop:
                cache.crop(-drop)
            out.append(f)
            last = t
            break
        if out[-1] in self.eos or len(out) >= max_new_tokens:
            return []
        return [self._start(out[-1], last.pos + 1, len(out) - 1)]
