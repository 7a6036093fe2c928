"""Run inside the engines venv (scripts/engines_setup.sh) by tests/test_engines.py; imports only
the engines and torch, never draftheads.

``python tests/engines_worker.py speculators EXPORT_DIR INPUTS.safetensors RESULT.safetensors``

Loads the export with speculators' own loader (``SpeculatorModel.from_pretrained``, the class
its config names; missing = the model's state-dict keys the file lacks, less the verifier-only
keys speculators never saves; unexpected = file keys the model has no place for) and runs its ``forward`` on the inputs draftheads computed (``hidden_states``
[1, T, 3H] = the verifier's hs at the export's layer ids, ``input_ids`` [1, T], ``position_ids``
[1, T], ``ttt_steps`` scalar), capturing the draft logits [1, T, N] that its ``lm_head`` produces
at every TTT step.  RESULT holds ``logits_step<i>``, ``embed_tokens`` (the loaded embedding) and
a JSON metadata entry ``info`` with the loader's missing / unexpected keys, the class and version.
"""
from __future__ import annotations

import json
import sys


def speculators_logits(export_dir: str, inputs_path: str, result_path: str) -> int:
    import importlib.metadata as md

    import torch
    from safetensors.torch import load_file, save_file
    from speculators import SpeculatorModel

    from safetensors import safe_open

    x = load_file(inputs_path)
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    # eager attention (speculators' dense-mask path, its ``draft_attn_impl=eager``): its default
    # flex-attention block mask needs lengths in multiples of 128 on CPU
    config = Eagle3SpeculatorConfig.from_pretrained(export_dir)
    config.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(export_dir, config=config).float().eval()
    # the loader's view of the file: the model's state-dict keys against the file's keys, less the
    # keys speculators itself never saves (``_keys_to_ignore_on_save``: verifier-only training buffers)
    with safe_open(f"{export_dir}/model.safetensors", framework="pt") as fh:
        in_file = set(fh.keys())
    wanted = set(model.state_dict()) - set(getattr(model, "_keys_to_ignore_on_save", None) or [])
    info = {"missing_keys": sorted(wanted - in_file), "unexpected_keys": sorted(in_file - set(model.state_dict()))}
    captured = []
    model.lm_head.register_forward_hook(lambda mod, inp, out: captured.append(out.detach().clone()))
    with torch.no_grad():
        model(hidden_states=x["hidden_states"].float(), input_ids=x["input_ids"],
              document_ids=torch.zeros_like(x["input_ids"]), position_ids=x["position_ids"],
              ttt_steps=int(x["ttt_steps"]))
    out = {f"logits_step{i}": t.float().contiguous() for i, t in enumerate(captured)}
    out["embed_tokens"] = model.embed_tokens.weight.detach().contiguous()
    meta = {"class": type(model).__name__, "speculators": md.version("speculators"),
            **info,
            "layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids or []),
            "verifier": model.config.speculators_config.verifier.name_or_path,
            "attn_implementation": getattr(model.config.transformer_layer_config, "_attn_implementation", None)}
    save_file(out, result_path, metadata={"info": json.dumps(meta)})
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "speculators":
        sys.exit(__doc__)
    sys.exit(speculators_logits(*sys.argv[2:]))
