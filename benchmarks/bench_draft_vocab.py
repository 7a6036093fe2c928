"""Draft vocabulary (issue 13): training steps/s per head at N ∈ {4k, 8k, 16k, full}, and the
held-out label coverage at each N, on the real packaged base (SmolLM2-135M, V = 49,152, H = 576).

Throughput: for every head, one bare training step = ``head.training_loss`` + ``backward`` +
``AdamW.step`` on the same in-memory batches, timed after ``--warmup`` steps (``--clock cpu``,
the default: the process's CPU time, which other jobs on a shared machine do not stretch).  The sizes are
interleaved round-robin (``--rounds`` rounds of ``--steps`` steps each, the order rotated every
round) so machine load drifts hit them alike; the figure is the median step time over all timed
steps of a size, reported as steps/s and as the ratio to the full vocabulary **of the same run**.

Batches: ``--cache DIR`` takes real batches from a cache (its ``train`` split; intermediate
layers missing from the cache are filled with random states at the real width); otherwise
synthetic batches at the real dimensions (random hidden states, labels drawn from the cache's
label counts if ``--counts-cache`` is given, else uniform).  The draft vocabulary comes from the
training label counts of ``--cache`` / ``--counts-cache`` (else the ids ranked by a fixed random
permutation: only the size matters for time).

Usage::

    python benchmarks/bench_draft_vocab.py                                   # synthetic batches
    python benchmarks/bench_draft_vocab.py --cache /work/outputs/cache/real_tf640 --heads ctc,falcon_k1
    python benchmarks/bench_draft_vocab.py --coverage-only --cache /work/outputs/cache/real_tf640
    python benchmarks/bench_draft_vocab.py --partial-cache /work/outputs/cache/real_tf640   # cache still being written

Prints Markdown tables and writes them (plus JSON) to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

HEADS = ("ctc", "falcon", "falcon_noglance", "falcon_k1", "adadecode", "eagle3")
SIZES = (4096, 8192, 16384, None)


PARTIAL: dict = {}  # set by --partial-cache: {"dir", "heldout_shards", "vocab_size"}


def partial_counts(cache: Path, heldout_shards: int, vocab_size: int):
    """Counts from the *finished* shards of a cache still being written (no manifest yet): the
    training counts from all but the last ``heldout_shards`` finished train shards, the held-out
    proxy counts from those last shards (disjoint conversations, but not the held-out split)."""
    from safetensors import safe_open

    from data_prep.label_counts import count_labels

    done = sorted(p.with_suffix(".safetensors") for p in (cache / "train").glob("shard-*.json"))
    if len(done) <= heldout_shards:
        raise SystemExit(f"{cache}/train has {len(done)} finished shards; need more than {heldout_shards}")
    per = []
    for path in done:
        with safe_open(str(path), framework="pt") as f:
            per.append(count_labels(f.get_tensor("labels"), f.get_tensor("loss_mask"), vocab_size))
    train = torch.stack(per[:-heldout_shards]).sum(0)
    held = torch.stack(per[-heldout_shards:]).sum(0)
    PARTIAL["desc"] = (f"{cache}: {len(done) - heldout_shards} finished train shards for the mapping, the next "
                       f"{heldout_shards} as the held-out proxy (cache still being written)")
    return train, held


def load_counts(cache: Path | None):
    from data_prep.label_counts import load_counts as load

    if PARTIAL:
        return partial_counts(PARTIAL["dir"], PARTIAL["heldout_shards"], PARTIAL["vocab_size"])
    if cache is None:
        return None, None
    return load(cache / "train"), load(cache / "val")


def synthetic_batches(base_cfg, n: int, batch_size: int, length: int, layers: list[int], counts, seed: int):
    g = torch.Generator().manual_seed(seed)
    H, V = int(base_cfg.hidden_size), int(base_cfg.vocab_size)
    probs = counts.double() / counts.sum() if counts is not None else torch.full((V,), 1.0 / V, dtype=torch.float64)
    out = []
    for _ in range(n):
        ids = torch.multinomial(probs, batch_size * length, replacement=True, generator=g).reshape(batch_size, length)
        labels = torch.roll(ids, -1, dims=1)
        am = torch.ones(batch_size, length, dtype=torch.bool)
        lm = am.clone()
        lm[:, : length // 4] = False
        hidden = torch.randn(batch_size, length, H, generator=g)
        out.append({"input_ids": ids, "attention_mask": am, "loss_mask": lm, "labels": labels, "hidden": hidden,
                    "aux_hidden": {l: torch.randn(batch_size, length, H, generator=g) for l in layers},
                    "lengths": torch.full((batch_size,), length), "ids": [f"s{i}" for i in range(batch_size)]})
    return out


def cache_batches(cache: Path, n: int, batch_size: int, max_len: int, layers: list[int], H: int, seed: int):
    from data_prep.cache import CacheReader, collate

    reader = CacheReader(cache / "train")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(reader), generator=g).tolist()
    out, pos = [], 0
    for _ in range(n):
        recs = []
        for _ in range(batch_size):
            r = reader[order[pos % len(order)]]
            pos += 1
            r = {k: (v[:max_len] if torch.is_tensor(v) else v) for k, v in r.items()}
            r["aux_hidden"] = {l: (r["aux_hidden"][l][:max_len] if l in r["aux_hidden"] else
                                   torch.randn(len(r["input_ids"]), H, generator=g).to(r["hidden"].dtype)) for l in layers}
            recs.append(r)
        out.append(collate(recs, reader.pad_id))
    return out


def head_cfg(name: str, size: int | None) -> dict:
    from omegaconf import OmegaConf

    from core.config import compose

    cfg = OmegaConf.to_container(compose([f"heads={name}"]).heads, resolve=True)
    cfg["draft_vocab_size"] = size
    return cfg


def time_heads(args) -> dict:
    import heads
    from core.base_model import load_base_model
    from core.config import compose
    from heads.base import Progress

    torch.set_num_threads(args.threads)
    # on a shared machine the process's CPU time is far steadier than wall time (other jobs only
    # stretch the wall clock); with several threads it sums their work
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    base, _, _ = load_base_model(compose([]).model)
    V, H = int(base.config.vocab_size), int(base.config.hidden_size)
    train_counts, _ = load_counts(args.cache or args.counts_cache)
    counts = train_counts
    if counts is None:  # only N matters for time: rank the ids by a fixed random permutation
        counts = torch.randperm(V, generator=torch.Generator().manual_seed(0)).to(torch.int64)
    results = {}
    for name in args.heads:
        # intermediate layers the head reads (adadecode's candidates, eagle3's [2, L//2, L-3])
        layers = [int(l) for l in heads.build(head_cfg(name, None), base).required_cache_layers]
        n_batches = args.warmup + args.steps
        if args.cache:
            batches = cache_batches(args.cache, n_batches, args.batch_size, args.length, layers, H, args.seed)
        else:
            batches = synthetic_batches(base.config, n_batches, args.batch_size, args.length, layers, train_counts, args.seed)
        setups = {}
        for size in args.sizes:
            torch.manual_seed(args.seed)
            head = heads.build(head_cfg(name, size), base, label_counts=counts if size else None)
            head.train()
            opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
            setups[size] = (head, opt, [])
        def step(size, batch, k):
            head, opt, _ = setups[size]
            opt.zero_grad(set_to_none=True)
            loss, metrics = head.training_loss(batch, Progress(step=k, total_steps=1000))
            loss.backward()
            opt.step()
            return metrics

        for size in args.sizes:  # warm-up (allocator, first-call overheads)
            for k in range(args.warmup):
                step(size, batches[k], k)
        oov = {}
        for r in range(args.rounds):
            order = list(args.sizes[r % len(args.sizes):]) + list(args.sizes[: r % len(args.sizes)])
            for size in order:
                for k in range(args.steps):
                    t0 = clock()
                    m = step(size, batches[args.warmup + k], args.warmup + k)
                    setups[size][2].append(clock() - t0)
                    oov.setdefault(size, []).append(float(m.get("oov_rate", 0.0)))
        rows = {}
        full = statistics.median(setups[None][2]) if None in setups else None
        for size in args.sizes:
            med = statistics.median(setups[size][2])
            rows["full" if size is None else str(size)] = {
                "step_s": med, "steps_per_s": 1.0 / med, "speedup_vs_full": (full / med) if full else None,
                "oov_rate": statistics.mean(oov[size]), "timed_steps": len(setups[size][2])}
        results[name] = rows
        print(f"{name}: " + ", ".join(f"{k} {v['step_s']:.3f}s ({v['speedup_vs_full']:.2f}x)" for k, v in rows.items()),
              flush=True)
        del setups
    return {"V": V, "H": H, "batch_size": args.batch_size, "length": args.length, "threads": args.threads,
            "clock": args.clock,
            "batches": "cache " + str(args.cache) if args.cache else "synthetic", "heads": results}


class CpuTimedDrafter:
    """Wraps a ``decoding.speculative.Drafter`` and adds the process CPU time of its ``start`` /
    ``draft`` / ``accept`` calls to ``cpu_seconds`` (the decoder's own stats are wall clock, which
    other jobs on a shared machine stretch).  Every other attribute (``feature_layers``,
    ``reset``, ...) is the wrapped drafter's."""

    def __init__(self, drafter) -> None:
        self.inner, self.cpu_seconds = drafter, 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _timed(self, fn, *args):
        t0 = time.process_time()
        try:
            return fn(*args)
        finally:
            self.cpu_seconds += time.process_time() - t0

    def start(self, prompt_ids, hidden):
        return self._timed(self.inner.start, prompt_ids, hidden)

    def draft(self, root_token):
        return self._timed(self.inner.draft, root_token)

    def accept(self, tokens, hidden):
        return self._timed(self.inner.accept, tokens, hidden)


def drafting(args) -> dict:
    """Drafter share of decoding time at each N: untrained heads (drafting cost does not depend on
    the weights) decode MT-bench first turns losslessly through ``SpeculativeDecoder``; the share is
    Σ drafter_seconds / Σ seconds over the prompts, sizes interleaved per prompt, parity checked.
    ``--clock cpu`` (default) measures both as process CPU time (:class:`CpuTimedDrafter`), ``wall``
    takes the decoder's wall-clock stats."""
    import heads
    from core.base_model import load_base_model
    from core.config import compose
    from decoding.speculative import SpeculativeDecoder
    from decoding.vanilla import eos_token_ids, greedy_generate
    from evaluation.prompts import template

    torch.set_num_threads(args.threads)
    base, tok, _ = load_base_model(compose([]).model)
    V = int(base.config.vocab_size)
    train_counts, _ = load_counts(args.cache or args.counts_cache)
    counts = train_counts if train_counts is not None else torch.randperm(
        V, generator=torch.Generator().manual_seed(0)).to(torch.int64)
    rows = [json.loads(l) for l in Path(args.prompts).read_text().splitlines() if l.strip()][: args.num_prompts]
    prompts = [template(tok, [{"role": "user", "content": r["turns"][0]}]) for r in rows]
    eos = eos_token_ids(tok, base)
    refs = [greedy_generate(base, p, args.max_new_tokens, eos)[0] for p in prompts]
    out = {}
    for name in args.draft_heads:
        decs, timed = {}, {}
        for size in args.sizes:
            torch.manual_seed(args.seed)
            head = heads.build(head_cfg(name, size), base, label_counts=counts if size else None).eval()
            timed[size] = CpuTimedDrafter(head.make_drafter(base))
            decs[size] = SpeculativeDecoder(base, timed[size], eos)
        tot = {size: {"drafter_seconds": 0.0, "seconds": 0.0, "steps": 0} for size in args.sizes}
        for i, p in enumerate(prompts):
            order = list(args.sizes[i % len(args.sizes):]) + list(args.sizes[: i % len(args.sizes)])
            for size in order:
                timed[size].cpu_seconds = 0.0
                c0 = time.process_time()
                toks, st = decs[size].generate(p, args.max_new_tokens)
                if args.clock == "cpu":  # process CPU time of the drafter calls and of the whole generate
                    st = dict(st, drafter_seconds=timed[size].cpu_seconds, seconds=time.process_time() - c0)
                if toks != refs[i]:
                    raise SystemExit(f"parity failure: {name} N={size} prompt {i}")
                for k in tot[size]:
                    tot[size][k] += st[k]
        out[name] = {("full" if size is None else str(size)): {
            "drafter_share": t["drafter_seconds"] / t["seconds"], "drafter_ms_per_step": 1000 * t["drafter_seconds"] / t["steps"],
            "steps": t["steps"]} for size, t in tot.items()}
        print(f"{name}: " + ", ".join(f"{k} share {v['drafter_share']:.3f} ({v['drafter_ms_per_step']:.1f} ms/step)"
                                       for k, v in out[name].items()), flush=True)
    return {"prompts": f"{args.prompts} first {len(prompts)} first turns", "max_new_tokens": args.max_new_tokens,
            "threads": args.threads, "clock": args.clock, "parity": f"{len(prompts)}/{len(prompts)} per head and N", "heads": out}


def coverage(args) -> dict:
    from data_prep.label_counts import coverage_table

    train, val = load_counts(args.cache or args.counts_cache)
    sizes = [2048, 4096, 8192, 16384, 32768]
    return {"cache": PARTIAL.get("desc") or str(args.cache or args.counts_cache), "train_labels": int(train.sum()),
            "heldout_labels": int(val.sum()), "rows": coverage_table(train, val, sizes)}


def markdown(res: dict) -> str:
    lines = []
    if "coverage" in res:
        c = res["coverage"]
        lines += [f"Held-out label coverage ({c['heldout_labels']:,} held-out labels, "
                  f"{c['train_labels']:,} training labels; {c['cache']}):", "",
                  "| N | held-out coverage | train coverage |", "|---|---|---|"]
        lines += [f"| {r['N']:,} | {100 * r['heldout_coverage']:.2f}% | {100 * r['train_coverage']:.2f}% |"
                  for r in c["rows"]]
        lines.append("")
    if "train" in res:
        t = res["train"]
        sizes = list(next(iter(t["heads"].values())).keys())
        lines += [f"Training steps/s (bare step: loss + backward + AdamW; B={t['batch_size']}, T={t['length']}, "
                  f"{t['threads']} CPU thread(s), {t['clock']} time per step, {t['batches']} batches; ratio = speed-up over the full "
                  f"vocabulary in the same run):", "",
                  "| head | " + " | ".join(f"N={s}" for s in sizes) + " |", "|---|" + "---|" * len(sizes)]
        for name, rows in t["heads"].items():
            lines.append(f"| {name} | " + " | ".join(
                f"{rows[s]['steps_per_s']:.2f}/s ({rows[s]['speedup_vs_full']:.2f}×, OOV {100 * rows[s]['oov_rate']:.1f}%)"
                for s in sizes) + " |")
    if "drafting" in res:
        d = res["drafting"]
        sizes = list(next(iter(d["heads"].values())).keys())
        lines += ["", f"Drafter share of decoding time (untrained heads, default trees, {d['prompts']}, "
                  f"{d['max_new_tokens']} tokens, {d['threads']} thread(s), {d.get('clock', 'wall')} time, parity {d['parity']}):", "",
                  "| head | " + " | ".join(f"N={s}" for s in sizes) + " |", "|---|" + "---|" * len(sizes)]
        for name, rows in d["heads"].items():
            lines.append(f"| {name} | " + " | ".join(
                f"{rows[s]['drafter_share']:.3f} ({rows[s]['drafter_ms_per_step']:.1f} ms/step)" for s in sizes) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default=",".join(HEADS))
    p.add_argument("--sizes", default="4096,8192,16384,full")
    p.add_argument("--cache", type=Path, default=None, help="real batches + label counts from this cache")
    p.add_argument("--counts-cache", type=Path, default=None, help="label counts only (synthetic batches)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="cpu: process CPU time per step / per drafter call (robust on a shared machine); wall: wall-clock")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--partial-cache", type=Path, default=None,
                   help="label counts from the finished shards of a cache still being written")
    p.add_argument("--heldout-shards", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=49152, help="V for --partial-cache")
    p.add_argument("--coverage-only", action="store_true")
    p.add_argument("--drafting", action="store_true", help="also measure the drafter share of decoding time")
    p.add_argument("--drafting-only", action="store_true")
    p.add_argument("--draft-heads", default="ctc,falcon_k1")
    p.add_argument("--prompts", default="/work/shared/data/mt_bench_questions.jsonl")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "draft_vocab")
    args = p.parse_args(argv)
    args.heads = [h for h in args.heads.split(",") if h]
    args.sizes = [None if s == "full" else int(s) for s in args.sizes.split(",")]
    res = {"argv": sys.argv[1:] if argv is None else list(argv)}
    if args.partial_cache:
        PARTIAL.update({"dir": args.partial_cache, "heldout_shards": args.heldout_shards, "vocab_size": args.vocab_size})
    if args.cache or args.counts_cache or args.partial_cache:
        res["coverage"] = coverage(args)
    args.draft_heads = [h for h in args.draft_heads.split(",") if h]
    if not (args.coverage_only or args.drafting_only):
        res["train"] = time_heads(args)
    if args.drafting or args.drafting_only:
        res["drafting"] = drafting(args)
    text = markdown(res)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(res, indent=1))
    (args.out / "result.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
