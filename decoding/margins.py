"""Top-2 logits of the rows that chose emitted tokens: what low-precision parity accounting reads.

A decoder that records them (``trace_logits = True`` on :class:`decoding.speculative.SpeculativeDecoder`
or :class:`decoding.adadecode.AdaDecodeDecoder`) keeps, after ``generate``, ``last_trace``: one entry
per emitted token, the :func:`top2` of the logits row whose argmax it emitted (None for the first
token, which the prefill chooses exactly as vanilla decoding's prefill does).
"""
from __future__ import annotations

import torch


def top2(logits: torch.Tensor) -> list[list]:
    """Per row: ``[top1 id, top1 logit, runner-up id, runner-up logit]``.

    The top-1 id is ``argmax`` (the greedy rule, ties to the lowest id) and the runner-up the argmax
    of the other entries, so an exact tie reads as two ids with equal logits.

    Args:
        logits: [n, V] or [V], any float dtype (values are reported as Python floats, exact for
            bf16 / fp16 / fp32).

    Returns:
        n lists (one for a [V] input).
    """
    x = logits.detach().reshape(-1, logits.shape[-1])
    i1 = x.argmax(-1)
    v1 = x.gather(-1, i1[:, None])[:, 0]
    rest = x.clone()
    rest.scatter_(-1, i1[:, None], float("-inf"))
    i2 = rest.argmax(-1)
    v2 = x.gather(-1, i2[:, None])[:, 0]
    return [[int(a), float(b), int(c), float(d)] for a, b, c, d in
            zip(i1.tolist(), v1.float().tolist(), i2.tolist(), v2.float().tolist())]
