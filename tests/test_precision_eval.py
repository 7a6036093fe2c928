"""Evaluation in bf16 (issue 26) on the tiny model: the parity accounting (a planted near tie is
reported with the right fields and passes; a planted wrong acceptance is a real error and fails),
the rule's boundary, row-consistent one-token steps, every head's drafter in the eval dtype, the
c(n) cache key's dtype, the tree planner on flat vs steep c(n), and a refused ``eval.dtype``."""
from __future__ import annotations

import json

import pytest
import torch

import heads
from core.base_model import load_base_model
from core.config import compose
from core.tiny import save_tiny_model
from decoding import cost_model
from decoding.cost_model import CostModel
from decoding.numerics import pad_one_row_products, restore_one_row_products
from decoding.tree import DraftTree
from decoding.tree_search import choose_budget, choose_rank_tree
from decoding.vanilla import greedy_generate
from decoding.verify import base_forward, new_cache, verify_tree
from evaluation.__main__ import main, rewrite_argv
from evaluation.divergence import NEAR_TIE_ULPS, classify, ulp
from evaluation.runner import run_evaluation

BF16 = torch.bfloat16


def _prompts(tmp_path, n=1):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Tell me about the sea, number {i}."}) + "\n"
                            for i in range(n)))
    return path


def _cfg(model_dir, tmp_path, *extra):
    return compose(rewrite_argv([f"model.path={model_dir}", "model.attn_implementation=eager",
                                 f"output_root={tmp_path / 'root'}", f"eval.output_dir={tmp_path / 'out'}",
                                 f"eval.prompts={_prompts(tmp_path)}", "eval.max_new_tokens=12", "eval.warmup=0",
                                 "eval.dtype=bfloat16", "eval.tree=config", *extra]))


# -- a planted near tie --------------------------------------------------------------------------
def _exact(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16 logits rounded once from the exact products (fp64 sums of bf16 products are exact here)."""
    return (rows.double() @ w.double().T).to(BF16)


def _split(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same logits summed in two halves, each rounded to bf16, then added in bf16: another order."""
    h = rows.shape[-1] // 2
    return _exact(rows[:, :h], w[:, :h]) + _exact(rows[:, h:], w[:, h:])


class SplitOrderHead(torch.nn.Module):
    """An LM head whose one-row product (the one-token step) sums in another order than its many-row
    product (verification): what a matrix-vector vs a blocked GEMM kernel does, on every machine."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        y = _split(rows, self.weight) if rows.shape[0] == 1 else _exact(rows, self.weight)
        return y.reshape(*x.shape[:-1], self.weight.shape[0])


def _planted_near_tie(tmp_path, cfg):
    """A tiny untied Llama whose LM-head row b equals row a (the greedy token at generated position
    1) up to a few bf16 ulps in one entry, chosen so that at position 1 the one-token step (split
    order) and verification (exact order) choose different ones of {a, b}.

    Returns:
        (fp32 model dir, bf16 model with :class:`SplitOrderHead`, tokenizer, identity, the one-token
        step's token, verification's token, the final hidden state h [1, H] at that step, prompt ids).
    """
    from evaluation.prompts import load_prompts

    src = save_tiny_model(tmp_path / "tiny_src", seed=0, tie_word_embeddings=False)
    m16, tok, ident = load_base_model({"path": str(src), "dtype": "bfloat16", "attn_implementation": "eager"})
    prompt_ids = load_prompts(cfg.eval, cfg.data, tok)[0][0].input_ids
    pad_one_row_products(m16)  # what the evaluation does: the body's rows agree, so only the head differs
    cache = new_cache(m16)
    logits, _ = base_forward(m16, prompt_ids, cache, logits_to_keep=1)
    first = int(logits[-1].argmax())
    _, hidden = base_forward(m16, torch.tensor([first]), cache)
    h = hidden[-1][None]  # final post-norm state at the step that chooses generated token 1
    w = m16.lm_head.weight.detach().clone()
    a = int(_split(h, w).argmax())
    b = max(set(range(3, w.shape[0])) - {a, first} - set(prompt_ids.tolist()))  # never an input before position 1
    rest = [i for i in range(w.shape[0]) if i not in (a, b)]
    others = max(float(_split(h, w[rest]).max()), float(_exact(h, w[rest]).max()))
    za_s, za_e = float(_split(h, w[[a]])[0, 0]), float(_exact(h, w[[a]])[0, 0])
    steps = torch.tensor([sign * k for k in range(1, 256) for sign in (1, -1)], dtype=torch.int16)
    for j in range(w.shape[1]):  # all |k| <= 255 bf16-ulp moves of entry j of row a at once
        rows = w[a].repeat(len(steps), 1)
        rows[:, j] = (rows[:, j].clone().view(torch.int16) + steps).view(BF16)
        zb_s, zb_e = _split(h, rows)[0].float(), _exact(h, rows)[0].float()
        step_b, verify_b = zb_s > za_s, zb_e > za_e  # ties go to the lower id, a
        hit = ((step_b != verify_b) & (torch.minimum(torch.maximum(zb_s, torch.tensor(za_s)),
                                                     torch.maximum(zb_e, torch.tensor(za_e))) > others)).nonzero()
        if len(hit):
            i = int(hit[0, 0])
            step_tok, verify_tok = (b if step_b[i] else a), (b if verify_b[i] else a)
            cand = w.clone()
            cand[b] = rows[i]
            state = {name: v.float() for name, v in m16.state_dict().items()}
            state["lm_head.weight"] = cand.float()  # exact in bf16: the bf16 load gets these rows back
            m32 = type(m16)(m16.config)
            m32.load_state_dict(state)
            out = tmp_path / "tiny_tie"
            m32.save_pretrained(out, safe_serialization=True)
            tok.save_pretrained(out)
            model, tok2, ident2 = load_base_model({"path": str(out), "dtype": "bfloat16",
                                                   "attn_implementation": "eager"})
            model.lm_head = SplitOrderHead(model.lm_head.weight)
            return out, model, tok2, ident2, step_tok, verify_tok, h, prompt_ids
    raise AssertionError("no planted near tie found")


def test_planted_near_tie_is_reported_with_its_margins_and_passes(tmp_path):
    torch.set_num_threads(1)
    cfg = _cfg(tmp_path / "tiny_tie", tmp_path, "checkpoint=oracle", "eval.reference_depth=3")
    model_dir, model, tok, ident, a, b, h, prompt = _planted_near_tie(tmp_path, cfg)
    van, _ = greedy_generate(model, prompt, 12, [])
    assert van[1] == a  # the one-token step's choice (b: verification's)
    rep = run_evaluation(cfg, base=(model, tok, ident))  # fail_on_mismatch: a near tie must not fail
    par = rep["parity"]
    assert par["mode"] == "accounting" and par["matched"] == 0
    acc = par["accounting"]
    assert acc["diverged"] == 1 and acc["near_ties"] == 1 and acc["real_errors"] == 0 and acc["error_ids"] == []
    assert acc["divergence_rate"] == 1.0
    assert acc["share_before_first_divergence"] == pytest.approx(1 / len(van))
    div = acc["divergences"][0]
    assert (div["position"], div["vanilla_token"], div["method_token"], div["class"]) == (1, a, b, "near_tie")
    w = model.lm_head.weight
    split, exact = _split(h, w)[0].float(), _exact(h, w)[0].float()
    # vanilla's margin: its one-token step (split order), a first; the method's: verification's row (exact order)
    assert div["vanilla_top2"]["ids"] == [a, b] and div["vanilla_top2"]["logits"] == [float(split[a]), float(split[b])]
    assert div["method_top2"]["ids"] == [b, a] and div["method_top2"]["logits"] == [float(exact[b]), float(exact[a])]
    assert div["method_top2"]["margin"] == float(exact[b] - exact[a]) >= 0
    # the fp32 margin: one fp32 forward over the shared prefix (prompt + generated token 0)
    m32 = load_base_model({"path": str(model_dir), "dtype": "float32", "attn_implementation": "eager"})[0]
    z32 = m32(input_ids=torch.cat([prompt, torch.tensor([van[0]])])[None]).logits[0, -1]
    assert div["fp32"]["delta"] == pytest.approx(float(z32[a] - z32[b]), abs=1e-6)
    assert div["bound"] == pytest.approx(NEAR_TIE_ULPS * ulp(float(z32.abs().max()), BF16))
    assert abs(div["fp32"]["delta"]) <= div["bound"]
    assert rep["per_prompt"][0]["divergence"]["position"] == 1


def test_planted_wrong_acceptance_is_a_real_error_and_fails(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A decoder bug (verification accepts the first child whatever the argmax) is flagged as a
    real error, not a tie, and the evaluation exits 1 like an fp32 parity failure."""
    from decoding import verify

    real = verify.greedy_accept

    def buggy(tree, predictions):
        path = real(tree, predictions)
        kids = tree.children(0)
        return path if len(path) > 1 or not kids else [0, kids[0]]  # accepts a wrong depth-1 draft

    monkeypatch.setattr(verify, "greedy_accept", buggy)
    argv = [f"model.path={tiny_model_dir}", "model.attn_implementation=eager", f"output_root={tmp_path / 'root'}",
            f"eval.output_dir={tmp_path / 'out'}", f"eval.prompts={_prompts(tmp_path)}", "eval.max_new_tokens=8",
            "eval.warmup=0", "eval.dtype=bfloat16", "eval.tree=config", "checkpoint=random"]
    assert main(argv) == 1
    assert "by more than a near tie" in capsys.readouterr().err
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    acc = rep["parity"]["accounting"]
    assert acc["real_errors"] == 1 and acc["near_ties"] == 0 and acc["error_ids"] == ["p0"]
    div = acc["divergences"][0]
    assert div["class"] == "real_error" and "did not choose" in div["reason"]
    assert div["method_top2"]["ids"][0] != div["method_token"]


def test_near_tie_rule_boundary():
    c = NEAR_TIE_ULPS
    z = torch.zeros(10)
    z[0], z[3] = 20.0, 20.0 - c * ulp(20.0, BF16)  # exactly at the bound: a near tie
    tie = classify(0, 3, [0, 20.0, 3, 19.9], [3, 20.0, 0, 19.9], z, BF16)
    assert tie["class"] == "near_tie" and tie["bound"] == c * 2.0 ** 4 * 2.0 ** -7  # ulp_bf16(20) = 2^4 · 2^-7
    z[3] = 20.0 - 1.01 * c * ulp(20.0, BF16)
    assert classify(0, 3, [0, 20.0, 3, 19.9], [3, 20.0, 0, 19.9], z, BF16)["class"] == "real_error"
    # an inconsistent vanilla replay, or an output that stops early, is never a tie
    z[3] = 20.0
    assert "not deterministic" in classify(0, 3, [3, 20.0, 0, 20.0], None, z, BF16)["reason"]
    assert classify(0, None, [0, 20.0, 3, 19.9], None, None, BF16)["class"] == "real_error"


@pytest.mark.parametrize("kernels", ["padded", "prepacked"])
def test_row_consistent_one_token_steps_equal_verification_rows(tiny_model_dir, kernels):
    """With ``pad_one_row_products`` (eval.row_consistent, the default), or with bf16 weights packed
    for every row count first (eval.prepack_weights on an AMX CPU), every row of a bf16 verification
    forward equals the one-token step of vanilla decoding bit for bit."""
    from decoding import prepacked

    torch.set_num_threads(1)
    m, _, _ = load_base_model({"path": str(tiny_model_dir), "dtype": "bfloat16", "attn_implementation": "eager"})
    if kernels == "prepacked":
        if not prepacked.can_pack(torch.bfloat16) or not prepacked.prepack_row_consistent(m):
            pytest.skip("oneDNN's packed bf16 products are not available or not row-consistent on this CPU")
    pad_one_row_products(m)
    try:
        ids = torch.randint(3, 384, (12,), generator=torch.Generator().manual_seed(1))
        van, _ = greedy_generate(m, ids, 24)
        cache = new_cache(m)
        lg, _ = base_forward(m, ids, cache, logits_to_keep=1)
        steps = [lg[-1]]
        for t in van[:-1]:
            lg, _ = base_forward(m, torch.tensor([t]), cache)
            steps.append(lg[-1])
        for t in range(1, 16, 5):
            c = new_cache(m)
            base_forward(m, ids, c)
            for j in range(t - 1):
                base_forward(m, torch.tensor([van[j]]), c)
            tree = DraftTree.chain(van[t - 1], van[t:t + 7])
            p = c.get_seq_length()
            lg, _ = base_forward(m, tree.tokens, c, position_ids=tree.position_ids(p),
                                 attention_mask=tree.attention_mask(p, m.dtype, torch.device("cpu")))
            for i in range(tree.num_nodes):
                assert torch.equal(lg[i], steps[t + i]), (t, i)
            # a branching tree (two wrong siblings per depth, listed after the right child): verify_tree
            # feeds it depth-first, so the top-ranked path's rows equal the one-token steps too
            paths = [van[t:t + d] + [(van[t + d] + k * 97) % 384] for d in range(6) for k in (1, 2)] + [van[t:t + 6]]
            branch = DraftTree.from_paths(van[t - 1], paths, scores=[-1.0] * 12 + [0.0])
            c = new_cache(m)
            base_forward(m, ids, c)
            for j in range(t - 1):
                base_forward(m, torch.tensor([van[j]]), c)
            res = verify_tree(m, c, branch)
            assert res.num_accepted == 6
            for i, node in enumerate(res.accepted_nodes):
                assert torch.equal(res.logits[node], steps[t + i]), (t, i)
    finally:
        restore_one_row_products(m)
        prepacked.restore_linear_weights(m)
    assert not any(hasattr(mod, "_draftheads_one_row_padded") for mod in m.modules())


@pytest.mark.parametrize("head", ["ctc", "falcon", "falcon_k1", "eagle3", "adadecode"])
def test_every_head_drafts_in_the_eval_dtype(tiny_base, tiny_model_dir, tmp_path, head):
    torch.set_num_threads(1)
    cfg = _cfg(tiny_model_dir, tmp_path, f"heads={head}", f"checkpoint={tmp_path / 'ckpt'}",
               *(["heads.layers=[1,2,3]"] if head in ("adadecode", "eagle3") else []))
    torch.manual_seed(0)
    heads.save(heads.build(cfg.heads, tiny_base[0]), tmp_path / "ckpt", tiny_base[2].to_dict())
    rep = run_evaluation(cfg)
    prec = rep["info"]["precision"]
    assert rep["dtype"] == prec["base"] == "bfloat16" and prec["head"] == "bfloat16"
    assert rep["parity"]["mode"] == "accounting" and rep["parity"]["accounting"]["real_errors"] == 0


def test_cost_model_keys_keep_fp32_and_bf16_apart(tiny_base, tmp_path, monkeypatch):
    model, _, identity = tiny_base
    calls = []
    real = cost_model.measure_verify_ms
    monkeypatch.setattr(cost_model, "measure_verify_ms", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    m16 = type(model)(model.config).eval()
    m16.load_state_dict(model.state_dict())
    m16.to(BF16)
    a = cost_model.load_or_measure(model, identity, tmp_path, [1, 2, 4], context_tokens=8, repeats=1)
    b = cost_model.load_or_measure(m16, identity, tmp_path, [1, 2, 4], context_tokens=8, repeats=1)
    again = cost_model.load_or_measure(model, identity, tmp_path, [1, 2, 4], context_tokens=8, repeats=1)
    assert calls == [torch.float32, BF16]  # the fp32 file was not overwritten by the bf16 measurement
    assert (a.key["dtype"], b.key["dtype"]) == ("float32", "bfloat16") and a.path != b.path == b.path
    assert again.path == a.path and again.verify_ms == a.verify_ms


def _cost(ratios):
    sizes = [1, 2, 4, 8, 16, 32]
    return CostModel(sizes=sizes, verify_ms=[25.0 * r for r in ratios], key={}, context_tokens=256, repeats=1)


# c(n)/c(1) at n = 1, 2, 4, 8, 16, 32: flat = issue 26's bf16 measurement; steep = each node costs a fifth of a step
FLAT, STEEP = [1.0, 1.00, 1.03, 1.12, 1.30, 1.63], [1 + 0.2 * (n - 1) for n in (1, 2, 4, 8, 16, 32)]


def test_auto_tree_grows_where_cost_is_flat():
    p = [[0.6 * 0.35 ** r for r in range(8)] for _ in range(6)]  # rank acceptance per depth
    flat = choose_rank_tree(p, _cost(FLAT).verify_seconds, lambda d: 0.002 * d, [1, 2, 4, 8, 16, 32], 6)
    steep = choose_rank_tree(p, _cost(STEEP).verify_seconds, lambda d: 0.002 * d, [1, 2, 4, 8, 16, 32], 6)
    assert flat.nodes > steep.nodes and flat.tau > steep.tau and flat.nodes >= 8
    tau = {1: 1.0, 2: 1.6, 4: 2.1, 8: 2.5, 16: 2.8, 32: 3.0}  # a budget head (ctc, eagle3, dynamic)
    assert choose_budget(tau, _cost(FLAT).verify_seconds, 0.002).nodes > choose_budget(tau, _cost(STEEP).verify_seconds, 0.002).nodes


def test_bad_eval_dtype_is_refused_before_anything_is_written(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main([f"model.path={tiny_model_dir}", f"output_root={tmp_path / 'root'}", f"eval.output_dir={out}",
              "checkpoint=oracle", "eval.dtype=bad"])
    assert exc.value.code == 2
    assert "eval.dtype" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "root").exists()


def test_verify_tree_feeds_the_top_ranked_path_in_the_one_token_steps_layout(tiny_model_dir):
    """verify_tree feeds a branching tree depth-first: the top-ranked path (root, first child, its
    first child, ...) sits in consecutive cache slots P, P+1, ..., and its row k sees exactly the
    columns [0, P+k] a one-token step sees (no masked sibling in between).  The breadth-first
    canonical order interleaves siblings with the path, which in bf16 on SmolLM2 left 10 of 294
    path rows differing from the one-token steps (docs/precision_eval.md); the tiny model's 16-wide
    heads do not show that rounding, so the layout itself is asserted.  The accepted logits, hidden
    states and cache stay those of the canonical node order (fp32, against a breadth-first forward)."""
    torch.set_num_threads(1)
    m, _, _ = load_base_model({"path": str(tiny_model_dir), "dtype": "float32", "attn_implementation": "eager"})
    ids = torch.randint(3, 384, (9,), generator=torch.Generator().manual_seed(2))
    van, _ = greedy_generate(m, ids, 8)
    paths = [van[1:1 + d] + [(van[1 + d] + k * 97) % 384] for d in range(4) for k in (1, 2)] + [van[1:6]]
    tree = DraftTree.from_paths(van[0], paths, scores=[-1.0] * 8 + [0.0])
    top, node = [0], 0
    while tree.children(node):
        node = tree.children(node)[0]
        top.append(node)
    assert top != list(range(len(top)))  # breadth-first, the path is not consecutive: the case under test
    seen = {}

    def spy(module, args, kwargs):
        seen.update(pos=kwargs["position_ids"].clone(), mask=kwargs["attention_mask"].clone(),
                    ids=kwargs["input_ids"].clone())

    c0 = new_cache(m)
    base_forward(m, ids, c0)
    past = c0.get_seq_length()
    ref_cache = new_cache(m)
    base_forward(m, ids, ref_cache)
    ref_logits, ref_hidden = base_forward(m, tree.tokens, ref_cache, position_ids=tree.position_ids(past),
                                          attention_mask=tree.attention_mask(past, m.dtype))
    h = m.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        res = verify_tree(m, c0, tree)
    finally:
        h.remove()
    visible = seen["mask"][0, 0] == 0  # [N, P+N]
    for k in range(len(top)):
        assert int(seen["ids"][0, k]) == int(tree.tokens[top[k]]) and int(seen["pos"][0, k]) == past + k
        assert visible[k, :past + k + 1].all() and not visible[k, past + k + 1:].any(), k
    assert res.accepted_nodes == top and res.num_accepted == len(top) - 1
    torch.testing.assert_close(res.logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.hidden, ref_hidden[torch.tensor(top)], rtol=1e-5, atol=1e-5)
    fresh = new_cache(m)
    base_forward(m, torch.cat([ids, tree.tokens[torch.tensor(top)]]), fresh)
    for a, b in zip(c0.layers, fresh.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


# -- the speed headline against the fastest vanilla ------------------------------------------------
def test_bf16_report_is_against_the_fastest_vanilla_timed_in_the_same_run(tiny_model_dir, tmp_path):
    """A bf16 evaluation also times fp32 vanilla on the same prompts (eval.fastest_vanilla=auto): the
    report names the fastest vanilla, its tokens/s, and the method's speedup against it; summary.md
    shows every vanilla.  Forcing one-row padding on the tiny model adds the native-kernel bf16 vanilla."""
    import decoding.numerics as numerics

    torch.set_num_threads(1)
    cfg = _cfg(tiny_model_dir, tmp_path, "checkpoint=oracle", "eval.reference_depth=2")
    real = numerics.one_row_differs
    numerics.one_row_differs = lambda w, b=None, **k: tuple(w.shape) == (64, 128) or real(w, b, **k)
    try:
        rep = run_evaluation(cfg)
    finally:
        numerics.one_row_differs = real
    fv = rep["fastest_vanilla"]
    assert rep["info"]["row_consistent_layers"] > 0
    assert set(fv["candidates"]) == {"bfloat16", "float32", "bfloat16 (native one-row kernels)",
                                     "bfloat16 (sdpa attention)", "float32 (sdpa attention)"}
    assert all(v > 0 for v in fv["candidates"].values()) and fv["candidates"]["bfloat16"] == rep["vanilla"]["tokens_per_s"]
    assert fv["label"] == max(fv["candidates"], key=fv["candidates"].get)
    assert fv["tokens_per_s"] == fv["candidates"][fv["label"]]
    assert fv["speedup"] == pytest.approx(rep["method"]["tokens_per_s"] / fv["tokens_per_s"])
    rec = [r for r in map(json.loads, (tmp_path / "out" / "progress.jsonl").read_text().splitlines())
           if "methods" in r][0]
    assert set(rec["vanilla_refs"]) == {"float32", "bfloat16 (native one-row kernels)", "bfloat16 (sdpa attention)",
                                        "float32 (sdpa attention)"}
    assert rec["vanilla_refs"]["float32"]["tokens"] > 0
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "## Against the fastest vanilla" in md and f"| {fv['label']} |" in md


def test_fp32_report_times_bf16_vanilla_only_where_bf16_is_native(tiny_model_dir, tmp_path, monkeypatch):
    torch.set_num_threads(1)
    cfg = _cfg(tiny_model_dir, tmp_path, "checkpoint=oracle", "eval.dtype=float32", "eval.reference_depth=2")
    rep = run_evaluation(cfg)  # the suite pins DRAFTHEADS_BF16=slow: bf16 cannot be the faster vanilla
    # the eval's base runs eager attention (tree masks); vanilla can run sdpa, so that is timed too
    assert set(rep["fastest_vanilla"]["candidates"]) == {"float32", "float32 (sdpa attention)"}
    assert rep["fastest_vanilla"]["candidates"]["float32"] == rep["vanilla"]["tokens_per_s"]
    cand = rep["fastest_vanilla"]["candidates"]
    assert rep["fastest_vanilla"]["label"] == max(cand, key=cand.get) and "mode" not in rep["parity"]
    recs = [r for r in map(json.loads, (tmp_path / "out" / "progress.jsonl").read_text().splitlines()) if "methods" in r]
    assert recs and all(r["vanilla_refs"]["float32 (sdpa attention)"]["same_tokens"] for r in recs)
    assert rep["parity"]["matched"] == rep["parity"]["total"]  # fp32: exact parity, as before
    monkeypatch.setenv("DRAFTHEADS_BF16", "native")
    cfg = _cfg(tiny_model_dir, tmp_path, "checkpoint=oracle", "eval.dtype=float32", "eval.reference_depth=2",
               f"eval.output_dir={tmp_path / 'out2'}")
    rep = run_evaluation(cfg)
    assert set(rep["fastest_vanilla"]["candidates"]) == {"float32", "bfloat16", "float32 (sdpa attention)",
                                                         "bfloat16 (sdpa attention)"}


def test_fastest_vanilla_entries_name_dtype_and_attention():
    """``eval.fastest_vanilla`` labels: a list entry ``dtype:attention`` times that attention; the
    evaluation's own (dtype, attention) is never timed twice; an sdpa base gets no sdpa twins."""
    from omegaconf import OmegaConf

    from evaluation.config_checks import check_fastest_vanilla_entries as check_entries
    from evaluation.fastest_vanilla import parse_label, reference_labels

    class Base:  # only what reference_labels reads
        def __init__(self, dtype, attention):
            self.dtype, self.config = dtype, type("C", (), {"_attn_implementation": attention})()

    ev = lambda v: OmegaConf.create({"fastest_vanilla": v})
    eager32 = Base(torch.float32, "eager")
    assert reference_labels(ev(["float32:sdpa", "float32:eager", "bfloat16"]), eager32, "cpu", []) == [
        "float32 (sdpa attention)", "bfloat16"]
    assert reference_labels(ev("auto"), Base(torch.bfloat16, "eager"), "cpu", ["x"]) == [
        "float32", "bfloat16 (native one-row kernels)", "bfloat16 (sdpa attention)", "float32 (sdpa attention)"]
    assert reference_labels(ev("auto"), Base(torch.bfloat16, "sdpa"), "cpu", []) == ["float32"]
    assert reference_labels(ev("off"), eager32, "cpu", []) == []
    # `eval.fastest_vanilla=off` typed on a command line: YAML reads off as False; it means off, not an error
    from core.config import compose, validate

    cli = compose(rewrite_argv(["eval.fastest_vanilla=off"]))
    assert cli.eval.fastest_vanilla is False
    # an override after a wrapper's: typed by the key's default (auto), not by the earlier override's list
    assert compose(rewrite_argv(["eval.fastest_vanilla=[float32]", "eval.fastest_vanilla=off"])).eval.fastest_vanilla is False
    assert list(compose(rewrite_argv(["eval.fastest_vanilla=off", "eval.fastest_vanilla=[bfloat16]"])).eval.fastest_vanilla) \
        == ["bfloat16"]
    validate(cli)
    assert reference_labels(cli.eval, eager32, "cpu", []) == []
    # the evaluation's own vanilla however it is spelt: its native one-row kernels are the other vanilla
    eager16 = Base(torch.bfloat16, "eager")
    for spelt in (["bfloat16"], ["bfloat16:eager"]):
        assert reference_labels(ev(spelt), eager16, "cpu", ["x"]) == ["bfloat16 (native one-row kernels)"], spelt
    assert parse_label("float32 (sdpa attention)") == ("float32", "sdpa", False)
    assert parse_label("bfloat16 (native one-row kernels)") == ("bfloat16", None, True)
    assert parse_label("float32") == ("float32", None, False)
    assert check_entries(["float32:sdpa", "bfloat16"]) == [] and check_entries(["float32:flash", "fp64"]) == [
        "float32:flash", "fp64"]
    with pytest.raises(ValueError, match="float32:flash"):
        reference_labels(ev(["float32:flash"]), eager32, "cpu", [])


def test_bad_fastest_vanilla_is_refused_before_anything_is_written(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exc:
        main([f"model.path={tiny_model_dir}", f"output_root={tmp_path / 'root'}", f"eval.output_dir={out}",
              "checkpoint=oracle", "eval.fastest_vanilla=fp64"])
    assert exc.value.code == 2 and "eval.fastest_vanilla" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "root").exists()


def test_sleeping_openmp_threads_are_named_before_timing(monkeypatch):
    """OMP_WAIT_POLICY=PASSIVE made a 2-thread one-token step 2.8x slower here: a timing run under it
    says so (however the variable is spelt, as OpenMP reads it); one thread, another policy or a GPU do not."""
    from decoding.cost_model import omp_wait_policy
    from evaluation.runner import wait_policy_warning

    monkeypatch.setenv("OMP_WAIT_POLICY", " passive ")
    msg = wait_policy_warning("cpu", 2, omp_wait_policy())
    assert msg and "OMP_WAIT_POLICY=PASSIVE with 2 threads" in msg and "not speed figures" in msg
    assert wait_policy_warning("cpu", 1, "PASSIVE") is None
    assert wait_policy_warning("cpu", 2, "ACTIVE") is None and wait_policy_warning("cpu", 2, None) is None
    assert wait_policy_warning("cuda", 8, "PASSIVE") is None


def test_references_share_the_weights_and_restore_the_attention(tiny_model_dir):
    """A reference in the evaluation's dtype runs on the evaluation's own base with its attention
    switched for the call only (restored after it, also when it raises); another dtype is loaded once."""
    from core.base_model import load_base_model
    from evaluation.fastest_vanilla import attention_as, build_references, model_attention

    torch.set_num_threads(1)
    model = load_base_model({"path": str(tiny_model_dir), "dtype": "float32", "attn_implementation": "eager"})[0]
    loads = []

    def load(dtype):
        loads.append(dtype)
        return load_base_model({"path": str(tiny_model_dir), "dtype": dtype, "attn_implementation": "eager"})[0]

    refs = build_references(["float32 (sdpa attention)", "bfloat16", "bfloat16 (sdpa attention)"], model, load, [])
    assert loads == ["bfloat16"]
    ids = torch.tensor([1, 5, 9, 17, 33])
    sdpa_tokens, _ = refs["float32 (sdpa attention)"](ids, 6)
    assert model_attention(model) == "eager"
    eager_tokens, _ = greedy_generate(model, ids, 6, [])
    assert sdpa_tokens == eager_tokens
    with pytest.raises(RuntimeError):
        with attention_as(model, "sdpa"):
            assert model_attention(model) == "sdpa"
            raise RuntimeError("a decoder failed")
    assert model_attention(model) == "eager"


def test_a_bf16_run_loads_one_fp32_copy_for_its_reference_and_its_accountant(tmp_path, monkeypatch):
    """The fp32 vanilla reference (packed, timed) and the near-tie accountant (plain fp32 logits) used to
    load two fp32 copies of the base: for an 8B base, 64 GB.  Now one, and the margin is the plain one."""
    import core.base_model

    torch.set_num_threads(1)
    cfg = _cfg(tmp_path / "tiny_tie", tmp_path, "checkpoint=oracle", "eval.reference_depth=3",
               "eval.fastest_vanilla=[float32]")
    model_dir, model, tok, ident, a, b, h, prompt = _planted_near_tie(tmp_path, cfg)
    loads = []
    real = core.base_model.load_base_model_as
    monkeypatch.setattr(core.base_model, "load_base_model_as",
                        lambda model_cfg, dtype, *a_, **k: loads.append(dtype) or real(model_cfg, dtype, *a_, **k))
    rep = run_evaluation(cfg, base=(model, tok, ident))
    assert loads == ["float32"]
    assert set(rep["fastest_vanilla"]["candidates"]) == {"bfloat16", "float32"}
    div = rep["parity"]["accounting"]["divergences"][0]
    van, _ = greedy_generate(model, prompt, 2, [])
    m32 = load_base_model({"path": str(model_dir), "dtype": "float32", "attn_implementation": "eager"})[0]
    with torch.no_grad():
        z32 = m32(input_ids=torch.cat([prompt, torch.tensor([van[0]])])[None]).logits[0, -1]
    assert div["fp32"]["delta"] == float(z32[a] - z32[b])  # plain products, bit for bit
