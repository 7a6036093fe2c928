"""The probe tree's results: when ``eval.tree`` picks the root alone, the head is also decoded at a
small fixed tree (:func:`evaluation.tree_auto.probe_tree`) on the same prompts, interleaved with
vanilla and the method, so the report can say what the head gives (issue 31).

A probe decoder is an extra entry after the methods in each prompt's record (``methods[n + j]``);
:class:`ProbeTallies` sums its stats like a method's and checks its parity against vanilla.
"""
from __future__ import annotations

from typing import Any, Sequence

from evaluation.metrics import summarize_method


class ProbeTallies:
    """Per-probe sums over the prompt turns decoded.

    Args:
        owners: for each probe decoder, the index of the method it probes.
        first: the position of the first probe in a record's ``methods`` (= the number of methods).
    """

    def __init__(self, owners: Sequence[int], first: int) -> None:
        self.owners, self.first = list(owners), int(first)
        self.acc = [{"stats": [], "tokens": 0, "seconds": 0.0, "mismatched": [], "near_ties": [], "total": 0}
                    for _ in owners]

    def add(self, prompt_id: str, rec: dict[str, Any], checked: bool) -> None:
        """Add one record's probe results (``checked``: greedy, so tokens must equal vanilla's; in a bf16 / fp16
        run a divergence the accounting classified as a near tie (``slot["divergence"]``,
        :mod:`evaluation.divergence`) is counted under ``near_tie_ids``, not as a mismatch)."""
        ref = rec["vanilla"]["tokens"]
        for j, a in enumerate(self.acc):
            slot = rec["methods"][self.first + j]
            a["stats"].append(slot["stats"])
            a["tokens"] += len(slot["tokens"])
            a["seconds"] += float(slot["seconds"])
            a["total"] += 1
            if checked and (slot["tokens"] != ref or slot.get("repeat_mismatch")):
                tie = (slot.get("divergence") or {}).get("class") == "near_tie" and not slot.get("repeat_mismatch")
                a["near_ties" if tie else "mismatched"].append(prompt_id)

    def summary(self, method_index: int, vanilla: dict[str, Any]) -> dict[str, Any] | None:
        """The measured figures of the probe of method ``method_index`` (None if it has none):
        ``tau``, ``acceptance_per_depth``, ``drafter_passes_per_step``, ``tokens_per_s``,
        ``speedup`` (against the same vanilla pass) and ``parity`` {matched, total, mismatched_ids} plus
        ``near_tie_ids`` when a bf16 run had near ties (matched counts neither)."""
        if method_index not in self.owners:
            return None
        a = self.acc[self.owners.index(method_index)]
        m = summarize_method(a["stats"], a["tokens"], a["seconds"])
        speed = (m["tokens_per_s"] / vanilla["tokens_per_s"]) if m.get("tokens_per_s") and vanilla.get("tokens_per_s") \
            else None
        return {"measured_tau": m.get("tau"), "acceptance_per_depth": m.get("acceptance_per_depth"),
                "conditional_acceptance_per_depth": m.get("conditional_acceptance_per_depth"),
                "drafter_passes_per_step": m.get("drafter_passes_per_step"), "tokens_per_s": m.get("tokens_per_s"),
                "measured_speedup": speed, "drafter_time_share": m.get("drafter_time_share"),
                "parity": {"matched": a["total"] - len(a["mismatched"]) - len(a["near_ties"]), "total": a["total"],
                           "mismatched_ids": list(a["mismatched"]),
                           **({"near_tie_ids": list(a["near_ties"])} if a["near_ties"] else {})}}
