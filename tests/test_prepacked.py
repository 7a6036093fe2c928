"""Prepacked verification weights (decoding/prepacked.py) on the tiny Llama: one-token steps keep
their kernel bit for bit, many-row products agree with ``F.linear`` to fp32 rounding, speculative
output still equals vanilla greedy, stale weights and gradients fall back, bf16 is left alone by the
fp32 packing, and the evaluation's switch and the c(n) cache key see it.  Row-consistent packing
(bf16 on an AMX CPU): the probe finds the largest consistent product, larger products run in chunks
whose rows equal one-row products, the padding of decoding.numerics leaves those layers alone, and
``auto`` packs bf16 only where AMX is."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.config import compose
from core.tiny import tiny_llama
from decoding import prepacked
from decoding.cost_model import cost_key
from decoding.numerics import pad_one_row_products, restore_one_row_products
from decoding.reference import OracleDrafter
from decoding.speculative import SpeculativeDecoder
from decoding.tree import DraftTree
from decoding.vanilla import greedy_generate
from decoding.verify import crop_cache, prefill, verify_tree
from evaluation.__main__ import rewrite_argv
from evaluation.methods import prepacked_products

pytestmark = pytest.mark.skipif(not prepacked.available(), reason="this torch build has no oneDNN weight reorder")
V = 384


@pytest.fixture()
def model():
    return tiny_llama(seed=0, attn_implementation="eager", initializer_range=0.3)


def _prompt(seed: int, n: int = 11) -> torch.Tensor:
    return torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(seed))


def _linears(m):
    return [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)]


def test_one_row_bitwise_many_rows_close_and_packed_kernel_used(model):
    names = prepacked.prepack_linear_weights(model)
    assert len(names) == len(_linears(model)) and prepacked.prepacked_min_rows(model) == prepacked.MIN_ROWS
    gen = torch.Generator().manual_seed(0)
    for lin in _linears(model):
        for rows, shape in [(1, (1, 1)), (2, (1, 2)), (3, (1, 3)), (9, (1, 9)), (12, (3, 4))]:
            x = torch.randn(*shape, lin.in_features, generator=gen)
            got, ref = lin(x), F.linear(x, lin.weight, lin.bias)
            assert got.shape == ref.shape
            if rows < prepacked.MIN_ROWS:
                assert torch.equal(got, ref), (rows, lin)  # vanilla's one-token step: the same kernel
            else:
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the packed path is really taken: a planted packed weight changes the many-row output only
    lin = _linears(model)[0]
    state = getattr(lin, prepacked._PACKED)
    real = state.packed
    state.packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(lin.weight))
    x = torch.randn(4, lin.in_features, generator=gen)
    assert torch.count_nonzero(lin(x)) == 0 and torch.count_nonzero(lin(x[:1])) > 0
    state.packed = real


def test_vanilla_tokens_unchanged_and_speculative_equals_vanilla(model):
    refs = [greedy_generate(model, _prompt(s), 24)[0] for s in range(3)]
    prepacked.prepack_linear_weights(model)
    for s, ref in enumerate(refs):
        assert greedy_generate(model, _prompt(s), 24)[0] == ref
        for depth, width, miss in [(4, 1, 0.0), (4, 3, 0.35)]:
            out, stats = SpeculativeDecoder(model, OracleDrafter(model, depth, width, True, miss, seed=s)).generate(
                _prompt(s), 24)
            assert out == ref and stats["base_forwards"] < 24


def test_tree_logits_match_unpacked_verification(model):
    cache, root, _ = prefill(model, _prompt(5, 40))
    past = cache.get_seq_length()
    rng = torch.Generator().manual_seed(1)
    tree = DraftTree.from_paths(root, [torch.randint(0, V, (3,), generator=rng).tolist() for _ in range(6)])
    ref = verify_tree(model, cache, tree).logits
    crop_cache(cache, past)
    prepacked.prepack_linear_weights(model)
    got = verify_tree(model, cache, tree).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() > past


def test_changed_weights_repack_copies_work_gradients_fall_back_and_restore(model):
    import copy

    prepacked.prepack_linear_weights(model)
    lin = _linears(model)[0]
    x = torch.randn(5, lin.in_features)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # changed after packing: the stale copy must not be used, it is repacked
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    # a deep copy (oneDNN tensors have no storage to copy) repacks its own weight; the original is untouched
    twin = copy.deepcopy(model)
    tlin = _linears(twin)[0]
    with torch.no_grad():
        tlin.weight.add_(1.0)
    torch.testing.assert_close(tlin(x), F.linear(x, tlin.weight, tlin.bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    # cast to bf16: the layer is no longer packable and runs F.linear (bit for bit)
    t16 = copy.deepcopy(model).to(torch.bfloat16)
    l16 = _linears(t16)[0]
    assert torch.equal(l16(x.bfloat16()), F.linear(x.bfloat16(), l16.weight, l16.bias))
    xg = x.clone().requires_grad_(True)
    out = lin(xg)
    out.sum().backward()  # autograd through F.linear, not the packed op
    torch.testing.assert_close(xg.grad, lin.weight.sum(0).expand_as(x))
    prepacked.restore_linear_weights(model)
    assert prepacked.prepacked_min_rows(model) is None and "forward" not in lin.__dict__


def test_bf16_and_min_rows_are_refused_or_left_alone(model):
    for bad in (1, "sometimes"):
        with pytest.raises(ValueError, match="min_rows"):
            prepacked.prepack_linear_weights(model, min_rows=bad)
    m16 = tiny_llama(seed=0, attn_implementation="eager").to(torch.bfloat16)
    padded = set(pad_one_row_products(m16, dtypes=(torch.bfloat16,)))
    assert prepacked.prepack_linear_weights(m16) == [] and prepacked.prepacked_min_rows(m16) is None
    if not padded:  # this machine's bf16 kernels are row-consistent at the tiny shapes: plant one padded layer
        name, lin = next((n, mod) for n, mod in m16.named_modules() if isinstance(mod, torch.nn.Linear))
        import types

        from decoding import numerics
        lin.forward = types.MethodType(numerics._padded_forward, lin)
        setattr(lin, numerics._PADDED, True)
        padded = {name}
    linears = {n for n, mod in m16.named_modules() if isinstance(mod, torch.nn.Linear)}
    # asked to pack bf16 too, the layers padded for row consistency are still never packed; on a CPU
    # whose oneDNN cannot reorder bf16 (AVX2 only: "bf16 path needs ... avx512bw"), none is, and nothing raises
    expected = linears - padded if prepacked.can_pack(torch.bfloat16) else set()
    assert set(prepacked.prepack_linear_weights(m16, dtypes=(torch.bfloat16,))) == expected
    assert prepacked.can_pack(torch.float32) == prepacked.available()
    restore_one_row_products(m16)


def test_eval_switch_and_cost_key(model):
    ev = compose(rewrite_argv(["eval.prepack_weights=auto"])).eval
    key_plain = cost_key({"base": "x"}, model, [1, 2], 16, 1)
    assert "prepacked_min_rows" not in key_plain  # older cost files stay valid for an unpacked base
    assert len(prepacked_products(model, ev)) == len(_linears(model))
    rows = prepacked.prepacked_min_rows(model)  # probed per shape on this CPU ("auto"): 1, 2, 3 or a mix
    assert rows is not None and cost_key({"base": "x"}, model, [1, 2], 16, 1)["prepacked_min_rows"] == rows
    prepacked.restore_linear_weights(model)
    assert prepacked_products(model, compose(rewrite_argv(["eval.prepack_weights=false"])).eval) == []
    m16 = tiny_llama(seed=0).to(torch.bfloat16)
    assert prepacked_products(m16, ev) == []  # auto, bf16 not native through AMX (the suite pins slow): left alone
    if not prepacked.can_pack(torch.bfloat16):
        with pytest.raises(ValueError, match="prepack_weights=true needs a CPU base whose oneDNN packs its dtype"):
            prepacked_products(m16, compose(rewrite_argv(["eval.prepack_weights=true"])).eval)
    with pytest.raises(ValueError, match="prepack_weights='sometimes'"):
        prepacked_products(model, compose(rewrite_argv(["eval.prepack_weights=sometimes"])).eval)
    # the entry point refuses the value with the other eval keys, before the base is loaded
    from core.config import ConfigError, validate

    with pytest.raises(ConfigError, match="prepack_weights='sometimes'"):
        validate(compose(rewrite_argv(["eval.prepack_weights=sometimes"])))
    for ok in ("auto", "true", "false"):
        validate(compose(rewrite_argv([f"eval.prepack_weights={ok}"])))


def test_prefill_logits_close(model):
    ids = _prompt(3, 30)
    ref = model(input_ids=ids[None]).logits[0]
    prepacked.prepack_linear_weights(model)
    torch.testing.assert_close(model(input_ids=ids[None]).logits[0], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fault", ["raises", "disagrees"])
def test_can_pack_probes_the_packed_product(model, monkeypatch, fault):
    """A CPU whose oneDNN reorders the weight but cannot run (or miscomputes) the packed product is
    one that cannot pack: nothing is packed, auto falls back to F.linear and true says why."""
    if not prepacked.available():
        pytest.skip("this torch build has no oneDNN")
    real = prepacked._packed_linear

    def broken(x, packed, bias):
        if fault == "raises":
            raise RuntimeError("could not create a primitive descriptor for an inner product")
        return real(x, packed, bias) + 1.0

    prepacked.can_pack.cache_clear()
    monkeypatch.setattr(prepacked, "_packed_linear", broken)
    try:
        assert prepacked.can_pack(torch.float32) is False
        assert prepacked.prepack_linear_weights(model) == []
        assert prepacked_products(model, compose(rewrite_argv(["eval.prepack_weights=auto"])).eval) == []
        with pytest.raises(ValueError, match="packs float32: False"):
            prepacked_products(model, compose(rewrite_argv(["eval.prepack_weights=true"])).eval)
    finally:
        prepacked.can_pack.cache_clear()
    monkeypatch.setattr(prepacked, "_packed_linear", real)
    assert prepacked.can_pack(torch.float32) is True


def _planted_blocking(monkeypatch, above: int):
    """oneDNN's packed product, planted to round differently (one fp32 ulp up) over more than ``above`` rows."""
    real = prepacked._packed_linear

    def blocked(x, packed, bias):
        y = real(x, packed, bias)
        return torch.nextafter(y, torch.full_like(y, float("inf"))) if x.shape[0] > above else y

    monkeypatch.setattr(prepacked, "_packed_linear", blocked)


def test_row_consistent_packing_chunks_above_the_probed_rows(model, monkeypatch):
    """A kernel that blocks differently above 4 rows: the probe says 4, every layer is packed for every row
    count in chunks of 4, so each row of a 9- or 12-row product equals its one-row product bit for bit."""
    from decoding import numerics

    _planted_blocking(monkeypatch, above=4)
    lin = _linears(model)[0]
    assert prepacked.consistent_rows(lin.weight, lin.bias, max_rows=16) == 4
    names = prepacked.prepack_row_consistent(model, dtypes=(torch.float32,), max_rows=16)
    assert len(names) == len(_linears(model)) and prepacked.prepacked_chunks(model) == (len(names), 4)
    gen = torch.Generator().manual_seed(3)
    for lin in _linears(model):
        assert getattr(lin, numerics.ROW_CONSISTENT) and prepacked.prepacked_min_rows(model) == 1
        x = torch.randn(12, lin.in_features, generator=gen)
        one = torch.cat([lin(x[i:i + 1]) for i in range(12)])
        assert torch.equal(lin(x), one) and torch.equal(lin(x[:9].reshape(3, 3, -1)), one[:9].reshape(3, 3, -1))
        # without the chunks the planted kernel would differ: the test can fail
        assert not torch.equal(prepacked._packed_linear(x, getattr(lin, prepacked._PACKED).packed, lin.bias), one)
    # decoding.numerics leaves the row-consistent layers alone, even where their F.linear would differ
    monkeypatch.setattr(numerics, "one_row_differs", lambda *a, **k: True)
    assert pad_one_row_products(model, dtypes=(torch.float32,)) == []
    prepacked.restore_linear_weights(model)
    assert not any(hasattr(m, numerics.ROW_CONSISTENT) or "forward" in m.__dict__ for m in _linears(model))
    assert len(pad_one_row_products(model, dtypes=(torch.float32,))) == len(_linears(model))
    restore_one_row_products(model)


def test_layers_whose_two_rows_already_differ_are_not_packed(model, monkeypatch):
    _planted_blocking(monkeypatch, above=1)
    assert prepacked.consistent_rows(_linears(model)[0].weight, max_rows=8) == 1
    assert prepacked.prepack_row_consistent(model, dtypes=(torch.float32,), max_rows=8) == []
    assert prepacked.prepacked_chunks(model) is None


@pytest.mark.skipif(not prepacked.can_pack(torch.bfloat16), reason="oneDNN cannot pack bf16 on this CPU")
def test_bf16_row_consistent_packing_on_this_cpu():
    """This CPU's real bf16 kernel: every product the probe calls consistent, and a larger one in chunks,
    equals the one-row products bit for bit; the packed product equals F.linear's to bf16 rounding."""
    m16 = tiny_llama(seed=0, attn_implementation="eager", initializer_range=0.3).to(torch.bfloat16)
    names = prepacked.prepack_row_consistent(m16)
    if not names:
        pytest.skip("oneDNN's packed bf16 products are not row-consistent on this CPU")
    gen = torch.Generator().manual_seed(0)
    for lin in [mod for n, mod in m16.named_modules() if n in set(names)]:
        rows = getattr(lin, prepacked._PACKED).chunk_rows
        x = torch.randn(rows + 7, lin.in_features, generator=gen).to(torch.bfloat16)
        one = torch.cat([lin(x[i:i + 1]) for i in range(rows + 7)])
        assert torch.equal(lin(x), one) and torch.equal(lin(x[:rows]), one[:rows])
        torch.testing.assert_close(one.float(), F.linear(x, lin.weight, lin.bias).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("vendor,flags,packs", [
    ("GenuineIntel", {"avx512_bf16", "amx_bf16"}, True),  # AMX (issue 27)
    ("AuthenticAMD", {"avx512_bf16"}, True),  # Zen 4 (2026-12-07): packed one-row and 9-row products faster
    ("GenuineIntel", {"avx512_bf16"}, False),  # an Intel without AMX: not measured, left alone
    ("AuthenticAMD", {"avx2"}, False),  # Zen 3: bf16 is not native at all
])
def test_auto_packs_bf16_where_it_was_measured_fastest(monkeypatch, vendor, flags, packs):
    import core.precision as precision
    from core.precision import Bf16Support

    m16 = tiny_llama(seed=0).to(torch.bfloat16)
    auto = compose(rewrite_argv(["eval.prepack_weights=auto"])).eval
    monkeypatch.setattr(precision, "bf16_support", lambda device="cpu": Bf16Support("cpu", "native", "planted"))
    monkeypatch.setattr(precision, "_cpuinfo", lambda: (vendor, flags))
    monkeypatch.setattr(prepacked, "can_pack", lambda dtype: True)
    monkeypatch.setattr(prepacked, "prepack_row_consistent", lambda model: ["planted"])
    assert prepacked_products(m16, auto) == (["planted"] if packs else [])
    monkeypatch.setattr(prepacked, "prepack_row_consistent", lambda model: [])
    assert prepacked_products(m16, auto) == []
    with pytest.raises(ValueError, match="not row-consistent on this CPU for any linear layer"):
        prepacked_products(m16, compose(rewrite_argv(["eval.prepack_weights=true"])).eval)


def test_cost_key_holds_chunks_and_attention(model, monkeypatch):
    plain = cost_key({"base": "x"}, model, [1, 2], 16, 1)
    assert "prepacked_chunks" not in plain and "attention" not in plain  # eager, unpacked: older files stay valid
    _planted_blocking(monkeypatch, above=4)
    prepacked.prepack_row_consistent(model, dtypes=(torch.float32,), max_rows=16)
    key = cost_key({"base": "x"}, model, [1, 2], 16, 1)
    assert key["prepacked_chunks"] == [len(_linears(model)), 4] and key["prepacked_min_rows"] == 1
    sdpa = tiny_llama(seed=0, attn_implementation="sdpa")
    assert cost_key({"base": "x"}, sdpa, [1, 2], 16, 1)["attention"] == "sdpa"


@pytest.mark.skipif(not prepacked.can_pack(torch.bfloat16), reason="oneDNN cannot pack bf16 on this CPU")
def test_draft_head_is_packed_like_its_base_and_decoding_stays_vanilla(tiny_model_dir):
    """A bf16 falcon_k1 head over a base packed for every row count gets its own layers packed too
    (evaluation.methods.pack_like_base); speculative output still equals bf16 vanilla greedy decoding."""
    import heads
    from core.base_model import load_base_model
    from evaluation.methods import pack_like_base

    base, _, _ = load_base_model({"path": str(tiny_model_dir), "dtype": "bfloat16", "attn_implementation": "eager"})
    cfg = compose(rewrite_argv([f"model.path={tiny_model_dir}", "heads=falcon_k1"]))
    torch.manual_seed(0)
    head = heads.build(cfg.heads, base).to(torch.bfloat16).eval().requires_grad_(False)
    assert pack_like_base(head, base) == []  # an unpacked base: the head is left alone
    if not prepacked.prepack_row_consistent(base):
        pytest.skip("oneDNN's packed bf16 products are not row-consistent on this CPU")
    pad_one_row_products(base)
    names = pack_like_base(head, base)
    own = {n for n, m in head.named_modules() if isinstance(m, prepacked.LINEAR_TYPES)}
    assert set(names) == own and "frozen_draft_lm_head" in own  # the frozen LM-head rows too
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(2))
    ref, _ = greedy_generate(base, ids, 20)
    out, stats = SpeculativeDecoder(base, head.make_drafter(base)).generate(ids, 20)
    assert out == ref and stats["drafter_passes"] > 0


def test_fp32_draft_head_is_packed_like_its_base_lm_head_rows_included(tiny_model_dir):
    """An fp32 falcon_k1 head with a draft vocabulary over a base packed for >= 3-row products gets the
    same threshold on every linear layer, its product over the frozen rows W[d2t] included
    (evaluation.methods.pack_like_base): that product then matches the unpacked one to fp32 rounding over
    many rows and bit for bit over one and two, keeps no copy of the weight it packs, and speculative
    output still equals vanilla greedy decoding."""
    import heads
    from core.base_model import load_base_model
    from evaluation.methods import pack_like_base

    base, _, _ = load_base_model({"path": str(tiny_model_dir), "dtype": "float32", "attn_implementation": "eager"})
    cfg = compose(rewrite_argv([f"model.path={tiny_model_dir}", "heads=falcon_k1", "heads.draft_vocab_size=96"]))
    torch.manual_seed(0)
    counts = torch.randint(0, 1000, (base.config.vocab_size,), generator=torch.Generator().manual_seed(0))
    head = heads.build(cfg.heads, base, label_counts=counts).eval().requires_grad_(False)
    x = torch.randn(7, base.config.hidden_size, generator=torch.Generator().manual_seed(1))
    want = x @ base.lm_head.weight[head.d2t].T
    assert torch.equal(head.draft_lm_head(x), F.linear(x, base.lm_head.weight[head.d2t]))
    assert pack_like_base(head, base) == []  # an unpacked base: the head is left alone
    assert prepacked.prepack_linear_weights(base)
    names = pack_like_base(head, base)
    own = {n for n, m in head.named_modules() if isinstance(m, prepacked.LINEAR_TYPES)}
    assert set(names) == own and "frozen_draft_lm_head" in own
    assert "frozen_draft_lm_head.weight" not in head.state_dict()  # borrowed, never saved
    assert all(p.data_ptr() != head.draft_lm_head_rows.data_ptr() for p in head.parameters())
    torch.testing.assert_close(head.draft_lm_head(x), want, rtol=1e-5, atol=1e-5)
    for rows in (1, 2):  # below the threshold: F.linear's own kernel, bit for bit
        assert torch.equal(head.draft_lm_head(x[:rows]), F.linear(x[:rows], base.lm_head.weight[head.d2t]))
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(2))
    ref, _ = greedy_generate(base, ids, 24)
    out, stats = SpeculativeDecoder(base, head.make_drafter(base)).generate(ids, 24)
    assert out == ref and stats["drafter_passes"] > 0
    prepacked.restore_linear_weights(head)
    assert prepacked.packed_layers(head) == 0 and prepacked.packed_layers(base) > 0


def test_auto_min_rows_packs_small_products_only_where_timed_faster(model, monkeypatch):
    """``min_rows="auto"``: each weight shape's threshold comes from timing the packed product against
    ``F.linear`` over 2 rows, then 1 (decoding.prepacked.probe_min_rows, planted timings here), with a margin;
    a layer packed from 1 row computes its one-token product with the packed weight (the planted zero
    weight shows it), the cost key names the mix, and speculative output still equals vanilla greedy."""
    shapes = {tuple(lin.weight.shape) for lin in _linears(model)}
    lm = tuple(model.lm_head.weight.shape)
    attn = tuple(model.model.layers[0].self_attn.q_proj.weight.shape)
    assert lm in shapes and attn in shapes and lm != attn
    # per probed shape, the times of (F.linear, packed) over 2 rows, then over 1 row
    plan = {lm: [10.0, 1.0, 10.0, 1.0], attn: [10.0, 1.0, 1.0, 1.0]}
    calls = []

    def planted(fn, repeats):
        fn()  # the product still runs
        shape = calls[-1]  # the weight the probe reordered last
        k = planted.counts.setdefault(shape, 0)
        planted.counts[shape] += 1
        return plan.get(shape, [1.0, 1.0])[k]  # others: the packed product is no faster over 2 rows
    planted.counts = {}

    real_reorder = prepacked._reorder

    def reorder(w):
        calls.append(tuple(w.shape))
        return real_reorder(w)

    monkeypatch.setattr(prepacked, "_PROBED", {})
    monkeypatch.setattr(prepacked, "_median_seconds", planted)
    monkeypatch.setattr(prepacked, "_reorder", reorder)
    assert prepacked.probe_min_rows(model.lm_head.weight) == 1
    assert prepacked.probe_min_rows(model.model.layers[0].self_attn.q_proj.weight) == 2
    other = next(sh for sh in shapes if sh not in plan)
    w_other = next(lin.weight for lin in _linears(model) if tuple(lin.weight.shape) == other)
    assert prepacked.probe_min_rows(w_other) == prepacked.MIN_ROWS
    n_probes = len(planted.counts)
    prepacked.prepack_linear_weights(model, min_rows="auto")
    assert len(planted.counts) == len(shapes) and n_probes == 3  # each shape probed once: cached
    want = {id(lin): (1 if tuple(lin.weight.shape) == lm else 2 if tuple(lin.weight.shape) == attn
                      else prepacked.MIN_ROWS) for lin in _linears(model)}
    assert all(getattr(lin, prepacked._PACKED).min_rows == want[id(lin)] for lin in _linears(model))
    mix = prepacked.prepacked_min_rows(model)
    assert isinstance(mix, str) and mix.startswith("1x1,2x") and cost_key({"base": "x"}, model, [1], 16, 1)[
        "prepacked_min_rows"] == mix
    # the one-row product of the LM head now runs the packed weight: a planted zero packed weight shows it
    state = getattr(model.lm_head, prepacked._PACKED)
    real = state.packed
    state.packed = real_reorder(torch.zeros_like(model.lm_head.weight))
    x = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.count_nonzero(model.lm_head(x)) == 0
    state.packed = real
    torch.testing.assert_close(model.lm_head(x), F.linear(x, model.lm_head.weight), rtol=1e-5, atol=1e-5)
    ids = _prompt(5)
    ref, _ = greedy_generate(model, ids, 20)
    prepacked.restore_linear_weights(model)
    assert greedy_generate(model, ids, 20)[0] == ref  # the packed one-row kernel changed no vanilla token here
    prepacked.prepack_linear_weights(model, min_rows="auto")
    out, _ = SpeculativeDecoder(model, OracleDrafter(model, 3, 2)).generate(ids, 20)
    assert out == ref


@pytest.mark.skipif(not prepacked.can_pack(torch.float32), reason="oneDNN cannot pack fp32 on this CPU")
def test_vanilla_references_are_packed_as_the_evaluation_packs_its_base():
    """A vanilla reference in another dtype (the fastest-vanilla candidates) was loaded unpacked, so on a
    CPU where packing speeds vanilla up it was not the fastest vanilla of that dtype.  It is now packed
    as ``eval.prepack_weights`` packs the evaluation's base (once per dtype), decodes the same tokens, and
    ``false`` leaves it unpacked."""
    from decoding.vanilla import greedy_generate
    from evaluation.fastest_vanilla import packed_loader

    loads = []

    def load(dtype):
        loads.append(dtype)
        return tiny_llama(seed=0, initializer_range=0.3).to(getattr(torch, dtype))

    auto = packed_loader(load, compose(rewrite_argv(["eval.prepack_weights=auto"])).eval)
    ref = auto("float32")
    assert auto("float32") is ref and loads == ["float32"]
    assert all(hasattr(lin, prepacked._PACKED) for lin in _linears(ref))
    ids = torch.arange(3, 40)
    assert greedy_generate(ref, ids, 12)[0] == greedy_generate(load("float32"), ids, 12)[0]
    off = packed_loader(load, compose(rewrite_argv(["eval.prepack_weights=false"])).eval)("float32")
    assert not any(hasattr(lin, prepacked._PACKED) for lin in _linears(off))


def test_plain_products_run_f_linear_inside_the_block_only(model):
    """One fp32 copy serves as the packed vanilla reference and as the accountant's plain fp32 base:
    inside ``plain_products`` its logits equal an unpacked copy's bit for bit; after it the packed
    weights are used again."""
    import copy

    plain = copy.deepcopy(model)
    prepacked.prepack_linear_weights(model)
    ids = _prompt(3, 12)[None]
    with torch.no_grad():
        want = plain(input_ids=ids).logits
        with prepacked.plain_products(model):
            got = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert torch.equal(got, want)
    lin = _linears(model)[0]  # the packed path is back: a planted packed weight changes a many-row product
    state = getattr(lin, prepacked._PACKED)
    assert state.min_rows == prepacked.MIN_ROWS
    state.packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(lin.weight))
    x = torch.randn(4, lin.in_features)
    assert torch.count_nonzero(lin(x)) == 0
    with prepacked.plain_products(model):
        assert torch.count_nonzero(lin(x)) > 0
    torch.testing.assert_close(after, want, rtol=1e-4, atol=1e-4)
