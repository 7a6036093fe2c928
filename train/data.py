"""The training data: batches of cached conversations, length-aware, seeded and sharded by rank.

Batching (:func:`make_batches`) happens once per split: conversation indices are shuffled with
``seed``, cut into buckets of ``bucket_size`` batches' worth, sorted by length inside each bucket
(so a batch holds conversations of similar length, little padding), and packed greedily into
batches of at most ``batch_size`` conversations and at most ``max_tokens`` padded tokens
(batch size x longest conversation).  A :class:`BatchDataset` item is one whole collated batch.

Order and sharding (:class:`ShardedBatchSampler`): each epoch the list of batches is permuted with
``seed + epoch`` (like ``torch.utils.data.DistributedSampler``), padded to a multiple of the world
size W, and rank r takes every W-th batch starting at r.  Optimizer step s at world size W
therefore sees the global batches ``perm[s*W : (s+1)*W]`` - the same batches as step s of a
single process with ``accumulate_grad_batches = W``.  This is why the Trainer runs with
``use_distributed_sampler=False``: the sampler is already rank-aware and identical for every
strategy (DDP, DeepSpeed ZeRO-1/2/3) at a given world size.

Validation padding: so that every rank runs the same number of validation forwards (ZeRO-3 needs
every rank in every parameter gather), the held-out batches are padded to a multiple of W with
repeats that carry ``batch["is_padding"] = True``; :class:`train.module.DraftHeadModule` gives
them weight 0 in the metric sums.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from core.config import UserInputError


# --------------------------------------------------------------------------------------------
# Batching.
# --------------------------------------------------------------------------------------------
def over_token_budget(lengths: Sequence[int], max_tokens: int | None) -> str | None:
    """The note owed when ``train.max_tokens`` is below some records' length (each of those is then a batch
    of its own, over the budget: :func:`make_batches`), else None."""
    if max_tokens is None:
        return None
    over = [n for n in lengths if n > max_tokens]
    if not over:
        return None
    return (f"train.max_tokens={max_tokens}: {len(over):,} of {len(lengths):,} training conversations are longer "
            f"(up to {max(over):,} tokens); each of those is a batch of its own, over the budget")


def make_batches(
    lengths: Sequence[int],
    batch_size: int | None,
    max_tokens: int | None,
    seed: int = 0,
    shuffle: bool = True,
    bucket_size: int = 64,
) -> list[list[int]]:
    """Group record indices into length-aware batches.

    Args:
        lengths: tokens per record (``T`` of each conversation), ``len(lengths) = N``.
        batch_size: most records per batch, or None (then ``max_tokens`` alone limits).
        max_tokens: most padded tokens per batch, ``len(batch) * max(lengths in batch)``, or None.
            A single record longer than ``max_tokens`` forms a batch of its own.
        seed: seeds the shuffle (a ``torch.Generator``); the same seed gives the same batches.
        shuffle: False keeps the record order (then no length sorting either).
        bucket_size: records are sorted by length within buckets of ``bucket_size * batch_size``
            records (``bucket_size * max_tokens / mean length`` under a token budget).

    Returns:
        A list of batches, each a list of record indices; every index appears exactly once.

    Raises:
        ValueError: both limits are None, a limit is < 1, or a length is < 1.
    """
    if batch_size is None and max_tokens is None:
        raise ValueError("make_batches needs batch_size or max_tokens")
    if (batch_size is not None and batch_size < 1) or (max_tokens is not None and max_tokens < 1):
        raise ValueError(f"batch_size={batch_size}, max_tokens={max_tokens}: limits must be >= 1")
    lengths = [int(x) for x in lengths]
    bad = [i for i, x in enumerate(lengths) if x < 1]
    if bad:
        raise ValueError(f"records {bad[:5]} have length < 1")
    n = len(lengths)
    if n == 0:
        return []
    if shuffle:
        g = torch.Generator().manual_seed(int(seed))
        order = torch.randperm(n, generator=g).tolist()
        per_batch = batch_size or max(1, max_tokens // max(1, round(sum(lengths) / n)))
        chunk = max(1, bucket_size * per_batch)
        buckets = [sorted(order[i:i + chunk], key=lambda j: (lengths[j], j)) for i in range(0, n, chunk)]
    else:
        buckets = [list(range(n))]

    batches: list[list[int]] = []
    for bucket in buckets:
        cur: list[int] = []
        longest = 0
        for j in bucket:
            new_longest = max(longest, lengths[j])
            full = batch_size is not None and len(cur) + 1 > batch_size
            over = max_tokens is not None and (len(cur) + 1) * new_longest > max_tokens
            if cur and (full or over):
                batches.append(cur)
                cur, new_longest = [], lengths[j]
            cur.append(j)
            longest = new_longest
        if cur:
            batches.append(cur)
    return batches


class BatchDataset(Dataset):
    """Map-style dataset whose item ``k`` is the collated batch ``batches[k % len(batches)]``.

    Items with ``k >= len(batches)`` are padding (see :class:`ShardedBatchSampler`) and carry
    ``is_padding = True``; real items carry ``False``.

    Args:
        reader: anything with ``len()`` and ``reader[i]`` -> record dict (``data_prep.cache.CacheReader``).
        batches: from :func:`make_batches`.
        collate_fn: ``collate_fn(records) -> batch dict`` (``data_prep.cache.collate`` with the pad id bound).
    """

    def __init__(self, reader, batches: list[list[int]], collate_fn: Callable[[list[dict]], dict]) -> None:
        self.reader = reader
        self.batches = batches
        self.collate_fn = collate_fn

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> dict[str, Any]:
        idx = self.batches[k % len(self.batches)]
        batch = self.collate_fn([self.reader[i] for i in idx])
        batch["is_padding"] = k >= len(self.batches)
        return batch


class ShardedBatchSampler(Sampler[int]):
    """Yields this rank's batch indices: a seeded per-epoch permutation, padded, strided by rank.

    Args:
        num_batches: number of batches ``B`` in the split.
        num_replicas, rank: world size W and this process's global rank.
        shuffle: permute the batches with ``torch.Generator().manual_seed(seed + epoch)``.
        seed: base seed.
        mark_padding: True (validation) -> padding indices are ``B + i`` (the dataset flags them);
            False (training) -> padding repeats real batches from the start of the permutation,
            exactly like ``torch.utils.data.DistributedSampler(drop_last=False)``.
        window: gradient-accumulation window A (``train.accumulate_grad_batches``): every rank's
            epoch is padded to a multiple of A batches, so each epoch is a whole number of
            optimizer steps and no optimizer step straddles an epoch end or a partial window
            (a checkpoint at a step boundary then holds exactly the batches its weights hold).

    ``set_epoch(e)`` (called by Lightning every epoch) selects the permutation.  ``len()`` is
    ``ceil(B / (W*A)) * A`` on every rank.

    Resume (:meth:`load_state_dict`): the ``consumed`` batches of the saved epoch are skipped by
    *every* iterator created while that epoch is current, not only by the first one: a DataLoader
    with worker processes calls ``iter(sampler)`` twice per iterator (``_BaseDataLoaderIter`` and
    ``_MultiProcessingDataLoaderIter._reset``), and Lightning may create an iterator and replace
    it; a skip spent on the first call made the resumed epoch restart from its first batch
    (``train.num_workers >= 1``: repeated and skipped micro-batches, issue 28).  The skip ends when
    another epoch is selected.
    """

    def __init__(self, num_batches: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True,
                 seed: int = 0, mark_padding: bool = False, window: int = 1) -> None:
        if num_batches < 1:
            raise ValueError("ShardedBatchSampler: the split has no batches")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} not in [0, {num_replicas})")
        if int(window) < 1:
            raise ValueError(f"window={window} must be >= 1")
        self.window = int(window)
        self.num_batches = num_batches
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.mark_padding = mark_padding
        self.epoch = 0
        self.consumed = 0  # finished batches of this epoch (set by train.resume.DataPosition)
        self._skip = 0     # batches of epoch self.epoch already trained (after load_state_dict)

    def set_epoch(self, epoch: int) -> None:
        """Select epoch ``epoch``'s permutation.  A pending resume skip (:meth:`load_state_dict`)
        belongs to the epoch it was saved in and is dropped when another epoch starts (a checkpoint
        written at an epoch's end resumes at the next epoch's first batch)."""
        if int(epoch) != self.epoch:
            self._skip = 0
        self.epoch = int(epoch)

    def state_dict(self) -> dict[str, int]:
        """Resume position: ``{"epoch", "consumed"}`` (see :class:`train.resume.DataPosition`)."""
        return {"epoch": int(self.epoch), "consumed": int(self.consumed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Skip the ``consumed`` batches of epoch ``epoch`` in every iteration of that epoch (mid-epoch resume)."""
        self.epoch = int(state["epoch"])
        self.consumed = self._skip = int(state["consumed"])

    def __len__(self) -> int:
        return math.ceil(self.num_batches / (self.num_replicas * self.window)) * self.window

    def global_order(self) -> list[int]:
        """All ranks' batch indices of this epoch in global order (before striding), padded."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_batches, generator=g).tolist()
        else:
            order = list(range(self.num_batches))
        pad = len(self) * self.num_replicas - self.num_batches
        if self.mark_padding:
            order += [self.num_batches + i for i in range(pad)]
        else:
            order += (order * math.ceil(pad / self.num_batches))[:pad] if pad else []
        return order

    def __iter__(self) -> Iterator[int]:
        return iter(self.global_order()[self.rank::self.num_replicas][self._skip:])


class ResumableDataLoader(DataLoader):
    """A DataLoader whose ``state_dict`` / ``load_state_dict`` are its sampler's, so Lightning
    saves the position inside the epoch and restores it on resume (``train.resume``).

    Works for any map-style dataset whose sampler has ``state_dict`` / ``load_state_dict`` /
    ``consumed`` (:class:`ShardedBatchSampler`).  Unless a ``generator`` is passed, the loader gets
    its own ``torch.Generator`` (seeded with ``seed``): creating an iterator draws a base seed from
    the loader's generator, and without one that draw comes from the *global* torch generator, so
    a resumed run (which creates its iterator after the checkpoint's RNG state is restored) would
    draw different dropout / noise / glancing numbers than an uninterrupted one.
    """

    def __init__(self, *args, seed: int = 0, **kwargs) -> None:
        if kwargs.get("generator") is None:
            kwargs["generator"] = torch.Generator().manual_seed(int(seed))
        super().__init__(*args, **kwargs)

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)


# --------------------------------------------------------------------------------------------
# Readers and record lengths.
# --------------------------------------------------------------------------------------------
def record_lengths(reader) -> list[int]:
    """Token count of every record of ``reader``.

    Uses ``reader.lengths`` or the manifest's per-record lengths when the reader provides them,
    else reads ``input_ids`` of every record (slow for big caches, but only once per run).
    """
    lengths = getattr(reader, "lengths", None)
    if callable(lengths):
        lengths = lengths()
    if lengths is None:
        manifest = getattr(reader, "manifest", None) or {}
        lengths = manifest.get("lengths") if isinstance(manifest, dict) else None
    if lengths is None:
        lengths = [int(reader[i]["input_ids"].shape[0]) for i in range(len(reader))]
    lengths = [int(x) for x in lengths]
    if len(lengths) != len(reader):
        raise ValueError(f"reader reports {len(lengths)} lengths for {len(reader)} records")
    return lengths


def tokens_seen(lengths: list[int], batches: list[list[int]], steps: int, seed: int, shuffle: bool = True,
                world_size: int = 1, window: int = 1) -> int:
    """Tokens (non-padding, all ranks) in the micro-batches of the first ``steps`` optimizer steps,
    replaying the training order of :class:`ShardedBatchSampler` epoch by epoch without reading any
    hidden state (``W·A`` micro-batches per step, the padded epoch order of every rank).

    Args:
        lengths: token count per record of the train split (:func:`record_lengths`).
        batches: the split's batches of record indices (``CacheDataModule.train_batches``).
        steps: finished optimizer steps (the checkpoint's ``global_step``).
        seed, shuffle: the data module's; world_size W; window A = ``train.accumulate_grad_batches``.

    Raises:
        ValueError: ``steps`` < 0, or a batch names a record outside ``lengths``.
    """
    if steps < 0:
        raise ValueError(f"steps={steps} must be >= 0")
    if batches and max(max(b) for b in batches if b) >= len(lengths):
        raise ValueError(f"a batch names a record outside the {len(lengths)} record lengths")
    sampler = ShardedBatchSampler(len(batches), world_size, 0, shuffle, seed, window=window)
    todo, total, epoch = steps * world_size * window, 0, 0
    while todo > 0:
        sampler.set_epoch(epoch)
        order = sampler.global_order()[:todo]
        total += sum(lengths[i] for b in order for i in batches[b])
        todo -= len(order)
        epoch += 1
    return total


def open_split(cache_dir: str | Path, split: str):
    """``data_prep.cache.CacheReader(cache_dir / split)``; FileNotFoundError names the missing directory."""
    from data_prep.cache import CacheReader

    path = Path(cache_dir) / split
    if not (path / "manifest.json").is_file():
        raise FileNotFoundError(
            f"cache split {path} not found (no manifest.json); run data prep first "
            f"(python -m data_prep ...) or set train.cache_dir"
        )
    return CacheReader(path)


def default_collate(pad_id: int) -> Callable[[list[dict]], dict]:
    """``data_prep.cache.collate`` with ``pad_id`` bound."""
    from functools import partial

    from data_prep.cache import collate

    return partial(collate, pad_id=pad_id)


class CacheDataModule(pl.LightningDataModule):
    """Training batches from the cache's ``train/`` split, validation from its held-out ``val/``.

    Args:
        cache_dir: a cache directory with ``train/`` and ``val/`` sub-caches, or None when
            ``train_reader`` / ``val_reader`` are given directly.
        pad_id: token id used to pad ``input_ids`` (the tokenizer's pad id).
        batch_size, max_tokens, bucket_size, shuffle: see :func:`make_batches` (validation uses
            the same limits, never shuffles).
        seed: seeds batch formation and the per-epoch order.
        num_workers: DataLoader workers.
        train_reader, val_reader: record readers to use instead of opening ``cache_dir``.
        collate_fn: ``collate_fn(records) -> batch``; default ``data_prep.cache.collate``.

    The world size and rank come from the attached Trainer (1 / 0 without one).
    """

    def __init__(self, cache_dir: str | Path | None, pad_id: int, batch_size: int | None = 8,
                 max_tokens: int | None = None, seed: int = 0, shuffle: bool = True, bucket_size: int = 64,
                 num_workers: int = 0, train_reader=None, val_reader=None,
                 collate_fn: Callable[[list[dict]], dict] | None = None) -> None:
        super().__init__()
        if cache_dir is None and (train_reader is None or val_reader is None):
            raise ValueError("CacheDataModule needs cache_dir or both train_reader and val_reader")
        self.cache_dir = cache_dir
        self.pad_id = int(pad_id)
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.seed = int(seed)
        self.shuffle = shuffle
        self.bucket_size = bucket_size
        self.num_workers = num_workers
        self.train_reader = train_reader
        self.val_reader = val_reader
        self.collate_fn = collate_fn
        self.train_batches: list[list[int]] | None = None
        self.val_batches: list[list[int]] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.collate_fn is None:
            self.collate_fn = default_collate(self.pad_id)
        if self.train_reader is None:
            self.train_reader = open_split(self.cache_dir, "train")
        if self.val_reader is None:
            self.val_reader = open_split(self.cache_dir, "val")
        for name, reader in (("train", self.train_reader), ("val", self.val_reader)):
            if len(reader) == 0:
                raise UserInputError(
                    f"cache split {name!r} of {self.cache_dir} holds no conversations; prepare more data "
                    "(data.max_conversations, data.heldout_fraction) with python -m data_prep")
        if self.train_batches is None:
            lengths = record_lengths(self.train_reader)
            if (line := over_token_budget(lengths, self.max_tokens)) and self._world()[1] == 0:
                from core.precision import note

                note(line)
            self.train_batches = make_batches(lengths, self.batch_size, self.max_tokens,
                                              self.seed, self.shuffle, self.bucket_size)
        if self.val_batches is None:
            self.val_batches = make_batches(record_lengths(self.val_reader), self.batch_size, self.max_tokens,
                                            self.seed, False, self.bucket_size)

    def _world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 1, 0
        return int(trainer.world_size), int(trainer.global_rank)

    def make_dataset(self, reader, batches: list[list[int]], split: str) -> Dataset:
        """The map-style dataset of one split's batches (:class:`BatchDataset`; ``train.online`` overrides it)."""
        return BatchDataset(reader, batches, self.collate_fn)

    def _loader(self, reader, batches, shuffle: bool, mark_padding: bool, window: int = 1) -> DataLoader:
        world, rank = self._world()
        sampler = ShardedBatchSampler(len(batches), world, rank, shuffle, self.seed, mark_padding, window=window)
        split = "train" if reader is self.train_reader else "val"
        return ResumableDataLoader(
            self.make_dataset(reader, batches, split), batch_size=None, sampler=sampler,
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0, seed=self.seed + rank,
        )

    def _window(self) -> int:
        trainer = getattr(self, "trainer", None)
        return int(getattr(trainer, "accumulate_grad_batches", 1) or 1) if trainer is not None else 1

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_reader, self.train_batches, self.shuffle, mark_padding=False,
                            window=self._window())

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_reader, self.val_batches, False, mark_padding=True)
