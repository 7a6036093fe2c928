"""Chat templates rendered the same on every day.

Some chat templates read the clock: Llama-3.x writes ``Today Date: <strftime_now("%d %b %Y")>`` into
its system header unless ``date_string`` is passed, Mistral-Small-3 and Granite call
``strftime_now`` directly (transformers provides it to every template, reading ``datetime.now()``).
A cache built across midnight, resumed on another day or split over ranks started at different
times would then hold two renderings under one config hash, an online run's records would change
identity the next day (and its resume be refused), and an evaluation's prompts would stop matching
its ``progress.jsonl``.  Every rendering here therefore runs with the template clock fixed at
:data:`TEMPLATE_DATE`, Llama 3.1's own default ``date_string`` (26 Jul 2024).  Templates that do not
read the clock render exactly as before.

Source: transformers' ``chat_template_utils._compile_jinja_template`` (the ``strftime_now`` global);
the fault class: sgl-project/sglang#3296, vllm-project/vllm#14344 (date-dependent prompts).
"""
from __future__ import annotations

import contextlib
from datetime import datetime
from typing import Any, Iterator, Sequence

#: the date every chat template sees (``strftime_now``, and Llama-3.x's ``date_string`` derived from it)
TEMPLATE_DATE = datetime(2024, 7, 26)


class _TemplateClock(datetime):
    """``datetime`` whose ``now()`` is :data:`TEMPLATE_DATE` (what ``strftime_now`` reads)."""

    @classmethod
    def now(cls, tz=None):  # noqa: D102 — the only method templates reach
        return TEMPLATE_DATE.replace(tzinfo=tz) if tz is not None else TEMPLATE_DATE


@contextlib.contextmanager
def fixed_template_clock() -> Iterator[None]:
    """Within the block, a chat template's ``strftime_now`` returns :data:`TEMPLATE_DATE`'s date.
    Where transformers renders without a module-level ``datetime`` (another version), nothing is
    patched."""
    from transformers.utils import chat_template_utils as ctu

    real = getattr(ctu, "datetime", None)
    if real is None:
        yield
        return
    ctu.datetime = _TemplateClock
    try:
        yield
    finally:
        ctu.datetime = real


def apply_chat_template(tokenizer, messages: Sequence[dict[str, Any]], **kwargs) -> Any:
    """``tokenizer.apply_chat_template(messages, **kwargs)`` with the template clock fixed
    (:func:`fixed_template_clock`): the same text and tokens on every day.

    Raises:
        whatever the template raises (jinja's ``TemplateError`` from ``raise_exception``, ...).
    """
    with fixed_template_clock():
        return tokenizer.apply_chat_template(list(messages), **kwargs)
