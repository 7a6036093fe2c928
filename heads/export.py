"""Export a trained head to the layouts serving engines load.

``python -m heads.export CKPT --format sglang|vllm|speculators|eagle1 OUT [--base MODEL_PATH] [--verifier HF_FOLDER_OR_HUB_ID]``

Reads ``CKPT/config.json`` and ``CKPT/model.safetensors`` (written by :func:`heads.save`) and,
for ``vllm``/``speculators``, the base's token embedding (one tensor of its HF folder), and
writes ``OUT/config.json`` + ``OUT/model.safetensors`` atomically (a temporary directory renamed
into place; an existing non-empty ``OUT`` is refused).  Head weights are written in fp32, the
embedding in the base's own dtype (bit-identical).  Every check (format, head type, base,
verifier, embedding) runs before anything is written.  ``config.json["draftheads"]["engines"]``
states, per engine, the versions the export targets, its layer-id rule, how the embedding is
handled and the dtype it runs in (:mod:`heads.export_engines`, which also holds the facts read
from each engine's source).  ``tests/test_eagle3_export.py`` rebuilds each drafter from the
exported files alone the way each engine's loader reads them; ``tests/test_engines.py``
(``pytest -m engines``) runs vLLM and speculators on the exports.

Formats
-------
``sglang`` (EAGLE-3 head) — SGLang ``python/sglang/srt/models/llama_eagle3.py``
(``LlamaForCausalLMEagle3``, ``LlamaModel``, ``load_weights``):
    config: ``architectures: [LlamaForCausalLMEagle3]``, the Llama layer dims, ``num_hidden_layers:
    1``, ``vocab_size`` V, ``draft_vocab_size`` N, ``target_hidden_size`` H (fc input = 3·H),
    ``bias: false`` (SGLang builds ``fc`` with ``bias=getattr(config, "bias", False)``),
    ``tie_word_embeddings: false``, and ``eagle_config.eagle_aux_hidden_state_layer_ids`` =
    [ℓ−1 for the head's hs ids ℓ] (SGLang ≥ 0.4.9's ``set_eagle3_layers_to_capture`` adds 1: an id
    names a layer's *output*; 0.4.6–0.4.8 ignore ids and build ``fc`` with a bias: not targets).  The
    top-level ``eagle_aux_hidden_state_layer_ids`` = the hs ids ℓ is written too: vLLM, which also
    serves this layout, reads that key first and captures the *input* of layer ℓ (with only
    ``eagle_config``'s ids it would read every feature one layer early).  Weights: ``midlayer.self_attn.{q,k,v,o}_proj.weight``,
    ``midlayer.mlp.{gate,up,down}_proj.weight``, ``midlayer.{input_layernorm,hidden_norm,
    post_attention_layernorm}.weight``, ``fc.weight`` [H, 3H], ``norm.weight``, ``lm_head.weight``
    [N, H], ``d2t`` [N] int64 (target id = d + d2t[d]), ``t2d`` [V] bool.  No ``embed_tokens``:
    the engine shares the target's embedding.  SGLang has no ``norm_before_residual`` switch,
    so a head trained with it is refused for this format.
``vllm`` = ``speculators`` (EAGLE-3 head) — vllm-project/speculators ``src/speculators/models/eagle3/config.py``
(``Eagle3SpeculatorConfig``) as read by vLLM ``vllm/transformers_utils/configs/speculators/algos.py``
(``update_eagle3``) and ``vllm/model_executor/models/llama_eagle3.py`` (``load_weights``):
    config: ``speculators_model_type: eagle3``, ``architectures: [Eagle3Speculator]``,
    ``transformer_layer_config`` (a Llama config, 1 layer, vocab V), ``draft_vocab_size``,
    ``target_hidden_size``, ``norm_before_residual`` (always written: vLLM defaults a missing one
    to **true**, EAGLE-3's layer is false), ``eagle_aux_hidden_state_layer_ids`` = the hs ids ℓ
    (vLLM captures the input of layer ℓ), ``speculators_config`` {``algorithm``,
    ``proposal_methods`` [greedy, ``speculative_tokens`` = ``ttt_steps``],
    ``default_proposal_method``, ``verifier`` {``name_or_path``, ``architectures``}}: ``name_or_path``
    is an absolute HF folder or a hub id (``--verifier``; default ``--base``, else the training
    base; a GGUF becomes its converted folder under ``~/.cache/draftheads/models``), never a GGUF
    or relative path (speculators loads it with ``AutoConfig``).  Weights as ``sglang`` with the
    prefix ``layers.0.`` instead of ``midlayer.`` (vLLM maps both) and no ``d2t``/``t2d`` for a
    full-vocabulary head (both engines build no mapping then), plus ``embed_tokens.weight``
    [V, H], the base's embedding bit for bit (speculators reads the embedding from the export
    only; vLLM finds it equal to the target's and shares the target's).
``eagle1`` (Falcon with ``block_size: 1`` and ``fuse: linear``, i.e. ``heads=falcon_k1``) —
SGLang ``python/sglang/srt/models/llama_eagle.py`` (``LlamaForCausalLMEagle``):
    config: ``architectures: [LlamaForCausalLMEagle]``, the Llama dims, ``num_hidden_layers`` D,
    ``bias: true`` written explicitly (SGLang builds ``fc = Linear(2H, H)`` with a bias; the
    exported ``fc.bias`` must exist), ``tie_word_embeddings: false``.  Weights: ``fc.weight``
    [H, 2H] over [Emb(x) ; f] and ``fc.bias`` [H], ``layers.{i}.*`` (HF Llama decoder keys; layer
    0 has no ``input_layernorm``, as EAGLE's ``cnets.py`` and SGLang skip it).  No final norm and
    no LM head: the target's LM head reads the drafter output.  A head with a draft vocabulary also
    writes :data:`HOT_TOKENS_FILE` (its ``d2t``, base ids; ``config["draftheads"]["draft_vocab"]``
    names it): the format drafts over the full vocabulary unless the engine restricts it (SGLang's
    FR-Spec ``--speculative-token-map``).

Other heads (Falcon k ≥ 2, LSTM fuse, CTC, AdaDecode) have no engine format: a one-line error
names the formats that exist.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import torch

FORMATS = ("sglang", "vllm", "speculators", "eagle1")
VERIFIER_FORMATS = ("vllm", "speculators")  # the formats whose config records the verifier (speculators_config)
#: an ``eagle1`` export of a head with a draft vocabulary writes its base ids here (JSON ``hot_token_ids``)
HOT_TOKENS_FILE = "hot_token_ids.json"
#: formats holding speculators' Eagle3SpeculatorConfig layout (one layout, named by either engine)
SPECULATORS_LAYOUT = ("vllm", "speculators")
_FORMAT_HEADS = ("sglang, vllm, speculators (heads=eagle3); eagle1 (heads=falcon_k1: falcon with block_size=1, "
                 "fuse=linear)")
_LLAMA_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "rope_theta",
               "rope_scaling", "attention_bias", "mlp_bias", "initializer_range")


class ExportError(ValueError):
    """A checkpoint that cannot be exported in the requested format (the message says why)."""


def _llama_dims(base_config: dict[str, Any]) -> dict[str, Any]:
    out = {k: base_config[k] for k in _LLAMA_KEYS if base_config.get(k) is not None}
    rp = out.get("rope_parameters")
    if "rope_theta" not in out and isinstance(rp, dict) and "rope_theta" in rp:
        out["rope_theta"] = rp["rope_theta"]  # engines on older transformers read rope_theta
    out.setdefault("head_dim", int(base_config["hidden_size"]) // int(base_config["num_attention_heads"]))
    out.setdefault("num_key_value_heads", base_config["num_attention_heads"])
    return out


def read_checkpoint(ckpt: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(meta, state)`` from ``config.json`` + ``model.safetensors`` (no pickle, no base model).

    Raises:
        FileNotFoundError: a file is missing.  ExportError: not a draftheads checkpoint.
    """
    from safetensors.torch import load_file

    from heads.registry import check_checkpoint_dir

    ckpt = check_checkpoint_dir(ckpt)
    meta = json.loads((ckpt / "config.json").read_text())
    for key in ("head_type", "head", "base", "base_config"):
        if key not in meta:
            raise ExportError(f"{ckpt / 'config.json'} has no {key!r}: not a draftheads head checkpoint")
    return meta, load_file(ckpt / "model.safetensors")


def check_base(meta: dict[str, Any], base: str | None, flag: str = "--base") -> None:
    """Refuse an export for a base other than the one the head was trained for.

    ``base``: a ``model.path`` (HF folder, hub id available offline, or ``.gguf``); None skips
    the check.  Compared: architecture, vocab size, hidden size, layer count and, when both
    sides have it, the GGUF sha256 and the weights' content SHA-256
    (:func:`core.weights_digest.weights_sha256`: a base of the same shape but other weights is
    refused, as training and evaluation refuse it).  ``flag`` names the option in messages.

    Raises:
        ExportError: a mismatch (names the field and both values), or ``base`` is not a model (a
            missing path, a folder without a model config; named, in one line).
    """
    if base is None:
        return
    from transformers import AutoConfig

    from core.base_model import resolve_model_dir

    try:
        load_path, _, sha = resolve_model_dir({"path": base})
        cfg = AutoConfig.from_pretrained(load_path, trust_remote_code=False)
    except FileNotFoundError as exc:
        if not Path(base).expanduser().exists():
            raise ExportError(f"{flag} {base}: no such file or folder") from None
        raise ExportError(f"{flag} {base}: not a Hugging Face model folder or GGUF file ({exc})") from None
    except (OSError, ValueError) as exc:  # transformers: no config.json, no model_type, a hub id offline
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ExportError(f"{flag} {base}: not a Hugging Face model folder or GGUF file ({first})") from None
    have = {"vocab_size": int(cfg.vocab_size), "hidden_size": int(cfg.hidden_size),
            "num_hidden_layers": int(cfg.num_hidden_layers)}
    if cfg.architectures:  # a config without it names no class to compare with the training base's
        have = {"architecture": cfg.architectures[0], **have}
    trained = meta["base"]
    for key, value in have.items():
        if key in trained and trained[key] != value:
            raise ExportError(f"{flag} {base}: {key}={value!r}, but the head was trained for {trained.get('source')!r} "
                              f"with {key}={trained[key]!r}")
    if sha and trained.get("sha256") and sha != trained["sha256"]:
        raise ExportError(f"{flag} {base}: GGUF sha256 {sha[:12]}… differs from the training base's {trained['sha256'][:12]}…")
    if trained.get("weights_sha256"):
        from core.base_model import default_cache_dir, weights_folder
        from core.weights_digest import weights_sha256

        folder = weights_folder(load_path)
        got = weights_sha256(folder, Path(default_cache_dir())) if folder else None
        if got is not None and got != trained["weights_sha256"]:
            raise ExportError(f"{flag} {base}: its weights (sha256 {got[:12]}…) are not the training base's "
                              f"({trained['weights_sha256'][:12]}…, {trained.get('source')!r}); a head drafts for the "
                              "weights it was trained on")


def _eagle3_weights(meta, state, prefix: str, mapping_if_full: bool = True) -> dict[str, torch.Tensor]:
    """The EAGLE-3 tensors under the engines' names.  ``mapping_if_full=False`` (speculators
    layout): no ``d2t``/``t2d`` for a full-vocabulary head, since speculators and vLLM build no
    mapping when ``draft_vocab_size`` = V (speculators reports them unexpected; vLLM has no
    parameter to load them into)."""
    from heads.draft_vocab import d2t_offsets, t2d_mask

    V = int(meta["base"]["vocab_size"])
    # absolute base ids per draft index: the shared ``d2t`` buffer (DraftHead), arange(V) without a draft vocabulary
    ids = state["d2t"].long() if "d2t" in state else torch.arange(V, dtype=torch.int64)
    out = {"fc.weight": state["fc.weight"], "norm.weight": state["norm.weight"],
           "lm_head.weight": state["trainable_lm_head.weight"]}
    if mapping_if_full or ids.numel() != V:
        out.update(d2t=d2t_offsets(ids),  # the engines' offsets: target id = d + d2t[d]
                   t2d=t2d_mask(ids, V))
    for k, v in state.items():
        if k.startswith("midlayer."):
            out[prefix + k[len("midlayer."):]] = v
    return out


def _eagle3_config(meta) -> dict[str, Any]:
    head, bc = meta["head"], meta["base_config"]
    N = int(head.get("draft_vocab_size") or meta["base"]["vocab_size"])
    return {**_llama_dims(bc), "model_type": "llama", "num_hidden_layers": 1, "vocab_size": int(meta["base"]["vocab_size"]),
            "draft_vocab_size": N, "target_hidden_size": int(bc["hidden_size"]), "tie_word_embeddings": False}


def build_export(meta: dict[str, Any], state: dict[str, torch.Tensor], fmt: str,
                 engine_inputs: Callable[[], tuple[str, torch.Tensor]] | None = None,
                 ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config, tensors)`` of format ``fmt`` for a checkpoint (module docstring).

    ``engine_inputs() -> (verifier, embedding)`` is required for ``vllm`` / ``speculators`` and
    called once the head checks passed: the verifier (an absolute HF folder or hub id,
    :func:`heads.export_engines.resolve_verifier`) and the base's token embedding [V, H].
    ``config["draftheads"]["engines"]`` is filled for the EAGLE-3 formats.

    Raises:
        ExportError: unknown format, the head has no such format, or a ``vllm``/``speculators``
            export without ``engine_inputs``.
    """
    from heads.export_engines import engine_metadata

    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: formats are {', '.join(FORMATS)}")
    head_type, head = meta["head_type"], meta["head"]
    if fmt in ("sglang",) + SPECULATORS_LAYOUT:
        if head_type != "eagle3":
            raise ExportError(f"--format {fmt} exports an eagle3 head; this checkpoint holds a {head_type!r} head "
                              f"(formats: {_FORMAT_HEADS})")
        layers = [int(x) for x in head["layers"]]
        cfg = _eagle3_config(meta)
        if fmt == "sglang":
            if head.get("norm_before_residual"):
                raise ExportError("--format sglang: SGLang's LlamaForCausalLMEagle3 takes the residual before "
                                  "hidden_norm; this head was trained with norm_before_residual=true (use --format vllm)")
            if "midlayer.self_attn.q_proj.bias" in state:
                raise ExportError("--format sglang: SGLang's LlamaForCausalLMEagle3 builds qkv_proj without a bias; "
                                  "this head's attention has one (use --format vllm)")
            cfg.update(architectures=["LlamaForCausalLMEagle3"], bias=False,
                       eagle_config={"eagle_aux_hidden_state_layer_ids": [l - 1 for l in layers],
                                     "use_aux_hidden_state": True},
                       eagle_aux_hidden_state_layer_ids=layers,  # vLLM reads this key first (hs ids)
                       draftheads={"engines": engine_metadata(fmt, layers, None)})
            return cfg, _eagle3_weights(meta, state, "midlayer.")
        if engine_inputs is None:
            raise ExportError(f"--format {fmt}: needs the verifier (an HF folder or hub id) and the base's embedding")
        verifier, embedding = engine_inputs()
        layer_cfg = {k: v for k, v in cfg.items() if k not in ("draft_vocab_size", "target_hidden_size")}
        layer_cfg["architectures"] = ["LlamaForCausalLM"]
        out = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": layer_cfg, "draft_vocab_size": cfg["draft_vocab_size"],
               "target_hidden_size": cfg["target_hidden_size"], "norm_before_residual": bool(head.get("norm_before_residual")),
               "eagle_aux_hidden_state_layer_ids": layers,
               "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                      "proposal_methods": [{"proposal_type": "greedy",
                                                            "speculative_tokens": int(head["ttt_steps"]),
                                                            "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                      "verifier": {"name_or_path": verifier,
                                                   "architectures": [meta["base"].get("architecture")]}},
               "dtype": "float32",
               "draftheads": {"engines": engine_metadata(fmt, layers, verifier)}}
        tensors = _eagle3_weights(meta, state, "layers.0.", mapping_if_full=False)
        tensors["embed_tokens.weight"] = embedding
        return out, tensors
    # eagle1
    if head_type != "falcon" or int(head.get("block_size", 0)) != 1 or head.get("fuse") != "linear":
        what = head_type if head_type != "falcon" else f"falcon (block_size={head.get('block_size')}, fuse={head.get('fuse')})"
        raise ExportError(f"--format eagle1 exports Falcon with block_size=1 and fuse=linear; this checkpoint holds {what} "
                          f"(formats: {_FORMAT_HEADS})")
    if "fc.bias" not in state:
        raise ExportError("--format eagle1: the checkpoint has no fc.bias, but the EAGLE-1 layout's fc has a bias")
    bc = meta["base_config"]
    cfg = {**_llama_dims(bc), "architectures": ["LlamaForCausalLMEagle"], "model_type": "llama",
           "num_hidden_layers": int(head["num_layers"]), "vocab_size": int(meta["base"]["vocab_size"]),
           "bias": True, "tie_word_embeddings": False}
    tensors = {k: v for k, v in state.items() if k.startswith(("fc.", "layers."))}
    if "d2t" in state:  # the format has no draft vocabulary: carried as FR-Spec's hot-token list beside it
        ids = [int(t) for t in state["d2t"].tolist()]
        cfg["draftheads"] = {"draft_vocab": {
            "size": len(ids), "file": HOT_TOKENS_FILE, "hot_token_ids": ids,
            "note": "trained and evaluated drafting over these base ids only; the EAGLE-1 format drafts over the "
                    "target's full vocabulary unless the engine restricts it (SGLang: --speculative-token-map, "
                    "FR-Spec; docs/exports.md)"}}
    return cfg, tensors


def export(ckpt: str | os.PathLike, fmt: str, out: str | os.PathLike, base: str | None = None,
           verifier: str | None = None) -> Path:
    """Write ``out/config.json`` and ``out/model.safetensors`` in format ``fmt`` (module docstring).

    ``base``: the serving target's ``model.path`` (checked against the training base);
    ``verifier``: what ``vllm``/``speculators`` exports record as the verifier (an HF folder,
    made absolute, or a hub id; default ``base``, else the training base).

    Raises:
        FileNotFoundError / ExportError: see :func:`read_checkpoint`, :func:`check_base`,
        :func:`build_export`; ExportError also when ``out`` exists and is not an empty directory,
        the verifier / the base's embedding cannot be resolved, or a weight holds NaN / ±inf (names the
        tensor).  Nothing is written before every check passed.
    """
    from core.io import atomic_save_safetensors, make_tmp_dir, output_dir_problem, replace_dir
    from heads.export_engines import VerifierError, base_embedding, resolve_verifier

    out = Path(out).expanduser().resolve()  # "." or "..": a name to write a sibling temporary folder beside
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: formats are {', '.join(FORMATS)}")
    if verifier is not None and fmt not in VERIFIER_FORMATS:  # it would be ignored: the export records no verifier
        raise ExportError(f"--verifier applies to --format {' or '.join(VERIFIER_FORMATS)} only; a --format {fmt} "
                          "export records no verifier (the serving engine is given the target model itself)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"output {out} exists and is not an empty directory")
    problem = output_dir_problem(out)
    if problem is not None:
        raise ExportError(f"output {out} cannot be written: {problem}")
    meta, state = read_checkpoint(ckpt)
    check_base(meta, base)
    if verifier is not None and Path(verifier).expanduser().exists():  # a local verifier is the base the engine runs
        check_base(meta, verifier, "--verifier")
    elif verifier is not None:
        print(f"warning: --verifier {verifier} is not a local folder: it is recorded as given, not checked against the "
              f"training base {meta['base'].get('source')!r}", file=sys.stderr)

    def engine_inputs() -> tuple[str, torch.Tensor]:
        try:
            ver = resolve_verifier(meta, base, verifier)
            # the embedding comes from local files: the verifier's folder, else --base, else the training base
            local = ver if Path(ver).is_dir() else resolve_verifier(meta, base, None)
            emb = base_embedding(local, int(meta["base"]["vocab_size"]), int(meta["base"]["hidden_size"]))
        except VerifierError as exc:
            raise ExportError(str(exc)) from None
        return ver, emb

    cfg, tensors = build_export(meta, state, fmt, engine_inputs=engine_inputs)
    cfg.setdefault("draftheads", {}).update(source_checkpoint=str(Path(ckpt).resolve()), head_type=meta["head_type"],
                                            format=fmt)
    from core.finite import NonFiniteError, check_finite

    try:  # a non-finite weight is never handed to a serving engine
        check_finite(tensors, f"export of {ckpt}")
    except NonFiniteError as exc:
        raise ExportError(str(exc)) from None
    tmp = make_tmp_dir(f".{out.name}.", out.parent if str(out.parent) else ".")
    try:
        tensors = {k: (v if k == "embed_tokens.weight" or not v.is_floating_point() else v.float()).contiguous()
                   for k, v in tensors.items()}
        # readable as config.json is (0666 & ~umask: safetensors' own save_file leaves 0600, which an engine
        # running as another user cannot read), and byte-deterministic
        atomic_save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        vocab = cfg["draftheads"].get("draft_vocab")
        if vocab is not None and "hot_token_ids" in vocab:  # the list goes to its own file, config.json names it
            ids = vocab.pop("hot_token_ids")
            (tmp / vocab["file"]).write_text(json.dumps({"hot_token_ids": ids, "size": len(ids)}) + "\n")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        replace_dir(tmp, out)  # out, when it exists, is an empty folder (checked above)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI; exit 0 on success, 2 with a one-line error on bad input."""
    p = argparse.ArgumentParser(prog="python -m heads.export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="head checkpoint dir (model.safetensors + config.json)")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--base", default=None, help="model.path of the serving target: refused unless it matches the training base")
    p.add_argument("--verifier", default=None,
                   help="vllm/speculators: the verifier to record (HF folder or hub id); default --base, else the training base")
    args = p.parse_args(argv)
    try:
        path = export(args.checkpoint, args.format, args.out, base=args.base, verifier=args.verifier)
    except (ValueError, OSError) as exc:  # ExportError, a checkpoint that is not one (heads.registry), JSON
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
