"""Reference drafters for tests and benchmarks: an oracle and a random drafter.

* :class:`OracleDrafter` drafts the base model's own greedy continuation (computed with its own
  KV cache, one token at a time) plus wrong sibling tokens at every depth, so verification
  accepts (almost) the whole chain: τ near its maximum ``depth + 1``.  With ``shuffle`` the
  correct child is not always the first sibling (exercises non-contiguous KV compaction); with
  ``miss_prob`` the correct token is left out at a depth with that probability.
* :class:`RandomDrafter` drafts uniformly random tokens: τ near 1.

Both implement :class:`decoding.speculative.Drafter` and re-seed their generator in ``start`` from
(``seed``, the prompt's token ids) (:func:`prompt_seed`): a prompt gets the same trees whatever
prompts were decoded before it, so reference results do not depend on prompt order, sharding,
resuming or warm-up runs.
"""
from __future__ import annotations

import hashlib
import random

import torch

from decoding.ranking import greedy_ids
from decoding.tree import DraftTree
from decoding.verify import base_forward, crop_cache, new_cache

#: ``eval.checkpoint`` values that name a reference drafter instead of a head checkpoint folder
REFERENCE_DRAFTERS = ("oracle", "random")


def prompt_seed(seed: int, prompt_ids) -> int:
    """A 63-bit seed from ``seed`` and a prompt's token ids (LongTensor [T] or ints), stable across
    processes and platforms (SHA-256, not Python's salted ``hash``)."""
    ids = [int(t) for t in torch.as_tensor(prompt_ids).reshape(-1).tolist()]
    digest = hashlib.sha256(f"{int(seed)}:{','.join(map(str, ids))}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class OracleDrafter:
    """Drafts the base model's greedy continuation of depth ``depth`` with ``width - 1`` wrong
    siblings per depth.

    Args:
        base_model: the frozen base model (the drafter runs it itself, ``depth`` forwards per step).
        depth: draft depth D >= 1 (the chain length below the root).
        width: children per chain node (1 correct + ``width - 1`` wrong leaves), >= 1.
        shuffle: give the correct child a random sibling rank.
        miss_prob: probability, per depth, of leaving the correct token out (the chain ends there).
        seed: for ``shuffle`` / ``miss_prob``; the generator restarts at every prompt from
            :func:`prompt_seed` (seed, prompt).
    """

    def __init__(self, base_model, depth: int = 4, width: int = 2, shuffle: bool = False,
                 miss_prob: float = 0.0, seed: int = 0) -> None:
        if depth < 1 or width < 1:
            raise ValueError(f"depth={depth} and width={width} must be >= 1")
        self.base_model = base_model
        self.depth, self.width = int(depth), int(width)
        self.shuffle, self.miss_prob = bool(shuffle), float(miss_prob)
        self.vocab_size = int(base_model.config.vocab_size)
        self.seed = int(seed)
        self.rng = random.Random(self.seed)
        self.ctx: list[int] = []
        self.cache = None

    def reset(self) -> None:
        self.ctx, self.cache = [], None

    def start(self, prompt_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """After prefill: prompt_ids [T] long (hidden unused); re-seeds the generator per prompt."""
        self.ctx = [int(t) for t in prompt_ids.tolist()]
        self.cache = new_cache(self.base_model)
        self.rng = random.Random(prompt_seed(self.seed, prompt_ids))

    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        self.ctx.extend(int(t) for t in tokens.tolist())

    def _greedy(self, root: int) -> list[int]:
        full = self.ctx + [root]
        crop_cache(self.cache, min(self.cache.get_seq_length(), len(self.ctx)))
        pending = full[self.cache.get_seq_length():]
        out = []
        for _ in range(self.depth):
            logits, _ = base_forward(self.base_model, torch.tensor(pending), self.cache)
            tok = int(greedy_ids(logits[-1]))
            out.append(tok)
            pending = [tok]
        crop_cache(self.cache, len(full))
        return out

    def draft(self, root_token: int) -> DraftTree:
        chain = self._greedy(int(root_token))
        # scores only order siblings (a node scores the best path through it): the chain path
        # scores 0, a wrong sibling +1 if it is ranked before the correct child, else -1
        paths, scores = [], []
        prefix: list[int] = []
        for tok in chain:
            rank = self.rng.randrange(self.width) if self.shuffle else 0
            for k in range(1, self.width):
                paths.append(prefix + [(tok + k * 7919) % self.vocab_size])
                scores.append(1.0 if k <= rank else -1.0)
            if self.rng.random() < self.miss_prob:
                break
            prefix = prefix + [tok]
        paths.append(prefix)
        scores.append(0.0)
        return DraftTree.from_paths(root_token, paths, scores, drafter_passes=self.depth)


class RandomDrafter:
    """Drafts ``width`` random chains of length ``depth`` (uniform token ids): τ near 1.

    Args:
        vocab_size: V.
        depth: chain length D >= 1; width: number of chains >= 1.
        seed: RNG seed; the generator restarts at every prompt from :func:`prompt_seed` (seed, prompt).
    """

    def __init__(self, vocab_size: int, depth: int = 3, width: int = 2, seed: int = 0) -> None:
        if depth < 1 or width < 1:
            raise ValueError(f"depth={depth} and width={width} must be >= 1")
        self.vocab_size, self.depth, self.width = int(vocab_size), int(depth), int(width)
        self.seed = int(seed)
        self.gen = torch.Generator().manual_seed(self.seed)

    def start(self, prompt_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """After prefill: re-seeds the generator from (seed, prompt_ids [T])."""
        self.gen.manual_seed(prompt_seed(self.seed, prompt_ids))

    def accept(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        pass

    def draft(self, root_token: int) -> DraftTree:
        paths = torch.randint(0, self.vocab_size, (self.width, self.depth), generator=self.gen)
        return DraftTree.from_paths(root_token, list(paths), drafter_passes=0)
