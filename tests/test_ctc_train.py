"""End to end on the tiny model: `train` (Lightning) trains the CTC head on a regenerate-style cache,
selects the best checkpoint on val/sim_tau, and the exported head decodes losslessly."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from train.run import metrics_csv
import torch

import heads
from core.config import compose
from decoding.speculative import SpeculativeDecoder
from decoding.vanilla import greedy_generate

PAD = 2


def _records(model, n, seed, prefix):
    """Prompt of random tokens + the base's own greedy continuation (METHODS.md §0 'regenerate')."""
    g = torch.Generator().manual_seed(seed)
    L = model.config.num_hidden_layers
    out = []
    for i in range(n):
        prompt = torch.randint(3, model.config.vocab_size, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g)
        gen, _ = greedy_generate(model, prompt, 16, eos_token_ids=[])
        ids = torch.cat([prompt, torch.tensor(gen)])
        with torch.no_grad():
            o = model(input_ids=ids[None], output_hidden_states=True)
        mask = torch.arange(ids.numel()) >= prompt.numel()
        out.append({"input_ids": ids, "loss_mask": mask, "labels": o.logits[0].argmax(-1),
                    "hidden": {L: o.hidden_states[L][0]}, "id": f"{prefix}{i}"})
    return out


def _write_split(directory: Path, records, identity):
    from data_prep import cache as C

    directory.mkdir(parents=True, exist_ok=True)
    L = identity.num_hidden_layers
    tensors = C.build_shard_tensors(records, [], L, torch.float32)
    C.write_shard(directory, 0, tensors, [r["id"] for r in records], {"config_hash": "test", "dropped": {}})
    header = {"config_hash": "test", "base": identity.to_dict(), "final_layer": L, "layers": [],
              "hidden_size": identity.hidden_size, "pad_id": PAD, "split": directory.name}
    assert C.write_manifest(directory, 1, header) is not None


@pytest.mark.parametrize("loss", ["ctc", "ce"])
def test_train_cli_path_and_lossless_export(tiny_base, tmp_path, loss):
    from train.run import train

    model, tok, identity = tiny_base
    cache = tmp_path / "cache"
    records = _records(model, 8, 1, "tr")
    _write_split(cache / "train", records, identity)
    # validation on training conversations: 30 steps on 8 conversations cannot generalise, but
    # memorising them must raise sim_tau, which checks the metric and best-checkpoint plumbing.
    _write_split(cache / "val", [dict(r, id=f"va{i}") for i, r in enumerate(records[:4])], identity)
    cfg = compose(["heads=ctc", f"heads.loss={loss}", "heads.attn_implementation=eager", "train.logger=csv",
                   "train.progress_bar=false", "train.sanity_val_steps=0", f"output_root={tmp_path}",
                   f"train.cache_dir={cache}", "train.run_name=t", "train.log_every_n_steps=1",
                   "train.accelerator=cpu", "train.devices=1", "train.scheduler.warmup_steps=2",
                   "train.optimizer.lr=0.01", "train.batch_size=4", "train.max_steps=30",
                   "train.val_every_n_steps=10"])
    result = train(cfg, base=tiny_base)
    run_dir = result["run_dir"]
    rows = list(csv.DictReader(open(metrics_csv(run_dir))))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    taus = [float(r["val/sim_tau"]) for r in rows if r.get("val/sim_tau")]
    assert len(taus) == 3 and all(1.0 <= t <= 7.0 for t in taus)
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])
    from data_prep.cache import CacheReader, collate

    reader = CacheReader(cache / "val")
    val_batch = collate([reader[i] for i in range(len(reader))], PAD)
    untrained = heads.build(cfg.heads, model).validation_metrics(val_batch)["sim_tau"]
    assert taus[-1] > float(untrained[0] / untrained[1]) + 1.0
    assert float(result["checkpoint_callback"].best_model_score) == pytest.approx(max(taus))
    head, meta = heads.load(run_dir / "best", base_model=model)
    assert meta["head_type"] == "ctc" and meta["head"]["loss"] == loss
    head.eval()
    dec = SpeculativeDecoder(model, head.make_drafter(model), eos_token_ids=[])
    for r in _records(model, 2, 3, "te"):
        prompt = r["input_ids"][~r["loss_mask"]]
        ref, _ = greedy_generate(model, prompt, 16, eos_token_ids=[])
        out, stats = dec.generate(prompt, 16)
        assert out == ref
    if loss == "ctc":  # the evaluation entry point on the exported checkpoint (parity + report)
        import json

        from evaluation.runner import run_evaluation

        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"id": f"q{i}", "turns": [t]}) + "\n"
                                   for i, t in enumerate(["Hello! How can I help you today?", "def add(a, b):"])))
        ecfg = compose(["heads=ctc", f"eval.checkpoint={run_dir / 'best'}", f"eval.prompts={prompts}",
                        "eval.max_new_tokens=12", "eval.warmup=0", f"eval.output_dir={tmp_path / 'eval'}",
                        "eval.topk=[4,3,2]", "eval.max_nodes=16"])
        report = run_evaluation(ecfg, base=tiny_base)
        assert report["parity"]["matched"] == report["parity"]["total"] == 2


def test_sweep_yaml_parameters_are_valid_config():
    """configs/sweeps/ctc.yaml: every swept key is a real config key, every value combination
    passes validation, and the agent's argument list (${args_no_hyphens}) parses in the CLI."""
    import itertools

    import yaml

    from train.__main__ import main  # noqa: F401  (the CLI module the sweep runs)

    sweep = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "sweeps" / "ctc.yaml").read_text())
    assert sweep["command"][-1] == "${args_no_hyphens}" and sweep["command"][1:5] == ["python", "-m", "train", "heads=ctc"]
    assert sweep["metric"]["name"] == "val/sim_tau"
    keys = list(sweep["parameters"])
    assert {"heads.slots", "heads.targets", "heads.aux_weight"} <= set(keys)
    for combo in itertools.product(*[sweep["parameters"][k]["values"] for k in keys]):
        args = [f"{k}={v}" for k, v in zip(keys, combo)]  # what ${args_no_hyphens} expands to
        cfg = compose(["heads=ctc", *args])
        for k, v in zip(keys, combo):
            assert cfg.heads[k.split(".", 1)[1]] == v
