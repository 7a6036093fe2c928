"""Where a training run lives: ``<output_root>/runs/<heads option>/<run name>/``.

Used by :mod:`train.run` (a fresh run's directory) and :mod:`train.resume` (``resume=auto``
looks for the newest ``checkpoints/last.ckpt`` among the runs of the same heads option).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


RUN_NAME_ENV = "DRAFTHEADS_RUN_NAME"


def run_dir_for(cfg: DictConfig) -> Path:
    """``<output_root>/runs/<head variant>/<name>`` (:func:`runs_root`).

    ``name`` is ``train.run_name``; else, in a process launched by another draftheads process
    (Lightning's DDP / DeepSpeed launcher re-runs this script for ranks > 0), the parent's name
    from ``$DRAFTHEADS_RUN_NAME``; else ``slurm-<SLURM_JOB_ID>`` inside a Slurm job; else the UTC
    time ``YYYYmmdd-HHMMSS``.  So all ranks of a run share one directory.
    """
    inherited = os.environ.get(RUN_NAME_ENV, "")
    parent_name = None
    if ":" in inherited:
        value, setter = inherited.rsplit(":", 1)
        parent_name = value if setter == str(os.getppid()) else None
    name = (cfg.train.run_name or parent_name
            or (f"slurm-{os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID") else None)
            or time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    os.environ[RUN_NAME_ENV] = f"{name}:{os.getpid()}"
    return runs_root(cfg) / str(name)


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
