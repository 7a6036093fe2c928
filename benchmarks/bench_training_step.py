"""A head's training step: this repository's loss path against the formulation it replaced, in the same run.

One bare training step = loss + ``backward`` + ``AdamW.step`` of a head at SmolLM2-135M's shape
(H = 576, 9 heads, 3 KV heads, MLP 1,536, V = 49,152, draft vocabulary 16,384), on synthetic
batches of ``--batch-size`` x ``--length`` tokens (loss on the last 3/4 of each row), under bf16
autocast (``train.precision=bf16-mixed``) or in fp32.  Two variants per head, interleaved
round-robin so machine load drifts hit both alike:

``--head eagle3``
  * ``head``: :meth:`heads.eagle3.Eagle3Head.training_loss` as trained (one teacher softmax for
    all TTT steps, no per-step row gather, the fused :func:`losses.eagle3.soft_cross_entropy`,
    the draft LM head in autocast's dtype);
  * ``textbook``: the same forward with the loss written as EAGLE's ``Model.forward`` does: per
    step the teacher logits gathered for that step's rows, ``-(softmax(teacher) *
    log_softmax(z)).sum(-1)``, and the draft LM head in fp32.

``--head falcon_k1`` (``configs/heads/falcon_k1.yaml``)
  * ``head``: :meth:`heads.falcon.FalconHead.training_loss` as trained (the distillation term
    through :func:`losses.falcon.falcon_loss_fused`, no student logits);
  * ``logits``: the same step with the student logits W f̂ formed, kept and fed to
    :func:`losses.falcon.falcon_loss` (this repository's loss path before the fused one).

``--head adadecode`` (three candidate layers, as the default 8/15/22 of 30)
  * ``head``: :meth:`heads.adadecode.AdaDecodeHead.training_loss` as trained (each chunk's
    gradients taken in its forward, :func:`losses.linear_soft_ce.linear_soft_cross_entropy`);
  * ``checkpointed``: the per-layer KL of ``kl_per_token`` over ``layer_logits``, each chunk
    under activation checkpointing (this repository's loss path before the fused one): the chunk's
    logits are computed twice and kept for the backward.

Both variants start from the same weights and batch; their losses are printed side by side (they
agree to float32 rounding).  Reported: median wall seconds per step and tokens/s (all batch
tokens), and head/reference.

Usage::

    python benchmarks/bench_training_step.py --head eagle3        # 7 TTT steps, bf16 autocast, 4 x 512
    python benchmarks/bench_training_step.py --head eagle3 --ttt-steps 3 --precision fp32
    python benchmarks/bench_training_step.py --head adadecode --precision fp32
    python benchmarks/bench_training_step.py --head falcon_k1 --precision fp32
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def build(args):
    """(head, batch): a SmolLM2-shaped random base (``--base-layers`` layers; the head reads hs[1..3]
    and its cost does not depend on the base's depth) and an ``--head`` head over a 16k draft vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import heads

    torch.manual_seed(args.seed)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      num_hidden_layers=args.base_layers, vocab_size=49152, rms_norm_eps=1e-5,
                      tie_word_embeddings=True)
    base = LlamaForCausalLM(cfg).eval()
    counts = torch.randint(1, 1000, (cfg.vocab_size,))
    if args.head == "falcon_k1":
        from omegaconf import OmegaConf

        head_cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "heads" / "falcon_k1.yaml"))
    else:
        head_cfg = {"type": args.head, "layers": [1, 2, 3], **({"ttt_steps": args.ttt_steps} if args.head == "eagle3" else {})}
    head = heads.build({**head_cfg, "draft_vocab_size": args.draft_vocab}, base, label_counts=counts, counts_source="bench")
    B, T, H = args.batch_size, args.length, cfg.hidden_size
    g = torch.Generator().manual_seed(args.seed)
    loss_mask = torch.ones(B, T, dtype=torch.bool)
    loss_mask[:, : T // 4] = False
    batch = {"input_ids": torch.randint(0, cfg.vocab_size, (B, T), generator=g),
             "attention_mask": torch.ones(B, T, dtype=torch.bool), "loss_mask": loss_mask,
             "labels": torch.randint(0, cfg.vocab_size, (B, T), generator=g),
             "hidden": torch.randn(B, T, H, generator=g),
             "aux_hidden": {l: torch.randn(B, T, H, generator=g) for l in (1, 2, 3)}}
    return head, batch


def textbook_loss(head, batch):
    """The EAGLE ``Model.forward`` formulation (module doc): per-step gather, softmax, log-softmax."""
    from losses.eagle3 import ttt_step_masks
    from losses.ttt import shift_left

    ids, valid = batch["input_ids"], batch["attention_mask"].bool()
    lm = batch["loss_mask"].bool() & valid
    steps = head.ttt_forward(head._features(batch), ids, valid)
    masks = ttt_step_masks(lm, len(steps))
    row = torch.full(lm.shape, -1, dtype=torch.long)
    row[lm] = torch.arange(int(lm.sum()))
    with torch.autocast("cpu", enabled=False):
        teacher = head.draft_lm_head(batch["hidden"][lm].float())
    total = torch.zeros(())
    for i, (h, m) in enumerate(zip(steps, masks)):
        with torch.autocast("cpu", enabled=False):
            lg = head.trainable_lm_head(head.norm(h[m])).float()
        tg = teacher.index_select(0, shift_left(row, 1 + i, -1)[m])
        ce = -(F.softmax(tg, -1) * F.log_softmax(lg, -1)).sum(-1)
        total = total + head.cfg["ttt_decay"] ** i * ce.mean()
        head.to_base_ids(lg.argmax(-1))  # the per-step accuracy metric training_loss also computes
    return total


def checkpointed_loss(head, batch):
    """AdaDecode's loss before the fused path (module doc): per chunk, the KL of ``kl_per_token``
    over ``layer_logits`` under ``torch.utils.checkpoint``, weights all 1."""
    from torch.utils.checkpoint import checkpoint

    from losses.adadecode import kl_per_token

    def chunk(hidden, *aux):
        with torch.autocast("cpu", enabled=False):
            t = head.teacher_logits(hidden).detach()
            return torch.stack([kl_per_token(t, head.layer_logits(l, h)).sum() for l, h in zip(head.layers, aux)])

    hidden, aux, _ = head._gather(batch)
    step = int(head.cfg["chunk_tokens"])
    total = torch.zeros(len(head.layers))
    for s in range(0, hidden.shape[0], step):
        total = total + checkpoint(chunk, hidden[s:s + step], *[aux[l][s:s + step] for l in head.layers],
                                   use_reentrant=False)
    return total.sum() / max(hidden.shape[0], 1)


def logits_falcon_loss(head, batch):
    """Falcon's loss before the fused path: the student logits W f̂ formed and kept, then
    :func:`losses.falcon.falcon_loss` (``training_loss`` with ``falcon_loss_fused`` swapped out)."""
    import heads.falcon as falcon_module
    from losses.falcon import falcon_loss

    def unfused(pred, tgt, weight, teacher, **kw):
        with torch.autocast("cpu", enabled=False):
            student = pred.float() @ weight.float().T
        loss, parts = falcon_loss(pred, tgt, student, teacher, torch.ones(pred.shape[0], dtype=torch.bool), **kw)
        return loss, parts, student.detach().argmax(-1)

    fused, falcon_module.falcon_loss_fused = falcon_module.falcon_loss_fused, unfused
    try:
        from heads import Progress

        return head.training_loss(batch, Progress())[0]
    finally:
        falcon_module.falcon_loss_fused = fused


REFERENCES = {"eagle3": ("textbook", textbook_loss), "adadecode": ("checkpointed", checkpointed_loss),
              "falcon_k1": ("logits", logits_falcon_loss)}


def run(args) -> dict:
    import copy

    from heads import Progress

    torch.set_num_threads(args.threads)
    head0, batch = build(args)
    ref_name, ref_loss = REFERENCES[args.head]
    variants = {"head": lambda h: h.training_loss(batch, Progress())[0], ref_name: lambda h: ref_loss(h, batch)}
    models = {name: copy.deepcopy(head0) for name in variants}
    opts = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
            for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    first_loss: dict[str, float] = {}
    order = list(variants)
    for r in range(args.warmup + args.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16-mixed"
                   else contextlib.nullcontext())
            torch.manual_seed(args.seed + r)  # the same feature noise (falcon) for both variants of a round
            t0 = time.perf_counter()
            with ctx:
                loss = variants[name](models[name])
            loss.backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            first_loss.setdefault(name, float(loss.detach()))
            if r >= args.warmup:
                times[name].append(dt)
    tokens = args.batch_size * args.length
    res = {"args": {k: str(v) for k, v in vars(args).items()}, "tokens_per_step": tokens, "variants": {}}
    for name, ts in times.items():
        med = statistics.median(ts)
        res["variants"][name] = {"median_s": med, "tokens_per_s": tokens / med, "first_loss": first_loss[name]}
    res["reference"] = ref_name
    res["speedup"] = res["variants"][ref_name]["median_s"] / res["variants"]["head"]["median_s"]
    return res


def markdown(res: dict) -> str:
    a = res["args"]
    steps = {"eagle3": f"{a['ttt_steps']} TTT steps, ", "adadecode": "3 candidate layers, "}.get(a["head"], "")
    lines = [f"{a['head']} training step, {a['batch_size']} x {a['length']} tokens, {steps}"
             f"{a['precision']}, {a['threads']} threads, draft vocabulary {a['draft_vocab']}", "",
             "| loss path | s / step (median) | tokens/s | first-step loss |", "|---|---|---|---|"]
    for name, v in res["variants"].items():
        lines.append(f"| {name} | {v['median_s']:.2f} | {v['tokens_per_s']:.0f} | {v['first_loss']:.5f} |")
    lines.append(f"\nhead / {res['reference']}: **{res['speedup']:.2f}x**")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", choices=sorted(REFERENCES), required=True)
    p.add_argument("--ttt-steps", type=int, default=7, help="eagle3 only")
    p.add_argument("--precision", choices=("bf16-mixed", "fp32"), default="bf16-mixed")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--draft-vocab", type=int, default=16384)
    p.add_argument("--base-layers", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="default outputs/bench/<head>_step")
    args = p.parse_args(argv)
    args.out = args.out or ROOT / "outputs" / "bench" / f"{args.head}_step"
    res = run(args)
    text = markdown(res)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.md").write_text(text + "\n")
    (args.out / "result.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
