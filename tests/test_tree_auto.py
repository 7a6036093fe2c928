"""Issue 14 end to end on the tiny model: eval.tree=auto|dynamic keeps parity for every tree head,
calibrates on held-out prompts only, caches c(n) per hardware key, and refuses bad input early."""
from __future__ import annotations

import json

import pytest
import torch

import heads
from core.config import ConfigError, compose
from decoding import cost_model
from decoding.tree_search import AcceptanceStats
from evaluation.__main__ import main, rewrite_argv
from evaluation.runner import run_evaluation
from evaluation.tree_auto import CalibrationError


def _cfg(tiny_model_dir, tmp_path, sharegpt, head, *extra):
    return compose(rewrite_argv([f"model.path={tiny_model_dir}", "model.attn_implementation=eager", f"heads={head}",
                                 f"output_root={tmp_path / 'root'}", f"eval.output_dir={tmp_path / 'out'}",
                                 f"data.path={sharegpt}", "data.heldout_fraction=0.3", "eval.num_prompts=2",
                                 "eval.max_new_tokens=10", "eval.warmup=0", "eval.calibration_prompts=3",
                                 "eval.tree_grid=[1,2,3,4,6,8]", "eval.cost_context_tokens=16",
                                 f"checkpoint={tmp_path / 'ckpt'}", *extra]))


def _save_head(cfg, tiny_base, tmp_path):
    torch.manual_seed(0)
    heads.save(heads.build(cfg.heads, tiny_base[0]), tmp_path / "ckpt", tiny_base[2].to_dict())


@pytest.fixture
def planted(monkeypatch):
    """Planted high acceptance makes the search pick real trees (an untrained head accepts ~nothing), and a
    planted cost model (c(n) = 1 s + 1 ms per node): a measured one on a loaded machine can make one tree size
    look dear and the search pick the root alone (seen in CI under load)."""
    monkeypatch.setattr(AcceptanceStats, "rank_acceptance", lambda self: [[0.7, 0.2, 0.05]] * 8)
    monkeypatch.setattr(AcceptanceStats, "budget_tau", lambda self: {1: 1.0, 2: 1.6, 3: 1.9, 4: 2.3, 6: 2.6, 8: 2.8})
    import evaluation.tree_auto as tree_auto

    real_measure = tree_auto.load_or_measure

    def planted_cost(*args, **kwargs):
        cost = real_measure(*args, **kwargs)
        cost.verify_ms = [1000.0 + n for n in cost.sizes]
        return cost

    monkeypatch.setattr(tree_auto, "load_or_measure", planted_cost)


@pytest.mark.parametrize("head", ["ctc", "falcon", "falcon_k1", "eagle3"])
@pytest.mark.parametrize("mode", ["auto", "dynamic"])
def test_auto_trees_keep_parity_for_every_tree_head(tiny_base, tiny_model_dir, tmp_path, sharegpt, head, mode,
                                                    planted):
    extra = ["heads.layers=[1,2,3]"] if head == "eagle3" else []  # the tiny base has 4 layers
    cfg = _cfg(tiny_model_dir, tmp_path, sharegpt, head, f"eval.tree={mode}", *extra)
    _save_head(cfg, tiny_base, tmp_path)
    rep = run_evaluation(cfg, base=tiny_base)
    assert rep["parity"] == {"matched": 2, "total": 2, "mismatched_ids": [], "checked": True}
    tree = rep["tree"]
    assert tree["applied"] and tree["mode"] == mode and tree["statistics"]["source"] == "calibration"
    # never calibrated on an evaluation prompt
    cal = json.loads(open(tree["statistics"]["path"]).read())
    assert not set(cal["key"]["prompts"]) & {p["id"] for p in rep["per_prompt"]} and cal["key"]["prompts"]
    chosen = tree["chosen"]
    assert chosen["nodes"] > 1 and chosen["tau"] == tree["predicted_tau"]
    assert rep["tree"]["measured_tau"] == rep["tau"]
    trees_seen = max(s["stats"]["tree_nodes"] / max(s["stats"]["steps"], 1) for s in rep["per_prompt"])
    assert trees_seen <= chosen["nodes"] - 1  # every verified tree within the chosen size
    best = max(c["tokens_per_s"] for c in chosen["candidates"])
    assert chosen["tokens_per_s"] == best
    limits = tree["limits"]  # speedup = tau / (step in vanilla steps); a free drafter is never predicted slower
    assert tree["predicted_speedup"] * limits["step_in_vanilla_steps"] == pytest.approx(tree["predicted_tau"])
    assert limits["drafter_free"]["speedup"] >= tree["predicted_speedup"] * (1 - 1e-9)
    assert 1.0 < limits["verify_in_vanilla_steps"] <= limits["step_in_vanilla_steps"] and 0 <= limits["drafter_share"] < 1
    if head == "eagle3":  # EAGLE-2 budget n* = total_tokens + 1; no deeper or wider expansion than n* - 1
        n = chosen["nodes"]
        assert chosen["decoding"] == {"total_tokens": n - 1, "depth": min(8, n - 1), "topk": min(10, n - 1)}
        assert cal["key"]["calibration"] == {"decoding": {"total_tokens": 7}}  # the largest grid budget, 8 nodes


def test_tau_objective_drafts_the_highest_tau_tree_of_the_budget(tiny_base, tiny_model_dir, tmp_path, sharegpt,
                                                                 planted, monkeypatch):
    """``eval.tree_objective=tau``: the "τ at n nodes" tree, the highest predicted τ of the budget, drafted and
    verified as chosen (parity kept), where speed stops at depth 1 because a drafter pass is dear."""
    monkeypatch.setattr(AcceptanceStats, "drafter_seconds_per_pass", lambda self: 5.0)  # 5 verifications a pass
    reports = {}
    for objective in ("speed", "tau"):
        cfg = _cfg(tiny_model_dir, tmp_path / objective, sharegpt, "falcon_k1", "eval.tree_nodes=8",
                   f"eval.tree_objective={objective}")
        _save_head(cfg, tiny_base, tmp_path / objective)
        reports[objective] = run_evaluation(cfg, base=tiny_base)
    speed, tau = (reports[o]["tree"] for o in ("speed", "tau"))
    assert speed["objective"] == "speed" and tau["objective"] == "tau"
    assert speed["chosen"]["depth"] == 1 and tau["chosen"]["depth"] > 1
    assert tau["chosen"]["tau"] == max(c["tau"] for c in tau["chosen"]["candidates"]) > speed["chosen"]["tau"]
    assert reports["tau"]["parity"]["matched"] == reports["tau"]["parity"]["total"] == 2
    trees_seen = max(s["stats"]["tree_nodes"] / max(s["stats"]["steps"], 1) for s in reports["tau"]["per_prompt"])
    assert 0 < trees_seen <= tau["chosen"]["nodes"] - 1  # verified trees within the chosen one


def test_eagle3_budget_charges_the_passes_it_drafts():
    """The EAGLE-3 planner: τ(n) / (c(n) + min(depth, n-1) passes); with costly passes a small budget
    wins, with free passes the largest τ(n) per verification second."""
    from decoding.cost_model import CostModel
    from evaluation.tree_auto import _eagle3_choose
    from omegaconf import OmegaConf

    stats = AcceptanceStats(budget_sizes=[1, 2, 4, 8])
    stats.budget_accepted, stats.steps = [0, 40, 70, 90], 100  # tau(n) = 1, 1.4, 1.7, 1.9
    stats.drafter_passes, stats.drafter_seconds = 800, 800 * 0.02
    cost = CostModel(sizes=[1, 2, 4, 8], verify_ms=[100.0, 100.0, 100.0, 100.0], key={}, context_tokens=16, repeats=1)
    ev = OmegaConf.create({"tree_grid": [1, 2, 4, 8], "tree_nodes": None, "decoding": None})
    setup = {"depth": 8, "topk": 10}
    # 20 ms per pass: n=2 -> 1.4/0.12 = 11.7, n=4 -> 1.7/0.16 = 10.6, n=8 -> 1.9/0.24 = 7.9 tokens/s
    chosen, kwargs, wrap = _eagle3_choose(setup, stats, cost, ev)
    assert chosen["nodes"] == 2 and kwargs == {"decoding": {"total_tokens": 1, "depth": 1, "topk": 1}} and wrap is None
    assert [round(c["tokens_per_s"], 2) for c in chosen["candidates"]] == [11.67, 10.62, 7.92]
    stats.drafter_seconds = 0.0
    chosen, kwargs, _ = _eagle3_choose(setup, stats, cost, ev)
    assert chosen["nodes"] == 8 and kwargs["decoding"] == {"total_tokens": 7, "depth": 7, "topk": 7}


@pytest.mark.parametrize("head", ["falcon", "ctc"])
def test_speed_limits_split_the_predicted_speedup_into_tau_drafter_and_verification(head):
    """Planted: rank acceptance p = [0.5, 0.25] at depth 1 (τ 1.5 with one draft, 1.75 with two), c(n) =
    1 s + 0.3 s per drafted node, the drafter 1 s a step.  By hand: 2 nodes give 1.5 / 2.3 = 0.652x, 3 nodes
    1.75 / 2.6 = 0.673x, so the planner takes 3 nodes, a step of 2.6 vanilla steps (verification 1.6,
    drafter 1 / 2.6), and 1.3x would need τ 3.38 there; with a free drafter 2 nodes win, 1.5 / 1.3 = 1.154x
    (3 nodes: 1.75 / 1.6 = 1.094x)."""
    from decoding.cost_model import CostModel
    from evaluation.tree_auto import PLANNERS, limits_text, speed_limits
    from omegaconf import OmegaConf

    stats = AcceptanceStats(budget_sizes=[1, 2, 3], rank_trials=[[4, 4]], rank_hits=[[2, 1]],
                            budget_accepted=[0, 2, 3], steps=4, drafter_passes=4, drafter_seconds=4.0)
    cost = CostModel(sizes=[1, 2, 3], verify_ms=[1000.0, 1300.0, 1600.0], key={}, context_tokens=16, repeats=1)
    ev = OmegaConf.create({"tree": "auto", "tree_grid": [1, 2, 3], "tree_nodes": None})
    setup = {"k": 1, "passes": 1, "max_depth": 1, "max_rank": 2, "calibration_kwargs": {}}
    _, choose = PLANNERS[head]
    chosen, _, _ = choose(setup, stats, cost, ev)
    assert chosen["nodes"] == 3 and chosen["speedup"] == pytest.approx(1.75 / 2.6)
    limits = speed_limits(setup, choose, stats, cost, ev, chosen)
    assert limits["step_in_vanilla_steps"] == pytest.approx(2.6)
    assert limits["verify_in_vanilla_steps"] == pytest.approx(1.6)
    assert limits["drafter_share"] == pytest.approx(1 / 2.6)
    free = limits["drafter_free"]
    assert free["nodes"] == 2 and free["tau"] == pytest.approx(1.5) and free["speedup"] == pytest.approx(1.5 / 1.3)
    assert stats.drafter_seconds == 4.0  # the calibration itself is left as it was
    text = limits_text(limits)
    assert "2.60 vanilla steps" in text and "1.3x needs tau 3.38" in text and "2 nodes, tau 1.50, 1.15x" in text


def test_auto_is_the_default_and_untrained_heads_choose_valid_trees(tiny_base, tiny_model_dir, tmp_path, sharegpt):
    cfg = _cfg(tiny_model_dir, tmp_path, sharegpt, "falcon")
    assert cfg.eval.tree == "auto"
    _save_head(cfg, tiny_base, tmp_path)
    rep = run_evaluation(cfg, base=tiny_base)
    assert rep["parity"]["matched"] == 2 and rep["tree"]["applied"]
    cost = rep["tree"]["cost_model"]
    assert cost["sizes"] == [1, 2, 3, 4, 6, 8] and len(cost["verify_ms"]) == 6 and min(cost["verify_ms"]) > 0


def test_calibration_without_usable_heldout_prompt_fails_before_decoding(tiny_base, tiny_model_dir, tmp_path, sharegpt):
    # every held-out conversation is an evaluation prompt -> nothing left to calibrate on
    cfg = _cfg(tiny_model_dir, tmp_path, sharegpt, "ctc", "eval.num_prompts=null")
    _save_head(cfg, tiny_base, tmp_path)
    with pytest.raises(CalibrationError, match="no usable held-out ShareGPT prompt"):
        run_evaluation(cfg, base=tiny_base)
    assert not (tmp_path / "out").exists()


def test_bad_tree_config_is_a_clear_error(tiny_model_dir, tmp_path, sharegpt, capsys):
    with pytest.raises(ConfigError, match="eval.tree_grid is empty"):
        _cfg(tiny_model_dir, tmp_path, sharegpt, "falcon", "eval.tree_grid=[]")
    with pytest.raises(ConfigError, match="eval.tree_nodes=5 must be one of"):
        _cfg(tiny_model_dir, tmp_path, sharegpt, "falcon", "eval.tree_nodes=5")
    with pytest.raises(ConfigError, match="eval.tree_objective='fast' is not valid; choices: speed, tau"):
        _cfg(tiny_model_dir, tmp_path, sharegpt, "falcon", "eval.tree_objective=fast")
    with pytest.raises(ConfigError, match="eval.tree_objective=tau maximises tau at a node budget: set eval.tree_nodes"):
        _cfg(tiny_model_dir, tmp_path, sharegpt, "falcon", "eval.tree_objective=tau")
    with pytest.raises(ConfigError, match=r"eval.falcon_tree.paths: rank path \[0, 1\]: its parent \[0\] is missing"):
        _cfg(tiny_model_dir, tmp_path, sharegpt, "falcon", "eval.tree=config", "eval.falcon_tree={paths: [[0, 1]]}")
    with pytest.raises(ConfigError, match=r"heads.decoding.tree.paths: rank path \[1, 0\]: its parent \[1\] is missing"):
        _cfg(tiny_model_dir, tmp_path, sharegpt, "falcon", "heads.decoding.tree.node_children=null",
             "heads.decoding.tree.paths=[[0], [1, 0]]")
    with pytest.raises(SystemExit) as exc:
        main([f"model.path={tiny_model_dir}", "eval.tree=sometimes", "checkpoint=oracle"])
    assert exc.value.code == 2 and "eval.tree='sometimes' is not valid" in capsys.readouterr().err


def test_cost_cache_is_reused_and_invalidated_by_device_dtype_threads(tiny_base, tmp_path, monkeypatch):
    model, _, identity = tiny_base
    calls = []
    real = cost_model.measure_verify_ms

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(cost_model, "measure_verify_ms", counting)
    grid = [1, 2, 4]
    a = cost_model.load_or_measure(model, identity, tmp_path, grid, context_tokens=8, repeats=1)
    b = cost_model.load_or_measure(model, identity, tmp_path, grid, context_tokens=8, repeats=1)
    assert len(calls) == 1 and a.path == b.path and a.verify_ms == b.verify_ms
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        c = cost_model.load_or_measure(model, identity, tmp_path, grid, context_tokens=8, repeats=1)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 2 and c.path != a.path and c.key["threads"] == threads + 1
    model64 = type(model)(model.config).to(torch.float64).eval()
    model64.load_state_dict(model.state_dict())
    d = cost_model.load_or_measure(model64, identity, tmp_path, grid, context_tokens=8, repeats=1)
    assert len(calls) == 3 and d.path not in (a.path, c.path) and d.key["dtype"] == "float64"
    monkeypatch.setattr(cost_model, "model_device", lambda m: torch.device("mps"))
    e = cost_model.cost_key(identity, model, grid, 8, 1)
    assert e["device"] == "mps" and e != a.key  # another device -> another cache file
    assert {cost_model.sha256_json(e), cost_model.sha256_json(a.key)}.__len__() == 2
    monkeypatch.undo()  # the real measurement and device again
    seen = {a.path}  # OpenMP's wait policy changed c(n) 2.2x here: each policy has its own measurement
    for policy in ("passive", "ACTIVE", ""):
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
        f = cost_model.load_or_measure(model, identity, tmp_path, grid, context_tokens=8, repeats=1)
        assert f.key["omp_wait_policy"] == (policy.upper() or None)
        assert (f.path == a.path) == (f.key["omp_wait_policy"] == a.key["omp_wait_policy"])
        seen.add(f.path)
    assert len(seen) == 3  # PASSIVE, ACTIVE, unset (the suite runs under PASSIVE: tests/conftest.py)


def test_cost_model_interpolates_measured_grid():
    cm = cost_model.CostModel(sizes=[1, 4, 8], verify_ms=[10.0, 16.0, 24.0], key={}, context_tokens=1, repeats=1)
    assert cm.verify_seconds(1) == pytest.approx(0.010)
    assert cm.verify_seconds(2) == pytest.approx(0.012)
    assert cm.verify_seconds(6) == pytest.approx(0.020)
    assert cm.verify_seconds(12) == pytest.approx(0.032)  # extrapolated from the last segment
    with pytest.raises(ValueError, match="eval.tree_grid is empty"):
        cost_model.check_grid([])


def test_adadecode_reports_expected_layer_steps_per_gamma_beside_measured(tiny_base, tiny_model_dir, tmp_path,
                                                                          sharegpt):
    cfg = _cfg(tiny_model_dir, tmp_path, sharegpt, "adadecode", "heads.layers=[1,2]", "eval.gamma=0.0")
    _save_head(cfg, tiny_base, tmp_path)
    rep = run_evaluation(cfg, base=tiny_base)
    assert rep["parity"]["matched"] == 2
    model = rep["tree"]["adadecode_model"]
    assert model["source"] == "calibration" and model["held_out_prompts"] == 3 and model["tokens"] > 0
    assert set(model["per_gamma"]) == {str(g) for g in cfg.heads.val_gammas}
    # gamma 0: every token exits at layer 1 -> E[c] = 1 (right) or 1 + L (wrong) per token, L = 4
    conf = model["configured"]
    assert conf["exit_rate"] == 1.0
    assert conf["expected_layer_steps_per_token"] == pytest.approx(1 + 4 * conf["reject_rate"])
    assert rep["tree"]["measured_layer_steps_per_token"] == rep["method"]["decoder_summary"]["layer_steps_per_token"]


def test_adadecode_model_scores_draft_vocabulary_predictions_as_base_ids(tiny_base, tiny_model_dir, tmp_path, sharegpt,
                                                                        monkeypatch):
    """Over a draft vocabulary the layer heads' argmax is a draft index; the exit model must map it to a
    base id before comparing with the greedy label (else nearly every exit looks rejected).  Planted:
    every layer head predicts base token t* (draft index t* − 1: d2t = every id but 0) and γ = 0, so every
    token exits at the first candidate layer and is rejected exactly when the greedy token is not t*."""
    import decoding.vanilla as vanilla
    import evaluation.tree_auto as tree_auto
    from heads.adadecode import AdaDecodeHead

    V = tiny_base[0].config.vocab_size
    cfg = _cfg(tiny_model_dir, tmp_path, sharegpt, "adadecode", "heads.layers=[1,2]", "eval.gamma=0.0",
               f"heads.draft_vocab_size={V - 1}")
    torch.manual_seed(0)
    head = heads.build(cfg.heads, tiny_base[0], label_counts=torch.arange(V))  # top V - 1: every id but 0
    assert head.d2t.tolist() == list(range(1, V))
    heads.save(head, tmp_path / "ckpt", tiny_base[2].to_dict())
    emitted, inside = [], {"on": False}
    real_greedy, real_predict = vanilla.greedy_generate, tree_auto.predict_adadecode

    def recording(*args, **kwargs):
        out = real_greedy(*args, **kwargs)
        if inside["on"]:
            emitted.extend(out[0])
        return out

    def predicting(*args, **kwargs):
        inside["on"] = True
        try:
            return real_predict(*args, **kwargs)
        finally:
            inside["on"] = False

    monkeypatch.setattr(vanilla, "greedy_generate", recording)
    monkeypatch.setattr(tree_auto, "predict_adadecode", predicting)
    # t*: a token the held-out continuations emit (greedy tokens of the tiny model on its calibration prompts)
    with torch.no_grad():
        probe = [real_greedy(tiny_base[0], p.input_ids, 10, [])[0]
                 for p in tree_auto.calibration_prompts(cfg, tiny_base[1], [], 3)]
    counts = torch.bincount(torch.tensor([t for o in probe for t in o]), minlength=V)
    counts[0] = 0
    t_star = int(counts.argmax())

    def planted(self, layer, h):
        z = torch.zeros(*h.shape[:-1], self.draft_vocab_size)
        z[..., t_star - 1] = 20.0  # draft index of base token t*
        return z

    monkeypatch.setattr(AdaDecodeHead, "layer_logits", planted)
    rep = run_evaluation(cfg, base=tiny_base)
    assert rep["parity"]["matched"] == 2
    conf = rep["tree"]["adadecode_model"]["configured"]
    assert emitted and conf["exit_rate"] == 1.0
    wrong = sum(t != t_star for t in emitted) / len(emitted)
    misread = sum(t != t_star - 1 for t in emitted) / len(emitted)  # the draft index taken for a base id
    assert wrong != misread and conf["reject_rate"] == pytest.approx(wrong)


def test_cost_measurement_clocks(tiny_base):
    model = tiny_base[0]
    wall = cost_model.measure_verify_ms(model, [1, 4], context_tokens=8, repeats=1)
    cpu = cost_model.measure_verify_ms(model, [1, 4], context_tokens=8, repeats=1, clock="cpu")
    assert len(wall) == len(cpu) == 2 and min(wall) > 0 and min(cpu) >= 0
    with pytest.raises(ValueError, match="clock='gpu'"):
        cost_model.measure_verify_ms(model, [1], clock="gpu")


def test_explicit_tree_keys_win_over_auto(tiny_base, tiny_model_dir, tmp_path, sharegpt):
    cfg = _cfg(tiny_model_dir, tmp_path, sharegpt, "ctc", "eval.max_nodes=5")
    _save_head(cfg, tiny_base, tmp_path)
    rep = run_evaluation(cfg, base=tiny_base)
    assert rep["tree"]["applied"] is False and "eval.max_nodes given explicitly" in rep["tree"]["reason"]
    assert (rep["tree"]["nodes"], rep["tree"]["depth"]) == (5, -1)  # what was drafted is recorded (was null)
    assert rep["parity"]["matched"] == 2
    assert all(p["stats"]["tree_nodes"] <= 4 * p["stats"]["steps"] for p in rep["per_prompt"])
    # EAGLE-3: an explicit eval.decoding.total_tokens is its budget, kept over auto
    cfg = _cfg(tiny_model_dir, tmp_path / "e3", sharegpt, "eagle3", "heads.layers=[1,2,3]", "eval.decoding={total_tokens: 3}")
    _save_head(cfg, tiny_base, tmp_path / "e3")
    rep = run_evaluation(cfg, base=tiny_base)
    assert rep["tree"]["applied"] is False and "eval.decoding.total_tokens given explicitly: that budget" in rep["tree"]["reason"]
    assert rep["parity"]["matched"] == 2
    assert all(p["stats"]["tree_nodes"] <= 3 * p["stats"]["steps"] for p in rep["per_prompt"])


def test_an_explicit_falcon_tree_records_the_tree_drafted_after_the_depth_cap(tiny_base, tiny_model_dir, tmp_path,
                                                                            sharegpt):
    """A 6-deep falcon_tree with one pass of k = 2 is cut to depth 2 (documented), but report.json said nodes
    and depth null, so the tree that was decoded was recorded nowhere."""
    from evaluation.summary import tree_summary, tree_text

    cfg = _cfg(tiny_model_dir, tmp_path, sharegpt, "falcon", "eval.falcon_tree={depth_children: [2, 2, 2, 2, 2, 2]}",
               "eval.falcon_passes=1")
    _save_head(cfg, tiny_base, tmp_path)
    rep = run_evaluation(cfg, base=tiny_base)
    assert rep["tree"]["applied"] is False and (rep["tree"]["nodes"], rep["tree"]["depth"]) == (7, 2)
    assert tree_text(tree_summary(rep["tree"])) == "given: 7 nodes, depth 2"  # eval.tree=auto did not size it
    assert rep["parity"]["matched"] == 2


def test_plan_threads_sizes_a_one_thread_run_for_the_timing_threads(tiny_base, tiny_model_dir, tmp_path, sharegpt,
                                                                     monkeypatch):
    """Acceptance is calibrated once (thread-independent); c(n) and the drafter's cost are per thread count.
    A one-thread run with ``eval.plan_threads=2`` decodes with the tree a two-thread run chooses, and a
    plain one-thread run sizes its own (here: planted c(n) that is steep on one thread -> a smaller tree)."""
    import evaluation.tree_auto as tree_auto

    monkeypatch.setattr(AcceptanceStats, "rank_acceptance", lambda self: [[0.7, 0.2, 0.05]] * 8)
    monkeypatch.setattr(AcceptanceStats, "budget_tau", lambda self: {1: 1.0, 2: 1.6, 3: 1.9, 4: 2.3, 6: 2.6, 8: 2.8})
    real_measure, real_calibrate = tree_auto.load_or_measure, tree_auto.calibrate
    per_node = {1: 2000.0, 2: 1.0}  # ms per tree node: one thread makes every extra node dear

    def planted_cost(*args, **kwargs):
        cost = real_measure(*args, **kwargs)
        cost.verify_ms = [1000.0 + per_node[cost.key["threads"]] * (n - 1) for n in cost.sizes]
        return cost

    calibrations = []

    def counting(*args, **kwargs):
        calibrations.append(torch.get_num_threads())
        return real_calibrate(*args, **kwargs)

    monkeypatch.setattr(tree_auto, "load_or_measure", planted_cost)
    monkeypatch.setattr(tree_auto, "calibrate", counting)
    old = torch.get_num_threads()
    try:
        reps = {}
        for name, extra in [("one_for_two", ["eval.threads=1", "eval.plan_threads=2"]), ("one", ["eval.threads=1"]),
                            ("two", ["eval.threads=2"])]:
            cfg = _cfg(tiny_model_dir, tmp_path, sharegpt, "falcon", "eval.tree=auto", *extra,
                       f"eval.output_dir={tmp_path / name}")
            if not reps:
                _save_head(cfg, tiny_base, tmp_path)
            reps[name] = run_evaluation(cfg, base=tiny_base)
            assert torch.get_num_threads() == int(extra[0].split("=")[1])  # the run's own threads are kept
    finally:
        torch.set_num_threads(old)
    assert calibrations == [2]  # acceptance measured once, at the planning thread count
    trees = {k: r["tree"] for k, r in reps.items()}
    for k, r in reps.items():
        assert r["parity"]["matched"] == 2, k
    assert [trees[k]["statistics"]["plan_threads"] for k in reps] == [2, 1, 2]
    assert [trees[k]["cost_model"]["key"]["threads"] for k in reps] == [2, 1, 2]
    assert trees["one_for_two"]["statistics"]["drafter_cost_source"] == "calibration"
    assert trees["one"]["statistics"]["drafter_cost_source"] == "timed on 3 prompts"  # 3 calibration prompts
    assert trees["two"]["statistics"]["drafter_cost_source"] == "calibration"
    assert trees["one_for_two"]["chosen"] == trees["two"]["chosen"] and trees["two"]["chosen"]["nodes"] > 1
    assert trees["one"]["chosen"]["nodes"] < trees["two"]["chosen"]["nodes"]
    cal = json.loads(open(trees["one"]["statistics"]["path"]).read())
    sfx = f"/{cost_model.omp_wait_policy()}" if cost_model.omp_wait_policy() else ""  # PASSIVE in the suite
    from decoding import prepacked  # eval.prepack_weights=auto packs this fp32 CPU base: its drafter costs are its own

    rows = prepacked.prepacked_min_rows(tiny_base[0])  # probed per weight shape, once per process ("auto")
    assert (rows is not None) == prepacked.available()
    assert all(trees[k]["cost_model"]["key"].get("prepacked_min_rows") == rows for k in trees)
    sfx += f"/prepacked{rows}" if prepacked.available() else ""
    if prepacked.available():  # and so is the head's every linear layer, its frozen LM-head rows included
        import heads

        head, _ = heads.load(cfg.eval.checkpoint, base_model=tiny_base[0])
        sfx += f"/head{sum(isinstance(m, prepacked.LINEAR_TYPES) for m in head.modules())}"
    assert set(cal["drafter_cost"]) == {f"1{sfx}", f"2{sfx}"} and "threads" not in cal["key"]
    assert cal["drafter_cost"][f"1{sfx}"]["prompts"] == 3 and cal["drafter_cost"][f"1{sfx}"]["passes"] > 0


@pytest.mark.parametrize("head", ["ctc", "falcon"])
def test_tree_fallback_decodes_without_a_tree_only_when_every_tree_is_slower(tiny_base, tiny_model_dir, tmp_path,
                                                                             sharegpt, head, monkeypatch):
    """``eval.tree_fallback=true``: with a planted c(n) that makes every tree slower than vanilla decoding
    (+2 s per extra node on a 1 s step), auto drafts nothing (τ 1, no drafter pass, parity kept); with
    cheap nodes (+1 ms) it keeps its tree; off, or with a fixed ``eval.tree_nodes``, it never falls back."""
    import evaluation.tree_auto as tree_auto

    monkeypatch.setattr(AcceptanceStats, "rank_acceptance", lambda self: [[0.7, 0.2, 0.05]] * 8)
    monkeypatch.setattr(AcceptanceStats, "budget_tau", lambda self: {1: 1.0, 2: 1.6, 3: 1.9, 4: 2.3, 6: 2.6, 8: 2.8})
    real_measure = tree_auto.load_or_measure
    per_node = {"ms": 2000.0}

    def planted_cost(*args, **kwargs):
        cost = real_measure(*args, **kwargs)
        cost.verify_ms = [1000.0 + per_node["ms"] * (n - 1) for n in cost.sizes]
        return cost

    monkeypatch.setattr(tree_auto, "load_or_measure", planted_cost)
    reps = {}
    for name, ms, extra in [("dear", 2000.0, ["eval.tree_fallback=true"]), ("dear_off", 2000.0, []),
                            ("dear_fixed", 2000.0, ["eval.tree_fallback=true", "eval.tree_nodes=4"]),
                            ("cheap", 1.0, ["eval.tree_fallback=true"])]:
        per_node["ms"] = ms
        cfg = _cfg(tiny_model_dir, tmp_path, sharegpt, head, "eval.tree=auto", *extra,
                   f"eval.output_dir={tmp_path / name}")
        if not reps:
            _save_head(cfg, tiny_base, tmp_path)
        reps[name] = run_evaluation(cfg, base=tiny_base)
        assert reps[name]["parity"]["matched"] == 2, name
    dear = reps["dear"]
    chosen = dear["tree"]["chosen"]
    assert chosen["fallback"] == "vanilla" and chosen["nodes"] == 1 and dear["tree"]["predicted_speedup"] == 1.0
    best = chosen["best_tree"]
    assert best["speedup"] < 1.0 and best == reps["dear_off"]["tree"]["chosen"]  # the tree it replaced, as chosen when off
    assert dear["tau"] == 1.0
    for p in dear["per_prompt"]:
        st = p["stats"]
        assert st["drafter_passes"] == 0 and st["tree_nodes"] == 0 and st["steps"] == st["new_tokens"] - 1
    assert "fallback" not in reps["dear_off"]["tree"]["chosen"]
    assert "fallback" not in reps["dear_fixed"]["tree"]["chosen"] and reps["dear_fixed"]["tree"]["chosen"]["nodes"] <= 4
    cheap = reps["cheap"]["tree"]["chosen"]
    assert "fallback" not in cheap and cheap["nodes"] > 1 and cheap["speedup"] > 1.0
    assert "no tree" in tree_auto.describe(dear["tree"]) and "no tree" not in tree_auto.describe(reps["cheap"]["tree"])


def test_calibration_prompts_are_the_split_end_read_once_and_again_after_an_edit(tiny_base, tiny_model_dir, tmp_path,
                                                                                 sharegpt, monkeypatch):
    """The last held-out conversations, evaluation prompts excluded; the dataset is scanned once per
    process for every variant's plan, and again when its file changes."""
    import evaluation.tree_auto as tree_auto
    from data_prep import front, pipeline
    from evaluation.prompts import Prompt, template

    cfg = _cfg(tiny_model_dir, tmp_path, sharegpt, "ctc")
    heldout = [pid for pid, _ in front.heldout_prompts(cfg.data)]
    assert len(heldout) >= 6
    scans = []
    real = pipeline.heldout_prompts
    monkeypatch.setattr(pipeline, "heldout_prompts", lambda data_cfg: scans.append(1) or real(data_cfg))
    tok = tiny_base[1]
    banned = Prompt(heldout[-2], [{"role": "user", "content": "x"}], template(tok, [{"role": "user", "content": "x"}]))
    first = [p.id for p in tree_auto.calibration_prompts(cfg, tok, [banned], 3)]
    assert first == [heldout[-1], heldout[-3], heldout[-4]]
    assert [p.id for p in tree_auto.calibration_prompts(cfg, tok, [], 2)] == heldout[::-1][:2] and len(scans) == 1
    convs = json.loads(sharegpt.read_text())
    sharegpt.write_text(json.dumps([c for c in convs if c["id"] != heldout[-1]]))  # edited: its last one removed
    assert [p.id for p in tree_auto.calibration_prompts(cfg, tok, [], 2)] == heldout[::-1][1:3] and len(scans) == 2
    # a held-out first turn holding a special token's text is skipped, as the evaluation's prompts skip it
    convs = json.loads(sharegpt.read_text())
    target = next(c for c in convs if c["id"] == heldout[-2])
    target["conversations"][0]["value"] += " <|im_end|>"
    sharegpt.write_text(json.dumps(convs))
    assert [p.id for p in tree_auto.calibration_prompts(cfg, tok, [], 2)] == [heldout[-3], heldout[-4]]


def test_calibration_skips_heldout_prompts_that_cannot_fit_the_context(tiny_base, tiny_model_dir, tmp_path, sharegpt):
    """A held-out prompt whose tokens + the calibration's max_new_tokens exceed max_position_embeddings
    (2048 here) cannot be decoded: it is skipped like an over-long one, instead of stopping the
    evaluation's planning with a context error that names neither the prompt nor the key."""
    import evaluation.tree_auto as tree_auto
    from data_prep import front

    cfg = _cfg(tiny_model_dir, tmp_path, sharegpt, "ctc", "eval.calibration_max_new_tokens=1990")
    heldout = [pid for pid, _ in front.heldout_prompts(cfg.data)]
    convs = json.loads(sharegpt.read_text())
    long = next(c for c in convs if c["id"] == heldout[-1])
    long["conversations"][0]["value"] = " ".join(["word"] * 60)  # 326 templated tokens: 326 + 1990 > 2048 (the others: 51)
    sharegpt.write_text(json.dumps(convs))
    model, tok = tiny_base[0], tiny_base[1]
    got = tree_auto.calibration_prompts(cfg, tok, [], 3, model)
    assert [p.id for p in got] == [heldout[-2], heldout[-3], heldout[-4]]
    assert all(p.input_ids.numel() + 1990 <= 2048 for p in got)
    # without the model (no context limit known) it stays the last one
    assert tree_auto.calibration_prompts(cfg, tok, [], 1)[0].id == heldout[-1]
    # nothing fits: a CalibrationError naming the key, before anything is decoded
    cfg = _cfg(tiny_model_dir, tmp_path, sharegpt, "ctc", "eval.calibration_max_new_tokens=2047")
    with pytest.raises(CalibrationError, match=r"eval.calibration_max_new_tokens=2047.*max_position_embeddings=2048"):
        tree_auto.calibration_prompts(cfg, tok, [], 3, model)
