"""Where a training run lives: ``<output_root>/runs/<heads option>/<run name>/``.

Used by :mod:`train.run` (a fresh run's directory) and :mod:`train.resume` (``resume=auto``
looks for the newest ``checkpoints/last.ckpt`` among the runs of the same heads option).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Iterator

from omegaconf import DictConfig, OmegaConf


RUN_NAME_ENV = "DRAFTHEADS_RUN_NAME"


def run_dir_for(cfg: DictConfig) -> Path:
    """``<output_root>/runs/<head variant>/<name>`` (:func:`runs_root`).

    ``name`` is ``train.run_name``; else, in a process launched by another draftheads process
    (Lightning's DDP / DeepSpeed launcher re-runs this script for ranks > 0), the parent's name
    from ``$DRAFTHEADS_RUN_NAME``; else ``slurm-<SLURM_JOB_ID>`` inside a Slurm job; else the UTC
    time ``YYYYmmdd-HHMMSS``.  So all ranks of a run share one directory.
    """
    name = (cfg.train.run_name or _parent_name()
            or (f"slurm-{os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID") else None)
            or time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    os.environ[RUN_NAME_ENV] = f"{name}:{os.getpid()}"
    return runs_root(cfg) / str(name)


def _parent_name() -> str | None:
    """The run name a parent draftheads process passed down in ``$DRAFTHEADS_RUN_NAME`` (``<name>:<its pid>``),
    or None when this process's parent set none."""
    value, _, setter = os.environ.get(RUN_NAME_ENV, "").rpartition(":")
    return value if value and setter == str(os.getppid()) else None


def named_by_time(cfg: DictConfig) -> bool:
    """True when :func:`run_dir_for` names the run by the clock (no run name given, inherited or from Slurm):
    two such runs started in the same second would otherwise share one directory."""
    return not (cfg.train.run_name or _parent_name() or os.environ.get("SLURM_JOB_ID"))


def run_files(run_dir: Path) -> list[Path]:
    """The checkpoints and exported heads ``run_dir`` holds (what a fresh run must not overwrite), sorted."""
    return sorted(p for p in [*run_dir.glob("checkpoints/*.ckpt"), run_dir / "best" / "model.safetensors",
                              run_dir / "last" / "model.safetensors"] if p.is_file())


@contextlib.contextmanager
def claimed_run_dir(run_dir: Path, by_time: bool = False, rank: int = 0) -> Iterator[Path]:
    """Hold ``run_dir`` for this training process: an exclusive ``flock`` on ``<runs root>/.<name>.lock``
    (with its pid inside), taken by global rank 0 only and released when the block ends or the process dies.

    Two launches in one directory - a run started twice, a resume beside the still-running run, two
    clock-named runs started in the same second - would interleave their checkpoints, ``config.yaml`` and
    ``best/``.  A clock-named run (``by_time``) whose directory is taken or already holds a run moves on to
    ``<name>-2``, ``<name>-3``, ... (``$DRAFTHEADS_RUN_NAME`` follows, so Lightning's other ranks agree); any
    other run is refused.  Ranks > 0 share rank 0's claim and yield ``run_dir`` unchanged.  The lock file is
    removed (while still locked) at the end, and so are the folders the claim created if the run left them
    empty: a refused launch leaves nothing behind.

    Raises:
        core.config.UserInputError: another live process holds the directory (its pid named).
    """
    from core.config import UserInputError

    if rank != 0:
        yield run_dir
        return
    made, d = [], run_dir.parent
    while not d.exists():  # the folders this claim creates, deepest first
        made.append(d)
        d = d.parent
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    base, n = run_dir, 1
    while True:
        lock = run_dir.parent / f".{run_dir.name}.lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if not by_time:
                raise UserInputError(f"run directory {run_dir} is in use by another training process (pid {owner}): "
                                     "wait for it to end, or choose another train.run_name") from None
        else:
            try:
                current = os.stat(lock).st_ino
            except FileNotFoundError:
                current = None
            if current != os.fstat(fd).st_ino:  # its holder removed the file as we opened it: take the new one
                os.close(fd)
                continue
            if not (by_time and run_files(run_dir)):
                break
            os.unlink(lock)
            os.close(fd)
        n += 1
        run_dir = base.with_name(f"{base.name}-{n}")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        if run_dir != base:
            os.environ[RUN_NAME_ENV] = f"{run_dir.name}:{os.getpid()}"
        yield run_dir
    finally:
        os.unlink(lock)  # still locked: a process that opened the old file sees it gone and retries
        os.close(fd)
        for d in made:  # the runs folders this claim created, if nothing else landed in them
            with contextlib.suppress(OSError):
                d.rmdir()


def runs_root(cfg: DictConfig) -> Path:
    """``<output_root>/runs/<head variant>``: the namespace of run names.

    The head variant is the selected ``heads=`` option (``cfg.choices.heads``: ``falcon``,
    ``falcon_noglance``, ``falcon_k1``, ...), so variants of one head type never share a run
    directory.  A config without ``choices``, or whose ``heads`` section was replaced by one of
    another type than the option's YAML (built by hand, e.g. in tests), uses ``heads.type``.
    """
    from core.config import CONFIG_DIR

    choices = cfg.get("choices") if isinstance(cfg, DictConfig) else None
    option = choices.get("heads") if choices is not None else None
    variant = str(cfg.heads.type)
    if option:
        yaml_path = CONFIG_DIR / "heads" / f"{option}.yaml"
        if yaml_path.is_file() and str(OmegaConf.load(yaml_path).get("type")) == variant:
            variant = str(option)
    return Path(cfg.output_root) / "runs" / variant
