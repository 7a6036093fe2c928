"""Draft vocabulary in every head (issue 13): N = V equals null, OOV rules on hand-built batches,
checkpoint round trip and bad d2t errors, decoding parity with a vocabulary that excludes tokens
vanilla greedy decoding needs (and that the full-vocabulary drafter does propose)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import heads
from core.config import compose
from heads.base import Progress
from heads.draft_vocab import DraftVocab

HEAD_NAMES = ["ctc", "falcon", "falcon_noglance", "falcon_k1", "adadecode"]
AUX = [1, 2, 3]


def _head_cfg(name: str, **extra) -> dict:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose([f"heads={name}"]).heads, resolve=True)
    cfg.update({"attn_implementation": "eager"} if name != "adadecode" else {"layers": AUX})
    if name == "ctc":
        cfg.update({"anchors_per_seq": 6, "val_anchors_per_seq": 6, "aux_weight": 0.5})
    cfg.update(extra)
    return cfg


def _batch(base, B=3, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, base.config.vocab_size, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.bool)
    am[1, 18:] = False
    am[2, 13:] = False
    ids = ids.masked_fill(~am, 2)
    with torch.no_grad():
        out = base(ids, attention_mask=am.long(), output_hidden_states=True)
    hs = out.hidden_states
    lm = am.clone()
    lm[:, :3] = False
    return dict(input_ids=ids, hidden=hs[-1], attention_mask=am, loss_mask=lm,
                labels=out.logits.argmax(-1).masked_fill(~am, 0), lengths=am.sum(-1),
                aux_hidden={l: hs[l] for l in AUX}, ids=[f"c{i}" for i in range(B)])


def _build(name, base, counts=None, seed=0, **extra):
    torch.manual_seed(seed)
    return heads.build(_head_cfg(name, **extra), base, label_counts=counts, counts_source="test-cache")


@pytest.fixture(scope="module")
def varied():
    """A tiny Llama whose greedy output varies (the default init repeats one token)."""
    from core.tiny import tiny_llama

    return tiny_llama(seed=0, initializer_range=0.2)


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_full_size_equals_null(tiny_base, name):
    base = tiny_base[0]
    V = base.config.vocab_size
    batch = _batch(base)
    counts = torch.randint(0, 5, (V,), generator=torch.Generator().manual_seed(3))
    ref = _build(name, base)
    dv = _build(name, base, counts, draft_vocab_size=V)
    assert torch.equal(dv.d2t, torch.arange(V)) and ref.draft_vocab_size is None
    for h in (ref, dv):
        h.eval()
    p = Progress(step=0, total_steps=10)
    torch.manual_seed(1)
    l_ref, m_ref = ref.training_loss(batch, p)
    torch.manual_seed(1)
    l_dv, m_dv = dv.training_loss(batch, p)
    torch.testing.assert_close(l_dv, l_ref)
    assert m_dv["oov_rate"] == 0.0
    v_ref, v_dv = ref.validation_metrics(batch), dv.validation_metrics(batch)
    assert sorted(v_ref) == sorted(v_dv)
    for k in v_ref:
        torch.testing.assert_close(torch.as_tensor(v_dv[k]).double(), torch.as_tensor(v_ref[k]).double(), msg=k)


def _excluding(V: int, excluded: set[int]) -> torch.Tensor:
    """Counts whose top-N (N = V - |excluded|) is exactly the complement of ``excluded``."""
    counts = torch.full((V,), 5, dtype=torch.int64)
    counts[sorted(excluded)] = 0
    return counts


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_sliced_logits_are_full_logits_restricted(tiny_base, name):
    """Training with N < V scores exactly the rows W[d2t] of the frozen LM head, and the
    out-of-vocabulary share is the share of loss labels outside d2t."""
    base = tiny_base[0]
    V = base.config.vocab_size
    batch = _batch(base)
    present = sorted(set(batch["labels"][batch["loss_mask"]].tolist()))
    excluded = set(present[::2]) | set(range(200, 260))
    head = _build(name, base, _excluding(V, excluded), draft_vocab_size=V - len(excluded))
    assert set(head.d2t.tolist()).isdisjoint(excluded) and head.d2t.numel() == V - len(excluded)
    h = torch.randn(5, base.config.hidden_size)
    torch.testing.assert_close(head.draft_lm_head(h), head.lm_head(h)[:, head.d2t])
    _, metrics = head.training_loss(batch, Progress(step=0, total_steps=10))
    if name == "adadecode":
        lab = batch["labels"][batch["loss_mask"]]
        expect = sum(int(t) in excluded for t in lab.tolist()) / lab.numel()
        assert metrics["oov_rate"] == pytest.approx(expect)
    else:
        assert 0 < metrics["oov_rate"] < 1


# -- out-of-vocabulary rules on hand-built batches ---------------------------------------------
def test_ctc_oov_anchor_dropped_and_ce_slot_dropped():
    from losses.ctc import ce_slot_loss, ctc_slot_loss

    torch.manual_seed(0)
    logits = torch.randn(3, 4, 6)  # 5 draft classes + blank (index 5)
    targets = torch.tensor([[0, 1], [2, -1], [3, 3]])
    loss, stats = ctc_slot_loss(logits, targets)
    keep, _ = ctc_slot_loss(logits[[0, 2]], targets[[0, 2]])
    torch.testing.assert_close(loss, keep)  # the OOV anchor leaves the mean
    assert int(stats["oov_anchors"]) == 1 and int(stats["infeasible"]) == 0
    ce, st = ce_slot_loss(logits, targets)
    lp = F.log_softmax(logits, -1)
    full = torch.tensor([[0, 1, 5, 5], [2, -1, 5, 5], [3, 3, 5, 5]])
    terms = [-lp[a, j, full[a, j]] for a in range(3) for j in range(4) if full[a, j] >= 0]
    torch.testing.assert_close(ce, torch.stack(terms).sum() / (3 * 2))
    assert int(st["oov_anchors"]) == 1
    with pytest.raises(ValueError, match="-1 = outside"):
        ctc_slot_loss(logits, torch.tensor([[0, 1], [2, -2], [3, 3]]))


def test_falcon_loss_oov_drops_ce_keeps_restricted_kl():
    from losses.falcon import falcon_loss

    torch.manual_seed(0)
    pred, tgt = torch.randn(4, 8), torch.randn(4, 8)
    student, teacher = torch.randn(4, 5), torch.randn(4, 5)  # logits over the draft vocabulary
    mask = torch.tensor([True, True, True, False])
    ce_mask = torch.tensor([True, False, True, True])  # position 1's label is out of vocabulary
    loss, parts = falcon_loss(pred, tgt, student, teacher, mask, alpha=0.9, omega=0.1, ce_mask=ce_mask)
    logq, logp = F.log_softmax(student, -1), F.log_softmax(teacher, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)[:3].mean()  # renormalised over the subset, every masked position
    y = teacher.argmax(-1)
    ce = -logq[[0, 2], y[[0, 2]]].mean()  # only in-vocabulary, masked positions
    reg = F.smooth_l1_loss(pred, tgt, reduction="none").mean(-1)[:3].mean()
    torch.testing.assert_close(parts["kl"], kl)
    torch.testing.assert_close(parts["ce"], ce)
    torch.testing.assert_close(loss, reg + 0.1 * (0.9 * kl + 0.1 * ce))


def test_falcon_validation_counts_oov_as_miss(tiny_base):
    """An oracle student (pred = target feature) is right everywhere except at OOV labels."""
    base = tiny_base[0]
    V = base.config.vocab_size
    batch = _batch(base)
    head = _build("falcon_k1", base)
    inp = head.prepare_inputs(batch)
    excluded = set(batch["labels"][:, 1:][inp["mask"][:, :-1]].tolist()[:3])
    dv = _build("falcon_k1", base, _excluding(V, excluded), draft_vocab_size=V - len(excluded))
    inp = dv.prepare_inputs(batch)
    oracle = inp["F_tgt"]
    _, _, acc, _, hit = dv._loss_on(oracle, inp, inp["mask"])
    lab = batch["labels"][:, 1:][inp["mask"][:, :-1]]
    expect = torch.tensor([int(t) not in excluded for t in lab.tolist()])
    assert torch.equal(hit.cpu(), expect) and 0 < float(acc) < 1


def test_adadecode_teacher_is_restricted_and_renormalised(tiny_base):
    base = tiny_base[0]
    V = base.config.vocab_size
    batch = _batch(base)
    excluded = set(range(0, V, 3))
    head = _build("adadecode", base, _excluding(V, excluded), draft_vocab_size=V - len(excluded))
    loss, metrics = head.training_loss(batch, Progress())
    m = batch["loss_mask"]
    d2t = head.d2t
    expect = 0.0
    for layer in AUX:
        p = F.log_softmax(head.lm_head(batch["hidden"][m].float())[:, d2t], -1)
        q = F.log_softmax(head.lm_head(head.transforms[str(layer)](head.final_norm(batch["aux_hidden"][layer][m])))[:, d2t], -1)
        kl = (p.exp() * (p - q)).sum(-1).mean()
        # training's KL is CE − H(p*) in fp32 (losses.linear_soft_ce): ~1e-7 nats of cancellation
        assert metrics[f"kl_l{layer}"] == pytest.approx(float(kl), rel=1e-5, abs=1e-6)
        expect = expect + kl
    torch.testing.assert_close(loss, expect, rtol=1e-5, atol=3e-6)


# -- checkpoints -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ctc", "falcon", "adadecode"])
def test_checkpoint_round_trip(tiny_base, tmp_path, name):
    base, _, ident = tiny_base
    V = base.config.vocab_size
    counts = torch.randint(0, 50, (V,), generator=torch.Generator().manual_seed(5))
    head = _build(name, base, counts, draft_vocab_size=100)
    heads.save(head, tmp_path / "h", ident.to_dict())
    back, meta = heads.load(tmp_path / "h", base_model=base)
    assert torch.equal(back.d2t, DraftVocab.from_counts(counts, 100).d2t)
    assert torch.equal(back.t2d, head.t2d) and torch.equal(back.draft_index, head.draft_index)
    torch.testing.assert_close(back.draft_lm_head_rows, base.lm_head.weight[back.d2t])
    dv = meta["head"]["draft_vocab"]
    assert meta["head"]["draft_vocab_size"] == 100 and dv["cache"] == "test-cache"
    assert dv["train_coverage"] == pytest.approx(float(counts[back.d2t].sum()) / float(counts.sum()))


@pytest.mark.parametrize("corrupt,match", [
    (lambda d: d.index_fill(0, torch.tensor([1]), int(d[0])), "appears more than once"),
    (lambda d: d.index_fill(0, torch.tensor([99]), 10_000), "out of range"),
    (lambda d: d[:-1], r"shapes differ: d2t \[99\] \(config.json's head has \[100\]\)"),
])
def test_bad_checkpoint_d2t_is_named(tiny_base, tmp_path, corrupt, match):
    from safetensors.torch import load_file, save_file

    base, _, ident = tiny_base
    head = _build("ctc", base, torch.arange(base.config.vocab_size), draft_vocab_size=100)
    heads.save(head, tmp_path / "h", ident.to_dict())
    path = tmp_path / "h" / "model.safetensors"
    state = load_file(path)
    state["d2t"] = corrupt(state["d2t"]).contiguous()
    save_file(state, path)
    with pytest.raises(ValueError, match=match):
        heads.load(tmp_path / "h", base_model=base)


def test_weights_of_another_head_beside_its_config_are_refused(tiny_base, tmp_path):
    """A best/model.safetensors copied in from a run with another draft_vocab_size: heads.load died with
    torch's 'size mismatch' RuntimeError traceback (naming no file), and heads.export wrote an EAGLE-3
    config whose draft_vocab_size (100) disagreed with its lm_head's 50 rows."""
    import shutil

    from heads.export import export

    base, _, ident = tiny_base
    counts = torch.arange(base.config.vocab_size)
    for n in (100, 50):
        torch.manual_seed(0)
        cfg = {**_heads_section("eagle3"), "layers": AUX, "attn_implementation": "eager", "draft_vocab_size": n}
        heads.save(heads.build(cfg, base, label_counts=counts, counts_source="c"), tmp_path / f"n{n}", ident.to_dict())
    shutil.copy(tmp_path / "n50" / "model.safetensors", tmp_path / "n100" / "model.safetensors")
    msg = (rf"^checkpoint {tmp_path / 'n100'}: model.safetensors does not hold the eagle3 head its config.json "
           r"describes \(shapes differ: d2t \[50\] \(config.json's head has \[100\]\); trainable_lm_head.weight "
           r"\[50, 64\] \(config.json's head has \[100, 64\]\)\); the two files come from different heads")
    with pytest.raises(ValueError, match=msg):
        heads.load(tmp_path / "n100", base_model=base)
    with pytest.raises(ValueError, match=msg):
        export(tmp_path / "n100", "sglang", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    heads.load(tmp_path / "n50", base_model=base)  # the untouched folder still loads


def _heads_section(name: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose([f"heads={name}"]).heads, resolve=True)


def test_size_errors(tiny_base):
    from core.config import ConfigError, validate

    base = tiny_base[0]
    V = base.config.vocab_size
    with pytest.raises(ValueError, match=f"draft_vocab_size={V + 1}"):
        _build("falcon", base, torch.ones(V, dtype=torch.long), draft_vocab_size=V + 1)
    with pytest.raises(ValueError, match="needs the cache's label counts"):
        _build("falcon", base, None, draft_vocab_size=8)
    with pytest.raises(ConfigError, match="heads.draft_vocab_size=1"):
        validate(compose(["heads=ctc", "heads.draft_vocab_size=1"]))


# -- decoding parity with tokens vanilla needs excluded ----------------------------------------
def _record_drafts(drafter, seen: set):
    orig = drafter.draft

    def draft(root):
        tree = orig(root)
        seen.update(tree.tokens[1:].tolist())
        return tree

    drafter.draft = draft
    return drafter


@pytest.mark.parametrize("name", ["ctc", "falcon", "falcon_k1"])
def test_tree_parity_with_excluded_needed_tokens(varied, name):
    from decoding.speculative import SpeculativeDecoder
    from decoding.vanilla import greedy_generate

    base = varied
    V = base.config.vocab_size
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, V, (int(k),), generator=g) for k in (6, 11)]
    refs = [greedy_generate(base, p, 16, eos_token_ids=[])[0] for p in prompts]
    full = _build(name, base).eval()
    proposed: set[int] = set()
    dec = SpeculativeDecoder(base, _record_drafts(full.make_drafter(base), proposed), eos_token_ids=[])
    for p, ref in zip(prompts, refs):
        assert dec.generate(p, 16)[0] == ref
    needed = {t for ref in refs for t in ref}
    excluded = needed | proposed  # tokens vanilla emits and tokens the full-vocabulary drafter proposes
    assert len(excluded) < V - 16
    sub = _build(name, base, _excluding(V, excluded), draft_vocab_size=V - len(excluded)).eval()
    sub.load_state_dict({k: v for k, v in full.state_dict().items()}, strict=False)  # same trained weights
    seen: set[int] = set()
    dec = SpeculativeDecoder(base, _record_drafts(sub.make_drafter(base), seen), eos_token_ids=[])
    for p, ref in zip(prompts, refs):
        out, stats = dec.generate(p, 16)
        assert out == ref  # lossless: verification by the full base model
        assert stats["emitted_per_step"] == [1] * (len(ref) - 1)  # no position of vanilla's output is ever drafted
    assert seen and seen.isdisjoint(excluded) and seen <= set(sub.d2t.tolist())


def test_adadecode_parity_with_excluded_needed_tokens(varied):
    from decoding.vanilla import greedy_generate

    base = varied
    V = base.config.vocab_size
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, V, (int(k),), generator=g) for k in (5, 9)]
    refs = [greedy_generate(base, p, 16, eos_token_ids=[])[0] for p in prompts]
    needed = {t for ref in refs for t in ref}
    head = heads.build({"type": "adadecode", "layers": AUX, "draft_vocab_size": V - len(needed)}, base,
                       label_counts=_excluding(V, needed))
    dec = head.make_drafter(base, gamma=0.0, eos_token_ids=[])  # γ = 0: every candidate layer exits
    drafts: list[int] = []
    orig = dec.propose

    def propose(layer, h, token):
        d = orig(layer, h, token)
        if d is not None:
            drafts.append(d)
        return d

    dec.propose = propose
    for p, ref in zip(prompts, refs):
        out, stats = dec.generate(p, 16)
        assert out == ref
        assert stats["accepted_exits"] == 0  # no needed token can be drafted, so no exit is ever accepted
    assert drafts and set(drafts).isdisjoint(needed) and set(drafts) <= set(head.d2t.tolist())


@pytest.mark.parametrize("head_type", ["falcon_k1", "ctc", "eagle3", "adadecode"])
def test_a_new_head_has_no_module_in_eval_mode(head_type):
    """Lightning warns of every module in eval mode at the start of training; the frozen copy of the base's
    final norm (``heads.base.frozen_copy``) kept the eval mode of the base it was copied from."""
    import heads
    from core.config import compose
    from core.tiny import tiny_llama

    base = tiny_llama(seed=0).eval()
    layers = ["heads.layers=[1,2,3]"] if head_type in ("eagle3", "adadecode") else []
    head = heads.build(compose([f"heads={head_type}", *layers]).heads, base)
    assert [n for n, m in head.named_modules() if not m.training] == []
    assert not base.training  # the base itself is left as it was
