"""Row-consistent matrix products: a one-token step computes what a verification forward computes.

Lossless speculative decoding needs the verification forward's row for a position to equal the
one-token step vanilla decoding runs there.  In exact arithmetic they are equal; in floating point
they are equal only when every kernel sums in the same order for any number of rows n.

Finding (issue 26, docs/precision_eval.md; torch 2.13 CPU, oneDNN): a **bf16** ``nn.Linear`` over
one row (M = 1, the one-token step) runs a matrix-vector kernel, over two or more rows (M >= 2,
verification, prefill) oneDNN's blocked GEMM.  With the reduction length K = 1536 (SmolLM2's
``down_proj``) the two orders round differently in about 1 of 5 000 outputs (one bf16 ulp), while
any two M >= 2 products agree bit for bit, and K = 576 (every other SmolLM2 projection, the LM
head) agrees at every M.  One differing ulp in layer 3 grows through the residual stream and flips
the argmax wherever the top two logits are close: with ``checkpoint=oracle`` the first MT-bench
prompt left bf16 vanilla at token 18.  Attention (eager, fp32 softmax, the tree mask adding exact
zeros), RMSNorm (computed in fp32 by transformers) and the LM head were bitwise row-consistent.

The fix taken here: :func:`pad_one_row_products` makes every linear layer whose one-row product
differs from its many-row product on this machine (probed per weight shape, :func:`one_row_differs`)
compute a one-row input as a two-row product (the row repeated) and keep the first row, so the
one-token step runs the same kernel as verification.  With it, the verification rows of a chain
equal the one-token steps bit for bit (measured on SmolLM2, n = 2..8).  It applies to the model
it is called on (vanilla and speculative decoding share the base, so the comparison stays fair).

fp32 is left alone (its exact parity is the proof; :data:`PAD_DTYPES`), and only CPU models are
probed (other devices: measure first).
"""
from __future__ import annotations

import logging
import types

import torch

log = logging.getLogger(__name__)

#: dtypes whose one-row products are probed and padded (fp32 parity is exact and stays untouched)
PAD_DTYPES = (torch.bfloat16, torch.float16)

#: outputs compared per weight shape when probing (a 1-in-5 000 rate is then missed with
#: probability ~e^-13)
PROBE_ELEMENTS = 65536

_PADDED = "_draftheads_one_row_padded"
#: set by a layer whose products are row-consistent by construction (decoding.prepacked packs a bf16
#: layer for every row count only where its packed one-row product equals its many-row rows): never padded
ROW_CONSISTENT = "_draftheads_row_consistent"


def one_row_differs(weight: torch.Tensor, bias: torch.Tensor | None = None, elements: int = PROBE_ELEMENTS,
                    seed: int = 0) -> bool:
    """Whether ``F.linear`` over one row differs from the same row inside a many-row product.

    Args:
        weight: [N, K] in the dtype and on the device to probe.  bias: [N] or None.
        elements: how many outputs to compare (rows = ceil(elements / N), at least 4).
        seed: of the random probe inputs (standard normal, cast to ``weight.dtype``).

    Returns:
        True when some output of the M = 1 product differs (bitwise) from the M = rows product.
    """
    import math

    F = torch.nn.functional
    n_out, k = weight.shape
    rows = max(4, math.ceil(elements / n_out))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(weight.device, weight.dtype)
    with torch.no_grad():
        full = F.linear(x, weight, bias)
        for i in range(rows):
            if not torch.equal(F.linear(x[i:i + 1], weight, bias), full[i:i + 1]):
                return True
    return False


def _padded_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` that computes a single input row as a two-row product (row repeated)."""
    if x.numel() == x.shape[-1]:
        y = torch.nn.functional.linear(x.reshape(1, -1).expand(2, -1), self.weight, self.bias)[:1]
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return torch.nn.functional.linear(x, self.weight, self.bias)


def pad_one_row_products(model: torch.nn.Module, dtypes=PAD_DTYPES) -> list[str]:
    """Make ``model``'s one-row linear products run the many-row kernel where the two differ.

    Each distinct (weight shape, bias, dtype, device) of the model's ``nn.Linear`` layers in
    ``dtypes`` on a CPU is probed once (:func:`one_row_differs`, with that layer's weights); the
    layers of a differing shape get :func:`_padded_forward` as their instance ``forward``.  Layers
    marked :data:`ROW_CONSISTENT` (bf16 weights prepacked for every row count,
    :func:`decoding.prepacked.prepack_row_consistent`) are left alone.  Idempotent;
    :func:`restore_one_row_products` undoes it.

    Returns:
        The padded layers' module names (empty when nothing differs, or the model is fp32 / not on
        a CPU).
    """
    verdict: dict[tuple, bool] = {}
    padded = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        w = mod.weight
        if w.dtype not in dtypes or w.device.type != "cpu":
            continue
        if getattr(mod, _PADDED, False):
            padded.append(name)
            continue
        if getattr(mod, ROW_CONSISTENT, False):
            continue
        key = (tuple(w.shape), mod.bias is not None, w.dtype, str(w.device))
        if key not in verdict:
            verdict[key] = one_row_differs(w, mod.bias)
        if verdict[key]:
            mod.forward = types.MethodType(_padded_forward, mod)
            setattr(mod, _PADDED, True)
            padded.append(name)
    if padded:
        shapes = sorted({f"{k[0][1]}->{k[0][0]}" for k, v in verdict.items() if v})
        log.info("one-row products differ from many-row ones for linear layers %s (in-out); %d layer(s) "
                 "compute a one-token step as two rows (decoding.numerics)", ", ".join(shapes), len(padded))
    return padded


def is_one_row_padded(module: torch.nn.Module) -> bool:
    """Whether :func:`pad_one_row_products` gave ``module`` its two-row one-token ``forward``."""
    return bool(getattr(module, _PADDED, False))


def restore_one_row_products(model: torch.nn.Module) -> None:
    """Undo :func:`pad_one_row_products` on ``model``."""
    for mod in model.modules():
        if getattr(mod, _PADDED, False):
            del mod.forward
            delattr(mod, _PADDED)
