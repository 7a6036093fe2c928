"""Precision per stage: is bf16 native on this device, what ``auto`` means, and one line when it is not.

Three settings choose a stage's arithmetic (docs/precision.md):

* ``model.dtype`` - the dtype the base runs in wherever it computes *features* (data prep:
  teacher-forced hidden states, greedy labels, regeneration; online / hybrid training).  It is
  part of the feature definition (:mod:`data_prep.features`) and of the cache hash.
* ``train.precision`` - the Lightning precision of the draft head's training step.
* ``eval.dtype`` - the base and drafter at evaluation (unchanged here: no ``auto``).

``auto`` resolves to bf16 only where bf16 is **native**, i.e. where a large bf16 matrix product
is clearly faster than fp32 on this device (:func:`bf16_support`):

* CUDA: ``torch.cuda.is_bf16_supported(including_emulation=False)`` (Ampere and later);
* x86 CPU: AMX (``amx_bf16``), or ``avx512_bf16`` on AMD (Zen 4 and later: issue 26 measured a
  bf16 GEMM at 4.6x fp32 on an EPYC), with oneDNN's bf16 path available
  (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``);
* aarch64 CPU: the ``bf16`` feature (BFMMLA).

``avx512_bf16`` on an Intel CPU without AMX (Cooper Lake; Sapphire/Emerald Rapids guests whose
hypervisor hides AMX) is **slow**: its bf16 dot product retires at the same FLOP rate as two fp32
FMAs, so large bf16 GEMMs are no faster than fp32 (measured 0.6-0.7x here, docs/precision.md).
A CPU with neither is **none**: bf16 is emulated, several times slower than fp32.

``auto`` on a slow or none device resolves to fp32 and says why in one line; an explicit bf16
request on a *slow* device runs, with one warning line; on a *none* device it is refused
(:class:`core.config.ConfigError` naming the key) before anything is written.  Never silently slow.

``DRAFTHEADS_BF16=native|slow|none`` forces the CPU answer (a CPU this table does not know; the
test suite pins ``slow`` so that ``auto`` is fp32 on every machine).
"""
from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from core.config import MODEL_DTYPES, ConfigError  # noqa: F401  (MODEL_DTYPES: this module's API)

#: environment override of the CPU detection (values: :data:`LEVELS`)
BF16_ENV = "DRAFTHEADS_BF16"
LEVELS = ("native", "slow", "none")
#: Lightning precisions that compute in bf16
BF16_PRECISIONS = ("bf16-mixed", "bf16-true", "bf16")


@dataclass(frozen=True)
class Bf16Support:
    """What bf16 costs on one device kind.

    Attributes:
        device: ``cpu`` or ``cuda``.
        level: ``native`` (bf16 GEMMs clearly faster than fp32), ``slow`` (bf16 instructions, no
            faster than fp32) or ``none`` (emulated).
        reason: one clause naming what was detected (CPU flags, vendor, GPU name, or the override).
    """

    device: str
    level: str
    reason: str

    @property
    def native(self) -> bool:
        return self.level == "native"


def _cpu0_fields() -> dict[str, str]:
    """``/proc/cpuinfo``'s ``key: value`` lines (keys lower-cased, the first of each) up to the end of the
    block that holds CPU 0's ``flags`` (x86) / ``Features`` (aarch64); ``{}`` where there is no such file."""
    fields: dict[str, str] = {}
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip() and ("flags" in fields or "features" in fields):
            break
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    return fields


def _cpuinfo() -> tuple[str, set[str]]:
    """``(vendor, flags)`` of CPU 0 from ``/proc/cpuinfo`` (x86 ``flags`` / aarch64 ``Features``);
    ``("", set())`` where there is no such file."""
    fields = _cpu0_fields()
    return fields.get("vendor_id", ""), set((fields.get("flags") or fields.get("features") or "").split())


#: The instruction-set flags that change this project's CPU kernels (bf16 and fp32 matrix products).
COST_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")


def cpu_identity() -> str:
    """This CPU as a measured cost depends on it: ``/proc/cpuinfo``'s ``model name``, ``cpu family`` and ``model``
    of CPU 0 and which of :data:`COST_FLAGS` it has, e.g. ``"AMD EPYC (family 25 model 17) [avx512_bf16 avx512f
    avx2]"`` (``platform.processor()`` where there is no such file).  Keys the cached c(n) measurements
    (:func:`decoding.cost_model.cost_key`), which must not travel to another CPU with ``output_root``."""
    import platform

    vendor, flags = _cpuinfo()
    fields = _cpu0_fields()
    name = fields.get("model name") or fields.get("cpu model") or vendor or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:  # a VM may name every EPYC alike; family/model tell Zen 3 from 4
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return f"{name} [{' '.join(f for f in COST_FLAGS if f in flags)}]"


def _mkldnn_bf16() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def classify_cpu(vendor: str, flags: set[str], machine: str, mkldnn_bf16: bool) -> Bf16Support:
    """The bf16 level of a CPU from its vendor string, flag set and architecture (pure; see module doc).

    Args:
        vendor: ``/proc/cpuinfo`` ``vendor_id`` (``AuthenticAMD``, ``GenuineIntel``, or empty).
        flags: its ``flags`` (x86) or ``Features`` (aarch64).
        machine: ``platform.machine()`` (``x86_64``, ``aarch64``, ``arm64``).
        mkldnn_bf16: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``.
    """
    if machine in ("aarch64", "arm64"):
        if "bf16" in flags:
            return Bf16Support("cpu", "native", "aarch64 CPU with the bf16 feature (BFMMLA)")
        return Bf16Support("cpu", "none", "aarch64 CPU without the bf16 feature: bf16 is emulated")
    if "amx_bf16" in flags and mkldnn_bf16:
        return Bf16Support("cpu", "native", "CPU with AMX (amx_bf16)")
    if "avx512_bf16" in flags and vendor == "AuthenticAMD" and mkldnn_bf16:
        return Bf16Support("cpu", "native", "AMD CPU with avx512_bf16 (Zen 4 or later)")
    if "avx512_bf16" in flags or mkldnn_bf16:
        return Bf16Support("cpu", "slow", f"{vendor or 'this'} CPU has avx512_bf16 but no AMX: its bf16 dot products "
                                          "retire at fp32's FLOP rate, so large bf16 matrix products are no faster than fp32")
    return Bf16Support("cpu", "none", "CPU without avx512_bf16 or AMX: bf16 is emulated, several times slower than fp32")


@lru_cache(maxsize=None)
def _detect_cpu() -> Bf16Support:
    vendor, flags = _cpuinfo()
    return classify_cpu(vendor, flags, platform.machine().lower(), _mkldnn_bf16())


def packed_bf16_is_fastest() -> bool:
    """Whether oneDNN's prepacked bf16 products were measured the fastest bf16 kernels on a CPU like this
    one, so that ``eval.prepack_weights=auto`` packs a bf16 base (:mod:`decoding.prepacked`):

    * a CPU with AMX (issue 27, an Intel Xeon): 25 against 58 us for SmolLM2's 576 -> 1536 product over one row;
    * an AMD CPU with ``avx512_bf16`` (measured on a Zen 4, 2026-12-07; Zen 5 has the same bf16
      instructions): SmolLM2's one-token step 38-40 against 44 ms unpacked, and a 9-node verification
      1.02-1.04 one-token steps against 1.27 (docs/precision.md "On an AMD EPYC (Zen 4)").

    Elsewhere (an Intel without AMX, aarch64) it was not measured, and ``auto`` leaves bf16 unpacked.
    """
    vendor, flags = _cpuinfo()
    return "amx_bf16" in flags or ("avx512_bf16" in flags and vendor == "AuthenticAMD")


def fp16_problem(device: str | torch.device = "cpu") -> str | None:
    """Why float16 would be emulated on ``device``, or None where its products are native: any CUDA
    device; an x86 CPU with ``avx512_fp16`` or AMX-FP16 (``amx_fp16``); an aarch64 CPU with half-precision
    arithmetic (``asimdhp``).  Elsewhere oneDNN and torch convert every fp16 product through fp32, and an
    evaluation in fp16 ran about 10x slower than in fp32 (2.1 tokens/s on an AMD EPYC Zen 4)."""
    kind = torch.device("cuda" if str(device) == "gpu" else device).type
    if kind != "cpu":
        return None
    _, flags = _cpuinfo()
    if flags & {"avx512_fp16", "amx_fp16", "asimdhp"}:
        return None
    return ("on this CPU (no avx512_fp16, AMX-FP16 or aarch64 half-precision arithmetic) is emulated through fp32, "
            "about 10x slower than float32")


def bf16_support(device: str | torch.device = "cpu") -> Bf16Support:
    """Whether bf16 is native on ``device`` (``cpu``, ``cuda``, ``cuda:N``, ``gpu``).

    ``$DRAFTHEADS_BF16`` (native | slow | none) overrides the CPU answer.

    Raises:
        ValueError: ``$DRAFTHEADS_BF16`` holds another value.
    """
    kind = torch.device("cuda" if str(device) == "gpu" else device).type
    if kind == "cuda":
        if not torch.cuda.is_available():
            return Bf16Support("cuda", "none", "no CUDA device")
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return Bf16Support("cuda", "native", f"{name} supports bf16")
        return Bf16Support("cuda", "none", f"{name} has no native bf16 (compute capability < 8.0)")
    forced = os.environ.get(BF16_ENV, "").strip().lower()
    if forced:
        if forced not in LEVELS:
            raise ValueError(f"${BF16_ENV}={forced!r} is not valid; choices: {', '.join(LEVELS)}")
        return Bf16Support("cpu", forced, f"${BF16_ENV}={forced}")
    return _detect_cpu()


_SAID: set[str] = set()


def note(line: str, out=None) -> None:
    """Print ``draftheads: <line>`` to stderr once per process (the one line a resolution owes)."""
    if line in _SAID:
        return
    _SAID.add(line)
    print(f"draftheads: {line}", file=out or sys.stderr, flush=True)


def resolve_dtype(value: Any, key: str, device: str | torch.device = "cpu", check: bool = True,
                  auto_ok: bool = True) -> str:
    """Resolve a base-compute dtype setting (``model.dtype``) for ``device``.

    ``auto`` -> ``bfloat16`` where bf16 is native, else ``float32`` (one line saying why);
    ``bfloat16`` on a *slow* device -> kept, one warning line; on a *none* device -> refused;
    ``float16`` where it would be emulated (:func:`fp16_problem`) -> refused; ``float32`` passes through.

    Args:
        value: the setting (``auto`` | ``float32`` | ``bfloat16`` | ``float16``).
        key: the config key, named in messages (e.g. ``model.dtype``).
        device: where the computation runs.
        check: print the resolution's line and refuse bf16 without instructions (a stage's entry
            point); False only resolves (hashing a config, reading a recorded one).
        auto_ok: ``key`` takes ``auto`` (the messages suggest it); False for ``eval.dtype``.

    Returns:
        the torch dtype name that runs.

    Raises:
        core.config.ConfigError: ``value`` is not one of :data:`MODEL_DTYPES`, or bf16 was asked
            for on a device without bf16 instructions, or fp16 on a CPU that emulates it (the message
            names ``key``).
    """

    value = str(value)
    if value not in MODEL_DTYPES:
        raise ConfigError(f"{key}={value!r} is not valid; choices: {', '.join(MODEL_DTYPES)}")
    if value == "float16" and check and (problem := fp16_problem(device)):
        raise ConfigError(f"{key}=float16 {problem}; use {key}={'auto' if auto_ok else 'float32'} "
                          "(or bfloat16 where it is native: docs/precision.md)")
    if value not in ("auto", "bfloat16"):
        return value
    return _resolve_bf16_choice(key, value, device, "bfloat16", "float32", check, auto_ok)


def resolve_train_precision(value: Any, accelerator: str, check: bool = True) -> str:
    """Resolve ``train.precision`` for ``accelerator`` (``cpu`` | ``gpu``).

    ``auto`` -> ``bf16-mixed`` where bf16 is native (any GPU with bf16; a CPU with AMX, or AMD
    avx512_bf16), else ``32-true`` with one line saying why.  An explicit bf16 precision on a
    *slow* CPU runs with one warning line, on a *none* device it is refused.  Other Lightning
    strings pass through (``train.config_checks`` refuses float16 on CPUs).  ``check=False``
    resolves without the line and without refusing.

    Raises:
        core.config.ConfigError: bf16 asked for where there are no bf16 instructions.
    """

    value = str(value)
    device = "cuda" if accelerator in ("gpu", "cuda") else "cpu"
    if value != "auto" and value not in BF16_PRECISIONS:
        return value
    return _resolve_bf16_choice("train.precision", value, device, "bf16-mixed", "32-true", check)


def _resolve_bf16_choice(key: str, value: str, device: str, native: str, fallback: str, check: bool,
                         auto_ok: bool = True) -> str:
    """The rule both precision keys share: ``auto`` -> ``native`` where bf16 is native on ``device``,
    else ``fallback``, with one line saying which and why; an explicit bf16 ``value`` is refused
    where there are no bf16 instructions and runs with one warning where they are slow.
    ``check=False``: no line, no refusal.

    Raises:
        core.config.ConfigError: bf16 asked for where there are no bf16 instructions (names ``key``).
    """
    s = bf16_support(device)
    if value == "auto":
        out = native if s.native else fallback
        if check:
            note(f"{key}=auto -> {out} on {s.device} ({s.reason})")
        return out
    if not check:
        return value
    if s.level == "none":
        use = f"{key}=auto or {fallback}" if auto_ok else f"{key}={fallback}"
        raise ConfigError(f"{key}={value} on {s.device}: {s.reason}; use {use}")
    if s.level == "slow":
        pick = f"{key}=auto picks {fallback} here" if auto_ok else f"{key}={fallback} is faster here"
        note(f"warning: {key}={value} on {s.device} runs, but is not expected to be faster than {fallback} "
             f"({s.reason}); {pick}")
    return value


def torch_dtype(name: str) -> torch.dtype:
    """``torch.float32`` for ``"float32"`` etc. (a resolved dtype name, never ``auto``)."""
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name")
    return dt


def with_values(cfg, values: dict[str, Any]):
    """A copy of the composed config ``cfg`` with dotted ``key: value`` pairs set (the resolved
    settings a stage records in its output's ``config.yaml``); ``cfg`` itself is unchanged."""
    import copy

    from omegaconf import OmegaConf

    out = copy.deepcopy(cfg)
    for key, value in values.items():
        OmegaConf.update(out, key, value, merge=False)
    return out
