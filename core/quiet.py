"""The one place that silences third-party output known to be irrelevant to draftheads users.

:func:`silence_known_noise` is called by every entry point (``core.config.cli``, which
``python -m data_prep|train|evaluation`` use, and ``python -m evaluation.merge``) before the
libraries that print it are imported or run.  Each entry of :data:`IGNORED_WARNINGS` and
:data:`DROPPED_LOG_PREFIXES` names why it does not concern our users; everything else (our own
warnings, real library warnings) still prints.  ``DRAFTHEADS_VERBOSE=1`` turns all of this off.
"""
from __future__ import annotations

import logging
import os
import warnings

# (message regex, category, why it is irrelevant here)
IGNORED_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    (r"The `srun` command is available on your system but is not used", Warning,
     "Lightning's Slurm hint, printed once per Trainer; draftheads runs under Slurm through its sbatch "
     "scripts (srun inside), and outside them a plain run on a login node is intended"),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", Warning,
     "lightning 2.6.6's own use of a torch pytree API deprecated in newer torch; nothing for a user to change"),
    (r"It is recommended to use `self\.log\(.*sync_dist=True\)", Warning,
     "train.module all-reduces every validation metric by hand (sums of counts over ranks) before logging, "
     "so Lightning's sync_dist advice is a false alarm"),
    (r"Checkpoint directory .* exists and is not empty", Warning,
     "Lightning's note when resume=auto continues a run in its own checkpoints/ folder, as intended; a new run "
     "over an existing one is refused by draftheads before Lightning starts (train.run)"),
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning,
     "DeepSpeed ZeRO's own collectives on torch 2.13 (eight per ZeRO-3 step on two ranks); nothing for a user to change"),
)

# Lightning INFO lines dropped: advertisements and echoes of settings draftheads chose itself.
DROPPED_LOG_PREFIXES: tuple[str, ...] = (
    "💡 Tip:",  # logger / checkpoint-upload advertisements (litlogger, litmodels)
    "`Trainer(limit_val_batches=1.0)` was configured",  # train.limit_val_batches=null means the whole split
)
LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                     "lightning.pytorch", "lightning.fabric")


class _DropPrefixes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        return not message.startswith(DROPPED_LOG_PREFIXES)


_FILTER = _DropPrefixes()


def silence_known_noise() -> None:
    """Install the warning filters and log filters above (idempotent).

    Also sets ``DS_ACCELERATOR=cpu`` when torch has no CUDA device and the variable is unset, so
    DeepSpeed does not print "Setting accelerator to CPU ... unable to detect it" on import.
    """
    if os.environ.get("DRAFTHEADS_VERBOSE"):
        return
    for pattern, category, _why in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"
