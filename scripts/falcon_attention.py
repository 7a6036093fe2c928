"""Where a trained Falcon drafter's queries look: attention mass per block slot and layer.

In Falcon's alignment (METHODS.md §1.1) slot j of a block holds (f_t, x_{t+1}) and predicts
f_{t+k}.  The newest input any slot of a block can see sits on the block's last position, so slot
0 of a k = 2 block has exactly the inputs of the k = 1 drafter one position later, but it must
fetch them through attention to its block partner rather than from its own residual stream.
This script measures whether it does: for every loss position (held-out split, teacher-forced,
training block mask, no noise) it takes each layer's attention probabilities, averaged over heads,
and reports their mass on

* ``newest``: the block's last position (for k = 1 and for slot k−1 this is the query itself),
* ``self``: the query's own position,
* ``older``: everything before the query's block,
* ``uniform``: what a flat spread would put on any one position (the mean of 1 / the number of
  positions the query sees), the reference for ``newest`` and ``self``,

per block slot j, averaged over positions.  Run on the same cache split as validation::

    .venv/bin/python scripts/falcon_attention.py outputs/runs/falcon/falcon-tf640/best \
        outputs/runs/falcon_k1/falcon_k1-tf640/best --cache outputs/cache/real_tf640 [--out attn.json]

Prints ``{checkpoint: {"layer<l>": {"slot<j>": {"newest", "self", "older", "uniform", "positions"}}}}``.

Raises:
    ValueError: a checkpoint that is not a Falcon head.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from _heads_cli import run_per_checkpoint


@torch.no_grad()
def attention_mass(head, batches: Iterable[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Mean attention mass on the newest / own / older positions, per layer and block slot.

    Args:
        head: a Falcon head (eval mode) attached to its base model.
        batches: collated cache batches (``input_ids``, ``hidden``, ``attention_mask``, ``loss_mask``).

    Returns:
        ``{"layer<l>": {"slot<j>": {"newest", "self", "older", "uniform": mean probability mass
        (float in [0, 1], averaged over heads and loss positions), "positions": int}}}``.

    Raises:
        ValueError: ``head`` is not a Falcon head.
    """
    if getattr(head, "head_type", None) != "falcon":
        raise ValueError(f"not a Falcon head: {type(head).__name__}")
    impl = head.layer_config._attn_implementation
    head.layer_config._attn_implementation = "eager"  # eager attention returns its probabilities
    captured: list[torch.Tensor] = []
    hooks = [layer.self_attn.register_forward_hook(lambda _m, _i, out: captured.append(out[1]))
             for layer in head.layers]
    k = head.k
    sums: dict[tuple[int, int], torch.Tensor] = {}
    try:
        for batch in batches:
            inp = head.prepare_inputs(batch)
            captured.clear()
            head.forward_train(inp["F_in"], inp["X_in"], inp["valid"])
            T = inp["mask"].shape[1]
            t = torch.arange(T)
            newest = ((t // k) + 1) * k - 1              # the block's last position, per query
            block_start = (t // k) * k
            # layer-independent: positions each query sees (flat reference) and the loss positions per slot
            n_visible = (inp["valid"][:, None, :] & (t[None, None, :] <= newest[None, :, None])).sum(-1)
            slots = [inp["mask"] & ((t % k) == j)[None] for j in range(k)]
            for layer, probs in enumerate(captured):     # [B, heads, T, T]
                p = probs.float().mean(1)                # [B, T, T]
                on_newest = p[:, t, newest.clamp(max=T - 1)]
                on_self = p[:, t, t]
                before = torch.cat([torch.zeros_like(p[..., :1]), p.cumsum(-1)], dim=-1)  # [B, T, T+1]
                older = before[:, t, block_start]        # mass on keys < the query's block start
                for j, sel in enumerate(slots):
                    acc = sums.setdefault((layer, j), torch.zeros(5, dtype=torch.float64))
                    acc += torch.tensor([float(on_newest[sel].sum()), float(on_self[sel].sum()),
                                         float(older[sel].sum()), float((1.0 / n_visible[sel].double()).sum()),
                                         float(sel.sum())], dtype=torch.float64)
    finally:
        for h in hooks:
            h.remove()
        head.layer_config._attn_implementation = impl
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (layer, j), (n, s, o, u, c) in sorted(sums.items()):
        out.setdefault(f"layer{layer}", {})[f"slot{j}"] = {
            "newest": float(n / c), "self": float(s / c), "older": float(o / c), "uniform": float(u / c),
            "positions": int(c)}
    return out


if __name__ == "__main__":
    run_per_checkpoint(__doc__, attention_mass)
