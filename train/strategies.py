"""Distributed strategies: one process, DDP, and DeepSpeed ZeRO stage 1/2/3 on GPUs or CPUs.

``strategy=<option>`` selects ``configs/strategy/<option>.yaml``; :func:`trainer_kwargs` turns
that section into the ``strategy`` / ``accelerator`` / ``devices`` / ``num_nodes`` /
``precision`` arguments of ``lightning.pytorch.Trainer``.  The same code path runs one CPU
process, ``srun`` over N nodes x 8 GPUs, or a ``torchrun``-style launch (the launcher sets
``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``).

* On GPUs the ZeRO stages are Lightning's :class:`~lightning.pytorch.strategies.DeepSpeedStrategy`
  with its own engine set-up untouched (:class:`ZeroStrategy` only replaces the pickle-based
  checkpoint files, see below).
* On CPUs Lightning's DeepSpeed strategy refuses to run (it insists on ``CUDAAccelerator`` and on
  CUDA device indices).  :class:`CPUZeroStrategy` runs the *same* DeepSpeed ZeRO engine over gloo:
  it keeps DDP's environment set-up instead of the CUDA check, its root device is ``cpu``, and it
  skips DeepSpeed's shared-memory communication op (an inference-only all-reduce kernel that
  otherwise costs a 40-75 s C++ compile on the first ``deepspeed.initialize`` of a machine).

Checkpoints never pickle.  DeepSpeed's engine checkpoints are ``torch.save`` files, so
:class:`ZeroStrategy` writes instead (see :mod:`train.zero_checkpoint`): the Lightning checkpoint
with the *consolidated* fp32 head weights (ZeRO-3 partitions gathered) through the trainer's
CheckpointIO, plus one safetensors + JSON file per rank with that rank's ZeRO optimizer partition
(fp32 master weights, Adam moments, step), which resume loads back into the engine.

``train.precision=auto`` is bf16-mixed wherever bf16 is native (GPUs; CPUs with AMX or AMD
avx512_bf16), else 32-true (:mod:`core.precision`, docs/precision.md).
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)

# CPUZeroStrategy overrides private pieces of lightning.pytorch.strategies.DeepSpeedStrategy
# (`setup_environment`'s CUDA check, `setup_distributed`'s device-index validation,
# `_init_deepspeed_distributed`) and the checkpoint hooks of ZeroStrategy rely on how
# Lightning 2.6.6 calls `save_checkpoint` / `load_checkpoint` / `load_model_state_dict`
# (`restore_checkpoint_after_setup`, `lightning_restore_optimizer`).  Those are not public API
# and change between minor releases, so the subclasses are pinned to the version they were
# written and tested against; update and re-run tests/test_distributed*.py before bumping.
PINNED_LIGHTNING = "2.6.6"

STRATEGY_NAMES = ("auto", "ddp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3")
PRECISIONS = ("auto", "32-true", "bf16-mixed", "bf16-true", "16-mixed", "32", "bf16", "16")


def check_lightning_version() -> None:
    """Raise ``RuntimeError`` unless the installed ``lightning`` is :data:`PINNED_LIGHTNING`."""
    import lightning

    if lightning.__version__ != PINNED_LIGHTNING:
        raise RuntimeError(
            f"train.strategies subclasses Lightning's DeepSpeedStrategy internals written for "
            f"lightning=={PINNED_LIGHTNING}, but lightning=={lightning.__version__} is installed; "
            f"install lightning=={PINNED_LIGHTNING} (pyproject.toml pins it) or port "
            "train/strategies.py and re-run tests/test_distributed*.py"
        )


check_lightning_version()

from lightning.fabric.utilities.seed import reset_seed  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Environment resolution: accelerator, processes per node, nodes, precision.
# ---------------------------------------------------------------------------------------------
def resolve_accelerator(value: str) -> str:
    """``auto`` -> ``gpu`` when CUDA is available, else ``cpu``; ``cpu`` / ``gpu`` pass through.

    Raises:
        ValueError: ``gpu`` was asked for but CUDA is not available.
    """
    if value == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    value = "gpu" if value == "cuda" else value
    if value == "gpu" and not torch.cuda.is_available():
        raise ValueError("train.accelerator=gpu but torch.cuda.is_available() is False")
    if value not in ("cpu", "gpu"):
        raise ValueError(f"train.accelerator={value!r}; choices: auto, cpu, gpu")
    return value


def _env_int(*names: str) -> int | None:
    for name in names:
        raw = os.environ.get(name, "")
        # SLURM_TASKS_PER_NODE looks like "2(x3)" or "2,1"; only a plain count is usable here.
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    return None


def in_slurm_job() -> bool:
    """True inside an ``srun`` step Lightning's ``SLURMEnvironment`` will detect."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()


def check_slurm_tasks() -> None:
    """Refuse ``srun`` tasks that Lightning would not run as ranks of one job.

    Lightning's ``SLURMEnvironment`` ignores Slurm when the job is named ``bash`` or ``interactive``
    (``salloc``'s and ``srun --pty bash``'s default names): each of the ``SLURM_NTASKS`` tasks then trains
    its own single-process copy into the same run directory (Lightning's hint about it is among the
    warnings core.quiet silences).

    A plain ``python -m train`` in an interactive allocation (no ``srun``, or ``srun --pty bash``'s one task)
    is Lightning's interactive mode and passes: there Lightning starts ``train.devices`` processes itself.

    Raises:
        core.config.UserInputError: this process is one of several tasks of one ``srun`` step
            (``SLURM_STEP_NUM_TASKS`` > 1) of such a job.
    """
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from core.config import UserInputError

    tasks = _env_int("SLURM_STEP_NUM_TASKS") or 1
    if tasks > 1 and "SLURM_PROCID" in os.environ and "LOCAL_RANK" not in os.environ and not in_slurm_job():
        raise UserInputError(f"{tasks} srun tasks of the Slurm job named {SLURMEnvironment.job_name()!r}: Lightning "
                             "ignores Slurm for jobs named bash or interactive, so each task would train its own copy; "
                             "submit with sbatch (slurm/*.sh), or start the tasks with srun --job-name=<another name>")


def resolve_devices(value: Any, accelerator: str, num_nodes: int) -> int | list[int]:
    """Processes per node (``train.devices``); an int or a list of device ids passes through, but ``-1`` on a
    CPU (Lightning's "every device", which its CPU accelerator refuses) is one process per core.

    ``auto`` -> inside Slurm ``SLURM_NTASKS_PER_NODE`` (else ``SLURM_NTASKS / nodes``); under an
    external launcher that set ``LOCAL_RANK``: ``LOCAL_WORLD_SIZE`` or ``WORLD_SIZE / nodes``; on
    GPUs the visible GPU count; else 1.  Lightning checks that this equals the launched tasks.
    """
    if value != "auto":
        if accelerator == "cpu" and isinstance(value, (int, str)) and int(value) == -1:
            return len(os.sched_getaffinity(0))  # Lightning's "every device"; on a CPU one process per core
        return int(value) if isinstance(value, (int, str)) else [int(v) for v in value]
    if in_slurm_job():
        per_node = _env_int("SLURM_NTASKS_PER_NODE")
        if per_node is None:
            ntasks = _env_int("SLURM_NTASKS") or 1
            per_node = max(1, ntasks // max(1, num_nodes))
        return per_node
    if "LOCAL_RANK" in os.environ:
        local = _env_int("LOCAL_WORLD_SIZE")
        if local is None:
            local = max(1, (_env_int("WORLD_SIZE") or 1) // max(1, num_nodes))
        return local
    if accelerator == "gpu":
        return torch.cuda.device_count()
    return 1


def resolve_precision(value: str, accelerator: str) -> str:
    """``auto`` -> ``bf16-mixed`` where bf16 is native on ``accelerator`` (any bf16 GPU; a CPU with
    AMX or AMD avx512_bf16), else ``32-true``, with one line saying why; other Lightning strings as
    given (:func:`core.precision.resolve_train_precision`; :func:`train.run.train` resolves before
    the Trainer is built, so its ``config.yaml`` records what ran)."""
    from core.precision import resolve_train_precision

    return resolve_train_precision(value, accelerator)


def legacy_auto_precision(accelerator: str) -> str:
    """What ``train.precision=auto`` meant before it looked at the CPU's bf16 support: ``bf16-mixed``
    on GPUs, ``32-true`` on CPUs (a resumed run recorded with ``auto`` keeps it)."""
    return "bf16-mixed" if accelerator == "gpu" else "32-true"


# ---------------------------------------------------------------------------------------------
# DeepSpeed strategies.
# ---------------------------------------------------------------------------------------------
def deepspeed_config(scfg: Any) -> dict[str, Any]:
    """The DeepSpeed config dict for the ``strategy`` section (ZeRO stage, offload, buckets).

    Lightning fills ``gradient_accumulation_steps``, ``gradient_clipping``,
    ``train_micro_batch_size_per_gpu`` and the bf16/fp16 block from the Trainer.
    """
    stage = int(scfg.zero_stage)
    zero: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": True,
        "overlap_comm": bool(scfg.overlap_comm),
        "allgather_bucket_size": int(scfg.bucket_size),
        "reduce_bucket_size": int(scfg.bucket_size),
    }
    if stage == 3:
        # Parameters below the persistence threshold stay whole on every rank (default 0: every
        # parameter is partitioned and gathered on use).
        zero.update({"stage3_param_persistence_threshold": int(scfg.get("param_persistence_threshold", 0)),
                     "stage3_max_live_parameters": int(1e9),
                     "stage3_prefetch_bucket_size": int(scfg.bucket_size),
                     "stage3_gather_16bit_weights_on_model_save": False})
    if scfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "zero_optimization": zero,
        # The optimizer comes from the LightningModule (torch.optim.AdamW); DeepSpeed only wraps it.
        "zero_allow_untested_optimizer": True,
        # Offload works with any torch optimizer (DeepSpeedCPUAdam is faster but compiles a C++ op).
        "zero_force_ds_cpu_optimizer": False,
        # Only DeepSpeed's throughput bookkeeping reads it (batches come from Lightning; their
        # size varies under a token budget); set so Lightning does not probe the DataLoader.
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class ZeroStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy (GPU) plus gradient clipping by value and pickle-free checkpoints.

    Args:
        clip_grad_value: clamp every gradient element to ``[-v, v]`` before the optimizer step
            (METHODS.md §6: CTC / Falcon clip by value 0.5), or None.  Lightning refuses value
            clipping under DeepSpeed; since clamping is element-wise it commutes with ZeRO's
            partitioning, so it is applied as a step pre-hook of the wrapped torch optimizer, whose
            parameters are this rank's fp32 master partitions holding the averaged, unscaled
            gradients (``unscale_and_clip_grads`` runs just before).  Identical to DDP's clamp
            of the all-reduced gradients.  Norm clipping stays DeepSpeed's own
            (``gradient_clipping`` in the config, filled from ``Trainer(gradient_clip_val=...)``).
        **kwargs: :class:`lightning.pytorch.strategies.DeepSpeedStrategy` arguments.
    """

    strategy_name = "draftheads_deepspeed"

    def __init__(self, *args, clip_grad_value: float | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clip_grad_value = float(clip_grad_value) if clip_grad_value else None
        self._clip_hook = None

    @property
    def zero_stage(self) -> int:
        """The configured ZeRO stage (1, 2 or 3)."""
        return int(self.config["zero_optimization"]["stage"])

    def init_deepspeed(self) -> None:
        super().init_deepspeed()
        optimizer = getattr(self.deepspeed_engine, "optimizer", None)
        zero_partition_padding(optimizer)
        inner = getattr(optimizer, "optimizer", None)
        if inner is not None and getattr(self, "_finite_hook", None) is None:
            # before the clamp: clipping by value would hide an inf (train.finite)
            def check_partition_grads(opt, args, kwargs) -> None:
                check = getattr(self.lightning_module, "check_partition_gradients", None)
                if check is not None:
                    check([p.grad for group in opt.param_groups for p in group["params"]])

            self._finite_hook = inner.register_step_pre_hook(check_partition_grads)
        if self.clip_grad_value and inner is not None and self._clip_hook is None:
            value = self.clip_grad_value

            def clamp_partition_grads(opt, args, kwargs) -> None:
                for group in opt.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.clamp_(-value, value)

            self._clip_hook = inner.register_step_pre_hook(clamp_partition_grads)

    def skipped_non_finite_step(self) -> bool:
        """True when the engine's last optimizer step was skipped for a non-finite gradient
        (DeepSpeed all-reduces the gradient norm, so every rank agrees; :mod:`train.finite`)."""
        optimizer = getattr(getattr(self, "deepspeed_engine", None), "optimizer", None)
        return bool(getattr(optimizer, "overflow", False))

    # -- checkpoints: see train.zero_checkpoint ------------------------------------------------
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any | None = None) -> None:
        from train import zero_checkpoint

        zero_checkpoint.save(self, checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        from train import zero_checkpoint

        return zero_checkpoint.load(self, checkpoint_path)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        from train import zero_checkpoint

        zero_checkpoint.load_weights(self, checkpoint, strict=strict)

    def remove_checkpoint(self, filepath) -> None:
        from train import zero_checkpoint

        zero_checkpoint.remove(self, filepath)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        from train import zero_checkpoint

        return zero_checkpoint.full_fp32_state_dict(self)


def zero_partition_padding(optimizer) -> int:
    """Zero the alignment padding of ZeRO-3's flat partitions; return the padded element count.

    ZeRO-3 pads every parameter's partition on the last rank to a multiple of the world size
    (``optimizer.groups_padding``) in buffers allocated uninitialised, so the fp32 master flat
    groups - and every checkpoint of them - held arbitrary bytes there (e.g. -1.7e38 in one run,
    0 in its resumed twin): two identical trainings gave different checkpoints.  The padding maps
    to no parameter and gets zero gradients, so zero stays zero under AdamW; nothing trained
    changes.  No-op for stages 1/2 (no ``groups_padding`` of this form) and ``None``.
    """
    pads = getattr(optimizer, "groups_padding", None)
    groups = getattr(optimizer, "fp16_partitioned_groups", None)
    if not pads or groups is None or not hasattr(optimizer, "fp32_partitioned_groups_flat"):
        return 0
    zeroed = 0
    with torch.no_grad():
        for i, (tensors, padding) in enumerate(zip(groups, pads)):
            module_flats = getattr(optimizer, "fp16_partitioned_groups_flat", None) or []
            flats = [optimizer.fp32_partitioned_groups_flat[i], module_flats[i] if i < len(module_flats) else None]
            for flat in flats:
                if flat is None or flat.numel() == 0:
                    continue
                offset = 0
                for t, pad in zip(tensors, padding):
                    if pad:
                        flat[offset + t.numel() - pad: offset + t.numel()].zero_()
                        zeroed += pad
                    offset += t.numel()
    return zeroed


class CPUZeroStrategy(ZeroStrategy):
    """DeepSpeed ZeRO on CPU processes over gloo (Lightning's strategy accepts CUDA only).

    Differences from :class:`lightning.pytorch.strategies.DeepSpeedStrategy`, and nothing else:

    * ``setup_environment`` runs DDP's set-up (accelerator device, process group) instead of
      raising for a non-CUDA accelerator;
    * ``setup_distributed`` skips the check that device indices equal local ranks (CPU devices
      have no index; the root device is ``cpu``);
    * DeepSpeed's shared-memory all-reduce op (``deepspeed_shm_comm``, built by
      ``ShareMemCommBuilder``) is marked unavailable before ``deepspeed.init_distributed``: only
      DeepSpeed-Inference's ``inference_all_reduce`` uses it, ZeRO training does not, and building
      it costs a 40-75 s C++ compile on a fresh machine.  ``inference_all_reduce`` falls back to
      ``torch.distributed.all_reduce`` without it.
    """

    strategy_name = "draftheads_deepspeed_cpu"

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _init_deepspeed_distributed(self) -> None:
        skip_shm_comm_op()
        super()._init_deepspeed_distributed()

    # Lightning passes ``device_rank=self.root_device.index`` to ``deepspeed.initialize``; a CPU
    # device has no index (None), which DeepSpeed's engine compares with 0.  The CPU accelerator's
    # ``set_device`` is a no-op and its device name is ``cpu`` whatever the rank, so the local rank
    # is passed instead.  Bodies otherwise as in Lightning 2.6.6.
    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        import deepspeed

        model_parameters = filter(lambda p: p.requires_grad, model.parameters())
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
            model_parameters=model_parameters, optimizer=optimizer, lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def _initialize_deepspeed_inference(self, model) -> None:
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                inference_config[key] = self.config[key]
        if self.zero_stage_3:
            inference_config.update({"zero_allow_untested_optimizer": self.config["zero_allow_untested_optimizer"],
                                     "zero_optimization": self.config["zero_optimization"]})
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank), config=inference_config, model=model,
            optimizer=None, lr_scheduler=None, model_parameters=[], dist_init_required=False,
        )


def skip_shm_comm_op() -> None:
    """Mark DeepSpeed's CPU shared-memory comm op incompatible so ``init_distributed`` skips its build."""
    import deepspeed.ops

    ops = deepspeed.ops.__compatible_ops__
    ops["deepspeed_shm_comm"] = False


# ---------------------------------------------------------------------------------------------
def _grad_clip(cfg: Any) -> tuple[float | None, str]:
    clip = cfg.train.get("grad_clip") if "train" in cfg else None
    if clip is None or not clip.get("value"):
        return None, "norm"
    return float(clip.value), str(clip.get("algorithm", "norm"))


def build_strategy(cfg: Any):
    """The Lightning strategy for ``cfg.strategy``: ``"auto"``, a ``DDPStrategy``, or a ZeRO strategy.

    ``deepspeed_zero{1,2,3}`` give :class:`ZeroStrategy` on GPUs and :class:`CPUZeroStrategy` on
    CPUs (``cfg.train.accelerator``); ``ddp`` gives ``DDPStrategy`` (gloo on CPUs, nccl on GPUs).
    Under ZeRO, ``train.grad_clip.algorithm=value`` is applied by the strategy (see
    :class:`ZeroStrategy`); :func:`trainer_kwargs` then gives the Trainer no clip value.

    Raises:
        ValueError: unknown ``strategy.name``, or a ZeRO option without ``zero_stage``.
    """
    from datetime import timedelta

    scfg = cfg.strategy
    name = str(scfg.name)
    accelerator = resolve_accelerator(str(cfg.train.accelerator))
    backend = None if scfg.process_group_backend in (None, "auto") else str(scfg.process_group_backend)
    timeout = timedelta(minutes=float(scfg.timeout_minutes))
    if name == "auto":
        return "auto"
    if name == "ddp":
        return DDPStrategy(process_group_backend=backend, timeout=timeout,
                           find_unused_parameters=bool(scfg.find_unused_parameters))
    if name.startswith("deepspeed"):
        if scfg.zero_stage not in (1, 2, 3):
            raise ValueError(f"strategy.name={name} needs strategy.zero_stage in 1, 2, 3; got {scfg.zero_stage!r}")
        clip_value, clip_algorithm = _grad_clip(cfg)
        cls = CPUZeroStrategy if accelerator == "cpu" else ZeroStrategy
        return cls(config=deepspeed_config(scfg), process_group_backend=backend, timeout=timeout,
                   logging_level=logging.WARNING,
                   clip_grad_value=clip_value if clip_algorithm == "value" else None)
    raise ValueError(f"strategy.name={name!r}; choices: {', '.join(STRATEGY_NAMES)}")


def cpu_oversubscription(devices: int | list[int], cores: int | None = None) -> str | None:
    """The note owed when ``train.devices`` CPU processes outnumber the cores this process may run
    on (``os.sched_getaffinity``), else None.  Lightning's launchers give each process
    ``max(1, cores // processes)`` intra-op threads, so past ``cores`` processes they only take
    turns on the same cores; ``-1`` (one process per core) never oversubscribes."""
    n = len(devices) if isinstance(devices, (list, tuple)) else int(devices)
    cores = int(cores or len(os.sched_getaffinity(0)))
    if n <= cores:
        return None
    return (f"train.devices={n} starts {n} CPU training processes on {cores} cores: they take turns on the "
            f"cores (1 intra-op thread each); train.devices={cores} uses each core once")


def trainer_kwargs(cfg: Any) -> dict[str, Any]:
    """``lightning.pytorch.Trainer`` keyword arguments for the distributed set-up.

    Returns ``strategy`` (:func:`build_strategy`), ``accelerator``, ``devices`` (processes per
    node, :func:`resolve_devices`), ``num_nodes``, ``precision`` (:func:`resolve_precision`),
    ``gradient_clip_val`` and ``gradient_clip_algorithm`` (None under ZeRO with value clipping,
    which the strategy applies itself), all from ``cfg.train`` and ``cfg.strategy``.
    """
    accelerator = resolve_accelerator(str(cfg.train.accelerator))
    num_nodes = int(cfg.train.num_nodes)
    strategy = build_strategy(cfg)
    clip_value, clip_algorithm = _grad_clip(cfg)
    if isinstance(strategy, ZeroStrategy) and clip_algorithm == "value":
        clip_value, clip_algorithm = None, None
    check_slurm_tasks()
    devices = resolve_devices(cfg.train.devices, accelerator, num_nodes)
    if accelerator == "cpu" and (line := cpu_oversubscription(devices)):
        from lightning.pytorch.utilities import rank_zero_only

        from core.precision import note

        if rank_zero_only.rank == 0:
            note(line)
    return {
        "strategy": strategy,
        "accelerator": accelerator,
        "devices": devices,
        "num_nodes": num_nodes,
        "precision": resolve_precision(str(cfg.train.precision), accelerator),
        "gradient_clip_val": clip_value,
        "gradient_clip_algorithm": clip_algorithm,
    }


def shutdown_distributed() -> bool:
    """End this process's part of a multi-process run: barrier, then destroy the process group.

    Call once per process when it has no collective left (every rank finished ``train`` or
    agreed on a pre-emption stop), never after an exception on one rank (the barrier would wait
    for ranks that are gone).  Without it the default gloo group lives until interpreter exit:
    its worker threads can still hold the last reference to an asynchronous collective's work
    (ZeRO-3 gathers parameters with ``async_op=True``), freeing it then needs the GIL of an
    interpreter that is being torn down, and the process aborts with "terminate called without
    an active exception" (exit -6) after a run that finished (pytorch/pytorch#190489, #179291).
    ``destroy_process_group`` joins those threads while the interpreter is whole; the barrier
    first lets every peer finish its last collective before any connection closes.  Before both, a
    garbage collection frees what only reference cycles still hold (a finished run's trainer and
    DeepSpeed engine, with their ZeRO-3 gather handles) while the group and the interpreter are whole:
    left to interpreter exit, such handles can abort a rank the same way after ``destroy_process_group``
    (seen once more in CI, rank 1 of the ZeRO-3 draft-vocabulary launch, after the run had finished).

    Returns True if a process group was destroyed (False: none was initialized).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return True


def zero_stage(cfg: Any) -> int:
    """ZeRO stage of ``cfg.strategy`` (0 for ``auto`` / ``ddp``); logged with every run."""
    stage = cfg.strategy.get("zero_stage")
    return int(stage) if stage else 0


def consolidated_head(trainer, module):
    """The head to export after training: ``module.head``, or under ZeRO a plain fp32 copy.

    Under DeepSpeed ZeRO the trained weights are the fp32 master partitions (ZeRO-3 also
    partitions the module's own parameters), so every rank gathers them
    (:func:`train.zero_checkpoint.full_fp32_state_dict`, a collective call) and a fresh,
    unpartitioned head of the same class is loaded with them; ``heads.save`` then writes the same
    ``model.safetensors`` + ``config.json`` as a single-process run.  The borrowed frozen base
    weights are not attached (``heads.save`` never writes them).
    """
    strategy = trainer.strategy
    if not isinstance(strategy, ZeroStrategy):
        return module.head
    from train import zero_checkpoint

    full = zero_checkpoint.full_fp32_state_dict(strategy)
    prefix = "head."
    head_state = {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
    src = module.head
    head = type(src)(src.cfg, src.base_config).float()
    head.load_state_dict(head_state, strict=True)
    return head


from lightning.pytorch.callbacks import Callback  # noqa: E402


class DistributedInfo(Callback):
    """Logs the distributed set-up once per fit: strategy, ZeRO stage, world size, nodes, precision.

    Sent to every logger as hyperparameters and as metrics (``distributed/*``) at the step each launch starts from, so W&B runs
    of a sweep can be grouped and compared by them.  Tokens/s per device is logged by the module
    (``train/tokens_per_s``, not reduced across ranks).
    """

    def on_train_start(self, trainer, pl_module) -> None:  # after a resume restored the loops
        strategy = trainer.strategy
        info = {
            "distributed/strategy": type(strategy).__name__,
            "distributed/zero_stage": int(getattr(strategy, "zero_stage", 0)),
            "distributed/world_size": int(trainer.world_size),
            "distributed/num_nodes": int(trainer.num_nodes),
            "distributed/devices_per_node": int(trainer.num_devices),
            "distributed/precision": str(trainer.precision),
        }
        numeric = {k: v for k, v in info.items() if isinstance(v, int)}
        for logger in trainer.loggers:
            logger.log_hyperparams(info)
            logger.log_metrics(numeric, step=int(trainer.global_step))  # the launch's first step
