"""Pickle-free, atomic resume checkpoints for DeepSpeed ZeRO 1/2/3 under Lightning.

DeepSpeed's own engine checkpoints (``engine.save_checkpoint``, what Lightning's
``DeepSpeedStrategy`` writes) are ``torch.save`` pickles, one per rank, in a directory that is
written in place.  Instead :class:`train.strategies.ZeroStrategy` writes, for a checkpoint path
``P`` (e.g. ``.../last.ckpt``):

* ``P`` - the ordinary Lightning checkpoint through the trainer's CheckpointIO
  (``train.checkpoint_io.SafetensorsCheckpointIO``: safetensors + JSON), whose ``state_dict`` holds
  the **consolidated fp32 master weights** (ZeRO-3 partitions gathered with
  ``deepspeed.utils.safe_get_full_fp32_param``), i.e. exactly what a single-process run stores,
  plus a ``zero`` entry naming the shard directory, stage and world size;
* ``P.zero-<step>-<token>/rank-<r>-of-<W>.safetensors`` - rank ``r``'s ZeRO optimizer partition
  (DeepSpeed's ``optimizer.state_dict()``: fp32 master partition, AdamW moments and step, loss
  scaler) in the same safetensors + JSON encoding (``train.checkpoint_io.dumps``), plus the
  engine's step counters.

Atomicity: every rank writes its shard into the *new* shard directory first (each file via
temp-file + rename), all ranks meet at a barrier, and only then rank 0 replaces ``P`` atomically;
older shard directories of ``P`` are deleted after that.  A kill at any moment leaves ``P`` either
the previous complete checkpoint (pointing at its own, untouched shard directory) or the new one.

Resume needs the same ZeRO stage and world size (the optimizer partitions are rank-local); a
mismatch raises a ``ValueError`` naming both.  The consolidated weights in ``P`` are readable by
any strategy and by the export (:func:`heads.save`), e.g. to start a new run from them.

The frozen base weights the heads borrow are non-persistent buffers: they are in no state dict,
never partitioned by ZeRO-3 (which shards parameters only) and never written here.
"""
from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from core.io import atomic_write_bytes

FORMAT = "draftheads-zero-v1"
_SHARD_DIR_RE = re.compile(r"\.zero-[0-9]+-[0-9a-f]{8}$")
# Entries of DeepSpeed's ZeRO optimizer state_dict that only serve DeepSpeed's "universal
# checkpoint" conversion (not used when reloading at the same world size).
_DROP_KEYS = ("param_slice_mappings", "universal_checkpoint_info")
_ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def shard_name(rank: int, world_size: int) -> str:
    """File name of rank ``rank``'s optimizer partition."""
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def shard_dirs(path: str | os.PathLike) -> list[Path]:
    """All shard directories ``<path>.zero-*`` that belong to checkpoint file ``path``."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    return sorted(p for p in path.parent.iterdir()
                  if p.is_dir() and p.name.startswith(path.name + ".zero-") and _SHARD_DIR_RE.search(p.name))


# ---------------------------------------------------------------------------------------------
def full_fp32_state_dict(strategy) -> dict[str, torch.Tensor]:
    """The LightningModule's state dict with every parameter as its full fp32 master copy (CPU).

    A collective call under ZeRO-3 (every rank must call it; each gathers the partitions).  Keys
    and order are those of ``lightning_module.state_dict()``; persistent buffers are copied as they
    are.  Parameters DeepSpeed does not manage (frozen ones) are returned from the module itself.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    module = strategy.lightning_module
    params = dict(module.named_parameters())
    frozen = [p for p in params.values() if hasattr(p, "ds_id") and not p.requires_grad]
    gathered: dict[int, torch.Tensor] = {}
    if frozen:
        # Frozen ZeRO-3 parameters have no fp32 master: gather their partitions.  ZeRO-3's
        # prefetcher may still have an all-gather of some of them in flight from the last forward
        # (a validation whose module order differs from the recorded trace), and gathering such a
        # parameter fails with "Cannot partition a param in flight": release and re-partition
        # every parameter first (waits for the in-flight gathers), then gather all frozen ones at once.
        import deepspeed

        engine = getattr(strategy, "deepspeed_engine", None)
        if engine is not None and hasattr(engine, "empty_partition_cache"):
            engine.empty_partition_cache()
        with deepspeed.zero.GatheredParameters(frozen):
            gathered = {id(p): p.detach().float().cpu().clone() for p in frozen}
    out: dict[str, torch.Tensor] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        param = params.get(key)
        if param is None:
            out[key] = value.detach().cpu().clone()
            continue
        full = gathered.get(id(param))
        if full is None:
            full = safe_get_full_fp32_param(param)
        if full is None:
            full = param.detach().float()
        out[key] = full.detach().cpu().clone().reshape(param.ds_shape if hasattr(param, "ds_shape") else param.shape)
    return out


def _to_plain(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    state = {k: v for k, v in optimizer_state.items() if k not in _DROP_KEYS}
    scaler = state.get("loss_scaler")
    if scaler is not None and not isinstance(scaler, dict):
        state["loss_scaler"] = {k: v for k, v in vars(scaler).items()
                                if isinstance(v, (bool, int, float, str, torch.Tensor)) or v is None}
    if "zero_stage" in state:
        state["zero_stage"] = int(state["zero_stage"])
    return state


def _checkpoint_io(strategy):
    from train.checkpoint_io import SafetensorsCheckpointIO

    io = strategy.checkpoint_io
    return io if isinstance(io, SafetensorsCheckpointIO) else SafetensorsCheckpointIO()


def save(strategy, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
    """Write the consolidated checkpoint ``filepath`` and every rank's ZeRO shard (collective).

    ``checkpoint`` is Lightning's dump (its ``state_dict`` already consolidated by
    :func:`full_fp32_state_dict`; its ``optimizer_states`` this rank's ZeRO partition).

    Raises:
        TypeError: ``storage_options`` given (not supported), or an entry cannot be stored without pickle.
    """
    from train.checkpoint_io import dumps

    if storage_options is not None:
        raise TypeError(f"ZeRO checkpoints take no storage_options, got {storage_options!r}")
    filepath = Path(strategy.broadcast(str(filepath)))
    engine = strategy.deepspeed_engine
    token = strategy.broadcast(f"{int(checkpoint.get('global_step', 0))}-{uuid.uuid4().hex[:8]}")
    shard_dir = filepath.parent / f"{filepath.name}.zero-{token}"
    world, rank = strategy.world_size, strategy.global_rank

    checkpoint = dict(checkpoint)
    optimizer_states = checkpoint.pop("optimizer_states", None) or [engine.optimizer.state_dict()]
    shard = {
        "format": FORMAT,
        "rank": rank,
        "world_size": world,
        "zero_stage": strategy.zero_stage,
        "optimizer": _to_plain(optimizer_states[0]),
        "engine": {k: int(getattr(engine, k, 0)) for k in _ENGINE_COUNTERS},
    }
    shard_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(shard_dir / shard_name(rank, world), dumps(shard))
    strategy.barrier("zero_checkpoint.shards_written")
    if strategy.is_global_zero:
        checkpoint["zero"] = {"format": FORMAT, "stage": strategy.zero_stage, "world_size": world,
                              "shards": shard_dir.name}
        _checkpoint_io(strategy).save_checkpoint(checkpoint, filepath)
        for old in shard_dirs(filepath):
            if old.name != shard_dir.name:
                shutil.rmtree(old, ignore_errors=True)
    strategy.barrier("zero_checkpoint.committed")


def remove(strategy, filepath) -> None:
    """Delete checkpoint ``filepath`` and its shard directories (rank 0 only, like Lightning)."""
    if strategy.is_global_zero:
        _checkpoint_io(strategy).remove_checkpoint(filepath)
        for old in shard_dirs(filepath):
            shutil.rmtree(old, ignore_errors=True)


def load(strategy, checkpoint_path) -> dict[str, Any]:
    """Read ``checkpoint_path``; when fitting, load this rank's ZeRO shard into the engine.

    Returns the Lightning checkpoint dict (consolidated ``state_dict``; Lightning restores loops,
    LR schedulers and callbacks from it, :func:`load_weights` the module weights).

    Raises:
        FileNotFoundError: the checkpoint or this rank's shard is missing.
        ValueError: the checkpoint was not written under ZeRO, or under another stage / world size.
    """
    from lightning.pytorch.trainer.states import TrainerFn

    from train.checkpoint_io import loads

    checkpoint_path = Path(strategy.broadcast(str(checkpoint_path)))
    checkpoint = _checkpoint_io(strategy).load_checkpoint(checkpoint_path)
    fitting = strategy.lightning_module.trainer.state.fn == TrainerFn.FITTING
    if not fitting:
        return checkpoint
    zero = checkpoint.get("zero")
    if not zero:
        raise ValueError(
            f"{checkpoint_path} was not written under DeepSpeed ZeRO (no 'zero' entry), so it holds no ZeRO "
            "optimizer partitions; resume it with the strategy it was trained with "
            "(its consolidated weights can still start a new run)"
        )
    if int(zero["world_size"]) != strategy.world_size or int(zero["stage"]) != strategy.zero_stage:
        raise ValueError(
            f"{checkpoint_path} was written by ZeRO-{zero['stage']} on {zero['world_size']} ranks; this run is "
            f"ZeRO-{strategy.zero_stage} on {strategy.world_size} ranks.  The optimizer partitions are rank-local: "
            "resume with the same strategy and world size"
        )
    shard_path = checkpoint_path.parent / zero["shards"] / shard_name(strategy.global_rank, strategy.world_size)
    if not shard_path.is_file():
        raise FileNotFoundError(f"ZeRO shard {shard_path} of checkpoint {checkpoint_path} is missing")
    shard = loads(shard_path.read_bytes(), str(shard_path))
    if shard.get("format") != FORMAT or int(shard["rank"]) != strategy.global_rank:
        raise ValueError(f"{shard_path}: not rank {strategy.global_rank}'s ZeRO shard")

    engine = strategy.deepspeed_engine
    optimizer = engine.optimizer
    state = dict(shard["optimizer"])
    scaler = optimizer.loss_scaler
    for key, value in (state.get("loss_scaler") or {}).items():
        setattr(scaler, key, value)
    state["loss_scaler"] = scaler
    state_list: list[Any] = [None] * strategy.world_size
    state_list[strategy.global_rank] = move_data_to_device(state, strategy.root_device)
    optimizer.load_state_dict(state_list, load_optimizer_states=True, load_from_fp32_weights=True)
    for key, value in shard["engine"].items():
        setattr(engine, key, int(value))
    return checkpoint


def load_weights(strategy, checkpoint: dict[str, Any], strict: bool = True) -> None:
    """Load the consolidated ``checkpoint['state_dict']`` into the (possibly partitioned) module.

    ZeRO-1/2 keep whole low-precision parameters on every rank: copied in place.  ZeRO-3: each
    submodule's partitions are gathered, rank 0 loads, and DeepSpeed re-partitions (Lightning's
    ``_restore_zero_state``).
    """
    if strategy.zero_stage == 3:
        strategy._restore_zero_state(checkpoint, strict=strict)
        return
    module = strategy.lightning_module
    state = {k: v for k, v in checkpoint["state_dict"].items()}
    module.load_state_dict(state, strict=strict)
