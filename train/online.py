"""Online and hybrid hidden states (``train.features=online|hybrid``): the frozen base runs inside training.

``offline`` (default) trains on the sharded cache written by ``python -m data_prep``.  The other
two modes need no hidden-state cache before training:

* **online** - the data module yields *token* batches: conversations read, split, templated and
  masked by the front half of data prep (:func:`data_prep.pipeline.read_split`,
  :func:`data_prep.front.template_split`, the same records, ids and drops as
  :func:`data_prep.pipeline.build_records`), batched exactly like the cache's records.
  :class:`BaseFeatures` then runs the frozen base (eval, no grad, in ``model.dtype`` - the compute
  dtype of the feature definition, ``data_prep.features``, on every device) on every batch and
  fills in exactly what the cache of the same settings would have given
  (design.md "Cache → batch contract"): ``hidden`` = hs[L], ``aux_hidden`` = hs[l] for
  ``prep.layers``, ``labels`` = argmax of the base logits.  Hidden states are rounded to
  ``prep.dtype`` (:func:`data_prep.fp8.storage_roundtrip`), so the three modes train on the same
  values; the heads do not change.
* **hybrid** - online, and every computed batch is also written as one shard of a cache in the
  data-prep format (:class:`HybridCache`: shard ``k`` of ``train/`` or ``val/`` = batch ``k`` of
  that split's fixed batch list; safetensors shard + checksummed sidecar, both atomic; manifests
  once every shard exists).  A batch whose shard is already there is read instead of computed, so
  later epochs (and the part of an epoch done before a crash) read the cache, a killed run resumes
  without duplicate or torn shards, and the losses equal the online ones.

Labels: online/hybrid labels are teacher-forced (``labels=teacher_forced``).  ``labels=regenerate``
needs the base's regenerated assistant turns, which only ``python -m data_prep`` produces (greedy
generation is far costlier than a teacher-forced forward and does not belong in a training step):
it is refused with a one-line error naming both ways out.

Distributed: the base is a plain attribute of :class:`BaseFeatures`, never a submodule of the
Lightning module, so every rank holds a full frozen copy, and neither DDP nor DeepSpeed ZeRO-1/2/3
sees it (ZeRO partitions only the head's parameters, gradients and optimizer state).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from core.config import UserInputError, override
from train.data import CacheDataModule

MODES = ("offline", "online", "hybrid")
#: ``train`` keys that decide the batches, hence the hybrid cache's shards
BATCHING_KEYS = ("batch_size", "max_tokens", "bucket_size", "shuffle")
HYBRID_HEADER = "hybrid.json"
SPLITS = ("train", "val")


# --------------------------------------------------------------------------------------------
# Token records (the front half of data prep).
# --------------------------------------------------------------------------------------------
class ConversationRecords:
    """Token-only records of one split, in the order a data-prep cache stores them.

    ``reader[i]`` -> ``{"id": str, "input_ids": LongTensor [T], "loss_mask": BoolTensor [T]}``;
    ``lengths()`` -> token counts (what :func:`train.data.record_lengths` uses for batching).
    """

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.records[i]

    def lengths(self) -> list[int]:
        return [int(r["input_ids"].shape[0]) for r in self.records]


def tokenize_split(cfg, tokenizer, model) -> dict[str, ConversationRecords]:
    """Read, split, template and mask the conversations of ``cfg.data`` like data prep does.

    Same records, ids, order and drops as a ``labels=teacher_forced`` cache of the same config, by the
    same code (:func:`data_prep.front.template_split`, :meth:`TemplatedConversation.encode`): a turn no
    rendering can give its inference view is dropped and the conversation kept; a conversation the
    template splits is several records (``<id>#<k>``); a record with no assistant token within
    ``data.max_length`` is dropped.

    Returns:
        ``{"train": ConversationRecords, "val": ConversationRecords}``.

    Raises:
        core.config.UserInputError: no conversation could be read or templated (as data prep).
    """
    from data_prep.front import template_split
    from data_prep.pipeline import read_split
    from data_prep.template import end_of_turn_ids

    data = read_split(cfg.data)
    max_length = int(cfg.data.max_length)
    templated = template_split(tokenizer, data, end_of_turn_ids(tokenizer, model), max_length)
    out = {}
    for split in SPLITS:
        records = []
        for conv in templated[split]:
            ids, mask = conv.encode(max_length)
            if not any(mask):
                continue
            records.append({"id": conv.id, "input_ids": torch.as_tensor(ids, dtype=torch.long),
                            "loss_mask": torch.as_tensor(mask, dtype=torch.bool)})
        out[split] = ConversationRecords(records)
    return out


def collate_tokens(records: Sequence[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """Right-pad token records into a batch without features (filled in by :class:`BaseFeatures`).

    Returns:
        ``input_ids`` [B, T] long (``pad_id`` on padding), ``attention_mask`` [B, T] bool,
        ``loss_mask`` [B, T] bool, ``lengths`` [B] long, ``ids`` list[str] - the same values as
        :func:`data_prep.cache.collate` gives for these keys.

    Raises:
        ValueError: ``records`` is empty.
    """
    if not records:
        raise ValueError("collate_tokens() got no records")
    lengths = torch.as_tensor([len(r["input_ids"]) for r in records], dtype=torch.long)
    B, T = len(records), int(lengths.max())
    batch = {"input_ids": torch.full((B, T), int(pad_id), dtype=torch.long),
             "attention_mask": torch.zeros((B, T), dtype=torch.bool),
             "loss_mask": torch.zeros((B, T), dtype=torch.bool),
             "lengths": lengths, "ids": [r["id"] for r in records]}
    for i, r in enumerate(records):
        n = int(lengths[i])
        batch["input_ids"][i, :n] = r["input_ids"]
        batch["attention_mask"][i, :n] = True
        batch["loss_mask"][i, :n] = r["loss_mask"]
    return batch


# --------------------------------------------------------------------------------------------
# The hybrid cache.
# --------------------------------------------------------------------------------------------
def hybrid_defining_config(cfg) -> dict[str, Any]:
    """What decides a hybrid cache's bytes: the data-prep sections (``model``, ``data``, ``prep``,
    ``labels``), ``seed`` and the batching keys :data:`BATCHING_KEYS` of ``train``."""
    from data_prep.cache import cache_defining_config

    out = cache_defining_config(cfg)
    out["seed"] = int(cfg.seed)
    out["batching"] = {k: cfg.train.get(k) for k in BATCHING_KEYS}
    return out


def hybrid_cache_dir(cfg) -> Path:
    """``train.cache_dir`` if set, else ``<output_root>/cache/hybrid-<hash[:16]>``."""
    from core.io import sha256_json

    if cfg.train.get("cache_dir"):
        return Path(cfg.train.cache_dir)
    return Path(cfg.output_root) / "cache" / f"hybrid-{sha256_json(hybrid_defining_config(cfg))[:16]}"


class HybridCache:
    """Shards of batches computed online, in the data-prep cache format (``data_prep.cache``).

    ``<root>/hybrid.json`` (the defining config and its hash), ``<root>/<split>/shard-<k>.safetensors``
    + ``shard-<k>.json`` (sidecar with sha256) for batch ``k`` of the split, ``<root>/<split>/manifest.json``
    once all shards of the split exist (then ``data_prep.cache.CacheReader`` reads it too).

    Args:
        root: the cache directory (:func:`hybrid_cache_dir`).
        cfg: the composed config (defines the hash; ``prep.dtype`` is the storage dtype).
        header: manifest fields (``base``, ``final_layer``, ``layers``, ``hidden_size``, ``pad_id`` ...).

    Raises:
        UserInputError: ``root`` holds a cache written under another config (hybrid or offline); the
            differing keys are named and nothing is written.
    """

    def __init__(self, root: str | Path, cfg, header: dict[str, Any]) -> None:
        from core.io import sha256_json
        from data_prep.fp8 import storage_dtype

        self.root = Path(root)
        self.defining = hybrid_defining_config(cfg)
        self.config_hash = sha256_json(self.defining)
        self.dtype_name = str(cfg.prep.dtype)
        self.dtype = storage_dtype(self.dtype_name)
        self.header = {**header, "config_hash": self.config_hash, "mode": "hybrid"}
        self._done: set[tuple[str, int]] = set()
        self._check()

    def _check(self) -> None:
        path = self.root / HYBRID_HEADER
        if path.is_file():
            old = json.loads(path.read_text())
            if old.get("config_hash") != self.config_hash:
                a, b = _flat(old.get("defining", {})), _flat(self.defining)
                diffs = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
                raise UserInputError(f"hybrid cache {self.root} was written under other settings ("
                                     f"{'; '.join(diffs[:4]) or 'config hash differs'}{'; ...' if len(diffs) > 4 else ''}"
                                     "); set another train.cache_dir, or the same settings to reuse it")
        elif self.root.is_dir() and any(self.root.iterdir()):
            raise UserInputError(f"train.cache_dir={self.root} holds files but no {HYBRID_HEADER}: it is not a hybrid "
                                 "cache (an offline cache? use train.features=offline); set another train.cache_dir")

    def prepare(self) -> None:
        """Create the directories and ``hybrid.json`` (atomic; every rank writes the same bytes)."""
        from core.io import atomic_write_json

        for split in SPLITS:
            (self.root / split).mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.root / HYBRID_HEADER, {"config_hash": self.config_hash, "defining": self.defining})

    def has(self, split: str, k: int) -> bool:
        """True when shard ``k`` of ``split`` is finished and intact (sha256 checked once per process)."""
        from data_prep.cache import finished_entry

        if (split, k) in self._done:
            return True
        try:
            ok = finished_entry(self.root / split, k, self.config_hash) is not None
        except ValueError as exc:
            raise UserInputError(str(exc)) from exc
        if ok:
            self._done.add((split, k))
        return ok

    def read(self, split: str, k: int) -> list[dict[str, Any]]:
        """The records of shard ``k`` (``data_prep.cache.CacheReader`` record dicts, same order)."""
        return _ShardReader(self.root / split, k, self.header["layers"]).records()

    def write(self, split: str, k: int, records: list[dict[str, Any]]) -> None:
        """Write shard ``k`` of ``split`` from records holding un-rounded ``hidden`` {l: [T, H]}
        (quantised / cast once here, exactly like data prep)."""
        from data_prep.cache import build_shard_tensors, write_shard

        if self.has(split, k):
            return
        tensors = build_shard_tensors(records, self.header["layers"], self.header["final_layer"], self.dtype)
        write_shard(self.root / split, k, tensors, [r["id"] for r in records], {"config_hash": self.config_hash,
                                                                               "dropped": {}})
        self._done.add((split, k))

    def finalize(self, num_batches: dict[str, int]) -> dict[str, bool]:
        """Write each split's manifest once all its shards exist; ``{split: complete}``."""
        from data_prep.cache import write_manifest

        out = {}
        for split, n in num_batches.items():
            out[split] = write_manifest(self.root / split, n, {**self.header, "split": split}) is not None
        return out


class _ShardReader:
    """One shard's records, through ``data_prep.cache.CacheReader`` with a one-shard manifest in memory."""

    def __init__(self, directory: Path, k: int, layers: Sequence[int]) -> None:
        from data_prep.cache import FORMAT, CacheReader, shard_name

        side = json.loads((directory / f"{shard_name(k)}.json").read_text())
        reader = CacheReader.__new__(CacheReader)
        reader.directory = directory
        reader.manifest = {"format": FORMAT, "layers": list(layers), "shards": [side]}
        reader.layers = list(layers)
        reader._files, reader._scaled, reader._offsets, reader._ids = [None], [False], [[]], [[]]
        reader._starts = [0, int(side["records"])]
        self.reader = reader

    def records(self) -> list[dict[str, Any]]:
        return [self.reader[i] for i in range(len(self.reader))]


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class HybridBatchDataset(torch.utils.data.Dataset):
    """Item ``k``: the cached batch ``k`` when its shard exists, else the token batch tagged
    ``batch["hybrid_shard"] = (split, k)`` for :class:`BaseFeatures` to compute and write.
    Padding items (``k >= len(batches)``, validation) are never written."""

    def __init__(self, reader, batches: list[list[int]], split: str, cache: HybridCache, pad_id: int) -> None:
        self.reader, self.batches, self.split, self.cache, self.pad_id = reader, batches, split, cache, int(pad_id)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> dict[str, Any]:
        from data_prep.cache import collate

        real = k % len(self.batches)
        if self.cache.has(self.split, real):
            batch = collate(self.cache.read(self.split, real), self.pad_id)
        else:
            batch = collate_tokens([self.reader[i] for i in self.batches[real]], self.pad_id)
            if k < len(self.batches):
                batch["hybrid_shard"] = (self.split, real)
        batch["is_padding"] = k >= len(self.batches)
        return batch


# --------------------------------------------------------------------------------------------
# The base forward inside training.
# --------------------------------------------------------------------------------------------
class BaseFeatures:
    """Fills a token batch with the frozen base's features, exactly as the cache would give them.

    ``features(batch)`` adds ``hidden`` [B, T, H] (hs[L], post-norm), ``aux_hidden`` {l: [B, T, H]}
    (hs[l] for ``layers``), both rounded to ``storage`` (``prep.dtype``; zeros on padding), and
    ``labels`` [B, T] long (argmax of the base logits at t; 0 on padding) - the computation of
    :func:`data_prep.labels.forward_features` (both call :func:`data_prep.features.teacher_forced`),
    kept on the batch's device.  A batch tagged ``hybrid_shard`` is also written to ``cache``
    (:class:`HybridCache`) before rounding.

    Args:
        model: the frozen HF causal LM (kept as a plain attribute: never a submodule, never sharded).
        layers: intermediate hidden-state ids (``prep.layers``).
        storage: ``prep.dtype`` name.
        cache: a :class:`HybridCache` (hybrid mode) or None.
        head_chunk: tokens per LM-head matmul for the argmax.
        compute_dtype: the dtype the base runs in (``model.dtype`` resolved); None = the model's own.
            A base in another dtype is copied and cast (the caller's model is never changed in place),
            and :meth:`to` keeps this dtype on every device.
    """

    def __init__(self, model, layers: Sequence[int], storage: str, cache: HybridCache | None = None,
                 head_chunk: int = 2048, compute_dtype: str | torch.dtype | None = None) -> None:
        import copy

        from core.precision import torch_dtype

        dtype = compute_dtype if isinstance(compute_dtype, torch.dtype) or compute_dtype is None \
            else torch_dtype(compute_dtype)
        if dtype is not None and model.dtype != dtype:
            from core.rope import cast_module

            model = cast_module(copy.deepcopy(model), dtype)  # RoPE's inv_freq stays fp32, as from_pretrained leaves it
        self.compute_dtype = model.dtype
        self.model = model
        self.layers = sorted(int(l) for l in layers)
        self.final_layer = int(model.config.num_hidden_layers)
        self.storage = storage
        self.cache = cache
        self.head_chunk = int(head_chunk)
        self.seconds = 0.0  # wall time spent in the base forward (benchmarks)

    def to(self, device: torch.device | str) -> "BaseFeatures":
        """Move the base to ``device``, in its compute dtype on every device (issue 28: a GPU once cast
        it to bf16 whatever ``model.dtype`` said, so online features differed from the cache's)."""
        from core.rope import cast_module

        cast_module(self.model, self.compute_dtype, torch.device(device))
        return self

    @torch.no_grad()
    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import time

        from data_prep.features import teacher_forced
        from data_prep.fp8 import storage_roundtrip

        t0 = time.perf_counter()
        device = next(self.model.parameters()).device
        ids = batch["input_ids"].to(device)
        attn = batch["attention_mask"].to(device).bool()
        was_training = self.model.training
        self.model.eval()
        with torch.autocast(device.type, enabled=False):  # the definition's dtype, not the head's autocast
            labels, hs, _ = teacher_forced(self.model, ids, attn, self.head_chunk)
        self.model.train(was_training)
        final = hs[-1]
        tag = batch.pop("hybrid_shard", None)
        if tag is not None and self.cache is not None:
            lengths = batch["lengths"].tolist()
            want = sorted({*self.layers, self.final_layer})
            records = [{"id": batch["ids"][i], "input_ids": batch["input_ids"][i, :n].cpu(),
                        "loss_mask": batch["loss_mask"][i, :n].cpu(), "labels": labels[i, :n].cpu(),
                        "hidden": {l: hs[l][i, :n].cpu() for l in want}} for i, n in enumerate(lengths)]
            self.cache.write(tag[0], int(tag[1]), records)
        keep = attn.unsqueeze(-1)
        rounded = lambda h: storage_roundtrip(h, self.storage) * keep  # noqa: E731
        batch = dict(batch)
        batch["labels"] = labels
        batch["hidden"] = rounded(final)
        batch["aux_hidden"] = {l: rounded(hs[l]) for l in self.layers}
        self.seconds += time.perf_counter() - t0
        return batch


# --------------------------------------------------------------------------------------------
# Wiring (called by train.run.train before the run directory exists).
# --------------------------------------------------------------------------------------------
def check_labels(cfg) -> None:
    """Online/hybrid labels are teacher-forced.

    Raises:
        UserInputError: ``labels`` is not ``teacher_forced``; the message names both ways out.
    """
    if str(cfg.labels) != "teacher_forced":
        raise UserInputError(
            f"train.features={cfg.train.features} computes teacher-forced labels in the training step; labels={cfg.labels} "
            "needs the base's regenerated text, which only data prep writes: pass labels=teacher_forced, or run "
            "`python -m data_prep labels=regenerate ...` and train with train.features=offline")


def check_online_config(cfg, model, head) -> None:
    """Refuse an online/hybrid run that cannot produce the head's inputs, before training starts.

    Raises:
        UserInputError: ``labels=regenerate`` (needs a data-prep cache); ``data.max_length`` beyond
            the base's context or ``prep.layers`` outside ``[1, L)`` of this base
            (:func:`data_prep.pipeline.check_against_base`); the head reads layers not in ``prep.layers``; the head was
            built for another hidden size / vocabulary than this base.
    """
    from data_prep.pipeline import check_against_base

    mode = str(cfg.train.features)
    check_labels(cfg)
    layers = check_against_base(cfg, model.config)
    need = [int(l) for l in getattr(head, "required_cache_layers", [])]
    missing = [l for l in need if l not in layers]
    if missing:
        raise UserInputError(f"the {head.head_type} head reads hidden states hs{missing} but train.features={mode} "
                             f"computes {override('prep.layers', layers)}; pass {override('prep.layers', need)}")
    for key, want in (("hidden_size", getattr(head, "hidden_size", None)), ("vocab_size", getattr(head, "vocab_size", None))):
        have = int(getattr(model.config, key))
        if want is not None and int(want) != have:
            raise UserInputError(f"the {head.head_type} head has {key}={want} but the base "
                                 f"(model.path={cfg.model.path!r}) has {key}={have}")


def feature_header(cfg, model, identity: dict[str, Any], pad_id: int) -> dict[str, Any]:
    """Manifest fields of a hybrid cache (the same as data prep's header)."""
    from data_prep.fp8 import FP8_NAME

    from data_prep.features import FeatureDefinition

    dt = str(cfg.prep.dtype)
    return {"base": dict(identity), "final_layer": int(model.config.num_hidden_layers),
            "features": FeatureDefinition.from_config(cfg, int(model.config.num_hidden_layers)).to_dict(),
            "layers": sorted(int(l) for l in cfg.prep.layers), "hidden_size": int(model.config.hidden_size),
            "dtypes": {"input_ids": "int32", "labels": "int32", "loss_mask": "bool", "offsets": "int64",
                       "hidden": dt, "aux_hidden": dt, **({"hidden_scale": "float32"} if dt == FP8_NAME else {})},
            "pad_id": int(pad_id), "labels": str(cfg.labels), "max_length": int(cfg.data.max_length),
            "max_new_tokens": None}


def online_datamodule(cfg, model, tokenizer, identity: dict[str, Any]):
    """``(datamodule, features)`` for ``train.features=online|hybrid``.

    Raises:
        UserInputError: fp8 on a torch without it; a hybrid cache of another config; empty splits.
    """
    from data_prep.fp8 import storage_dtype

    check_labels(cfg)
    storage_dtype(str(cfg.prep.dtype))  # fp8 without torch support: refuse now
    mode = str(cfg.train.features)
    from data_prep.template import end_of_turn_ids, pad_token_id

    pad_id = pad_token_id(tokenizer, end_of_turn_ids(tokenizer, model))
    cache = None
    if mode == "hybrid":
        cache = HybridCache(hybrid_cache_dir(cfg), cfg, feature_header(cfg, model, identity, pad_id))
    readers = tokenize_split(cfg, tokenizer, model)
    for split, reader in readers.items():
        if len(reader) == 0:
            raise UserInputError(f"train.features={mode}: the {split!r} split of {cfg.data.path or 'the packaged ShareGPT file'} "
                                 "holds no usable conversation (raise data.max_conversations or data.heldout_fraction)")
    t = cfg.train
    dm = OnlineDataModule(cache, pad_id, batch_size=t.batch_size, max_tokens=t.max_tokens, seed=int(cfg.seed),
                          shuffle=bool(t.shuffle), bucket_size=int(t.bucket_size), num_workers=int(t.num_workers),
                          train_reader=readers["train"], val_reader=readers["val"])
    from core.precision import resolve_dtype

    # train.run.train resolved model.dtype for the training device; a direct call resolves auto for the CPU
    compute = resolve_dtype(cfg.model.dtype, "model.dtype", "cpu", check=False)
    return dm, BaseFeatures(model, cfg.prep.layers, str(cfg.prep.dtype), cache, compute_dtype=compute)


class OnlineDataModule(CacheDataModule):
    """:class:`train.data.CacheDataModule` over :class:`ConversationRecords`: the same batches,
    order, rank sharding and resume position, but token batches (and, with a :class:`HybridCache`,
    cached batches wherever their shard exists)."""

    def __init__(self, cache: HybridCache | None, pad_id: int, **kwargs) -> None:
        from functools import partial

        super().__init__(None, pad_id, collate_fn=partial(collate_tokens, pad_id=int(pad_id)), **kwargs)
        self.hybrid = cache

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self.hybrid is not None:
            self.hybrid.prepare()

    def make_dataset(self, reader, batches: list[list[int]], split: str):
        if self.hybrid is None:
            return super().make_dataset(reader, batches, split)
        return HybridBatchDataset(reader, batches, split, self.hybrid, self.pad_id)

    def finalize_hybrid(self) -> dict[str, bool]:
        """Write the hybrid cache's manifests where every shard exists (no-op when not hybrid)."""
        if self.hybrid is None:
            return {}
        return self.hybrid.finalize({"train": len(self.train_batches), "val": len(self.val_batches)})
