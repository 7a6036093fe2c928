"""CLI: ``python -m evaluation heads=<h> checkpoint=PATH [eval.prompts=FILE.jsonl] [eval.max_new_tokens=128]``.

``checkpoint=X`` is shorthand for ``eval.checkpoint=X`` (``oracle`` / ``random`` select the
reference drafters).  Exit status: 0 on success, 1 when any prompt's output differs from vanilla
greedy decoding (the ids are printed), 2 on a configuration or input error.

Examples::

    python -m evaluation heads=ctc checkpoint=outputs/runs/ctc/r1/best eval.prompts=/path/to/mt_bench_questions.jsonl
    python -m evaluation heads=falcon 'eval.variants=[{name: k2, checkpoint: A/best}, {name: k1, checkpoint: B/best}]'
    python -m evaluation heads=adadecode checkpoint=R/best 'eval.variants=[{gamma: 0.6}, {gamma: 0.85}]'
    python -m evaluation heads=ctc checkpoint=R/best eval.output_dir=outputs/eval/e1 resume=auto   # continue
    python -m evaluation checkpoint=oracle eval.num_prompts=4     # reference drafter: the runtime's ceiling
"""
from __future__ import annotations

import logging
import sys
from typing import Sequence


def rewrite_argv(argv: Sequence[str]) -> list[str]:
    """Map the ``checkpoint=`` shorthand to ``eval.checkpoint=``."""
    return [("eval." + a) if a.startswith("checkpoint=") else a for a in argv]


def check_head_overrides(argv: Sequence[str]) -> None:
    """Refuse ``heads.*`` overrides on an evaluation's command line.

    Raises:
        core.config.ConfigError: the evaluated head's settings are its checkpoint's (``config.json``), so a
            ``heads.*`` override would be ignored while the run's ``config.yaml`` recorded it.
    """
    from core.config import ConfigError

    for a in argv:
        if a.startswith("heads.") and "=" in a:
            raise ConfigError(f"{a}: an evaluation reads the head's settings from its checkpoint (config.json), so "
                              "heads.* would be ignored; set the decoding keys with eval.* (eval.falcon_passes, "
                              "eval.falcon_tree, eval.topk, eval.max_nodes, eval.gamma, or eval.decoding={...})")


def main(argv: Sequence[str] | None = None) -> int:
    from core.config import ConfigError, cli
    from evaluation.cli import run_and_report
    from evaluation.runner import run_evaluation

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args = rewrite_argv(sys.argv[1:] if argv is None else argv)
        check_head_overrides(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = cli(args, __doc__)
    return run_and_report(lambda: run_evaluation(cfg))


if __name__ == "__main__":
    raise SystemExit(main())
