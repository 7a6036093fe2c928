"""fp8 storage of cached hidden states: ``prep.dtype=float8_e4m3fn`` with one scale per row (token).

A hidden-state row ``x`` [H] is stored as ``q = fp8_e4m3(x / s)`` with ``s = max|x| / 448`` (448 =
the largest finite e4m3 value) kept in float32, so every row uses the full e4m3 range whatever its
magnitude (the residual stream of Llama-family bases has rows whose norms differ by 100x and
more).  Reading gives ``q * s`` in bfloat16.  The same scheme (per-token absmax scale, e4m3) is what
vllm-project/speculators and NVIDIA Model-Optimizer call per-token fp8; the cost is 1 byte per value
plus 4 bytes per row, half of bf16 at H >= 64.

:func:`storage_roundtrip` gives any hidden tensor exactly as the cache would return it, so online
and hybrid training (``train.online``) see the same values as an offline cache of that dtype.
"""
from __future__ import annotations

import torch

FP8_NAME = "float8_e4m3fn"
#: largest finite value of float8_e4m3fn
FP8_MAX = 448.0
#: dtype returned by :func:`dequantize_rows`
READ_DTYPE = torch.bfloat16
_PLAIN = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: every ``prep.dtype`` choice
STORAGE_DTYPES = (*_PLAIN, FP8_NAME)


def fp8_dtype() -> torch.dtype:
    """``torch.float8_e4m3fn``.

    Raises:
        core.config.UserInputError: this torch build has no float8_e4m3fn (torch < 2.1, or a build
            without it); the message names the torch version and the fallback.
    """
    from core.config import UserInputError

    dt = getattr(torch, FP8_NAME, None)
    if not isinstance(dt, torch.dtype):
        raise UserInputError(f"prep.dtype={FP8_NAME} needs torch.{FP8_NAME}, which torch {torch.__version__} "
                             "does not have (torch >= 2.1 has it); use prep.dtype=bfloat16")
    return dt


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype a ``prep.dtype`` value stores hidden states in.

    Raises:
        ValueError: ``name`` is not one of :data:`STORAGE_DTYPES`.
        core.config.UserInputError: fp8 on a torch build without it (:func:`fp8_dtype`).
    """
    if name == FP8_NAME:
        return fp8_dtype()
    if name not in _PLAIN:
        raise ValueError(f"prep.dtype={name!r} is not one of {', '.join(STORAGE_DTYPES)}")
    return _PLAIN[name]


def is_fp8(dtype: torch.dtype) -> bool:
    """True for ``torch.float8_e4m3fn`` (False on builds without fp8)."""
    return dtype == getattr(torch, FP8_NAME, None)


#: smallest scale: rows whose max |x| / 448 underflows float32 would divide by 0 (0/0 = NaN)
_MIN_SCALE = torch.finfo(torch.float32).tiny


def quantize_rows(x: torch.Tensor, where: str = "hidden states") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax fp8 quantisation: finite values saturate, non-finite ones are refused.

    Every finite value maps to a finite e4m3 value: ``x / scale`` lies in [-448, 448] (clamped
    against rounding), and a row whose max |x| is so small that ``max / 448`` underflows gets the
    smallest normal float32 scale instead of 0 (its values flush towards 0, never to NaN).  A NaN
    or ±inf has no e4m3 value that stands for it (``float8_e4m3fn`` has no inf; a NaN would also
    poison its row's scale), so it is refused rather than clipped to ±448 or spread over its row.

    Args:
        x: float tensor [..., H] (any float dtype, any device).
        where: names the tensor in the error.

    Returns:
        ``(q, scale)``: ``q`` float8_e4m3fn [..., H], ``scale`` float32 [...] with
        ``x ≈ q.float() * scale[..., None]``; an all-zero row gets scale 1 (and q = 0).

    Raises:
        core.finite.NonFiniteError: ``x`` holds NaN or ±inf (names ``where``, the row and the count).
    """
    from core.finite import NonFiniteError, describe, first_non_finite

    xf = x.float()
    found = first_non_finite(xf)
    if found is not None:
        index, value, count = found
        raise NonFiniteError(f"fp8 quantisation of {where}: {count} non-finite value(s) (first {describe(value)} "
                             f"at {list(index)}); e4m3 has no value for them and they are never clipped or spread")
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, (amax / FP8_MAX).clamp_min(_MIN_SCALE), torch.ones_like(amax))
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(fp8_dtype())
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = READ_DTYPE) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: ``(q.float() * scale[..., None]).to(dtype)`` [..., H]."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def storage_roundtrip(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` [..., H] as a cache with ``prep.dtype=name`` returns it: cast for bf16/fp16/fp32,
    quantise + dequantise (bf16 result) for fp8.  Bit-identical to writing then reading.

    Raises:
        core.finite.NonFiniteError: fp8 and ``x`` holds NaN / ±inf (:func:`quantize_rows`)."""
    dt = storage_dtype(name)
    if is_fp8(dt):
        return dequantize_rows(*quantize_rows(x))
    return x.to(dt)
