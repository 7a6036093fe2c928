"""Data-prep throughput against the bare base forward pass, and cache bytes against raw tensor bytes.

Both timings run in one process on the same conversations and the same length-sorted batches
(``data_prep.pipeline.length_batches``):

* **bare forward**: ``model(input_ids, attention_mask)`` per batch (logits, no hidden states kept);
* **data prep**: ``template_split`` (per-turn templating) + ``build_records`` (forward with hidden states, chunked argmax labels)
  + ``build_shard_tensors`` + ``write_shard`` (safetensors + sha256 + sidecar) into a temp dir.

Each is repeated ``--repeats`` times alternately; the best time of each is reported.  Labels are
teacher-forced here.  Targets (issue 2): prep ≥ 0.90× forward tokens/s, cache ≤ 1.02× raw bytes.

``--regenerate`` (issue 15) also times ``labels=regenerate``'s generation
(:func:`data_prep.labels.regenerate`: continuous batching over a slot KV cache, docs/data_prep.md;
``benchmarks/bench_regen.py`` is the fuller sweep over batch sizes) against the bare batched greedy generation of ``transformers``
(``model.generate``, greedy, left-padded, same batches of ``--gen-batch-size``) over exactly the
same turns — every turn's full regenerated context as prompt, its regenerated length as budget —
and checks that both produce the same tokens.

    python benchmarks/bench_data_prep.py                       # real packaged SmolLM2, 16 conversations
    python benchmarks/bench_data_prep.py --tiny                # tiny random Llama (seconds)
    python benchmarks/bench_data_prep.py --regenerate --conversations 8   # + regeneration vs model.generate
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.config import compose  # noqa: E402
from data_prep import cache as cache_mod  # noqa: E402
from data_prep.labels import _pad_right  # noqa: E402
from data_prep.labels import regen_sources, regenerate  # noqa: E402
from data_prep.pipeline import build_records, length_batches, read_split, template_split  # noqa: E402
from data_prep.template import end_of_turn_ids  # noqa: E402


@torch.inference_mode()
def bench_regenerate(model, tok, convs, eos, max_length: int, batch_size: int) -> dict:
    """Regeneration tokens/s against bare batched ``model.generate`` over the same turns (module doc)."""
    from collections import Counter

    stats = Counter()
    t0 = time.perf_counter()
    out = [r for records in regenerate(model, tok, regen_sources(convs), eos, None, max_length, batch_size, stats=stats)
           for r in records]
    t_regen = time.perf_counter() - t0
    # the same turns as independent prompts: (round k, full context, generated tokens)
    turns: dict[int, list[tuple[list[int], list[int]]]] = {}
    for ids, mask in out:
        k, t = 0, 0
        while t < len(ids):
            if mask[t]:
                e = t
                while e < len(ids) and mask[e]:
                    e += 1
                turns.setdefault(k, []).append((ids[:t], ids[t:e]))
                k, t = k + 1, e
            else:
                t += 1
    pad = tok.pad_token_id
    n_bare, same = 0, True
    t0 = time.perf_counter()
    for k in sorted(turns):
        group = sorted(turns[k], key=lambda x: len(x[0]))
        for b in range(0, len(group), batch_size):
            chunk = group[b: b + batch_size]
            T = max(len(p) for p, _ in chunk)
            ids = torch.full((len(chunk), T), pad, dtype=torch.long)
            attn = torch.zeros((len(chunk), T), dtype=torch.long)
            for i, (p, _) in enumerate(chunk):
                ids[i, T - len(p):] = torch.tensor(p)
                attn[i, T - len(p):] = 1
            gen = model.generate(ids, attention_mask=attn, do_sample=False, max_new_tokens=max(len(g) for _, g in chunk),
                                 eos_token_id=sorted(eos), pad_token_id=pad)[:, T:].tolist()
            for (p, g), row in zip(chunk, gen):
                n_bare += len(g)
                same &= row[: len(g)] == g
    t_bare = time.perf_counter() - t0
    n = stats["generated_tokens"]
    return {"regenerate_turns": sum(len(v) for v in turns.values()), "regenerated_tokens": n,
            "regen_truncated_turns": stats["truncated_turns"], "regenerate_tok_s": n / t_regen,
            "bare_generate_tok_s": n_bare / t_bare, "regenerate_speedup": (n / t_regen) / (n_bare / t_bare),
            "same_tokens_as_bare_generate": bool(same)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="use the tiny random Llama instead of SmolLM2")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--layers", type=str, default="", help="comma-separated intermediate layers, e.g. 8,15,22")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--regenerate", action="store_true",
                    help="also time regeneration (full length) against bare batched model.generate")
    ap.add_argument("--gen-batch-size", type=int, default=16)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench_data_prep_"))
    if args.tiny:
        from core.tiny import save_tiny_model

        model_args = [f"model.path={save_tiny_model(tmp / 'tiny')}"]
    else:
        model_args = []
    cfg = compose(model_args + [f"data.max_conversations={args.conversations}", f"data.max_length={args.max_length}"])
    from core.base_model import load_base_model

    model, tok, ident = load_base_model(cfg.model)
    data = read_split(cfg.data)
    eos = end_of_turn_ids(tok, model)
    templated = template_split(tok, data, eos, args.max_length)
    convs = templated["train"] + templated["val"]
    L = int(model.config.num_hidden_layers)
    layers = [int(x) for x in args.layers.split(",") if x]
    dtype = cache_mod._TORCH_DTYPES[args.dtype]
    seqs = [c.encode(args.max_length)[0] for c in convs]
    batches = length_batches([len(s) for s in seqs], args.batch_tokens)
    n_tokens = sum(len(s) for s in seqs)
    pad = tok.pad_token_id

    @torch.inference_mode()
    def bare():
        for g in batches:
            ids, attn = _pad_right([seqs[i] for i in g], pad)
            model(input_ids=ids, attention_mask=attn)

    def prep(k):
        t = template_split(tok, data, eos, args.max_length)  # templating is timed too (as before issue 15)
        records, _ = build_records(model, tok, t["train"] + t["val"], labels_mode="teacher_forced", max_length=args.max_length,
                                   max_new_tokens=1, layers=layers, final_layer=L, batch_tokens=args.batch_tokens,
                                   gen_batch_size=1)
        tensors = cache_mod.build_shard_tensors(records, layers, L, dtype)
        entry = cache_mod.write_shard(tmp / f"run{k}", 0, tensors, [r["id"] for r in records], {})
        raw = sum(t.numel() * t.element_size() for t in tensors.values())
        return entry["bytes"], raw

    t_bare, t_prep = [], []
    for k in range(args.repeats):
        t0 = time.perf_counter(); bare(); t_bare.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); size, raw = prep(k); t_prep.append(time.perf_counter() - t0)
    result = {
        "model": "tiny" if args.tiny else "SmolLM2-135M-Instruct (packaged GGUF, fp32)",
        "threads": torch.get_num_threads(), "conversations": len(convs), "tokens": n_tokens,
        "batches": len(batches), "layers_cached": [L] + layers, "dtype": args.dtype,
        "bare_forward_tok_s": n_tokens / min(t_bare), "data_prep_tok_s": n_tokens / min(t_prep),
        "throughput_ratio": min(t_bare) / min(t_prep),
        "cache_bytes": size, "raw_tensor_bytes": raw, "bytes_ratio": size / raw, "bytes_per_token": size / n_tokens,
    }
    if args.regenerate:
        result.update(bench_regenerate(model, tok, convs, eos, args.max_length, args.gen_batch_size))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
