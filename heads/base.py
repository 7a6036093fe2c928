"""The draft-head interface every method implements, and the borrowed frozen base weights.

A draft head is an ``nn.Module`` that

* is built from its config section (``configs/heads/<name>.yaml``) and the base model's
  ``PretrainedConfig`` (:meth:`DraftHead.__init__`);
* borrows the base model's frozen token embedding, final norm (module) and LM head through
  :meth:`DraftHead.attach_base`.  They are registered as *non-persistent buffers*: never in a
  head checkpoint, never trained, and never partitioned by DeepSpeed ZeRO-3 (which shards
  parameters only), so every rank holds them whole and the export stays readable;
* computes its training loss and validation metrics from a cached batch
  (see ``data_prep.cache.collate`` for the batch keys and shapes);
* builds a drafter for the lossless speculative-decoding runtime in ``decoding/``.

* optionally drafts over a draft vocabulary of N frequent tokens (``heads.draft_vocab_size``,
  :mod:`heads.draft_vocab`): :meth:`DraftHead.draft_lm_head` scores the frozen rows W[d2t].

Checkpoint format (written by :func:`heads.save`, read by :func:`heads.load`): a directory with
``model.safetensors`` (trainable head weights only, plus ``d2t`` / ``t2d`` with a draft
vocabulary) and ``config.json`` (head type, every hyperparameter incl. ``draft_vocab_size`` and
``draft_vocab``, the base model's identity and vocab size).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from core.frozen_linear import FrozenLinear
from core.logit_transform import logit_transform


#: ``heads`` keys every head accepts (handled here, not by the head class): the draft vocabulary
#: size N (null = full vocabulary) and its provenance (written by :meth:`DraftHead.set_draft_vocab`).
SHARED_KEYS = ("draft_vocab_size", "draft_vocab")


def frozen_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters are non-persistent buffers: it computes exactly what
    ``module`` does, is never trained, saved or partitioned by ZeRO-3, and moves with its owner."""
    import copy

    out = copy.deepcopy(module)
    for sub in out.modules():
        for name, p in list(sub._parameters.items()):
            del sub._parameters[name]
            sub.register_buffer(name, None if p is None else p.detach(), persistent=False)
    # in a new module's mode, then its owner's: a copy of the (eval-mode) base's module stayed in eval mode, so
    # Lightning warned of a module "in eval mode at the start of training" on every run (a norm computes alike in both)
    return out.train()


@dataclass(frozen=True)
class Progress:
    """Where training is, for schedules such as Falcon's glancing ratio λ.

    ``step`` counts optimizer steps from 0; ``epoch`` counts epochs from 0; totals are the
    configured budgets (``total_steps`` >= 1, ``total_epochs`` >= 1).
    """

    step: int = 0
    total_steps: int = 1
    epoch: int = 0
    total_epochs: int = 1


class DraftHead(nn.Module):
    """Base class of every draft head.

    Subclasses set ``head_type`` (the registry name, e.g. ``"ctc"``), and implement
    :meth:`training_loss`, :meth:`validation_metrics` and :meth:`make_drafter`.

    Args:
        cfg: the plain-dict ``heads`` config section (hyperparameters); stored as ``self.cfg``
            and written to ``config.json`` on save.
        base_config: the base model's ``transformers.PretrainedConfig``.
    """

    head_type: ClassVar[str] = ""
    #: validation metric (a key of :meth:`validation_metrics`) that selects the best checkpoint,
    #: logged as ``val/<monitor_metric>``; heads without a simulated τ use ``"loss"`` / ``"min"``.
    monitor_metric: ClassVar[str] = "sim_tau"
    monitor_mode: ClassVar[str] = "max"  # "max" | "min"

    @property
    def required_cache_layers(self) -> list[int]:
        """Intermediate hidden states hs[ℓ] the head reads from the cache (``aux_hidden.ℓ``, written
        by data prep with ``prep.layers``); the final state is always cached.  Default: none."""
        return []

    @classmethod
    def cache_layers_for(cls, cfg: dict[str, Any], num_layers: int) -> list[int]:
        """:attr:`required_cache_layers` of the head a ``heads`` section would build over a base of
        ``num_layers`` decoder layers, without building it: for a check before the base's weights load
        (``train.run.check_cache_layers_early``).  Default: none."""
        return []

    def __init__(self, cfg: dict[str, Any], base_config) -> None:
        super().__init__()
        self.cfg = dict(cfg)
        self.base_config = base_config
        self.hidden_size = int(base_config.hidden_size)
        self.vocab_size = int(base_config.vocab_size)
        #: what the base does to W h before it returns logits (Gemma 2's soft-capping...): every score of
        #: the frozen LM head below applies it, so teachers and drafts use the base's own distribution
        self.logit_transform = logit_transform(base_config)
        self._init_draft_vocab()

    # -- borrowed frozen weights ---------------------------------------------------------------
    def attach_base(self, base_model) -> None:
        """Borrow the base model's frozen embedding [V,H], final norm and LM head [V,H].

        The weights become non-persistent buffers ``embed_weight``, ``lm_head_weight`` and the module
        ``base_norm`` (the base's own final-norm class, its weight a buffer; same dtype as the base).
        Call again after moving the base model if needed.
        """
        inner = base_model.get_decoder() if hasattr(base_model, "get_decoder") else base_model.model
        emb = base_model.get_input_embeddings().weight.detach()
        head = base_model.get_output_embeddings().weight.detach()
        self.register_buffer("embed_weight", emb, persistent=False)
        self.register_buffer("lm_head_weight", head, persistent=False)
        self.base_norm = frozen_copy(inner.norm)
        self._slice_draft_lm_head()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Frozen token embedding: ids [...] (long) -> [..., H]."""
        return nn.functional.embedding(ids, self.embed_weight)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """Frozen LM head: h [..., H] -> logits [..., V] (in h's dtype), the base's logits of a final
        (post-norm) hidden state: W h under the base's :attr:`logit_transform`."""
        return self.logit_transform(h @ self.lm_head_weight.to(h.dtype).T)

    # -- draft vocabulary (heads.draft_vocab; FR-Spec / EAGLE-3 d2t) ---------------------------
    def _init_draft_vocab(self) -> None:
        """Read ``heads.draft_vocab_size`` (null = full vocabulary, ``auto`` = :data:`heads.draft_vocab.AUTO_SIZE`
        when V is larger) and register the mapping buffers.

        With N set, ``d2t`` int64 [N] and ``t2d`` bool [V] are *persistent* buffers (so they are in
        ``model.safetensors`` and in every Lightning checkpoint; never trained, never sharded by
        ZeRO, broadcast by DDP), ``draft_index`` int64 [V] (base id → draft index, −1 outside) is
        derived.  They hold zeros until :meth:`set_draft_vocab` (training, from label counts) or
        ``load_state_dict`` + :meth:`check_draft_vocab` (a checkpoint) fill them.

        Raises:
            ValueError: ``draft_vocab_size`` < 2 or > V (see :func:`heads.draft_vocab.check_size`).
        """
        from heads.draft_vocab import check_size

        self.cfg.setdefault("draft_vocab_size", None)
        self.draft_vocab_size = check_size(self.cfg["draft_vocab_size"], self.vocab_size)
        self.cfg["draft_vocab_size"] = self.draft_vocab_size  # "auto" resolved: config.json holds N or null
        if self.draft_vocab_size is not None:
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(self.vocab_size, dtype=torch.bool))
            self.register_buffer("draft_index", torch.full((self.vocab_size,), -1, dtype=torch.int64), persistent=False)
            self.register_load_state_dict_post_hook(DraftHead._rederive_after_load)

    @staticmethod
    def _rederive_after_load(module: "DraftHead", incompatible_keys) -> None:
        """After any ``load_state_dict``: the lookups derived from the draft vocabulary (``draft_index``,
        the frozen rows W[d2t] (``frozen_draft_lm_head``) that score drafts and the soft teachers) are
        rebuilt from the loaded ``d2t``, never kept from the mapping the head was built with (issue 28).
        A loaded mapping that is not valid is left to :meth:`check_draft_vocab` (``heads.load``), which
        raises naming the file."""
        from heads.draft_vocab import DraftVocab, t2d_index

        try:
            DraftVocab.from_tensors({"d2t": module.d2t.cpu(), "t2d": module.t2d.cpu()}, module.vocab_size,
                                    module.draft_vocab_size)
        except ValueError:
            return
        with torch.no_grad():
            module.draft_index.copy_(t2d_index(module.d2t, module.vocab_size))
        DraftHead._slice_draft_lm_head(module)  # the base rows only: EAGLE-3 keeps its loaded trainable head

    @property
    def num_draft_tokens(self) -> int:
        """N if a draft vocabulary is configured, else V: the width of :meth:`draft_lm_head`'s logits."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    def set_draft_vocab(self, vocab, info: dict[str, Any] | None = None) -> None:
        """Install a :class:`heads.draft_vocab.DraftVocab` (e.g. from the cache's label counts).

        ``info`` (e.g. ``{"train_coverage": 0.97, "cache": "<dir>"}``) is stored as
        ``cfg["draft_vocab"]`` and so written to ``config.json``.

        Raises:
            ValueError: no draft vocabulary is configured, or ``vocab`` has another N or V.
        """
        if self.draft_vocab_size is None:
            raise ValueError("heads.draft_vocab_size is null (full vocabulary): there is no draft vocabulary to set")
        if vocab.size != self.draft_vocab_size or vocab.vocab_size != self.vocab_size:
            raise ValueError(f"draft vocabulary of N={vocab.size} over V={vocab.vocab_size} does not fit "
                             f"heads.draft_vocab_size={self.draft_vocab_size} over V={self.vocab_size}")
        with torch.no_grad():
            self.d2t.copy_(vocab.d2t)
            self.t2d.copy_(vocab.t2d)
        if info is not None:
            self.cfg["draft_vocab"] = dict(info)
        self._derive_draft_vocab()

    def check_draft_vocab(self, where: str = "checkpoint") -> None:
        """Validate the loaded ``d2t`` / ``t2d`` buffers and derive the lookups.

        Raises:
            ValueError: duplicates, ids outside [0, V), wrong length, unsorted, or ``t2d`` ≠ mask of ``d2t``.
        """
        if self.draft_vocab_size is None:
            return
        from heads.draft_vocab import DraftVocab

        DraftVocab.from_tensors({"d2t": self.d2t.cpu(), "t2d": self.t2d.cpu()}, self.vocab_size,
                                self.draft_vocab_size, where=where)
        self._derive_draft_vocab()

    def _derive_draft_vocab(self) -> None:
        from heads.draft_vocab import t2d_index

        with torch.no_grad():
            self.draft_index.copy_(t2d_index(self.d2t, self.vocab_size))
        self._slice_draft_lm_head()

    def _slice_draft_lm_head(self) -> None:
        """The module ``frozen_draft_lm_head`` over W[d2t] [N, H] (a copy, a non-persistent buffer), or over W
        [V, H] itself with no draft vocabulary, once the base (and the mapping) exist."""
        if not hasattr(self, "lm_head_weight"):
            return
        from heads.draft_vocab import slice_rows

        self.frozen_draft_lm_head = FrozenLinear(slice_rows(self.lm_head_weight, None if self.draft_vocab_size is None else self.d2t))

    @property
    def draft_lm_head_rows(self) -> torch.Tensor:
        """The frozen LM head's rows over the draft vocabulary: W[d2t] [N, H], or W [V, H] with none
        (the base's dtype; row i scores base token ``d2t[i]``): the weight :meth:`draft_lm_head` multiplies by."""
        return self.frozen_draft_lm_head.weight

    def draft_lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """Frozen LM head restricted to the draft vocabulary (FR-Spec): h [..., H] → [..., N] (h's dtype).

        Column i scores base token ``d2t[i]``; with no draft vocabulary this is :meth:`lm_head` ([..., V]),
        the base's :attr:`logit_transform` included.  The product runs in the module ``frozen_draft_lm_head``
        (:class:`core.frozen_linear.FrozenLinear`), which decoding may prepack for oneDNN like the base's
        layers (:func:`evaluation.methods.pack_like_base`).
        """
        return self.logit_transform(self.frozen_draft_lm_head(h))

    def to_draft_ids(self, base_ids: torch.Tensor) -> torch.Tensor:
        """Base ids [...] (long) → draft indices [...] (−1 outside the draft vocabulary); identity if full."""
        if self.draft_vocab_size is None:
            return base_ids
        return self.draft_index.to(base_ids.device)[base_ids]

    def to_base_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft indices [...] (long, in [0, N)) → base ids [...]; identity if full."""
        if self.draft_vocab_size is None:
            return draft_ids
        return self.d2t.to(draft_ids.device)[draft_ids]

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The base model's frozen final norm, run by the base's own module (so a Llama RMSNorm, a
        Gemma ``(1 + w)`` RMSNorm or any other equals what decoding applies): h [..., H] -> [..., H]
        in the dtype that module returns (h's dtype for a base of h's dtype)."""
        return self.base_norm(h)

    # -- what each method implements ---------------------------------------------------------
    def training_loss(self, batch: dict[str, Any], progress: Progress) -> tuple[torch.Tensor, dict[str, float]]:
        """Return ``(scalar loss, metrics)`` for a cached batch; metrics are floats to log."""
        raise NotImplementedError

    @torch.no_grad()
    def validation_metrics(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Per-batch validation metrics ``{name: Tensor[2]}`` holding ``(sum, count)``.

        ``train.module.DraftHeadModule`` adds the pairs over every batch and rank and logs
        ``val/<name> = Σ sum / Σ count`` (an exact mean over the held-out split; e.g. ``loss`` =
        (Σ token losses, #tokens), ``sim_tau`` = (Σ τ over anchors, #anchors)).  A 0-d tensor is
        accepted as one observation ``(value, 1)``, i.e. averaged over batches (inexact when
        batches differ in size).  Drafters include ``loss`` and ``sim_tau``.
        """
        raise NotImplementedError

    def make_drafter(self, base_model, **kwargs):
        """Build the decoding-time drafter bound to ``base_model`` (see ``decoding/``)."""
        raise NotImplementedError

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's own weights (``requires_grad`` parameters and persistent buffers)."""
        return {k: v for k, v in self.state_dict().items()}
