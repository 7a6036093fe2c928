"""RoPE's inverse frequencies stay fp32 through every module cast (core.rope; transformers issue 29496).

A plain ``.to(torch.bfloat16)`` rounds ``inv_freq``; ``from_pretrained(dtype=torch.bfloat16)`` does not.
Online features (a cast copy of the base) must equal the cache's (a base loaded in bf16), and a head
evaluated in bf16 must rotate with the angles it was trained with."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import heads
from core.config import compose
from core.rope import ROPE_BUFFERS, RotaryEmbedding, cast_module

T = 256  # positions: the rounding of inv_freq moves the angle by up to p * 2**-9 rad


def _hidden(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, output_hidden_states=True).hidden_states


def _rope(module):
    return {f"{m}.{n}": b for m, sub in module.named_modules() for n, b in sub._buffers.items() if n in ROPE_BUFFERS}


def test_cast_base_equals_the_base_loaded_in_bf16_and_a_plain_cast_does_not(tiny_base, tiny_model_dir):
    """The cast copy online training runs (train.online.BaseFeatures) gives the hidden states of the base
    data prep loads with from_pretrained(dtype=bf16), bit for bit, at every layer; ``.to`` alone does not."""
    import copy

    from train.online import BaseFeatures
    from transformers import AutoModelForCausalLM

    fp32 = tiny_base[0]
    loaded = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16, attn_implementation="eager").eval()
    assert all(b.dtype == torch.float32 for b in _rope(loaded).values())  # what from_pretrained leaves
    features = BaseFeatures(fp32, layers=[2], storage="bfloat16", compute_dtype="bfloat16").to("cpu")
    assert features.model is not fp32 and fp32.dtype == torch.float32  # the caller's base is not changed
    rope = _rope(features.model)
    assert rope and all(b.dtype == torch.float32 for b in rope.values())
    for name, buf in rope.items():
        assert torch.equal(buf, _rope(fp32)[name])
    ids = torch.randint(0, int(fp32.config.vocab_size), (1, T), generator=torch.Generator().manual_seed(0))
    want = _hidden(loaded, ids)
    got = _hidden(features.model, ids)
    for layer, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), layer
    plain = _hidden(copy.deepcopy(fp32).to(torch.bfloat16), ids)  # the old cast: the test can fail
    assert not torch.equal(plain[-1], want[-1])


def test_rotary_embedding_keeps_fp32_frequencies_through_any_cast(tiny_base):
    """The heads' RotaryEmbedding: ``.to(bf16)``, ``.bfloat16()``, ``.half()`` leave ``inv_freq`` fp32 and
    bit-equal; its bf16 cos/sin are the fp32 ones rounded once, as a bf16 base's are."""
    cfg = tiny_base[0].config
    ref = RotaryEmbedding(cfg)
    inv = ref.inv_freq.clone()
    pos = torch.arange(T)[None]
    cos32, sin32 = ref(torch.zeros(1, T, 8), pos)
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.bfloat16(), lambda m: m.half(),
                 lambda m: m.to(device="cpu", dtype=torch.bfloat16)):
        rot = cast(RotaryEmbedding(cfg))
        assert rot.inv_freq.dtype == rot.original_inv_freq.dtype == torch.float32
        assert torch.equal(rot.inv_freq, inv) and torch.equal(rot.original_inv_freq, inv)
    cos, sin = RotaryEmbedding(cfg).bfloat16()(torch.zeros(1, T, 8, dtype=torch.bfloat16), pos)
    assert torch.equal(cos, cos32.to(torch.bfloat16)) and torch.equal(sin, sin32.to(torch.bfloat16))


@pytest.mark.parametrize("name", ["ctc", "falcon", "falcon_k1", "eagle3"])
def test_a_head_cast_for_a_bf16_evaluation_rotates_as_trained(name, tiny_base):
    """Every head with a rotary embedding, cast as the evaluation casts it (``cast_module`` to the base's
    dtype) or with a plain ``.to``: its RoPE buffers are the fp32 ones it was built (and trained) with."""
    cfg = OmegaConf.to_container(compose([f"heads={name}"]).heads, resolve=True)
    if name == "eagle3":
        cfg["layers"] = [1, 2, 3]  # the tiny base has 4 layers
    head = heads.build(cfg, tiny_base[0])
    before = {k: v.clone() for k, v in _rope(head).items()}
    assert before, name
    for cast in (lambda h: cast_module(h, torch.bfloat16), lambda h: h.to(torch.bfloat16)):
        cast(head)
        assert next(head.parameters()).dtype == torch.bfloat16
        for key, buf in _rope(head).items():
            assert buf.dtype == torch.float32 and torch.equal(buf, before[key]), (name, key)
