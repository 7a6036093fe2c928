"""``eval.tree=auto|dynamic``: size each head's draft tree to the hardware before decoding.

Inputs (issue 14):

* the cost model c(n) (:mod:`decoding.cost_model`, cached under ``<output_root>/cost_model/``);
* the head's acceptance statistics (:class:`decoding.tree_search.AcceptanceStats`), measured by a
  **calibration pass** on held-out ShareGPT first turns — never on the evaluation prompts (ids and
  token ids of the evaluation prompts are excluded) — with the head's own drafter and a wide
  calibration tree; cached under ``<output_root>/calibration/`` per (checkpoint weights, head
  config, calibration tree, prompts, device, dtype).  Acceptance does not depend on the thread
  count; the drafter's seconds per pass do, so they are kept in the same file per thread count:
  from the calibration pass itself, or, for another thread count, from a short timed decode of the
  first :data:`DRAFTER_COST_PROMPTS` calibration prompts (:func:`drafter_cost`).

The tree is sized for ``eval.plan_threads`` threads (null = the run's own): the cost model and the
drafter's cost are measured (or read from the cache) at that count.  A τ/parity run on one thread
per shard can so decode with exactly the tree that a timing run on all cores chooses.

Per head type (a planner per type; a new tree head registers one in :data:`PLANNERS`):

* ``falcon`` (k ≥ 1, incl. the k = 1 EAGLE-1-style head): calibration tree = the rank-0 spine with
  ``eval.tree_max_rank`` children at every depth up to passes·k.  ``auto``: the Sequoia-style DP
  tree (:func:`decoding.tree_search.choose_rank_tree`), drafter cost ⌈depth/k⌉ passes.
  ``dynamic``: the calibration tree cut every step to its n* best nodes by cumulative draft
  probability (:class:`decoding.tree_search.ScoreBudgetDrafter`), n* from the cost model.
* ``ctc``: the trie keeps its best-scoring nodes already, so ``auto`` = ``dynamic`` = the candidate
  budget ``max_nodes`` = n* maximising τ(n) / (c(n) + drafter).
* ``eagle3``: its EAGLE-2 tree is dynamic already (the best ``total_tokens`` nodes by cumulative
  log-probability each step), so ``auto`` = ``dynamic`` = the budget n* (``total_tokens`` = n* − 1)
  from a calibration at the largest grid budget, with ``depth``/``topk`` capped at n* − 1 (the same
  tree for fewer drafter passes; :func:`_eagle3_choose`).

``eval.tree_fallback=true``: when even the best tree is predicted slower than vanilla decoding,
decode without a tree (the root alone, no drafter pass; :func:`vanilla_fallback`), as a server
would.  Off by default: an evaluation exists to measure the head, and a fixed ``eval.tree_nodes``
never falls back.

``eval.tree_objective`` says what the search maximises (:data:`decoding.tree_search.TREE_OBJECTIVES`): ``speed``
(predicted tokens/s, the default) or ``tau`` (predicted τ at the budget ``eval.tree_nodes``, cost ignored: the
tree of a "τ at n nodes" quality figure; speedups measured at it are not the auto tree's).

``eval.tree=config`` keeps the head's configured tree.  Heads without a tree (AdaDecode) and the
reference drafters are left as they are (the report says so).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import OmegaConf

from core.io import atomic_write_json, sha256_file, sha256_json
from decoding.cost_model import CostModel, check_grid, load_or_measure
from decoding.measurement import machine_load, reuse_line
from decoding.prepacked import packed_layers
from decoding.speculative import SpeculativeDecoder
from decoding.tree_search import (AcceptanceStats, RecordingDrafter, RootOnlyDrafter, ScoreBudgetDrafter,
                                  choose_budget, choose_rank_tree)

log = logging.getLogger(__name__)
TREE_MODES = ("auto", "dynamic", "config")
DRAFTER_COST_PROMPTS = 4  # calibration prompts timed for the drafter's cost at a thread count not calibrated at


class CalibrationError(ValueError):
    """No usable held-out prompt for the calibration pass, or a calibration that verified no draft
    (raised before any evaluation prompt is decoded)."""


@functools.lru_cache(maxsize=4)
def _heldout_scan(data_json: str, files: tuple) -> tuple:
    from data_prep.pipeline import heldout_prompts

    return tuple(heldout_prompts(OmegaConf.create(json.loads(data_json))))


def _heldout_prompts(data_cfg) -> tuple:
    """Every held-out first turn of ``data_cfg``'s sources, read once per process: the scan reads
    the whole dataset (about 4 s for the packaged ShareGPT), and each variant of an evaluation
    plans its tree from the same prompts.  A local source file that changed (size or mtime) is
    read again."""
    from core.config import to_container

    data = to_container(data_cfg)
    paths = [data.get("path")] + [s.get("path") for s in data.get("sources") or [] if isinstance(s, dict)]
    files = tuple((str(p), st.st_size, st.st_mtime_ns) for p in paths if p and Path(str(p)).is_file()
                  for st in [Path(str(p)).stat()])
    return _heldout_scan(json.dumps(data, sort_keys=True, default=str), files)


def calibration_prompts(cfg, tokenizer, eval_prompts, count: int, model=None) -> list:
    """Held-out ShareGPT first turns for calibration, the last ``count`` usable ones of the split,
    excluding every evaluation prompt.

    Args:
        cfg: the composed config (``data`` section; ``eval.max_prompt_tokens``; the calibration's
            ``eval.calibration_max_new_tokens`` or ``eval.max_new_tokens``).
        tokenizer: the base tokenizer.
        eval_prompts: the evaluation's :class:`evaluation.prompts.Prompt` list (excluded by id and
            by templated token ids).
        count: how many to take.
        model: the base (or its config): a prompt whose tokens + the calibration's max_new_tokens
            exceed its ``max_position_embeddings`` cannot be decoded and is skipped too.

    Raises:
        CalibrationError: none is usable (all excluded, over-long or beyond the context with the
            calibration's max_new_tokens, or the held-out split is empty).
    """
    from data_prep.template import special_token_texts
    from decoding.vanilla import context_limit
    from evaluation.prompts import Prompt, special_text, template

    specials = special_token_texts(tokenizer)
    banned_ids = {p.id for p in eval_prompts}
    banned_tokens = {tuple(p.input_ids.tolist()) for p in eval_prompts}
    max_len = cfg.eval.get("max_prompt_tokens")
    # prompt + the calibration's replies must fit the context, as the evaluation's prompts must (else its decode raises)
    budget_key = "calibration_max_new_tokens" if cfg.eval.get("calibration_max_new_tokens") else "max_new_tokens"
    max_new = int(cfg.eval.get(budget_key) or 0)
    limit = context_limit(model) if model is not None else None
    fits = 0
    out = []
    seen = 0
    # from the END of the held-out split: evaluations on held-out ShareGPT take its first prompts, so every shard
    # of a sharded evaluation (eval.prompt_offset) calibrates on the same prompts, none of them evaluated
    for pid, messages in reversed(_heldout_prompts(cfg.data)):
        seen += 1
        if pid in banned_ids or special_text(specials, messages) is not None:  # as the evaluation's prompts
            continue
        ids = template(tokenizer, messages)
        if tuple(ids.tolist()) in banned_tokens or (max_len is not None and ids.numel() > int(max_len)):
            continue
        if limit is not None and ids.numel() + max_new > limit:
            fits += 1
            continue
        out.append(Prompt(pid, messages, ids))
        if len(out) >= count:
            break
    if not out:
        beyond = (f"; {fits} of them fit eval.max_prompt_tokens but not the context: prompt + eval.{budget_key}="
                  f"{max_new} exceeds the base model's context limit max_position_embeddings={limit}, lower "
                  f"eval.{budget_key}") if fits else ""
        raise CalibrationError(f"eval.tree={cfg.eval.tree}: no usable held-out ShareGPT prompt for the calibration pass "
                               f"({seen} held-out conversations in data.path={cfg.data.get('path')}, all excluded as "
                               f"evaluation prompts or longer than eval.max_prompt_tokens{beyond}); use eval.tree=config")
    return out


def calibrate(model, drafter, prompts, max_new_tokens: int, eos_ids, budget_sizes, stats: AcceptanceStats | None = None,
              done: int = 0, on_prompt: Callable[[int, AcceptanceStats], None] | None = None,
              desc: str = "calibrating") -> AcceptanceStats:
    """Decode ``prompts`` with ``drafter`` (lossless speculative decoding) and replay every drafted
    tree against the greedy continuation that followed its root (module doc).  The last step of
    each prompt is replayed only as far as the continuation reaches.

    Args:
        stats, done: resume: the statistics of ``prompts[:done]`` (prompts are independent, so the
            result equals one uninterrupted pass).
        on_prompt: called as ``on_prompt(k, stats)`` after the k-th prompt (1-based) was added,
            e.g. to persist partial statistics; an exception it raises stops the calibration.
        desc: the progress bar's label (tqdm on stderr: prompts done, ETA, tokens/s).
    """
    from tqdm.auto import tqdm

    rec = RecordingDrafter(drafter)
    dec = SpeculativeDecoder(model, rec, eos_ids)
    stats = stats if stats is not None else AcceptanceStats(budget_sizes=list(budget_sizes))
    tokens, t0 = 0, time.perf_counter()
    with tqdm(total=len(prompts), initial=done, unit="prompt", desc=desc, mininterval=1.0, dynamic_ncols=True) as bar:
        for k in range(done, len(prompts)):
            out, st = dec.generate(prompts[k].input_ids, max_new_tokens)
            pos = 0
            for tree, emitted in zip(rec.trees, st["emitted_per_step"]):
                stats.add_step(tree, out[pos + 1:])
                pos += emitted
            stats.drafter_passes += int(st["drafter_passes"])
            stats.drafter_seconds += float(st["drafter_seconds"])
            tokens += len(out)
            bar.update(1)
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - t0, 1e-9):.1f} tokens/s", refresh=False)
            if on_prompt is not None:
                on_prompt(k + 1, stats)
    return stats


@contextmanager
def planning_threads(threads: int | None):
    """``torch.set_num_threads(threads)`` inside the block (restored after); a no-op for None."""
    if not threads:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(int(threads))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def drafter_cost(model, drafter, prompts, max_new_tokens: int, eos_ids) -> dict[str, float]:
    """The drafter's measured cost on ``prompts`` at the current thread count: ``{"passes": P,
    "seconds": S, "prompts": n}`` (seconds of drafter forwards, from the decoder's own
    ``drafter_seconds``; the outputs are lossless speculative decoding and are discarded)."""
    from tqdm.auto import tqdm

    dec = SpeculativeDecoder(model, drafter, eos_ids)
    passes, seconds = 0, 0.0
    for p in tqdm(prompts, unit="prompt", desc="timing the drafter", mininterval=1.0, dynamic_ncols=True):
        _, st = dec.generate(p.input_ids, max_new_tokens)
        passes += int(st["drafter_passes"])
        seconds += float(st["drafter_seconds"])
    return {"passes": passes, "seconds": seconds, "prompts": len(prompts)}


def _spine_tree(depth: int, rank: int) -> dict:
    return {"node_children": {("root" if d == 0 else ",".join(["0"] * d)): int(rank) for d in range(depth)}}


def _falcon_setup(head, ev) -> dict[str, Any]:
    k = int(head.k)
    passes = int(ev.get("falcon_passes") or head.cfg["decoding"]["passes"])
    R = int(ev.tree_max_rank)
    return {"k": k, "passes": passes, "max_depth": passes * k, "max_rank": R,
            "calibration_kwargs": {"falcon_passes": passes, "falcon_tree": _spine_tree(passes * k, R)}}


def _ctc_setup(head, ev) -> dict[str, Any]:
    grid = check_grid(ev.tree_grid)
    return {"calibration_kwargs": {"max_nodes": max(grid)}}


def _tree_budgets(stats: AcceptanceStats, ev) -> dict[int, float]:
    """τ(n) of the budgets auto / dynamic may choose: n ≥ 2 only, since a budget of 1 drafts
    nothing (no drafter pass: vanilla decoding, which only ``eval.tree_fallback`` chooses,
    :func:`vanilla_fallback`); n = 1 stays when ``eval.tree_nodes`` = 1 asks for it or the grid has
    nothing else."""
    tau = stats.budget_tau()
    trees = {n: t for n, t in tau.items() if n >= 2}
    return tau if (ev.get("tree_nodes") is not None and int(ev.tree_nodes) == 1) or not trees else trees


def _objective(ev) -> str:
    """``eval.tree_objective`` (:data:`decoding.tree_search.TREE_OBJECTIVES`; ``speed`` when unset)."""
    return str(ev.get("tree_objective") or "speed")


def _falcon_choose(setup, stats: AcceptanceStats, cost: CostModel, ev) -> tuple[dict, dict, Callable | None]:
    per_pass = stats.drafter_seconds_per_pass() or 0.0
    k = setup["k"]
    if ev.tree == "dynamic":
        passes_per_step = stats.drafter_passes / stats.steps if stats.steps else 0.0
        # a budget of n keeps nodes no deeper than n - 1: the drafter runs at most ceil((n - 1) / k)
        # passes for it (none for the root alone; decoding.falcon.FalconDrafter.draft's max_nodes)
        choice = choose_budget(_tree_budgets(stats, ev), cost.verify_seconds,
                               lambda n: min(passes_per_step, math.ceil((n - 1) / k)) * per_pass, ev.get("tree_nodes"),
                               _objective(ev))
        return (choice.to_dict() | {"max_nodes": choice.nodes}, setup["calibration_kwargs"],
                lambda d: ScoreBudgetDrafter(d, choice.nodes))
    p = stats.rank_acceptance()
    if not p:
        p = [[0.0]]
    choice = choose_rank_tree(p, cost.verify_seconds, lambda depth: math.ceil(depth / k) * per_pass,
                              check_grid(ev.tree_grid), setup["max_depth"], ev.get("tree_nodes"), _objective(ev))
    passes = max(1, math.ceil(choice.depth / k))
    kwargs = {"falcon_passes": passes, "falcon_tree": {"paths": [list(q) for q in choice.paths[1:]]}}
    return choice.to_dict() | {"falcon_passes": passes}, kwargs, None


def _ctc_choose(setup, stats: AcceptanceStats, cost: CostModel, ev) -> tuple[dict, dict, Callable | None]:
    per_step = stats.drafter_seconds / stats.steps if stats.steps else 0.0
    # max_nodes = 1 drafts the root alone and runs no slot forward (decoding.ctc.CTCDrafter.draft)
    choice = choose_budget(_tree_budgets(stats, ev), cost.verify_seconds, lambda n: per_step if n > 1 else 0.0,
                           ev.get("tree_nodes"), _objective(ev))
    return choice.to_dict() | {"max_nodes": choice.nodes}, {"max_nodes": choice.nodes}, None


def _eval_decoding(ev) -> dict[str, Any]:
    from core.config import to_container

    d = ev.get("decoding")
    return dict(to_container(d)) if d is not None else {}


def _eagle3_setup(head, ev) -> dict[str, Any]:
    grid = check_grid(ev.tree_grid)
    dec = {**head.cfg["decoding"], **_eval_decoding(ev)}
    return {"depth": int(dec["depth"]), "topk": int(dec["topk"]),
            "calibration_kwargs": {"decoding": {**_eval_decoding(ev), "total_tokens": max(2, max(grid)) - 1}}}


def _eagle3_choose(setup, stats: AcceptanceStats, cost: CostModel, ev) -> tuple[dict, dict, Callable | None]:
    """EAGLE-3's budget n* (EAGLE-2 ``total_token`` = n − 1, chosen from the cost model as EAGLE-2's
    ``total_token=-1`` does, but from the calibrated τ(n) rather than a fixed table).  The top n − 1
    nodes by cumulative log-probability are ancestor-closed, so no kept node lies deeper than n − 1
    or beyond rank n − 1 at its depth: drafting with ``depth`` = min(depth, n − 1) and ``topk`` =
    min(topk, n − 1) yields the same tree for fewer drafter passes (the cost charged per n)."""
    per_pass = stats.drafter_seconds_per_pass() or 0.0
    tau = {n: t for n, t in stats.budget_tau().items() if n >= 2}  # n = 1 drafts nothing: not an EAGLE tree
    if not tau:
        raise ValueError(f"eval.tree_grid={list(ev.tree_grid)}: eagle3 needs a node count >= 2 in the grid")
    depth = lambda n: min(setup["depth"], n - 1)  # noqa: E731
    choice = choose_budget(tau, cost.verify_seconds, lambda n: depth(n) * per_pass, ev.get("tree_nodes"), _objective(ev))
    n = choice.nodes
    dec = {**_eval_decoding(ev), "total_tokens": n - 1, "depth": depth(n), "topk": min(setup["topk"], n - 1)}
    return choice.to_dict() | {"decoding": dec}, {"decoding": dec}, None


# head type -> (the eval key that fixes its tree explicitly, what it fixes); set, it wins over auto / dynamic
EXPLICIT_TREE_KEYS = {"falcon": ("falcon_tree", "tree"), "ctc": ("max_nodes", "tree"),
                      "eagle3": ("decoding.total_tokens", "budget")}


def drafted_tree(drafter) -> dict[str, int]:
    """``{"nodes", "depth"}`` of the tree a drafter drafts as configured (Falcon: its template after the
    depth cap of ``passes x k``; CTC: its node cap, depth -1), or ``{}`` for a drafter without one: what an
    evaluation that sizes nothing (``eval.tree=config``, an explicit tree) records in ``report["tree"]``."""
    template = getattr(drafter, "template", None)
    if template is not None and hasattr(template, "num_nodes"):
        return {"nodes": int(template.num_nodes), "depth": int(template.max_depth)}
    if getattr(drafter, "max_nodes", None) is not None:
        return {"nodes": int(drafter.max_nodes), "depth": -1}
    return {}


# head type -> (setup(head, eval) -> dict with calibration_kwargs, choose(setup, stats, cost, eval))
PLANNERS: dict[str, tuple[Callable, Callable]] = {"falcon": (_falcon_setup, _falcon_choose), "ctc": (_ctc_setup, _ctc_choose),
                                                  "eagle3": (_eagle3_setup, _eagle3_choose)}


def plan_tree(cfg, decoder, info: dict, model, identity, tokenizer, eval_prompts, eos_ids, on_prompt=None):
    """Apply ``eval.tree`` to one method: returns ``(decoder, info)`` with the drafter rebuilt for the
    chosen tree and ``info["tree_choice"]`` (mode, source of the statistics, chosen tree, predicted
    τ and speedup, the cost model).  Unchanged (with a note) for ``config``, non-tree heads and
    reference drafters.

    An explicit ``eval.falcon_tree`` (Falcon) or ``eval.max_nodes`` (CTC) wins over ``auto`` /
    ``dynamic``: that tree is used and the report says so.  The tree is sized for
    ``eval.plan_threads`` threads when set (module doc), else for the run's thread count.

    Calibration shows a progress bar and persists its statistics after every prompt
    (``<calibration file>.partial.json``, atomic), so an interrupted calibration resumes with
    the prompts not yet calibrated (``on_prompt``: :func:`calibrate`'s callback, after the
    persisting).  ``info["tree_choice"]["timing"]``: ``cost_model_seconds`` and
    ``calibration_seconds`` spent by this call (0 for what was read from a cache).

    Raises:
        ValueError: an unknown ``eval.tree``, an empty ``eval.tree_grid``, a ``tree_nodes`` that is not
            calibrated; :class:`CalibrationError` when no held-out prompt is usable.
    """
    ev = cfg.eval
    mode = str(ev.get("tree") or "config")
    if mode not in TREE_MODES:
        raise ValueError(f"eval.tree={mode!r} is not one of {', '.join(TREE_MODES)}")
    head_type = str(info.get("head_type"))
    drafter = getattr(decoder, "drafter", None)
    if mode != "config" and head_type == "adadecode" and hasattr(decoder, "gammas"):
        info["tree_choice"] = {"mode": mode, "applied": False, "reason": "adadecode has no tree to size",
                               "adadecode_model": predict_adadecode(cfg, decoder, model, tokenizer, eval_prompts, eos_ids)}
        return decoder, info
    if mode == "config" or head_type not in PLANNERS or not isinstance(decoder, SpeculativeDecoder):
        info["tree_choice"] = {"mode": mode, "applied": False, **drafted_tree(drafter),
                               "reason": "eval.tree=config" if mode == "config" else f"{head_type} has no tree to size"}
        return decoder, info
    check_grid(ev.tree_grid)
    if ev.get("tree_nodes") is not None and int(ev.tree_nodes) < 1:
        raise ValueError(f"eval.tree_nodes={ev.tree_nodes} must be >= 1 (root included)")
    key, what = EXPLICIT_TREE_KEYS.get(head_type, (None, None))
    if key and OmegaConf.select(ev, key, default=None) is not None:  # the user chose it explicitly: it wins over auto
        log.warning("eval.%s is set: using it, not eval.tree=%s", key, mode)
        info["tree_choice"] = {"mode": mode, "applied": False, **drafted_tree(drafter),
                               "reason": f"eval.{key} given explicitly: that {what} is used (unset it to size the tree)"}
        return decoder, info
    head = drafter.head
    setup_fn, choose_fn = PLANNERS[head_type]
    setup = setup_fn(head, ev)
    root = Path(str(cfg.get("output_root") or "outputs"))
    prompts = calibration_prompts(cfg, tokenizer, eval_prompts, int(ev.calibration_prompts), model)
    grid = check_grid(ev.tree_grid)
    max_new = int(ev.get("calibration_max_new_tokens") or ev.max_new_tokens)
    with planning_threads(ev.get("plan_threads")):
        t0 = time.perf_counter()
        cost = load_or_measure(model, identity, root, grid, int(ev.cost_context_tokens))
        t1 = time.perf_counter()
        stats, path, drafter_source, reused = _acceptance_and_cost(cost, setup, head, head_type, info, ev, model, prompts,
                                                           max_new, eos_ids, grid, root, on_prompt)
        t2 = time.perf_counter()
    if not stats.steps:  # e.g. eval.max_new_tokens=1: each reply's one token comes from the prefill
        raise CalibrationError(
            f"eval.tree={mode}: the calibration on {len(prompts)} held-out prompt(s) verified no draft (each reply ended "
            f"within its first token at {max_new} new token(s), which the prefill gives), so no tree can be sized; "
            "set eval.calibration_max_new_tokens=128, or eval.tree=config")
    timing = {"cost_model_seconds": 0.0 if cost.reused else t1 - t0,
              "calibration_seconds": 0.0 if reused else t2 - t1}
    chosen, kwargs, wrap = choose_fn(setup, stats, cost, ev)
    limits = speed_limits(setup, choose_fn, stats, cost, ev, chosen)
    fallback = vanilla_fallback(ev, chosen, cost)

    def drafter_for(kw, wrapper):
        from core.config import to_container

        make_kwargs = {k: v for k, v in to_container(ev).items()}
        make_kwargs.update(kw)
        make_kwargs["eos_token_ids"] = list(eos_ids)
        d = head.make_drafter(model, **make_kwargs)
        return wrapper(d) if wrapper is not None else d

    if fallback is not None:  # every tree is predicted slower than vanilla decoding: draft nothing
        chosen, new = fallback, RootOnlyDrafter()
    else:
        new = drafter_for(kwargs, wrap)
    decoder.drafter = new
    probe = None
    if int(chosen["nodes"]) == 1:  # the root alone tests nothing of the head: also decode at a small fixed tree
        probe = probe_tree(setup, choose_fn, stats, cost, ev, grid)
        if probe is not None:
            info["probe_decoder"] = SpeculativeDecoder(model, drafter_for(probe.pop("kwargs"), probe.pop("wrap")),
                                                       eos_ids)
    info["tree_choice"] = {
        "mode": mode, "objective": _objective(ev), "applied": True, "chosen": chosen,
        "statistics": {"source": "calibration", "path": str(path), "held_out_prompts": len(prompts),
                       "steps": stats.steps, "max_new_tokens": max_new, "rank_acceptance": stats.rank_acceptance(),
                       "budget_tau": stats.budget_tau(),
                       "drafter_ms_per_pass": 1000 * (stats.drafter_seconds_per_pass() or 0.0),
                       "drafter_cost_source": drafter_source, "plan_threads": cost.key["threads"], "reused": reused},
        "cost_model": cost.to_dict(),
        "predicted_tau": chosen["tau"], "predicted_speedup": chosen["speedup"],
        "limits": limits,
        "timing": timing,
    }
    if probe is not None:
        info["tree_choice"]["probe"] = probe
    log.info("eval.tree=%s for %s: %d nodes, predicted tau %.2f, speedup %.2fx", mode, head_type, chosen["nodes"],
             chosen["tau"], chosen["speedup"])
    if int(chosen["nodes"]) == 1:
        why = "eval.tree_nodes=1 fixes the tree to" if ev.get("tree_nodes") == 1 else f"eval.tree={mode} chose"
        log.warning("%s the root alone for %s: no draft token is verified (tau 1 by construction), "
                    "so this tree does not test the head%s", why, head_type,
                    f"; the head is also decoded at the {probe['nodes']}-node probe tree (report tree.probe)"
                    if probe else "")
    return decoder, info


#: the speedup whose τ :func:`limits_text` states (issue 27's target against the fastest vanilla)
TARGET_SPEEDUP = 1.3


def speed_limits(setup, choose_fn, stats: AcceptanceStats, cost: CostModel, ev, chosen: dict) -> dict[str, Any]:
    """What bounds the predicted speedup of the chosen tree: τ, the drafter or verification (issue 27,
    "where a target is missed, say what limits it, measured"), from the same cost model and calibration.

    The predicted speedup of a tree is τ(T) · c(1) / (c(n) + drafter(T)) (Sequoia, Chen et al. 2024, §3;
    :func:`decoding.tree_search.choose_rank_tree`).  Its three factors are reported separately, for the
    tree the planner chose (before ``eval.tree_fallback``):

    * ``step_in_vanilla_steps`` = (c(n) + drafter) / c(1): what one speculative step costs in one-token
      vanilla steps, so the τ that a speedup s needs at this tree is s times it;
    * ``verify_in_vanilla_steps`` = c(n) / c(1) and ``drafter_share`` = drafter / (c(n) + drafter);
    * ``drafter_free``: the planner's best tree and its predicted τ and speedup when the drafter is free
      (its seconds set to 0, the same acceptance and c(n)): the ceiling a faster drafter could reach.

    Args:
        setup, choose_fn: the head type's planner (:data:`PLANNERS`).
        stats: the calibrated acceptance statistics (``drafter_seconds`` at the cost model's threads).
        cost: the cost model c(n).  ev: the ``eval`` section.  chosen: ``choose_fn``'s choice
            (``nodes``, ``step_seconds``, ``tau``, ``speedup``).

    Returns:
        ``{"step_in_vanilla_steps", "verify_in_vanilla_steps", "drafter_share", "drafter_free": {"nodes",
        "depth", "tau", "speedup"}}`` (floats; depth -1 for a budget without a fixed depth).
    """
    c1 = cost.verify_seconds(1)
    verify = cost.verify_seconds(int(chosen["nodes"]))
    step = float(chosen["step_seconds"])
    free, _, _ = choose_fn(setup, dataclasses.replace(stats, drafter_seconds=0.0), cost, ev)
    return {"step_in_vanilla_steps": step / c1, "verify_in_vanilla_steps": verify / c1,
            "drafter_share": max(step - verify, 0.0) / step if step > 0 else 0.0,
            "drafter_free": {"nodes": int(free["nodes"]), "depth": int(free.get("depth", -1)),
                             "tau": float(free["tau"]), "speedup": float(free["speedup"])}}


def limits_text(limits: dict[str, Any] | None) -> str:
    """One more console line, or ``""`` without limits: ``limits: a step costs 1.25 vanilla steps
    (verification 1.13, drafter 9 %): 1.3x needs tau 1.62 at this tree; with a free drafter the best tree
    is 6 nodes, tau 1.61, 1.28x``."""
    if not limits:
        return ""
    free = limits["drafter_free"]
    return (f"\nlimits: a step costs {limits['step_in_vanilla_steps']:.2f} vanilla steps (verification "
            f"{limits['verify_in_vanilla_steps']:.2f}, drafter {100 * limits['drafter_share']:.0f} %): {TARGET_SPEEDUP}x needs tau "
            f"{TARGET_SPEEDUP * limits['step_in_vanilla_steps']:.2f} at this tree; with a free drafter the best tree is "
            f"{free['nodes']} nodes, tau {free['tau']:.2f}, {free['speedup']:.2f}x")


PROBE_NODES = 4  # the probe tree's size when eval.tree picks the root alone (the grid size nearest to it)


def probe_tree(setup, choose_fn, stats: AcceptanceStats, cost: CostModel, ev, grid) -> dict | None:
    """The small fixed tree at which the head is also decoded when ``eval.tree`` picks the root alone
    (issue 31): the root alone verifies no draft token, so τ = 1 says nothing about the head.

    The probe is the best tree of :data:`PROBE_NODES` nodes (the grid size ≥ 2 nearest to it) by
    the same calibration statistics and cost model (the planner with ``eval.tree_nodes`` fixed:
    Falcon's rank DP, the CTC / EAGLE-3 / dynamic budget); where the statistics accepted nothing
    at all, so that even that tree is the root alone (Falcon's DP), the head's own top-1 chain of
    that many nodes.  It is decoded on the same prompts, interleaved, parity checked; its τ,
    acceptance and speedup go to ``report["tree"]["probe"]``.

    Returns:
        ``{"nodes", "depth", "predicted_tau", "predicted_speedup", "shape", "why", "kwargs" (make_drafter
        overrides), "wrap"}`` (the caller pops ``kwargs`` and ``wrap``), or None when the grid has
        no size ≥ 2.
    """
    from omegaconf import open_dict

    sizes = [int(g) for g in grid if int(g) >= 2]
    if not sizes:
        return None
    n = min(sizes, key=lambda g: (abs(g - PROBE_NODES), g))
    ev_probe = ev.copy()
    with open_dict(ev_probe):
        ev_probe.tree_nodes = n
        ev_probe.tree_fallback = False
    chosen, kwargs, wrap = choose_fn(setup, stats, cost, ev_probe)
    shape = "the best tree of that size by the calibration"
    if int(chosen["nodes"]) == 1 and "k" in setup:  # Falcon: nothing accepted in calibration -> the top-1 chain
        k = int(setup["k"])
        depth = min(n - 1, int(setup["max_depth"]))
        kwargs = {"falcon_passes": max(1, math.ceil(depth / k)), "falcon_tree": {"paths": [[0] * d for d in
                                                                                           range(1, depth + 1)]}}
        chosen, wrap, shape = {"nodes": depth + 1, "depth": depth, "tau": None, "speedup": None}, None, \
            "the head's top-1 chain (calibration accepted nothing)"
    return {"nodes": int(chosen["nodes"]), "depth": chosen.get("depth"), "predicted_tau": chosen.get("tau"),
            "predicted_speedup": chosen.get("speedup"), "shape": shape,
            "why": "eval.tree chose the root alone, which verifies no draft token (tau 1 by construction): the probe "
                   f"decodes the same prompts at a {int(chosen['nodes'])}-node tree so the head is tested",
            "decoding": {k: v for k, v in kwargs.items()}, "kwargs": kwargs, "wrap": wrap}


PREDICTION_TOLERANCE = 0.25  # |measured / predicted - 1| beyond this warns (τ and speedup)


def prediction_warnings(tree: dict | None) -> list[str]:
    """Warnings for a measured τ or speedup more than :data:`PREDICTION_TOLERANCE` off what
    ``eval.tree`` predicted (``report["tree"]`` with ``measured_*``, :func:`evaluation.report.tree_report`),
    each naming the cache file(s) to delete so that the next run measures again: the calibration
    for τ (and the drafter cost), the cost model c(n) and the calibration for the speedup."""
    if not tree or not tree.get("applied") or tree.get("predicted_tau") is None:
        return []
    stats_file = (tree.get("statistics") or {}).get("path")
    cost = tree.get("cost_model") or {}
    out = []
    for what, pred, meas, files in (
            ("tau", tree.get("predicted_tau"), tree.get("measured_tau"), [stats_file]),
            ("speedup", tree.get("predicted_speedup"), tree.get("measured_speedup"), [cost.get("path"), stats_file])):
        if not pred or meas is None or abs(meas / pred - 1.0) <= PREDICTION_TOLERANCE:
            continue
        reused = " (read from the cache)" if (cost.get("reused") if what == "speedup" else
                                                (tree.get("statistics") or {}).get("reused")) else ""
        out.append(f"eval.tree={tree.get('mode')}: measured {what} {meas:.2f} is {meas / pred - 1.0:+.0%} off the "
                   f"predicted {pred:.2f}{reused}; the measurements it was planned on may not fit this run (another "
                   f"load, thread count or prompt mix): delete {' and '.join(str(f) for f in files if f)} to measure "
                   "again")
    return out


def vanilla_fallback(ev, chosen: dict, cost: CostModel) -> dict | None:
    """``eval.tree_fallback``: when the best tree is predicted slower than vanilla decoding
    (predicted speedup < 1, i.e. τ / (c(n) + drafter) < 1 / c(1)), the choice "no tree": the root
    alone and no drafter pass (:class:`decoding.tree_search.RootOnlyDrafter`), predicted τ 1 and
    speedup 1.  None when the fallback is off, the node count is fixed (``eval.tree_nodes``) or a
    tree pays.

    Returns:
        The replacement ``chosen`` dict (``nodes`` 1, ``depth`` 0, ``tau`` 1.0, ``speedup`` 1.0,
        ``fallback`` "vanilla", ``best_tree``: the tree it replaces, candidates included), or None.
    """
    if not ev.get("tree_fallback") or ev.get("tree_nodes") is not None or chosen["speedup"] >= 1.0:
        return None
    step = cost.verify_seconds(1)
    return {"nodes": 1, "depth": 0, "tau": 1.0, "step_seconds": step, "tokens_per_s": 1.0 / step, "speedup": 1.0,
            "fallback": "vanilla", "best_tree": chosen, "candidates": chosen.get("candidates", [])}


def _acceptance_and_cost(cost: CostModel, setup, head, head_type: str, info, ev, model, prompts, max_new: int,
                         eos_ids, grid, root: Path, on_prompt=None) -> tuple[AcceptanceStats, Path, str, bool]:
    """The head's calibrated :class:`AcceptanceStats` with ``drafter_seconds`` at the cost model's
    thread count, from ``<root>/calibration/`` or measured now (and cached).

    Each file records the machine load it was measured under (calibration and every per-thread
    drafter cost: :func:`decoding.measurement.machine_load`); every reuse is logged with the file,
    its age and that load.  A calibration in progress is persisted after every prompt to
    ``<file>.partial.json`` and resumed from there (same key only); the partial file is removed
    once the calibration is complete.

    Returns:
        ``(stats, path of the cache file, source of the drafter cost, reused)``: the source is
        ``"calibration"`` (timed by the calibration pass at this thread count) or ``"timed on N
        prompts"`` (:func:`drafter_cost`); ``reused``: nothing was measured now (all from the file).
    """
    ckpt = Path(str(ev.checkpoint))
    key = {"weights": sha256_file(ckpt / "model.safetensors"), "head": info.get("head_config"),
           "calibration": setup["calibration_kwargs"], "grid": grid, "prompts": [p.id for p in prompts],
           "prompt_tokens": sha256_json([p.input_ids.tolist() for p in prompts]), "max_new_tokens": max_new,
           "device": cost.key["device"], "dtype": cost.key["dtype"]}
    path = root / "calibration" / f"{head_type}-{sha256_json(key)[:16]}.json"
    partial = path.with_name(path.stem + ".partial.json")
    # drafter costs per thread count (and OpenMP wait policy and prepacked weights, when set: cost_key)
    threads = str(cost.key["threads"]) + (f"/{cost.key['omp_wait_policy']}" if cost.key.get("omp_wait_policy") else "")
    if cost.key.get("prepacked_min_rows"):  # a drafter that runs the base's layers over several rows is faster too
        threads += f"/prepacked{cost.key['prepacked_min_rows']}"
    if cost.key.get("prepacked_chunks"):  # bf16 packed for every row count: the drafter's one-row steps too
        threads += "/chunks{}x{}".format(*cost.key["prepacked_chunks"])
    if (head_packed := packed_layers(head)):  # the head's own layers packed too (evaluation.methods.pack_like_base)
        threads += f"/head{head_packed}"
    stats, costs, saved, cached = None, {}, None, False
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            if saved.get("key") == key:
                stats, costs = AcceptanceStats.from_dict(saved["stats"]), dict(saved.get("drafter_cost") or {})
                cached = True
                log.info(reuse_line(f"{head_type} calibration ({stats.steps} steps on {len(prompts)} held-out prompts)",
                                    path, saved.get("measured_at"), saved.get("load")))
        except (ValueError, KeyError, TypeError):
            stats, costs = None, {}
    if stats is None:
        done, resumed, load = 0, None, machine_load()
        if partial.is_file():
            try:
                part = json.loads(partial.read_text())
                if part.get("key") == key and 0 < int(part["done"]) <= len(prompts):
                    resumed, done, load = AcceptanceStats.from_dict(part["stats"]), int(part["done"]), part.get("load")
            except (ValueError, KeyError, TypeError):
                resumed, done = None, 0
        if resumed is not None:
            log.info("resuming the %s calibration: %d of %d held-out prompts already calibrated in %s", head_type, done,
                     len(prompts), partial)
        else:
            log.info("calibrating %s acceptance on %d held-out ShareGPT prompts (max_new_tokens=%d)", head_type,
                     len(prompts), max_new)

        def persist(k: int, st: AcceptanceStats) -> None:  # atomically, so Ctrl-C loses at most the prompt in flight
            atomic_write_json(partial, {"key": key, "done": k, "stats": st.to_dict(), "load": load})
            if on_prompt is not None:
                on_prompt(k, st)

        cal = head.make_drafter(model, eos_token_ids=list(eos_ids), **setup["calibration_kwargs"])
        stats = calibrate(model, cal, prompts, max_new, eos_ids, grid, stats=resumed, done=done, on_prompt=persist,
                          desc=f"calibrating {head_type}")
        costs = {threads: {"passes": stats.drafter_passes, "seconds": stats.drafter_seconds,
                           "prompts": len(prompts), "source": "calibration", "load": load, "measured_at": time.time()}}
        atomic_write_json(path, {"key": key, "stats": stats.to_dict(), "drafter_cost": costs, "load": load,
                                 "measured_at": time.time()})
        partial.unlink(missing_ok=True)
    elif threads not in costs:
        few = prompts[:DRAFTER_COST_PROMPTS]
        log.info("timing the %s drafter on %d held-out prompts at %s threads", head_type, len(few), threads)
        cal = head.make_drafter(model, eos_token_ids=list(eos_ids), **setup["calibration_kwargs"])
        load = machine_load()
        costs[threads] = drafter_cost(model, cal, few, max_new, eos_ids) | {
            "source": f"timed on {len(few)} prompts", "load": load, "measured_at": time.time()}
        atomic_write_json(path, {**saved, "drafter_cost": costs})  # the file as read, plus this thread count
        cached = False
    c = costs[threads]
    source = str(c.get("source", "calibration"))
    if cached:
        log.info(reuse_line(f"{head_type} drafter cost at {threads} threads", path, c.get("measured_at"), c.get("load")))
    if c["passes"]:  # the calibration's passes per step, at this thread count's seconds per pass
        stats.drafter_seconds = float(c["seconds"]) / int(c["passes"]) * stats.drafter_passes
    return stats, path, source, cached


@torch.no_grad()
def predict_adadecode(cfg, decoder, model, tokenizer, eval_prompts, eos_ids) -> dict[str, Any]:
    """AdaDecode's cost model per threshold γ on held-out prompts (never the evaluation prompts).

    The held-out prompts are decoded greedily; one base forward over prompt + continuation gives
    hs[ℓ] and the greedy labels at every generated position, and the head's exit policy is
    simulated there (:meth:`heads.adadecode.AdaDecodeHead.validation_metrics`: exit at the first
    candidate layer with confidence ≥ γ; sequential layer steps c = L, e or e + L).  Returns the
    expected layer steps per token and the layer-step speedup L / E[c] for every
    ``heads.val_gammas`` threshold and for the decoder's own schedule (``configured``), to set
    beside the measured ``decoder_summary.layer_steps_per_token``.

    Raises:
        CalibrationError: no usable held-out prompt.
    """
    import heads
    from decoding.vanilla import greedy_generate

    ev = cfg.eval
    head, _ = heads.load(Path(str(ev.checkpoint)), base_model=model)
    head.to(next(model.parameters()).device).eval()
    prompts = calibration_prompts(cfg, tokenizer, eval_prompts, int(ev.calibration_prompts), model)
    max_new = int(ev.get("calibration_max_new_tokens") or ev.max_new_tokens)
    L = int(model.config.num_hidden_layers)
    confs, correct = [], []
    for p in prompts:
        out, _ = greedy_generate(model, p.input_ids, max_new, eos_ids)
        ids = torch.cat([p.input_ids, torch.tensor(out[:-1], dtype=torch.long)]).to(next(model.parameters()).device)
        res = model(input_ids=ids[None], output_hidden_states=True)
        hs = res.hidden_states
        t0 = p.input_ids.numel() - 1  # positions predicting the generated tokens
        labels = res.logits[0, t0:].argmax(-1)
        _, c, a, _ = head._chunk_stats(hs[L][0, t0:], *[hs[layer][0, t0:] for layer in head.layers], want_preds=True)
        confs.append(c)
        correct.append(head.to_base_ids(a) == labels.unsqueeze(0))  # a: draft-vocabulary indices, labels: base ids
    confs_t, correct_t = torch.cat(confs, 1), torch.cat(correct, 1)

    def row(gammas) -> dict[str, float]:
        pol = head._policy(confs_t, correct_t, gammas)
        cost = float(pol["cost"][0] / pol["cost"][1])
        return {"expected_layer_steps_per_token": cost * L, "predicted_layer_step_speedup": 1.0 / cost,
                "exit_rate": float(pol["exit"][0] / pol["exit"][1]),
                "reject_rate": float(pol["reject"][0] / pol["reject"][1]) if float(pol["reject"][1]) else None}

    return {"source": "calibration", "held_out_prompts": len(prompts), "tokens": int(confs_t.shape[1]),
            "per_gamma": {str(g): row([float(g)] * len(head.layers)) for g in head.val_gammas},
            "configured": row([float(decoder.gammas[layer]) for layer in head.layers]),
            "gammas": {str(k): float(v) for k, v in decoder.gammas.items()}}


def describe(choice: dict | None) -> str:
    """One console line: the chosen tree and predicted τ / speedup (measured added by the caller)."""
    if not choice:
        return "tree: -"
    if not choice.get("applied"):
        ada = choice.get("adadecode_model")
        if ada:
            c = ada["configured"]
            return (f"adadecode model ({ada['held_out_prompts']} held-out prompts): expected layer steps/token "
                    f"{c['expected_layer_steps_per_token']:.1f}, layer-step speedup {c['predicted_layer_step_speedup']:.2f}x")
        drafted = ""
        if choice.get("nodes") is not None:
            depth = f", depth {choice['depth']}" if choice.get("depth", -1) >= 0 else " (budget)"
            drafted = f": {choice['nodes']} nodes{depth}"
        return f"tree: {choice.get('mode')} ({choice.get('reason')}){drafted}"
    c = choice["chosen"]
    if c.get("fallback"):
        b = c["best_tree"]
        return (f"tree: {choice['mode']} -> no tree (eval.tree_fallback: the best, {b['nodes']} nodes, is predicted at "
                f"{b['speedup']:.2f}x vanilla; decoding drafts nothing, predicted tau 1.00, speedup 1.00x)")
    if int(c["nodes"]) == 1:
        return (f"tree: {choice['mode']} -> the root alone: no draft token is verified (tau 1 by construction), so "
                "this tree does not test the head" + (f"; see the {choice['probe']['nodes']}-node probe tree"
                                                      if choice.get("probe") else ""))
    shape = f"{c['nodes']} nodes" + (f", depth {c['depth']}" if c.get("depth", -1) >= 0 else " (budget)")
    return (f"tree: {choice['mode']} -> {shape}; predicted tau {choice['predicted_tau']:.2f}, speedup "
            f"{choice['predicted_speedup']:.2f}x (statistics: {choice['statistics']['source']}, "
            f"{choice['statistics']['held_out_prompts']} held-out prompts)")
