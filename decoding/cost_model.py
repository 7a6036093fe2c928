"""The verification cost model c(n): one base forward over n tree tokens, measured on the run's hardware.

c(n) is what a tree of n nodes (root included) costs per decoding step — the quantity Sequoia's
tree search and EAGLE-2's ``total_token=-1`` budget selection time on the target hardware.  It
is measured, never assumed: after a prefill of ``context_tokens`` random tokens, one
:func:`decoding.verify.verify_tree` (tree-attention forward + argmax + KV compaction) over a
random n-node tree, repeated, the median kept; the cache is cropped back between repeats so every
measurement sees the same context length.

Measurements are cached as JSON per (base identity, device, dtype, threads, grid, context
length) under ``<output_root>/cost_model/``; any change of these keys gives another file, i.e. a
re-measurement (:func:`load_or_measure`).  Each file records the machine load it was measured under
(:func:`decoding.measurement.machine_load`), and every reuse is logged with the file, its age and
that load.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from core.io import atomic_write_json, sha256_json
from decoding.measurement import busy, load_text, machine_load, reuse_line
from decoding.tree import DraftTree
from decoding.verify import crop_cache, model_device, prefill, verify_tree

log = logging.getLogger(__name__)


@dataclass
class CostModel:
    """Measured verification cost.

    Attributes:
        sizes: node counts n (root incl.), ascending.
        verify_ms: median milliseconds of one verification forward per size.
        key: what the measurement depends on (base identity, device, dtype, threads, grid, context).
        context_tokens: cached tokens before the tree.
        repeats: timed repeats per size.
        path: the cache file it was loaded from / written to (None if not cached).
    """

    sizes: list[int]
    verify_ms: list[float]
    key: dict[str, Any]
    context_tokens: int
    repeats: int
    path: str | None = None
    measured_at: float | None = None
    load: dict[str, Any] | None = None  # decoding.measurement.machine_load() when measured
    reused: bool = False  # read from the cache file rather than measured by this run

    def verify_seconds(self, n: int) -> float:
        """c(n) in seconds: piecewise-linear interpolation over the grid, linear extrapolation
        beyond it from the nearest segment (constant when the grid has one point)."""
        xs, ys = self.sizes, self.verify_ms
        n = float(n)
        if len(xs) == 1:
            return ys[0] / 1000.0
        if n <= xs[0]:
            i = 0
        elif n >= xs[-1]:
            i = len(xs) - 2
        else:
            i = next(j for j in range(len(xs) - 1) if xs[j] <= n <= xs[j + 1])
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        y = y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        return max(y, 0.0) / 1000.0

    def to_dict(self) -> dict[str, Any]:
        return {"sizes": self.sizes, "verify_ms": self.verify_ms, "key": self.key, "context_tokens": self.context_tokens,
                "repeats": self.repeats, "path": self.path, "measured_at": self.measured_at, "load": self.load,
                "reused": self.reused}


def check_grid(sizes: Sequence[int] | None, where: str = "eval.tree_grid") -> list[int]:
    """Sorted distinct node counts; raises ValueError naming ``where`` for an empty grid or n < 1."""
    grid = sorted({int(n) for n in (sizes or [])})
    if not grid:
        raise ValueError(f"{where} is empty: give the node counts (root included) to measure, e.g. [1, 2, 4, 8, 16]")
    if grid[0] < 1:
        raise ValueError(f"{where}={list(sizes)}: node counts must be >= 1 (the root)")
    return grid


@torch.no_grad()
def measure_verify_ms(model, sizes: Sequence[int], context_tokens: int = 256, repeats: int = 5,
                      seed: int = 0, clock: str = "wall") -> list[float]:
    """Median ms of one verification forward over a random n-node tree after ``context_tokens``.

    The tree is a random trie of depth ≤ 4 (its shape hardly matters to one forward: the cost is
    the n query tokens plus the ancestor mask); the context is random token ids.  One untimed
    forward warms up first.

    Args:
        clock: ``wall`` (``time.perf_counter``, what a run pays; the default and what
            ``eval.tree=auto`` uses) or ``cpu`` (``time.process_time``: CPU seconds of this process
            over all its threads, which time spent descheduled on a shared machine does not inflate;
            at one thread it approximates the wall clock of an idle core).

    Raises:
        ValueError: an unknown ``clock``.

    Returns:
        one float per size (same order as ``sizes``).
    """
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock={clock!r}: use wall or cpu")
    now = time.perf_counter if clock == "wall" else time.process_time
    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    ctx = torch.randint(0, vocab, (max(int(context_tokens), 1),), generator=gen)
    cache, root, _ = prefill(model, ctx)
    past = cache.get_seq_length()
    dev = model_device(model)
    trees = []
    for n in sizes:
        paths = [torch.randint(0, vocab, (4,), generator=gen).tolist() for _ in range(int(n))]
        trees.append(DraftTree.from_paths(root, paths, max_nodes=int(n)))
    times: list[list[float]] = [[] for _ in trees]
    # rounds over the whole grid (round 0 is a warm-up), so that a burst of load from other
    # processes hits every size alike instead of inflating the few sizes timed during it
    from tqdm.auto import tqdm

    bar = tqdm(total=(int(repeats) + 1) * len(trees), unit="forward", desc="measuring c(n)", mininterval=1.0,
               dynamic_ncols=True)
    for r in range(int(repeats) + 1):
        for j, tree in enumerate(trees):
            bar.update(1)
            crop_cache(cache, past)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = now()
            verify_tree(model, cache, tree)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if r:
                times[j].append(now() - t0)
    bar.close()
    out = [1000.0 * sorted(t)[len(t) // 2] for t in times]
    crop_cache(cache, past)
    return out


def cost_key(identity, model, sizes: Sequence[int], context_tokens: int, repeats: int) -> dict[str, Any]:
    """What a measurement depends on: base identity, device (with the GPU's name or the CPU's model and
    ISA flags, :func:`core.precision.cpu_identity`), dtype, intra-op threads, OpenMP's wait
    policy, grid, context, and (keys present only then) the ``min_rows`` of prepacked linear weights and
    the layers and chunk rows of row-consistent packing (:mod:`decoding.prepacked`: a packed base
    verifies faster, so its c(n) is its own), and the attention implementation when it is not
    ``eager`` (sdpa's verification costs differ).

    ``omp_wait_policy`` is ``$OMP_WAIT_POLICY`` upper-cased (None when unset): with ``PASSIVE`` a
    2-thread verification forward measured 2.2x slower on this project's 2-core CPU (c(1) 133 against
    59 ms) and its c(n)/c(1) flatter, so a measurement taken under one policy is never reused under
    another (a tree planned on it was mis-sized; docs/precision.md).
    """
    ident = identity.to_dict() if hasattr(identity, "to_dict") else identity
    dev = model_device(model)
    device = str(dev)
    if dev.type == "cuda":
        device += f" ({torch.cuda.get_device_name(dev)})"
    elif dev.type == "cpu":  # c(n) of one CPU model must not size another's trees (a shared or copied output_root)
        from core.precision import cpu_identity

        device += f" ({cpu_identity()})"
    key = {"base": ident, "device": device, "dtype": str(model.dtype).replace("torch.", ""),
           "threads": int(torch.get_num_threads()), "omp_wait_policy": omp_wait_policy(),
           "sizes": [int(n) for n in sizes],
           "context_tokens": int(context_tokens), "repeats": int(repeats), "torch": torch.__version__}
    from decoding.prepacked import prepacked_chunks, prepacked_min_rows

    if (rows := prepacked_min_rows(model)) is not None:  # present only when packed: older files stay valid
        key["prepacked_min_rows"] = rows
    if (chunks := prepacked_chunks(model)) is not None:  # bf16 packed for every row count: layers, chunk rows
        key["prepacked_chunks"] = list(chunks)
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if attention not in (None, "eager"):  # sdpa verifies at another cost; absent for eager: older files stay valid
        key["attention"] = attention
    return key


def omp_wait_policy() -> str | None:
    """``$OMP_WAIT_POLICY`` as OpenMP reads it (upper-cased, stripped), or None when unset or empty."""
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().upper()
    return policy or None


def load_or_measure(model, identity, root: str | Path, sizes: Sequence[int], context_tokens: int = 256,
                    repeats: int = 5) -> CostModel:
    """The cached :class:`CostModel` for this (base, device, dtype, threads, grid, context), measured
    and written atomically to ``<root>/cost_model/<hash>.json`` when absent (or unreadable).

    Raises:
        ValueError: empty grid (:func:`check_grid`).
    """
    grid = check_grid(sizes)
    key = cost_key(identity, model, grid, context_tokens, repeats)
    path = Path(root) / "cost_model" / f"{sha256_json(key)[:16]}.json"
    if path.is_file():
        try:
            d = json.loads(path.read_text())
            if d.get("key") == key:
                cm = CostModel(sizes=list(d["sizes"]), verify_ms=list(d["verify_ms"]), key=key,
                               context_tokens=int(d["context_tokens"]), repeats=int(d["repeats"]), path=str(path),
                               measured_at=d.get("measured_at"), load=d.get("load"), reused=True)
                log.info(reuse_line("cost model c(n)", path, cm.measured_at, cm.load))
                return cm
        except (ValueError, KeyError, TypeError):
            log.warning("cost model %s unreadable; measuring again", path)
    log.info("measuring c(n) for n in %s at context %d on %s (%s, %d threads)", grid, context_tokens, key["device"],
             key["dtype"], key["threads"])
    load = machine_load()  # the load the measurement is taken under (reported on every reuse)
    if busy(load):
        log.warning("measuring c(n) on a busy machine (%s): the cost model is cached in %s; delete it and measure "
                    "again on a quiet machine for timing runs", load_text(load), path)
    ms = measure_verify_ms(model, grid, context_tokens, repeats)
    cm = CostModel(sizes=grid, verify_ms=ms, key=key, context_tokens=int(context_tokens), repeats=int(repeats),
                   path=str(path), measured_at=time.time(), load=load)
    atomic_write_json(path, cm.to_dict())
    return cm
