"""RoPE's inverse frequencies stay fp32 whatever dtype a module is cast to.

``transformers`` computes rotary cos/sin in fp32 from the buffer ``inv_freq`` [head_dim / 2]
(``LlamaRotaryEmbedding.forward``), and ``from_pretrained(dtype=torch.bfloat16)`` leaves that buffer
fp32.  A plain ``module.to(torch.bfloat16)`` does not: it rounds ``inv_freq`` to 8 mantissa bits, so
the angle at position p is off by up to p · 2⁻⁹ · inv_freq[i] (SmolLM2, θ = 1e5, head_dim 64: about
0.14 rad at position 100 and 0.7 rad at 500; transformers issue 29496).  Every cast this project
makes of a module that holds a rotary embedding goes through here, so that:

* online and hybrid features equal the cache's in bf16 (data prep loads the base with
  ``from_pretrained(dtype=...)``, online training used to cast a copy with ``.to``);
* a draft head evaluated in bf16 rotates with the angles it was trained with (bf16-mixed training
  keeps the head's buffers fp32; the evaluation casts the head to the base's dtype).

:class:`RotaryEmbedding` is the heads' rotary embedding: ``LlamaRotaryEmbedding`` whose fp32 RoPE
buffers survive any cast (``.to``, ``.bfloat16()``, Lightning's ``bf16-true`` conversion), moved to
the new device only.  :func:`cast_module` does the same for any module tree, e.g. a Hugging Face base.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

__all__ = ["ROPE_BUFFERS", "RotaryEmbedding", "cast_module"]

#: buffer names holding RoPE inverse frequencies (transformers' rotary embeddings)
ROPE_BUFFERS = ("inv_freq", "original_inv_freq")


def _fp32_rope_buffers(module: nn.Module) -> dict[tuple[nn.Module, str], torch.Tensor]:
    """(owner, name) -> the fp32 RoPE buffers of ``module`` and its submodules, as they are now."""
    return {(m, n): b for m in module.modules() for n, b in m._buffers.items()
            if n in ROPE_BUFFERS and b is not None and b.dtype == torch.float32}


def _restore(saved: dict[tuple[nn.Module, str], torch.Tensor]) -> None:
    """Put back each saved fp32 buffer that a cast changed the dtype of, on the buffer's new device."""
    for (owner, name), old in saved.items():
        new = owner._buffers.get(name)
        if new is not None and new.dtype != torch.float32:
            owner._buffers[name] = old.to(new.device)


class RotaryEmbedding(LlamaRotaryEmbedding):
    """``LlamaRotaryEmbedding`` (same forward, same ``inv_freq``) whose fp32 RoPE buffers keep their
    dtype through any module cast; a device move still moves them.

    Args:
        config: the Llama-style config of the layer it rotates for (``rope_parameters``, ``head_dim``).
    """

    def _apply(self, fn, recurse: bool = True):
        saved = _fp32_rope_buffers(self)
        out = super()._apply(fn, recurse)
        _restore(saved)
        return out


def cast_module(module: nn.Module, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> nn.Module:
    """``module.to(device=device, dtype=dtype)`` in place, with every fp32 RoPE buffer (:data:`ROPE_BUFFERS`)
    kept fp32 (moved to ``device``), as ``from_pretrained(dtype=...)`` leaves it.

    Args:
        module: any module tree (a Hugging Face causal LM, a draft head).
        dtype: the floating dtype for its parameters and other floating buffers (None: unchanged).
        device: the device to move it to (None: unchanged).

    Returns:
        ``module`` itself.
    """
    saved = _fp32_rope_buffers(module)
    module.to(device=device, dtype=dtype)
    _restore(saved)
    return module
