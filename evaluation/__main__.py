"""CLI: ``python -m evaluation heads=<h> checkpoint=PATH [eval.prompts=FILE.jsonl] [eval.max_new_tokens=128]``.

``checkpoint=X`` is shorthand for ``eval.checkpoint=X`` (``oracle`` / ``random`` select the
reference drafters).  Exit status: 0 on success, 1 when any prompt's output differs from vanilla
greedy decoding (the ids are printed), 2 on a configuration or input error.
"""
from __future__ import annotations

import logging
import sys
from typing import Sequence


def rewrite_argv(argv: Sequence[str]) -> list[str]:
    """Map the ``checkpoint=`` shorthand to ``eval.checkpoint=``."""
    return [("eval." + a) if a.startswith("checkpoint=") else a for a in argv]


def main(argv: Sequence[str] | None = None) -> int:
    from core.config import cli
    from evaluation.prompts import PromptError
    from evaluation.runner import ParityError, format_summary, run_evaluation

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = cli(rewrite_argv(sys.argv[1:] if argv is None else argv))
    try:
        report = run_evaluation(cfg)
    except ParityError as exc:
        print(f"PARITY FAILURE: {exc}", file=sys.stderr)
        return 1
    except (PromptError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, rep in (report["variants"].items() if "variants" in report else [(None, report)]):
        if name:
            print(f"== {name}")
        print(format_summary(rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
