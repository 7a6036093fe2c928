"""AdaDecode draft heads: one lightweight LM head per candidate layer (METHODS.md §3.2, arXiv 2506.03700).

For every candidate layer ℓ ∈ 𝓛 (SmolLM2 default {8, 15, 22} of L = 30)

    z^(ℓ) = W · T_ℓ · RMSNorm_final(hs[ℓ])                                   (METHODS §3.2 Rec.)

with T_ℓ ∈ R^{H×H} learned and initialised to the identity (so at init the head *is* the logit
lens), and the final RMSNorm and LM head W ∈ R^{V×H} the base model's own, frozen and shared
(borrowed through :meth:`heads.base.DraftHead.attach_base`, never saved).  hs[ℓ] is the HF
hidden state after ℓ decoder layers (pre-norm residual stream), cached by data prep as
``aux_hidden[ℓ]``.  Parameters per head: H² (0.33M for SmolLM2) against V·H (28.3M) for a full LM
head.

Training objective: :func:`losses.adadecode.adadecode_loss` (METHODS §3.3).  Validation metrics
simulate the decode-time exit policy (exit at the first candidate layer whose confidence
max softmax(z^(ℓ)) ≥ γ_ℓ); the decoding runtime is :mod:`decoding.adadecode`.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from torch import nn

from core.config import override
from heads.base import DraftHead, Progress
from heads.registry import register
from losses.adadecode import kl_per_token
from losses.linear_soft_ce import linear_soft_cross_entropy, teacher_entropy

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "layers": [8, 15, 22],
    "layer_weights": None,
    "gamma": 0.85,
    "gamma_schedule": None,
    "gamma_slope": 0.0,
    "val_gammas": [0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95],
    "chunk_tokens": 4096,
    "max_inflight": 8,
}


def _check_cfg(cfg: dict[str, Any], num_layers: int | None) -> None:
    """Raise ValueError naming the first bad ``heads.*`` key (``num_layers`` = L if known)."""
    from heads.base import SHARED_KEYS

    unknown = sorted(set(cfg) - set(DEFAULTS) - {"type", "param_counts", *SHARED_KEYS})
    if unknown:
        raise ValueError(f"unknown heads keys {unknown}; valid: {sorted(DEFAULTS)}")
    def numbers(key, cast):  # a list of numbers (ints for layer ids), or ValueError naming the key
        value = cfg[key]
        ok = isinstance(value, Sequence) and not isinstance(value, str) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and (cast is float or float(v).is_integer())
            for v in value)
        if not ok:
            raise ValueError(f"heads.{key}={value!r} must be a list of {'numbers' if cast is float else 'integers'}")
        return [cast(v) for v in value]

    layers = numbers("layers", int)
    numbers("val_gammas", float)
    if not layers:
        raise ValueError("heads.layers is empty; give at least one candidate layer")
    if layers != sorted(set(layers)) or layers[0] < 1:
        raise ValueError(f"heads.layers={layers} must be strictly increasing layer ids >= 1")
    if num_layers is not None and layers[-1] >= num_layers:
        raise ValueError(f"heads.layers={layers} must lie in [1, {num_layers - 1}] "
                         f"(the base has L={num_layers} layers; ℓ = L is the final layer itself)")
    for key in ("layer_weights", "gamma_schedule"):
        if cfg[key] is not None:
            values = numbers(key, float)
            if len(values) != len(layers):
                raise ValueError(f"heads.{key} has {len(values)} entries but heads.layers={layers} has {len(layers)}")
            if any(v < 0 for v in values) or (key == "gamma_schedule" and any(v > 1 for v in values)):
                raise ValueError(f"heads.{key}={values} must all be "
                                 f"{'in [0, 1] (exit thresholds on a confidence)' if key == 'gamma_schedule' else '>= 0'}")
    if not 0 <= float(cfg["gamma"]) <= 1:  # a confidence never exceeds 1: above it no layer could ever exit
        raise ValueError(f"heads.gamma={cfg['gamma']} must lie in [0, 1] (an exit threshold on the head's confidence)")
    if int(cfg["chunk_tokens"]) < 1:
        raise ValueError(f"heads.chunk_tokens={cfg['chunk_tokens']} must be >= 1")
    if int(cfg["max_inflight"]) < 1:
        raise ValueError(f"heads.max_inflight={cfg['max_inflight']} must be >= 1")


def _gamma_key(g: float) -> str:
    return f"{float(g):g}"


@register
class AdaDecodeHead(DraftHead):
    """Per-layer lightweight LM heads z^(ℓ) = W·T_ℓ·RMSNorm_final(hs[ℓ]).

    Config keys (``configs/heads/adadecode.yaml``):
        layers: candidate layer ids ℓ (HF hidden-state index, 1 <= ℓ < L), strictly increasing.
        layer_weights: per-layer loss weights w_ℓ (list aligned with ``layers``) or null = all 1.
        gamma: early-exit threshold γ on the head's max probability (decode default 0.85).
        gamma_schedule: per-layer thresholds (list aligned with ``layers``) or null = the
            linear schedule below.
        gamma_slope: with no ``gamma_schedule``, the k-th of K candidate layers uses
            γ_k = min(1, max(0, gamma + gamma_slope·(k − (K−1)/2))) (0 = ``gamma`` everywhere; a
            confidence never exceeds 1, so γ is kept in [0, 1]).
        val_gammas: thresholds at which validation reports per-layer and policy metrics.
        chunk_tokens: tokens per chunk when computing [N, V] logits (bounds activation memory:
            a training chunk's gradients are taken in its forward, no logits are kept).
        max_inflight: decode-time cap on in-flight (not yet verified) tokens, see
            :mod:`decoding.adadecode`.

    Raises:
        ValueError: a config value is out of range (the message names the key).
    """

    head_type = "adadecode"
    monitor_metric = "loss"
    monitor_mode = "min"

    @staticmethod
    def check_config(cfg: dict[str, Any]) -> None:
        """Validate a ``heads`` section (plain dict) without the base; raises ValueError naming the key."""
        _check_cfg({**DEFAULTS, **dict(cfg)}, num_layers=None)

    def __init__(self, cfg: dict[str, Any], base_config) -> None:
        merged = {**DEFAULTS, **{k: v for k, v in dict(cfg).items() if k != "param_counts"}}
        super().__init__(merged, base_config)
        self.num_layers = int(base_config.num_hidden_layers)
        _check_cfg(merged, self.num_layers)
        layers = [int(x) for x in merged["layers"]]
        self.layers = layers
        self.layer_weights = self._per_layer(merged["layer_weights"], 1.0)
        self.gammas = self._per_layer(merged["gamma_schedule"], float(merged["gamma"]))
        if merged["gamma_schedule"] is None and float(merged["gamma_slope"]) != 0.0:
            mid = (len(layers) - 1) / 2
            self.gammas = {layer: min(1.0, max(0.0, float(merged["gamma"]) + float(merged["gamma_slope"]) * (k - mid)))
                           for k, layer in enumerate(layers)}
        self.val_gammas = [float(g) for g in merged["val_gammas"]]
        H = self.hidden_size
        self.transforms = nn.ModuleDict()
        for layer in layers:
            lin = nn.Linear(H, H, bias=False)
            with torch.no_grad():
                lin.weight.copy_(torch.eye(H))
            self.transforms[str(layer)] = lin
        self.cfg["param_counts"] = self.parameter_report()
        log.info("adadecode heads at layers %s: %s", layers, self.cfg["param_counts"])

    @property
    def required_cache_layers(self) -> list[int]:
        """The candidate exit layers: their hs[ℓ] must be in the cache (``prep.layers``)."""
        return list(self.layers)

    @classmethod
    def cache_layers_for(cls, cfg: dict[str, Any], num_layers: int) -> list[int]:
        """``heads.layers`` (default [8, 15, 22]); the base's depth does not change them."""
        return [int(x) for x in {**DEFAULTS, **dict(cfg)}["layers"]]

    def _per_layer(self, value, default: float) -> dict[int, float]:
        if value is None:
            return {layer: float(default) for layer in self.layers}
        return dict(zip(self.layers, [float(v) for v in value]))

    def parameter_report(self) -> dict[str, Any]:
        """Parameter counts: per head (H²), all heads, a full LM head (V·H) and the ratio."""
        per_head = self.hidden_size * self.hidden_size
        full = self.vocab_size * self.hidden_size
        return {"per_head": per_head, "num_heads": len(self.layers), "total": per_head * len(self.layers),
                "full_lm_head": full, "full_over_per_head": round(full / per_head, 2)}

    # -- the head ------------------------------------------------------------------------------
    def layer_features(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """T_ℓ·RMSNorm_final(h): h [..., H] (any float dtype) -> [..., H] float32, the input of W."""
        T = self.transforms[str(layer)]
        return T(self.final_norm(h.to(T.weight.dtype))).float()

    def layer_logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """z^(ℓ) = W·T_ℓ·RMSNorm_final(h): h [..., H] (any float dtype) -> logits [..., V] float32
        ([..., N] over the draft vocabulary: W = W[d2t])."""
        return self.draft_lm_head(self.layer_features(layer, h))

    def teacher_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-layer logits W·f_t from the cached post-norm hidden hs[L]: [..., H] -> [..., V] fp32.

        Over a draft vocabulary [..., N]: the KL teacher p* is restricted to the draft vocabulary
        and renormalised (the out-of-vocabulary rule of this head; it has no CE term)."""
        return self.draft_lm_head(hidden.float())

    def _gather(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor]:
        """Masked tokens only: hidden [N, H], {ℓ: [N, H]}, labels [N]."""
        aux = batch.get("aux_hidden") or {}
        aux = {int(k): v for k, v in aux.items()}
        for layer in self.layers:
            if layer not in aux:
                raise KeyError(
                    f"batch has no aux_hidden for candidate layer {layer} (cached layers: {sorted(aux)}); "
                    f"rebuild the cache with {override('prep.layers', self.layers)} or set heads.layers to cached layers"
                )
        mask = batch["loss_mask"].bool()
        hidden = batch["hidden"][mask]
        return hidden, {layer: aux[layer][mask] for layer in self.layers}, batch["labels"][mask]

    def _chunk_starts(self, n: int, device) -> range:
        """Start offsets of the ``chunk_tokens`` chunks over ``n`` tokens, agreed across ranks.

        Under ZeRO-3 every forward of the head's layers gathers their partitioned parameters with
        a collective, so every rank must run the same number of chunk forwards: a rank with fewer
        tokens than another runs its extra chunks empty (0 rows, KL 0).  Without a process group
        (or with one rank) this is just ``range(0, n, chunk_tokens)``."""
        step = int(self.cfg["chunk_tokens"])
        chunks = -(-n // step)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([chunks], dtype=torch.long, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            chunks = int(t.item())
        return range(0, chunks * step, step)

    def _chunk_stats(self, hidden: torch.Tensor, *aux: torch.Tensor, want_preds: bool = False):
        """KL per layer (sum over the chunk) and, if ``want_preds``, confidence / argmax per token.
        Everything in float32 with autocast off (METHODS §3.3: the KL in fp32)."""
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return self._chunk_stats_fp32(hidden, *aux, want_preds=want_preds)

    def _chunk_stats_fp32(self, hidden: torch.Tensor, *aux: torch.Tensor, want_preds: bool = False):
        t_logits = self.teacher_logits(hidden).detach()
        kls, confs, args = [], [], []
        for layer, h in zip(self.layers, aux):
            z = self.layer_logits(layer, h)
            kls.append(kl_per_token(t_logits, z).sum())
            if want_preds:
                conf, arg = torch.softmax(z, dim=-1).max(dim=-1)
                confs.append(conf)
                args.append(arg)
        if want_preds:
            return torch.stack(kls), torch.stack(confs), torch.stack(args), t_logits.argmax(-1)
        return torch.stack(kls)

    # -- training ------------------------------------------------------------------------------
    def _chunk_kl_fused(self, hidden: torch.Tensor, *aux: torch.Tensor) -> torch.Tensor:
        """[len(layers)] Σ_t KL(p*_t ‖ softmax(z^(ℓ)_t)) over a chunk, with gradients to T_ℓ.

        KL = CE(p*, z) − H(p*) (H constant: the teacher is frozen); the CE and its gradient through
        the frozen W come from :func:`losses.linear_soft_ce.linear_soft_cross_entropy`, which never
        holds a chunk's [n, V] student logits for the backward.  Equal to :meth:`_chunk_stats`' KL to
        float32 rounding, gradients included; fp32 with autocast off (METHODS §3.3)."""
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            probs, entropy = teacher_entropy(self.teacher_logits(hidden))
            w, h_sum = self.draft_lm_head_rows, entropy.sum()
            return torch.stack([linear_soft_cross_entropy(self.layer_features(layer, h), w, probs,
                                                          transform=self.logit_transform).loss - h_sum
                                for layer, h in zip(self.layers, aux)])

    def training_loss(self, batch: dict[str, Any], progress: Progress) -> tuple[torch.Tensor, dict[str, float]]:
        """Σ_ℓ w_ℓ masked-mean KL(p* ‖ softmax(z^(ℓ))) (METHODS §3.3), fp32, in chunks of
        ``chunk_tokens`` whose gradients are taken in the forward (:meth:`_chunk_kl_fused`).

        Returns ``(loss, {"kl_l<ℓ>": float, "num_tokens": float, "oov_rate": float})`` (``oov_rate``:
        share of masked tokens whose greedy label is outside the draft vocabulary).
        Raises KeyError naming a candidate layer missing from ``batch["aux_hidden"]``.
        """
        hidden, aux, labels = self._gather(batch)
        n = hidden.shape[0]
        kl_sum = hidden.new_zeros(len(self.layers), dtype=torch.float32)
        step = int(self.cfg["chunk_tokens"])
        for s in self._chunk_starts(n, hidden.device):
            args = (hidden[s:s + step], *[aux[layer][s:s + step] for layer in self.layers])
            kl_sum = kl_sum + (self._chunk_kl_fused(*args) if torch.is_grad_enabled() else self._chunk_stats(*args))
        per_layer = kl_sum / max(n, 1)
        w = torch.tensor([self.layer_weights[layer] for layer in self.layers], device=per_layer.device)
        loss = (w * per_layer).sum()
        if n == 0:  # keep the graph connected so every rank runs the same backward
            loss = loss + 0.0 * sum(p.sum() for p in self.parameters())
        metrics = {f"kl_l{layer}": float(per_layer[i].detach()) for i, layer in enumerate(self.layers)}
        metrics["num_tokens"] = float(n)
        metrics["oov_rate"] = float((self.to_draft_ids(labels) < 0).sum()) / max(n, 1)
        return loss, metrics

    # -- validation ----------------------------------------------------------------------------
    @torch.no_grad()
    def validation_metrics(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Exactly aggregable validation metrics: every value is a float32 tensor ``[sum, count]``
        (the metric is Σsum / Σcount over the held-out split).

        Over the masked (assistant) tokens, with ``final`` = the base model's argmax at the same
        position (``batch["labels"]``, the cached greedy label):

        * ``loss``: Σ_ℓ w_ℓ KL summed over tokens / M — the training loss on held-out data.
        * ``kl_l<ℓ>``, ``top1_l<ℓ>``: per-layer KL and agreement of the head argmax with ``final``.
        * ``exit_l<ℓ>_g<γ>``: share of tokens with head confidence (max prob) ≥ γ at layer ℓ.
        * ``mismatch_l<ℓ>_g<γ>``: among those, the share whose head argmax ≠ ``final``.
        * ``policy_g<γ>_{exit,reject,saved,cost}``: the decode policy "exit at the first candidate
          layer whose confidence ≥ γ" (e = that layer, or L if none): ``exit`` share of tokens
          exiting early, ``reject`` share of early exits that are wrong, ``saved`` mean (L−e)/L —
          the fraction of layer computations not on the sequential path, ``cost`` mean c/L with
          the sequential-step cost model c = L (no exit), e (correct exit: its upper layers run
          in parallel with the successor), e + L (wrong exit: the successor's L steps are wasted
          before verification rolls back).  1/cost ≈ the layer-step speedup.
        * ``exit_rate``, ``reject_rate``, ``layers_saved``, ``sim_cost`` (the sweep objective,
          minimise) and ``sim_layer_speedup`` ([L·M, Σc], i.e. L / mean cost): the same at the
          configured threshold schedule (``gamma`` / ``gamma_schedule``).
        """
        hidden, aux, labels = self._gather(batch)
        n = hidden.shape[0]
        dev = hidden.device
        nl = len(self.layers)
        kl_sum = torch.zeros(nl, device=dev)
        confs = torch.empty(nl, n, device=dev)
        args = torch.empty(nl, n, dtype=torch.long, device=dev)
        step = int(self.cfg["chunk_tokens"])
        for s in self._chunk_starts(n, dev):
            k, c, a, _ = self._chunk_stats(hidden[s:s + step], *[aux[layer][s:s + step] for layer in self.layers],
                                           want_preds=True)
            kl_sum += k
            confs[:, s:s + step] = c
            args[:, s:s + step] = self.to_base_ids(a)
        correct = args == labels.unsqueeze(0)  # [nl, n]; an out-of-vocabulary label is never matched
        M = torch.tensor(float(n), device=dev)

        def pair(s, c) -> torch.Tensor:
            return torch.stack([torch.as_tensor(s, device=dev, dtype=torch.float32).reshape(()),
                                torch.as_tensor(c, device=dev, dtype=torch.float32).reshape(())])

        w = torch.tensor([self.layer_weights[layer] for layer in self.layers], device=dev)
        out = {"loss": pair((w * kl_sum).sum(), M)}
        for i, layer in enumerate(self.layers):
            out[f"kl_l{layer}"] = pair(kl_sum[i], M)
            out[f"top1_l{layer}"] = pair(correct[i].sum(), M)
            for g in self.val_gammas:
                ex = confs[i] >= g
                out[f"exit_l{layer}_g{_gamma_key(g)}"] = pair(ex.sum(), M)
                out[f"mismatch_l{layer}_g{_gamma_key(g)}"] = pair((ex & ~correct[i]).sum(), ex.sum())
        for g in self.val_gammas:
            for name, v in self._policy(confs, correct, [g] * nl).items():
                out[f"policy_g{_gamma_key(g)}_{name}"] = v
        configured = self._policy(confs, correct, [self.gammas[layer] for layer in self.layers])
        out["exit_rate"] = configured["exit"]
        out["reject_rate"] = configured["reject"]
        out["layers_saved"] = configured["saved"]
        out["sim_cost"] = configured["cost"]
        out["sim_layer_speedup"] = pair(configured["cost"][1] * self.num_layers,
                                        configured["cost"][0] * self.num_layers)
        return out

    def _policy(self, confs: torch.Tensor, correct: torch.Tensor, gammas: Sequence[float]) -> dict[str, torch.Tensor]:
        """Simulate exit-at-first-confident-layer; see :meth:`validation_metrics` for the cost model."""
        nl, n = confs.shape
        dev = confs.device
        L = float(self.num_layers)
        thr = torch.tensor(list(gammas), device=dev).unsqueeze(1)
        confident = confs >= thr  # [nl, n]
        any_exit = confident.any(0)
        first = confident.float().argmax(0)  # index of the first confident layer (0 if none)
        layer_ids = torch.tensor(self.layers, device=dev, dtype=torch.float32)
        e = torch.where(any_exit, layer_ids[first], torch.full_like(layer_ids[first], L))
        ok = correct.gather(0, first.unsqueeze(0)).squeeze(0) & any_exit
        wrong = any_exit & ~ok
        cost = torch.where(any_exit, torch.where(ok, e, e + L), e)
        f = torch.float32
        return {
            "exit": torch.stack([any_exit.sum().to(f), torch.tensor(float(n), device=dev)]),
            "reject": torch.stack([wrong.sum().to(f), any_exit.sum().to(f)]),
            "saved": torch.stack([((L - e) / L).sum(), torch.tensor(float(n), device=dev)]),
            "cost": torch.stack([(cost / L).sum(), torch.tensor(float(n), device=dev)]),
        }

    # -- decoding ------------------------------------------------------------------------------
    def make_drafter(self, base_model, **kwargs):
        """The lossless adaptive layer-parallel decoder (:class:`decoding.adadecode.AdaDecodeDecoder`).

        Accepts every key of the ``eval`` section; uses ``eos_token_ids`` if given, and the
        optional overrides ``gamma`` / ``gamma_schedule`` / ``max_inflight`` (else the head config),
        and ``temperature`` / ``seed`` (τ > 0: lossless sampling, METHODS §3.4).
        """
        from decoding.adadecode import AdaDecodeDecoder

        return AdaDecodeDecoder(base_model, self, gamma=kwargs.get("gamma"),
                                gamma_schedule=kwargs.get("gamma_schedule"),
                                max_inflight=kwargs.get("max_inflight"),
                                eos_token_ids=kwargs.get("eos_token_ids"),
                                temperature=float(kwargs.get("temperature") or 0.0),
                                seed=int(kwargs.get("seed") or 0))
