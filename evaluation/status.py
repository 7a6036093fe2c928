"""How far an evaluation got: skipped turns, a stop in the middle, and where its time went.

Every ``report.json`` carries (merged in by :func:`evaluation.runner.run_evaluation`):

* ``complete`` — false when decoding stopped in the middle (an exception in a decoder,
  KeyboardInterrupt); the report then holds every prompt turn decoded before the stop, ``error``
  names the exception, ``stopped_at`` the prompt turn in flight and ``pending_prompts`` the
  prompts not reached.  ``resume=auto`` continues from ``progress.jsonl``.
* ``skipped_prompts`` — prompts and turns that cannot be run, each with its reason: prompts
  longer than ``eval.max_prompt_tokens`` (at loading) and later turns without a correct prompt
  (:func:`evaluation.turns.follow_up_prompt`: the chat template cannot render the conversation;
  or the turn's prompt + ``eval.max_new_tokens`` exceeds the context), with the turns after them.
* ``phases`` — wall-clock seconds of the run's stages: ``planning_seconds`` (all of
  ``eval.tree``'s planning), of which ``cost_model_seconds`` (measuring c(n); 0 when read from the
  cache) and ``calibration_seconds`` (the calibration decode and drafter timing; 0 when cached),
  and ``decoding_seconds`` (vanilla + every method on the evaluation prompts, in this launch);
  ``timed_decoding_seconds`` (the timed decoding behind every reported turn: vanilla, the methods
  and the vanilla references, whichever launch or merged shard decoded it) and
  ``turns_decoded_earlier`` (turns a resumed or merged run did not decode itself).
"""
from __future__ import annotations

from typing import Any, Sequence

from evaluation.prompts import turn_id


def skipped_turn(prompt_id: str, turn: int, last_turn: int, exc: BaseException) -> dict[str, Any]:
    """The ``skipped_prompts`` entry of a later turn that cannot be run: ``{"id", "turn", "ids"
    (this turn and the later ones, which follow its answer), "reason"}``."""
    return {"id": turn_id(prompt_id, turn), "turn": int(turn),
            "ids": [turn_id(prompt_id, t) for t in range(turn, last_turn + 1)], "reason": str(exc)}


def plan_phases(methods: Sequence[tuple], planning_seconds: float) -> dict[str, float]:
    """``phases`` after planning: total planning seconds and the cost-model / calibration seconds
    that :func:`evaluation.tree_auto.plan_tree` recorded in each method's ``tree_choice.timing``."""
    out = {"planning_seconds": float(planning_seconds), "cost_model_seconds": 0.0, "calibration_seconds": 0.0}
    for m in methods:
        timing = ((m[3] or {}).get("tree_choice") or {}).get("timing") or {}
        out["cost_model_seconds"] += float(timing.get("cost_model_seconds") or 0.0)
        out["calibration_seconds"] += float(timing.get("calibration_seconds") or 0.0)
    return out


def run_status(error: BaseException | None, prompts: Sequence, done: Sequence, in_flight, phases: dict[str, float]
               ) -> dict[str, Any]:
    """The report keys of :mod:`this module <evaluation.status>`'s doc (``skipped_prompts`` aside).

    Args:
        error: the exception that stopped decoding, or None for a finished run.
        prompts: the evaluation's first-turn prompts.
        done: the prompt turns with results, in decoding order.
        in_flight: the prompt turn being decoded when ``error`` struck (None if none).
        phases: the run's phase seconds (:func:`plan_phases` + ``decoding_seconds``).
    """
    ids = {p.id for p in done}
    return {"complete": error is None,
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "stopped_at": None if error is None or in_flight is None else in_flight.id,
            "pending_prompts": [] if error is None else [p.id for p in prompts if p.id not in ids],
            "phases": dict(phases)}


def phases_line(phases: dict[str, float] | None) -> str:
    """One console line: ``time: planning 12.0 s (c(n) 3.1 s, calibration 8.2 s), decoding 40.3 s``."""
    if not phases:
        return "time: -"
    line = (f"time: planning {phases.get('planning_seconds', 0.0):.1f} s (c(n) {phases.get('cost_model_seconds', 0.0):.1f} s, "
            f"calibration {phases.get('calibration_seconds', 0.0):.1f} s), decoding {phases.get('decoding_seconds', 0.0):.1f} s")
    if phases.get("turns_decoded_earlier"):  # resumed or merged: this launch's wall time is not the decoding's
        line += (f" in this launch; {phases['turns_decoded_earlier']} turn(s) decoded by earlier launches or merged "
                 f"shards; timed decoding over every turn {phases.get('timed_decoding_seconds', 0.0):.1f} s")
    return line
