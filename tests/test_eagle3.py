"""EAGLE-3 head: TTT mask and loss against hand-built references, dynamic-tree parity, training."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

LAYERS = [1, 2, 3]  # the tiny base has 4 layers: hs[1..3] are its intermediate states

from test_decoding_bookkeeping import bases64, varied  # noqa: E402,F401  (fp64 tiny bases, shared fixtures)


def _head(base, **cfg):
    """An eagle3 head whose fc/attention weights are large enough (std 0.3, not the 0.02 init) that
    attention is far from uniform, and whose draft LM head is scaled ×30 so the draft distribution
    is peaked: position (RoPE) and mask errors then move the losses well beyond the tolerance."""
    import heads

    head = heads.build({"type": "eagle3", "layers": LAYERS, **cfg}, base)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith(("fc.", "midlayer.self_attn.")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        head.trainable_lm_head.weight.mul_(30.0)
    return head


def _batch(base, lengths, mask_from=2, seed=0):
    """A padded batch from base forwards: ids, masks, greedy labels, hs[L] and hs[1..3]."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    L = base.config.num_hidden_layers
    H = base.config.hidden_size
    batch = {"input_ids": torch.zeros(B, T, dtype=torch.long), "attention_mask": torch.zeros(B, T, dtype=torch.bool),
             "loss_mask": torch.zeros(B, T, dtype=torch.bool), "labels": torch.zeros(B, T, dtype=torch.long),
             "hidden": torch.zeros(B, T, H), "aux_hidden": {l: torch.zeros(B, T, H) for l in LAYERS}}
    for b, n in enumerate(lengths):
        ids = torch.randint(3, 300, (1, n), generator=g)
        with torch.no_grad():
            o = base(input_ids=ids, output_hidden_states=True)
        batch["input_ids"][b, :n] = ids[0]
        batch["attention_mask"][b, :n] = True
        batch["loss_mask"][b, mask_from:n] = True
        batch["labels"][b, :n] = o.logits[0].argmax(-1)
        batch["hidden"][b, :n] = o.hidden_states[L][0]
        for l in LAYERS:
            batch["aux_hidden"][l][b, :n] = o.hidden_states[l][0]
    return batch


def _causal(head, feats, toks):
    """Fresh causal forward of slots (feats [n,H], toks [n]) at positions 0..n−1 → outputs [n, H]."""
    from decoding.falcon import DraftKVCache
    from decoding.masks import additive_mask

    n = toks.numel()
    vis = torch.ones(n, n, dtype=torch.bool).tril()
    return head.forward_cached(feats[None], toks[None], torch.arange(n)[None],
                               additive_mask(vis, head.compute_dtype)[None, None], DraftKVCache())[0]


def _soft_ce(head, h, hidden_next):
    logq = F.log_softmax(head.draft_logits(h), -1)
    p = F.softmax(hidden_next.float() @ head.lm_head_weight.float().T, -1)
    return float(-(p * logq).sum().detach())


# -- mask ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("step", [0, 1, 3])
def test_ttt_visibility_matches_brute_force(step):
    from losses.ttt import ttt_visibility

    T = 6
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    got = ttt_visibility(T, step, valid)
    assert got.shape == (2, T, (step + 1) * T)
    for b in range(2):
        for t in range(T):
            for j in range(step + 1):
                for s in range(T):
                    want = (s <= t and bool(valid[b, s])) if j == 0 else (s == t)
                    assert bool(got[b, t, j * T + s]) == want, (b, t, j, s)


def test_ttt_attention_equals_dense_attention_under_the_mask(tiny_base):
    """The vectorised TTT attention (causal step-0 scores + diagonals) = softmax over all steps'
    keys with :func:`ttt_visibility`, at step 2, with padding and grouped-query heads."""
    from losses.ttt import ttt_visibility

    head = _head(tiny_base[0])
    attn = head.midlayer.self_attn
    B, T, H = 2, 7, head.hidden_size
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 5:] = False
    first = (torch.ones(T, T, dtype=torch.bool).tril()[None] & valid[:, None, :])[:, None]
    past, xs, rope = [], [], []
    for i in range(3):
        x = torch.randn(B, T, 2 * H)
        cos, sin = head.rotary_emb(x, (torch.arange(T) + i)[None].expand(B, T))
        out, kv = attn.forward_ttt(x, cos, sin, past, first)
        past.append(kv)
        xs.append(x); rope.append((cos, sin))
    q, _, _ = attn.project(xs[2], *rope[2])
    K = torch.cat([attn._expand(k) for k, _ in past], dim=2)
    V = torch.cat([attn._expand(v) for _, v in past], dim=2)
    s = (q @ K.transpose(-1, -2)) / attn.head_dim ** 0.5
    s = s.masked_fill(~ttt_visibility(T, 2, valid)[:, None], float("-inf"))
    want = attn._out(torch.softmax(s, -1) @ V)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# -- loss ------------------------------------------------------------------------------------------
def test_ttt_one_step_equals_single_step_loss(tiny_base):
    """ttt_steps=1 is the plain EAGLE next-token loss: one causal forward, soft CE at t+1."""
    from heads import Progress

    base = tiny_base[0]
    head = _head(base, ttt_steps=1)
    batch = _batch(base, [9, 6])
    loss, metrics = head.training_loss(batch, Progress())
    ces = []
    for b, n in enumerate([9, 6]):
        ids = batch["input_ids"][b, :n]
        aux = torch.cat([batch["aux_hidden"][l][b, :n] for l in LAYERS], -1)
        out = _causal(head, head.fuse(aux), torch.cat([ids[1:], ids[:1]]))  # slot n−1's token is never scored
        for t in range(n - 1):
            if batch["loss_mask"][b, t + 1]:
                ces.append(_soft_ce(head, out[t], batch["hidden"][b, t + 1]))
    assert metrics["loss_tokens"] == len(ces)
    assert float(loss.detach()) == pytest.approx(sum(ces) / len(ces), rel=1e-5)
    three = _head(base, ttt_steps=3)
    three.load_state_dict(head.state_dict())
    assert three.training_loss(batch, Progress())[1]["loss_step0"] == pytest.approx(float(loss), rel=1e-5)


def test_ttt_two_steps_equals_hand_unrolled_reference(tiny_base):
    """Step 1 of slot t = a causal forward over the true slots 0..t plus the slot (h0_t, x_{t+2})
    at position t+1 — what a depth-2 draft sees at decoding time; loss = CE0 + 0.8·CE1."""
    from heads import Progress

    base = tiny_base[0]
    head = _head(base, ttt_steps=2, ttt_decay=0.8)
    lengths = [10, 7]
    batch = _batch(base, lengths)
    loss, metrics = head.training_loss(batch, Progress())
    ce0, ce1 = [], []
    for b, n in enumerate(lengths):
        ids = batch["input_ids"][b, :n]
        g = head.fuse(torch.cat([batch["aux_hidden"][l][b, :n] for l in LAYERS], -1))
        h0 = _causal(head, g, torch.cat([ids[1:], ids[:1]]))
        for t in range(n - 1):
            if batch["loss_mask"][b, t + 1]:
                ce0.append(_soft_ce(head, h0[t], batch["hidden"][b, t + 1]))
            if t + 2 < n and batch["loss_mask"][b, t + 2]:
                feats = torch.cat([g[: t + 1], h0[t][None]])
                toks = torch.cat([ids[1: t + 2], ids[t + 2: t + 3]])
                h1 = _causal(head, feats, toks)[-1]
                ce1.append(_soft_ce(head, h1, batch["hidden"][b, t + 2]))
    want = sum(ce0) / len(ce0) + 0.8 * sum(ce1) / len(ce1)
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert metrics["loss_step1"] == pytest.approx(sum(ce1) / len(ce1), rel=1e-5)


def test_soft_cross_entropy_equals_log_softmax_form_value_and_gradient():
    """The fused soft CE (logsumexp(z) − p·z, gradient softmax(z) − p) against the textbook
    −Σ p log softmax(z) and its autograd gradient, with peaked rows where a sign or scale error shows."""
    from losses.eagle3 import soft_cross_entropy

    g = torch.Generator().manual_seed(0)
    z = (torch.randn(7, 50, generator=g, dtype=torch.float64) * 6).requires_grad_()
    p = torch.softmax(torch.randn(7, 50, generator=g, dtype=torch.float64) * 4, -1)
    w = torch.rand(7, generator=g, dtype=torch.float64)
    got = soft_cross_entropy(z, p)
    want = -(p * torch.log_softmax(z, -1)).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (gz,) = torch.autograd.grad((got * w).sum(), z)
    (wz,) = torch.autograd.grad((want * w).sum(), z)
    torch.testing.assert_close(gz, wz, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: soft_cross_entropy(x, p), (z,))
    with pytest.raises(ValueError, match="do not match"):
        soft_cross_entropy(z, p[:, :49])


@pytest.mark.parametrize("zero3", [False, True])
def test_fused_lm_head_gradients_equal_autograd_through_the_logits(tiny_base, zero3):
    """training_loss's soft CE through DraftLMHead(x, probs) (gradients taken in the forward, or the
    autograd path for a ZeRO-3 partitioned weight) equals ttt_loss over draft_logits: loss, every
    parameter's gradient and the per-step accuracy."""
    from heads import Progress
    from losses.eagle3 import ttt_loss

    base = tiny_base[0]
    head = _head(base, ttt_steps=3)
    if zero3:
        head.trainable_lm_head.weight.ds_id = 0  # what DeepSpeed ZeRO-3 marks its parameters with
    batch = _batch(base, [11, 8], mask_from=1)
    loss, metrics = head.training_loss(batch, Progress())
    loss.backward()
    fused = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
    head.zero_grad(set_to_none=True)
    lm = batch["loss_mask"] & batch["attention_mask"]
    steps = head.ttt_forward(head._features(batch), batch["input_ids"], batch["attention_mask"])
    masks = head._run(batch)[1]
    logits = [head.draft_logits(h[m]) for h, m in zip(steps, masks)]
    ref, _ = ttt_loss(logits, [t[0] for t in head._targets(batch, lm, masks)], 0.8)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert set(fused) == {n for n, p in head.named_parameters() if p.grad is not None}
    for n, p in head.named_parameters():
        torch.testing.assert_close(fused[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    assert float(fused["trainable_lm_head.weight"].abs().max()) > 0
    for i, (lg, m) in enumerate(zip(logits, masks)):
        acc = float((head.to_base_ids(lg.argmax(-1)) == batch["labels"][m]).float().mean())
        assert metrics[f"acc_step{i}"] == pytest.approx(acc)


def test_greedy_target_and_validation_metrics(tiny_base):
    base = tiny_base[0]
    head = _head(base, ttt_steps=3, loss={"target": "greedy"})
    batch = _batch(base, [12, 8])
    v = head.validation_metrics(batch)
    assert float(v["sim_tau"][1]) == float(v["acc_step0"][1]) > 0
    assert 1.0 <= float(v["sim_tau"][0] / v["sim_tau"][1]) <= 4.0
    # an oracle LM head (the base's own final norm + LM head, identity layer) would need base features;
    # here: greedy CE = −log q(label) at step 0, checked on one position by hand
    from heads import Progress

    loss, m = head.training_loss(batch, Progress())
    assert loss.requires_grad and m["loss_tokens"] == float(batch["loss_mask"][:, 1:].sum())


# -- draft vocabulary (issue 13's shared mechanism) ---------------------------------------------------
def _vocab_head(base, ids, seed=0, **cfg):
    """An eagle3 head over the draft vocabulary ``ids`` (sorted base ids) through the config route
    (``heads.draft_vocab_size`` + label counts whose top |ids| are ``ids``), weights from ``seed``."""
    import heads

    counts = torch.zeros(base.config.vocab_size, dtype=torch.int64)
    counts[ids] = torch.arange(ids.numel(), 0, -1) + 10
    torch.manual_seed(seed)
    return heads.build({"type": "eagle3", "layers": LAYERS, "draft_vocab_size": ids.numel(), **cfg}, base,
                       label_counts=counts, counts_source="test")


@pytest.mark.parametrize("steps,mask_from", [(2, 2), (4, 1)])
@pytest.mark.parametrize("target", ["soft", "greedy"])
def test_reduced_draft_vocabulary_loss_rule(tiny_base, target, steps, mask_from):
    """Issue 13's rule: a greedy label outside the draft vocabulary leaves the greedy CE; the soft
    teacher is the base's softmax restricted to W[d2t] and renormalised, over EVERY loss position.
    Brute force per position from the head's own TTT outputs; also oov_rate and the W[d2t] init.
    With loss positions from 1 and 4 steps, later steps score fewer rows than the teacher holds
    (positions p < 1+i have no slot t = p−1−i): the row selection of ``_targets``."""
    from heads import Progress

    base = tiny_base[0]
    ids = torch.arange(3, base.config.vocab_size, 3)  # every third id: many greedy labels fall outside
    head = _vocab_head(base, ids, ttt_steps=steps, loss={"target": target})
    torch.testing.assert_close(head.trainable_lm_head.weight, base.get_output_embeddings().weight[ids])
    assert torch.equal(head.to_base_ids(torch.arange(ids.numel())), ids)
    batch = _batch(base, [12, 9], mask_from=mask_from)
    loss, m = head.training_loss(batch, Progress())
    W = base.get_output_embeddings().weight[ids]
    index = {int(t): d for d, t in enumerate(ids)}
    outs = head.ttt_forward(head._features(batch), batch["input_ids"], batch["attention_mask"].bool())
    per_step, oov, n0 = [], 0, 0
    for i, h in enumerate(outs):
        ces = []
        for b in range(2):
            for t in range(batch["input_ids"].shape[1] - 1 - i):
                p = t + 1 + i
                if not (batch["loss_mask"][b, p] and batch["attention_mask"][b, p]):
                    continue
                logq = torch.log_softmax(head.draft_logits(h[b, t]), -1)
                label = int(batch["labels"][b, p])
                if i == 0:
                    n0 += 1
                    oov += label not in index
                if target == "greedy":
                    if label in index:
                        ces.append(-float(logq[index[label]]))
                else:
                    teacher = torch.softmax(batch["hidden"][b, p] @ W.T, -1)
                    ces.append(-float((teacher * logq).sum()))
        per_step.append(sum(ces) / len(ces))
    assert 0 < oov < n0
    assert m["oov_rate"] == pytest.approx(oov / n0)
    for i in range(steps):
        assert m[f"loss_step{i}"] == pytest.approx(per_step[i], rel=1e-5)
    assert float(loss) == pytest.approx(sum(0.8 ** i * c for i, c in enumerate(per_step)), rel=1e-5)
    v = head.validation_metrics(batch)
    assert float(v["oov_rate"][0]) == oov and float(v["oov_rate"][1]) == n0 == float(v["sim_tau"][1])
    # an OOV label is a miss: acc_step0 hits ≤ in-vocabulary positions
    assert float(v["acc_step0"][0]) <= n0 - oov


def test_full_size_draft_vocabulary_equals_null(tiny_base):
    """heads.draft_vocab_size = V (d2t = arange(V)) trains, validates and drafts exactly as null."""
    import heads
    from heads import Progress

    base = tiny_base[0]
    V = base.config.vocab_size
    full = _vocab_head(base, torch.arange(V), seed=4, ttt_steps=2)
    torch.manual_seed(4)
    null = heads.build({"type": "eagle3", "layers": LAYERS, "ttt_steps": 2, "draft_vocab_size": None}, base)
    assert full.num_draft_tokens == null.num_draft_tokens == V and null.draft_vocab_size is None
    for (k, a), (_, b) in zip(full.named_parameters(), null.named_parameters()):
        assert torch.equal(a, b), k
    batch = _batch(base, [11, 7])
    lf, mf = full.training_loss(batch, Progress())
    ln, mn = null.training_loss(batch, Progress())
    assert float(lf) == pytest.approx(float(ln), rel=1e-6) and mf["oov_rate"] == mn["oov_rate"] == 0.0
    vf, vn = full.validation_metrics(batch), null.validation_metrics(batch)
    for k in vn:
        torch.testing.assert_close(vf[k], vn[k])
    prompt = _prompts(1, seed=6)[0]
    from decoding.speculative import SpeculativeDecoder

    a = SpeculativeDecoder(base, full.eval().make_drafter(base, decoding={"depth": 3, "topk": 3, "total_tokens": 9}))
    b = SpeculativeDecoder(base, null.eval().make_drafter(base, decoding={"depth": 3, "topk": 3, "total_tokens": 9}))
    (oa, sa), (ob, sb) = a.generate(prompt, 12), b.generate(prompt, 12)
    assert oa == ob and {k: v for k, v in sa.items() if "seconds" not in k} == {k: v for k, v in sb.items() if "seconds" not in k}


# -- config / inputs -------------------------------------------------------------------------------
def test_defaults_and_bad_config(tiny_base):
    import heads
    from heads.eagle3 import default_layers

    assert default_layers(30) == [2, 15, 27] and default_layers(32) == [2, 16, 29]
    base = tiny_base[0]
    with pytest.raises(ValueError, match="heads.layers: the default"):
        heads.build({"type": "eagle3"}, base)  # 4 layers: [2, 2, 1]
    with pytest.raises(ValueError, match=r"heads.layers: \[1, 2, 4\] lies outside the base's depth"):
        heads.build({"type": "eagle3", "layers": [1, 2, 4]}, base)
    with pytest.raises(ValueError, match="strictly increasing"):
        heads.build({"type": "eagle3", "layers": [3, 2, 1]}, base)
    with pytest.raises(ValueError, match="heads.ttt_steps"):
        heads.build({"type": "eagle3", "layers": LAYERS, "ttt_steps": 0}, base)
    V = base.config.vocab_size
    with pytest.raises(ValueError, match=f"heads.draft_vocab_size.*{V + 1}"):
        heads.build({"type": "eagle3", "layers": LAYERS, "draft_vocab_size": V + 1}, base)
    with pytest.raises(ValueError, match="heads.draft_vocab_size=100 needs the cache's label counts"):
        heads.build({"type": "eagle3", "layers": LAYERS, "draft_vocab_size": 100}, base)
    head = _head(base)
    batch = _batch(base, [6])
    del batch["aux_hidden"][2]
    with pytest.raises(KeyError, match=r"prep.layers=\[1,2,3\]"):
        head.training_loss(batch, heads.Progress())


def test_config_check_at_compose():
    from core.config import ConfigError, compose

    with pytest.raises(ConfigError, match="heads.ttt_steps"):
        compose(["heads=eagle3", "heads.ttt_steps=0"])
    cfg = compose(["heads=eagle3"])
    assert cfg.heads.ttt_steps == 7 and cfg.heads.ttt_decay == 0.8 and cfg.heads.layers is None


def test_lm_head_initialised_from_base_rows_and_kept_on_load(tiny_base, tmp_path):
    import heads

    base = tiny_base[0]
    head = heads.build({"type": "eagle3", "layers": LAYERS}, base)
    torch.testing.assert_close(head.trainable_lm_head.weight, base.get_output_embeddings().weight)
    with torch.no_grad():
        head.trainable_lm_head.weight.mul_(2.0)
    heads.save(head, tmp_path / "c", {"source": "tiny", "vocab_size": base.config.vocab_size})
    loaded, _ = heads.load(tmp_path / "c", base_model=base)
    torch.testing.assert_close(loaded.trainable_lm_head.weight, 2.0 * base.get_output_embeddings().weight)


# -- decoding --------------------------------------------------------------------------------------
def _prompts(n=3, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g) for _ in range(n)]


def test_parity_random_weights(tiny_base):
    from decoding.speculative import SpeculativeDecoder
    from decoding.vanilla import greedy_generate

    base, tok, _ = tiny_base
    head = _head(base).eval()
    eos = [tok.eos_token_id]
    for depth, topk, total in ((4, 3, 10), (6, 4, 25)):
        drafter = head.make_drafter(base, decoding={"depth": depth, "topk": topk, "total_tokens": total})
        for prompt in _prompts():
            ref, _ = greedy_generate(base, prompt, 24, eos)
            out, stats = SpeculativeDecoder(base, drafter, eos).generate(prompt, 24)
            assert out == ref
            # at most depth passes a step: fewer where fewer tokens are left or no deeper node can enter
            # the best total_tokens (tests/test_draft_limits.py counts them exactly)
            assert stats["steps"] <= stats["drafter_passes"] <= depth * stats["steps"]
            assert stats["tree_nodes"] <= total * stats["steps"]


def test_parity_and_full_acceptance_with_oracle_distribution(tiny_base):
    """The dynamic tree with the base's own next-token distribution at every node: each step
    accepts the whole depth (τ = depth + 1), so node tokens, positions and the d2t mapping of the
    tree are right, and the output equals vanilla greedy."""
    from decoding.eagle3 import Eagle3Drafter
    from decoding.speculative import SpeculativeDecoder
    from decoding.vanilla import greedy_generate

    base, tok, _ = tiny_base

    class Oracle(Eagle3Drafter):
        def _topk(self, h, nodes):
            rows = []
            for u in nodes:
                path = []
                while u > 0:
                    path.append(self._node_tok[u]); u = self._parents[u]
                seq = self.tokens + [self._node_tok[0]] + path[::-1]
                with torch.no_grad():
                    rows.append(torch.log_softmax(base(input_ids=torch.tensor([seq])).logits[0, -1].float(), -1))
            vals, ids = torch.stack(rows).topk(self.topk, -1)
            return vals, ids

    head = _head(base).eval()
    depth = 4
    drafter = Oracle(head, depth=depth, topk=2, total_tokens=100)  # keep every node: deep nodes can score below shallow ones
    for prompt in _prompts(2, seed=9):
        ref, _ = greedy_generate(base, prompt, 30, [])
        out, stats = SpeculativeDecoder(base, drafter, []).generate(prompt, 30)
        assert out == ref
        assert stats["emitted_per_step"][:-1] == [depth + 1] * (len(stats["emitted_per_step"]) - 1)


def test_eval_decoding_override_errors(tiny_base):
    base = tiny_base[0]
    head = _head(base)
    with pytest.raises(ValueError, match="eval.decoding: unknown key"):
        head.make_drafter(base, decoding={"passes": 3})
    with pytest.raises(ValueError, match="heads.decoding.topk"):
        head.make_drafter(base, decoding={"topk": 0})


# -- training through the CLI path -----------------------------------------------------------------
@pytest.mark.parametrize("draft_vocab", [None, 64])
def test_train_reload_and_decode(tiny_base, tiny_model_dir, tmp_path, draft_vocab):
    """python -m train's code path; with heads.draft_vocab_size=64 the mapping is the top 64 of the
    cache's training labels (as every head), checkpointed, and decoding stays lossless."""
    import heads
    from core.config import UserInputError, compose
    from data_prep.synthetic import write_random_cache
    from decoding.speculative import SpeculativeDecoder
    from decoding.vanilla import greedy_generate
    from train.run import train

    model, tok, _ = tiny_base
    cache = write_random_cache(tmp_path / "cache", tiny_model_dir, n_train=8, n_val=4, layers=LAYERS, length_range=(8, 16))
    args = ["heads=eagle3", "heads.layers=[1,2,3]", "heads.ttt_steps=2", "train.logger=csv", "train.progress_bar=false",
            "train.sanity_val_steps=0", f"output_root={tmp_path}", f"train.cache_dir={cache}", "train.run_name=e",
            "train.accelerator=cpu", "train.devices=1", "train.max_steps=2", "train.batch_size=4",
            "train.val_every_n_steps=2", "train.scheduler.warmup_steps=1",
            f"heads.draft_vocab_size={'null' if draft_vocab is None else draft_vocab}"]
    result = train(compose(args), base=tiny_base)
    head, meta = heads.load(result["run_dir"] / "best", base_model=model)
    assert meta["head_type"] == "eagle3" and head.layers == LAYERS
    assert meta["head"]["draft_vocab_size"] == draft_vocab and head.num_draft_tokens == (draft_vocab or model.config.vocab_size)
    assert head.trainable_lm_head.weight.shape == (head.num_draft_tokens, model.config.hidden_size)
    if draft_vocab is not None:
        from data_prep.label_counts import scan_split
        from heads.draft_vocab import select_d2t

        assert torch.equal(head.d2t, select_d2t(scan_split(cache / "train"), draft_vocab))
        assert meta["head"]["draft_vocab"]["cache"] == str(cache)
        import csv

        rows = list(csv.DictReader(open(next((result["run_dir"]).rglob("metrics.csv")))))
        assert any(r.get("train/oov_rate") not in (None, "") for r in rows)
    assert "sim_tau" in result["module"].validation_results
    prompt = _prompts(1, seed=3)[0]
    ref, _ = greedy_generate(model, prompt, 16, [tok.eos_token_id])
    out, _ = SpeculativeDecoder(model, head.eval().make_drafter(model), [tok.eos_token_id]).generate(prompt, 16)
    assert out == ref
    # a cache without the feature layers is refused before a run directory is made
    bare = write_random_cache(tmp_path / "bare", tiny_model_dir, n_train=4, n_val=2, length_range=(8, 12))
    args2 = [a.replace(str(cache), str(bare)).replace("run_name=e", "run_name=f") for a in args]
    with pytest.raises(UserInputError, match=r"prep.layers=\[1,2,3\]"):
        train(compose(args2), base=tiny_base)
    assert not (tmp_path / "runs" / "eagle3" / "f").exists()


# -- the same unrolling offered to Falcon k = 1 ------------------------------------------------------
@pytest.mark.parametrize("draft_vocab", [False, True])
def test_falcon_k1_ttt_equals_hand_unrolled_reference(tiny_base, draft_vocab):
    """heads=falcon_k1 heads.ttt_steps=2: L0 + 0.8·L1, where step 1 of slot t is a causal forward
    over the true slots 0..t plus (f̂_t, x_{t+2}) at position t+1, scored against f_{t+2}.  With a
    draft vocabulary holding half of the batch's labels, every step keeps the single-step rule: a row
    whose greedy label (x_{t+2} for step 1) is outside it leaves the CE term and counts as a miss."""
    import heads
    from heads import Progress
    from decoding.masks import additive_mask
    from losses.falcon import falcon_loss

    base = tiny_base[0]
    cfg = {"type": "falcon", "block_size": 1, "glancing": {"enabled": False}, "noise": {"type": "none"}}
    lengths = [9, 6]
    batch = _batch(base, lengths)
    extra, counts = {}, None
    if draft_vocab:
        counts = torch.bincount(batch["labels"][batch["loss_mask"]], minlength=int(base.config.vocab_size))
        extra = {"draft_vocab_size": max(2, int((counts > 0).sum()) // 2)}
    head = heads.build({**cfg, **extra, "ttt_steps": 2}, base, label_counts=counts)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "self_attn" in name or name.startswith("fc."):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    one = heads.build({**cfg, **extra, "ttt_steps": 1}, base, label_counts=counts)
    one.load_state_dict(head.state_dict())
    loss, metrics = head.training_loss(batch, Progress())
    assert metrics["loss_step0"] == pytest.approx(float(one.training_loss(batch, Progress())[0]), rel=1e-5)

    def causal(feats, toks):
        n = toks.numel()
        vis = additive_mask(torch.ones(n, n, dtype=torch.bool).tril(), torch.float32)
        return head(feats[None], toks[None], torch.arange(n)[None], vis[None, None])[0]

    preds, tgts, in_vocab = [], [], []
    for b, n in enumerate(lengths):
        ids, f = batch["input_ids"][b, :n], batch["hidden"][b, :n]
        h0 = causal(f, torch.cat([ids[1:], ids[:1]]))
        for t in range(n - 2):
            if batch["loss_mask"][b, t + 2]:
                h1 = causal(torch.cat([f[: t + 1], h0[t][None]]), torch.cat([ids[1: t + 2], ids[t + 2: t + 3]]))[-1]
                preds.append(h1); tgts.append(f[t + 2])
                in_vocab.append(bool(head.to_draft_ids(batch["labels"][b, t + 2: t + 3])[0] >= 0))
    P, Tg, ce = torch.stack(preds), torch.stack(tgts), torch.tensor(in_vocab)
    assert bool(ce.all()) != draft_vocab  # the precondition: some step-1 labels are out of vocabulary
    student, teacher = head.logits_fp32(P), head.logits_fp32(Tg)
    L1, _ = falcon_loss(P, Tg, student, teacher, torch.ones(len(preds), dtype=torch.bool),
                        ce_mask=ce if draft_vocab else None)
    assert metrics["loss_step1"] == pytest.approx(float(L1), rel=1e-5)
    hit = (student.argmax(-1) == teacher.argmax(-1)) & ce
    assert metrics["acc_step1"] == pytest.approx(float(hit.float().mean()), abs=1e-6)
    assert float(loss) == pytest.approx(metrics["loss_step0"] + 0.8 * float(L1), rel=1e-5)
    with pytest.raises(ValueError, match="heads.ttt_steps"):
        heads.build({"type": "falcon", "ttt_steps": 2}, base)  # k = 2 with glancing


def test_drafter_refuses_a_shallower_base(tiny_base):
    from core.tiny import tiny_llama

    head = _head(tiny_base[0])
    with pytest.raises(ValueError, match="trained for another base"):
        head.make_drafter(tiny_llama(num_layers=3))


def test_drafted_tree_matches_fresh_forwards(tiny_base):
    """Every expanded node's children are the top-k of a fresh, uncached causal forward over the true
    slots plus the node's chain (its ancestors' slots), with matching cumulative log-probabilities —
    also after steps that reuse the drafter's KV cache."""
    from decoding.speculative import SpeculativeDecoder

    base, tok, _ = tiny_base
    head = _head(base).eval()
    drafter = head.make_drafter(base, decoding={"depth": 3, "topk": 3, "total_tokens": 1000})
    trees = []
    orig = drafter.draft

    def spy(root):
        t = orig(root)
        trees.append((list(drafter.tokens), drafter.feats.clone(), t))
        return t

    drafter.draft = spy
    SpeculativeDecoder(base, drafter, []).generate(torch.randint(3, 300, (7,), generator=torch.Generator().manual_seed(2)), 12)
    assert len(trees) >= 2
    for tokens, feats, tree in trees[:3]:
        n = len(tokens)
        g = head.fuse(feats)
        toks = torch.tensor(tokens[1:] + [int(tree.tokens[0])])
        with torch.no_grad():
            h_root = _causal(head, g, toks)[-1]

            def h_of(node):  # fresh output of the slot expanding `node`: slot of v_k = (output that produced v_k, v_k)
                feats_, toks_, prev = [], [], h_root
                for v in tree.path(node)[1:]:
                    feats_.append(prev)
                    toks_.append(int(tree.tokens[v]))
                    prev = _causal(head, torch.cat([g, torch.stack(feats_)]), torch.cat([toks, torch.tensor(toks_)]))[-1]
                return prev

            for i in range(tree.num_nodes):
                kids = tree.children(i)
                if not kids:
                    continue
                lp = torch.log_softmax(head.draft_logits(h_of(i)), -1)
                vals, ids = lp.topk(3)
                assert sorted(int(tree.tokens[c]) for c in kids) == sorted(ids.tolist())
                for c in kids:
                    want = (float(tree.scores[i]) if i else 0.0) + float(lp[int(tree.tokens[c])])
                    assert float(tree.scores[c]) == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("base_kind", ["default_init", "init0.3"])
def test_cached_drafter_equals_fresh_drafter_every_step(bases64, base_kind):
    """Issue 12's rule for eagle3: the tree from the drafter's cached state equals a fresh drafter's
    tree started on the committed context, at every step (fp64)."""
    from omegaconf import OmegaConf

    import heads
    from decoding.speculative import SpeculativeDecoder
    from decoding.vanilla import greedy_generate
    from test_decoding_bookkeeping import ROOT, FreshCheck, _prompt, _same

    base = bases64[base_kind]
    torch.manual_seed(0)
    cfg = OmegaConf.load(ROOT / "configs" / "heads" / "eagle3.yaml")
    cfg.layers = LAYERS
    head = heads.build(cfg, base).double().eval()
    small = {"depth": 4, "topk": 4, "total_tokens": 20}
    wrapped = FreshCheck(head.make_drafter(base, decoding=small), lambda: head.make_drafter(base, decoding=small))
    wrapped.feature_layers = head.feature_layers  # the wrapper must ask the runtime for the same features
    ref, _ = greedy_generate(base, _prompt(1), 40)
    out, stats = SpeculativeDecoder(base, wrapped).generate(_prompt(1), 40)
    assert out == ref
    bad = [n for n, cached, fresh in wrapped.pairs if not _same(cached, fresh)]
    assert not bad and len(wrapped.pairs) == stats["steps"] >= 10
