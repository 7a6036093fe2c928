"""One definition of a feature, shared by the offline cache, online and hybrid training (issue 28 item 2).

A *feature* is what a draft head trains on for one token: the base's hidden states (hs[L], the
final post-norm state, and hs[l] for ``prep.layers``) and its greedy label (argmax of the base
logits at t).  Its value is fixed by :class:`FeatureDefinition`:

* ``compute_dtype`` - the dtype the base runs in (``model.dtype`` resolved: ``core.precision``);
* ``attn_implementation`` - ``model.attn_implementation`` (``eager`` is batch-invariant on CPUs:
  a conversation's features do not depend on what it was batched or padded with; ``sdpa``'s
  blocked attention is not, so its features can differ by one rounding step between batchings);
* ``final_layer`` L and ``layers`` (the aux ids), ``storage_dtype`` (``prep.dtype``) and
  ``labels`` (``teacher_forced`` | ``regenerate``).

:func:`teacher_forced` is the one computation: data prep
(:func:`data_prep.labels.forward_features`) and ``train.online.BaseFeatures`` both call it, so
with the same definition online features equal the cache's (labels exactly, hidden states bit for
bit in the storage dtype; ``tests/test_precision.py``).  Every cache manifest records the
definition (``manifest["features"]``); a run whose definition differs from its cache's is refused
with the differences (:func:`check_same_features`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from core.logit_transform import logit_transform

#: fields compared between a cache and an offline training run (the base forward's settings)
COMPUTE_FIELDS = ("compute_dtype",)

@dataclass(frozen=True)
class FeatureDefinition:
    """What decides a feature's value (module doc).  ``compute_dtype`` is None only for a cache made
    before it was recorded whose ``config.yaml`` is gone (unknown)."""

    compute_dtype: str | None
    attn_implementation: str | None
    final_layer: int
    layers: tuple[int, ...]
    storage_dtype: str
    labels: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d

    @classmethod
    def from_config(cls, cfg, final_layer: int) -> "FeatureDefinition":
        """The definition a composed config asks for (``model.dtype=auto`` is resolved for the CPU, quietly)."""
        from core.precision import resolve_dtype

        return cls(compute_dtype=resolve_dtype(cfg.model.dtype, "model.dtype", "cpu", check=False),
                   attn_implementation=cfg.model.get("attn_implementation"), final_layer=int(final_layer),
                   layers=tuple(sorted(int(l) for l in cfg.prep.layers)), storage_dtype=str(cfg.prep.dtype),
                   labels=str(cfg.labels))

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], root: str | Path | None = None) -> "FeatureDefinition":
        """The definition a cache split's manifest records; for a cache made before ``features`` was
        recorded, the compute dtype and attention come from ``<root>/config.yaml`` (None if absent)."""
        rec = manifest.get("features")
        if rec:
            return cls(compute_dtype=rec.get("compute_dtype"), attn_implementation=rec.get("attn_implementation"),
                       final_layer=int(rec["final_layer"]), layers=tuple(int(l) for l in rec["layers"]),
                       storage_dtype=str(rec["storage_dtype"]), labels=str(rec["labels"]))
        model = _recorded_model_section(root)
        return cls(compute_dtype=model.get("dtype"), attn_implementation=model.get("attn_implementation"),
                   final_layer=int(manifest.get("final_layer", -1)),
                   layers=tuple(int(l) for l in manifest.get("layers", [])),
                   storage_dtype=str(manifest.get("dtypes", {}).get("hidden", "")),
                   labels=str(manifest.get("labels", "")))

    def differences(self, other: "FeatureDefinition", fields: Sequence[str] | None = None) -> list[str]:
        """``"field: self -> other"`` for each differing field (all fields, or ``fields``)."""
        a, b = self.to_dict(), other.to_dict()
        return [f"{k}: {a[k]!r} -> {b[k]!r}" for k in (fields or a) if a[k] != b[k]]


def _recorded_model_section(root: str | Path | None) -> dict[str, Any]:
    if root is None:
        return {}
    path = Path(root) / "config.yaml"
    if not path.is_file():
        return {}
    from omegaconf import OmegaConf

    model = OmegaConf.load(path).get("model")
    return OmegaConf.to_container(model, resolve=True) if model is not None else {}


def cache_features(cache_dir: str | Path) -> FeatureDefinition | None:
    """The feature definition of a prepared cache (``<cache_dir>/train/manifest.json``), or None
    when the cache has no manifest yet."""
    from core.io import MANIFEST_FIX, read_json

    path = Path(cache_dir) / "train" / "manifest.json"
    if not path.is_file():
        return None
    return FeatureDefinition.from_manifest(read_json(path, MANIFEST_FIX), cache_dir)


def check_same_features(recorded: FeatureDefinition, run: FeatureDefinition, what: str,
                        fields: Sequence[str] = COMPUTE_FIELDS) -> None:
    """Refuse a run whose feature definition differs from its cache's.

    Fields the cache does not record (a pre-``features`` cache without ``config.yaml``) are not compared.

    Raises:
        core.config.UserInputError: names ``what``, every differing field (cache -> run) and the way out.
    """
    from core.config import UserInputError

    rec = recorded.to_dict()
    fields = [f for f in fields if rec.get(f) is not None]
    diffs = recorded.differences(run, fields)
    if diffs:
        hint = (f"pass model.dtype={recorded.compute_dtype} (or auto) to train on it"
                if "compute_dtype" in " ".join(diffs) else "use the settings it was made with")
        raise UserInputError(f"{what} holds features of another definition than this run's ({'; '.join(diffs)}; "
                             f"cache -> run): {hint}, or prepare a cache with this run's settings")


def greedy_labels(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy label of each row of ``logits`` and whether the row is all finite, in two passes.

    Equal to ``(logits.argmax(-1), torch.isfinite(logits).all(-1))`` (ties go to the lower id;
    a row holding NaN gets the NaN's id and is not finite), but on CPUs in bf16 about 5x faster:
    ``torch.max(dim)`` and ``torch.amin`` are vectorised reductions, where ``argmax`` and the
    ``isfinite`` mask over [N, V] are not (data prep spent 13% of its time in these two lines).
    A row is finite exactly when its maximum and its minimum are: NaN propagates through both,
    +inf shows in the maximum, -inf in the minimum.

    Args:
        logits: [N, V] float tensor (any float dtype).

    Returns:
        ``(labels, finite)``: LongTensor [N], BoolTensor [N].
    """
    top, labels = logits.max(-1)
    finite = torch.isfinite(top) & torch.isfinite(logits.amin(-1))
    return labels, finite


@torch.no_grad()
def teacher_forced(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, head_chunk: int = 2048
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The base's features for a right-padded token batch: the one computation of a feature.

    One forward of ``model.base_model`` (no KV cache, every hidden state kept) in the model's own
    dtype, then the greedy label ``argmax_v (W h_t)`` over the non-padding positions with the LM
    head applied to ``head_chunk`` tokens at a time (the [B, T, V] logits are never materialised).
    Argmax ties go to the lower id (``torch.argmax``).

    Args:
        model: frozen HF causal LM (``base_model``, ``get_output_embeddings``), in the compute dtype.
        input_ids: LongTensor [B, T] (on the model's device).
        attention_mask: [B, T], True/1 on real tokens (right padding).
        head_chunk: tokens per LM-head matmul.

    Returns:
        ``(labels, hidden_states, logits_finite)``: labels LongTensor [B, T] (0 on padding);
        hidden_states the HF tuple ``hs[0..L]`` of [B, T, H] in the model's dtype (hs[L] post-norm);
        logits_finite BoolTensor [B, T], False where a logit is NaN / ±inf (the label is undefined
        there; True on padding).
    """
    attn = attention_mask.bool()
    out = model.base_model(input_ids=input_ids, attention_mask=attn.long(), output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    flat = hs[-1][attn]
    head, transform = model.get_output_embeddings(), logit_transform(model.config)
    picked, ok = [], []
    for j in range(0, flat.shape[0], head_chunk):
        label, finite_row = greedy_labels(transform(head(flat[j: j + head_chunk])))  # the base's own logits
        picked.append(label)
        ok.append(finite_row)
    labels = torch.zeros(input_ids.shape, dtype=torch.long, device=input_ids.device)
    labels[attn] = torch.cat(picked)
    finite = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    finite[attn] = torch.cat(ok)
    return labels, hs, finite
