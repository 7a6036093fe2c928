"""Falcon: the semi-autoregressive (SAR) draft head (arXiv 2412.12639; METHODS.md §1).

Slot t holds (f_t, x_{t+1}) and predicts the feature k steps ahead, f_{t+k}, hence the token
x_{t+k+1} = argmax W f̂_t (alignment table METHODS §1.1).  Architecture (§1.2):

    u_t = Fuse([Emb(x_{t+1}); f_t])                      (per position, no recurrence over time)
    f̂  = LlamaDecoderLayer^D(u) with the relaxed block-causal mask (block size k)
    logits = W f̂                                         (frozen LM head, no final norm)

``Fuse`` is EAGLE's ``Linear(2H→H)`` (``fuse: linear``) or Falcon's two-layer LSTM run per
position (``fuse: lstm``: [1, B·T, 2H] so every position is its own length-1 sequence, METHODS
§1.2 Rec.).  The first decoder layer has no input RMSNorm (EAGLE), and there is no final norm.
k = 1 without glancing is the EAGLE-1-style autoregressive drafter (the baseline).

Training uses CSGD (§1.4, Rec. for B > 1) with the λ schedule of ``heads.glancing``; the loss is
:func:`losses.falcon.falcon_loss`.  Decoding uses :class:`decoding.falcon.FalconDrafter`.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from decoding.masks import additive_mask, block_causal_mask
from heads.base import DraftHead, Progress
from heads.layer_config import draft_layer_config
from heads.registry import register
from losses.falcon import falcon_loss, falcon_loss_fused, glancing_positions, glancing_ratio

FUSE_TYPES = ("linear", "lstm")
NOISE_TYPES = ("uniform", "length_scaled", "none")

DEFAULTS: dict[str, Any] = {
    "block_size": 2,
    "num_layers": 2,
    "fuse": "linear",
    "lstm_layers": 2,
    "lstm_dropout": 0.1,
    "attn_implementation": "sdpa",
    "noise": {"type": "uniform", "scale": 0.1},
    "loss": {"alpha": 0.9, "omega": 0.1, "beta": 1.0},
    "glancing": {"enabled": True, "schedule": "linear", "unit": "step", "scale": 0.4, "offset": 0.0,
                 "glanced_in_loss": False},
    "ttt_steps": 1,
    "ttt_decay": 0.8,
    "decoding": {"passes": 4, "tree": {"node_children": None, "depth_children": [4, 2, 2, 1], "paths": None}},
}


def _merge(defaults: dict, given: dict) -> dict:
    out = copy.deepcopy(defaults)
    for key, value in (given or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "tree":  # a tree is replaced whole
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def check_falcon_config(c: dict[str, Any]) -> None:
    """Validate a (merged) Falcon ``heads`` section; raises ``ValueError`` naming the key."""
    def bad(key, msg):
        raise ValueError(f"heads.{key}: {msg}")

    if not isinstance(c["block_size"], int) or c["block_size"] < 1:
        bad("block_size", f"must be an int >= 1, got {c['block_size']!r}")
    if not isinstance(c["num_layers"], int) or c["num_layers"] < 1:
        bad("num_layers", f"must be an int >= 1, got {c['num_layers']!r}")
    if c["fuse"] not in FUSE_TYPES:
        bad("fuse", f"{c['fuse']!r}; choices: {', '.join(FUSE_TYPES)}")
    if c["fuse"] == "lstm":  # checked with the config, not by nn.LSTM once the base has loaded
        layers, dropout = c["lstm_layers"], c["lstm_dropout"]
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            bad("lstm_layers", f"must be an int >= 1 with fuse=lstm, got {layers!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            bad("lstm_dropout", f"must lie in [0, 1) with fuse=lstm, got {dropout!r}")
    if c["noise"]["type"] not in NOISE_TYPES:
        bad("noise.type", f"{c['noise']['type']!r}; choices: {', '.join(NOISE_TYPES)}")
    if not 0.0 <= float(c["loss"]["alpha"]) <= 1.0:
        bad("loss.alpha", f"must lie in [0, 1], got {c['loss']['alpha']}")
    if float(c["loss"]["omega"]) < 0:
        bad("loss.omega", f"must be >= 0, got {c['loss']['omega']}")
    g = c["glancing"]
    if g["enabled"] and c["block_size"] < 2:
        bad("glancing.enabled", "glancing needs block_size >= 2 (k=1 is the EAGLE-1 baseline: set glancing.enabled=false)")
    glancing_ratio(g, Progress())  # raises on unknown schedule / unit
    if not isinstance(g["glanced_in_loss"], bool):
        bad("glancing.glanced_in_loss", f"must be true or false, got {g['glanced_in_loss']!r}")
    steps = c["ttt_steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        bad("ttt_steps", f"must be an int >= 1 (1 = the paper's single-step training), got {steps!r}")
    if steps > 1 and (c["block_size"] != 1 or g["enabled"]):
        bad("ttt_steps", f"training-time test ({steps} steps) is offered for block_size=1 without glancing "
                         "(heads=falcon_k1) only")
    if not 0.0 < float(c["ttt_decay"]) <= 1.0:
        bad("ttt_decay", f"must lie in (0, 1], got {c['ttt_decay']!r}")
    if not isinstance(c["decoding"]["passes"], int) or c["decoding"]["passes"] < 1:
        bad("decoding.passes", f"must be an int >= 1, got {c['decoding']['passes']!r}")


@register
class FalconHead(DraftHead):
    """The Falcon SAR drafter (METHODS.md §1.2).

    Config (``configs/heads/falcon.yaml``): ``block_size`` k, ``num_layers`` D, ``fuse``
    (``linear``|``lstm``), ``lstm_layers``, ``lstm_dropout``, ``attn_implementation``, ``noise``
    (``type`` uniform|length_scaled|none, ``scale``), ``loss`` (``alpha``, ``omega``, ``beta``),
    ``glancing`` (``enabled``, ``schedule``, ``unit``, ``scale``, ``offset``, ``glanced_in_loss``; see
    :func:`losses.falcon.glancing_ratio`), ``decoding`` (``passes`` m, ``tree``; see
    :mod:`decoding.falcon`), ``ttt_steps`` / ``ttt_decay`` (k = 1 only: EAGLE-3's training-time
    test on Falcon's loss, :meth:`ttt_training_loss`; default 1 = the paper's recipe).

    Raises:
        ValueError: a bad config value (the message names the key).
    """

    head_type = "falcon"

    @staticmethod
    def check_config(cfg: dict[str, Any]) -> None:
        """Validate a ``heads`` section (plain dict) at compose, before any base loads
        (:func:`check_falcon_config`); raises ValueError naming the key.  The decoding tree is checked by
        ``evaluation.config_checks`` (which names a malformed ``paths`` value) and when the head is built."""
        check_falcon_config(_merge(DEFAULTS, dict(cfg)))

    def __init__(self, cfg: dict[str, Any], base_config) -> None:
        merged = _merge(DEFAULTS, dict(cfg))
        check_falcon_config(merged)
        super().__init__(merged, base_config)
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        from core.rope import RotaryEmbedding

        c = merged
        self.k = int(c["block_size"])
        from decoding.falcon import FalconTreeTemplate  # fail early on a malformed decoding tree

        FalconTreeTemplate.from_config(c["decoding"]["tree"], self.k, int(c["decoding"]["passes"]))
        H = self.hidden_size
        layer_cfg = draft_layer_config(base_config, c["attn_implementation"])
        self.layer_config = layer_cfg
        self.fuse_type = c["fuse"]
        if self.fuse_type == "linear":
            self.fc = nn.Linear(2 * H, H, bias=True)
        else:
            self.lstm = nn.LSTM(2 * H, H, num_layers=int(c["lstm_layers"]), dropout=float(c["lstm_dropout"]))
        self.layers = nn.ModuleList([LlamaDecoderLayer(layer_cfg, layer_idx=i) for i in range(int(c["num_layers"]))])
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE: no input norm on the first layer
        self.rotary_emb = RotaryEmbedding(layer_cfg)
        std = float(getattr(base_config, "initializer_range", 0.02))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    # -- model -----------------------------------------------------------------------------------
    @property
    def compute_dtype(self) -> torch.dtype:
        return self.layers[0].mlp.down_proj.weight.dtype

    def fuse(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """u = Fuse([Emb(tokens); feats]): feats [B,T,H], tokens [B,T] long → [B,T,H] (per position)."""
        dtype = self.compute_dtype
        x = torch.cat([self.embed(tokens).to(dtype), feats.to(dtype)], dim=-1)
        if self.fuse_type == "linear":
            return self.fc(x)
        B, T, _ = x.shape
        out, _ = self.lstm(x.reshape(1, B * T, x.shape[-1]))  # T·B independent length-1 sequences
        return out.reshape(B, T, -1)

    def logits_fp32(self, h: torch.Tensor) -> torch.Tensor:
        """W h in fp32 with autocast off over the draft vocabulary, under the base's logit transform:
        h [..., H] → logits [..., N] float32 (N = ``draft_vocab_size``, or V; column i scores base token
        ``d2t[i]``)."""
        with torch.autocast(device_type=h.device.type, enabled=False):
            return self.logit_transform(h.float() @ self.draft_lm_head_rows.float().T)

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor, cache=None) -> torch.Tensor:
        """Drafter features f̂ [B,T,H] from feats [B,T,H], tokens [B,T] (x_{t+1} per slot t).

        Args:
            position_ids: [B, T] long RoPE positions.
            attention_mask: additive float [B or 1, 1, T, S] (S = cached + T keys) in the compute dtype.
            cache: optional KV store with ``update(k, v, layer_idx, **kw)`` (see decoding.falcon).
        """
        h = self.fuse(feats, tokens)
        pos_emb = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=attention_mask, position_ids=position_ids,
                      position_embeddings=pos_emb, cache=cache, use_cache=cache is not None)
        return h

    def forward_train(self, feats: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Full-sequence forward with the training block mask; positions 0..T−1.  → f̂ [B,T,H]."""
        B, T = tokens.shape
        mask = additive_mask(block_causal_mask(T, self.k, valid), self.compute_dtype)
        pos = torch.arange(T, device=tokens.device)[None].expand(B, T)
        return self.forward(feats, tokens, pos, mask)

    # -- data ------------------------------------------------------------------------------------
    def prepare_inputs(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Training tensors of METHODS.md §1.1 from a collated cache batch.

        Returns ``F_in`` f_t, ``X_in`` x_{t+1}, ``F_tgt`` f_{t+k}, ``G`` x_{t+k+1} (each [B,T(,H)],
        zero beyond the sequence), ``valid`` [B,T] bool (not padding), ``mask`` [B,T] bool:
        m_t = loss_mask[t+k] ∧ (t+k < length), i.e. the target feature sits on an assistant token
        (so m = 0 on the last k positions), and ``in_vocab`` [B,T] bool: the greedy label of the
        target, ``labels[t+k]`` = argmax W f_{t+k}, lies in the draft vocabulary (all True without
        one; with one the batch must hold ``labels``).
        """
        for key in ("input_ids", "hidden", "attention_mask", "loss_mask"):
            if key not in batch:
                raise KeyError(f"Falcon batch has no {key!r} (keys: {', '.join(batch)})")
        ids = batch["input_ids"]
        f = batch["hidden"].to(self.compute_dtype)
        valid = batch["attention_mask"].bool()
        lm = batch["loss_mask"].bool() & valid
        B, T = ids.shape
        k = self.k
        X_in = torch.zeros_like(ids)
        X_in[:, :-1] = ids[:, 1:]
        F_tgt = torch.zeros_like(f)
        G = torch.zeros_like(ids)
        mask = torch.zeros_like(lm)
        if T > k:
            F_tgt[:, : T - k] = f[:, k:]
            mask[:, : T - k] = lm[:, k:]
        if T > k + 1:
            G[:, : T - k - 1] = ids[:, k + 1:]
        in_vocab = torch.ones_like(lm)
        if self.draft_vocab_size is not None:
            if "labels" not in batch:
                raise KeyError("Falcon batch has no 'labels': a draft vocabulary needs them to find OOV targets")
            if T > k:
                in_vocab[:, : T - k] = self.to_draft_ids(batch["labels"][:, k:]) >= 0
        return {"F_in": f, "X_in": X_in, "F_tgt": F_tgt, "G": G, "valid": valid, "mask": mask, "in_vocab": in_vocab}

    def _noise(self, f: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        n = self.cfg["noise"]
        if n["type"] == "none" or float(n["scale"]) == 0.0:
            return f
        scale = float(n["scale"])
        if n["type"] == "length_scaled":  # EAGLE / Falcon [C]: U(±scale·512/T)
            scale = scale * 512.0 / max(int(valid.sum(-1).max()), 1)
        return f + (torch.rand_like(f) * 2.0 - 1.0) * scale

    def _loss_on(self, pred: torch.Tensor, inp: dict[str, torch.Tensor], mask: torch.Tensor,
                 teacher: torch.Tensor | None = None, teacher_ids: torch.Tensor | None = None):
        """Loss over the ``mask`` positions.  Out-of-vocabulary rule (draft vocabulary, issue 13):
        student and teacher logits are over the draft vocabulary, so the KL teacher is restricted
        to it and renormalised; a position whose greedy label is outside it leaves the CE term
        (``ce_mask``) and counts as a top-1 miss.

        ``teacher`` [M, N] float32 (M = ``mask.sum()``, rows in ``pred[mask]`` order) and its
        argmax ``teacher_ids`` [M] long may be passed when the caller already scored the target
        features W f_{t+k} (the glancing pass does): the frozen teacher is then not recomputed.
        """
        sel_pred = pred[mask]
        sel_tgt = inp["F_tgt"][mask]
        in_vocab = inp["in_vocab"][mask]
        if teacher is None:
            with torch.no_grad():  # frozen W, data features: the teacher carries no gradient
                teacher = self.logits_fp32(sel_tgt)
        if teacher_ids is None:
            teacher_ids = teacher.argmax(-1)
        loss, parts, student, student_ids = self._falcon_loss(sel_pred, sel_tgt, teacher, teacher_ids, in_vocab)
        hit = (student_ids == teacher_ids) & in_vocab  # [M] top-1 agreement per loss position
        acc = hit.float().mean() if sel_pred.shape[0] else sel_pred.new_zeros((), dtype=torch.float32)
        return loss, parts, acc, student, hit

    def _falcon_loss(self, sel_pred: torch.Tensor, sel_tgt: torch.Tensor, teacher: torch.Tensor,
                     teacher_ids: torch.Tensor, ce_mask: torch.Tensor | None):
        """``(loss, parts, student logits or None, student argmax [M])`` of ``heads.loss`` over rows.

        With gradients (training) and α > 0: :func:`losses.falcon.falcon_loss_fused`, which never
        forms the student logits (None); otherwise the logits W f̂ and :func:`losses.falcon.falcon_loss`.
        """
        L = self.cfg["loss"]
        coef = dict(alpha=float(L["alpha"]), omega=float(L["omega"]), beta=float(L["beta"]),
                    ce_mask=ce_mask, teacher_ids=teacher_ids)
        if torch.is_grad_enabled() and coef["alpha"] > 0:
            loss, parts, student_ids = falcon_loss_fused(sel_pred, sel_tgt, self.draft_lm_head_rows, teacher,
                                                         transform=self.logit_transform, **coef)
            return loss, parts, None, student_ids
        student = self.logits_fp32(sel_pred)
        loss, parts = falcon_loss(sel_pred, sel_tgt, student, teacher,
                                  torch.ones(sel_pred.shape[0], dtype=torch.bool, device=sel_pred.device), **coef)
        return loss, parts, student, student.detach().argmax(-1)

    # -- training --------------------------------------------------------------------------------
    def training_loss(self, batch: dict[str, Any], progress: Progress) -> tuple[torch.Tensor, dict[str, float]]:
        """Falcon loss with CSGD (METHODS.md §1.3, §1.4).  Returns ``(loss, metrics)``.

        Pass A (no grad, train mode) → per-row Hamming distance d_b between the drafter's argmax
        and the teacher argmax over the loss positions; R = :func:`glancing_positions` with
        λ = :func:`glancing_ratio`; coupled replacement F_in ← F_tgt, X_in ← G on R, and R leaves
        the loss mask (METHODS §1.4 Rec., as GLAT; ``glancing.glanced_in_loss: true`` keeps R in
        the loss, as the official code does); pass B with grad.  Noise goes on F_in before
        glancing (replaced slots get the clean ground truth).
        """
        if int(self.cfg["ttt_steps"]) > 1:
            return self.ttt_training_loss(batch)
        inp = self.prepare_inputs(batch)
        valid, mask = inp["valid"], inp["mask"]
        F_in = self._noise(inp["F_in"], valid) if self.training else inp["F_in"]
        X_in = inp["X_in"]
        metrics: dict[str, float] = {}
        g = self.cfg["glancing"]
        lam = glancing_ratio(g, progress) if g["enabled"] else 0.0
        glanced = 0
        teacher = teacher_ids = None
        if lam > 0 and bool(mask.any()):
            with torch.no_grad():
                pred_a = self.forward_train(F_in, X_in, valid)
                # the teacher W f_{t+k} is frozen and reads data features only, so pass A's scores
                # serve pass B's loss too (rows of R are dropped below): computed once per step
                teacher = self.logits_fp32(inp["F_tgt"][mask])  # [M, N]
                teacher_ids = teacher.argmax(-1)
                in_vocab = inp["in_vocab"][mask]
                wrong_m = ~in_vocab  # an out-of-vocabulary target is a miss whatever the student drafts,
                student = self.logits_fp32(pred_a[mask][in_vocab])  # so only in-vocabulary rows are scored
                wrong_m[in_vocab] = student.argmax(-1) != teacher_ids[in_vocab]
                wrong = torch.zeros_like(mask)
                wrong[mask] = wrong_m
                distance = wrong.sum(-1)
                del pred_a, student
            R, _ = glancing_positions(mask, distance, lam, self.k)
            F_in = torch.where(R[..., None], inp["F_tgt"], F_in)
            X_in = torch.where(R, inp["G"], X_in)
            if not g["glanced_in_loss"]:
                keep = ~R[mask]  # pass B's loss rows among pass A's (both in row-major mask order)
                teacher, teacher_ids = teacher[keep], teacher_ids[keep]
                mask = mask & ~R
            glanced = int(R.sum())
            metrics["hamming"] = float(distance.float().mean())
        pred = self.forward_train(F_in, X_in, valid)
        inp_b = dict(inp, F_in=F_in, X_in=X_in)
        loss, parts, acc, _, _ = self._loss_on(pred, inp_b, mask, teacher=teacher, teacher_ids=teacher_ids)
        if not bool(mask.any()):
            loss = loss + 0.0 * pred.sum()  # keep the graph connected (DDP) on an empty batch
        metrics.update({"loss": float(loss.detach()), "loss_reg": float(parts["reg"]), "kl": float(parts["kl"]),
                        "ce": float(parts["ce"]), "acc": float(acc), "glance_ratio": lam,
                        "glanced_tokens": float(glanced), "loss_tokens": float(mask.sum()),
                        "oov_rate": float((inp["mask"] & ~inp["in_vocab"]).sum()) / max(int(inp["mask"].sum()), 1)})
        return loss, metrics

    def ttt_training_loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """Falcon k = 1 trained with EAGLE-3's training-time test (``heads.ttt_steps`` S > 1).

        Step 0 is the ordinary single-step pass (noise on the true features f_t).  Step i feeds
        slot t its own step-(i−1) prediction f̂ (which estimates f_{t+i}) with the token
        x_{t+1+i} at RoPE position t+i, under the EAGLE-3 mask (:func:`losses.ttt.ttt_visibility`:
        the true-feature slots s ≤ t and the slot's own earlier steps; the keys of earlier steps
        come from a :class:`decoding.falcon.DraftKVCache`), and is scored by
        :func:`losses.falcon.falcon_loss` against f_{t+1+i} where m_{t+i}, with the single-step pass's
        out-of-vocabulary rule (a row whose greedy label is outside the draft vocabulary leaves the CE
        term and counts as a miss; :meth:`_loss_on`).  Loss = Σ_i
        ``ttt_decay``^i · L_i (arXiv 2503.01840 §3.2; EAGLE ``traineagle3``: 0.8^i).  Labelled
        as an option so an ablation can separate TTT from EAGLE-3's architecture; validation
        (``sim_tau``) stays the single-step teacher-forced pass.
        """
        from decoding.falcon import DraftKVCache
        from losses.ttt import shift_left, ttt_visibility

        inp = self.prepare_inputs(batch)
        valid, mask = inp["valid"], inp["mask"]
        feats = self._noise(inp["F_in"], valid) if self.training else inp["F_in"]
        B, T = mask.shape
        decay = float(self.cfg["ttt_decay"])
        cache = DraftKVCache()
        total = feats.new_zeros((), dtype=torch.float32)
        metrics: dict[str, float] = {}
        for i in range(int(self.cfg["ttt_steps"])):
            pos = (torch.arange(T, device=mask.device) + i)[None].expand(B, T)
            vis = additive_mask(ttt_visibility(T, i, valid)[:, None], self.compute_dtype)
            pred = self.forward(feats, shift_left(inp["X_in"], i, 0), pos, vis, cache=cache)
            m = shift_left(mask, i, False)
            tgt = shift_left(inp["F_tgt"], i, 0)
            sel_p, sel_t = pred[m], tgt[m]
            in_vocab = shift_left(inp["in_vocab"], i, False)[m]  # the out-of-vocabulary rule of _loss_on
            with torch.no_grad():
                teacher = self.logits_fp32(sel_t)
            teacher_ids = teacher.argmax(-1)
            loss_i, parts, _, student_ids = self._falcon_loss(sel_p, sel_t, teacher, teacher_ids, in_vocab)
            total = total + (decay ** i) * loss_i + 0.0 * pred.sum()
            hit = ((student_ids == teacher_ids) & in_vocab).float()
            metrics[f"loss_step{i}"] = float(loss_i.detach())
            metrics[f"acc_step{i}"] = float(hit.mean()) if hit.numel() else 0.0
            if i == 0:
                metrics.update(loss_reg=float(parts["reg"]), kl=float(parts["kl"]), ce=float(parts["ce"]),
                               acc=metrics["acc_step0"], loss_tokens=float(m.sum()))
            feats = pred
        metrics["loss"] = float(total.detach())
        return total, metrics

    # -- validation ------------------------------------------------------------------------------
    @torch.no_grad()
    def validation_metrics(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Validation loss parts, teacher-forced top-1 accuracy and ``sim_tau`` as ``(sum, count)`` pairs.

        ``loss``, ``loss_reg``, ``kl``, ``ce``, ``acc`` (top-1 agreement with the teacher argmax) are
        (Σ over loss positions, M); ``acc_slot<j>`` is ``acc`` over the positions of block slot j
        (position ≡ j mod k); ``sim_tau`` is (Σ τ over anchors, number of anchors), so the
        trainer's Σsum/Σcount is an exact mean over the whole split.

        ``sim_tau`` (simulated acceptance length, incl. the bonus token, METHODS §5.1): one
        teacher-forced forward with the training block mask (no noise, no glancing).  An anchor is
        every block start s (s ≡ 0 mod k) with m_s = 1; it plays the root block [s..s+k−1] of a
        decoding step whose bonus token is x_{s+k}.  Depth d = 1..m·k (m = ``decoding.passes``)
        is the prediction of slot s+d−1, exactly the slot/block that drafts depth d in
        :class:`decoding.falcon.FalconDrafter` (pass ⌈d/k⌉, slot (d−1) mod k); it is correct iff
        argmax W f̂_{s+d−1} equals the greedy label ``labels[s+d−1+k]`` and m_{s+d−1} = 1.
        τ(s) = 1 + the number of leading correct depths; ``sim_tau`` is the mean over anchors.
        Teacher forcing means that later passes read true features f (and the data tokens)
        instead of the drafter's own f̂ and drafted tokens, so it is an optimistic proxy of the
        chain acceptance of decoding.
        """
        inp = self.prepare_inputs(batch)
        valid, mask = inp["valid"], inp["mask"]
        pred = self.forward_train(inp["F_in"], inp["X_in"], valid)
        loss, parts, acc, student, hit = self._loss_on(pred, inp, mask)
        B, T = mask.shape
        k = self.k
        draft_tok = torch.zeros(B, T, dtype=torch.long, device=mask.device)
        draft_tok[mask] = self.to_base_ids(student.argmax(-1))  # an OOV label is never matched
        labels = batch.get("labels")
        if labels is None:
            raise KeyError("Falcon validation batch has no 'labels' (greedy labels, needed for sim_tau)")
        lab_shift = torch.full_like(labels, -1)
        if T > k:
            lab_shift[:, : T - k] = labels[:, k:]
        correct = mask & (draft_tok == lab_shift)
        depth = k * int(self.cfg["decoding"]["passes"])
        alive = torch.ones(B, T, dtype=torch.bool, device=mask.device)
        tau = torch.ones(B, T, dtype=torch.float32, device=mask.device)
        for j in range(depth):
            shifted = torch.zeros_like(correct)
            if T > j:
                shifted[:, : T - j] = correct[:, j:]
            alive = alive & shifted
            tau = tau + alive.float()
        anchors = mask & (torch.arange(T, device=mask.device) % k == 0)[None]
        n_anchor = anchors.sum()
        M = mask.sum().float()
        out = {"loss": (loss.detach().float() * M, M), "loss_reg": (parts["reg"] * M, M),
               "kl": (parts["kl"] * M, M), "ce": (parts["ce"] * M, M), "acc": (acc.detach().float() * M, M),
               "sim_tau": ((tau * anchors).sum(), n_anchor.float())}
        # top-1 agreement per block slot j (position ≡ j mod k): slot j predicts j + 1 steps past its
        # block's last known token, so slot k−1 is the semi-autoregressive (hardest) one
        top1 = torch.zeros(B, T, dtype=torch.bool, device=mask.device)
        top1[mask] = hit
        slot = torch.arange(T, device=mask.device) % k
        for j in range(k):
            in_slot = mask & (slot == j)[None]
            out[f"acc_slot{j}"] = ((top1 & in_slot).sum().float(), in_slot.sum().float())
        return out

    # -- decoding --------------------------------------------------------------------------------
    def make_drafter(self, base_model=None, **kwargs):
        """A :class:`decoding.falcon.FalconDrafter` with this head's tree and pass count.

        Optional kwargs ``falcon_passes`` / ``falcon_tree`` override ``decoding.passes`` /
        ``decoding.tree``; every other kwarg (the ``eval`` section) is ignored.
        """
        from decoding.falcon import FalconDrafter

        return FalconDrafter(self, passes=kwargs.get("falcon_passes"), tree=kwargs.get("falcon_tree"))

