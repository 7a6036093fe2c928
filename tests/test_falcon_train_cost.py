"""Falcon's CSGD training step scores the frozen teacher once (issue 13 speed target): the loss,
metrics and gradients equal the two-pass computation that scored it in pass A and again in
pass B, and the LM head multiplies exactly the rows the step needs."""
from __future__ import annotations

import pytest
import torch

from heads.base import Progress
from losses.falcon import falcon_loss, glancing_positions, glancing_ratio
from tests.test_draft_vocab_heads import _batch, _build


def _reference_step(head, batch, progress):
    """The step as written before the teacher was shared: pass A scores student and teacher on
    every loss row, pass B scores both again on its own rows (same RNG order: noise, then R)."""
    inp = head.prepare_inputs(batch)
    valid, mask = inp["valid"], inp["mask"]
    F_in, X_in = head._noise(inp["F_in"], valid), inp["X_in"]
    g = head.cfg["glancing"]
    lam = glancing_ratio(g, progress)
    with torch.no_grad():
        pred_a = head.forward_train(F_in, X_in, valid)
        wrong = torch.zeros_like(mask)
        s = head.logits_fp32(pred_a[mask])
        t = head.logits_fp32(inp["F_tgt"][mask])
        wrong[mask] = (s.argmax(-1) != t.argmax(-1)) | ~inp["in_vocab"][mask]
        distance = wrong.sum(-1)
    R, _ = glancing_positions(mask, distance, lam, head.k)
    F_in = torch.where(R[..., None], inp["F_tgt"], F_in)
    X_in = torch.where(R, inp["G"], X_in)
    if not g["glanced_in_loss"]:
        mask = mask & ~R
    pred = head.forward_train(F_in, X_in, valid)
    sel_p, sel_t, iv = pred[mask], inp["F_tgt"][mask], inp["in_vocab"][mask]
    student, teacher = head.logits_fp32(sel_p), head.logits_fp32(sel_t)
    L = head.cfg["loss"]
    loss, parts = falcon_loss(sel_p, sel_t, student, teacher, torch.ones(sel_p.shape[0], dtype=torch.bool),
                              alpha=L["alpha"], omega=L["omega"], beta=L["beta"], ce_mask=iv)
    acc = ((student.argmax(-1) == teacher.argmax(-1)) & iv).float().mean()
    return loss, {"hamming": float(distance.float().mean()), "glanced_tokens": float(R.sum()),
                  "loss_tokens": float(mask.sum()), "kl": float(parts["kl"]), "ce": float(parts["ce"]),
                  "acc": float(acc)}


def _grads(head):
    return {n: p.grad.clone() for n, p in head.named_parameters() if p.requires_grad and p.grad is not None}


@pytest.mark.parametrize("size,glanced_in_loss", [(None, False), (160, False), (160, True)])
def test_csgd_step_equals_two_pass_reference(tiny_base, size, glanced_in_loss):
    base = tiny_base[0]
    V = base.config.vocab_size
    batch = _batch(base, B=3, T=24)
    # a draft vocabulary without a third of the batch's labels, so OOV rows take every branch
    counts = torch.bincount(batch["labels"][batch["loss_mask"]], minlength=V)
    counts = counts + torch.randint(0, 2, (V,), generator=torch.Generator().manual_seed(5))
    extra = {"glancing": {"enabled": True, "schedule": "constant", "offset": 0.5, "glanced_in_loss": glanced_in_loss}}
    if size is not None:
        extra["draft_vocab_size"] = size
    head = _build("falcon", base, counts if size else None, **extra).train()
    p = Progress(step=0, total_steps=10)
    torch.manual_seed(7)
    loss, metrics = head.training_loss(batch, p)
    loss.backward()
    got = _grads(head)
    head.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    ref_loss, ref = _reference_step(head, batch, p)
    ref_loss.backward()
    want = _grads(head)
    assert ref["glanced_tokens"] > 0 and ref["hamming"] > 0  # glancing really replaced slots
    if size is not None:
        assert metrics["oov_rate"] > 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for key, value in ref.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert sorted(got) == sorted(want) and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_csgd_step_scores_the_teacher_once(tiny_base):
    """LM-head rows per step: teacher M (once), student M_in-vocab (pass A), student M_B (pass B);
    the two-pass step also scored the OOV rows in pass A and the teacher again on M_B rows."""
    base = tiny_base[0]
    V = base.config.vocab_size
    batch = _batch(base, B=3, T=24)
    counts = torch.randint(0, 100, (V,), generator=torch.Generator().manual_seed(5))  # ~60 % of labels OOV
    head = _build("falcon", base, counts, draft_vocab_size=160,
                  glancing={"enabled": True, "schedule": "constant", "offset": 0.5}).train()
    rows = []
    scorer = head.logits_fp32

    def counting(h):
        rows.append(int(h.reshape(-1, h.shape[-1]).shape[0]))
        return scorer(h)

    head.logits_fp32 = counting
    import heads.falcon as falcon_module

    fused = falcon_module.falcon_loss_fused  # pass B scores the student inside the fused loss

    def counting_fused(pred_feat, *args, **kwargs):
        rows.append(int(pred_feat.shape[0]))
        return fused(pred_feat, *args, **kwargs)

    falcon_module.falcon_loss_fused = counting_fused
    try:
        _, metrics = head.training_loss(batch, Progress(step=0, total_steps=10))
    finally:
        falcon_module.falcon_loss_fused = fused
    inp = head.prepare_inputs(batch)
    M = int(inp["mask"].sum())
    in_vocab = int((inp["mask"] & inp["in_vocab"]).sum())
    assert in_vocab < M and metrics["glanced_tokens"] > 0
    assert sorted(rows) == sorted([M, in_vocab, int(metrics["loss_tokens"])])
