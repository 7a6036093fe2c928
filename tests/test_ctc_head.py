"""CTC head (heads/ctc.py): slot mask, training/decoding consistency, both losses train, checkpoints."""
from __future__ import annotations

import pytest
import torch

import heads
from heads.base import Progress
from heads.ctc import CTCHead


def _batch(model, b=2, t=36, prompt=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (b, t), generator=g)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    lengths = torch.tensor([t, t - 5][:b])
    am = torch.arange(t)[None] < lengths[:, None]
    lm = am & (torch.arange(t)[None] >= prompt)
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm, "labels": out.logits.argmax(-1) * am,
            "hidden": out.hidden_states[-1], "aux_hidden": {}, "lengths": lengths, "ids": [f"c{i}" for i in range(b)]}


def _head(base, **cfg):
    head = CTCHead({"type": "ctc", "attn_implementation": "eager", **cfg}, base.config)
    head.attach_base(base)
    return head


def test_packed_visibility_pattern():
    anchors = torch.tensor([[1, 3]])
    valid = torch.tensor([[True, False]])
    vis = CTCHead.packed_visibility(anchors, valid, context_len=4, num_slots=2)[0].int()
    expected = torch.tensor([
        # ctx0..ctx3   blk0   blk1
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 1, 0, 0],  # anchor t=1: context τ <= 1, its own two slots (bidirectional)
        [1, 1, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 1, 1],  # padding block: only itself
        [0, 0, 0, 0, 0, 0, 1, 1],
    ])
    assert torch.equal(vis, expected)


def test_anchor_selection_and_labels(tiny_base):
    base = tiny_base[0]
    head = _head(base, targets=3, anchors_per_seq=1000)
    batch = _batch(base)
    lm = batch["loss_mask"][1]
    cand = head.eligible_anchors(lm, int(batch["lengths"][1])).tolist()
    brute = [t for t in range(int(batch["lengths"][1])) if t + 4 < int(batch["lengths"][1]) and bool(lm[t + 1: t + 5].all())]
    assert cand == brute and cand[0] == 7  # bonus x_8 is the first assistant token
    out = head.forward_batch(batch, 0, 1000)
    for (row, t), tgt, bonus in zip(out["anchor_index"].tolist(), out["targets"].tolist(), out["bonus"].tolist()):
        assert tgt == batch["labels"][row, t + 1: t + 4].tolist()  # ℓ_j = labels[t+j]
        assert bonus == int(batch["input_ids"][row, t + 1])
    # deterministic given the seed, different across steps
    a1 = head.sample_anchors(lm, 31, "c1", step=5, count=4)
    assert torch.equal(a1, head.sample_anchors(lm, 31, "c1", step=5, count=4))
    assert not all(torch.equal(a1, head.sample_anchors(lm, 31, "c1", step=s, count=4)) for s in range(6, 12))


def test_slot_logits_match_incremental_drafter(tiny_base):
    """Training packing (4-D mask, positions t+1..t+S) == the decoding drafter's KV-cached forward."""
    base = tiny_base[0]
    head = _head(base, anchors_per_seq=5).eval()
    batch = _batch(base, b=1)
    out = head.forward_batch(batch, 0, 5)
    seen = []
    orig = head.slot_logits
    head.slot_logits = lambda h: seen.append(orig(h)) or seen[-1]  # record the drafter's logits
    drafter = head.make_drafter(base)
    ids, hid = batch["input_ids"][0], batch["hidden"][0]
    for k, (_, t) in enumerate(out["anchor_index"].tolist()):
        drafter.start(ids[: t - 2], hid[: t - 2])  # then two accepted tokens, exercising accept()
        drafter.draft(int(ids[t - 2]))
        drafter.accept(ids[t - 2: t + 1], hid[t - 2: t + 1])
        drafter.draft(int(ids[t + 1]))
        assert drafter.cache.get_seq_length() == t + 1  # context only; slot entries removed
        torch.testing.assert_close(seen[-1][0], out["slot_logits"][k], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("loss", ["ctc", "ce"])
def test_head_trains(tiny_base, loss):
    base = tiny_base[0]
    torch.manual_seed(0)
    head = _head(base, loss=loss, slots=4, targets=2, aux_weight=0.1 if loss == "ctc" else 0.0)
    batch = _batch(base, b=2, t=32)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-2)
    first = None
    tau0 = head.validation_metrics(batch)["sim_tau"]
    for step in range(30):
        value, metrics = head.training_loss(batch, Progress(step=0, total_steps=30))
        opt.zero_grad()
        value.backward()
        opt.step()
        first = first if first is not None else metrics["slot_loss"]
    assert metrics["slot_loss"] < 0.5 * first, (first, metrics)
    assert metrics["infeasible"] == 0 and metrics["anchors"] > 0
    if loss == "ctc":
        assert "aux_v" in metrics
    tau1 = head.validation_metrics(batch)["sim_tau"]
    tau0, tau1 = float(tau0[0] / tau0[1]), float(tau1[0] / tau1[1])
    assert 1.0 <= tau0 < 1.2 and tau1 > tau0 + 0.5 and tau1 <= 1 + 4, (tau0, tau1)  # 4 = S (max depth)


def test_checkpoint_roundtrip(tiny_base, tmp_path):
    base, _, identity = tiny_base
    head = _head(base, slots=5, targets=2)
    with torch.no_grad():
        head.blank.bias.fill_(0.3)
    heads.save(head, tmp_path / "ckpt", identity.to_dict())
    loaded, meta = heads.load(tmp_path / "ckpt", base_model=base)
    assert meta["head"]["slots"] == 5 and loaded.num_slots == 5
    batch = _batch(base, b=1)
    a = head.eval().forward_batch(batch, 0, 4)["slot_logits"]
    b = loaded.eval().forward_batch(batch, 0, 4)["slot_logits"]
    torch.testing.assert_close(a, b)


def test_config_errors(tiny_base):
    cfg = tiny_base[0].config
    with pytest.raises(ValueError, match="heads.loss"):
        CTCHead({"loss": "mse"}, cfg)
    with pytest.raises(ValueError, match="slots"):
        CTCHead({"loss": "ce", "slots": 2, "targets": 3}, cfg)


def test_batch_without_eligible_anchors(tiny_base):
    base = tiny_base[0]
    head = _head(base)
    batch = _batch(base, b=2, t=12)
    batch["loss_mask"][:] = False
    batch["loss_mask"][:, 9:] = True  # only 3 assistant tokens: no room for bonus + N=3 targets
    loss, metrics = head.training_loss(batch, Progress())
    loss.backward()
    assert float(loss.detach()) == 0.0 and metrics["anchors"] == 0
    val = head.validation_metrics(batch)
    assert val["sim_tau"].tolist() == [0.0, 0.0] and val["anchors"].tolist() == [0.0, 1.0]


def test_make_drafter_overrides_and_cap(tiny_base):
    base = tiny_base[0]
    head = _head(base).eval()
    d = head.make_drafter(base, topk=[4, 3], max_nodes=16, max_alignments=None, eos_token_ids=[2], num_prompts=3)
    assert d.topk == [4, 3, 3, 3, 3, 3] and d.max_nodes == 16 and d.max_alignments == 4096
    batch = _batch(base, b=1)
    d.start(batch["input_ids"][0, :10], batch["hidden"][0, :10])
    tree = d.draft(int(batch["input_ids"][0, 10]))
    assert tree.num_nodes == 16 and tree.root_token == int(batch["input_ids"][0, 10])


def test_aux_loss_hand_computed(tiny_base):
    """aux_weight > 0 adds c·(L_v + 0.1·L_p) (METHODS.md §2.4) on the context rows."""
    import torch.nn.functional as F

    base = tiny_base[0]
    head = _head(base, aux_weight=0.5)
    batch = _batch(base, b=1)
    out = head.forward_batch(batch, 0, 4)
    aux, parts = head._aux_loss(batch, out["context_out"])
    rows = [t for t in range(35) if bool(batch["loss_mask"][0, t + 1])]
    l_v = sum(F.smooth_l1_loss(out["context_out"][0, t], batch["hidden"][0, t + 1]) for t in rows) / len(rows)
    w = head.lm_head_weight
    l_p = sum(-(torch.softmax(w @ batch["hidden"][0, t + 1], -1) * torch.log_softmax(w @ out["context_out"][0, t], -1)).sum()
              for t in rows) / len(rows)
    torch.testing.assert_close(aux, l_v + 0.1 * l_p, rtol=1e-4, atol=1e-5)
    total, metrics = head.training_loss(batch, Progress())
    torch.testing.assert_close(total.detach(), torch.tensor(metrics["slot_loss"] + 0.5 * (metrics["aux_v"] + 0.1 * metrics["aux_p"])),
                               rtol=1e-4, atol=1e-4)
