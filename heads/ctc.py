"""CTC-drafter head, non-autoregressive slot variant (METHODS.md §2, main variant §2.6).

Architecture (METHODS.md §0 "Draft decoder layer", §2.3, §2.6):

* context stream: u_τ = Linear_{2H→H}([Emb(x_{τ+1}); f_τ]) at RoPE position τ, where f_τ is
  the base's final post-norm hidden state at τ (cache key ``hidden``; it predicts x_{τ+1});
* S slot queries at anchor t: q_s = Linear_{2H→H}([Emb(x_{t+1}); f_t]) + e_s at positions
  t+1..t+S (x_{t+1} is the bonus token, the base's greedy output at t);
* one transformers ``LlamaDecoderLayer`` built from the base config, with its input RMSNorm
  replaced by Identity (EAGLE) and no final norm.  Context rows attend causally; the slots of
  anchor t attend to the context τ ≤ t and to all S slots of their own block (bidirectionally);
* slot output ĥ_s → Ẑ⁺_s = [W ĥ_s ; w_ε·ĥ_s + b_ε] ∈ R^{V+1} with W the frozen base LM head and
  the learned blank logit at index V (METHODS.md §2.4 "Rec.").

Labels (METHODS.md §2.6 "Labels", cache contract in docs/design.md): ``labels[τ]`` is the base's
argmax at τ, i.e. its prediction of x_{τ+1}.  At anchor t the bonus is x_{t+1} (= labels[t] under
``labels: regenerate``) and the targets are the next N greedy tokens after it,
ℓ_j = y_{t+j−1} = argmax W f_{t+j} = ``labels[t + j]``, j = 1..N.

Anchors: t is eligible when the bonus and every target are assistant tokens, i.e.
``loss_mask[t+1 .. t+N+1]`` are all True (so t+N+1 <= length−1).  Up to ``anchors_per_seq``
eligible anchors are drawn per sequence without replacement from a generator seeded by
(``anchor_seed``, conversation id, optimizer step) — deterministic given the seed, independent
of batch composition and rank; validation uses step −1, so its anchors are fixed.

Training packs the slot blocks after the context of each sequence, [u_0..u_{T−1}, block_1, ...,
block_A], with a 4-D additive mask and the positions above, so one layer call scores every
anchor.  Decoding (:class:`decoding.ctc.CTCDrafter`) uses the same positions with a KV cache.

Loss (``loss: ctc | ce``): :func:`losses.ctc.ctc_slot_loss` or :func:`losses.ctc.ce_slot_loss`
(slot j → ℓ_j for j ≤ N, blank for j > N).  Optional ``aux_weight`` c adds c·(L_v + 0.1·L_p) of
METHODS.md §2.4 on the context rows (ĥ_τ regresses f_{τ+1}; the layer is shared with the slots,
so it is a dense regulariser; 0 = the pure §2.6 objective).
"""
from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from decoding.masks import additive_mask
from heads.base import DraftHead, Progress
from heads.layer_config import draft_layer_config
from heads.registry import register

DEFAULTS: dict[str, Any] = {
    "slots": 6,  # S
    "targets": 3,  # N
    "loss": "ctc",  # ctc | ce
    "anchors_per_seq": 64,
    "val_anchors_per_seq": 64,
    "anchor_seed": 0,
    "aux_weight": 0.0,
    "topk": [10, 6, 4, 3, 2, 2],
    "max_nodes": 64,
    "max_alignments": 4096,
    "attn_implementation": "sdpa",
}


def _resolve_cfg(cfg: dict[str, Any]) -> dict[str, Any]:
    out = dict(DEFAULTS)
    out.update({k: v for k, v in cfg.items() if v is not None})
    s, n = int(out["slots"]), int(out["targets"])
    if n < 1 or s < 1:
        raise ValueError(f"heads.slots={s} and heads.targets={n} must be >= 1")
    if out["loss"] not in ("ctc", "ce"):
        raise ValueError(f"heads.loss={out['loss']!r}: expected 'ctc' or 'ce'")
    if out["loss"] == "ce" and s < n:
        raise ValueError(f"heads.loss=ce needs heads.slots >= heads.targets, got S={s}, N={n}")
    if out["loss"] == "ctc" and s < n:
        raise ValueError(f"heads.loss=ctc needs heads.slots >= heads.targets (S >= 2N-1 handles repeats), got S={s}, N={n}")
    if int(out["anchors_per_seq"]) < 1 or int(out["val_anchors_per_seq"]) < 1:
        raise ValueError("heads.anchors_per_seq and heads.val_anchors_per_seq must be >= 1")
    if float(out["aux_weight"]) < 0:
        raise ValueError(f"heads.aux_weight={out['aux_weight']} must be >= 0")
    topk = out["topk"]
    ks = [topk] if isinstance(topk, int) else list(topk)
    if not ks or any(not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"heads.topk={topk!r}: expected an int >= 1 or a non-empty list of them")
    if int(out["max_nodes"]) < 1:
        raise ValueError(f"heads.max_nodes={out['max_nodes']} must be >= 1")
    if out["attn_implementation"] not in ("eager", "sdpa"):
        raise ValueError(f"heads.attn_implementation={out['attn_implementation']!r}: expected eager or sdpa")
    return out


@register
class CTCHead(DraftHead):
    """Non-autoregressive CTC draft head (METHODS.md §2.6); see the module docstring.

    Config keys (``configs/heads/ctc.yaml``): ``slots`` S, ``targets`` N, ``loss`` (ctc|ce),
    ``anchors_per_seq``, ``val_anchors_per_seq``, ``anchor_seed``, ``aux_weight``, ``topk``
    (per-slot candidates), ``max_nodes`` (tree cap incl. root), ``max_alignments``,
    ``attn_implementation`` (eager|sdpa, for the head's own layer).

    Raises:
        ValueError: invalid hyperparameters (named by key).
    """

    head_type = "ctc"
    monitor_metric = "sim_tau"
    monitor_mode = "max"

    @staticmethod
    def check_config(cfg: dict[str, Any]) -> None:
        """Validate a ``heads`` section (plain dict); raises ValueError naming the key."""
        _resolve_cfg(cfg)

    def __init__(self, cfg: dict[str, Any], base_config) -> None:
        cfg = _resolve_cfg(cfg)
        super().__init__(cfg, base_config)
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        from core.rope import RotaryEmbedding

        self.num_slots = int(cfg["slots"])
        self.num_targets = int(cfg["targets"])
        h = self.hidden_size
        layer_cfg = draft_layer_config(base_config, cfg["attn_implementation"])
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.slot_fc = nn.Linear(2 * h, h, bias=True)
        self.slot_embed = nn.Parameter(torch.randn(self.num_slots, h) * float(getattr(base_config, "initializer_range", 0.02)))
        self.layer = LlamaDecoderLayer(layer_cfg, layer_idx=0)
        self.layer.input_layernorm = nn.Identity()  # EAGLE: no input norm on the first draft layer
        self.rotary = RotaryEmbedding(layer_cfg)
        self.blank = nn.Linear(h, 1, bias=True)  # w_ε·ĥ + b_ε
        nn.init.zeros_(self.blank.weight)
        nn.init.zeros_(self.blank.bias)

    # ------------------------------------------------------------------ building blocks
    def _dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def fuse(self, next_ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """Context rows u = Linear([Emb(x_{τ+1}); f_τ]): ids [...] long, feats [..., H] → [..., H]."""
        x = torch.cat([self.embed(next_ids).to(self._dtype()), feats.to(self._dtype())], dim=-1)
        return self.fc(x)

    def slot_inputs(self, bonus_ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """Slot queries q_s = Linear([Emb(x_{t+1}); f_t]) + e_s: ids [A], feats [A, H] → [A, S, H]."""
        x = torch.cat([self.embed(bonus_ids).to(self._dtype()), feats.to(self._dtype())], dim=-1)
        return self.slot_fc(x).unsqueeze(-2) + self.slot_embed.to(self._dtype())

    def run_layer(self, hidden: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, cache=None) -> torch.Tensor:
        """The draft decoder layer: hidden [B, Q, H], additive mask [B, 1, Q, K], positions [B, Q]."""
        cos_sin = self.rotary(hidden, position_ids)
        return self.layer(hidden, attention_mask=mask, position_ids=position_ids, cache=cache,
                          use_cache=cache is not None, position_embeddings=cos_sin)

    def slot_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Ẑ⁺ = [W ĥ ; w_ε·ĥ + b_ε]: h [..., H] → [..., V+1]; class V is the blank.

        With a draft vocabulary of N tokens W is the row slice W[d2t] and the result is
        [..., N+1] (class i < N scores base token ``d2t[i]``; the blank stays last)."""
        return torch.cat([self.draft_lm_head(h), self.blank(h)], dim=-1)

    # ------------------------------------------------------------------ anchors and packing
    @staticmethod
    def packed_visibility(anchors: torch.Tensor, valid: torch.Tensor, context_len: int, num_slots: int) -> torch.Tensor:
        """Training attention pattern of the packed sequence [context (T rows); A blocks of S slots].

        Args:
            anchors: [B, A] long anchor positions t.  valid: [B, A] bool (False = padding block).
            context_len: T.  num_slots: S.
        Returns:
            BoolTensor [B, Q, Q], Q = T + A·S, True = may attend: context rows are causal; the
            slots of anchor t see context τ <= t and every slot of their own block; padding
            blocks see only their own block.
        """
        b, a = anchors.shape
        t_len, s, dev = context_len, num_slots, anchors.device
        q = t_len + a * s
        vis = torch.zeros(b, q, q, dtype=torch.bool, device=dev)
        vis[:, :t_len, :t_len] = torch.ones(t_len, t_len, dtype=torch.bool, device=dev).tril()
        if a:
            ctx_vis = torch.arange(t_len, device=dev)[None, None, :] <= anchors[:, :, None]  # [B, A, T]
            vis[:, t_len:, :t_len] = (ctx_vis & valid[:, :, None]).repeat_interleave(s, dim=1)
            vis[:, t_len:, t_len:] = torch.block_diag(*[torch.ones(s, s, dtype=torch.bool, device=dev)] * a)
        return vis

    def eligible_anchors(self, loss_mask: torch.Tensor, length: int) -> torch.Tensor:
        """Anchors t with ``loss_mask[t+1..t+N+1]`` all True: loss_mask [T] bool → LongTensor [k]."""
        n = self.num_targets
        m = loss_mask[:length].bool()
        if length < n + 2:
            return torch.zeros(0, dtype=torch.long, device=m.device)
        win = m[1:].unfold(0, n + 1, 1).all(dim=-1)  # win[t] = all(m[t+1 .. t+N+1]), t = 0..length-N-2
        return win.nonzero().flatten()

    def sample_anchors(self, loss_mask: torch.Tensor, length: int, conv_id: str, step: int, count: int) -> torch.Tensor:
        """Up to ``count`` eligible anchors, sorted, drawn deterministically (see module docstring)."""
        cand = self.eligible_anchors(loss_mask, length)
        if cand.numel() <= count:
            return cand
        seed = zlib.crc32(f"{int(self.cfg['anchor_seed'])}|{conv_id}|{step}".encode())
        g = torch.Generator().manual_seed(seed)
        pick = torch.randperm(cand.numel(), generator=g)[:count]
        return cand[pick.to(cand.device)].sort().values

    def forward_batch(self, batch: dict[str, Any], step: int, anchors_per_seq: int) -> dict[str, Any]:
        """Run the packed layer over a cached batch.

        Returns a dict with ``slot_logits`` [A_tot, S, V+1] (N_d+1 with a draft vocabulary),
        ``targets`` [A_tot, N] long base ids, ``draft_targets`` [A_tot, N] long (draft indices,
        −1 outside the draft vocabulary; = ``targets`` without one),
        ``bonus`` [A_tot] long, ``anchor_index`` [A_tot, 2] long (batch row, t), ``context_out``
        [B, T, H] (layer output on the context rows), ``A`` the total number of anchors.
        """
        ids, hidden = batch["input_ids"], batch["hidden"]
        loss_mask, labels = batch["loss_mask"], batch["labels"]
        b, t_len = ids.shape
        lengths = batch.get("lengths")
        if lengths is None:
            lengths = batch["attention_mask"].sum(dim=1)
        conv_ids = batch.get("ids") or [str(i) for i in range(b)]
        s, n, dev = self.num_slots, self.num_targets, ids.device
        anchors = [self.sample_anchors(loss_mask[i], int(lengths[i]), conv_ids[i], step, anchors_per_seq) for i in range(b)]
        a_max = max([int(a.numel()) for a in anchors] + [0])
        # context rows: u_τ = fc([Emb(x_{τ+1}); f_τ]); the last position has no next token (pad 0).
        nxt = torch.cat([ids[:, 1:], torch.zeros(b, 1, dtype=ids.dtype, device=dev)], dim=1)
        ctx = self.fuse(nxt, hidden)  # [B, T, H]
        pos_ctx = torch.arange(t_len, device=dev)
        # slot rows
        a_idx = torch.zeros(b, a_max, dtype=torch.long, device=dev)
        valid = torch.zeros(b, a_max, dtype=torch.bool, device=dev)
        for i, a in enumerate(anchors):
            a_idx[i, : a.numel()] = a.to(dev)
            valid[i, : a.numel()] = True
        rows = torch.arange(b, device=dev)[:, None].expand(b, a_max)
        bonus = ids.gather(1, (a_idx + 1).clamp(max=t_len - 1))  # [B, A]
        anchor_feat = hidden[rows, a_idx]  # [B, A, H]
        slots = self.slot_inputs(bonus, anchor_feat)  # [B, A, S, H]
        x = torch.cat([ctx, slots.reshape(b, a_max * s, ctx.shape[-1])], dim=1)  # [B, Q, H]
        pos_slots = (a_idx[:, :, None] + 1 + torch.arange(s, device=dev)).reshape(b, a_max * s)
        position_ids = torch.cat([pos_ctx.expand(b, t_len), pos_slots], dim=1)
        vis = self.packed_visibility(a_idx, valid, t_len, s)
        mask = additive_mask(vis[:, None], x.dtype)
        out = self.run_layer(x, mask, position_ids)
        slot_out = out[:, t_len:].reshape(b, a_max, s, out.shape[-1])[valid]  # [A_tot, S, H]
        tgt_pos = a_idx[:, :, None] + torch.arange(1, n + 1, device=dev)  # labels[t+1..t+N]
        targets = labels.gather(1, tgt_pos.clamp(max=t_len - 1).reshape(b, -1)).reshape(b, a_max, n)[valid]
        return {
            "slot_logits": self.slot_logits(slot_out),
            "targets": targets,
            "draft_targets": self.to_draft_ids(targets),
            "bonus": bonus[valid],
            "anchor_index": torch.stack([rows[valid], a_idx[valid]], dim=-1),
            "context_out": out[:, :t_len],
            "A": int(valid.sum()),
        }

    # ------------------------------------------------------------------ objectives
    def _slot_loss(self, logits: torch.Tensor, targets: torch.Tensor):
        from losses.ctc import ce_slot_loss, ctc_slot_loss

        return (ctc_slot_loss if self.cfg["loss"] == "ctc" else ce_slot_loss)(logits, targets)

    def _aux_loss(self, batch: dict[str, Any], context_out: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """METHODS.md §2.4 L_v + 0.1·L_p on context rows: ĥ_τ vs f_{τ+1}, masked by loss_mask[τ+1]."""
        m = batch["loss_mask"][:, 1:].bool()  # target position τ+1 is an assistant token
        pred = context_out[:, :-1][m].float()  # [M, H]: only masked rows reach the V-wide head
        target = batch["hidden"][:, 1:][m].float()
        if pred.shape[0] == 0:
            zero = context_out.sum() * 0.0
            return zero, {"aux_v": 0.0, "aux_p": 0.0}
        l_v = F.smooth_l1_loss(pred, target, reduction="none").mean(-1).mean()
        # over the draft vocabulary: the teacher is restricted to it and renormalised (issue 13)
        teacher = torch.softmax(self.draft_lm_head(target), dim=-1)
        l_p = -(teacher * torch.log_softmax(self.draft_lm_head(pred), dim=-1)).sum(-1).mean()
        return l_v + 0.1 * l_p, {"aux_v": float(l_v.detach()), "aux_p": float(l_p.detach())}

    def training_loss(self, batch: dict[str, Any], progress: Progress) -> tuple[torch.Tensor, dict[str, float]]:
        """Slot loss (+ optional aux) on a cached batch.

        Returns ``(loss, metrics)``; metrics: ``slot_loss``, ``anchors`` (count in the batch),
        ``infeasible`` (anchors with no CTC alignment, zeroed by ``zero_infinity``), ``oov_rate``
        (share of targets outside the draft vocabulary; their rule is in :mod:`losses.ctc`), and
        the aux parts when ``aux_weight > 0``.
        """
        out = self.forward_batch(batch, progress.step, int(self.cfg["anchors_per_seq"]))
        loss, stats = self._slot_loss(out["slot_logits"], out["draft_targets"])
        dt = out["draft_targets"]
        metrics = {"slot_loss": float(loss.detach()), "anchors": float(stats["anchors"]),
                   "infeasible": float(stats["infeasible"]),
                   "oov_rate": float((dt < 0).sum()) / max(dt.numel(), 1)}
        w = float(self.cfg["aux_weight"])
        if w > 0:
            aux, aux_metrics = self._aux_loss(batch, out["context_out"])
            loss = loss + w * aux
            metrics.update(aux_metrics)
        return loss, metrics

    @torch.no_grad()
    def validation_metrics(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Validation loss and simulated acceptance length on fixed anchors.

        ``sim_tau``: per anchor, the verification tree is built by :func:`decoding.ctc.build_ctc_trees`
        (the decoding code path: top-k per slot → alignments → collapse → trie → cap) and walked
        against the greedy continuation ``labels[t+1], labels[t+2], ...`` (as far as it stays in
        the assistant region, ``loss_mask[t+j+1]``); τ = accepted draft tokens + 1 (bonus).

        Returns ``(sum, count)`` pairs (fp64 tensors of shape [2]; the trainer reports Σsum/Σcount
        over the split, i.e. exact per-anchor means): ``loss`` (the configured slot loss per
        feasible anchor, plus aux if weighted), ``sim_tau`` (τ, bonus included), ``infeasible`` (fraction
        of anchors with no CTC alignment), and ``anchors`` (mean anchors per batch).
        """
        from decoding.ctc import accepted_length, build_ctc_trees

        out = self.forward_batch(batch, -1, int(self.cfg["val_anchors_per_seq"]))
        loss, stats = self._slot_loss(out["slot_logits"], out["draft_targets"])
        if float(self.cfg["aux_weight"]) > 0:
            loss = loss + float(self.cfg["aux_weight"]) * self._aux_loss(batch, out["context_out"])[0]
        a = out["A"]
        pair = lambda total, count: torch.tensor([float(total), float(count)], dtype=torch.float64)  # noqa: E731
        if a == 0:
            return {"loss": pair(0, 0), "sim_tau": pair(0, 0), "infeasible": pair(0, 0), "anchors": pair(0, 1)}
        trees = build_ctc_trees(out["slot_logits"], out["bonus"].tolist(), self.cfg["topk"],
                                int(self.cfg["max_nodes"]), int(self.cfg["max_alignments"]),
                                d2t=self.d2t if self.draft_vocab_size is not None else None)
        labels = batch["labels"].cpu()
        lmask = batch["loss_mask"].cpu().bool()
        lengths = batch.get("lengths")
        lengths = (lengths if lengths is not None else batch["attention_mask"].sum(1)).cpu()
        taus = []
        for tree, (row, t) in zip(trees, out["anchor_index"].cpu().tolist()):
            greedy = []
            for j in range(1, tree.max_depth + 1):
                if t + j + 1 >= int(lengths[row]) or not bool(lmask[row, t + j + 1]):
                    break
                greedy.append(int(labels[row, t + j]))
            taus.append(accepted_length(tree, greedy) + 1)
        scored = max(a - int(stats["infeasible"]) - int(stats["oov_anchors"]), 1)  # anchors in the loss mean
        return {
            "loss": pair(float(loss) * scored, scored),
            "sim_tau": pair(sum(taus), a),
            "infeasible": pair(float(stats["infeasible"]), a),
            "anchors": pair(a, 1),
        }

    def make_drafter(self, base_model=None, **eval_cfg):
        """A :class:`decoding.ctc.CTCDrafter`; ``topk`` / ``max_nodes`` / ``max_alignments`` in
        ``eval_cfg`` (if given and not None) override the head config; other keys are ignored."""
        from decoding.ctc import CTCDrafter

        pick = lambda key: eval_cfg[key] if eval_cfg.get(key) is not None else self.cfg[key]  # noqa: E731
        topk = pick("topk")
        if not isinstance(topk, int):
            topk = [int(k) for k in topk]
        return CTCDrafter(self, topk, int(pick("max_nodes")), int(pick("max_alignments")))
