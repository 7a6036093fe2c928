"""``python -m data_prep key=value ...``: prepare (or resume) the hidden-state / label cache.

Examples::

    python -m data_prep                                   # packaged SmolLM2 + ShareGPT, defaults
    python -m data_prep labels=teacher_forced data.max_conversations=1000 prep.layers=[8,15,22]
    torchrun --nproc-per-node 4 -m data_prep data.max_conversations=null   # 4 disjoint shard sets
"""
from __future__ import annotations

import logging

from core.config import run_cli
from data_prep.pipeline import prepare


def main(argv=None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_cli(prepare, argv, __doc__, interrupted="data prep interrupted (Ctrl-C): every shard written is kept; "
                                                      "run the same command again to resume from there")


if __name__ == "__main__":
    main()
