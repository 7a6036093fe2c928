"""Where a cached measurement came from: the machine load it was taken under, and how to say so.

Timed measurements (the verification cost model c(n), :mod:`decoding.cost_model`; a head's
calibration and drafter cost, :mod:`evaluation.tree_auto`) are cached and reused, so a
measurement taken on a loaded machine would silently size every later tree (issue 31).  Each
cache file therefore records :func:`machine_load` at measurement time, and every reuse is logged
with :func:`reuse_line`: the file, its age, and that load.
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch


def machine_load() -> dict[str, Any]:
    """The load a measurement is taken under: ``loadavg`` (1, 5, 15-minute load averages of the
    host, ``os.getloadavg``; None where unavailable), ``cpus`` (``os.cpu_count``), ``threads``
    (torch intra-op threads) and ``measured_at`` (Unix seconds)."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    return {"loadavg": load, "cpus": os.cpu_count(), "threads": int(torch.get_num_threads()),
            "measured_at": time.time()}


def age_text(seconds: float | None) -> str:
    """``42 s``, ``13 min``, ``5.2 h``, ``3.0 days``; ``unknown age`` for None."""
    if seconds is None:
        return "unknown age"
    s = max(0.0, float(seconds))
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def load_text(load: dict[str, Any] | None) -> str:
    """``load 3.10 on 2 CPUs, 2 threads`` (1-minute average), or ``load not recorded``."""
    if not load:
        return "load not recorded"
    avg = load.get("loadavg")
    first = f"load {avg[0]:.2f}" if avg else "load unknown"
    return f"{first} on {load.get('cpus')} CPUs, {load.get('threads')} threads"


def reuse_line(what: str, path, measured_at: float | None, load: dict[str, Any] | None) -> str:
    """One log line for the reuse of a cached measurement: what, the file, its age, the load it
    was measured under, and how to measure it again."""
    age = None if measured_at is None else time.time() - float(measured_at)
    return (f"reusing the cached {what} from {path} (measured {age_text(age)} ago, {load_text(load)}); "
            f"delete that file to measure it again")


def busy(load: dict[str, Any] | None, factor: float = 1.0) -> bool:
    """Whether ``load`` (:func:`machine_load`) had more runnable processes than CPUs × ``factor``."""
    if not load or not load.get("loadavg") or not load.get("cpus"):
        return False
    return float(load["loadavg"][0]) > float(load["cpus"]) * factor
