"""The draft vocabulary: a frequency-ranked subset of the base vocabulary a head drafts over.

FR-Spec (Zhao et al. 2025, §3 "frequency-ranked drafting") and EAGLE-3 (Li et al. 2025; public code
``eagle/traineagle3/cnets.py``, SpecForge ``specforge/data/preprocessing.py: generate_vocab_mapping``)
let the draft head score only the N most frequent target tokens instead of all V.  Verification by
the full base model is unchanged, so decoding stays lossless; only the drafter's proposals are
restricted to the subset.

Conventions of this project (one concept, one module; every head and loss uses only this API):

* ``counts`` int64 [V] — how often each base token is a greedy label on a loss position
  (``labels[loss_mask]``) in the training split (written by data prep).
* ``d2t`` int64 [N] — draft index → base token id, **strictly increasing** (sorted by id).  This
  is an *absolute* id, unlike the EAGLE-3 / SpecForge / vLLM export format, which stores the
  offset ``base_id - draft_index`` (see :func:`d2t_offsets`).
* ``t2d`` bool [V] — True where the base token is in the draft vocabulary.
* ``t2d_index`` int64 [V] — base id → draft index, ``-1`` outside the draft vocabulary
  (what losses use to move targets into draft-index space).

Selection rule (:func:`select_d2t`): the top N tokens by count, ties broken towards the lower
token id, then sorted by id.  Deterministic, independent of the number of shards or ranks.

Errors are ``ValueError`` with a one-line message naming the offending value; the CLI layers
re-raise them as ``core.config.UserInputError`` / ``ConfigError``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "AUTO_SIZE",
    "check_size",
    "select_d2t",
    "validate_d2t",
    "t2d_mask",
    "t2d_index",
    "to_base",
    "to_draft",
    "slice_rows",
    "coverage",
    "d2t_offsets",
    "DraftVocab",
]


#: N chosen by ``heads.draft_vocab_size: auto`` (the configs' default) when the base vocabulary is
#: larger; see docs/draft_vocab.md for the measurements behind it.
AUTO_SIZE = 16384


def check_size(size: int | str | None, vocab_size: int, key: str = "heads.draft_vocab_size") -> int | None:
    """Validate a configured draft-vocabulary size N against the base vocabulary size V.

    Args:
        size: N, None for the full vocabulary, or ``"auto"``: :data:`AUTO_SIZE` if it is smaller
            than V, else the full vocabulary (so small test vocabularies stay full).
        vocab_size: V (the base model's ``config.vocab_size``).
        key: the config key named in the error.

    Returns:
        ``None`` for the full vocabulary, otherwise N as an int.

    Raises:
        ValueError: ``size`` is not an integer, ``< 2`` or ``> V`` (and not null / ``auto``).
    """
    if size == "auto":
        return AUTO_SIZE if AUTO_SIZE < int(vocab_size) else None
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) and not (isinstance(size, float) and size.is_integer()):
        raise ValueError(f"{key}={size!r}: expected an integer in [2, {vocab_size}], auto or null (full vocabulary)")
    n = int(size)
    if n < 2 or n > int(vocab_size):
        raise ValueError(f"{key}={n}: must be in [2, {vocab_size}] (the base vocabulary size), auto or null")
    return n


def select_d2t(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The draft vocabulary of size N from label counts: top N by count, ties to the lower id, sorted.

    Args:
        counts: int64 (any integer dtype) [V], non-negative label counts per base token id.
        size: N, ``2 <= N <= V``.

    Returns:
        ``d2t`` int64 [N] (CPU), strictly increasing base token ids.

    Raises:
        ValueError: ``counts`` is not 1-D integer / has negative entries, or N is out of range.
    """
    if counts.dim() != 1 or counts.is_floating_point() or counts.dtype == torch.bool:
        raise ValueError(f"label counts: expected a 1-D integer tensor [V], got {tuple(counts.shape)} {counts.dtype}")
    counts = counts.detach().to("cpu", torch.int64)
    if bool((counts < 0).any()):
        raise ValueError(f"label counts: {int((counts < 0).sum())} negative entries")
    n = check_size(size, counts.numel())
    # stable sort by descending count keeps ascending ids among equal counts (ties → lower id)
    order = torch.sort(-counts, stable=True).indices
    return order[:n].sort().values


def validate_d2t(d2t: torch.Tensor, vocab_size: int, size: int | None = None, where: str = "d2t") -> torch.Tensor:
    """Check a stored ``d2t`` (e.g. from a checkpoint) and return it as int64 on its device.

    Args:
        d2t: integer tensor [N] of base ids.  vocab_size: V.  size: the expected N (e.g. from
        ``config.json``), or None to skip the length check.  where: names the source in errors.

    Raises:
        ValueError: not 1-D integer, wrong length, N < 2 or > V, ids outside [0, V), duplicates,
        or not sorted by id.
    """
    if d2t.dim() != 1 or d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise ValueError(f"{where}: expected a 1-D integer tensor, got shape {tuple(d2t.shape)} dtype {d2t.dtype}")
    d2t = d2t.to(torch.int64)
    n = d2t.numel()
    if size is not None and n != int(size):
        raise ValueError(f"{where}: has {n} entries, expected draft_vocab_size={int(size)}")
    if n < 2 or n > int(vocab_size):
        raise ValueError(f"{where}: has {n} entries, must be in [2, {vocab_size}]")
    bad = (d2t < 0) | (d2t >= int(vocab_size))
    if bool(bad.any()):
        raise ValueError(f"{where}: token id {int(d2t[bad][0])} out of range [0, {vocab_size})")
    uniq = torch.unique(d2t)
    if uniq.numel() != n:
        srt = d2t.sort().values
        dup = int(srt[1:][srt[1:] == srt[:-1]][0])
        raise ValueError(f"{where}: token id {dup} appears more than once")
    if n > 1 and not bool((d2t[1:] > d2t[:-1]).all()):
        raise ValueError(f"{where}: ids are not sorted ascending (draft index order must follow token id)")
    return d2t


def t2d_mask(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``t2d`` bool [V] on d2t's device: True at the base ids in ``d2t`` [N]."""
    mask = torch.zeros(int(vocab_size), dtype=torch.bool, device=d2t.device)
    mask[d2t] = True
    return mask


def t2d_index(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Base id → draft index lookup, int64 [V] on d2t's device, ``-1`` outside the draft vocabulary."""
    index = torch.full((int(vocab_size),), -1, dtype=torch.int64, device=d2t.device)
    index[d2t] = torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device)
    return index


def to_base(draft_ids: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """Map draft indices (any shape, long, in [0, N)) to base token ids; identity if ``d2t`` is None."""
    if d2t is None:
        return draft_ids
    return d2t.to(draft_ids.device)[draft_ids]


def to_draft(base_ids: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """Map base token ids (any shape, long) to draft indices with a :func:`t2d_index` table.

    Out-of-vocabulary ids map to ``-1``.  Identity if ``index`` is None (full vocabulary).
    """
    if index is None:
        return base_ids
    return index.to(base_ids.device)[base_ids]


def slice_rows(weight: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """The rows ``W[d2t]`` of an LM-head weight [V, H] → [N, H] (same dtype/device; a copy).

    This is FR-Spec's sliced LM head: logits over the draft vocabulary are ``h @ W[d2t].T``.
    Returns ``weight`` itself when ``d2t`` is None.
    """
    if d2t is None:
        return weight
    return weight.index_select(0, d2t.to(weight.device))


def coverage(counts: torch.Tensor, d2t: torch.Tensor | None) -> float:
    """Share of the counted labels that fall in the draft vocabulary: Σ counts[d2t] / Σ counts.

    ``counts`` int [V]; returns a float in [0, 1] (1.0 for ``d2t=None``; NaN when nothing was counted).
    """
    total = int(counts.sum())
    if d2t is None:
        return 1.0 if total else float("nan")
    if total == 0:
        return float("nan")
    return int(counts.to(torch.int64)[d2t.to(counts.device)].sum()) / total


def d2t_offsets(d2t: torch.Tensor) -> torch.Tensor:
    """EAGLE-3 / SpecForge / vLLM export form of the mapping: ``d2t[i] - i`` int64 [N].

    Those runtimes recover the base id as ``draft_index + offsets[draft_index]``.
    """
    return d2t.to(torch.int64) - torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device)


@dataclass(frozen=True)
class DraftVocab:
    """A validated draft vocabulary: ``d2t`` int64 [N] (sorted base ids) over a base vocab of V.

    Build with :meth:`from_counts` (data-prep label counts) or :meth:`from_d2t` (a checkpoint).
    ``t2d`` bool [V], ``index`` int64 [V] (base id → draft index, -1 outside) are derived.
    """

    d2t: torch.Tensor
    vocab_size: int

    @classmethod
    def from_counts(cls, counts: torch.Tensor, size: int) -> "DraftVocab":
        """Top-``size`` tokens of ``counts`` int64 [V] (see :func:`select_d2t`); raises ValueError."""
        return cls(select_d2t(counts, size), int(counts.numel()))

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, vocab_size: int, size: int | None = None, where: str = "d2t") -> "DraftVocab":
        """Validate a stored mapping (see :func:`validate_d2t`); raises ValueError naming ``where``."""
        return cls(validate_d2t(d2t, vocab_size, size, where), int(vocab_size))

    @classmethod
    def from_tensors(cls, tensors: dict, vocab_size: int, size: int | None = None, where: str = "checkpoint") -> "DraftVocab":
        """Rebuild from :meth:`tensors` output (``d2t`` and optional ``t2d``); checks they agree.

        Raises:
            ValueError: ``d2t`` missing or invalid, or ``t2d`` not bool [V] equal to the mask of ``d2t``.
        """
        if "d2t" not in tensors:
            raise ValueError(f"{where}: no 'd2t' tensor")
        vocab = cls.from_d2t(tensors["d2t"], vocab_size, size, where=f"{where}: d2t")
        if "t2d" in tensors:
            t2d = tensors["t2d"]
            if t2d.dtype != torch.bool or tuple(t2d.shape) != (int(vocab_size),) or not torch.equal(t2d.cpu(), vocab.t2d.cpu()):
                raise ValueError(f"{where}: t2d (shape {tuple(t2d.shape)}, {t2d.dtype}) does not match d2t over V={vocab_size}")
        return vocab

    @property
    def size(self) -> int:
        """N, the number of draft tokens."""
        return int(self.d2t.numel())

    @property
    def t2d(self) -> torch.Tensor:
        """bool [V]: True where the base token is drafted."""
        return t2d_mask(self.d2t, self.vocab_size)

    @property
    def index(self) -> torch.Tensor:
        """int64 [V]: base id → draft index, -1 outside."""
        return t2d_index(self.d2t, self.vocab_size)

    def to_base(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft indices [...] → base ids [...]."""
        return to_base(draft_ids, self.d2t)

    def to_draft(self, base_ids: torch.Tensor) -> torch.Tensor:
        """Base ids [...] → draft indices [...] (-1 outside)."""
        return to_draft(base_ids, self.index)

    def slice_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """LM-head rows W[d2t]: [V, H] → [N, H]."""
        if weight.shape[0] != self.vocab_size:
            raise ValueError(f"LM head has {weight.shape[0]} rows, draft vocabulary expects V={self.vocab_size}")
        return slice_rows(weight, self.d2t)

    def tensors(self) -> dict[str, torch.Tensor]:
        """``{"d2t": int64 [N], "t2d": bool [V]}`` (CPU) for ``model.safetensors``."""
        d2t = self.d2t.detach().cpu().contiguous()
        return {"d2t": d2t, "t2d": t2d_mask(d2t, self.vocab_size)}
