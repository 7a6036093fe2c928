"""Exit statuses shared by the evaluation entry points (``python -m evaluation``, ``evaluation.merge``).

0 on success, 1 when a prompt's output differs from vanilla greedy decoding (:class:`ParityError`),
2 on a configuration or input error or any ``OSError`` (one ``error:`` line naming the file, no
traceback).
"""
from __future__ import annotations

import sys
from typing import Any, Callable


def run_and_report(run: Callable[[], dict[str, Any] | None]) -> int:
    """Call ``run`` and print the summary of every variant of the report it returns.

    Args:
        run: runs the evaluation and returns :func:`evaluation.runner.run_evaluation`'s report, or
            ``None`` when there is nothing to summarise (then nothing is printed).
    Returns:
        The exit status: 0, 1 (parity failure, printed as ``PARITY FAILURE: ...``), 2 (``error: ...``) or
        130 (Ctrl-C, with no traceback).
    """
    from core.config import describe_os_error
    from evaluation.prompts import PromptError
    from evaluation.report import format_summary
    from evaluation.runner import ParityError

    try:
        result = run()
    except ParityError as exc:
        print(f"PARITY FAILURE: {exc}", file=sys.stderr)
        return 1
    except (PromptError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {describe_os_error(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the runner has logged what is kept and how to resume, when decoding had begun
        print("\nevaluation interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    if result is not None:
        for name, rep in (result["variants"].items() if "variants" in result else [(None, result)]):
            if name:
                print(f"== {name}")
            print(format_summary(rep))
    return 0
