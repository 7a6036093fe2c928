"""The lossless evaluation run: vanilla greedy vs the head's decoder on the same prompts.

For every prompt (interleaved, so load drift hits both alike) vanilla greedy decoding
(:func:`decoding.vanilla.greedy_generate`) and each method's decoder (:mod:`evaluation.methods`)
run on the same base model; outputs must match token for token (issue 3, "Output parity").

With ``eval.temperature`` > 0 the reference is vanilla ancestral sampling
(:func:`decoding.vanilla.sample_generate`) and the method must sample too (AdaDecode does; the
tree decoders are greedy-only and refuse).  Samples cannot be compared token for token, so the
report's parity is marked unchecked; losslessness in distribution is what
``tests/test_adadecode_sampling.py`` tests.  Speed, τ and exit/rejection rates are still reported.

Finished prompt turns go to ``progress.jsonl`` as they finish (:mod:`evaluation.progress`), so an
interrupted run resumes.  Outputs in the run directory: ``config.yaml`` (resolved),
``report.json`` (:mod:`evaluation.report`), ``acceptance.png`` (:mod:`evaluation.plots`),
``summary.json`` / ``summary.md`` (:mod:`evaluation.summary`).
"""
from __future__ import annotations

import functools
import logging
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from core.config import save_config, to_container
from core.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from decoding.cost_model import omp_wait_policy
from decoding.vanilla import check_context_limit, eos_token_ids, greedy_generate, sample_generate
from evaluation.divergence import Accountant, add_accounting, failing_ids
from evaluation.fastest_vanilla import build_references, fastest, packed_loader, reference_labels
from evaluation.methods import (REFERENCE_DRAFTERS, build_decoder, check_checkpoint_given, checkpoint_label, prepacked_products,
                                resolve_device, row_consistent_products, variant_configs)
from evaluation.plots import plot
from evaluation.progress import (Progress, ResultsMismatch, absolute_paths, check_progress, check_prompts_unchanged,
                                 progress_fingerprint, prompt_digest)
from evaluation.probe import ProbeTallies
from evaluation.prompts import load_prompts, read_jsonl_records
from evaluation.report import build_report
from evaluation.status import plan_phases, run_status, skipped_turn
from evaluation.summary import resume_hint, summary_markdown, summary_row
from evaluation.turns import follow_up_prompt, length_bound, turns_to_run

log = logging.getLogger(__name__)




class ParityError(RuntimeError):
    """The method's output differed from vanilla greedy decoding on at least one prompt."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_output_dir(cfg: DictConfig, info: dict[str, Any]) -> Path:
    """``<output_root>/eval/<head type>-<checkpoint label or 'variants'>-<UTC time>``."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    head = str(info["head_type"]).split(":")[0]
    what = "variants" if cfg.eval.get("variants") else checkpoint_label(cfg.eval.checkpoint)
    return Path(str(cfg.get("output_root", "runs"))) / "eval" / f"{head}-{what}-{stamp}"


def _timed(fn, ids, max_new, device):
    _sync(device)
    t0 = time.perf_counter()
    out, stats = fn(ids, max_new)
    _sync(device)
    return [int(t) for t in out], stats, time.perf_counter() - t0


def _decode_prompt(p, reference, decoders, max_new: int, device, repeats: int = 1, refs=None) -> dict[str, Any]:
    """Vanilla, then every decoder, on one prompt (timed separately): a JSON-safe record.

    ``refs`` (``{label: generate}``, :mod:`evaluation.fastest_vanilla`): other vanillas timed right
    after vanilla in every round; ``rec["vanilla_refs"][label]`` holds their token count, whether they
    decoded vanilla's tokens (``same_tokens``: another dtype may not; fp32 with another attention should)
    and seconds.

    With ``repeats`` > 1 the whole round (vanilla, then each decoder) runs ``repeats`` times,
    interleaved so load drift hits all alike.  Tokens and stats are kept from the first round
    (τ, acceptance and parity are deterministic); every round's seconds go to
    ``seconds_repeats`` (``seconds`` is their mean), and ``repeat_mismatch`` lists the rounds
    (1-based) whose tokens differed from the first round's (empty for a deterministic decoder).
    """
    rec = {"id": p.id, "prompt_sha256": prompt_digest(p.input_ids), "vanilla": None, "methods": [None] * len(decoders)}
    for r in range(repeats):
        for j, fn in enumerate([reference] + [d.generate for d in decoders]):
            toks, stats, sec = _timed(fn, p.input_ids, max_new, device)
            slot = rec["vanilla"] if j == 0 else rec["methods"][j - 1]
            if slot is None:
                slot = {"tokens": toks, "stats": stats, "seconds_repeats": [], "repeat_mismatch": []}
                if j == 0:
                    rec["vanilla"] = slot
                else:
                    rec["methods"][j - 1] = slot
            elif toks != slot["tokens"]:
                slot["repeat_mismatch"].append(r + 1)
            slot["seconds_repeats"].append(sec)
            if j == 0:
                for label, fn in (refs or {}).items():
                    toks_r, _, sec_r = _timed(fn, p.input_ids, max_new, device)
                    ref_slot = rec.setdefault("vanilla_refs", {}).setdefault(
                        label, {"tokens": len(toks_r), "same_tokens": toks_r == rec["vanilla"]["tokens"],
                                "seconds_repeats": []})
                    ref_slot["seconds_repeats"].append(sec_r)
    for slot in [rec["vanilla"], *rec["methods"], *rec.get("vanilla_refs", {}).values()]:
        slot["seconds"] = sum(slot["seconds_repeats"]) / len(slot["seconds_repeats"])
    return rec


def wait_policy_warning(device, threads: int, policy: str | None) -> str | None:
    """The line to print when the timing would run with OpenMP's idle threads asleep, else None.

    ``OMP_WAIT_POLICY=PASSIVE`` (common advice for multi-process jobs) puts idle OpenMP threads to
    sleep between parallel regions; a one-token decoding step is hundreds of small ones, and waking
    the threads each time made it 2.8x slower on a 2-core machine of this project's kind (fp32,
    2 threads: 148 ms against 55 ms, ``benchmarks/bench_vanilla_step.py``; docs/precision.md).
    Both vanilla and speculative decoding pay it, but not equally, so a speedup measured under it
    is not the one a user gets.  ``policy`` is :func:`decoding.cost_model.omp_wait_policy`'s
    normalised value (upper-cased, None when unset), the one the cost caches are keyed by.
    """
    if torch.device(device).type != "cpu" or threads < 2 or policy != "PASSIVE":
        return None
    return (f"OMP_WAIT_POLICY=PASSIVE with {threads} threads: decoding steps run much slower (2.8x measured on "
            "2 cores, docs/precision.md), so tokens/s and speedups from this run are not speed figures; "
            "unset it (or set eval.threads=1) for timing")


def run_evaluation(cfg: DictConfig, base=None, decoder=None) -> dict[str, Any]:
    """Run the evaluation described by ``cfg`` and write the outputs (:func:`_evaluate`).

    The reports are written on every exit path: when decoding stops in the middle (an exception
    in a decoder, KeyboardInterrupt), ``report.json`` / ``summary.*`` hold every prompt turn
    decoded so far (``complete`` false, ``error`` the reason, ``pending_prompts``), then the
    exception propagates; ``resume=auto`` continues from ``progress.jsonl``.

    Raises:
        core.config.ConfigError: ``eval.output_dir`` cannot become a folder to write into (checked
            before the base loads).
        FileNotFoundError: a checkpoint (``eval.checkpoint``, a variant's) is not a head checkpoint
            folder (:func:`heads.registry.check_checkpoint_dir`; checked before the base loads).
        ValueError: such a checkpoint holds another head than ``heads.type``, or ``eval.output_dir`` holds
            results this run may not continue (:func:`evaluation.progress.check_progress`); both before the
            base loads.
    """
    from core.config import check_output_path

    check_output_path(cfg, "eval.output_dir")
    if decoder is None:  # a missing, mistyped or other head's checkpoint is named before the base loads
        from heads.registry import check_checkpoint_dir

        want = cfg.heads.get("type") if "heads" in cfg else None
        variants = [v for v in (cfg.eval.get("variants") or []) if hasattr(v, "get")]
        for i, holder in enumerate(variants or [cfg.eval]):  # a variant without its own checkpoint runs eval.checkpoint
            ckpt = holder.get("checkpoint", cfg.eval.get("checkpoint"))
            try:
                check_checkpoint_given(ckpt)
                if str(ckpt) not in REFERENCE_DRAFTERS:
                    check_checkpoint_dir(str(ckpt), want)
            except (FileNotFoundError, ValueError) as exc:
                if not variants:
                    raise
                raise type(exc)(f"eval.variants[{i}]: {exc}") from None
    progress_file = Path(str(cfg.eval.output_dir)) / "progress.jsonl" if cfg.eval.get("output_dir") else None
    prior: dict[str, Any] = {}
    if progress_file is not None and progress_file.is_file():  # results this run may not continue: before the base loads
        full = absolute_paths(cfg)
        _, prior = check_progress(progress_file, progress_fingerprint(full), full.get("resume"), config=full)
    state: dict[str, Any] = {"prior_records": prior}
    try:
        return _evaluate(cfg, base, decoder, state)
    except BaseException as exc:
        finish = state.get("finish")
        # results of other prompts on disk: their report stays as it is (nothing of this run's to add)
        if finish is not None and not state.get("written") and not isinstance(exc, ResultsMismatch):
            try:
                out_dir = finish(error=exc)
                at = f" while decoding prompt {state['stopped_at']!r}" if state.get("stopped_at") is not None else ""
                log.error("evaluation stopped%s (%s: %s); the %d prompt turn(s) decoded are reported in %s; %s",
                          at, type(exc).__name__, exc, state.get("decoded", 0), out_dir, resume_hint(out_dir))
            except Exception as inner:  # noqa: BLE001 — never mask the original failure
                log.error("could not write the partial report: %s: %s", type(inner).__name__, inner)
        raise


@torch.no_grad()
def _evaluate(cfg: DictConfig, base, decoder, state: dict[str, Any]) -> dict[str, Any]:
    """Run the evaluation described by ``cfg`` and write the outputs.

    Per prompt, vanilla greedy decoding runs once, then every method variant (``eval.variants``,
    see :func:`variant_configs`; one variant when unset), interleaved so that load drift hits all
    alike.

    With ``eval.turns`` > 1 every prompt's later turns follow it, each built from the vanilla
    answer to the turn before (:func:`evaluation.turns.follow_up_prompt`); with ``eval.repeats``
    > 1 each prompt's round is timed that many times (:func:`_decode_prompt`).  Reports carry
    ``parity_per_turn``, ``per_turn``, ``per_category`` (:mod:`evaluation.breakdown`) and
    ``timing``; ``summary.json`` and ``summary.md`` (:mod:`evaluation.summary`) are written too.

    Args:
        cfg: the composed config (``model``, ``data``, ``heads``, ``eval`` sections).
        base: optional preloaded ``(model, tokenizer, identity)``; else loaded from ``cfg.model``
            with ``dtype = eval.dtype``.
        decoder: optional Decoder to evaluate instead of the one built from ``eval.checkpoint``
            (single variant only).

    Returns:
        The report dict (also written to ``<output_dir>/report.json``); ``report["output_dir"]``.
        With ``eval.variants``: ``{"variants": {name: report}, "output_dir": ...}``, each report
        written to ``<output_dir>/<name>/report.json`` and a table to ``<output_dir>/summary.json``.

    Raises:
        ParityError: ``eval.fail_on_mismatch`` and some prompt's output differed (after the
            reports were written); the message names the variants and prompt ids.
        ValueError: a bad ``eval.variants`` entry or checkpoint (see :func:`build_decoder`), or a
            prompt + ``eval.max_new_tokens`` beyond the base's ``max_position_embeddings`` (raised
            before anything is written; :func:`decoding.vanilla.check_context_limit`).
    """
    cfg = absolute_paths(cfg)  # config.yaml and the progress fingerprint hold no cwd-relative paths
    ev = cfg.eval
    if ev.get("threads"):
        torch.set_num_threads(int(ev.threads))
    device = resolve_device(ev.get("device"))
    if (warning := wait_policy_warning(device, torch.get_num_threads(), omp_wait_policy())):
        log.warning(warning)
    variants = variant_configs(cfg)
    if decoder is not None and variants[0][0] is not None:
        raise ValueError("run_evaluation(decoder=...) takes no eval.variants")
    # a prompt file is read (and refused, by line) before the base loads
    records = read_jsonl_records(ev.prompts, ev.get("prompt_field")) if ev.get("prompts") else None
    from core.base_model import load_base_model, load_base_model_as, load_tokenizer

    if base is None:
        from core.precision import resolve_dtype

        resolve_dtype(ev.dtype, "eval.dtype", device, auto_ok=False)  # bf16 without bf16 instructions: named
    # the prompts too, with the tokenizer alone: no usable prompt (eval.prompt_offset past the set...) costs no model load
    prompts, skipped = load_prompts(ev, cfg.data if "data" in cfg else {},
                                    load_tokenizer(cfg.model) if base is None else base[1], records)
    if state.get("prior_records"):  # results decoded for other prompts (an edited file): before the base loads
        check_prompts_unchanged(Path(str(ev.output_dir)) / "progress.jsonl", state["prior_records"], prompts)
    if base is None:
        model_cfg = to_container(cfg.model)
        model_cfg["dtype"] = ev.dtype
        base = load_base_model(model_cfg)
    model, tokenizer, identity = base
    model.to(device)
    # fp32 on a CPU: many-row products without per-call weight packing; bf16 on an AMX CPU: every product packed,
    # where that is row-consistent; then the bf16 layers left unpacked round one-token steps as verification does
    prepacked = prepacked_products(model, ev)
    row_padded = row_consistent_products(model, ev)
    eos_ids = eos_token_ids(tokenizer, model)
    methods = []  # (name, cfg, decoder, info)
    if decoder is not None:
        methods.append((None, cfg, decoder, {"checkpoint": str(ev.get("checkpoint")), "head_type": "custom",
                                             "decoder": type(decoder).__name__}))
    else:
        for name, vcfg in variants:
            dec, info = build_decoder(vcfg, model, eos_ids, device, identity=identity)
            methods.append((name, vcfg, dec, info))
    temperature = float(ev.get("temperature") or 0.0)
    if temperature > 0:
        for name, _, dec, info in methods:
            if float(getattr(dec, "temperature", 0.0) or 0.0) != temperature:
                raise ValueError(f"eval.temperature={temperature:g} needs a sampling decoder, but {info['decoder']}"
                                 f"{f' [{name}]' if name else ''} decodes greedily only (heads=adadecode samples)")
    sampler = torch.Generator(device=device)
    sampler.manual_seed(int(cfg.get("seed") or 0))

    def reference(ids, n):
        if temperature > 0:
            return sample_generate(model, ids, n, eos_ids, temperature, sampler)
        return greedy_generate(model, ids, n, eos_ids)

    turns = ev.get("turns", 1)
    for p in prompts:  # before anything is written: prompt + eval.max_new_tokens must fit the context
        check_context_limit(model, int(p.input_ids.numel()), int(ev.max_new_tokens), what=f"eval prompt {p.id!r}: ",
                            budget_key="eval.max_new_tokens")
        for t in range(2, turns_to_run(turns, p) + 1):  # later turns: bound with max_new_tokens answers
            n = length_bound(tokenizer, p, t, int(ev.max_new_tokens))
            if n is None:  # the template cannot render this turn: skipped (with its reason) when it comes
                break
            check_context_limit(model, n - int(ev.max_new_tokens), int(ev.max_new_tokens),
                                what=f"eval prompt {p.id!r} turn {t} (earlier answers at their longest): ",
                                budget_key="eval.max_new_tokens")
    # eval.tree=auto|dynamic: cost model + held-out calibration -> each tree head's tree (before anything is written)
    from evaluation.tree_auto import plan_tree

    t_plan = time.perf_counter()
    methods = [(name, vcfg, *plan_tree(vcfg, dec, info, model, identity, tokenizer, prompts, eos_ids))
               for name, vcfg, dec, info in methods]
    phases = plan_phases(methods, time.perf_counter() - t_plan)
    for m in methods:
        m[3]["row_consistent_layers"] = len(row_padded)
        m[3]["prepacked_layers"] = len(prepacked)
    # eval.tree chose the root alone: the head is also decoded at a small probe tree (evaluation.probe)
    probe_owners = [j for j, m in enumerate(methods) if "probe_decoder" in m[3]]
    decoders = [m[2] for m in methods] + [methods[j][3].pop("probe_decoder") for j in probe_owners]
    probes = ProbeTallies(probe_owners, len(methods))
    # bf16 / fp16 greedy: every divergence from vanilla (methods and probes) is accounted for (near tie or real
    # error), against a plain fp32 copy loaded at the first divergence; the vanilla references are packed
    # one copy of the base per other dtype: the fp32 one is both a (packed) vanilla reference and, through
    # decoding.prepacked.plain_products, the accountant's plain fp32 base
    load_as = functools.cache(lambda dtype: load_base_model_as(cfg.model, dtype, device))
    accountant = Accountant.for_run(cfg, model, tokenizer, decoders, load=lambda: load_as("float32"))
    # the speed headline is against the fastest vanilla on this machine (eval.fastest_vanilla)
    refs = build_references(reference_labels(ev, model, device, row_padded), model, packed_loader(load_as, ev),
                            eos_ids)
    ref_tally: dict[str, dict[str, float]] = {label: {"tokens": 0, "seconds": 0.0, "prompts": 0} for label in refs}
    out_dir = Path(str(ev.output_dir)) if ev.get("output_dir") else default_output_dir(cfg, methods[0][3])
    out_dir.mkdir(parents=True, exist_ok=True)
    # refuses (before anything is written) when out_dir holds results and resume is not auto
    progress = Progress(out_dir / "progress.jsonl", progress_fingerprint(cfg), cfg.get("resume"), config=cfg)
    save_config(cfg, out_dir)
    max_new = int(ev.max_new_tokens)
    n_turns = sum(turns_to_run(turns, p) for p in prompts)
    log.info("evaluating %s on %d prompts%s (max_new_tokens=%d) on %s -> %s",
             ", ".join(str(m[3]["decoder"]) + (f" [{m[0]}]" if m[0] else "") for m in methods), len(prompts),
             f", {n_turns} turns" if n_turns != len(prompts) else "", max_new, device, out_dir)

    for _ in range(int(ev.get("warmup") or 0)):  # untimed: allocator, kernels, lazy imports
        reference(prompts[0].input_ids, min(8, max_new))
        for fn in refs.values():
            fn(prompts[0].input_ids, min(8, max_new))
        for d in decoders:
            d.generate(prompts[0].input_ids, min(8, max_new))

    if progress.records:
        log.info("resuming: %d prompt turn(s) already decoded in %s", len(progress.records), progress.path)
    van_tokens = van_seconds = van_forwards = 0
    reused = 0  # prompt turns whose results an earlier launch (or a merged shard) decoded
    acc = [{"stats": [], "rows": [], "tokens": 0, "seconds": 0.0} for _ in methods]
    repeats = int(ev.get("repeats") or 1)
    last_ref: list[int] = []

    skipped_turns: list[dict[str, Any]] = []

    def units():  # every prompt's turns in order; turn k > 1 is built from turn k-1's vanilla answer
        for q in prompts:
            unit = q
            for t in range(1, turns_to_run(turns, q) + 1):
                if t > 1:
                    try:
                        unit = follow_up_prompt(tokenizer, unit, last_ref, eos_ids)
                        check_context_limit(model, int(unit.input_ids.numel()), max_new,
                                            what=f"eval prompt {unit.id!r}: ", budget_key="eval.max_new_tokens")
                    except ValueError as exc:  # PromptError included: this turn has no correct prompt
                        skipped_turns.append(skipped_turn(q.id, t, turns_to_run(turns, q), exc))
                        log.warning("skipping %s: %s", ", ".join(skipped_turns[-1]["ids"]), exc)
                        break  # the later turns follow this one's answer
                yield unit

    done = []
    t_decode = time.perf_counter()

    def finish(error: BaseException | None = None):
        """Write report.json / acceptance.png per method and summary.*; returns the result (after a
        failure: the output directory).  Raises ParityError for a finished run with mismatches."""
        tallied = done[:len(acc[0]["rows"])]  # a prompt in flight has no result yet
        state["decoded"] = len(tallied)
        phases["decoding_seconds"] = time.perf_counter() - t_decode
        # the timed decoding behind every reported turn, this launch's or not (a merged run decodes nothing itself)
        phases["timed_decoding_seconds"] = (van_seconds + sum(a["seconds"] for a in acc)
                                            + sum(r["seconds"] for r in ref_tally.values()))
        phases["turns_decoded_earlier"] = min(reused, len(tallied))
        status = run_status(error, prompts, tallied, done[len(tallied)] if len(done) > len(tallied) else None, phases)
        state["stopped_at"] = status["stopped_at"]  # the prompt turn in flight, named by the log line of a stop
        return _write_outputs(out_dir, methods, acc, identity, device, model, ev, tallied, skipped + skipped_turns,
                              max_new, eos_ids, van_tokens, van_seconds, van_forwards, status, state,
                              raise_on_mismatch=error is None, probes=probes, ref_tally=ref_tally)

    state["finish"] = finish
    for i, p in enumerate(units()):
        done.append(p)
        rec = progress.records.get(p.id)
        if rec is not None:  # a later turn is built from earlier answers: checked as it is reached
            check_prompts_unchanged(progress.path, progress.records, [p])
        if rec is not None and len(rec["methods"]) != len(decoders):
            rec = None  # decoded with(out) a probe tree this run does not (does): decode it again
        reused += rec is not None
        if rec is None:
            rec = _decode_prompt(p, reference, decoders, max_new, device, repeats, refs)
            if accountant is not None:
                accountant.annotate(rec, p.input_ids, decoders)
            progress.append(rec)
        ref, vstats, v_sec = rec["vanilla"]["tokens"], rec["vanilla"]["stats"], rec["vanilla"]["seconds"]
        last_ref[:] = ref
        van_tokens += len(ref)
        van_seconds += v_sec
        van_forwards += vstats["base_forwards"] + vstats["prefill_forwards"]
        for label, r in (rec.get("vanilla_refs") or {}).items():
            if label in ref_tally:
                ref_tally[label]["tokens"] += r["tokens"]
                ref_tally[label]["seconds"] += r["seconds"]
                ref_tally[label]["prompts"] += 1
        for (name, _, _, _), a, m in zip(methods, acc, rec["methods"]):
            out, mstats, m_sec = m["tokens"], m["stats"], m["seconds"]
            match = (out == ref) if temperature == 0 else None
            first_diff = None
            if match is False:
                first_diff = next((j for j, (x, y) in enumerate(zip(out, ref)) if x != y), min(len(out), len(ref)))
            a["tokens"] += len(out)
            a["seconds"] += m_sec
            a["stats"].append(mstats)
            emitted = mstats.get("emitted_per_step")
            row = {"id": p.id, "turn": p.turn, "category": p.category,
                   "prompt_tokens": int(p.input_ids.numel()), "vanilla_tokens": len(ref),
                   "method_tokens": len(out), "match": match, "first_mismatch": first_diff,
                   "vanilla_seconds": v_sec, "method_seconds": m_sec,
                   "speedup": (v_sec / len(ref)) / (m_sec / len(out)) if out and ref and m_sec > 0 else None,
                   "tau": (sum(emitted) / len(emitted)) if emitted else None,
                   "vanilla_seconds_repeats": rec["vanilla"].get("seconds_repeats", [v_sec]),
                   "method_seconds_repeats": m.get("seconds_repeats", [m_sec]),
                   "repeat_mismatch": sorted(set(rec["vanilla"].get("repeat_mismatch", []))
                                             | set(m.get("repeat_mismatch", []))),
                   "stats": {k: v for k, v in mstats.items() if k != "emitted_per_step"}}
            if match is False:
                row["vanilla_output"], row["method_output"] = ref, out
            if "divergence" in m:
                row["divergence"] = m["divergence"]
            a["rows"].append(row)
            log.info("[%d] %s%s: %d tokens, tau=%s, %s", i + 1, p.id, f" [{name}]" if name else "",
                     len(out), f"{row['tau']:.2f}" if row["tau"] else "-",
                     "sampled" if match is None else "match" if match else f"MISMATCH at {first_diff}")
        probes.add(p.id, rec, temperature == 0)

    return finish()


def _write_outputs(out_dir, methods, acc, identity, device, model, ev, done, skipped, max_new, eos_ids, van_tokens,
                   van_seconds, van_forwards, status, state, raise_on_mismatch=True, probes=None, ref_tally=None):
    """The run's outputs from the per-prompt tallies: per method ``report.json`` + ``acceptance.png``,
    and ``summary.json`` / ``summary.md``; ``status`` (:func:`run_status`) goes into each report.
    Returns the result of :func:`run_evaluation` (with ``raise_on_mismatch`` False, after a
    failure: the output directory)."""
    vanilla = {"tokens": van_tokens, "seconds": van_seconds, "tokens_per_s": van_tokens / van_seconds if van_seconds else None,
               "base_forwards_per_token": van_forwards / van_tokens if van_tokens else None}
    reports, probe_failed = {}, {}
    for j, ((name, vcfg, dec, info), a) in enumerate(zip(methods, acc)):
        vdir = out_dir / name if name else out_dir
        vdir.mkdir(parents=True, exist_ok=True)
        rep = build_report(info, identity, device, model, vcfg.eval, done, skipped, max_new, eos_ids, vanilla,
                      a["stats"], a["seconds"], a["tokens"], a["rows"], dec, vdir)
        add_accounting(rep)  # bf16: parity.mode = accounting (near ties vs real errors); fp32 parity stays exact
        rep["fastest_vanilla"] = fastest(str(rep.get("dtype")), vanilla, ref_tally or {},
                                         rep["method"].get("tokens_per_s"), len(done))
        rep.update(status)
        measured = probes.summary(j, vanilla) if probes is not None else None
        if measured is not None and (rep.get("tree") or {}).get("probe") is not None:
            rep["tree"]["probe"] = {**rep["tree"]["probe"], **measured}
            if measured["parity"]["mismatched_ids"]:
                probe_failed[name] = [f"{i} (probe tree)" for i in measured["parity"]["mismatched_ids"]]
        if status["complete"] and rep.get("tree"):  # measured far from predicted: say which cache to delete
            from evaluation.tree_auto import prediction_warnings

            rep["tree"]["warnings"] = prediction_warnings(rep["tree"])
            for w in rep["tree"]["warnings"]:
                log.warning("%s%s", f"[{name}] " if name else "", w)
        if name:
            rep["variant"] = name
            save_config(vcfg, vdir)
        atomic_write_json(vdir / "report.json", rep)
        atomic_write_bytes(vdir / "acceptance.png", plot(rep))
        reports[name] = rep
    failed = {n: failing_ids(r) + probe_failed.get(n, []) for n, r in reports.items()
              if failing_ids(r) or probe_failed.get(n)}
    unstable = {n: r["timing"]["nonidentical_ids"] for n, r in reports.items() if r["timing"]["nonidentical_ids"]}
    rows = [summary_row(n, r) for n, r in reports.items()]
    if methods[0][0] is None:
        result = reports[None]
    else:
        result = {"variants": reports, "output_dir": str(out_dir)}
    atomic_write_json(out_dir / "summary.json", {"vanilla": vanilla, "variants": rows})
    atomic_write_text(out_dir / "summary.md", summary_markdown(rows, str(out_dir)))
    state["written"] = True
    if not raise_on_mismatch:
        return out_dir
    if (failed or unstable) and ev.get("fail_on_mismatch", True):
        where = "; ".join(f"{n + ': ' if n else ''}ids {', '.join(ids)}" for n, ids in failed.items())
        where += "".join(f"; {n + ': ' if n else ''}repeats decoded other tokens on ids {', '.join(ids)}"
                         for n, ids in unstable.items())
        what = ("differs from vanilla greedy decoding" if all(r["parity"].get("mode") != "accounting" for r in reports.values())
                else f"diverges from {reports[next(iter(reports))]['dtype']} vanilla greedy decoding by more than a near tie")
        raise ParityError(f"output {what} on {sum(map(len, failed.values()))} "
                          f"prompt run(s) of {len(done)} prompts: {where.lstrip('; ')} "
                          f"(details in report.json under {out_dir})")
    return result
