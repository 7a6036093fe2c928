"""EAGLE-3: multi-layer feature fusion and training-time test (Li et al., arXiv 2503.01840).

Architecture (paper §3.2 "Training-time test" and Fig. 5; public code ``SafeAILab/EAGLE``
``eagle/traineagle3/cnets.py``: ``Model``, ``LlamaDecoderLayeremb``, ``LlamaAttention``):

    g_t  = fc([hs[l_low]_t ; hs[l_mid]_t ; hs[l_high]_t])          fc: Linear(3H → H, no bias)
    a_t  = [RMSNorm_in(Emb(x_{t+1})) ; RMSNorm_hidden(g_t)]        (2H, the attention input)
    h_t  = g_t + Attn(a_t);  h_t = h_t + MLP(RMSNorm_post(h_t))    (one decoder layer, ``midlayer``)
    logits_t = LMHead_draft(RMSNorm_final(h_t))                     (own norm, own LM head over N draft tokens)

Slot t pairs the fused feature g_t with the next token x_{t+1} at RoPE position t and predicts
x_{t+2} (the base's greedy label at position t+1), as EAGLE-1/Falcon k = 1 do.

* **Layer ids** (``heads.layers``) use the HF ``hidden_states`` index of docs/design.md (hs[ℓ] =
  the residual stream entering decoder layer ℓ).  Default ``[2, L//2, L-3]``: the layers the
  EAGLE-3 code, SGLang (``LlamaForCausalLM.set_eagle3_layers_to_capture``) and vLLM
  (``get_eagle3_aux_hidden_state_layers``) capture before running layer ℓ, i.e. hs[ℓ].  The
  cache supplies them (``prep.layers``); the decoding runtime asks the base for them through the
  drafter's ``feature_layers``.
* **Draft vocabulary**: the shared mechanism of every head (:class:`heads.base.DraftHead`,
  :mod:`heads.draft_vocab`): ``heads.draft_vocab_size`` N (``auto`` / null / an int), the top N
  training labels of the cache, persistent ``d2t`` int64 [N] (absolute base ids, strictly
  increasing) and ``t2d`` bool [V]; :meth:`DraftHead.to_base_ids` / :meth:`DraftHead.to_draft_ids`
  map between them (the engines' ``d2t`` offsets d2t[d] − d are written by :mod:`heads.export`,
  EAGLE-3 ``scandata``).  Unlike the other heads, EAGLE-3 has its OWN trainable LM head
  ``trainable_lm_head`` [N, H], initialised from the base's rows W[d2t] (EAGLE-3 ``Model.__init__``
  loads the target head's rows; SpecForge does the same); the frozen W[d2t]
  (:meth:`DraftHead.draft_lm_head`) gives the soft teacher.
* **Out-of-vocabulary rule** (issue 13, as Falcon): a position whose greedy label lies outside the
  draft vocabulary leaves the CE term (``loss.target: greedy``); the soft teacher is restricted to
  the draft vocabulary and renormalised (its softmax over W[d2t]·f) and keeps every loss position.
  (EAGLE-3's code also drops those positions from the soft loss: ``position_mask = t2d[target]·loss_mask``.)
  Validation counts an OOV label as a miss.  ``oov_rate`` (step-0 loss positions with an OOV label) is logged.
* **Training-time test** (TTT, ``heads.ttt_steps`` S, default 7 as ``Model.length = 7``;
  ``heads.ttt_decay`` 0.8 as ``ploss_weight = 0.8**i`` in ``traineagle3/main.py``): step i
  feeds every slot its own step-(i−1) output h (pre-norm, the ``hidden_states_out`` of
  ``Model.forward``) with the data token x_{t+1+i} at RoPE position t+i, and is scored against
  the base's prediction at position t+1+i.  Attention at step i (the EAGLE-3 mask,
  :func:`losses.ttt.ttt_visibility`): query (i, t) sees the step-0 keys at positions s ≤ t (true features)
  and the keys of steps 1..i at the same slot t (its own chain), exactly what a depth-(i+1)
  draft token sees at decoding time.  It is computed as EAGLE's ``LlamaAttention.forward`` does:
  one causal score matrix against step 0 plus one diagonal score per later step (O(T² + S·T)
  per step, no Python loop over positions).

Loss: :func:`losses.eagle3.ttt_loss` (soft targets: each step through the fused LM head,
:class:`DraftLMHead`).  Decoding: :class:`decoding.eagle3.Eagle3Drafter` (EAGLE-2
dynamic tree).  Exports: :mod:`heads.export`.
"""
from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from core.config import override
from heads.base import DraftHead, Progress
from heads.layer_config import draft_layer_config
from heads.registry import register
from losses.eagle3 import TARGETS, soft_cross_entropy, ttt_combine, ttt_loss, ttt_step_masks
from losses.linear_soft_ce import linear_soft_cross_entropy
from losses.ttt import shift_left

DEFAULTS: dict[str, Any] = {
    "layers": None,
    "ttt_steps": 7,
    "ttt_decay": 0.8,
    "draft_vocab_size": "auto",
    "norm_before_residual": False,
    "loss": {"target": "soft"},
    "decoding": {"depth": 8, "topk": 10, "total_tokens": 60},
}


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/middle/high feature layers for a base of ``num_layers`` decoder layers.

    ``[2, L//2, L-3]`` in the hs index (SGLang ``set_eagle3_layers_to_capture(None)``, vLLM
    ``get_eagle3_aux_hidden_state_layers``, EAGLE ``modeling_llama_kv.py``); [2, 15, 27] for
    SmolLM2 (L = 30).

    Raises:
        ValueError: the three ids are not strictly increasing inside [1, L−1] (bases with fewer
            than 8 layers): set ``heads.layers`` explicitly.
    """
    ids = [2, num_layers // 2, num_layers - 3]
    if not (1 <= ids[0] < ids[1] < ids[2] <= num_layers - 1):
        raise ValueError(f"heads.layers: the default [2, L//2, L-3] = {ids} is not valid for a base with "
                         f"{num_layers} layers; set heads.layers to three increasing ids in [1, {num_layers - 1}]")
    return ids


def _merge(defaults: dict, given: dict) -> dict:
    out = copy.deepcopy(defaults)
    for key, value in (given or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def check_eagle3_config(c: dict[str, Any], num_layers: int | None = None, vocab_size: int | None = None) -> None:
    """Validate a merged ``heads`` section; raises ``ValueError`` naming the key.

    ``layers``: null or three strictly increasing ints in [1, L−1] (hs[0] is the embedding, hs[L]
    the post-norm output, neither is an EAGLE-3 feature); ``ttt_steps`` int ≥ 1; ``ttt_decay`` in
    (0, 1]; ``loss.target`` soft|greedy;
    ``decoding.depth`` ≥ 1, ``topk`` ≥ 1, ``total_tokens`` ≥ 1.
    """
    def bad(key, msg):
        raise ValueError(f"heads.{key}: {msg}")

    steps = c.get("ttt_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        bad("ttt_steps", f"must be an int >= 1 (1 = no training-time test), got {steps!r}")
    if not 0.0 < float(c["ttt_decay"]) <= 1.0:
        bad("ttt_decay", f"must lie in (0, 1], got {c['ttt_decay']!r}")
    layers = c.get("layers")
    if layers is not None:
        if not isinstance(layers, (list, tuple)) or len(layers) != 3 or not all(isinstance(x, int) for x in layers):
            bad("layers", f"must be null or three int layer ids (low, middle, high), got {layers!r}")
        if list(layers) != sorted(set(layers)):
            bad("layers", f"must be strictly increasing (the fc reads them in base-layer order), got {list(layers)}")
        if num_layers is not None and not all(1 <= x <= num_layers - 1 for x in layers):
            bad("layers", f"{list(layers)} lies outside the base's depth: ids are hs indices in [1, {num_layers - 1}] "
                          f"(the base has {num_layers} layers)")
    if vocab_size is not None:  # ``heads.draft_vocab_size`` (null | auto | 2..V): the shared rule of every head
        from heads.draft_vocab import check_size

        check_size(c.get("draft_vocab_size"), int(vocab_size))
    if not isinstance(c["norm_before_residual"], bool):
        bad("norm_before_residual", f"must be true or false, got {c['norm_before_residual']!r}")
    if c["loss"]["target"] not in TARGETS:
        bad("loss.target", f"{c['loss']['target']!r}; choices: {', '.join(TARGETS)}")
    for key in ("depth", "topk", "total_tokens"):
        v = c["decoding"].get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            bad(f"decoding.{key}", f"must be an int >= 1, got {v!r}")


class Eagle3Attention(nn.Module):
    """Self-attention whose q/k/v read the 2H input [embedding ; feature] (EAGLE ``LlamaAttention``).

    Parameter names follow HF/EAGLE (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``), so the
    export is a rename of the ``midlayer.`` prefix.  Grouped-query attention as the base config.
    """

    def __init__(self, config) -> None:
        super().__init__()
        H = int(config.hidden_size)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or H // self.num_heads)
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(2 * H, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * H, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * H, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=bias)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B,T,2H] → q [B,nh,T,hd], k, v [B,nkv,T,hd] with RoPE applied to q and k."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def _expand(self, kv: torch.Tensor) -> torch.Tensor:
        rep = self.num_heads // self.num_kv_heads
        return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def forward_ttt(self, x, cos, sin, past: list[tuple[torch.Tensor, torch.Tensor]], first_visible: torch.Tensor):
        """One TTT step, vectorised over slots (the EAGLE-3 mask of :func:`losses.ttt.ttt_visibility`).

        Args:
            x: [B,T,2H].  cos, sin: RoPE tables of this step's positions.
            past: (k, v) of steps 0..i−1 (empty at step 0).
            first_visible: bool [B,1,T,T], the step-0 key visibility (causal ∧ not padding).

        Returns:
            ``(out [B,T,H], (k, v))`` — this step's keys/values for later steps.
        """
        q, k, v = self.project(x, cos, sin)
        steps = list(past) + [(k, v)]
        k0, v0 = steps[0]
        scale = 1.0 / math.sqrt(self.head_dim)
        s0 = (q.float() @ self._expand(k0).float().transpose(-1, -2)) * scale  # [B,nh,T,T]
        s0 = s0.masked_fill(~first_visible, float("-inf"))
        diag = [((q.float() * self._expand(kj).float()).sum(-1) * scale)[..., None] for kj, _ in steps[1:]]
        p = torch.softmax(torch.cat([s0] + diag, dim=-1), dim=-1)
        T = x.shape[1]
        o = p[..., :T] @ self._expand(v0).float()
        for j, (_, vj) in enumerate(steps[1:]):
            o = o + p[..., T + j: T + j + 1] * self._expand(vj).float()  # slot t's own step-j value
        return self._out(o.to(x.dtype)), (k, v)

    def forward_cached(self, x, cos, sin, cache, mask: torch.Tensor) -> torch.Tensor:
        """Decoding: append this chunk's k/v to ``cache`` (``update(k, v, 0)``) and attend with an
        additive mask [1,1,T,S] (0 visible, finfo.min hidden).  x [1,T,2H] → [1,T,H]."""
        q, k, v = self.project(x, cos, sin)
        k, v = cache.update(k, v, 0)
        o = torch.nn.functional.scaled_dot_product_attention(q, self._expand(k), self._expand(v),
                                                             attn_mask=mask.to(q.dtype))
        return self._out(o)


class Eagle3DecoderLayer(nn.Module):
    """EAGLE-3's ``midlayer`` (EAGLE ``LlamaDecoderLayeremb``; SGLang ``llama_eagle3.LlamaDecoderLayer``).

    residual = h (``norm_before_residual: false``, EAGLE/SGLang) or RMSNorm_hidden(h) (``true``,
    vLLM ``_norm_before_residual``); a = [RMSNorm_in(emb) ; RMSNorm_hidden(h)]; h = residual +
    Attn(a); h = h + MLP(RMSNorm_post(h)).
    """

    def __init__(self, config, norm_before_residual: bool = False) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        H, eps = int(config.hidden_size), float(getattr(config, "rms_norm_eps", 1e-6))
        self.norm_before_residual = bool(norm_before_residual)
        self.self_attn = Eagle3Attention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(H, eps=eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=eps)

    def forward(self, emb: torch.Tensor, h: torch.Tensor, attend) -> tuple[torch.Tensor, Any]:
        """emb, h [B,T,H]; ``attend(x [B,T,2H]) -> (out [B,T,H], extra)`` → (h' [B,T,H], extra)."""
        normed = self.hidden_norm(h)
        residual = normed if self.norm_before_residual else h
        a, extra = attend(torch.cat([self.input_layernorm(emb), normed], dim=-1))
        h = residual + a
        return h + self.mlp(self.post_attention_layernorm(h)), extra


class DraftLMHead(nn.Linear):
    """EAGLE-3's trainable LM head over the draft vocabulary: weight [N, H], no bias.

    ``head(x)`` gives the logits [..., N] (``nn.Linear``).  ``head(x, probs=p)`` gives a TTT step's
    summed soft cross-entropy against the teacher p [M, N] and the argmax of each row [M] through
    :func:`losses.linear_soft_ce.linear_soft_cross_entropy`, which takes the gradients in its forward
    and never keeps the [M, N] logits.  It runs inside this module's call so that ZeRO-3 gathers the
    weight for it; a ZeRO-3 partitioned weight (``ds_id``) takes the autograd path instead, whose
    backward ZeRO-3 re-gathers the weight for.
    """

    def __init__(self, hidden_size: int, num_tokens: int) -> None:
        super().__init__(hidden_size, num_tokens, bias=False)

    def forward(self, x: torch.Tensor, probs: torch.Tensor | None = None):
        if probs is None:
            return super().forward(x)
        if hasattr(self.weight, "ds_id"):
            z = super().forward(x).float()
            return soft_cross_entropy(z, probs).sum(), z.argmax(-1)
        out = linear_soft_cross_entropy(x, self.weight, probs)
        return out.loss, out.argmax


@register
class Eagle3Head(DraftHead):
    """The EAGLE-3 draft head (module docstring).

    Config (``configs/heads/eagle3.yaml``): ``layers`` (null = [2, L//2, L−3]), ``ttt_steps``,
    ``ttt_decay``, ``draft_vocab_size`` (shared key: auto | null = full | N), ``norm_before_residual``, ``loss.target``
    (soft = cross-entropy against the base's softmax over the draft vocabulary, as EAGLE's
    ``Model.forward``; greedy = against the greedy label), ``decoding`` (``depth``, ``topk``,
    ``total_tokens``: :class:`decoding.eagle3.Eagle3Drafter`).

    Trainable: ``fc`` [H, 3H], ``midlayer.*``, ``norm`` [H], ``trainable_lm_head`` [N, H] (N = V
    without a draft vocabulary; initialised from the base LM head's rows W[d2t] once both the base
    and the mapping are present, on a freshly built head).  With a draft vocabulary the shared
    persistent buffers ``d2t`` [N] int64 / ``t2d`` [V] bool (:class:`heads.base.DraftHead`) are saved.
    The trainable head is not named ``draft_lm_head``: that is the base class's frozen W[d2t] method.

    Raises:
        ValueError: a bad config value (the message names the key), incl. layer ids outside the
            base's depth and ``ttt_steps`` < 1.
    """

    head_type = "eagle3"

    @staticmethod
    def check_config(cfg: dict[str, Any]) -> None:
        """Validate a ``heads`` section without the base (config-time check)."""
        check_eagle3_config(_merge(DEFAULTS, dict(cfg)))

    def __init__(self, cfg: dict[str, Any], base_config) -> None:
        merged = _merge(DEFAULTS, dict(cfg))
        L = int(base_config.num_hidden_layers)
        check_eagle3_config(merged, num_layers=L, vocab_size=int(base_config.vocab_size))
        if merged["layers"] is None:
            merged["layers"] = default_layers(L)
        super().__init__(merged, base_config)
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        from core.rope import RotaryEmbedding

        H = self.hidden_size
        self.layers = [int(x) for x in merged["layers"]]
        self.ttt_steps = int(merged["ttt_steps"])
        layer_cfg = draft_layer_config(base_config)
        self.layer_config = layer_cfg
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = Eagle3DecoderLayer(layer_cfg, norm_before_residual=merged["norm_before_residual"])
        self.norm = LlamaRMSNorm(H, eps=float(layer_cfg.rms_norm_eps))
        # own trainable head; not `lm_head` / `draft_lm_head` (DraftHead's frozen W / W[d2t] methods)
        self.trainable_lm_head = DraftLMHead(H, self.num_draft_tokens)
        self.rotary_emb = RotaryEmbedding(layer_cfg)
        std = float(getattr(base_config, "initializer_range", 0.02))
        for module in (self.fc, self.midlayer):
            for sub in module.modules():
                if isinstance(sub, nn.Linear):
                    nn.init.normal_(sub.weight, std=std)
                    if sub.bias is not None:
                        nn.init.zeros_(sub.bias)
        self._weights_loaded = False
        self._lm_head_from_base = False  # trainable_lm_head already copied from W[d2t]
        self.register_load_state_dict_post_hook(lambda module, keys: setattr(module, "_weights_loaded", True))

    # -- base, vocabulary --------------------------------------------------------------------------
    @property
    def required_cache_layers(self) -> list[int]:
        """hs[ℓ] for the three feature layers (``prep.layers``)."""
        return list(self.layers)

    @classmethod
    def cache_layers_for(cls, cfg: dict[str, Any], num_layers: int) -> list[int]:
        """``heads.layers``, or :func:`default_layers` of the base's ``num_layers`` when null."""
        layers = _merge(DEFAULTS, dict(cfg))["layers"]
        return [int(x) for x in layers] if layers is not None else default_layers(int(num_layers))

    @property
    def feature_layers(self) -> list[int]:
        """The hs ids the decoding runtime must hand the drafter, concatenated in this order."""
        return list(self.layers)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def _slice_draft_lm_head(self) -> None:
        """Base class: W[d2t] once base and mapping exist (on :meth:`attach_base` and after
        :meth:`set_draft_vocab`, in either order).  Here also: a freshly built head copies those
        frozen rows into its own ``trainable_lm_head`` (EAGLE-3 initialises from the target's head);
        a loaded checkpoint (``load_state_dict``) keeps its trained rows."""
        super()._slice_draft_lm_head()
        if (getattr(self, "_weights_loaded", True) or self._lm_head_from_base or not hasattr(self, "lm_head_weight")):
            return  # loaded / trained rows are never overwritten by a later attach_base
        rows = self.draft_lm_head_rows
        with torch.no_grad():
            self.trainable_lm_head.weight.copy_(rows.to(self.trainable_lm_head.weight))
        self._lm_head_from_base = True

    def set_draft_vocab(self, vocab, info: dict[str, Any] | None = None) -> None:
        """:meth:`DraftHead.set_draft_vocab`; a freshly built head re-initialises ``trainable_lm_head``
        from the new rows W[d2t] (if the base is attached; else on :meth:`attach_base`)."""
        if not self._weights_loaded:
            self._lm_head_from_base = False
        super().set_draft_vocab(vocab, info)

    # -- model -------------------------------------------------------------------------------------
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """g = fc(aux): aux [..., 3H] (low ; mid ; high) → [..., H] in the compute dtype."""
        return self.fc(aux.to(self.compute_dtype))

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM head over the draft vocabulary: h [..., H] (pre-norm layer output) → [..., N] float32.

        The product runs in the compute dtype, or in autocast's (bf16 under ``bf16-mixed``, as
        EAGLE-3's and SpecForge's trainers run their draft LM head); the logits, and the loss
        taken from them, are float32.
        """
        return self.trainable_lm_head(self.norm(h)).float()

    def _rope(self, h: torch.Tensor, pos: torch.Tensor):
        return self.rotary_emb(h, pos)

    def ttt_forward(self, aux: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, steps: int | None = None) -> list[torch.Tensor]:
        """Unrolled training forward: per TTT step i the layer outputs h^(i) [B,T,H] (pre-norm).

        Args:
            aux: [B,T,3H] the concatenated feature layers hs[low]; hs[mid]; hs[high] at every position.
            ids: [B,T] long input ids x_0..x_{T−1}.
            valid: [B,T] bool, not padding.
            steps: S (default ``heads.ttt_steps``).

        Step i: slot t reads (h^(i−1)_t, or g_t at i = 0) and the token x_{t+1+i} (0 past the end)
        at RoPE position t+i; attention per :func:`losses.ttt.ttt_visibility`.
        """
        S = self.ttt_steps if steps is None else int(steps)
        B, T = ids.shape
        h = self.fuse(aux)
        first = (torch.arange(T, device=ids.device)[None, :] <= torch.arange(T, device=ids.device)[:, None])
        first = (first[None] & valid.bool()[:, None, :])[:, None]  # [B,1,T,T]
        past: list[tuple[torch.Tensor, torch.Tensor]] = []
        outs = []
        attn = self.midlayer.self_attn
        for i in range(S):
            tok = shift_left(ids, 1 + i, 0)
            pos = (torch.arange(T, device=ids.device) + i)[None].expand(B, T)
            cos, sin = self._rope(h, pos)
            h, kv = self.midlayer(self.embed(tok).to(h.dtype), h,
                                  lambda x: attn.forward_ttt(x, cos, sin, past, first))
            past.append(kv)
            outs.append(h)
        return outs

    def forward_cached(self, feats: torch.Tensor, tokens: torch.Tensor, position_ids: torch.Tensor,
                       mask: torch.Tensor, cache) -> torch.Tensor:
        """Decoding forward of new slots against a KV ``cache`` (see ``decoding.falcon.DraftKVCache``).

        Args:
            feats: [1,n,H] per-slot hidden input (fc-fused true features, or a draft slot's parent output).
            tokens: [1,n] long, the slot tokens.  position_ids: [1,n] long.
            mask: additive [1,1,n,S] over the cached + new slots.

        Returns:
            h [1,n,H] (pre-norm; :meth:`draft_logits` gives the distribution of the next token).
        """
        h = feats.to(self.compute_dtype)
        cos, sin = self._rope(h, position_ids)
        attn = self.midlayer.self_attn
        out, _ = self.midlayer(self.embed(tokens).to(h.dtype), h,
                               lambda x: (attn.forward_cached(x, cos, sin, cache, mask), None))
        return out

    # -- data --------------------------------------------------------------------------------------
    def _features(self, batch: dict[str, Any]) -> torch.Tensor:
        aux = {int(k): v for k, v in (batch.get("aux_hidden") or {}).items()}
        missing = [l for l in self.layers if l not in aux]
        if missing:
            raise KeyError(f"the eagle3 head reads hs{self.layers} but the batch's aux_hidden holds layers {sorted(aux)} "
                           f"(missing {missing}); prepare the cache with {override('prep.layers', self.layers)}")
        return torch.cat([aux[l].to(self.compute_dtype) for l in self.layers], dim=-1)

    def _targets(self, batch: dict[str, Any], used: torch.Tensor, masks: list[torch.Tensor]):
        """Per step i: (soft target probabilities [M_i, N] float32 or draft ids [M_i] (−1 = outside
        the draft vocabulary, dropped from the CE), greedy labels [M_i] (base ids)).

        Soft teacher: softmax(W[d2t]·f) in fp32 (:meth:`DraftHead.draft_lm_head`), i.e. the base's
        distribution restricted to the draft vocabulary and renormalised.  The base's distribution
        at a position is the same for every step that scores it, so it is computed once for the
        positions ``used`` ([B, T] bool, the targets any step reads) and step i reads the rows of
        positions t+1+i.
        """
        labels = batch["labels"][used]
        soft = self.cfg["loss"]["target"] == "soft"
        if soft:
            hid = batch["hidden"][used]
            with torch.autocast(device_type=hid.device.type, enabled=False):
                teacher = torch.softmax(self.draft_lm_head(hid.float()), dim=-1)  # once for every step
        # Step i's rows (slots t with t+1+i in ``used``, row-major) are the used positions p = t+1+i
        # with p >= 1+i, in the same order: a boolean row selection, and none at all (no [M, N]
        # copy) when every used position lies past 1+i, as assistant positions do.
        pos = torch.arange(used.shape[1], device=used.device).expand_as(used)[used]
        out = []
        for i in range(len(masks)):
            keep = pos >= 1 + i
            whole = bool(keep.all())
            lab = labels if whole else labels[keep]
            if soft:
                out.append((teacher if whole else teacher[keep], lab))
            else:
                out.append((self.to_draft_ids(lab), lab))
        return out

    def _run(self, batch: dict[str, Any]):
        """The unrolled forward and its loss: ``(steps, masks, targets, loss, parts, argmax)``.

        ``steps``/``masks`` as :meth:`ttt_forward`/:func:`ttt_step_masks`, ``targets`` as
        :meth:`_targets`, ``loss, parts`` as :func:`ttt_loss`, ``argmax`` per step the draft argmax
        [M_i] (draft ids).  Soft targets: each step's CE from the fused LM head
        (:class:`DraftLMHead` with ``probs``, no [M_i, N] logits kept); greedy: logits and
        :func:`ttt_loss`.
        """
        ids = batch["input_ids"]
        valid = batch["attention_mask"].bool()
        lm = batch["loss_mask"].bool() & valid
        steps = self.ttt_forward(self._features(batch), ids, valid)
        masks = ttt_step_masks(lm, len(steps))
        targets = self._targets(batch, lm, masks)
        decay = float(self.cfg["ttt_decay"])
        if self.cfg["loss"]["target"] == "soft":
            sums, argmax = zip(*[self.trainable_lm_head(self.norm(h[m]), probs=p)
                                 for h, m, (p, _) in zip(steps, masks, targets)])
            loss, parts = ttt_combine(list(sums), [a.shape[0] for a in argmax], decay)
        else:
            logits = [self.draft_logits(h[m]) for h, m in zip(steps, masks)]
            loss, parts = ttt_loss(logits, [t[0] for t in targets], decay)
            argmax = [lg.argmax(-1) for lg in logits]
        return steps, masks, targets, loss, parts, list(argmax)

    def _oov(self, labels: torch.Tensor) -> torch.Tensor:
        """[M] bool: the greedy label (base id) lies outside the draft vocabulary (all False if full)."""
        return self.to_draft_ids(labels) < 0

    # -- training ----------------------------------------------------------------------------------
    def training_loss(self, batch: dict[str, Any], progress: Progress) -> tuple[torch.Tensor, dict[str, float]]:
        """Σ_i ttt_decay^i · CE_i over the TTT steps (:func:`losses.eagle3.ttt_loss`).

        Metrics: ``loss``, ``loss_step<i>`` and ``acc_step<i>`` (top-1 agreement of the draft
        argmax, mapped to target ids, with the greedy label; an OOV label is a miss),
        ``loss_tokens`` (step-0 positions), ``oov_rate`` (step-0 positions whose greedy label lies
        outside the draft vocabulary; they leave the greedy CE, the soft teacher keeps them).
        """
        steps, masks, targets, loss, parts, argmax = self._run(batch)
        loss = loss + 0.0 * sum(h.sum() for h in steps)  # keep every parameter in the graph (DDP) on empty steps
        lab0 = targets[0][1]
        metrics = {"loss": float(loss.detach()), "loss_tokens": float(masks[0].sum()),
                   "oov_rate": float(self._oov(lab0).sum()) / max(lab0.numel(), 1)}
        for i, (am, (_, lab)) in enumerate(zip(argmax, targets)):
            metrics[f"loss_step{i}"] = float(parts[i])
            hit = self.to_base_ids(am) == lab if am.shape[0] else torch.zeros(0, dtype=torch.bool)
            metrics[f"acc_step{i}"] = float(hit.float().mean()) if hit.numel() else 0.0
        return loss, metrics

    @torch.no_grad()
    def validation_metrics(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """``loss`` (Σ weighted CE · M0, M0), ``acc_step<i>`` (hits, M_i), ``oov_rate`` (OOV step-0
        labels, M0) and ``sim_tau``.

        ``sim_tau`` (METHODS §5.1, bonus included): an anchor is a slot t with a step-0 loss
        position; depth d = i+1 is correct iff step i's draft argmax equals the greedy label at
        t+1+i and that position is a loss position; τ(t) = 1 + the leading correct depths over the
        S TTT steps.  Step i reads the drafter's own hidden states (as decoding does) but the data
        tokens, so it is the chain acceptance of decoding exactly when the data tokens are the
        base's greedy output (``labels=regenerate``), an optimistic proxy otherwise.
        """
        steps, masks, targets, loss, _, argmax = self._run(batch)
        B, T = masks[0].shape
        alive = masks[0].clone()
        tau = masks[0].float()
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, (m, am, (_, lab)) in enumerate(zip(masks, argmax, targets)):
            hit = torch.zeros(B, T, dtype=torch.bool, device=m.device)
            hit[m] = self.to_base_ids(am) == lab
            out[f"acc_step{i}"] = (hit.sum().float(), m.sum().float())
            alive = alive & hit
            tau = tau + alive.float()
        M0 = masks[0].sum().float()
        out["loss"] = (loss.detach().float() * M0, M0)
        out["sim_tau"] = (tau[masks[0]].sum(), M0)
        out["oov_rate"] = (self._oov(targets[0][1]).sum().float(), M0)
        return out

    # -- decoding ----------------------------------------------------------------------------------
    def make_drafter(self, base_model=None, **kwargs):
        """A :class:`decoding.eagle3.Eagle3Drafter`; ``eval.decoding`` (a map over
        ``heads.decoding``: ``depth``, ``topk``, ``total_tokens``) overrides the checkpoint's
        values; every other kwarg is ignored.

        Raises:
            ValueError: a bad override (names the key), or ``base_model`` has fewer layers than the
                head's feature layers need (a head trained for another base).
        """
        from decoding.eagle3 import Eagle3Drafter

        if base_model is not None:
            L = int(base_model.config.num_hidden_layers)
            if max(self.layers) > L - 1:
                raise ValueError(f"the eagle3 head reads hs{self.layers} but the base model has {L} layers "
                                 "(was it trained for another base?)")

        dec = dict(self.cfg["decoding"])
        over = kwargs.get("decoding") or {}
        unknown = sorted(set(over) - set(dec))
        if unknown:
            raise ValueError(f"eval.decoding: unknown key(s) {unknown} for the eagle3 head; keys: {', '.join(sorted(dec))}")
        dec.update(over)
        check_eagle3_config({**self.cfg, "decoding": dec})
        return Eagle3Drafter(self, depth=int(dec["depth"]), topk=int(dec["topk"]), total_tokens=int(dec["total_tokens"]))
