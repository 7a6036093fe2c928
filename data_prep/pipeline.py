"""Data prep end to end: sources → split → template → labels → sharded cache (issues 2, 15).

The front half (reading, normalising, splitting, templating: :mod:`data_prep.front`) runs on the
tokenizer alone, before the base model is loaded and before any directory is created.

:func:`prepare` is what ``python -m data_prep`` runs.  Work is split into shards of
``prep.shard_size`` conversations per sub-cache (``train/``, ``val/``); rank r of N (torchrun or
SLURM variables) prepares the shards whose global index (train shards, then val shards) is
≡ r (mod N).  Each shard is computed from its
conversations alone (sorted by length into forward batches of at most ``prep.batch_tokens``
padded tokens), so the bytes do not depend on N, and a re-run skips every intact shard.
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import torch

from core.config import UserInputError, save_config
from core.io import atomic_write_json
from data_prep import cache as cache_mod
from data_prep import label_counts
from data_prep.features import FeatureDefinition
from data_prep.labels import conversation_groups, forward_features, packed_for_generation, regen_sources, regenerate
from data_prep.front import (SPLITS, SplitConversations, TemplatedConversation, heldout_prompts,  # noqa: F401
                              read_split, template_split)
from data_prep.template import end_of_turn_ids, pad_token_id
from decoding.prepacked import prepack_mode

def eos_ids_before_model(model_cfg, tokenizer) -> set[int]:
    """End-of-turn ids from the tokenizer and the generation config the base will load with, read
    without its weights: the folder's ``generation_config.json``, else the one transformers derives
    from ``config.json`` (``GenerationConfig.from_model_config``, as ``from_pretrained`` does, so a
    config whose ``eos_token_id`` differs from the tokenizer's counts here as it does at inference).
    Only a folder with neither file falls back to the tokenizer's eos alone."""
    from types import SimpleNamespace

    from transformers import AutoConfig, GenerationConfig

    from core.base_model import resolve_model_dir

    folder = resolve_model_dir(model_cfg)[0]
    try:
        gen = GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json
        try:
            config = AutoConfig.from_pretrained(folder, trust_remote_code=bool(model_cfg.get("trust_remote_code")))
            gen = GenerationConfig.from_model_config(config)
        except (OSError, ValueError):  # no readable config.json either
            gen = None
    return end_of_turn_ids(tokenizer, SimpleNamespace(generation_config=gen))


class _Progress:
    """tqdm bar over this rank's shards (disabled when ``enabled`` is False); shards already on
    disk count as done from the start (``initial``), so the rate and ETA cover this run's work.

    * ``teacher_forced``: unit tokens (the templated tokens of each shard's conversations),
      advanced by each forward batch; conversations in the postfix.
    * ``regenerate``: unit conversations, advanced as each conversation's regeneration ends
      (generation is nearly all the time, so the rate in conversations gives a readable ETA);
      the postfix shows the tokens regenerated, their rate, and the replies cut so far."""

    def __init__(self, total: int, initial: int, regenerate: bool, enabled: bool, rank: int):
        from tqdm.auto import tqdm

        self.regen = regenerate
        self.bar = tqdm(total=total, initial=initial, unit="conv" if regenerate else "tok", unit_scale=not regenerate,
                        desc=f"data prep [rank {rank}]", disable=not enabled, file=sys.stderr, dynamic_ncols=True)
        self.conversations = 0
        self.gen_tokens = 0
        self.turns = Counter()           # regenerated replies of finished shards: turns, truncated_turns
        self.live: Counter | None = None  # the running shard's regeneration counter
        self.t0 = time.perf_counter()
        self.last = 0.0

    def _postfix(self, force: bool = True) -> None:
        now = time.perf_counter()
        if not force and now - self.last < 0.5:  # every decode step calls in: redraw at most twice a second
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        if self.regen:
            turns = self.turns + (self.live or Counter())
            text = f"regenerated {self.gen_tokens:,} tok ({self.gen_tokens / dt:,.1f} tok/s)"
            if turns["turns"]:
                text += (f", cut {turns['truncated_turns']:,}/{turns['turns']:,} replies "
                         f"({100 * turns['truncated_turns'] / turns['turns']:.0f}%)")
        else:
            text = f"{self.conversations:,} conv"
        self.bar.set_postfix_str(text)

    def shard_stats(self) -> Counter:
        """A counter for the next shard's :func:`data_prep.labels.regenerate` (read live by the postfix)."""
        if self.live is not None:
            self.turns.update({k: self.live[k] for k in ("turns", "truncated_turns")})
        self.live = Counter()
        return self.live

    def generated(self, tokens: int) -> None:
        self.gen_tokens += tokens
        self._postfix(force=False)

    def regenerated(self, conversations: int) -> None:
        """``conversations`` finished their regeneration."""
        self._postfix()
        self.bar.update(conversations)

    def shard_done(self, done: int) -> None:
        """The running shard is written: the bar stands at the shards done so far, ``done`` in its unit
        (a shard's templated tokens include those truncation and dropped records never feed)."""
        self.bar.update(max(0, done - self.bar.n))

    def update(self, conversations: int, tokens: int) -> None:
        """``conversations`` holding ``tokens`` tokens have their features (teacher-forced bar: advances)."""
        self.conversations += conversations
        if not self.regen:
            self._postfix()
            self.bar.update(tokens)

    def close(self) -> None:
        if self.live is not None:
            self.shard_stats()
            self.live = None
        self._postfix()
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


#: drop reasons of the finite-value guard (:func:`non_finite_reason`)
NON_FINITE_HIDDEN = "non_finite_hidden"
NON_FINITE_LABELS = "non_finite_labels"
HIDDEN_OVERFLOWS_STORAGE = "hidden_overflows_storage_dtype"


def non_finite_reason(record: dict, storage: torch.dtype | None = None) -> tuple[str, dict] | None:
    """Why a featurised record must not enter the cache, or None when every cached value is finite.

    Checks every cached layer's hidden state ``record["hidden"][l]`` [T, H] at every position,
    first as the base computed it, then (``storage`` = ``prep.dtype``, bf16 / fp16 / fp32) as it
    would be stored (a finite fp32 state beyond fp16's 65504 becomes inf); fp8 stores every finite
    value (:func:`data_prep.fp8.quantize_rows` saturates).  Then the logits behind the labels
    (``record["logits_finite"]`` [T]: a NaN / inf logit leaves the greedy label undefined).

    Returns:
        ``(reason, where)``: reason :data:`NON_FINITE_HIDDEN`, :data:`HIDDEN_OVERFLOWS_STORAGE` or
        :data:`NON_FINITE_LABELS`; ``where`` = ``{"layer", "position", "value"}`` of the first bad
        value (``layer`` None for labels).
    """
    from core.finite import describe, first_non_finite
    from data_prep.fp8 import is_fp8

    for layer in sorted(record["hidden"]):
        h = record["hidden"][layer]
        found = first_non_finite(h)
        if found is not None:
            return NON_FINITE_HIDDEN, {"layer": int(layer), "position": found[0][0], "value": describe(found[1])}
        if storage is not None and not is_fp8(storage) and h.dtype != storage:
            found = first_non_finite(h.to(storage))
            if found is not None:
                return HIDDEN_OVERFLOWS_STORAGE, {"layer": int(layer), "position": found[0][0],
                                                  "value": f"{float(h[found[0]]):.4g} -> {describe(found[1])} "
                                                           f"in {str(storage).removeprefix('torch.')}"}
    finite = record.get("logits_finite")
    if finite is not None and not bool(finite.all()):
        return NON_FINITE_LABELS, {"layer": None, "position": int((~finite).nonzero()[0, 0]), "value": "logits"}
    return None


def check_against_base(cfg, base_config) -> list[int]:
    """Refuse settings this base cannot serve, from its config alone (before its weights load, before
    anything is written); shared by data prep and online/hybrid training.

    * ``data.max_length`` beyond the base's context (``max_position_embeddings``,
      :func:`decoding.vanilla.context_limit`): features and labels at positions the base was never
      trained on are not what it computes at inference, where the evaluation refuses such prompts
      (:func:`decoding.vanilla.check_context_limit`);
    * ``prep.layers`` outside [1, L): hs[L], the final post-norm state, is always cached.

    Args:
        cfg: the run config (``data.max_length``, ``prep.layers``, ``model.path``).
        base_config: the base's ``transformers.PretrainedConfig`` (:func:`core.base_model.load_base_config`).

    Returns:
        The sorted, distinct ``prep.layers``.

    Raises:
        UserInputError: naming the key, its value and the base's limit.
    """
    from decoding.vanilla import context_limit

    max_length = int(cfg.data.max_length)
    limit = context_limit(base_config)
    if limit is not None and max_length > limit:
        raise UserInputError(f"data.max_length={max_length} exceeds the base model's context "
                             f"(max_position_embeddings={limit}): its hidden states and labels past position {limit} "
                             f"are not what it computes at inference; set data.max_length<={limit}")
    L = int(base_config.num_hidden_layers)
    layers = sorted({int(l) for l in cfg.prep.layers})
    bad = [l for l in layers if not 1 <= l < L]
    if bad:
        base = f"model.path={cfg.model.path!r}" if cfg.model.get("path") else "the packaged SmolLM2-135M-Instruct"
        raise UserInputError(f"prep.layers={layers}: {bad} are not intermediate layers of the base ({base} has L={L}; "
                             f"ids must lie in [1, {L}), and hs[{L}], the final post-norm state, is always cached)")
    return layers


def max_length_cuts(conv: TemplatedConversation, max_length: int) -> Counter:
    """What ``data.max_length`` cuts from one teacher-forced record: ``tf_conversations`` (1),
    ``tf_cut_conversations`` (1 when its templated tokens exceed ``max_length``), ``tf_turns`` (its
    assistant replies) and ``tf_cut_turns`` (those not whole within ``max_length``: cut inside, or
    ending past it, end-of-turn included, or dropped entirely).  Issue 27: the share of cut replies."""
    past = int(conv.turns_past_max_length)  # replies the templating stopped before (issue 27: counted as cut)
    out = Counter(tf_conversations=1, tf_turns=past, tf_cut_turns=past)
    pos = 0
    for seg in conv.segments:
        end = pos + len(seg.ids)
        if seg.body:
            out["tf_turns"] += 1
            out["tf_cut_turns"] += int(end > max_length)
        pos = end
    out["tf_cut_conversations"] += int(pos > max_length or past > 0)
    return out


def build_records(model, tokenizer, convs: Sequence[TemplatedConversation], *, labels_mode: str, max_length: int,
                  max_new_tokens: int | None, layers: Sequence[int], final_layer: int, batch_tokens: int,
                  gen_batch_size: int, progress: _Progress | None = None, storage: torch.dtype | None = None,
                  examples: dict | None = None, prepack_weights: str = "false") -> tuple[list[dict], Counter]:
    """Label and featurise templated conversations (one shard's worth), in input order.

    Args:
        convs: :func:`data_prep.front.template_split` output for the shard (under ``regenerate`` a
            conversation's records adjacent: :func:`shard_records`).
        labels_mode: ``teacher_forced`` or ``regenerate`` (records ``<id>``, ``<id>#1``, ... per
            conversation as the template renders the regenerated replies).
        max_new_tokens: regeneration budget per turn (``None`` = up to ``max_length``).
        prepack_weights: ``prep.prepack_weights`` for the regeneration (:func:`data_prep.labels.packed_for_generation`).

    Returns:
        ``(records, counts)``: records with ``id``, ``input_ids``, ``loss_mask``, ``labels``
        and ``hidden`` {l: [T, H]} for ``final_layer`` and ``layers``; ``counts`` holds
        ``no_assistant_tokens`` (every assistant token fell beyond ``max_length``), the finite-value
        guard's reasons (:func:`non_finite_reason`: a non-finite hidden state or label, or a state
        the storage dtype ``storage`` cannot hold; the conversation is dropped) and, for
        ``regenerate``, ``regen_turns`` (replies regenerated), ``regen_closed_by_template`` (replies ended by
        another eos than the template's, closed with the template's token), ``regen_truncated_turns`` (replies
        cut by the budget, left without an end-of-turn), ``regen_rerendered_turns`` (later turns whose context
        the template re-rendered), ``regen_template_errors`` (conversations ended because the template raised on
        a regenerated reply, the first named on stderr) and ``regen_turns_after_a_dropped_turn`` (kept turns
        not regenerated because an earlier turn was dropped), all counted as generated, before the
        guard drops a conversation; for ``teacher_forced``, what ``max_length`` cuts
        (:func:`max_length_cuts`, over the records kept).  ``examples`` (optional dict) receives the
        first dropped conversation per guard reason: ``{reason: {"id", "layer", "position", "value"}}``.
    """
    eos = end_of_turn_ids(tokenizer, model)
    pad_id = pad_token_id(tokenizer, eos)
    counts: Counter = Counter()
    items = []
    if labels_mode == "regenerate":
        stats: Counter = progress.shard_stats() if progress is not None else Counter()
        sources = regen_sources(convs, stats)
        errors: dict[str, str] = {}
        with packed_for_generation(model, prepack_weights):
            regenerated = regenerate(model, tokenizer, sources, eos, max_new_tokens, max_length, gen_batch_size,
                                     on_generated=progress.generated if progress is not None else None,
                                     on_done=progress.regenerated if progress is not None else None, stats=stats,
                                     errors=errors)
        for key, message in errors.items():
            print(f"data prep: regeneration ended {message} (counted as regen_{key})", file=sys.stderr)
        for key in ("regen_turns", "regen_truncated_turns", *(k for k, _ in REGEN_DETAILS)):
            count = stats[key.removeprefix("regen_")]  # regenerate()'s and regen_sources' counter names
            if count or key == "regen_turns":
                counts[key] += count
        for src, records in zip(sources, regenerated):
            if not records:
                counts["no_assistant_tokens"] += 1
            for k, (ids, mask) in enumerate(records):
                items.append({"id": src.id if k == 0 else f"{src.id}#{k}", "input_ids": ids, "loss_mask": mask})
        finished = len(sources)
    elif labels_mode == "teacher_forced":
        for conv in convs:
            ids, mask = conv.encode(max_length)
            if not any(mask):
                counts["no_assistant_tokens"] += 1
                continue
            counts.update(max_length_cuts(conv, max_length))
            items.append({"id": conv.id, "input_ids": ids, "loss_mask": mask})
        finished = len(convs)
    else:
        raise ValueError(f"labels={labels_mode!r} is not valid; choices: teacher_forced, regenerate")
    want = sorted(set(layers) | {final_layer})
    for group in length_batches([len(it["input_ids"]) for it in items], batch_tokens):
        feats = forward_features(model, [items[i]["input_ids"] for i in group], pad_id, want)
        for i, f in zip(group, feats):
            items[i]["labels"] = f["labels"]
            items[i]["hidden"] = f["hidden"]
            items[i]["logits_finite"] = f.get("logits_finite")
        if progress is not None:
            progress.update(len(group), sum(len(items[i]["input_ids"]) for i in group))
    if progress is not None and finished > len(items):
        progress.update(finished - len(items), 0)
    kept = []
    for it in items:  # the finite-value guard: nothing non-finite enters the cache
        bad = non_finite_reason(it, storage)
        it.pop("logits_finite", None)
        if bad is None:
            kept.append(it)
            continue
        reason, where = bad
        counts[reason] += 1
        if examples is not None:
            examples.setdefault(reason, {"id": it["id"], **where})
    return kept, counts


def shard_records(records: Sequence[TemplatedConversation], shard_size: int, by_conversation: bool = False
                  ) -> list[list[TemplatedConversation]]:
    """Split one split's templated records into shards of ``shard_size`` (``prep.shard_size``).

    ``by_conversation``: shards of ``shard_size`` conversations, a conversation's records (a template
    that rewrites history gives several) always in one shard: regeneration writes a conversation's
    turns in order (:func:`data_prep.labels.regen_sources`).  Under a prefix-stable template every
    conversation is one record, so both ways give the same shards."""
    if not by_conversation:
        return [list(records[k:k + shard_size]) for k in range(0, len(records), shard_size)]
    groups = conversation_groups(records)
    return [[rec for group in groups[k:k + shard_size] for rec in group] for k in range(0, len(groups), shard_size)]


def shard_inputs_sha256(convs: Sequence[TemplatedConversation]) -> str:
    """SHA-256 of what one shard is made from: its records' ids, templated token ids and loss masks, and
    the source messages regeneration renders from.  An edited data file, chat template or tokenizer
    shows in it, though the cache-defining settings (:func:`data_prep.cache.cache_hash`) are the same."""
    import hashlib
    import json

    from data_prep.template import flatten

    h = hashlib.sha256()
    for c in convs:
        ids, mask = flatten(c.segments)
        h.update(json.dumps([c.id, ids, mask, c.messages], ensure_ascii=False, sort_keys=True).encode())
        h.update(b"\n")
    return h.hexdigest()


def check_finished_shards(root: Path, todo, entries: Sequence[dict[str, Any] | None], base: dict[str, Any]) -> None:
    """Refuse to resume a cache whose finished shards were made from other inputs than this run's.

    A resumed data prep keeps every finished shard and writes the rest, and the manifest then records
    this run's base: shards of another base's weights, or of an edited data file, chat template or
    tokenizer, would enter the cache under the new identity.  Each shard's sidecar records its
    ``inputs_sha256`` (:func:`shard_inputs_sha256`) and its ``base`` (the identity fields of
    :data:`core.base_model.IDENTITY_FIELDS`); a sidecar written before they were recorded is not compared.

    Args:
        root: the cache directory; todo: ``(split, index, convs)`` of this rank; entries: each one's sidecar
            when it is finished on disk, else None (:func:`data_prep.cache.finished_entry`); base: the loaded
            base's identity dict.

    Raises:
        UserInputError: naming the first such shard and what differs; nothing is written.
    """
    from core.base_model import check_same_base

    for (split, k, convs), entry in zip(todo, entries):
        if entry is None:
            continue
        shard = root / split / entry["file"]
        fix = (f"prepare into another prep.cache_dir, or delete {root} to rebuild it; its finished shards are "
               "kept only for the inputs they were made from")
        diffs = check_same_base(entry.get("base"), base, f"cache shard {shard}", "", allow=True)
        if diffs:
            raise UserInputError(f"cache shard {shard} was made by another base model than the one loaded "
                                 f"({'; '.join(diffs)}): {fix}")
        if entry.get("inputs_sha256") not in (None, shard_inputs_sha256(convs)):
            raise UserInputError(f"cache shard {shard} was made from other conversations or another templating than "
                                 "this run's (the data file, the chat template or the tokenizer changed under the same "
                                 f"settings): {fix}")


def refuse_different_cache(root: Path, cfg) -> None:
    """Refuse to write into a cache directory prepared under other cache-defining settings.

    Raises:
        UserInputError: ``root`` holds an evaluation's, a run's or a head's files; or ``root/config.yaml``
            exists and its ``model``/``data``/``prep``/``labels`` settings differ from ``cfg``'s (the
            differing keys are named; nothing is written).
    """
    from omegaconf import OmegaConf

    foreign = [name for name in ("progress.jsonl", "report.json", "record.json", "model.safetensors", "checkpoints")
               if (Path(root) / name).exists()]
    if foreign:  # an evaluation's, a training run's or a head's folder: never a cache to write into
        raise UserInputError(f"{root} is not a data-prep cache (it holds {', '.join(foreign)}); "
                             "set prep.cache_dir to a new or cache folder")
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

    The base runs in ``model.dtype`` (``auto`` resolved for the CPU by :func:`core.precision.resolve_dtype`:
    one line; bf16 on a CPU without bf16 instructions is refused before anything is written); the
    cache's ``config.yaml``, hash and manifest ``features`` (:class:`data_prep.features.FeatureDefinition`)
    record the dtype that ran.

    Raises:
        core.config.ConfigError: ``model.dtype=bfloat16`` on a CPU without bf16 instructions.
        ValueError: ``model`` was loaded in another dtype than ``model.dtype`` resolves to.
        UserInputError: bad ``prep.layers`` or ``data.max_length`` for this base (:func:`check_against_base`,
            before the base loads), a cache directory prepared under other settings, or no usable conversation.
        core.config.ConfigError: ``prep.cache_dir`` cannot become a folder to write into.
    """
    from core.config import check_output_path

    check_output_path(cfg, "prep.cache_dir")  # a path through a file is refused before the base loads
    if float(cfg.data.heldout_fraction) >= 1:  # (an evaluation may hold every conversation out; a cache may not)
        raise UserInputError(f"data.heldout_fraction={cfg.data.heldout_fraction!r} holds every conversation out, so "
                             "the cache's train split would be empty; use a share below 1, e.g. 0.05")
    if rank is None or world is None:
        rank, world = cache_mod.rank_world()
    # the base's compute dtype first: model.dtype=auto -> what runs on this CPU (one line), bf16 without
    # bf16 instructions refused; the cache's config.yaml, hash and manifest record the resolved dtype
    from core.precision import resolve_dtype, torch_dtype, with_values

    compute = resolve_dtype(cfg.model.dtype, "model.dtype", "cpu")
    cfg = with_values(cfg, {"model.dtype": compute})
    if model is not None and model.dtype != torch_dtype(compute):
        raise ValueError(f"prepare() was given a base in {model.dtype} but model.dtype resolves to {compute}; "
                         f"load it with dtype={compute} (core.base_model.load_base_model(cfg.model))")
    root = cache_mod.default_cache_dir(cfg)
    chash = cache_mod.cache_hash(cfg)
    max_length = int(cfg.data.max_length)
    max_new = cfg.prep.get("max_new_tokens")
    max_new = None if max_new is None else int(max_new)
    # front half first: read, validate and template the data before the model loads or a directory exists;
    # a missing, unreadable or empty input leaves no cache directory behind (read_split / template_split raise)
    data = read_split(cfg.data)
    if not data.train and data.val:  # a cache with nothing to train on: refused before the base loads
        raise UserInputError(f"every one of the {len(data.val)} conversations read is held out, so the cache's train "
                             f"split would be empty ({empty_split_advice('train', data, cfg.data)})")
    from core.base_model import load_base_config

    # a prep.layers or data.max_length this base cannot serve costs neither the data's templating nor a model load
    layers = check_against_base(cfg, model.config if model is not None else load_base_config(cfg.model))
    refuse_different_cache(root, cfg)  # nor does a cache folder of other settings
    if tokenizer is None:
        from core.base_model import load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
    eos_front = end_of_turn_ids(tokenizer, model) if model is not None else eos_ids_before_model(cfg.model, tokenizer)
    templated = template_split(tokenizer, data, eos_front, max_length)
    if model is None:
        from core.base_model import load_base_model

        model, tokenizer, identity = load_base_model(cfg.model)
    if end_of_turn_ids(tokenizer, model) != set(eos_front):  # the templates above ended turns with these
        raise RuntimeError(f"end-of-turn ids read before the base loaded {sorted(eos_front)} differ from the loaded "
                           f"base's {sorted(end_of_turn_ids(tokenizer, model))}: the records would end turns with "
                           "other tokens than inference; please report this model folder")
    L = int(model.config.num_hidden_layers)
    from core.base_model import IDENTITY_FIELDS
    from data_prep.fp8 import is_fp8, storage_dtype

    dtype = storage_dtype(str(cfg.prep.dtype))  # fp8 on a torch without it: one line, nothing written
    root.mkdir(parents=True, exist_ok=True)
    save_config(cfg, root)
    S = int(cfg.prep.shard_size)
    pad_id = pad_token_id(tokenizer, eos_front)
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
        "features": FeatureDefinition.from_config(cfg, L).to_dict(),
        "max_length": max_length,
        "max_new_tokens": (max_new if max_new is not None else max_length) if cfg.labels == "regenerate" else None,
        "data_sources": [s.describe() for s in data.sources],
        "data_read": {k: v for k, v in data.stats.to_dict().items() if k != "finished"},
    }
    regen = str(cfg.labels) == "regenerate"
    shards = {split: shard_records(templated[split], S, by_conversation=regen) for split in SPLITS}
    # every (split, shard) pair gets a global index; rank r takes the indices ≡ r (mod world)
    todo = []
    index = 0
    for split in SPLITS:
        for k, convs in enumerate(shards[split]):
            if index % world == rank:
                todo.append((split, k, convs))
            index += 1

    def size(convs) -> int:  # what a shard adds to the bar: conversations (regenerate) or templated tokens
        if regen:
            return len(conversation_groups(convs))
        return sum(sum(len(s.ids) for s in c.segments) for c in convs)

    entries = [cache_mod.finished_entry(root / split, k, chash) for split, k, _ in todo]
    finished = [e is not None for e in entries]
    base = identity.to_dict() if hasattr(identity, "to_dict") else dict(identity or {})
    check_finished_shards(root, todo, entries, base)
    progress = _Progress(sum(size(cs) for _, _, cs in todo), sum(size(cs) for (_, _, cs), f in zip(todo, finished) if f),
                         regen, bool(cfg.prep.progress), rank)
    initial, written = progress.bar.n, 0  # the bar's work: shards on disk, then those written here
    try:
        for (split, k, convs), done in zip(todo, finished):
            directory = root / split
            directory.mkdir(parents=True, exist_ok=True)
            if done:
                progress.update(size(convs) if regen else len(convs), 0)
                continue
            examples: dict = {}
            records, dropped = build_records(
                model, tokenizer, convs, labels_mode=str(cfg.labels), max_length=max_length,
                max_new_tokens=max_new, layers=layers, final_layer=L,
                batch_tokens=int(cfg.prep.batch_tokens), gen_batch_size=int(cfg.prep.gen_batch_size),
                progress=progress, storage=dtype, examples=examples,
                prepack_weights=prepack_mode(cfg.prep.get("prepack_weights", "auto")))
            for reason, ex in examples.items():
                print(f"data prep: dropped conversation {ex['id']!r} ({reason}: {ex['value']} at layer {ex['layer']}, "
                      f"position {ex['position']})", file=sys.stderr)
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
                                  {"config_hash": chash, "inputs_sha256": shard_inputs_sha256(convs),
                                   "base": {f: base.get(f) for f in IDENTITY_FIELDS},
                                   "dropped": dict(sorted(dropped.items())),
                                   **({"drop_examples": dict(sorted(examples.items()))} if examples else {})})
            written += size(convs)
            progress.shard_done(initial + written)
    finally:
        progress.close()
    manifests = {}
    for split in SPLITS:
        n = len(shards[split])
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
                  f"({empty_split_advice(split, data, cfg.data)})", file=sys.stderr)
    return summary


def empty_split_advice(split: str, data: SplitConversations, data_cfg) -> str:
    """What to change when ``split`` came out empty: under ``data.split_key=root``, when the largest root id
    gathers most conversations (enumerated ids such as ``conv_0`` ... ``conv_99``, which are no parts of one
    conversation but share the root ``conv``), ``data.split_key=id``; else the share or the count."""
    from data_prep.split import root_id

    ids = [c.id for c in (*data.train, *data.val)]
    if str(data_cfg.get("split_key", "root")) == "root" and ids:
        root, n = Counter(root_id(i) for i in ids).most_common(1)[0]
        if n > 1 and 2 * n >= len(ids):
            return (f"{n} of its {len(ids)} conversations share the root id {root!r} under data.split_key=root, "
                    "which keeps a root's parts on one side; if they are not parts of one conversation, set "
                    "data.split_key=id")
    if split == "train":
        return "lower data.heldout_fraction or raise data.max_conversations"
    return "raise data.max_conversations or data.heldout_fraction"


#: regeneration counts the summary lists under the replies regenerated (key, what it counts)
#: what data.max_length cuts from teacher-forced records (:func:`max_length_cuts`), summed in summary.json
TF_CUTS = ("tf_conversations", "tf_cut_conversations", "tf_turns", "tf_cut_turns")

REGEN_DETAILS = (
    ("regen_closed_by_template", "ended by another eos of the base, closed with the template's end-of-turn"),
    ("regen_rerendered_turns", "later turns whose context the template re-rendered (it rewrites earlier replies; "
                               "a new record each)"),
    ("regen_template_errors", "conversations ended because the template raised on a regenerated reply"),
    ("regen_turns_after_a_dropped_turn", "turns not regenerated because an earlier turn was dropped (its reply "
                                         "would be the dataset's)"),
)


def _summary(root: Path, data: SplitConversations, manifests: dict) -> dict[str, Any]:
    complete = all(m is not None for m in manifests.values())
    dropped = Counter(data.stats.dropped)
    truncated = turns = 0
    details, cuts = Counter(), Counter()
    totals = {"conversations": 0, "tokens": 0, "assistant_tokens": 0, "bytes": 0}
    per_split = {}
    examples = dict(data.stats.examples)
    for split, m in manifests.items():
        if m is None:
            continue
        dropped.update(m["dropped"])
        for entry in m["shards"]:  # the finite-value guard's first example per reason (shard sidecars)
            for reason, ex in entry.get("drop_examples", {}).items():
                examples.setdefault(reason, {"id": ex["id"], "message": f"{ex['value']} at layer {ex['layer']}, "
                                                                        f"position {ex['position']}"})
        cuts.update({key: dropped.pop(key, 0) for key in TF_CUTS})
        truncated += dropped.pop("regen_truncated_turns", 0)
        turns += dropped.pop("regen_turns", 0)
        details.update({key: dropped.pop(key, 0) for key, _ in REGEN_DETAILS})
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
        "drop_examples": dict(sorted(examples.items())),
        "fixed": dict(sorted(data.stats.fixed.items())),
        "fix_examples": dict(sorted(data.stats.fix_examples.items())),
        "regen_truncated_turns": truncated,
        "regen_turns": turns,
        **{key: details[key] for key, _ in REGEN_DETAILS},
        **{key: cuts[key] for key in TF_CUTS},
        "replaced_bytes": data.stats.replaced_bytes,
        "replaced_records": data.stats.replaced_records,
        "unparsed_bytes": data.stats.unparsed_bytes if data.stats.finished else None,
        "unparsed_regions": data.stats.unparsed_regions,
        "first_unparsed": data.stats.first_unparsed,
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
        *[f"  {k}: first {ex['id']!r}: {ex['message']}" for k, ex in s.get("drop_examples", {}).items()],
        "kept after normalisation: " + (", ".join(f"{k} {v:,}" for k, v in s.get("fixed", {}).items()) or "none"),
        *[f"  {k}: first {ex['id']!r}: {ex['message']}" for k, ex in s.get("fix_examples", {}).items()],
        f"bytes on disk: {s['bytes']:,}   bytes per token: {s['bytes_per_token']:.1f}"
        if s["bytes_per_token"] else f"bytes on disk: {s['bytes']:,}",
    ]
    if s.get("regen_turns"):
        lines.append(f"regenerated replies: {s['regen_turns']:,}, cut by prep.max_new_tokens / data.max_length "
                     f"(no end-of-turn): {s['regen_truncated_turns']:,} "
                     f"({100 * s['regen_truncated_turns'] / s['regen_turns']:.1f}%)")
        lines += [f"  {label}: {s[key]:,}" for key, label in REGEN_DETAILS if s.get(key)]
    elif s.get("regen_truncated_turns"):  # a cache written before replies were counted
        lines.append(f"regenerated turns cut by prep.max_new_tokens / data.max_length (no end-of-turn): "
                     f"{s['regen_truncated_turns']:,}")
    if s.get("tf_turns"):
        lines.append(f"cut by data.max_length: {s['tf_cut_conversations']:,} of {s['tf_conversations']:,} conversations "
                     f"({100 * s['tf_cut_conversations'] / s['tf_conversations']:.1f}%), {s['tf_cut_turns']:,} of "
                     f"{s['tf_turns']:,} assistant replies ({100 * s['tf_cut_turns'] / s['tf_turns']:.1f}%) not whole "
                     "with their end-of-turn")
    if s.get("replaced_bytes"):
        lines.append(f"bytes not valid in data.encoding (decoded as U+FFFD): {s['replaced_bytes']:,} "
                     f"in {s['replaced_records']:,} records")
    if s["unparsed_bytes"] is not None:
        lines.append(f"unparsed bytes in the input file: {s['unparsed_bytes']:,}")
        first = s.get("first_unparsed")
        if first:
            lines[-1] += (f" in {s['unparsed_regions']:,} region(s), skipped (no record there was read); the first: "
                          f"{first['file']}:{first['line']}, after {first['after_record']:,} records: {first['text']!r}")
    return "\n".join(lines)
