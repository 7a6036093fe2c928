"""A trained head's drafter with its layers packed for oneDNN, against the same drafter unpacked, in one run.

The evaluation packs the base's linear weights for oneDNN (:mod:`decoding.prepacked`) and, through
:func:`evaluation.methods.pack_like_base`, the head's own layers, among them its product over the frozen
LM-head rows (``frozen_draft_lm_head``, 16,384 x 576 for SmolLM2's heads of record).  This benchmark decodes
the same prompts with one base and one head, packed as the evaluation packs them, switching only the
head's packing (:func:`decoding.prepacked.restore_linear_weights` / ``pack_like_base``) between the two
modes, round after round, and reports per mode:

* ``ms_per_pass``: drafter seconds / drafter forwards (the speculative loop's ``drafter_seconds``: every
  ``draft`` and ``accept`` call);
* ``drafter_ms_per_step`` and ``drafter_time_share``;
* ``tokens_per_s``, τ, and against vanilla greedy decoding of the same base in the same run: ``speedup``;
* ``identical``: prompts whose output equals vanilla greedy decoding (in fp32 every one must: exit 1 else).

The drafts of the two modes can differ in near ties (a packed product rounds differently), so τ is
reported for both; the verdict is per drafter pass.  The head drafts with its configured tree
(``heads.decoding``: for Falcon up to ``passes`` forwards a step), or ``--tree-nodes`` of it.

    .venv/bin/python benchmarks/bench_drafter.py --checkpoint heads_of_record/falcon_k1_smollm2 --threads 2 \\
        --prompts ../shared/data/mt_bench_questions.jsonl --num-prompts 4 --max-new-tokens 64 --rounds 3
    .venv/bin/python benchmarks/bench_drafter.py ... --dtype bfloat16 --attn sdpa   # a CPU with native bf16
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import heads  # noqa: E402
from core.base_model import load_base_model  # noqa: E402
from core.rope import cast_module  # noqa: E402
from decoding.prepacked import restore_linear_weights  # noqa: E402
from decoding.speculative import SpeculativeDecoder  # noqa: E402
from decoding.vanilla import eos_token_ids, greedy_generate  # noqa: E402
from evaluation.methods import pack_like_base, prepacked_products, row_consistent_products  # noqa: E402
from evaluation.prompts import read_jsonl_prompts, template  # noqa: E402

MODES = ("unpacked", "packed")


def _set_mode(head, model, mode: str) -> list[str]:
    restore_linear_weights(head)
    return pack_like_base(head, model) if mode == "packed" else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(ROOT / "heads_of_record" / "falcon_k1_smollm2"))
    ap.add_argument("--model-path", default=None, help="model.path (default: packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", default="/work/shared/data/mt_bench_questions.jsonl")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both modes, alternating which goes first")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, ident = load_base_model({"path": args.model_path, "dtype": args.dtype, "attn_implementation": args.attn})
    ev = {"prepack_weights": "auto", "row_consistent": True}
    base_packed = prepacked_products(model, ev)  # as the evaluation does (evaluation.runner)
    row_consistent_products(model, ev)
    head, meta = heads.load(args.checkpoint, base_model=model)
    cast_module(head, model.dtype).eval()
    head.requires_grad_(False)
    eos = eos_token_ids(tok, model)
    dec = SpeculativeDecoder(model, head.make_drafter(model, eos_token_ids=eos), eos)
    prompts = [(pid, template(tok, msgs)) for pid, msgs in read_jsonl_prompts(args.prompts, limit=args.num_prompts)]

    refs, van_s, van_tok = {}, 0.0, 0
    for pid, ids in prompts:
        t0 = time.perf_counter()
        refs[pid], _ = greedy_generate(model, ids, args.max_new_tokens, eos)
        van_s += time.perf_counter() - t0
        van_tok += len(refs[pid])
    packed_names = []
    keys = ("seconds", "tokens", "drafter_seconds", "drafter_passes", "steps", "emitted")
    acc = {m: {k: 0 for k in keys} | {"identical": 0, "rounds_ms_per_pass": []} for m in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            names = _set_mode(head, model, mode)
            packed_names = names or packed_names
            dec.generate(prompts[0][1], 4)  # warm-up after a switch (the first packed product reorders)
            a, rd = acc[mode], {"drafter_seconds": 0.0, "drafter_passes": 0}
            for pid, ids in prompts:
                t0 = time.perf_counter()
                out, st = dec.generate(ids, args.max_new_tokens)
                a["seconds"] += time.perf_counter() - t0
                a["tokens"] += len(out)
                a["steps"] += st["steps"]
                a["emitted"] += sum(st["emitted_per_step"])
                a["identical"] += int(out == refs[pid])
                for k in rd:
                    rd[k] += st[k]
                    a[k] += st[k]
            a["rounds_ms_per_pass"].append(1e3 * rd["drafter_seconds"] / max(rd["drafter_passes"], 1))
    van_tps = van_tok / van_s
    result = {"checkpoint": args.checkpoint, "head_type": meta["head_type"], "model": ident.source, "dtype": args.dtype,
              "attn": args.attn, "threads": torch.get_num_threads(), "num_prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "base_packed_layers": len(base_packed),
              "head_packed_layers": packed_names, "vanilla_tokens_per_s": van_tps}
    for mode, a in acc.items():
        tps = a["tokens"] / a["seconds"]
        result[mode] = {"ms_per_pass": 1e3 * a["drafter_seconds"] / max(a["drafter_passes"], 1),
                        "rounds_ms_per_pass": a["rounds_ms_per_pass"],
                        "drafter_ms_per_step": 1e3 * a["drafter_seconds"] / max(a["steps"], 1),
                        "passes_per_step": a["drafter_passes"] / max(a["steps"], 1),
                        "drafter_time_share": a["drafter_seconds"] / a["seconds"], "tau": a["emitted"] / max(a["steps"], 1),
                        "tokens_per_s": tps, "speedup": tps / van_tps,
                        "identical": f"{a['identical']}/{len(prompts) * args.rounds}"}
    result["packed_over_unpacked_per_pass"] = result["unpacked"]["ms_per_pass"] / result["packed"]["ms_per_pass"]
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    bad = args.dtype == "float32" and any(a["identical"] != len(prompts) * args.rounds for a in acc.values())
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
