"""The config of a draft head's decoder layer: a Llama layer sized like the base.

Every head here drafts with transformers' Llama decoder layer (EAGLE, EAGLE-3, Falcon and CTC-drafter all
do, whatever the target; SpecForge and speculators write ``LlamaForCausalLM`` into the draft's config).
The layer reads its sizes from a config.  A Llama base's config is that config; any other base's (Gemma 2,
Qwen 2, Cohere...) lacks keys the Llama layer reads (``mlp_bias``, ``attention_bias``, ``hidden_act``) or
names them otherwise, so :func:`draft_layer_config` translates it into a ``LlamaConfig`` with the base's
sizes, norm epsilon and rotary embedding.
"""
from __future__ import annotations

import copy

from transformers import LlamaConfig


def _rope(cfg) -> dict:
    """The base's global-attention rotary parameters (Gemma 3 keeps one set per layer type)."""
    rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": float(getattr(cfg, "rope_theta", 10000.0))}
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = rope["full_attention"]
    return dict(rope)


def draft_layer_config(base_config, attn_implementation: str | None = None) -> LlamaConfig:
    """A ``LlamaConfig`` for a draft head's decoder layer(s) over ``base_config`` (its text config for a
    multimodal base).

    A Llama base's own config is copied unchanged (the heads of record were built so).  Any other base
    gives a Llama config with its vocabulary, hidden and intermediate sizes, attention and key-value heads,
    head_dim, context length, initializer range, RMS-norm epsilon (``rms_norm_eps``, or ``layer_norm_eps``)
    and global-attention rotary parameters; the activation is the base's ``hidden_act`` where it names one,
    else SiLU; no attention or MLP bias.

    Args:
        base_config: the base's ``transformers.PretrainedConfig``.
        attn_implementation: the layer's attention (``eager``, ``sdpa``...), or None to keep the default.

    Returns:
        A new config (the base's is never modified).
    """
    src = base_config.get_text_config() if hasattr(base_config, "get_text_config") else base_config
    if isinstance(src, LlamaConfig):
        out = copy.deepcopy(src)
    else:
        heads = int(src.num_attention_heads)
        out = LlamaConfig(
            vocab_size=int(src.vocab_size), hidden_size=int(src.hidden_size),
            intermediate_size=int(src.intermediate_size), num_hidden_layers=int(src.num_hidden_layers),
            num_attention_heads=heads, num_key_value_heads=int(getattr(src, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(src, "head_dim", None) or int(src.hidden_size) // heads),
            hidden_act=getattr(src, "hidden_act", None) or "silu",
            max_position_embeddings=int(getattr(src, "max_position_embeddings", 4096)),
            initializer_range=float(getattr(src, "initializer_range", 0.02)),
            rms_norm_eps=float(getattr(src, "rms_norm_eps", None) or getattr(src, "layer_norm_eps", None) or 1e-6),
            rope_parameters=_rope(src), attention_bias=False, mlp_bias=False)
    if attn_implementation is not None:
        out._attn_implementation = attn_implementation
    return out
