"""The lossless evaluation run: vanilla greedy vs the head's decoder on the same prompts.

For every prompt (interleaved, so load drift hits both alike) vanilla greedy decoding
(:func:`decoding.vanilla.greedy_generate`) and the method's decoder run on the same base model;
outputs must match token for token (issue 3, "Output parity").  The method's decoder is

* a :class:`decoding.speculative.Decoder` (has ``generate``) returned by
  ``head.make_drafter(base, eos_token_ids=..., **cfg.eval)`` (e.g. AdaDecode), used as is, or
* a :class:`decoding.speculative.Drafter`, wrapped in :class:`decoding.speculative.SpeculativeDecoder`,
* or, for ``eval.checkpoint=oracle|random``, a reference drafter (:mod:`decoding.reference`).

Outputs in the run directory: ``config.yaml`` (resolved), ``report.json``, ``acceptance.png``.
"""
from __future__ import annotations

import io
import logging
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from core.config import save_config, to_container
from core.io import atomic_write_bytes, atomic_write_json
from decoding.reference import OracleDrafter, RandomDrafter
from decoding.speculative import Decoder, Drafter, SpeculativeDecoder
from decoding.vanilla import eos_token_ids, greedy_generate
from evaluation.metrics import TAU_CONVENTION, summarize_method
from evaluation.prompts import load_prompts

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


def build_decoder(cfg: DictConfig, base_model, eos_ids: list[int], device: torch.device):
    """The method's decoder for this run, and a description dict.

    Raises:
        ValueError: ``eval.checkpoint`` is missing, or the checkpoint's head type differs from
            ``heads.type``.
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
        head, meta = heads.load(path, base_model=base_model)
        want = cfg.heads.get("type") if "heads" in cfg else None
        if want is not None and meta["head_type"] != want:
            raise ValueError(f"checkpoint {path} holds a {meta['head_type']!r} head but heads.type={want!r}; "
                             f"run with heads={meta['head_type']}")
        head.to(device).eval()
        head.requires_grad_(False)
        kwargs = {k: v for k, v in to_container(ev).items()}
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


def default_output_dir(cfg: DictConfig, info: dict[str, Any]) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    name = Path(str(cfg.eval.checkpoint)).name or "ckpt"
    return Path(str(cfg.get("output_root", "runs"))) / "eval" / f"{info['head_type'].replace(':', '-')}-{name}-{stamp}"


def plot(report: dict[str, Any]) -> bytes:
    """PNG bytes: acceptance per draft depth (and conditional), and per-prompt speedup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = report["method"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    acc = m.get("acceptance_per_depth")
    if acc:
        depths = list(range(1, len(acc) + 1))
        ax1.bar(depths, [a or 0.0 for a in acc], color="tab:blue", label="accepted / proposed")
        cond = m.get("conditional_acceptance_per_depth") or []
        ax1.plot(depths, [c if c is not None else float("nan") for c in cond], "o-", color="tab:orange",
                 label="conditional (n-α)")
        ax1.set_ylim(0, 1.25)
        ax1.set_xticks(depths)
        ax1.legend(loc="upper right", ncol=2, fontsize=8)
    else:
        ax1.text(0.5, 0.5, "no per-depth acceptance\n(non-tree decoder)", ha="center", va="center")
    tau = m.get("tau")
    ax1.set_title(f"acceptance per draft depth  (τ={tau:.2f}, bonus incl.)" if tau else "acceptance per draft depth")
    ax1.set_xlabel("draft depth")
    ax1.set_ylabel("acceptance rate")
    sp = [p["speedup"] for p in report["per_prompt"] if p.get("speedup")]
    ax2.hist(sp, bins=min(20, max(1, len(sp))), color="tab:green")
    ax2.axvline(1.0, color="k", lw=0.8)
    ax2.set_title(f"per-prompt speedup (overall {report['speedup']:.2f}x)" if report.get("speedup") else "per-prompt speedup")
    ax2.set_xlabel("method tokens/s ÷ vanilla tokens/s")
    fig.suptitle(f"{report['head_type']} — {report['num_prompts']} prompts, parity "
                 f"{report['parity']['matched']}/{report['parity']['total']}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


@torch.no_grad()
def run_evaluation(cfg: DictConfig, base=None, decoder=None) -> dict[str, Any]:
    """Run the evaluation described by ``cfg`` and write the outputs.

    Args:
        cfg: the composed config (``model``, ``data``, ``heads``, ``eval`` sections).
        base: optional preloaded ``(model, tokenizer, identity)``; else loaded from ``cfg.model``
            with ``dtype = eval.dtype``.
        decoder: optional Decoder to evaluate instead of the one built from ``eval.checkpoint``.

    Returns:
        The report dict (also written to ``<output_dir>/report.json``); ``report["output_dir"]``.

    Raises:
        ParityError: ``eval.fail_on_mismatch`` and some prompt's output differed (after the
            report was written); the message names the prompt ids.
    """
    ev = cfg.eval
    if ev.get("threads"):
        torch.set_num_threads(int(ev.threads))
    device = resolve_device(ev.get("device"))
    if base is None:
        from core.base_model import load_base_model

        model_cfg = to_container(cfg.model)
        model_cfg["dtype"] = ev.dtype
        base = load_base_model(model_cfg)
    model, tokenizer, identity = base
    model.to(device)
    eos_ids = eos_token_ids(tokenizer, model)
    if decoder is None:
        decoder, info = build_decoder(cfg, model, eos_ids, device)
    else:
        info = {"checkpoint": str(ev.get("checkpoint")), "head_type": "custom", "decoder": type(decoder).__name__}
    prompts, skipped = load_prompts(ev, cfg.data if "data" in cfg else {}, tokenizer)
    out_dir = Path(str(ev.output_dir)) if ev.get("output_dir") else default_output_dir(cfg, info)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out_dir)
    max_new = int(ev.max_new_tokens)
    log.info("evaluating %s on %d prompts (max_new_tokens=%d) on %s -> %s", info["decoder"], len(prompts), max_new,
             device, out_dir)

    for _ in range(int(ev.get("warmup") or 0)):  # untimed: allocator, kernels, lazy imports
        greedy_generate(model, prompts[0].input_ids, min(8, max_new), eos_ids)
        decoder.generate(prompts[0].input_ids, min(8, max_new))

    per_prompt, method_stats = [], []
    van_tokens = van_seconds = van_forwards = 0
    met_tokens = 0
    met_seconds = 0.0
    mismatches = []
    for i, p in enumerate(prompts):
        _sync(device)
        t0 = time.perf_counter()
        ref, vstats = greedy_generate(model, p.input_ids, max_new, eos_ids)
        _sync(device)
        t1 = time.perf_counter()
        out, mstats = decoder.generate(p.input_ids, max_new)
        _sync(device)
        t2 = time.perf_counter()
        out = [int(t) for t in out]
        match = out == ref
        first_diff = None
        if not match:
            first_diff = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
            mismatches.append(p.id)
        van_tokens += len(ref)
        van_seconds += t1 - t0
        van_forwards += vstats["base_forwards"] + vstats["prefill_forwards"]
        met_tokens += len(out)
        met_seconds += t2 - t1
        method_stats.append(mstats)
        emitted = mstats.get("emitted_per_step")
        row = {"id": p.id, "prompt_tokens": int(p.input_ids.numel()), "vanilla_tokens": len(ref),
               "method_tokens": len(out), "match": match, "first_mismatch": first_diff,
               "vanilla_seconds": t1 - t0, "method_seconds": t2 - t1,
               "speedup": ((t1 - t0) / len(ref)) / ((t2 - t1) / len(out)) if out and ref and t2 > t1 else None,
               "tau": (sum(emitted) / len(emitted)) if emitted else None,
               "stats": {k: v for k, v in mstats.items() if k != "emitted_per_step"}}
        if not match:
            row["vanilla_output"], row["method_output"] = ref, out
        per_prompt.append(row)
        log.info("[%d/%d] %s: %d tokens, tau=%s, %s", i + 1, len(prompts), p.id, len(out),
                 f"{row['tau']:.2f}" if row["tau"] else "-", "match" if match else f"MISMATCH at {first_diff}")

    method = summarize_method(method_stats, met_tokens, met_seconds)
    if hasattr(decoder, "summarize"):
        method["decoder_summary"] = decoder.summarize(method_stats)
    vanilla = {"tokens": van_tokens, "seconds": van_seconds, "tokens_per_s": van_tokens / van_seconds if van_seconds else None,
               "base_forwards_per_token": van_forwards / van_tokens if van_tokens else None}
    report = {
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
        "parity": {"matched": len(prompts) - len(mismatches), "total": len(prompts), "mismatched_ids": mismatches},
        "vanilla": vanilla, "method": method, "per_prompt": per_prompt,
        "output_dir": str(out_dir),
    }
    atomic_write_json(out_dir / "report.json", report)
    atomic_write_bytes(out_dir / "acceptance.png", plot(report))
    if mismatches and ev.get("fail_on_mismatch", True):
        raise ParityError(f"output differs from vanilla greedy decoding on {len(mismatches)}/{len(prompts)} prompts: "
                          f"ids {', '.join(mismatches)} (details in {out_dir / 'report.json'})")
    return report


def format_summary(report: dict[str, Any]) -> str:
    """A few human-readable lines for the console."""
    m, v = report["method"], report["vanilla"]
    fmt = lambda x, f="{:.3f}": "-" if x is None else f.format(x)  # noqa: E731
    acc = report.get("acceptance_per_depth") or []
    lines = [
        f"decoder: {report['decoder']}  ({report['num_prompts']} prompts, max_new_tokens={report['max_new_tokens']}, "
        f"{report['device']}, {report['dtype']})",
        f"parity: {report['parity']['matched']}/{report['parity']['total']}",
        f"tau (bonus incl.): {fmt(report.get('tau'))}   drafter passes/step: {fmt(report.get('drafter_passes_per_step'), '{:.2f}')}",
        "acceptance per depth: " + (" ".join(fmt(a, "{:.2f}") for a in acc) if acc else "-"),
        f"base forwards/token: vanilla {fmt(v['base_forwards_per_token'])}, method {fmt(m.get('base_forwards_per_token'))}",
        f"tokens/s: vanilla {fmt(v['tokens_per_s'], '{:.1f}')}, method {fmt(m.get('tokens_per_s'), '{:.1f}')}  "
        f"speedup {fmt(report.get('speedup'), '{:.2f}')}x  (drafter time share {fmt(m.get('drafter_time_share'), '{:.2f}')})",
        f"report: {report['output_dir']}/report.json",
    ]
    return "\n".join(lines)

