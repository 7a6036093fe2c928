"""What a base model does to its LM head's product before it returns logits.

Most causal LMs return ``logits = W h`` for the final (post-norm) hidden state h.  Some do more,
in their ``ForCausalLM.forward`` and nowhere else, so code that applies the LM head to hidden
states itself (a draft head's soft teacher and draft probabilities, AdaDecode's exits and
verification, data prep's labels) must do it too or it scores with another distribution:

* final-logit soft-capping, ``c · tanh(z / c)`` with ``c = final_logit_softcapping`` (Gemma 2, §2 of
  the Gemma 2 report; Gemma 3 and others when the config sets it);
* a multiplier ``logit_scale`` (Cohere, Command R);
* a divisor ``logits_scaling`` (IBM Granite).

:func:`logit_transform` reads them from a config; :func:`check_logit_transform` proves on one short
forward that a loaded base's logits are that transform of its LM head's product, so a base that
changes its logits some other way is refused by name instead of being silently drafted against the
wrong distribution.  All three maps are strictly increasing, so greedy labels and argmax drafts are
unchanged by them; probabilities (teachers, temperature sampling, confidence thresholds γ) are not.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitTransform:
    """``z ↦ softcap · tanh(scale · z / softcap)`` (or ``scale · z`` with no cap), applied to an LM head's
    product z [..., V] in z's dtype.

    Attributes:
        scale: the multiplier (Cohere's ``logit_scale``, 1 / Granite's ``logits_scaling``; 1.0 = none).
        softcap: the soft cap c > 0 (Gemma's ``final_logit_softcapping``), or None.
    """

    scale: float = 1.0
    softcap: float | None = None

    @property
    def is_identity(self) -> bool:
        """True when the map is z ↦ z (Llama, Qwen, Mistral...); calling it then returns z itself."""
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """z [..., V] → transformed [..., V], same dtype; z itself when the map is the identity."""
        if self.scale != 1.0:
            z = z * self.scale
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def derivative(self, out: torch.Tensor) -> torch.Tensor:
        """dz_out/dz at every element, from the transformed logits ``out`` [..., V] themselves:
        ``scale · (1 − (out / softcap)²)`` (``scale`` with no cap), for a chain rule through the map
        (:func:`losses.linear_soft_ce.linear_soft_cross_entropy`)."""
        if self.softcap is None:
            return torch.full_like(out, self.scale)
        return (1.0 - (out / self.softcap).square()).mul_(self.scale)


def logit_transform(config) -> LogitTransform:
    """The transform a base with this ``transformers.PretrainedConfig`` applies to ``W h`` (its text config
    for a multimodal one): soft-capping, ``logit_scale`` and ``logits_scaling`` as transformers' modelling
    code applies them (Gemma2ForCausalLM, CohereForCausalLM, GraniteForCausalLM).

    Raises:
        ValueError: a cap or divisor that is not a positive number, naming the config key.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = 1.0
    if getattr(cfg, "logit_scale", None) is not None:
        scale *= float(cfg.logit_scale)
    div = getattr(cfg, "logits_scaling", None)
    if div is not None:
        if not float(div) > 0:
            raise ValueError(f"base config logits_scaling={div!r} must be > 0")
        scale /= float(div)
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap is not None and not float(cap) > 0:
        raise ValueError(f"base config final_logit_softcapping={cap!r} must be > 0 or null")
    return LogitTransform(scale=scale, softcap=None if cap is None else float(cap))


@torch.no_grad()
def check_logit_transform(model, name: str = "the base model", tokens: int = 4) -> LogitTransform:
    """Prove that ``model``'s logits are :func:`logit_transform` of its LM head applied to its last hidden
    state, on one forward over ``tokens`` token ids (a few milliseconds).

    Args:
        model: a loaded HF causal LM (``get_output_embeddings``, ``output_hidden_states``), eval mode.
        name: how the error names the model (its path).

    Returns:
        The transform (see :func:`logit_transform`).

    Raises:
        ValueError: the logits differ, so the base changes them in a way draftheads does not know; every
            draft head would then score against a distribution that is not the base's.
    """
    transform = logit_transform(model.config)
    p = next(model.parameters())
    vocab = int(model.get_output_embeddings().weight.shape[0])
    ids = (torch.arange(tokens, device=p.device) * 7919 + 11).remainder(vocab).unsqueeze(0)
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    ours = transform(model.get_output_embeddings()(out.hidden_states[-1])).float()
    theirs = out.logits.float()
    tol = 1e-4 if p.dtype == torch.float32 else 2e-2
    err = (ours - theirs).abs().max().item()
    if not err <= tol * max(1.0, theirs.abs().max().item()):
        raise ValueError(
            f"{name} ({type(model).__name__}) returns logits that are not its LM head's product of the final hidden "
            f"state (max difference {err:.3g}) under any transform draftheads applies (final_logit_softcapping, "
            f"logit_scale, logits_scaling; here {transform}): draft heads would be trained and verified against "
            "another distribution than the base's")
    return transform
