"""Online training of every head on a randomly initialised Llama, under DeepSpeed ZeRO (issue 17).

What ``scripts/gpu_check.sh`` runs on one GPU (no download: the base is built from a config):

1. a random ``LlamaForCausalLM`` of about 1.1B parameters (TinyLlama's shape: H=2048, 22 layers,
   GQA 32:4, V=32000) in bf16, and a synthetic ShareGPT file (``core.tiny`` tokenizer);
2. for every ``--strategies`` x ``--heads``: ``train.features=online`` training for ``--steps``
   optimizer steps through ``train.run.train`` (the frozen base runs inside each step);
3. the export check: ``<run>/last/model.safetensors`` equals the in-memory trained weights
   (``train.strategies.consolidated_head``: under ZeRO the gathered fp32 masters);
4. throughput: training tokens/s (all non-padding tokens, after the first step) and the share of
   the step time spent in the base forward.

``--tiny`` swaps in ``core.tiny``'s 4-layer model (CPU tests run this entry that way).
Writes ``<out>/gpu_check.json`` and prints a Markdown table.  Exit status 1 if an export differs.

    python scripts/gpu_check.py --out outputs/gpu_check                      # the GPU run
    python scripts/gpu_check.py --tiny --strategies auto --steps 2 --out /tmp/gc  # CPU smoke run
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

#: about 1.1B parameters (TinyLlama-1.1B's shape)
BIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=22, num_attention_heads=32,
           num_key_value_heads=4, max_position_embeddings=4096)
WORDS = ["The quick brown fox jumps over the lazy dog.", "Speculative decoding drafts tokens and verifies them.",
         "Hello! How can I help you today?", "Please write a short poem about the sea.", "def add(a, b): return a + b",
         "1 2 3 4 5 6 7 8 9 10", "system user assistant", "You are a helpful AI assistant."]


def build_base(tiny: bool, dtype: torch.dtype, seed: int = 0):
    """``(model, tokenizer, identity)``: a random frozen Llama (``BIG`` or ``core.tiny``) and the tiny tokenizer."""
    from core.base_model import BaseIdentity
    from core.rope import cast_module
    from core.tiny import tiny_llama_config, tiny_tokenizer
    from transformers import LlamaForCausalLM

    tok = tiny_tokenizer()
    shape = {} if tiny else dict(BIG)
    shape.setdefault("vocab_size", len(tok))
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initialise where it will run
        model = cast_module(LlamaForCausalLM(tiny_llama_config(attn_implementation="sdpa", **shape)), dtype).eval()
    model.requires_grad_(False)
    c = model.config
    ident = BaseIdentity(source="random:" + ("tiny" if tiny else "llama-1.1b"), sha256=None,
                         architecture="LlamaForCausalLM", vocab_size=int(c.vocab_size), hidden_size=int(c.hidden_size),
                         num_hidden_layers=int(c.num_hidden_layers))
    return model, tok, ident


def write_conversations(path: Path, n: int, turns: int) -> Path:
    """A ShareGPT JSON file of ``n`` synthetic conversations with ``turns`` exchanges each."""
    convs = []
    for i in range(n):
        msgs = []
        for j in range(turns):
            msgs.append({"from": "human", "value": " ".join(WORDS[(i + j + k) % len(WORDS)] for k in range(3))})
            msgs.append({"from": "gpt", "value": " ".join(WORDS[(2 * i + j + k) % len(WORDS)] for k in range(8))})
        convs.append({"id": f"gc-{i}", "conversations": msgs})
    path.write_text(json.dumps(convs))
    return path


def head_overrides(head: str, num_layers: int) -> list[str]:
    """Config overrides that fit ``head`` to a base of ``num_layers`` layers (AdaDecode's exit layers)."""
    if head == "adadecode":
        ls = sorted({max(1, num_layers // 4), max(1, num_layers // 2), max(1, 3 * num_layers // 4)} - {num_layers})
        return [f"heads.layers={ls}", f"prep.layers={ls}"]
    return []


def _tokens_per_s(run_dir: Path) -> float | None:
    from train.run import metrics_csv

    rows = [float(r["train/tokens_per_s"]) for r in csv.DictReader(open(metrics_csv(run_dir))) if r.get("train/tokens_per_s")]
    rows = rows[1:] or rows  # the first step includes start-up
    return sum(rows) / len(rows) if rows else None


def check_one(base, data: Path, out: Path, head: str, strategy: str, steps: int, max_length: int, batch_size: int,
              accelerator: str, features: str = "online") -> dict:
    """Train ``head`` with ``train.features=features`` under ``strategy`` and check its export; returns the result row."""
    from safetensors.torch import load_file

    from core.config import compose
    from train.run import train
    from train.strategies import consolidated_head

    model = base[0]
    args = [f"heads={head}", f"strategy={strategy}", f"train.features={features}", "labels=teacher_forced",
            f"data.path={data}", "data.max_conversations=null", "data.heldout_fraction=0.1", f"data.max_length={max_length}",
            f"output_root={out}", f"train.run_name={strategy}", f"train.max_steps={steps}", f"train.val_every_n_steps={steps}",
            f"train.batch_size={batch_size}", "train.scheduler.warmup_steps=1", "train.logger=csv",
            "train.progress_bar=false", "train.sanity_val_steps=0", "train.log_every_n_steps=1", "train.limit_val_batches=2",
            f"train.accelerator={accelerator}", "train.devices=1", *head_overrides(head, model.config.num_hidden_layers)]
    cfg = compose(args)
    t0 = time.perf_counter()
    result = train(cfg, base=base)
    wall = time.perf_counter() - t0
    trainer, module = result["trainer"], result["module"]
    live = {k: v.detach().float().cpu() for k, v in consolidated_head(trainer, module).trainable_state_dict().items()}
    saved = load_file(Path(result["run_dir"]) / "last" / "model.safetensors")
    same = sorted(live) == sorted(saved) and all(torch.equal(live[k], saved[k].float()) for k in live)
    base_features = module.features
    row = {"head": head, "strategy": strategy, "features": features, "steps": int(trainer.global_step), "export_equals_memory": bool(same),
           "tokens_per_s": _tokens_per_s(Path(result["run_dir"])), "wall_s": round(wall, 1),
           "base_forward_s": round(base_features.seconds, 2), "head_params": sum(v.numel() for v in live.values()),
           "loss": float(trainer.callback_metrics.get("train/loss", float("nan")))}
    if torch.cuda.is_available():
        row["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
        torch.cuda.reset_peak_memory_stats()
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--tiny", action="store_true", help="core.tiny's 4-layer model instead of ~1.1B (CPU tests)")
    p.add_argument("--heads", default="ctc,falcon,adadecode")
    p.add_argument("--strategies", default="deepspeed_zero2,deepspeed_zero3")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--features", default="online", choices=("online", "hybrid"))
    p.add_argument("--conversations", type=int, default=96)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    base = build_base(args.tiny, torch.bfloat16 if gpu else torch.float32)
    args.out.mkdir(parents=True, exist_ok=True)
    data = write_conversations(args.out / "conversations.json", args.conversations, turns=6)
    params = sum(p_.numel() for p_ in base[0].parameters())
    rows = []
    for strategy in args.strategies.split(","):
        for head in args.heads.split(","):
            rows.append(check_one(base, data, args.out / head, head, strategy, args.steps, args.max_length,
                                  args.batch_size, "gpu" if gpu else "cpu", args.features))
            print(json.dumps(rows[-1]), flush=True)
    report = {"base_params": params, "device": torch.cuda.get_device_name(0) if gpu else "cpu",
              "torch": torch.__version__, "rows": rows}
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"\nbase: random Llama, {params / 1e9:.2f}B parameters, {report['device']}\n")
    print("| head | strategy | steps | export == memory | train tokens/s | base-forward share | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        share = r["base_forward_s"] / r["wall_s"] if r["wall_s"] else float("nan")
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        print(f"| {r['head']} | {r['strategy']} | {r['steps']} | {r['export_equals_memory']} | {tps} | "
              f"{share:.0%} of wall | {r.get('peak_gpu_gib', '-')} |")
    if not all(r["export_equals_memory"] for r in rows):
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    main()
