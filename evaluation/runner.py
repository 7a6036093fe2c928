"""The lossless evaluation run: vanilla greedy vs the head's decoder on the same prompts.

For every prompt (interleaved, so load drift hits both alike) vanilla greedy decoding
(:func:`decoding.vanilla.greedy_generate`) and the method's decoder run on the same base model;
outputs must match token for token (issue 3, "Output parity").  The method's decoder is

* a :class:`decoding.speculative.Decoder` (has ``generate``) returned by
  ``head.make_drafter(base, eos_token_ids=..., **cfg.eval)`` (e.g. AdaDecode), used as is, or
* a :class:`decoding.speculative.Drafter`, wrapped in :class:`decoding.speculative.SpeculativeDecoder`,
* or, for ``eval.checkpoint=oracle|random``, a reference drafter (:mod:`decoding.reference`).

With ``eval.temperature`` > 0 the reference is vanilla ancestral sampling
(:func:`decoding.vanilla.sample_generate`) and the method must sample too (AdaDecode does; the
tree decoders are greedy-only and refuse).  Samples cannot be compared token for token, so the
report's parity is marked unchecked; losslessness in distribution is what
``tests/test_adadecode_sampling.py`` tests.  Speed, τ and exit/rejection rates are still reported.

Outputs in the run directory: ``config.yaml`` (resolved), ``report.json``, ``acceptance.png``.
"""
from __future__ import annotations

import io
import json
import logging
import os
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from core.config import save_config, to_container
from core.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from decoding.reference import OracleDrafter, RandomDrafter
from decoding.speculative import Decoder, Drafter, SpeculativeDecoder
from decoding.vanilla import check_context_limit, eos_token_ids, greedy_generate, sample_generate
from evaluation.breakdown import group_table, timing_spread
from evaluation.metrics import TAU_CONVENTION, summarize_method
from evaluation.prompts import load_prompts
from evaluation.summary import summary_markdown
from evaluation.turns import follow_up_prompt, length_bound, turns_to_run

log = logging.getLogger(__name__)
REFERENCE_DRAFTERS = ("oracle", "random")


class ParityError(RuntimeError):
    """The method's output differed from vanilla greedy decoding on at least one prompt."""


def resolve_device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_decoder(cfg: DictConfig, base_model, eos_ids: list[int], device: torch.device, identity=None):
    """The method's decoder for this run, and a description dict.

    ``identity`` (the loaded base's :class:`core.base_model.BaseIdentity` or its dict) is compared
    with the base the head checkpoint recorded (:func:`core.base_model.check_same_base`).

    Raises:
        ValueError: ``eval.checkpoint`` is missing, or the checkpoint's head type differs from
            ``heads.type``.
        core.config.UserInputError: the checkpoint was trained on another base (unless
            ``eval.allow_other_base=true`` and only the weights / architecture differ).
        TypeError: ``make_drafter`` returned neither a Decoder nor a Drafter.
    """
    ev = cfg.eval
    ckpt = ev.get("checkpoint")
    if ckpt is None:
        raise ValueError("eval.checkpoint is required: `python -m evaluation heads=<h> checkpoint=PATH` "
                         f"(or checkpoint={'|'.join(REFERENCE_DRAFTERS)} for a reference drafter)")
    info: dict[str, Any] = {"checkpoint": str(ckpt)}
    if str(ckpt) in REFERENCE_DRAFTERS:
        depth, width = int(ev.reference_depth), int(ev.reference_width)
        if ckpt == "oracle":
            obj = OracleDrafter(base_model, depth=depth, width=width, seed=int(cfg.get("seed", 0)))
        else:
            obj = RandomDrafter(int(base_model.config.vocab_size), depth=depth, width=width, seed=int(cfg.get("seed", 0)))
        info.update(head_type=f"reference:{ckpt}", reference_depth=depth, reference_width=width)
    else:
        import heads

        path = Path(str(ckpt))
        if not path.is_dir():
            raise ValueError(f"eval.checkpoint={str(ckpt)!r}: not a directory")
        if identity is not None:  # before loading: a head of another base may not even fit
            from core.base_model import check_same_base

            recorded = json.loads((path / "config.json").read_text()).get("base") if (path / "config.json").is_file() else None
            differs = check_same_base(recorded, identity.to_dict() if hasattr(identity, "to_dict") else dict(identity),
                                      f"head checkpoint {path}", "eval.allow_other_base",
                                      bool(ev.get("allow_other_base", False)))
            if differs:
                log.warning("eval.allow_other_base=true: %s was trained on another base (%s)", path, "; ".join(differs))
                info["other_base"] = differs
        head, meta = heads.load(path, base_model=base_model)
        want = cfg.heads.get("type") if "heads" in cfg else None
        if want is not None and meta["head_type"] != want:
            raise ValueError(f"checkpoint {path} holds a {meta['head_type']!r} head but heads.type={want!r}; "
                             f"run with heads={meta['head_type']}")
        head.to(device).eval()
        head.requires_grad_(False)
        kwargs = {k: v for k, v in to_container(ev).items()}
        kwargs["seed"] = int(cfg.get("seed") or 0)  # sampling decoders (temperature > 0)
        obj = head.make_drafter(base_model, eos_token_ids=list(eos_ids), **kwargs)
        info.update(head_type=meta["head_type"], head_config=meta.get("head"), checkpoint_extra=meta.get("extra", {}),
                    head_parameters=int(sum(p.numel() for p in head.parameters())))
    if isinstance(obj, Decoder):
        info["decoder"] = type(obj).__name__
        return obj, info
    if isinstance(obj, Drafter):
        info["decoder"] = f"SpeculativeDecoder({type(obj).__name__})"
        return SpeculativeDecoder(base_model, obj, eos_ids), info
    raise TypeError(f"make_drafter returned {type(obj).__name__}: neither a Decoder (generate) nor a Drafter "
                    "(start/draft/accept); see docs/design.md 'Decoding runtime API'")


def checkpoint_label(ckpt) -> str:
    """A short name for a checkpoint: ``<run>-best`` for ``.../<run>/best``, else the last path part."""
    if ckpt is None:
        return "none"
    path = Path(str(ckpt))
    return f"{path.parent.name}-{path.name}" if path.name in ("best", "last") and path.parent.name else path.name


def default_output_dir(cfg: DictConfig, info: dict[str, Any]) -> Path:
    """``<output_root>/eval/<head type>-<checkpoint label or 'variants'>-<UTC time>``."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    head = str(info["head_type"]).split(":")[0]
    what = "variants" if cfg.eval.get("variants") else checkpoint_label(cfg.eval.checkpoint)
    return Path(str(cfg.get("output_root", "runs"))) / "eval" / f"{head}-{what}-{stamp}"


def plot(report: dict[str, Any]) -> bytes:
    """PNG bytes of :func:`make_figure` (``acceptance.png``)."""
    import matplotlib.pyplot as plt

    fig = make_figure(report)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def make_figure(report: dict[str, Any]):
    """A matplotlib figure of one report: the method's own figures (left), per-prompt speedup (right).

    Left: for tree decoders, acceptance per draft depth (bars: accepted / proposed) and the
    conditional acceptance (line: accepted at depth d / steps that accepted every depth < d and
    whose tree reached d, the n-α of METHODS §5.1); for a decoder that reports per-layer early exits
    (AdaDecode's ``decoder_summary``: ``exits_l<ℓ>`` / ``accepted_l<ℓ>``), exits and accepted exits
    per layer as a share of emitted tokens, titled with its exit rate, rejection rate and layer
    steps per token.  Right: histogram of per-prompt speedups (bars edged, y = prompt count) with
    the labelled break-even line at 1.0.  The figure's title names the variant (``eval.variants``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = report["method"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    acc = m.get("acceptance_per_depth")
    summary = m.get("decoder_summary") or {}
    layers = sorted(int(k[len("exits_l"):]) for k in summary if k.startswith("exits_l") and k[7:].isdigit())
    if acc:
        depths = list(range(1, len(acc) + 1))
        ax1.bar(depths, [a or 0.0 for a in acc], color="tab:blue", edgecolor="black", linewidth=0.6,
                label="accepted / proposed at depth d")
        cond = m.get("conditional_acceptance_per_depth") or []
        ax1.plot(depths, [c if c is not None else float("nan") for c in cond], "o-", color="tab:orange",
                 label="conditional: given depths < d accepted")
        ax1.set_ylim(0, 1.25)
        ax1.set_xticks(depths)
        ax1.legend(loc="upper right", fontsize=8)
        tau = m.get("tau")
        ax1.set_title(f"acceptance per draft depth  (τ={tau:.2f}, bonus incl.)" if tau else "acceptance per draft depth")
        ax1.set_xlabel("draft depth d")
        ax1.set_ylabel("acceptance rate")
    elif layers and summary.get("new_tokens"):
        n = float(summary["new_tokens"])
        x = list(range(len(layers)))
        ax1.bar([i - 0.2 for i in x], [summary[f"exits_l{l}"] / n for l in layers], width=0.4, color="tab:blue",
                edgecolor="black", linewidth=0.6, label="early exits proposed")
        ax1.bar([i + 0.2 for i in x], [summary.get(f"accepted_l{l}", 0) / n for l in layers], width=0.4,
                color="tab:green", edgecolor="black", linewidth=0.6, label="accepted by verification")
        ax1.set_xticks(x, [f"hs[{l}]" for l in layers])
        ax1.set_xlabel("exit layer")
        ax1.set_ylabel("share of emitted tokens")
        ax1.legend(loc="upper right", fontsize=8)
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        ax1.set_title(f"early exits: rate {fmt(summary.get('early_exit_rate'))}, rejected "
                      f"{fmt(summary.get('rejection_rate'))}\nlayer steps/token {fmt(summary.get('layer_steps_per_token'))}"
                      f" (vanilla {summary.get('vanilla_layer_steps_per_token')})", fontsize=10)
    else:
        ax1.text(0.5, 0.5, "no per-depth acceptance\n(non-tree decoder)", ha="center", va="center")
        ax1.set_title("acceptance per draft depth")
    sp = [p["speedup"] for p in report["per_prompt"] if p.get("speedup")]
    ax2.hist(sp, bins=min(20, max(1, len(sp))), color="tab:green", edgecolor="black", linewidth=0.6)
    ax2.axvline(1.0, color="k", lw=0.9, ls="--", label="1.0 = vanilla speed")
    ax2.legend(loc="upper right", fontsize=8)
    ax2.set_title(f"per-prompt speedup (overall {report['speedup']:.2f}x)" if report.get("speedup") else "per-prompt speedup")
    ax2.set_xlabel("method tokens/s ÷ vanilla tokens/s")
    ax2.set_ylabel("prompts")
    variant = f" [{report['variant']}]" if report.get("variant") else ""
    fig.suptitle(f"{report['head_type']}{variant} — {report['num_prompts']} prompts, parity {parity_text(report)}")
    fig.tight_layout()
    return fig


_NAME_OK = re.compile(r"[^A-Za-z0-9._=,+-]+")
# eval keys that define the shared reference run (prompts, lengths, dtype, device, sampling), not a method
SHARED_EVAL_KEYS = frozenset({"variants", "prompts", "prompt_field", "num_prompts", "prompt_offset", "max_new_tokens",
                              "max_prompt_tokens", "dtype", "device", "threads", "plan_threads", "warmup",
                              "output_dir", "fail_on_mismatch", "temperature", "allow_other_base", "turns", "repeats",
                              "prompts_per_category"})


def variant_configs(cfg: DictConfig) -> list[tuple[str | None, DictConfig]]:
    """Expand ``eval.variants`` into one config per method variant.

    ``eval.variants`` is null (one method: the run's own ``eval`` section) or a list of mappings of
    ``eval.*`` overrides, e.g. ``[{checkpoint: runs/falcon/k2/best}, {checkpoint: runs/falcon/k1/best}]``
    or ``[{gamma: 0.7}, {gamma: 0.85}]``; an optional ``name`` key names the variant's report
    subdirectory (default: the overrides, e.g. ``gamma=0.7`` or ``k2-best`` for a checkpoint).
    All variants share one vanilla decoding of every prompt, so their speedups are measured against
    the same reference in the same run.

    Returns:
        ``[(name, cfg)]``: ``name`` is None when ``eval.variants`` is unset.

    Raises:
        ValueError: a variant is not a mapping, overrides an unknown ``eval`` key or one shared by
            the whole run (:data:`SHARED_EVAL_KEYS`: prompts, lengths, dtype, device, temperature...;
            the key and the variant index are named), two variants share a name, or a variant's
            merged ``eval`` section fails the checks a whole run's does (a value's type or range,
            :func:`evaluation.config_checks.check_decoding_overrides`); the message names
            ``eval.variants[i]``.
    """
    from omegaconf import OmegaConf, open_dict

    raw = cfg.eval.get("variants")
    if not raw:
        return [(None, cfg)]
    out: list[tuple[str | None, DictConfig]] = []
    for i, v in enumerate(to_container(raw) if not isinstance(raw, list) else raw):
        if not isinstance(v, dict) or not v:
            raise ValueError(f"eval.variants[{i}]={v!r}: expected a non-empty mapping of eval.* overrides")
        v = dict(v)
        name = v.pop("name", None)
        bad = sorted(k for k in v if k not in cfg.eval or k == "variants")
        if bad:
            raise ValueError(f"eval.variants[{i}]: unknown eval key(s) {', '.join(bad)}; valid: "
                             f"{', '.join(sorted(k for k in cfg.eval if k not in SHARED_EVAL_KEYS))}")
        shared = sorted(k for k in v if k in SHARED_EVAL_KEYS)
        if shared:
            raise ValueError(f"eval.variants[{i}]: {', '.join(shared)} cannot differ between variants (one vanilla "
                             f"pass serves them all); set eval.{shared[0]} for the whole run")
        if name is None:
            parts = []
            for k, val in v.items():
                if k == "checkpoint" and val not in REFERENCE_DRAFTERS:
                    parts.append(checkpoint_label(val))
                else:
                    parts.append(f"{k}={val}")
            name = ",".join(parts)
        name = _NAME_OK.sub("_", str(name)).strip("._") or f"variant{i}"
        if any(name == n for n, _ in out):
            raise ValueError(f"eval.variants[{i}]: duplicate variant name {name!r}; give each a distinct `name`")
        from core.config import ConfigError, check_override_type

        for k, val in v.items():
            try:
                check_override_type(f"eval.variants[{i}].{k}", cfg.eval.get(k), val)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        c = cfg.copy()
        with open_dict(c):
            c.eval.variants = None
            for k, val in v.items():
                OmegaConf.update(c, f"eval.{k}", val, merge=False)
        from core.config import validate
        from evaluation.config_checks import check_decoding_overrides

        try:  # the variant's eval section passes the same checks as a whole run's (ranges, per-head overrides)
            heads_cfg = to_container(c.heads) if "heads" in c else {}
            check_decoding_overrides({k: val for k, val in to_container(c.eval).items() if k in v},
                                     heads_cfg.get("type"), heads_cfg, where=f"eval.variants[{i}]")
            validate(c)
        except ConfigError as exc:
            msg = str(exc)
            raise ValueError(msg if msg.startswith(f"eval.variants[{i}]") else f"eval.variants[{i}]: {msg}") from None
        out.append((name, c))
    return out


def parity_text(report: dict[str, Any]) -> str:
    """``"matched/total"``, or why parity was not checked (sampling)."""
    par = report["parity"]
    if par.get("checked", True):
        return f"{par['matched']}/{par['total']}"
    return f"not checked ({par['reason']})"


def _report(info, identity, device, model, ev, prompts, skipped, max_new, eos_ids, vanilla, stats, seconds,
            tokens, rows, decoder, out_dir) -> dict[str, Any]:
    method = summarize_method(stats, tokens, seconds)
    if hasattr(decoder, "summarize"):
        method["decoder_summary"] = decoder.summarize(stats)
    mismatches = [r["id"] for r in rows if r["match"] is False]
    temperature = float(ev.get("temperature") or 0.0)
    per_turn = group_table(rows, stats, "turn")
    parity = {"matched": len(prompts) - len(mismatches), "total": len(prompts), "mismatched_ids": mismatches,
              "checked": temperature == 0}
    if temperature > 0:
        parity.update(matched=None, reason=f"temperature {temperature:g}: outputs are samples; lossless in "
                                           "distribution (tests/test_adadecode_sampling.py)")
    timing = timing_spread(rows)
    # greedy decoding is deterministic: every repeat must decode round 1's tokens (samples may differ)
    unstable = [r["id"] for r in rows if r.get("repeat_mismatch")] if temperature == 0 else []
    timing["identical_tokens"] = not unstable if temperature == 0 else None
    timing["nonidentical_ids"] = unstable
    return {
        "head_type": info["head_type"], "decoder": info["decoder"], "checkpoint": info["checkpoint"], "info": info,
        "base": identity.to_dict() if hasattr(identity, "to_dict") else str(identity),
        "device": str(device), "dtype": str(model.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
        "prompts_source": str(ev.prompts) if ev.get("prompts") else "sharegpt-heldout",
        "num_prompts": len(prompts), "skipped_prompts": skipped, "max_new_tokens": max_new,
        "eos_token_ids": eos_ids,
        "tau": method.get("tau"), "tau_convention": TAU_CONVENTION,
        "acceptance_per_depth": method.get("acceptance_per_depth"),
        "base_forwards_per_token": {"vanilla": vanilla["base_forwards_per_token"],
                                    "method": method.get("base_forwards_per_token")},
        "drafter_passes_per_step": method.get("drafter_passes_per_step"),
        "speedup": (method["tokens_per_s"] / vanilla["tokens_per_s"]) if method.get("tokens_per_s") and vanilla["tokens_per_s"] else None,
        "tree": tree_report(info.get("tree_choice"), method, vanilla),
        "parity": parity, "parity_per_turn": {t: g["parity"] for t, g in per_turn.items()},
        "turns": str(ev.get("turns", 1)), "per_turn": per_turn, "per_category": group_table(rows, stats, "category"),
        "timing": timing,
        "temperature": temperature,
        # the eval settings this method ran with (a variant's overrides merged in); ``info.head_config``
        # is the checkpoint's own config, whose decoding defaults eval keys such as falcon_tree override
        "eval": {k: v for k, v in to_container(ev).items() if k != "variants"},
        "vanilla": vanilla, "method": method, "per_prompt": rows,
        "output_dir": str(out_dir),
    }


def tree_report(choice: dict[str, Any] | None, method: dict[str, Any], vanilla: dict[str, Any]) -> dict[str, Any] | None:
    """``eval.tree``'s choice (:mod:`evaluation.tree_auto`) with the measured τ and speedup beside the predicted."""
    if choice is None:
        return None
    out = dict(choice)
    summary = method.get("decoder_summary") or {}
    if "adadecode_model" in choice:
        out["measured_layer_steps_per_token"] = summary.get("layer_steps_per_token")
        out["measured_layer_step_speedup"] = summary.get("layer_step_speedup")
    if choice.get("applied"):
        speed = (method["tokens_per_s"] / vanilla["tokens_per_s"]) if method.get("tokens_per_s") and vanilla["tokens_per_s"] else None
        out.update(measured_tau=method.get("tau"), measured_speedup=speed)
    return out


def _timed(fn, ids, max_new, device):
    _sync(device)
    t0 = time.perf_counter()
    out, stats = fn(ids, max_new)
    _sync(device)
    return [int(t) for t in out], stats, time.perf_counter() - t0


def _decode_prompt(p, reference, decoders, max_new: int, device, repeats: int = 1) -> dict[str, Any]:
    """Vanilla, then every decoder, on one prompt (timed separately): a JSON-safe record.

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
    for slot in [rec["vanilla"], *rec["methods"]]:
        slot["seconds"] = sum(slot["seconds_repeats"]) / len(slot["seconds_repeats"])
    return rec


def prompt_digest(input_ids: torch.Tensor) -> str:
    """SHA-256 of a templated prompt's token ids (ties a stored result to the exact prompt)."""
    from core.io import sha256_json

    return sha256_json([int(t) for t in input_ids.reshape(-1).tolist()])


# eval keys added after evaluations were first written, each at the value that keeps the behaviour from before
# it: at that value a key is left out of the progress fingerprint, so those evaluations still resume
NEUTRAL_EVAL_KEYS: dict[str, Any] = {"tree_fallback": False}
# eval keys that do not change any prompt's result; shards may differ in these
UNFINGERPRINTED_EVAL_KEYS = ("output_dir", "threads", "warmup", "fail_on_mismatch", "num_prompts", "prompt_offset",
                             "allow_other_base")


def checkpoint_digest(ckpt) -> str | None:
    """SHA-256 of a head checkpoint's ``model.safetensors`` (its identity), or None when ``ckpt`` is
    not a checkpoint directory (``oracle`` / ``random``, a missing path)."""
    from core.io import sha256_file

    if ckpt is None:
        return None
    path = Path(str(ckpt)) / "model.safetensors"
    return sha256_file(path) if path.is_file() else None


def progress_fingerprint(cfg: DictConfig) -> tuple[str, dict[str, dict[str, str]]]:
    """What determines an evaluation's per-prompt results (not where they go or how a path is spelt).

    Returns:
        ``(fingerprint, weights)``: ``fingerprint`` hashes the model, heads, prompt and eval settings
        and the seed, with every checkpoint path replaced by a reference to its slot in ``weights``
        (so ``checkpoint=/abs/run/best`` and ``checkpoint=run/best`` are the same evaluation);
        ``weights`` maps each checkpoint slot (``checkpoint``, ``variants[i]``) to
        ``{"sha256": digest of model.safetensors, "path": as given}``: the digest is the
        checkpoint's identity, the path is recorded only, never compared.
    """
    from core.io import sha256_json

    ev = dict(to_container(cfg.eval))
    # num_prompts / prompt_offset are left out: records are per prompt (checked by token hash), so a
    # larger num_prompts extends a finished evaluation, and shards (prompt_offset) can be combined
    for k in UNFINGERPRINTED_EVAL_KEYS:
        ev.pop(k, None)
    if "turns" in ev:  # eval.turns=2 and eval.turns="2" are one setting
        ev["turns"] = str(ev["turns"])
    weights: dict[str, dict[str, str]] = {}  # a retrained checkpoint at the same path must not reuse old results
    slots = [("checkpoint", ev)] + [(f"variants[{i}]", v) for i, v in enumerate(ev.get("variants") or [])
                                    if isinstance(v, dict)]
    for _, holder in slots:
        for k, neutral in NEUTRAL_EVAL_KEYS.items():
            if k in holder and type(holder[k]) is type(neutral) and holder[k] == neutral:
                holder.pop(k)
    for slot, holder in slots:
        digest = checkpoint_digest(holder.get("checkpoint"))
        if digest is not None:
            weights[slot] = {"sha256": digest, "path": str(holder["checkpoint"])}
            holder["checkpoint"] = f"<weights[{slot}]>"  # identity = the digest in ``weights``, not the path
    return sha256_json({"model": to_container(cfg.model) if "model" in cfg else None,
                        "heads": to_container(cfg.heads) if "heads" in cfg else None,
                        "data": to_container(cfg.data) if "data" in cfg and not ev.get("prompts") else None,
                        "eval": ev, "seed": cfg.get("seed")}), weights


def weight_digests(weights: dict[str, Any] | None) -> dict[str, str]:
    """``{slot: sha256}`` of a progress header's ``weights`` (:func:`progress_fingerprint`)."""
    return {k: (v.get("sha256") if isinstance(v, dict) else str(v)) for k, v in (weights or {}).items()}


RECORD_KEYS = ("id", "prompt_sha256", "vanilla", "methods")


def read_progress(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]], bool]:
    """Read a ``progress.jsonl`` (see :class:`Progress`): ``(header, {prompt id: record}, torn)``.

    A torn last line (a crash mid-write) is dropped and reported as ``torn=True``; that prompt is
    simply decoded again.

    Raises:
        ValueError: the file is not UTF-8, its header is not ``{"fingerprint": str, "weights":
            {...}}``, or a record is not a JSON object with ``id``, ``prompt_sha256``, ``vanilla``
            and ``methods`` (a corrupt line before the last one included); the message names the
            file and line.
    """
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start}); move it away to start over") from exc
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: unreadable header ({exc}); move it away to start over") from exc
    if not (isinstance(head, dict) and isinstance(head.get("fingerprint"), str)
            and isinstance(head.get("weights", {}), dict)):
        raise ValueError(f"{path}:1: not a progress header (expected {{\"fingerprint\": ..., \"weights\": ...}})")
    records: dict[str, dict[str, Any]] = {}
    torn = False
    for k, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if k == len(lines) or all(not x.strip() for x in lines[k:]):
                torn = True  # torn final line
                break
            raise ValueError(f"{path}:{k}: corrupt record; move the file away to start over")
        missing = [key for key in RECORD_KEYS if not isinstance(rec, dict) or key not in rec]
        if missing:
            raise ValueError(f"{path}:{k}: not a prompt record (missing {', '.join(missing)}); "
                             "move the file away to start over")
        records[str(rec["id"])] = rec
    return head, records, torn


def write_progress(path: Path, header: dict[str, Any], records) -> None:
    """Atomically (re)write a ``progress.jsonl``: the header line, then one line per record."""
    lines = [json.dumps(header)] + [json.dumps(r) for r in records]
    atomic_write_text(path, "\n".join(lines) + "\n")


class Progress:
    """Per-prompt results appended to ``progress.jsonl`` as they finish, so an interrupted
    evaluation resumes (``resume=auto``) without decoding finished prompts again.

    Line 1 is ``{"fingerprint": ..., "weights": ...}`` (:func:`progress_fingerprint`: checkpoints
    are identified by content, their paths only recorded); every further line is one
    prompt's record (vanilla and method tokens, stats, seconds).  Each line is flushed and fsynced;
    a torn last line (a crash mid-write) is ignored.

    Raises:
        ValueError: the file holds results but ``resume`` is not ``auto`` (nothing is overwritten),
            ``resume`` has another value, or the file was written under a different configuration or
            different checkpoint weights.
    """

    def __init__(self, path: Path, fingerprint: tuple[str, dict[str, str]], resume) -> None:
        fingerprint, weights = fingerprint
        self.path, self.records = path, {}
        if resume not in (None, "auto"):
            raise ValueError(f"resume={resume!r}: evaluation takes resume=auto (continue {path.name} in "
                             "eval.output_dir) or nothing")
        if path.is_file() and path.stat().st_size:
            head, self.records, _ = read_progress(path)
            if resume != "auto":
                raise ValueError(f"{path} already holds results of {len(self.records)} prompt(s): "
                                 "pass resume=auto to continue them, or choose another eval.output_dir")
            now, then = weight_digests(weights), weight_digests(head.get("weights"))
            changed = sorted(c for c in set(now) | set(then) if now.get(c) != then.get(c))
            if changed:
                names = [str((weights.get(c) or (head.get("weights") or {}).get(c) or {}).get("path", c))
                         if isinstance(weights.get(c) or (head.get("weights") or {}).get(c), dict) else c for c in changed]
                raise ValueError(f"{path}: the weights of checkpoint {', '.join(names)} changed since these results "
                                 "were written (checkpoints are identified by their model.safetensors SHA-256); "
                                 "evaluate them into another eval.output_dir")
            if head.get("fingerprint") != fingerprint:
                raise ValueError(f"{path} was written under a different model/heads/eval configuration; "
                                 "resume with the same settings, or choose another eval.output_dir")
            write_progress(path, head, self.records.values())  # drop a torn tail before appending
        else:
            write_progress(path, {"fingerprint": fingerprint, "weights": weights}, [])

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records[str(record["id"])] = record


@torch.no_grad()
def absolute_paths(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` whose local file paths are absolute: ``eval.checkpoint`` and every
    ``eval.variants[i].checkpoint`` (not ``oracle`` / ``random``), ``eval.prompts``, ``model.path`` and
    ``data.path``, each when it names an existing file or directory (a hub id stays as given).

    A relative path means something only in the directory the command ran in: the saved
    ``config.yaml`` is re-run by ``python -m evaluation.merge`` from anywhere, and the progress
    fingerprint must not depend on how a path was spelt (``../shared/q.jsonl`` and
    ``/work/shared/q.jsonl`` are one prompt file).  Symlinks are kept (``os.path.abspath``).
    """
    from omegaconf import OmegaConf, open_dict

    def fix(value):
        if isinstance(value, str) and value not in REFERENCE_DRAFTERS and not os.path.isabs(value) \
                and os.path.exists(value):
            return os.path.abspath(value)
        return value

    out = cfg.copy()
    with open_dict(out):
        for key in ("eval.checkpoint", "eval.prompts", "model.path", "data.path"):
            value = OmegaConf.select(out, key, default=None)
            if value is not None:
                OmegaConf.update(out, key, fix(value), merge=False)
        for v in out.eval.get("variants") or []:
            if isinstance(v, DictConfig) and v.get("checkpoint") is not None:
                v.checkpoint = fix(v.checkpoint)
    return out


def run_evaluation(cfg: DictConfig, base=None, decoder=None) -> dict[str, Any]:
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
    variants = variant_configs(cfg)
    if decoder is not None and variants[0][0] is not None:
        raise ValueError("run_evaluation(decoder=...) takes no eval.variants")
    if base is None:
        from core.base_model import load_base_model

        model_cfg = to_container(cfg.model)
        model_cfg["dtype"] = ev.dtype
        base = load_base_model(model_cfg)
    model, tokenizer, identity = base
    model.to(device)
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

    prompts, skipped = load_prompts(ev, cfg.data if "data" in cfg else {}, tokenizer)
    turns = ev.get("turns", 1)
    for p in prompts:  # before anything is written: prompt + eval.max_new_tokens must fit the context
        check_context_limit(model, int(p.input_ids.numel()), int(ev.max_new_tokens), what=f"eval prompt {p.id!r}: ",
                            budget_key="eval.max_new_tokens")
        for t in range(2, turns_to_run(turns, p) + 1):  # later turns: bound with max_new_tokens answers
            n = length_bound(tokenizer, p, t, int(ev.max_new_tokens))
            check_context_limit(model, n - int(ev.max_new_tokens), int(ev.max_new_tokens),
                                what=f"eval prompt {p.id!r} turn {t} (earlier answers at their longest): ",
                                budget_key="eval.max_new_tokens")
    # eval.tree=auto|dynamic: cost model + held-out calibration -> each tree head's tree (before anything is written)
    from evaluation.tree_auto import plan_tree

    methods = [(name, vcfg, *plan_tree(vcfg, dec, info, model, identity, tokenizer, prompts, eos_ids))
               for name, vcfg, dec, info in methods]
    out_dir = Path(str(ev.output_dir)) if ev.get("output_dir") else default_output_dir(cfg, methods[0][3])
    out_dir.mkdir(parents=True, exist_ok=True)
    # refuses (before anything is written) when out_dir holds results and resume is not auto
    progress = Progress(out_dir / "progress.jsonl", progress_fingerprint(cfg), cfg.get("resume"))
    save_config(cfg, out_dir)
    max_new = int(ev.max_new_tokens)
    log.info("evaluating %s on %d prompts (max_new_tokens=%d) on %s -> %s",
             ", ".join(str(m[3]["decoder"]) + (f" [{m[0]}]" if m[0] else "") for m in methods), len(prompts),
             max_new, device, out_dir)

    for _ in range(int(ev.get("warmup") or 0)):  # untimed: allocator, kernels, lazy imports
        reference(prompts[0].input_ids, min(8, max_new))
        for m in methods:
            m[2].generate(prompts[0].input_ids, min(8, max_new))

    if progress.records:
        log.info("resuming: %d prompt turn(s) already decoded in %s", len(progress.records), progress.path)
    van_tokens = van_seconds = van_forwards = 0
    acc = [{"stats": [], "rows": [], "tokens": 0, "seconds": 0.0} for _ in methods]
    repeats = int(ev.get("repeats") or 1)
    last_ref: list[int] = []

    def units():  # every prompt's turns in order; turn k > 1 is built from turn k-1's vanilla answer
        for q in prompts:
            unit = q
            for t in range(1, turns_to_run(turns, q) + 1):
                if t > 1:
                    unit = follow_up_prompt(tokenizer, unit, last_ref, eos_ids)
                yield unit

    done = []
    for i, p in enumerate(units()):
        done.append(p)
        rec = progress.records.get(p.id)
        if rec is not None and rec.get("prompt_sha256") != prompt_digest(p.input_ids):
            raise ValueError(f"{progress.path}: prompt {p.id!r} is not the prompt these results were decoded for "
                             "(the prompt file changed); evaluate into another eval.output_dir")
        if rec is None:
            rec = _decode_prompt(p, reference, [m[2] for m in methods], max_new, device, repeats)
            progress.append(rec)
        ref, vstats, v_sec = rec["vanilla"]["tokens"], rec["vanilla"]["stats"], rec["vanilla"]["seconds"]
        last_ref[:] = ref
        van_tokens += len(ref)
        van_seconds += v_sec
        van_forwards += vstats["base_forwards"] + vstats["prefill_forwards"]
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
            a["rows"].append(row)
            log.info("[%d] %s%s: %d tokens, tau=%s, %s", i + 1, p.id, f" [{name}]" if name else "",
                     len(out), f"{row['tau']:.2f}" if row["tau"] else "-",
                     "sampled" if match is None else "match" if match else f"MISMATCH at {first_diff}")

    vanilla = {"tokens": van_tokens, "seconds": van_seconds, "tokens_per_s": van_tokens / van_seconds if van_seconds else None,
               "base_forwards_per_token": van_forwards / van_tokens if van_tokens else None}
    reports = {}
    for (name, vcfg, dec, info), a in zip(methods, acc):
        vdir = out_dir / name if name else out_dir
        vdir.mkdir(parents=True, exist_ok=True)
        rep = _report(info, identity, device, model, vcfg.eval, done, skipped, max_new, eos_ids, vanilla,
                      a["stats"], a["seconds"], a["tokens"], a["rows"], dec, vdir)
        if name:
            rep["variant"] = name
            save_config(vcfg, vdir)
        atomic_write_json(vdir / "report.json", rep)
        atomic_write_bytes(vdir / "acceptance.png", plot(rep))
        reports[name] = rep
    failed = {n: r["parity"]["mismatched_ids"] for n, r in reports.items() if r["parity"]["mismatched_ids"]}
    unstable = {n: r["timing"]["nonidentical_ids"] for n, r in reports.items() if r["timing"]["nonidentical_ids"]}
    rows = [summary_row(n, r) for n, r in reports.items()]
    if methods[0][0] is None:
        result = reports[None]
    else:
        result = {"variants": reports, "output_dir": str(out_dir)}
    atomic_write_json(out_dir / "summary.json", {"vanilla": vanilla, "variants": rows})
    atomic_write_text(out_dir / "summary.md", summary_markdown(rows))
    if (failed or unstable) and ev.get("fail_on_mismatch", True):
        where = "; ".join(f"{n + ': ' if n else ''}ids {', '.join(ids)}" for n, ids in failed.items())
        where += "".join(f"; {n + ': ' if n else ''}repeats decoded other tokens on ids {', '.join(ids)}"
                         for n, ids in unstable.items())
        raise ParityError(f"output differs from vanilla greedy decoding on {sum(map(len, failed.values()))} "
                          f"prompt run(s) of {len(done)} prompts: {where.lstrip('; ')} "
                          f"(details in report.json under {out_dir})")
    return result


def tree_line(tree: dict[str, Any] | None) -> str:
    """The chosen tree with predicted vs measured τ and speedup, one console line."""
    from evaluation.tree_auto import describe

    line = describe(tree)
    if tree and "adadecode_model" in tree:
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        line += (f"; measured {fmt(tree.get('measured_layer_steps_per_token'))} steps/token, "
                 f"{fmt(tree.get('measured_layer_step_speedup'))}x")
    if tree and tree.get("applied"):
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        line += f"; measured tau {fmt(tree.get('measured_tau'))}, speedup {fmt(tree.get('measured_speedup'))}x"
    return line


def summary_row(name: str | None, report: dict[str, Any]) -> dict[str, Any]:
    """One line of a results table from a report: τ, acceptance, passes, speedup (and its mean ±
    std over ``eval.repeats``), parity (overall and per turn), per-category τ and speedup, and the
    decoding tree the report names (``tree`` in the report or its ``info``; None if none)."""
    m = report["method"]
    info = report.get("info") or {}
    return {"variant": name, "head_type": report.get("head_type"), "checkpoint": report["checkpoint"],
            "tau": report.get("tau"), "prompts": report.get("num_prompts"), "turns": report.get("turns"),
            "speedup_repeats": (report.get("timing") or {}).get("speedup"),
            "identical_repeat_tokens": (report.get("timing") or {}).get("identical_tokens"),
            "tree": report.get("tree") or info.get("tree"),
            "parity_per_turn": {t: f"{p['matched']}/{p['total']}" if p.get("checked") else "not checked"
                                for t, p in (report.get("parity_per_turn") or {}).items()},
            "per_category": {c: {"tau": g["tau"], "speedup": g["speedup"], "prompts": g["prompts"]}
                             for c, g in (report.get("per_category") or {}).items()},
            "acceptance_per_depth": report.get("acceptance_per_depth"),
            "drafter_passes_per_step": report.get("drafter_passes_per_step"),
            "base_forwards_per_token": report["base_forwards_per_token"]["method"],
            "tokens_per_s": m.get("tokens_per_s"), "speedup": report.get("speedup"),
            "drafter_time_share": m.get("drafter_time_share"),
            "tree": tree_summary(report.get("tree")),
            "parity": parity_text(report),
            "decoder_summary": m.get("decoder_summary")}


def tree_summary(tree: dict[str, Any] | None) -> dict[str, Any] | None:
    """The table cells of a tree choice: mode, nodes, depth, predicted and measured τ / speedup."""
    if not tree or not tree.get("applied"):
        return None
    c = tree["chosen"]
    return {"mode": tree["mode"], "nodes": c["nodes"], "depth": c.get("depth"), "predicted_tau": tree["predicted_tau"],
            "measured_tau": tree.get("measured_tau"), "predicted_speedup": tree["predicted_speedup"],
            "measured_speedup": tree.get("measured_speedup")}


def format_summary(report: dict[str, Any]) -> str:
    """A few human-readable lines for the console."""
    m, v = report["method"], report["vanilla"]
    fmt = lambda x, f="{:.3f}": "-" if x is None else f.format(x)  # noqa: E731
    acc = report.get("acceptance_per_depth") or []
    lines = [
        f"decoder: {report['decoder']}{' [' + report['variant'] + ']' if report.get('variant') else ''}  "
        f"({report['num_prompts']} prompts, max_new_tokens={report['max_new_tokens']}, {report['device']}, {report['dtype']})",
        f"parity: {parity_text(report)}",
    ]
    ds = m.get("decoder_summary") or {}
    if report.get("tau") is not None or not ds:
        lines += [
            f"tau (bonus incl.): {fmt(report.get('tau'))}   drafter passes/step: {fmt(report.get('drafter_passes_per_step'), '{:.2f}')}",
            "acceptance per depth: " + (" ".join(fmt(a, "{:.2f}") for a in acc) if acc else "-")]
    if "early_exit_rate" in ds:  # early-exit decoders (AdaDecode): their own figures, from summed counts
        lines += [
            f"early exits: accepted {fmt(ds.get('early_exit_rate'))} of emitted tokens, attempted "
            f"{fmt(ds.get('exit_attempt_rate'))}, rejection rate {fmt(ds.get('rejection_rate'))}",
            f"layer steps/token: {fmt(ds.get('layer_steps_per_token'), '{:.2f}')} (vanilla "
            f"{ds.get('vanilla_layer_steps_per_token')}; layer-step speedup {fmt(ds.get('layer_step_speedup'), '{:.2f}')}x)"]
    lines += [
        f"base forwards/token: vanilla {fmt(v['base_forwards_per_token'])}, method {fmt(m.get('base_forwards_per_token'))}",
        f"tokens/s: vanilla {fmt(v['tokens_per_s'], '{:.1f}')}, method {fmt(m.get('tokens_per_s'), '{:.1f}')}  "
        f"speedup {fmt(report.get('speedup'), '{:.2f}')}x  (drafter time share {fmt(m.get('drafter_time_share'), '{:.2f}')})",
        tree_line(report.get("tree")),
        f"report: {report['output_dir']}/report.json",
    ]
    return "\n".join(lines)

