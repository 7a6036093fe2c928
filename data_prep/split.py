"""Deterministic held-out split by conversation id (design.md "Splits").

A conversation is held out when ``sha256(f"{salt}:{id}")`` read as a fraction in [0, 1) is
below ``fraction``; ``id`` is the conversation's root id (:func:`root_id`) unless
``data.split_key=id``.  The decision depends on the id alone, so it is the same for every
``max_conversations``, rank count, file order and machine; held-out conversations go to the
``val/`` sub-cache and to evaluation prompts and are never trained on.
"""
from __future__ import annotations

import hashlib
import re

_PART_SUFFIX = re.compile(r"_\d+$")


def root_id(conversation_id: str) -> str:
    """The conversation *root* id: ``abc_0``, ``abc_1`` → ``abc`` (ShareGPT splits long conversations
    into parts ``<root>_<k>``; all parts must land on the same side of the held-out split).  An id
    without a ``_<digits>`` suffix is its own root."""
    return _PART_SUFFIX.sub("", conversation_id) or conversation_id


def heldout_score(conversation_id: str, salt: str) -> float:
    """The id's position in [0, 1): the first 8 bytes of ``sha256(salt:id)`` / 2**64."""
    digest = hashlib.sha256(f"{salt}:{conversation_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_heldout(conversation_id: str, fraction: float, salt: str) -> bool:
    """True when ``conversation_id`` belongs to the held-out (validation / evaluation) split.

    Args:
        conversation_id: the ShareGPT record id.
        fraction: share of ids held out, in [0, 1].
        salt: ``data.split_salt``; changing it reshuffles the split.

    Raises:
        ValueError: ``fraction`` outside [0, 1].
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"data.heldout_fraction={fraction!r} must lie in [0, 1]")
    return heldout_score(conversation_id, salt) < fraction
