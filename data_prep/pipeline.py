"""Data prep end to end: ShareGPT → split → template → labels → sharded cache (issue 2).

:func:`prepare` is what ``python -m data_prep`` runs.  Work is split into shards of
``prep.shard_size`` conversations per sub-cache (``train/``, ``val/``); rank r of N (torchrun or
SLURM variables) prepares the shards whose global index (train shards, then val shards) is
≡ r (mod N).  Each shard is computed from its
conversations alone (sorted by length into forward batches of at most ``prep.batch_tokens``
padded tokens), so the bytes do not depend on N, and a re-run skips every intact shard.
"""
from __future__ import annotations

import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from core.config import UserInputError, save_config
from core.io import atomic_write_json
from data_prep import cache as cache_mod
from data_prep import label_counts
from data_prep.labels import forward_features, regenerate
from data_prep.sharegpt import Conversation, ReadStats, iter_conversations
from data_prep.split import is_heldout
from data_prep.template import TemplateError, end_of_turn_ids, flatten, segment_conversation

SPLITS = ("train", "val")


@dataclass
class SplitConversations:
    """Conversations read for one data config, divided by the held-out split."""

    train: list[Conversation] = field(default_factory=list)
    val: list[Conversation] = field(default_factory=list)
    stats: ReadStats = field(default_factory=ReadStats)


def read_split(data_cfg) -> SplitConversations:
    """Read the first ``data.max_conversations`` valid conversations and split them by id hash."""
    out = SplitConversations()
    limit = data_cfg.get("max_conversations")
    for conv in iter_conversations(data_cfg.get("path"), out.stats):
        target = out.val if is_heldout(conv.id, float(data_cfg.heldout_fraction), str(data_cfg.split_salt)) else out.train
        target.append(conv)
        if limit is not None and len(out.train) + len(out.val) >= int(limit):
            break
    return out


def heldout_prompts(data_cfg, limit: int | None = None) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """Yield ``(id, messages)`` for held-out conversations: the messages up to and including the
    first user turn (after an optional system turn), ready for ``apply_chat_template(...,
    add_generation_prompt=True)``.  Scans the whole file (not capped by ``max_conversations``);
    the split is by id, so these are never in any training cache.

    Args:
        data_cfg: the ``data`` config section (``path``, ``heldout_fraction``, ``split_salt``).
        limit: stop after this many prompts (``None`` = all).
    """
    n = 0
    for conv in iter_conversations(data_cfg.get("path")):
        if not is_heldout(conv.id, float(data_cfg.heldout_fraction), str(data_cfg.split_salt)):
            continue
        first_user = next(i for i, m in enumerate(conv.messages) if m["role"] == "user")
        yield conv.id, conv.messages[: first_user + 1]
        n += 1
        if limit is not None and n >= limit:
            return


class _Progress:
    """tqdm bar over conversations with a tokens/s postfix (disabled when ``enabled`` is False)."""

    def __init__(self, total: int, enabled: bool, rank: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, unit="conv", desc=f"data prep [rank {rank}]", disable=not enabled,
                        file=sys.stderr, dynamic_ncols=True)
        self.tokens = 0
        self.gen_tokens = 0
        self.t0 = time.perf_counter()

    def _postfix(self) -> None:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        text = f"{self.tokens / dt:,.0f} tok/s"
        if self.gen_tokens:
            text += f", regenerated {self.gen_tokens:,} tok ({self.gen_tokens / dt:,.1f} tok/s)"
        self.bar.set_postfix_str(text)

    def generated(self, tokens: int) -> None:
        self.gen_tokens += tokens
        self._postfix()

    def update(self, conversations: int, tokens: int) -> None:
        self.tokens += tokens
        self._postfix()
        self.bar.update(conversations)

    def close(self) -> None:
        self.bar.close()


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped into forward batches: sorted by length (longest first, ties by index),
    each batch holding at most ``batch_tokens`` padded tokens (at least one sequence)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, b = [], 0
    while b < len(order):
        size = max(1, batch_tokens // max(lengths[order[b]], 1))
        batches.append(order[b: b + size])
        b += size
    return batches


def build_records(model, tokenizer, convs: Sequence[Conversation], *, labels_mode: str, max_length: int,
                  max_new_tokens: int, layers: Sequence[int], final_layer: int, batch_tokens: int,
                  gen_batch_size: int, progress: _Progress | None = None) -> tuple[list[dict], Counter]:
    """Tokenise, label and featurise conversations (one shard's worth), in input order.

    Returns:
        ``(records, dropped)``: records with ``id``, ``input_ids``, ``loss_mask``, ``labels``
        and ``hidden`` {l: [T, H]} for ``final_layer`` and ``layers``; ``dropped`` counts
        ``template_error`` and ``no_assistant_tokens`` (every assistant token fell beyond
        ``max_length``).
    """
    eos = end_of_turn_ids(tokenizer, model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    dropped: Counter = Counter()
    kept: list[Conversation] = []
    segs = []
    for conv in convs:
        try:
            segs.append(segment_conversation(tokenizer, conv.messages, conv.id, eos, max_length))
            kept.append(conv)
        except TemplateError:
            dropped["template_error"] += 1
    if labels_mode == "regenerate":
        seqs = regenerate(model, tokenizer, segs, eos, max_new_tokens, max_length, gen_batch_size,
                          on_generated=progress.generated if progress is not None else None)
    elif labels_mode == "teacher_forced":
        seqs = [flatten(s, max_length) for s in segs]
    else:
        raise ValueError(f"labels={labels_mode!r} is not valid; choices: teacher_forced, regenerate")
    items = []
    for conv, (ids, mask) in zip(kept, seqs):
        if not any(mask):
            dropped["no_assistant_tokens"] += 1
            continue
        items.append({"id": conv.id, "input_ids": ids, "loss_mask": mask})
    want = sorted(set(layers) | {final_layer})
    for group in length_batches([len(it["input_ids"]) for it in items], batch_tokens):
        feats = forward_features(model, [items[i]["input_ids"] for i in group], pad_id, want)
        for i, f in zip(group, feats):
            items[i]["labels"] = f["labels"]
            items[i]["hidden"] = f["hidden"]
        if progress is not None:
            progress.update(len(group), sum(len(items[i]["input_ids"]) for i in group))
    if progress is not None and len(convs) > len(items):
        progress.update(len(convs) - len(items), 0)
    return items, dropped


def refuse_different_cache(root: Path, cfg) -> None:
    """Refuse to write into a cache directory prepared under other cache-defining settings.

    Raises:
        UserInputError: ``root/config.yaml`` exists and its ``model``/``data``/``prep``/``labels``
            settings differ from ``cfg``'s (the differing keys are named; nothing is written).
    """
    from omegaconf import OmegaConf

    old_path = Path(root) / "config.yaml"
    if not old_path.is_file():
        return
    old = cache_mod.cache_defining_config(OmegaConf.load(old_path))
    new = cache_mod.cache_defining_config(cfg)
    if old == new:
        return
    diffs = []
    for section in new:
        a, b = old.get(section), new[section]
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [f"{section}.{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            diffs.append(f"{section}: {a!r} -> {b!r}")
    raise UserInputError(f"cache {root} was prepared with other settings ({'; '.join(diffs[:4])}"
                         f"{'; ...' if len(diffs) > 4 else ''}); use another prep.cache_dir, or the same settings to resume")


def prepare(cfg, model=None, tokenizer=None, identity=None, rank: int | None = None, world: int | None = None,
            out=sys.stdout) -> dict[str, Any]:
    """Prepare (or resume) the cache for a composed config; return the summary.

    Args:
        cfg: the composed config (``model``, ``data``, ``prep``, ``labels``, ``output_root``).
        model, tokenizer, identity: an already loaded base (else ``core.base_model`` loads it).
        rank, world: override the torchrun / SLURM variables (:func:`data_prep.cache.rank_world`).
        out: where the summary is printed (``None`` = silent).

    Returns:
        the summary dict (also ``<cache>/summary.json`` once every shard of both splits exists):
        conversations, tokens, assistant tokens, dropped by reason, bytes on disk, bytes per token.

    Raises:
        UserInputError: bad ``prep.layers``, a cache directory prepared under other settings, or no
            usable conversation.
    """
    if model is None:
        from core.base_model import load_base_model

        model, tokenizer, identity = load_base_model(cfg.model)
    if rank is None or world is None:
        rank, world = cache_mod.rank_world()
    root = cache_mod.default_cache_dir(cfg)
    chash = cache_mod.cache_hash(cfg)
    L = int(model.config.num_hidden_layers)
    layers = sorted({int(l) for l in cfg.prep.layers})
    if any(l >= L or l < 1 for l in layers):
        raise UserInputError(f"prep.layers={layers}: intermediate layer ids must lie in [1, L={L}) "
                             f"(hs[{L}], the final post-norm state, is always cached)")
    from data_prep.fp8 import is_fp8, storage_dtype

    dtype = storage_dtype(str(cfg.prep.dtype))  # fp8 on a torch without it: one line, nothing written
    refuse_different_cache(root, cfg)  # before anything is written there
    data = read_split(cfg.data)  # a missing, unreadable or empty input leaves no cache directory behind
    if not data.train and not data.val:
        raise UserInputError(
            f"no usable conversation in {cfg.data.path or 'the packaged ShareGPT file'} "
            f"(records read {data.stats.records}, dropped {dict(sorted(Counter(data.stats.dropped).items()))}); "
            "check data.path, data.max_length and data.max_conversations")
    root.mkdir(parents=True, exist_ok=True)
    save_config(cfg, root)
    S = int(cfg.prep.shard_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(tokenizer.eos_token_id)
    header = {
        "config_hash": chash,
        "base": identity.to_dict() if hasattr(identity, "to_dict") else dict(identity or {}),
        "final_layer": L,
        "layers": layers,
        "hidden_size": int(model.config.hidden_size),
        "dtypes": {"input_ids": "int32", "labels": "int32", "loss_mask": "bool", "offsets": "int64",
                   "hidden": cfg.prep.dtype, "aux_hidden": cfg.prep.dtype,
                   **({"hidden_scale": "float32"} if is_fp8(dtype) else {})},
        "pad_id": int(pad_id),
        "labels": str(cfg.labels),
        "max_length": int(cfg.data.max_length),
        "max_new_tokens": int(cfg.prep.max_new_tokens) if cfg.labels == "regenerate" else None,
    }
    # every (split, shard) pair gets a global index; rank r takes the indices ≡ r (mod world)
    todo = []
    index = 0
    for split in SPLITS:
        convs = getattr(data, split)
        for k in range(math.ceil(len(convs) / S)):
            if index % world == rank:
                todo.append((split, k, convs[k * S:(k + 1) * S]))
            index += 1
    progress = _Progress(sum(len(c) for _, _, c in todo), bool(cfg.prep.progress), rank)
    try:
        for split, k, convs in todo:
            directory = root / split
            directory.mkdir(parents=True, exist_ok=True)
            if cache_mod.finished_entry(directory, k, chash) is not None:
                progress.update(len(convs), 0)
                continue
            records, dropped = build_records(
                model, tokenizer, convs, labels_mode=str(cfg.labels), max_length=int(cfg.data.max_length),
                max_new_tokens=int(cfg.prep.max_new_tokens), layers=layers, final_layer=L,
                batch_tokens=int(cfg.prep.batch_tokens), gen_batch_size=int(cfg.prep.gen_batch_size),
                progress=progress)
            if records:
                tensors = cache_mod.build_shard_tensors(records, layers, L, dtype)
            else:
                H = int(model.config.hidden_size)
                tensors = {"input_ids": torch.zeros(0, dtype=torch.int32), "labels": torch.zeros(0, dtype=torch.int32),
                           "loss_mask": torch.zeros(0, dtype=torch.bool), "offsets": torch.zeros(1, dtype=torch.int64),
                           "hidden": torch.zeros(0, H, dtype=dtype),
                           **{f"aux_hidden.{l}": torch.zeros(0, H, dtype=dtype) for l in layers}}
                if is_fp8(dtype):
                    tensors.update({k.replace("hidden", "hidden_scale", 1): torch.zeros(0) for k in list(tensors)
                                    if "hidden" in k})
            cache_mod.write_shard(directory, k, tensors, [r["id"] for r in records],
                                  {"config_hash": chash, "dropped": dict(sorted(dropped.items()))})
    finally:
        progress.close()
    manifests = {}
    for split in SPLITS:
        n = math.ceil(len(getattr(data, split)) / S)
        (root / split).mkdir(parents=True, exist_ok=True)
        manifests[split] = cache_mod.write_manifest(root / split, n, {**header, "split": split})
        if manifests[split] is not None:  # Σ over the shards' labels: the same bytes from any rank
            label_counts.write_split_counts(root / split)
    summary = _summary(root, data, manifests)
    if all(m is not None for m in manifests.values()):
        atomic_write_json(root / "summary.json", {k: v for k, v in summary.items() if k != "cache_dir"})
    if out is not None:
        print(format_summary(summary), file=out)
        if summary["complete"]:
            counts = {split: label_counts.load_counts(root / split, scan=False) for split in SPLITS}
            rows = label_counts.coverage_table(counts["train"], counts["val"])
            print(label_counts.format_coverage(rows, int(counts["val"].sum())), file=out)
    if summary["complete"]:
        empty = [k for k, v in summary["splits"].items() if not v["conversations"]]
        if summary["conversations"] == 0:
            raise UserInputError(
                f"no usable conversation in {cfg.data.path or 'the packaged ShareGPT file'} "
                f"(records read {summary['records_read']}, dropped {summary['dropped']}); "
                "check data.path, data.max_length and data.max_conversations")
        for split in empty:
            print(f"warning: the {split!r} split of {root} is empty; training needs both splits "
                  "(raise data.max_conversations or data.heldout_fraction)", file=sys.stderr)
    return summary


def _summary(root: Path, data: SplitConversations, manifests: dict) -> dict[str, Any]:
    complete = all(m is not None for m in manifests.values())
    dropped = Counter(data.stats.dropped)
    totals = {"conversations": 0, "tokens": 0, "assistant_tokens": 0, "bytes": 0}
    per_split = {}
    for split, m in manifests.items():
        if m is None:
            continue
        dropped.update(m["dropped"])
        per_split[split] = {"conversations": m["num_records"], "tokens": m["num_tokens"],
                            "assistant_tokens": m["num_assistant_tokens"], "bytes": m["bytes"]}
        totals["conversations"] += m["num_records"]
        totals["tokens"] += m["num_tokens"]
        totals["assistant_tokens"] += m["num_assistant_tokens"]
        totals["bytes"] += m["bytes"]
    return {
        "cache_dir": str(root),
        "complete": complete,
        **totals,
        "bytes_per_token": totals["bytes"] / totals["tokens"] if totals["tokens"] else None,
        "splits": per_split,
        "records_read": data.stats.records,
        "dropped": dict(sorted(dropped.items())),
        "unparsed_bytes": data.stats.unparsed_bytes if data.stats.finished else None,
    }


def format_summary(s: dict[str, Any]) -> str:
    """Human-readable summary block printed at the end of ``python -m data_prep``."""
    if not s["complete"]:
        return (f"data prep: this rank's shards are done; {s['cache_dir']} is complete once every rank "
                "finishes (re-run any rank to write the manifests).")
    lines = [
        f"cache: {s['cache_dir']}",
        f"conversations: {s['conversations']:,} (" + ", ".join(
            f"{k} {v['conversations']:,}" for k, v in s["splits"].items()) + ")",
        f"tokens: {s['tokens']:,}   assistant tokens: {s['assistant_tokens']:,}",
        f"records read: {s['records_read']:,}   dropped: " + (", ".join(
            f"{k} {v:,}" for k, v in s["dropped"].items()) or "none"),
        f"bytes on disk: {s['bytes']:,}   bytes per token: {s['bytes_per_token']:.1f}"
        if s["bytes_per_token"] else f"bytes on disk: {s['bytes']:,}",
    ]
    if s["unparsed_bytes"] is not None:
        lines.append(f"unparsed bytes in the input file: {s['unparsed_bytes']:,}")
    return "\n".join(lines)
