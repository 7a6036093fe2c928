"""Lossless speculative-decoding evaluation: ``python -m evaluation heads=<h> checkpoint=PATH``.

:func:`evaluation.runner.run_evaluation` runs vanilla greedy decoding and the head's decoder on
the same prompts, checks output parity token for token, and writes ``report.json`` (τ with the
bonus token included, acceptance per depth, base forwards per token, drafter passes per step,
tokens/s and speedup) and ``acceptance.png`` next to the resolved ``config.yaml``.
"""
