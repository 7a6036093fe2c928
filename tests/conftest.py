"""Shared fixtures: a tiny random Llama + ChatML tokenizer written as a local HF folder.

No download happens anywhere in the suite; the one end-to-end test on the real packaged model
is marked ``slow`` and converts the packaged GGUF once into ``$DRAFTHEADS_CACHE``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: the multi-process tests (DDP, ZeRO, shards, Slurm) run
# more threads than a 2-core machine has, and spinning waiters steal the cores the working threads
# need.  Set before torch loads its OpenMP runtime; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# model.dtype / train.precision = auto resolve from the CPU's bf16 support (core.precision); pin the
# answer to "bf16 instructions, not native" so that auto means fp32 on every machine the suite runs on
# (tests of the detection itself monkeypatch it).
os.environ["DRAFTHEADS_BF16"] = "slow"
# The unit tests use toy-sized tensors: one intra-op thread is faster than two on a 2-core
# machine (no oversubscription when a subprocess test runs alongside).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A local HF folder with a tiny random Llama (4 layers, H=64) and a ChatML BPE tokenizer."""
    from core.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), seed=0)


@pytest.fixture(scope="session")
def tiny_base(tiny_model_dir):
    """``(model, tokenizer, identity)`` loaded through ``core.base_model`` in fp32, frozen."""
    from core.base_model import load_base_model

    return load_base_model({"path": str(tiny_model_dir), "dtype": "float32", "attn_implementation": "eager"})


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def sharegpt(tmp_path):
    """A ShareGPT JSON file of 60 one-turn conversations (``c0`` .. ``c59``): held-out prompts for
    calibration and evaluation tests (``data.path=``)."""
    import json

    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Tell me about topic number {i}."},
                                               {"from": "gpt", "value": "Sure."}]} for i in range(60)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    return path
