"""Training stops on a non-finite loss or gradient, on every rank together (issue 28).

Rule (one, documented in ``docs/reliability.md``): a NaN / ±inf in a micro-batch's features or
training loss (checked on every micro-batch, before its backward) or in a gradient (checked before every optimizer step, before any
clipping: clipping by value would turn an inf into ±clip and hide it) raises
:class:`core.finite.NonFiniteError`, so the update that would have used it never happens and
``last.ckpt`` keeps the last finite weights.  The message names the optimizer step, the epoch, the
micro-batch and the conversation ids of every rank's accumulation window, and for a gradient the
first parameter that holds one.  Steps are never skipped silently: a non-finite value means
broken data or numerics (data prep already drops non-finite conversations), and a skipped step
would change the run without a trace.

Multi-process runs (DDP, DeepSpeed ZeRO): every rank computes its own flag, the flags are
all-reduced (max; one scalar per micro-batch and per step) and all ranks raise together, so no rank
waits forever in a collective that a stopped rank never joins.  Under ZeRO-2/3 the gradients live
in each rank's partition, checked by a pre-hook on the wrapped optimizer
(:class:`train.strategies.ZeroStrategy`); DeepSpeed itself all-reduces the gradient norm and, when it
is not finite, skips the update with only a log line ("OVERFLOW! Skipping step", also in fp32 and
bf16): that skipped step stops the run here too, right after it.  Under fp16 loss scaling (``train.precision=16-mixed``)
non-finite gradients are the scaler's signal to skip the step and lower the scale, so only the
loss is checked there.
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

import torch

from core.finite import NonFiniteError, all_finite, describe, first_non_finite

#: precisions whose loss scaler handles non-finite gradients itself (skips the step)
LOSS_SCALED = ("16-mixed", "16")


def agree(flag: bool, trainer) -> bool:
    """``flag`` or-ed over all ranks (a collective call when the world size is > 1)."""
    if trainer is None or int(getattr(trainer, "world_size", 1)) <= 1:
        return bool(flag)
    t = torch.tensor([int(bool(flag))], dtype=torch.long, device=trainer.strategy.root_device)
    return bool(trainer.strategy.reduce(t, reduce_op="max").item())


def _gather(obj: Any, trainer) -> list[Any]:
    if trainer is None or int(getattr(trainer, "world_size", 1)) <= 1 or not torch.distributed.is_initialized():
        return [obj]
    out: list[Any] = [None] * int(trainer.world_size)
    torch.distributed.all_gather_object(out, obj)  # in memory, on the failure path only
    return out


def stop(what: str, trainer, local: dict[str, Any], step: int | None = None) -> None:
    """Raise the agreed :class:`NonFiniteError` on this rank (every rank calls it together).

    ``local``: this rank's ``{"bad": bool, "detail": str, "window": [[conversation ids] per micro-batch]}``;
    ``step``: the 1-based optimizer step (default: the one in progress, ``global_step + 1``).
    """
    everyone = _gather(local, trainer)
    step = int(getattr(trainer, "global_step", 0)) + 1 if step is None else int(step)
    epoch = int(getattr(trainer, "current_epoch", 0))
    parts = [f"rank {r}: {d['detail']}, conversations {d['window']}" for r, d in enumerate(everyone) if d.get("bad")]
    raise NonFiniteError(
        f"non-finite {what} in optimizer step {step} (epoch {epoch}): {'; '.join(parts)}. Training stopped "
        f"before this update on every rank; {_checkpoint_note(trainer)}. Check those conversations "
        f"(python -m data_prep drops and counts non-finite features) or the optimisation settings (train.optimizer.lr, "
        f"train.precision)")


def _checkpoint_note(trainer) -> str:
    """What the run has on disk to go back to: its last checkpoint (finite: no non-finite update was ever
    applied), or that none was written yet."""
    cb = getattr(trainer, "checkpoint_callback", None)
    last = getattr(cb, "last_model_path", "") or ""
    if last and os.path.isfile(last):
        return f"its last checkpoint ({last}) holds finite weights"
    return "no checkpoint was written before it (the first is written at the first validation)"


def batch_detail(batch: dict[str, Any], loss: torch.Tensor | None, error: str | None,
                 micro_batch: int) -> tuple[bool, str]:
    """``(bad, detail)`` for one micro-batch: its features (``hidden``, ``aux_hidden``: [B, T, H]),
    then its loss (one device sync).  A non-finite feature is refused even where the head's loss
    happens not to read it; ``error``: a refusal raised while computing the loss."""
    if error is not None:
        return True, f"micro-batch {micro_batch}: {error}"
    feats = [("hs[L]", batch.get("hidden"))] + [(f"hs[{l}]", t) for l, t in sorted((batch.get("aux_hidden") or {}).items())]
    value = loss.detach()
    if all_finite([value, *(t for _, t in feats if isinstance(t, torch.Tensor))]):
        return False, ""
    ids = list(batch.get("ids", []))
    for name, t in feats:
        found = first_non_finite(t) if isinstance(t, torch.Tensor) else None
        if found is not None:
            (b, pos, *_), v, count = found
            who = ids[b] if b < len(ids) else f"row {b}"
            return True, (f"micro-batch {micro_batch}: feature {name} of conversation {who!r} is {describe(v)} at token "
                          f"{pos} ({count} non-finite value(s))")
    return True, f"micro-batch {micro_batch}: loss {describe(float(value.float().reshape(-1)[0]))}"


def grad_detail(named: Iterable[tuple[str, torch.Tensor | None]]) -> tuple[bool, str]:
    """``(bad, detail)`` over ``(name, grad)`` pairs (None grads skipped): the first non-finite one is named."""
    pairs = [(n, g) for n, g in named if g is not None]
    if all_finite(g for _, g in pairs):
        return False, ""
    for name, g in pairs:
        found = first_non_finite(g.detach())
        if found is not None:
            index, value, count = found
            return True, f"gradient of {name} {list(g.shape)} has {count} non-finite value(s) (first {describe(value)} at {list(index)})"
    return True, "a gradient is non-finite"


def check_window(what: str, trainer, bad: bool, detail: str, window: Sequence[Sequence[str]],
                 step: int | None = None) -> None:
    """Agree on ``bad`` across ranks and raise for all of them if any rank's value is non-finite."""
    if agree(bad, trainer):
        stop(what, trainer, {"bad": bool(bad), "detail": detail, "window": [list(w) for w in window]}, step)
