"""Resume for evaluations: ``progress.jsonl`` holds every finished prompt turn's result.

Line 1 is a header ``{"fingerprint", "weights"}`` (:func:`progress_fingerprint`: what determines a
prompt's result; checkpoints identified by the SHA-256 of their weights, never by path); each
further line is one prompt turn's record (vanilla and method tokens, stats, seconds), flushed and
fsynced as it finishes.  ``python -m evaluation.merge`` combines shards' files.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from core.config import to_container
from core.io import atomic_write_text
from decoding.reference import REFERENCE_DRAFTERS


class ResultsMismatch(ValueError):
    """``progress.jsonl`` holds a result decoded for another prompt than this run's under the same id: the
    prompt file changed.  Raised before that prompt is decoded; the evaluation then writes nothing (its
    report, summaries and plots stay those of the results on disk)."""


def check_prompts_unchanged(path: Path, records: dict[str, dict[str, Any]], prompts) -> None:
    """Refuse a resume whose prompts (``.id``, ``.input_ids``) differ from those ``records`` (by id) were
    decoded for; later turns, built from earlier answers, are checked as they are reached.

    Raises:
        ResultsMismatch: naming the first such prompt.
    """
    for p in prompts:
        rec = records.get(p.id)
        if rec is not None and rec.get("prompt_sha256") != prompt_digest(p.input_ids):
            raise ResultsMismatch(f"{path}: prompt {p.id!r} is not the prompt these results were decoded for (the "
                                  "prompt file changed); evaluate into another eval.output_dir")


def prompt_digest(input_ids: torch.Tensor) -> str:
    """SHA-256 of a templated prompt's token ids (ties a stored result to the exact prompt)."""
    from core.io import sha256_json

    return sha256_json([int(t) for t in input_ids.reshape(-1).tolist()])


# eval keys added after evaluations were first written, each at the value that keeps the behaviour from before
# it: at that value a key is left out of the progress fingerprint, so those evaluations still resume
NEUTRAL_EVAL_KEYS: dict[str, Any] = {"tree_fallback": False,
                                     "row_consistent": True}  # acts on bf16 / fp16 bases only (issue 26)


# eval keys that do not change any prompt's result; shards may differ in these
UNFINGERPRINTED_EVAL_KEYS = ("output_dir", "threads", "warmup", "fail_on_mismatch", "num_prompts", "prompt_offset",
                             "allow_other_base")


def checkpoint_digest(ckpt) -> str | None:
    """SHA-256 of a head checkpoint's ``model.safetensors`` (its identity), or None when ``ckpt`` is
    not a checkpoint directory (``oracle`` / ``random``, a missing path)."""
    from core.io import sha256_file

    if ckpt is None:
        return None
    path = Path(str(ckpt)) / "model.safetensors"
    return sha256_file(path) if path.is_file() else None


def progress_fingerprint(cfg: DictConfig) -> tuple[str, dict[str, dict[str, str]]]:
    """What determines an evaluation's per-prompt results (not where they go or how a path is spelt).

    Returns:
        ``(fingerprint, weights)``: ``fingerprint`` hashes the model, heads, prompt and eval settings
        and the seed, with every checkpoint path replaced by a reference to its slot in ``weights``
        (so ``checkpoint=/abs/run/best`` and ``checkpoint=run/best`` are the same evaluation);
        ``weights`` maps each checkpoint slot (``checkpoint``, ``variants[i]``) to
        ``{"sha256": digest of model.safetensors, "path": as given}``: the digest is the
        checkpoint's identity, the path is recorded only, never compared.
    """
    from core.io import sha256_json

    parts, weights = _fingerprint_parts(cfg)
    return sha256_json(parts), weights


def fingerprint_differences(old: DictConfig, new: DictConfig) -> list[str]:
    """``["eval.turns: '1' -> 'all'", ...]``: the settings in which two evaluation configs differ as
    :func:`progress_fingerprint` sees them (checkpoints by weights, unfingerprinted keys left out)."""
    from core.config import flatten_dotted

    a, b = (flatten_dotted(_fingerprint_parts(c)[0]) for c in (old, new))
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _fingerprint_parts(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    """``(what progress_fingerprint hashes, weights)`` (:func:`progress_fingerprint`)."""
    ev = dict(to_container(cfg.eval))
    # num_prompts / prompt_offset are left out: records are per prompt (checked by token hash), so a
    # larger num_prompts extends a finished evaluation, and shards (prompt_offset) can be combined
    for k in UNFINGERPRINTED_EVAL_KEYS:
        ev.pop(k, None)
    if "turns" in ev:  # eval.turns=2 and eval.turns="2" are one setting
        ev["turns"] = str(ev["turns"])
    weights: dict[str, dict[str, str]] = {}  # a retrained checkpoint at the same path must not reuse old results
    slots = [("checkpoint", ev)] + [(f"variants[{i}]", v) for i, v in enumerate(ev.get("variants") or [])
                                    if isinstance(v, dict)]
    for _, holder in slots:
        for k, neutral in NEUTRAL_EVAL_KEYS.items():
            if k in holder and type(holder[k]) is type(neutral) and holder[k] == neutral:
                holder.pop(k)
    for slot, holder in slots:
        digest = checkpoint_digest(holder.get("checkpoint"))
        if digest is not None:
            weights[slot] = {"sha256": digest, "path": str(holder["checkpoint"])}
            holder["checkpoint"] = f"<weights[{slot}]>"  # identity = the digest in ``weights``, not the path
    return {"model": to_container(cfg.model) if "model" in cfg else None,
            "heads": to_container(cfg.heads) if "heads" in cfg else None,
            "data": to_container(cfg.data) if "data" in cfg and not ev.get("prompts") else None,
            "eval": ev, "seed": cfg.get("seed")}, weights


def weight_digests(weights: dict[str, Any] | None) -> dict[str, str]:
    """``{slot: sha256}`` of a progress header's ``weights`` (:func:`progress_fingerprint`)."""
    return {k: (v.get("sha256") if isinstance(v, dict) else str(v)) for k, v in (weights or {}).items()}


RECORD_KEYS = ("id", "prompt_sha256", "vanilla", "methods")


def read_progress(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]], bool]:
    """Read a ``progress.jsonl`` (see :class:`Progress`): ``(header, {prompt id: record}, torn)``.

    A torn last line (a crash mid-write) is dropped and reported as ``torn=True``; that prompt is
    simply decoded again.

    Raises:
        ValueError: the file is not UTF-8, its header is not ``{"fingerprint": str, "weights":
            {...}}``, or a record is not a JSON object with ``id``, ``prompt_sha256``, ``vanilla``
            and ``methods`` (a corrupt line before the last one included); the message names the
            file and line.
    """
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start}); move it away to start over") from exc
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: unreadable header ({exc}); move it away to start over") from exc
    if not (isinstance(head, dict) and isinstance(head.get("fingerprint"), str)
            and isinstance(head.get("weights", {}), dict)):
        raise ValueError(f"{path}:1: not a progress header (expected {{\"fingerprint\": ..., \"weights\": ...}})")
    records: dict[str, dict[str, Any]] = {}
    torn = False
    for k, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if k == len(lines) or all(not x.strip() for x in lines[k:]):
                torn = True  # torn final line
                break
            raise ValueError(f"{path}:{k}: corrupt record; move the file away to start over")
        missing = [key for key in RECORD_KEYS if not isinstance(rec, dict) or key not in rec]
        if missing:
            raise ValueError(f"{path}:{k}: not a prompt record (missing {', '.join(missing)}); "
                             "move the file away to start over")
        records[str(rec["id"])] = rec
    return head, records, torn


def write_progress(path: Path, header: dict[str, Any], records) -> None:
    """Atomically (re)write a ``progress.jsonl``: the header line, then one line per record."""
    lines = [json.dumps(header)] + [json.dumps(r) for r in records]
    atomic_write_text(path, "\n".join(lines) + "\n")


def differences_note(recorded: Path, config: DictConfig | Path | None) -> str:
    """`` (eval.turns: '1' -> 'all'; ...)``: how ``config`` (a config, or another evaluation's
    ``config.yaml``) differs from the evaluation's recorded ``config.yaml`` in what
    :func:`progress_fingerprint` sees, or "" when either is missing or unreadable."""
    if config is None or not recorded.is_file() or (isinstance(config, Path) and not config.is_file()):
        return ""
    from omegaconf import OmegaConf

    try:
        diffs = fingerprint_differences(OmegaConf.load(recorded),
                                        OmegaConf.load(config) if isinstance(config, Path) else config)
    except Exception:  # noqa: BLE001 — a damaged config.yaml only loses the detail, never the refusal
        return ""
    return f" ({'; '.join(diffs[:6])}{'; ...' if len(diffs) > 6 else ''})" if diffs else ""


class Progress:
    """Per-prompt results appended to ``progress.jsonl`` as they finish, so an interrupted
    evaluation resumes (``resume=auto``) without decoding finished prompts again.

    Line 1 is ``{"fingerprint": ..., "weights": ...}`` (:func:`progress_fingerprint`: checkpoints
    are identified by content, their paths only recorded); every further line is one
    prompt's record (vanilla and method tokens, stats, seconds).  Each line is flushed and fsynced;
    a torn last line (a crash mid-write) is ignored.

    Raises:
        ValueError: the file holds results but ``resume`` is not ``auto`` (nothing is overwritten),
            ``resume`` has another value, or the file was written under a different configuration or
            different checkpoint weights.
    """

    def __init__(self, path: Path, fingerprint: tuple[str, dict[str, str]], resume, config: DictConfig | None = None) -> None:
        self.path = path
        head, self.records = check_progress(path, fingerprint, resume, config)
        if head is not None:
            write_progress(path, head, self.records.values())  # drop a torn tail before appending
        else:
            write_progress(path, {"fingerprint": fingerprint[0], "weights": fingerprint[1]}, [])

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records[str(record["id"])] = record


def check_progress(path: Path, fingerprint: tuple[str, dict[str, str]], resume, config: DictConfig | None = None
                   ) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """What :class:`Progress` finds in ``path`` and may continue, read without writing anything (the
    evaluation calls it before the base loads when ``eval.output_dir`` is given).

    Returns:
        ``(head, records)``: the file's first line and its records by prompt id, or ``(None, {})`` for no file.

    Raises:
        ValueError: as :class:`Progress`.
    """
    fingerprint, weights = fingerprint
    records: dict[str, dict[str, Any]] = {}
    if resume not in (None, "auto"):
        raise ValueError(f"resume={resume!r}: evaluation takes resume=auto (continue {path.name} in "
                         "eval.output_dir) or nothing")
    if path.is_file() and path.stat().st_size:
        head, records, _ = read_progress(path)
        if resume != "auto":
            raise ValueError(f"{path} already holds results of {len(records)} prompt(s): "
                             "pass resume=auto to continue them, or choose another eval.output_dir")
        now, then = weight_digests(weights), weight_digests(head.get("weights"))
        changed = sorted(c for c in set(now) | set(then) if now.get(c) != then.get(c))
        if changed:
            names = [str((weights.get(c) or (head.get("weights") or {}).get(c) or {}).get("path", c))
                     if isinstance(weights.get(c) or (head.get("weights") or {}).get(c), dict) else c for c in changed]
            raise ValueError(f"{path}: the weights of checkpoint {', '.join(names)} changed since these results "
                             "were written (checkpoints are identified by their model.safetensors SHA-256); "
                             "evaluate them into another eval.output_dir")
        if head.get("fingerprint") != fingerprint:
            raise ValueError(f"{path} was written under a different model/heads/eval configuration"
                             f"{differences_note(path.parent / 'config.yaml', config)}; "
                             "resume with the same settings, or choose another eval.output_dir")
        return head, records
    return None, records


def absolute_paths(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` whose local file paths are absolute: ``eval.checkpoint`` and every
    ``eval.variants[i].checkpoint`` (not ``oracle`` / ``random``), ``eval.prompts``, ``model.path`` and
    ``data.path``, each when it names an existing file or directory (a hub id stays as given).

    A relative path means something only in the directory the command ran in: the saved
    ``config.yaml`` is re-run by ``python -m evaluation.merge`` from anywhere, and the progress
    fingerprint must not depend on how a path was spelt (``../shared/q.jsonl`` and
    ``/work/shared/q.jsonl`` are one prompt file).  Symlinks are kept (``os.path.abspath``).
    """
    from omegaconf import OmegaConf, open_dict

    def fix(value):
        if isinstance(value, str) and value not in REFERENCE_DRAFTERS and not os.path.isabs(value) \
                and os.path.exists(value):
            return os.path.abspath(value)
        return value

    out = cfg.copy()
    with open_dict(out):
        for key in ("eval.checkpoint", "eval.prompts", "model.path", "data.path"):
            value = OmegaConf.select(out, key, default=None)
            if value is not None:
                OmegaConf.update(out, key, fix(value), merge=False)
        for v in out.eval.get("variants") or []:
            if isinstance(v, DictConfig) and v.get("checkpoint") is not None:
                v.checkpoint = fix(v.checkpoint)
    return out
