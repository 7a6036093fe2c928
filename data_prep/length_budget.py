"""``python -m data_prep.length_budget [key=value ...]``: what each ``data.max_length`` would cut, before a
cache is built.

Reads the configured conversations (``data.*``, as data prep reads them), templates each one whole with the
base's tokenizer alone (no model weights load) and, for 512, 1024, 2048 and 4096 tokens and the configured
``data.max_length``, counts with data prep's own rule (:func:`data_prep.pipeline.max_length_cuts`) the
conversations longer than it and the assistant replies not whole within it (cut inside, or ending past
it with their end-of-turn token; a conversation whose first reply starts past it, which data prep drops and
counts as ``no_assistant_tokens``, counts here as cut with all its replies), with the templated tokens it
would keep.  Issue 27 asks for a
``data.max_length`` that keeps most replies whole and for the share that are cut; a cache's own
``summary.json`` gives the same counts for the length it was built at.

Example (the first 2,000 packaged ShareGPT conversations; about 30 s on 2 cores)::

    python -m data_prep.length_budget data.max_conversations=2000
"""
from __future__ import annotations

import logging
import sys
from collections import Counter
from typing import Any, Sequence

from core.config import run_cli

DEFAULT_LENGTHS = (512, 1024, 2048, 4096)


def length_budget(records, lengths: Sequence[int]) -> list[dict[str, Any]]:
    """Per length L: ``{"max_length", "conversations", "cut_conversations", "turns", "cut_turns", "tokens_kept"}``
    over ``records`` (:class:`data_prep.front.TemplatedConversation` templated without a length limit).

    Raises:
        ValueError: a length < 1.
    """
    from data_prep.pipeline import max_length_cuts

    rows = []
    for L in lengths:
        if int(L) < 1:
            raise ValueError(f"max_length {L}: must be >= 1")
        c: Counter = Counter()
        kept = 0
        for r in records:
            c.update(max_length_cuts(r, int(L)))
            kept += kept_tokens(r, int(L))
        rows.append({"max_length": int(L), "conversations": c["tf_conversations"],
                     "cut_conversations": c["tf_cut_conversations"], "turns": c["tf_turns"],
                     "cut_turns": c["tf_cut_turns"], "tokens_kept": kept})
    return rows


def kept_tokens(record, max_length: int) -> int:
    """The tokens of ``record`` (templated whole) a cache at ``max_length`` stores: its turns up to the first
    whose generation prompt reaches the limit (data prep stops there, :func:`data_prep.template.segment_records`),
    cut at ``max_length``."""
    pos = kept = 0
    for seg in record.segments:
        if pos + seg.header >= max_length:
            break
        pos += len(seg.ids)
        kept = min(max_length, pos)
        if pos >= max_length:
            break
    return kept


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of :func:`length_budget`'s rows."""
    lines = ["| data.max_length | conversations cut | replies not whole | templated tokens kept |",
             "|---:|---:|---:|---:|"]
    for r in rows:
        conv = f"{r['cut_conversations']:,} / {r['conversations']:,} ({100 * r['cut_conversations'] / max(1, r['conversations']):.1f} %)"
        turn = f"{r['cut_turns']:,} / {r['turns']:,} ({100 * r['cut_turns'] / max(1, r['turns']):.1f} %)"
        lines.append(f"| {r['max_length']:,} | {conv} | {turn} | {r['tokens_kept']:,} |")
    return "\n".join(lines)


def measure(cfg, out=sys.stdout) -> list[dict[str, Any]]:
    """Read, template and count (module docstring); prints the table to ``out``.

    Raises:
        core.config.UserInputError: as data prep for the data (no usable conversation, a bad split key).
    """
    from core.base_model import load_tokenizer
    from data_prep.front import read_split, template_split
    from data_prep.pipeline import eos_ids_before_model

    lengths = sorted(set(DEFAULT_LENGTHS) | {int(cfg.data.max_length)})
    tokenizer = load_tokenizer(cfg.model)
    data = read_split(cfg.data)
    templated = template_split(tokenizer, data, eos_ids_before_model(cfg.model, tokenizer), sys.maxsize)
    rows = length_budget([c for split in ("train", "val") for c in templated[split]], lengths)
    if out is not None:
        print(format_rows(rows), file=out)
    return rows


def main(argv=None):
    logging.basicConfig(level=logging.WARNING)
    return run_cli(measure, argv, __doc__)


if __name__ == "__main__":
    main()
