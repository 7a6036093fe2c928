"""SGLang's loader expectations, read from its source for the versions the ``sglang`` export
targets (issue 30): ``pytest -m engines``.  SGLang cannot be installed for this CPU (CUDA stack;
its CPU backend needs AMX and a source build), so ``scripts/engines_setup.sh`` unpacks the
relevant files of each release's wheel under ``$DRAFTHEADS_ENGINES_VENV/sglang-src/<version>/``
and this test reads them, then loads the export *the way that source does*:

* ``set_eagle3_layers_to_capture``: which hs layers the target captures for the config's ids
  (≥ 0.4.9: ``[id + 1 for id in layer_ids]`` captured at the input of layer id + 1; 0.4.8: no
  ids, the default layers);
* ``model_runner``: where the ids are read (``eagle_config["eagle_aux_hidden_state_layer_ids"]``);
* ``LlamaForCausalLMEagle3.load_weights``: its ``stacked_params_mapping`` (q/k/v → qkv_proj,
  gate/up → gate_up_proj), the ``model.`` prefix rule, ``d2t`` → ``hot_token_id`` = d2t + arange,
  ``t2d`` skipped, and names with no parameter dropped without a word; the ``fc`` bias rule.

The export must then fill every parameter of SGLang's draft model (but ``embed_tokens``, which
the EAGLE-3 worker replaces by the target's) with the right shape, drop no tensor, and the layers
SGLang captures must be the head's, so the draft logits computed from those layers are the head's.
"""
from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_eagle3_export import LAYERS, _draftheads_eagle3, _save, _sharpen, read_eagle3

pytestmark = pytest.mark.engines

SRC = Path(os.environ.get("DRAFTHEADS_ENGINES_VENV", "/work/venvs/engines")) / "sglang-src"
TARGETED = ("0.4.9", "0.5.5", "0.5.23")  # heads.export_engines.SGLANG_SOURCES_READ
NOT_SERVED = ("0.4.8",)


def _src(version: str, rel: str) -> str:
    p = SRC / version / "sglang" / "srt" / rel
    if not p.is_file():
        pytest.fail(f"{p} missing: run `bash scripts/engines_setup.sh` (it unpacks SGLang {version}'s source)")
    return p.read_text()


def _function(source: str, name: str) -> ast.FunctionDef:
    hits = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert hits, f"no function {name}"
    return hits[-1]


def capture_rule(version: str):
    """``ids -> hs layers captured`` as SGLang ``version`` runs it, from its source."""
    llama = _src(version, "models/llama.py")
    fn = _function(llama, "set_eagle3_layers_to_capture")
    body = ast.get_source_segment(llama, fn)
    assert "[2, num_layers // 2, num_layers - 3]" in body  # the default (no ids)
    # the capture point: before decoder layer i runs (its input = hs[i])
    assert re.search(r"if i in self\.layers_to_capture:\s*\n\s*aux_hidden_states\.append\(hidden_states \+ residual\)", llama) \
        or re.search(r"capture_output=aux_hidden_states\.capture\s*\n\s*if i in self\.layers_to_capture", llama), version
    takes_ids = len(fn.args.args) > 1
    if not takes_ids:
        return None
    assert "[val + 1 for val in layer_ids]" in body, f"SGLang {version} changed its layer-id rule"
    runner = _src(version, "model_executor/model_runner.py")
    comp = SRC / version / "sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py"
    reader = runner + (comp.read_text() if comp.is_file() else "")
    assert re.search(r'eagle_config\[\s*"eagle_aux_hidden_state_layer_ids"\s*\]', reader), version
    return lambda ids: [i + 1 for i in ids]


def sglang_load(version: str, out: Path):
    """Emulate ``LlamaForCausalLMEagle3.load_weights`` of ``version`` on the export: ``(params,
    loaded, dropped, hot_token_id)`` with params = name -> expected shape."""
    src = _src(version, "models/llama_eagle3.py")
    cfg = json.loads((out / "config.json").read_text())
    fn = _function(src, "load_weights")
    seg = ast.get_source_segment(src, fn)
    mapping = next(ast.literal_eval(n.value) for n in ast.walk(fn) if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", None) == "stacked_params_mapping")
    assert 'f"model.{name}" if name not in params_dict else name' in seg or \
        'name if name in params_dict else f"model.{name}"' in seg
    assert 'bias=getattr(config, "bias", False)' in src  # fc bias follows the config's `bias`
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) if "num_aux_hidden_states" in src else 3
    fc_bias = bool(cfg.get("bias", False))
    params = {"model.embed_tokens.weight": (V, H), "model.fc.weight": (H, cfg.get("target_hidden_size", H) * n_aux),
              "model.midlayer.self_attn.qkv_proj.weight": ((nh + 2 * nkv) * hd, 2 * H),
              "model.midlayer.self_attn.o_proj.weight": (H, nh * hd),
              "model.midlayer.mlp.gate_up_proj.weight": (2 * I, H), "model.midlayer.mlp.down_proj.weight": (H, I),
              "model.midlayer.input_layernorm.weight": (H,), "model.midlayer.hidden_norm.weight": (H,),
              "model.midlayer.post_attention_layernorm.weight": (H,), "model.norm.weight": (H,),
              "lm_head.weight": (cfg["draft_vocab_size"], H)}
    if fc_bias:
        params["model.fc.bias"] = (H,)
    shard_rows = {"q": nh * hd, "k": nkv * hd, "v": nkv * hd, 0: I, 1: I}
    loaded, dropped, hot = {}, [], None
    for name, w in load_file(out / "model.safetensors").items():
        if "d2t" in name:
            hot = w + torch.arange(w.shape[0])
            continue
        if "t2d" in name:
            continue
        for param_name, weight_name, shard in mapping:
            if weight_name not in name:
                continue
            name2 = name.replace(weight_name, param_name)
            pn = f"model.{name2}" if name2 not in params else name2
            if pn in params:
                assert tuple(w.shape) == (shard_rows[shard], params[pn][1]), (name, tuple(w.shape))
                loaded.setdefault(pn, 0)
                loaded[pn] += w.shape[0]
            else:
                dropped.append(name)
            break
        else:
            pn = name if name in params else f"model.{name}"
            if pn in params:
                assert tuple(w.shape) == params[pn], (name, tuple(w.shape), params[pn])
                loaded[pn] = w.shape[0]
            else:
                dropped.append(name)
    return params, loaded, dropped, hot


@pytest.mark.parametrize("version", TARGETED)
def test_sglang_loads_the_export_as_its_source_does(tiny_base, tmp_path, version):
    import heads
    from heads.export import export

    base, _, identity = tiny_base
    head = heads.build({"type": "eagle3", "layers": LAYERS}, base)
    _sharpen(head)
    out = export(_save(head, base, tmp_path / "ckpt", identity), "sglang", tmp_path / "out")
    params, loaded, dropped, hot = sglang_load(version, out)
    assert dropped == [], f"SGLang {version} would silently drop {dropped}"
    unfilled = sorted(set(params) - set(loaded) - {"model.embed_tokens.weight"})  # embed: set_embed(target's)
    assert unfilled == [], f"SGLang {version} would leave {unfilled} at their initial values"
    for pn, rows in loaded.items():  # stacked shards add up to the fused parameter
        assert rows == params[pn][0], pn
    assert torch.equal(hot, head.to_base_ids(torch.arange(head.num_draft_tokens)))
    cfg = json.loads((out / "config.json").read_text())
    rule = capture_rule(version)
    assert rule(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == head.layers
    # draft logits from the layers SGLang captures equal the head's
    ids = torch.randint(3, 300, (10,), generator=torch.Generator().manual_seed(5))
    got, want = read_eagle3(out, base, ids, "sglang"), _draftheads_eagle3(head, base, ids)
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-4, atol=1e-4)
    worker = _src(version, "speculative/eagle_worker_v2.py" if version >= "0.5.23" else "speculative/eagle_worker.py")
    assert "set_embed(embed)" in worker  # the draft's embedding is the target's


@pytest.mark.parametrize("version", NOT_SERVED)
def test_sglang_before_0_4_9_cannot_serve_the_export(tiny_base, tmp_path, version):
    """0.4.8: no layer ids (always the default layers) and an fc with a bias the export lacks:
    what the export's metadata says (not a target)."""
    import heads
    from heads.export import export

    assert capture_rule(version) is None
    src = _src(version, "models/llama_eagle3.py")
    assert re.search(r"self\.fc = torch\.nn\.Linear\(config\.target_hidden_size \* 3, config\.hidden_size\)", src)
    base, _, identity = tiny_base
    out = export(_save(heads.build({"type": "eagle3", "layers": LAYERS}, base), base, tmp_path / "c", identity),
                 "sglang", tmp_path / "o")
    assert "fc.bias" not in load_file(out / "model.safetensors")
    assert f"not 0.4.6 - {version}" in json.loads((out / "config.json").read_text())["draftheads"]["engines"]["sglang"]["versions"]
