"""Run inside the engines venv (scripts/engines_setup.sh) by tests/test_engines.py; imports only
the engines and torch, never draftheads.

``python tests/engines_worker.py speculators EXPORT_DIR INPUTS.safetensors RESULT.safetensors``

Loads the export with speculators' own loader (``SpeculatorModel.from_pretrained``, the class
its config names) and runs its ``forward`` on the inputs draftheads computed (``hidden_states``
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

    x = load_file(inputs_path)
    model, info = SpeculatorModel.from_pretrained(export_dir, output_loading_info=True)
    model = model.float().eval()
    captured = []
    model.lm_head.register_forward_hook(lambda mod, inp, out: captured.append(out.detach().clone()))
    with torch.no_grad():
        model(hidden_states=x["hidden_states"].float(), input_ids=x["input_ids"],
              document_ids=torch.zeros_like(x["input_ids"]), position_ids=x["position_ids"],
              ttt_steps=int(x["ttt_steps"]))
    out = {f"logits_step{i}": t.float().contiguous() for i, t in enumerate(captured)}
    out["embed_tokens"] = model.embed_tokens.weight.detach().contiguous()
    meta = {"class": type(model).__name__, "speculators": md.version("speculators"),
            "missing_keys": sorted(info.get("missing_keys", [])), "unexpected_keys": sorted(info.get("unexpected_keys", [])),
            "mismatched_keys": [list(map(str, k)) for k in info.get("mismatched_keys", [])],
            "layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids or []),
            "verifier": model.config.speculators_config.verifier.name_or_path,
            "attn_implementation": getattr(model.config.transformer_layer_config, "_attn_implementation", None)}
    save_file(out, result_path, metadata={"info": json.dumps(meta)})
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "speculators":
        sys.exit(__doc__)
    sys.exit(speculators_logits(*sys.argv[2:]))
