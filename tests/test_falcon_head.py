"""Falcon head, loss and CSGD (METHODS.md §1.1–1.4): masks, glancing, λ schedules, loss values."""
from __future__ import annotations

import math

import pytest
import torch

from heads.base import Progress
from decoding.masks import block_causal_mask
from losses.falcon import falcon_loss, glancing_positions, glancing_ratio


@pytest.fixture(scope="module")
def base():
    from core.tiny import tiny_llama

    return tiny_llama(seed=0)


def _batch(base, B=3, T=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.bool)
    if B > 1:
        am[1, 15:] = False
    if B > 2:
        am[2, 11:] = False
    ids = ids.masked_fill(~am, 2)
    with torch.no_grad():
        hs = base(ids, attention_mask=am.long(), output_hidden_states=True).hidden_states[-1]
    lm = am.clone()
    lm[:, :4] = False
    return dict(input_ids=ids, hidden=hs, attention_mask=am, loss_mask=lm,
                labels=base.lm_head(hs).argmax(-1).masked_fill(~am, 0), lengths=am.sum(-1))


def _head(base, **cfg):
    from heads.registry import build

    return build({"type": "falcon", **cfg}, base)


# -- relaxed causal mask ------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
def test_block_mask_matches_bruteforce(k):
    T = 10
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, 7:] = False
    got = block_causal_mask(T, k, valid)
    want = torch.zeros(2, 1, T, T, dtype=torch.bool)
    for b in range(2):
        for i in range(T):
            for j in range(T):
                # same or earlier block (blocks aligned at 0), key not padding
                want[b, 0, i, j] = (j // k <= i // k) and bool(valid[b, j])
                assert bool(want[b, 0, i, j]) == (j <= (i // k + 1) * k - 1 and bool(valid[b, j]))
    assert torch.equal(got, want)
    if k == 1:
        assert torch.equal(got[0, 0], torch.tril(torch.ones(T, T, dtype=torch.bool)))


def test_drafter_output_respects_block_mask(base):
    """Changing a slot's inputs changes exactly the outputs of its own and later blocks."""
    head = _head(base, block_size=3).eval()
    b = _batch(base, B=1, T=12)
    f, x = b["hidden"], b["input_ids"]
    valid = torch.ones(1, 12, dtype=torch.bool)
    ref = head.forward_train(f, x, valid)
    f2 = f.clone()
    f2[0, 7] += 1.0  # block 2 = positions 6..8
    out = head.forward_train(f2, x, valid)
    changed = (out - ref).abs().amax(-1)[0] > 1e-6
    assert changed.tolist() == [False] * 6 + [True] * 6


# -- λ schedules ---------------------------------------------------------------------------------
def test_glancing_ratio_values():
    paper = {"schedule": "linear", "unit": "epoch", "scale": 0.4, "offset": 0.0}
    code = {"schedule": "linear", "unit": "epoch", "scale": 0.35, "offset": 0.1}
    assert glancing_ratio(paper, Progress(epoch=0, total_epochs=20)) == pytest.approx(0.4)
    assert glancing_ratio(paper, Progress(epoch=5, total_epochs=20)) == pytest.approx(0.4 * 15 / 20)
    assert glancing_ratio(paper, Progress(epoch=19, total_epochs=20)) == pytest.approx(0.02)
    assert glancing_ratio(code, Progress(epoch=0, total_epochs=20)) == pytest.approx(0.45)
    assert glancing_ratio(code, Progress(epoch=10, total_epochs=20)) == pytest.approx(0.275)
    assert glancing_ratio(code, Progress(epoch=20, total_epochs=20)) == pytest.approx(0.10)
    per_step = dict(code, unit="step")
    assert glancing_ratio(per_step, Progress(step=250, total_steps=1000, epoch=7, total_epochs=20)) == pytest.approx(
        0.35 * 0.75 + 0.1)
    assert glancing_ratio({"schedule": "constant", "offset": 0.3}, Progress(step=999, total_steps=1000)) == 0.3
    with pytest.raises(ValueError, match="schedule"):
        glancing_ratio({"schedule": "cosine"}, Progress())


# -- glancing positions --------------------------------------------------------------------------
@pytest.mark.parametrize("k", [2, 3])
def test_glancing_positions_count_and_placement(k):
    B, T = 4, 24
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 3:20] = True   # partial blocks at both ends
    mask[1, :] = True
    mask[2, 6:9] = True    # exactly one full block
    mask[3, 1:T] = True
    dist = torch.tensor([7, 30, 9, 0])
    lam = 0.45
    g = torch.Generator().manual_seed(1)
    R, n = glancing_positions(mask, dist, lam, k, generator=g)
    for b in range(B):
        cands = [s for s in range(0, T, k) if bool(mask[b, s:s + k].all()) and s + k <= T]
        want = min(math.floor(lam * int(dist[b])), len(cands))
        assert int(n[b]) == want
        starts = [s for s in range(0, T, k) if bool(R[b, s:s + k].any())]
        assert len(starts) == want
        for s in starts:
            assert s in cands
            blk = R[b, s:s + k].tolist()
            r = sum(blk)
            assert 1 <= r <= k - 1 and blk == [True] * r + [False] * (k - r)  # a prefix of the block
    assert not R[3].any()
    with pytest.raises(ValueError, match="k >= 2"):
        glancing_positions(mask, dist, lam, 1)


@pytest.mark.parametrize("in_loss", [False, True])
def test_glancing_is_coupled_and_leaves_loss(base, monkeypatch, in_loss):
    """CSGD (METHODS §1.4): per-row count, coupled replacement; glanced positions leave the loss
    unless ``glancing.glanced_in_loss`` (the official code's choice) keeps them."""
    import heads.falcon as hf

    head = _head(base, block_size=2, noise={"type": "none"}, glancing={"glanced_in_loss": in_loss}).train()
    b = _batch(base, B=3, T=20)
    seen = {}
    real_pos = hf.glancing_positions
    real_fwd = head.forward_train

    def spy_pos(mask, distance, ratio, k, generator=None):
        R, n = real_pos(mask, distance, ratio, k, generator)
        seen.update(R=R, n=n, distance=distance, mask=mask, ratio=ratio)
        return R, n

    calls = []

    def spy_fwd(feats, tokens, valid):
        calls.append((feats.clone(), tokens.clone()))
        return real_fwd(feats, tokens, valid)

    monkeypatch.setattr(hf, "glancing_positions", spy_pos)
    monkeypatch.setattr(head, "forward_train", spy_fwd)
    _, metrics = head.training_loss(b, Progress(epoch=0, total_epochs=1))
    R = seen["R"]
    assert seen["ratio"] == pytest.approx(0.4)
    assert R.any()
    inp = head.prepare_inputs(b)
    # pass A: Hamming distance per row between drafter argmax and teacher argmax over the loss mask
    with torch.no_grad():
        fa, xa = calls[0]
        pred = real_fwd(fa, xa, inp["valid"])
        d = ((head.lm_head(pred).argmax(-1) != head.lm_head(inp["F_tgt"]).argmax(-1)) & inp["mask"]).sum(-1)
    assert torch.equal(seen["distance"], d)
    assert torch.equal(seen["n"], torch.minimum(torch.floor(0.4 * d.double() + 1e-9).long(), seen["n"].new_tensor(
        [int(inp["mask"][i].view(-1, 2).all(-1).sum()) for i in range(3)])))
    fb, xb = calls[1]
    # coupled: token AND feature replaced by the ground truth on R, untouched elsewhere
    assert torch.equal(fb[R], inp["F_tgt"][R]) and torch.equal(xb[R], inp["G"][R])
    assert torch.equal(fb[~R], inp["F_in"][~R]) and torch.equal(xb[~R], inp["X_in"][~R])
    assert torch.equal(inp["G"][R], b["input_ids"][R.nonzero()[:, 0], R.nonzero()[:, 1] + 3])
    assert metrics["loss_tokens"] == float(inp["mask"].sum() - (0 if in_loss else R.sum()))
    assert metrics["glanced_tokens"] == float(R.sum())


def test_alignment_table(base):
    head = _head(base, block_size=2)
    b = _batch(base, B=2, T=12)
    inp = head.prepare_inputs(b)
    ids, f = b["input_ids"], b["hidden"]
    assert torch.equal(inp["X_in"][:, :11], ids[:, 1:])
    assert torch.equal(inp["F_tgt"][:, :10], f[:, 2:])
    assert torch.equal(inp["G"][:, :9], ids[:, 3:])
    want = torch.zeros(2, 12, dtype=torch.bool)
    want[:, :10] = b["loss_mask"][:, 2:]
    assert torch.equal(inp["mask"], want)
    assert not inp["mask"][:, -2:].any()


# -- loss ----------------------------------------------------------------------------------------
def test_falcon_loss_hand_computed():
    pred = torch.tensor([[0.0, 2.0], [1.0, 1.0], [5.0, 5.0]])
    tgt = torch.tensor([[0.5, 0.0], [1.0, 1.0], [0.0, 0.0]])
    zs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    zt = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    mask = torch.tensor([True, True, False])
    loss, parts = falcon_loss(pred, tgt, zs, zt, mask, alpha=0.9, omega=0.1)

    def sl1(a, b):
        d = abs(a - b)
        return 0.5 * d * d if d < 1 else d - 0.5

    def softmax(z):
        e = [math.exp(v) for v in z]
        return [v / sum(e) for v in e]

    reg = ((sl1(0, 0.5) + sl1(2, 0)) / 2 + 0.0) / 2  # (0.125+1.5)/2 = 0.8125 and 0; mean over 2
    kls, ces = [], []
    for t in range(2):
        p, q = softmax(zt[t].tolist()), softmax(zs[t].tolist())
        kls.append(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)))
        y = max(range(3), key=lambda v: zt[t, v].item())
        ces.append(-math.log(q[y]))
    kl, ce = sum(kls) / 2, sum(ces) / 2
    assert float(parts["reg"]) == pytest.approx(reg, abs=1e-6)
    assert float(parts["kl"]) == pytest.approx(kl, abs=1e-6)
    assert float(parts["ce"]) == pytest.approx(ce, abs=1e-6)
    assert float(loss) == pytest.approx(reg + 0.1 * (0.9 * kl + 0.1 * ce), abs=1e-6)


@pytest.mark.parametrize("alpha", [0.9, 0.3, 1.0])
@pytest.mark.parametrize("rows", [37, 0])
def test_fused_falcon_loss_equals_falcon_loss_and_its_gradient(alpha, rows):
    """falcon_loss_fused (no student logits) against falcon_loss over W f̂: loss, the three parts,
    the gradient to f̂ and the student argmax, with some rows out of the CE (ce_mask)."""
    from losses.falcon import falcon_loss_fused

    g = torch.Generator().manual_seed(7)
    H, N = 12, 40
    W = torch.randn(N, H, generator=g)
    pred = torch.randn(rows, H, generator=g)
    tgt = torch.randn(rows, H, generator=g)
    teacher = 2 * torch.randn(rows, H, generator=g) @ W.T
    keep = torch.arange(rows) % 4 != 1
    ids = teacher.argmax(-1)
    kw = dict(alpha=alpha, omega=0.1, beta=1.0, ce_mask=keep, teacher_ids=ids)
    p1, p2 = pred.clone().requires_grad_(), pred.clone().requires_grad_()
    loss, parts, student_ids = falcon_loss_fused(p1, tgt, W, teacher, **kw)
    ref, ref_parts = falcon_loss(p2, tgt, p2 @ W.T, teacher, torch.ones(rows, dtype=torch.bool), **kw)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for k in ("reg", "kl", "ce"):
        torch.testing.assert_close(parts[k], ref_parts[k], rtol=1e-5, atol=2e-6, msg=k)
    torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-4, atol=1e-7)
    assert torch.equal(student_ids, (pred @ W.T).argmax(-1))
    with pytest.raises(ValueError, match="alpha > 0"):
        falcon_loss_fused(pred, tgt, W, teacher, alpha=0.0)


def test_training_step_k1_baseline_and_grads(base):
    head = _head(base, block_size=1, glancing={"enabled": False}).train()
    loss, metrics = head.training_loss(_batch(base), Progress())
    loss.backward()
    assert metrics["glance_ratio"] == 0.0 and metrics["glanced_tokens"] == 0.0
    grads = [p.grad for p in head.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and any(float(g.abs().sum()) > 0 for g in grads)
    with pytest.raises(ValueError, match="glancing"):
        _head(base, block_size=1, glancing={"enabled": True})


@pytest.mark.parametrize("ttt_steps", [1, 2])
def test_batch_without_loss_positions_trains_to_zero_and_keeps_the_graph(base, ttt_steps):
    """An all-False loss mask (a rank's empty batch): loss 0, accuracy 0, and backward reaches
    every trainable parameter (DDP), on the fused training path and the TTT option."""
    head = _head(base, block_size=1, glancing={"enabled": False}, ttt_steps=ttt_steps).train()
    batch = _batch(base)
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    loss, metrics = head.training_loss(batch, Progress())
    loss.backward()
    assert float(loss) == 0.0 and metrics["acc"] == 0.0 and metrics["loss_tokens"] == 0.0
    assert all(p.grad is not None for p in head.parameters() if p.requires_grad)


def test_lstm_fuse_is_per_position(base):
    head = _head(base, fuse="lstm", lstm_dropout=0.0).eval()
    f = torch.randn(2, 5, 64)
    x = torch.randint(0, 300, (2, 5))
    u = head.fuse(f, x)
    u2 = head.fuse(f[:, 3:4], x[:, 3:4])  # no recurrence over time: one position alone gives the same
    assert torch.allclose(u[:, 3:4], u2, atol=1e-6)


# -- validation: sim_tau -------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2])
def test_sim_tau_bruteforce(base, k):
    head = _head(base, block_size=k, decoding={"passes": 2}, glancing={"enabled": k > 1}).eval()
    b = _batch(base, B=3, T=20)
    # make some predictions right: use labels equal to the head's own teacher-forced argmax on a few spots
    inp = head.prepare_inputs(b)
    with torch.no_grad():
        tok = head.lm_head(head.forward_train(inp["F_in"], inp["X_in"], inp["valid"])).argmax(-1)
    labels = b["labels"].clone()
    B, T = labels.shape
    g = torch.Generator().manual_seed(3)
    hit = torch.rand(B, T, generator=g) < 0.7
    for bb in range(B):
        for t in range(T - k):
            if hit[bb, t]:
                labels[bb, t + k] = tok[bb, t]
    b["labels"] = labels
    m = head.validation_metrics(b)
    taus = []
    for bb in range(B):
        for s in range(0, T, k):
            if not inp["mask"][bb, s]:
                continue
            tau = 1
            for d in range(1, 2 * k + 1):
                t = s + d - 1
                if t < T and inp["mask"][bb, t] and t + k < T and tok[bb, t] == labels[bb, t + k]:
                    tau += 1
                else:
                    break
            taus.append(tau)
    s_, c_ = m["sim_tau"]
    assert int(c_) == len(taus)
    assert float(s_) / float(c_) == pytest.approx(sum(taus) / len(taus))
    assert float(s_) / float(c_) > 1.0
    # per-slot top-1 agreement with the teacher, brute force over the loss positions
    with torch.no_grad():
        teacher = head.lm_head(inp["F_tgt"]).argmax(-1)
    for j in range(k):
        pos = [(bb, t) for bb in range(B) for t in range(T) if inp["mask"][bb, t] and t % k == j]
        hits = sum(int(tok[bb, t] == teacher[bb, t]) for bb, t in pos)
        assert (float(m[f"acc_slot{j}"][0]), float(m[f"acc_slot{j}"][1])) == (hits, len(pos))
    assert sum(float(m[f"acc_slot{j}"][1]) for j in range(k)) == float(m["acc"][1])


def test_save_load_roundtrip(base, tmp_path):
    import heads

    head = _head(base, block_size=3, fuse="lstm").eval()
    heads.save(head, tmp_path / "ck", {"source": "tiny", "vocab_size": base.config.vocab_size})
    head2, meta = heads.load(tmp_path / "ck", base_model=base)
    b = _batch(base, B=1, T=9)
    v = torch.ones(1, 9, dtype=torch.bool)
    head2.eval()
    assert torch.allclose(head.forward_train(b["hidden"], b["input_ids"], v),
                          head2.forward_train(b["hidden"], b["input_ids"], v), atol=1e-6)
    assert head2.k == 3 and meta["head"]["fuse"] == "lstm"
    assert not any(k.startswith(("embed_weight", "lm_head_weight", "base_norm")) for k in head.trainable_state_dict())


def test_config_files_compose():
    from core.config import compose

    for name, k, glance in (("falcon", 2, True), ("falcon_noglance", 2, False), ("falcon_k1", 1, False)):
        cfg = compose([f"heads={name}"])
        assert cfg.heads.type == "falcon" and cfg.heads.block_size == k and cfg.heads.glancing.enabled == glance


def test_attention_diagnostic_matches_bruteforce_layer0(base):
    """scripts/falcon_attention.py: layer 0's per-slot attention mass on the block's newest position,
    the query itself and older blocks equals a softmax recomputed by hand from q/k (RoPE, block mask)."""
    import sys
    from pathlib import Path

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from falcon_attention import attention_mass

    k = 2
    head = _head(base, block_size=k, num_layers=2).eval()
    with torch.no_grad():  # sharpen attention so that the masses are far from uniform
        head.layers[0].self_attn.q_proj.weight.mul_(40.0)
    b = _batch(base, B=3, T=20)
    out = attention_mass(head, [b])
    assert head.layer_config._attn_implementation == "sdpa"  # restored
    inp = head.prepare_inputs(b)
    B, T = inp["mask"].shape
    attn = head.layers[0].self_attn
    with torch.no_grad():
        h = head.fuse(inp["F_in"], inp["X_in"])
        pos = torch.arange(T)[None].expand(B, T)
        cos, sin = head.rotary_emb(h, pos)
        d = attn.head_dim
        q = attn.q_proj(h).view(B, T, -1, d).transpose(1, 2)
        kk = attn.k_proj(h).view(B, T, -1, d).transpose(1, 2)
        q, kk = apply_rotary_pos_emb(q, kk, cos, sin)
        kk = kk.repeat_interleave(q.shape[1] // kk.shape[1], dim=1)
        scores = (q @ kk.transpose(-1, -2)) * d ** -0.5
        visible = block_causal_mask(T, k, inp["valid"])
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).mean(1)  # [B, T, T]
    for j in range(k):
        rows = [(bb, t) for bb in range(B) for t in range(T) if inp["mask"][bb, t] and t % k == j]
        newest = sum(float(probs[bb, t, (t // k) * k + k - 1]) for bb, t in rows) / len(rows)
        own = sum(float(probs[bb, t, t]) for bb, t in rows) / len(rows)
        older = sum(float(probs[bb, t, : (t // k) * k].sum()) for bb, t in rows) / len(rows)
        flat = sum(1.0 / int(visible[bb, 0, t].sum()) for bb, t in rows) / len(rows)
        got = out["layer0"][f"slot{j}"]
        assert got["positions"] == len(rows)
        assert (got["newest"], got["self"], got["older"], got["uniform"]) == pytest.approx(
            (newest, own, older, flat), abs=1e-5)
    # slot 0 of a k=2 block sees older blocks, itself and its partner (the newest) and nothing else
    s0 = out["layer0"]["slot0"]
    assert s0["newest"] + s0["self"] + s0["older"] == pytest.approx(1.0, abs=1e-5)
    assert out["layer0"]["slot1"]["newest"] == out["layer0"]["slot1"]["self"]


@pytest.mark.parametrize("override, message", [
    ("heads.block_size=0", "heads.block_size: must be an int >= 1, got 0"),
    ("heads.fuse=gru", "heads.fuse: 'gru'; choices: linear, lstm"),
    ("heads.loss.alpha=2", r"heads.loss.alpha: must lie in \[0, 1\], got 2"),
    ("heads.decoding.passes=0", "heads.decoding.passes: must be an int >= 1, got 0"),
])
def test_a_bad_falcon_setting_is_refused_at_compose(override, message):
    """Falcon had no check_config, so these were refused by the head's constructor, after the base loaded."""
    from core.config import ConfigError, compose

    with pytest.raises(ConfigError, match=message):
        compose(["heads=falcon_k1", override])
