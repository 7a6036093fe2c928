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


#: the most conversations one root id may gather under ``data.split_key=root`` (ShareGPT V3's largest
#: conversation is split into 89 parts); more look like enumerated ids (``identity_0`` ... ``identity_917``)
#: that all share one root and so would all land on one side of the split
MAX_PARTS_PER_ROOT = 256


class RootCounter:
    """Counts conversations per (source, root id) under ``data.split_key=root`` and refuses a root that
    gathers more than :data:`MAX_PARTS_PER_ROOT` of them, before anything is written.

    Raises (from :meth:`add`):
        ValueError: names the source, the root, how many ids it gathered and two of them, and the fix.
    """

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], tuple[int, str]] = {}  # (source, root) -> (count, first id)

    def add(self, source: str, conversation_id: str) -> None:
        root = root_id(conversation_id)
        if root == conversation_id:
            return
        key = (source, root)
        n, first = self._seen.get(key, (0, conversation_id))
        n += 1
        self._seen[key] = (n, first)
        if n > MAX_PARTS_PER_ROOT:
            raise ValueError(
                f"{source}: {n} conversations share the root id {root!r} ({first!r} ... {conversation_id!r}) "
                f"under data.split_key=root, so they would all land on one side of the held-out split. Root ids join "
                f"the parts <root>_<k> of one ShareGPT conversation (at most {MAX_PARTS_PER_ROOT}); these look like "
                f"enumerated ids: set data.split_key=id")


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
