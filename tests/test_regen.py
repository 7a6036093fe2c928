"""labels=regenerate on the tiny Llama (fp32): continuous batching equals batch-1 greedy decoding,
its cached logits equal a fresh forward, a regeneration killed mid-shard resumes to the same bytes,
and the summary / progress bar state the replies cut."""
from __future__ import annotations

import bisect
import copy
import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from core.config import compose
from data_prep import labels as labels_mod
from data_prep import pipeline
from data_prep.cache import CacheReader, default_cache_dir
from data_prep.labels import regenerate
from data_prep.template import end_of_turn_ids
from tests.test_data_prep import _conversations as data_prep_conversations
from tests.test_data_prep import _reference_regeneration as reference_regeneration
from tests.test_data_prep import regen_sources_of


def _conversations(n: int) -> list[dict]:
    """Conversations of 1-3 turns whose prompts have very different lengths (1-4 phrases)."""
    return data_prep_conversations(n, prompt_phrases=lambda i: 1 + (i * 5) % 4, bad_record=False)


@pytest.fixture(scope="module")
def varied_dir(tmp_path_factory) -> Path:
    """A tiny Llama with initializer_range=0.3: varied greedy replies (the default init repeats one token)."""
    from core.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_varied"), seed=0, initializer_range=0.3)


@pytest.fixture(scope="module")
def varied(varied_dir):
    """``(model, tokenizer, identity)`` of :func:`varied_dir`, fp32, eager (as configs/model/smollm2.yaml)."""
    from core.base_model import load_base_model

    return load_base_model({"path": str(varied_dir), "dtype": "float32", "attn_implementation": "eager"})


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sharegpt") / "data.json"
    path.write_text(json.dumps(_conversations(14)))
    return path


def _messages(data_file, n):
    from data_prep.sharegpt import iter_conversations

    return list(iter_conversations(data_file))[:n]


def _eos_emitted(model, tok, convs, max_length):
    """The tiny random model almost never emits <|im_end|>; add a token it does emit as an
    end-of-turn id (never as a reply's first token, mostly a few tokens in), so turns end at
    different steps and conversations go on to later turns."""
    eos = end_of_turn_ids(tok, model)
    out = regenerate(model, tok, regen_sources_of(tok, convs, eos, max_length), eos, 12, max_length, batch_size=4)
    replies = [[t for t, m in zip(ids, mask) if m] for recs in out for ids, mask in recs]
    firsts = {r[0] for r in replies if r}
    score = Counter()
    for r in replies:
        for t in set(r) - firsts:
            if 2 <= r.index(t) < 10:
                score[t] += 1
    return eos | {min(score, key=lambda t: (-score[t], t))}


def _batch1_greedy(model, tok, source, eos, max_new_tokens, max_length):
    """Reference: HF ``generate`` at batch 1 (greedy, its own KV cache), one turn at a time
    (test_data_prep's reference; ``max_new_tokens=None``: up to ``max_length``)."""
    return reference_regeneration(model, tok, source, eos, 10**9 if max_new_tokens is None else max_new_tokens,
                                  max_length)


class _Spy:
    """Records the schedule of one regenerate call: each forward's rows, pending lengths, and slot moves."""

    def __init__(self, monkeypatch):
        self.forwards, self.moves = [], 0
        real = labels_mod._Regenerator._forward
        spy = self

        def forward(engine, slots):
            rows = list(range(len(engine.active))) if slots is None else list(slots)
            spy.forwards.append({"decode": slots is None, "rows": rows, "active": len(engine.active),
                                 "convs": [engine.active[s] for s in rows],
                                 "fed": [engine.convs[engine.active[s]].fed for s in rows],
                                 "pending": [len(engine.convs[engine.active[s]].pending) for s in rows]})
            return real(engine, slots)

        monkeypatch.setattr(labels_mod._Regenerator, "_forward", forward)
        real_run = labels_mod._Regenerator.run

        def run(engine, order):
            layer_cls = labels_mod._slot_layer_class()
            real_move = layer_cls.move

            def move(layer, dst, src, n):
                spy.moves += 1
                return real_move(layer, dst, src, n)

            monkeypatch.setattr(layer_cls, "move", move)
            try:
                return real_run(engine, order)
            finally:
                monkeypatch.setattr(layer_cls, "move", real_move)

        monkeypatch.setattr(labels_mod._Regenerator, "run", run)


def test_a_reply_marked_not_to_train_stays_as_written_in_the_regenerated_context(varied):
    """Regeneration writes only the trained replies: a reply marked ``"train": False`` is context as the dataset
    wrote it, like a user turn, and the next reply is greedy from the prompt that holds it."""
    from data_prep.sharegpt import Conversation

    model, tok, _ = varied
    messages = [{"role": "user", "content": "Hello! How can I help you today?"},
                {"role": "assistant", "content": "The quick brown fox", "train": False},
                {"role": "user", "content": "Please write a short poem about the sea."},
                {"role": "assistant", "content": "jumps over the lazy dog."}]
    eos = end_of_turn_ids(tok, model)
    [source] = regen_sources_of(tok, [Conversation("marked", messages)], eos, 160)
    prompt = list(tok.apply_chat_template(messages[:3], tokenize=True, return_dict=False, add_generation_prompt=True))
    assert source.turns == [3] and source.prompt == prompt
    [records] = regenerate(model, tok, [source], eos, 10, 160, batch_size=2)
    assert records == _batch1_greedy(model, tok, source, eos, 10, 160)
    [(ids, mask)] = records
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)]) and all(mask[len(prompt):])


@pytest.mark.parametrize("max_new_tokens", [10, None])
def test_continuous_batching_equals_batch_1_greedy(varied, data_file, monkeypatch, max_new_tokens):
    model, tok, _ = varied
    max_length = 160 if max_new_tokens else 112  # full length: every turn runs on to max_length or eos
    convs = _messages(data_file, 10)
    eos = _eos_emitted(model, tok, convs, max_length)
    segs = regen_sources_of(tok, convs, eos, max_length)
    want = [_batch1_greedy(model, tok, s, eos, max_new_tokens, max_length) for s in segs]
    # every conversation in its own slot from the start: rows finish in any order, and the busy
    # rows are packed into the first slots (moved) as others end
    packed = _Spy(monkeypatch)
    assert regenerate(model, tok, segs, eos, max_new_tokens, max_length, batch_size=len(segs)) == want
    assert packed.moves > 0
    spy = _Spy(monkeypatch)
    stats = Counter()
    got = regenerate(model, tok, segs, eos, max_new_tokens, max_length, batch_size=3, stats=stats)
    assert got == want
    # the schedule exercised what it claims: 3 slots for 10 conversations, so conversations were
    # admitted into freed slots while the other rows were mid-reply (refills), prefills were
    # left-padded (different pending lengths in one forward) over rows of different lengths,
    # a conversation's next turn was prefilled on top of its own cached turns, rows finished at
    # different steps
    started = {}
    for f in spy.forwards:
        for c, fed in zip(f["convs"], f["fed"]):
            started.setdefault(c, fed)
    assert len(started) == len(segs) and all(fed == 0 for fed in started.values())
    refills = [f for f in spy.forwards if not f["decode"] and 0 in f["fed"] and f["active"] == 3 and len(f["rows"]) < 3]
    assert refills, "no conversation joined a running batch"
    assert any(len(set(f["pending"])) > 1 for f in spy.forwards if not f["decode"]) or \
        any(len(set(f["fed"])) > 1 for f in spy.forwards if f["decode"])
    assert any(not f["decode"] and any(fed > 0 for fed in f["fed"]) for f in spy.forwards), "no turn continued in place"
    assert any(len(set(f["fed"])) > 1 for f in spy.forwards if f["decode"])
    records = [r for recs in got for r in recs]
    assert stats["turns"] == sum(sum(1 for a, b in zip([False] + m, m) if b and not a) for _, m in records)
    assert any(sum(1 for a, b in zip(m, m[1:]) if b and not a) > 1 for _, m in records)  # some multi-turn
    assert stats["truncated_turns"] == sum(1 for ids, m in records if m and m[-1] and ids[-1] not in eos)
    assert stats["generated_tokens"] == sum(sum(m) for _, m in records)


def test_batch_size_does_not_change_fp32_tokens(varied, data_file):
    model, tok, _ = varied
    convs = _messages(data_file, 9)
    eos = _eos_emitted(model, tok, convs, 96)
    segs = regen_sources_of(tok, convs, eos, 96)
    one = regenerate(model, tok, segs, eos, 8, 96, batch_size=1)
    assert regenerate(model, tok, segs, eos, 8, 96, batch_size=4) == one
    assert regenerate(model, tok, segs, eos, 8, 96, batch_size=64) == one


@pytest.mark.parametrize("template_name", ["chatml", "deepseek_r1_like"])
def test_every_forward_of_the_slot_cache_equals_a_fresh_forward(varied, data_file, monkeypatch, template_name):
    """The logits after each row's fed tokens (left-padded prefills, refilled slots, turns appended
    in place, rows moved between slots) equal a full forward of that row's tokens so far.

    Both are fp32 and neither is exact: they are held to a float64 forward of the same tokens, and
    the cached logits may be off it by at most 3x (+1e-5) what a fresh fp32 forward is.  On an AMD
    EPYC a fresh forward is itself up to 5e-5 off at logits of about 8; a stale or misplaced cache
    entry is off by O(1)."""
    model, tok, _ = varied
    if template_name != "chatml":  # a template that re-renders history: re-rendered records refill their slot
        tok = _with_template(tok, template_name)
    model64 = copy.deepcopy(model).double()
    convs = _messages(data_file, 7)
    eos = _eos_emitted(model, tok, convs, 96)
    segs = regen_sources_of(tok, convs, eos, 96)
    real = labels_mod._Regenerator._forward
    checked = [0]

    def forward(engine, slots):
        rows = list(range(len(engine.active))) if slots is None else list(slots)
        contexts = [list(engine.convs[engine.active[s]].ids[: engine.convs[engine.active[s]].fed])
                    + list(engine.convs[engine.active[s]].pending) for s in rows]
        logits = real(engine, slots)
        with torch.no_grad():
            for ctx, got in zip(contexts, logits):
                ref = model(torch.tensor([ctx])).logits[0, -1].double()
                exact = model64(torch.tensor([ctx])).logits[0, -1]
                fresh_error = float((ref - exact).abs().max())
                cached_error = float((got.double() - exact).abs().max())
                assert cached_error <= 3 * fresh_error + 1e-5, (cached_error, fresh_error)
                checked[0] += 1
        return logits

    monkeypatch.setattr(labels_mod._Regenerator, "_forward", forward)
    stats = Counter()
    regenerate(model, tok, segs, eos, 6, 96, batch_size=3, stats=stats)
    assert checked[0] > 30
    assert (stats["rerendered_turns"] > 0) == (template_name != "chatml")


def test_sliding_window_narrower_than_max_length_is_refused(varied):
    model, tok, _ = varied
    old = (getattr(model.config, "sliding_window", None), getattr(model.config, "layer_types", None))
    try:
        model.config.sliding_window = 16
        model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
        with pytest.raises(ValueError, match="sliding_window=16"):
            regenerate(model, tok, [], {2}, 4, 96)
    finally:
        model.config.sliding_window, model.config.layer_types = old


def test_attention_implementation_is_restored(varied, data_file):
    model, tok, _ = varied
    assert model.config._attn_implementation == "eager"
    convs = _messages(data_file, 2)
    eos = end_of_turn_ids(tok, model)
    segs = regen_sources_of(tok, convs, eos, 96)
    seen = []
    regenerate(model, tok, segs, eos, 2, 96, on_generated=lambda n: seen.append(model.config._attn_implementation))
    assert seen and set(seen) == {"sdpa"} and model.config._attn_implementation == "eager"


# -- pipeline: resume, summary, progress ------------------------------------------------------

def _cfg(model_dir, data_file, out_dir, *extra):
    return compose([f"model.path={model_dir}", "model.dtype=float32", "model.attn_implementation=eager",
                    f"data.path={data_file}", "data.max_conversations=null", "data.heldout_fraction=0.25",
                    "data.max_length=96", "prep.shard_size=3", "prep.batch_tokens=200", "prep.progress=false",
                    "prep.gen_batch_size=2", "prep.max_new_tokens=12", "labels=regenerate",
                    f"output_root={out_dir}", *extra])


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".") and p.name != "config.yaml"}  # it names output_root


def test_regeneration_killed_mid_shard_resumes_to_identical_bytes(varied, varied_dir, data_file, tmp_path,
                                                                   monkeypatch):
    model, tok, ident = varied
    whole = _cfg(varied_dir, data_file, tmp_path / "whole")
    pipeline.prepare(whole, model, tok, ident, rank=0, world=1, out=None)
    want = _digests(default_cache_dir(whole))
    assert sum(1 for k in want if k.endswith(".safetensors") and "shard" in k) >= 4

    cut = _cfg(varied_dir, data_file, tmp_path / "cut")
    root = default_cache_dir(cut)
    real = pipeline._Progress.generated
    calls = {"n": 0, "at_kill": None}

    class Killed(Exception):
        pass

    def generated(self, tokens):
        real(self, tokens)
        calls["n"] += 1
        shards = sorted(root.rglob("shard-*.safetensors"))
        if len(shards) >= 2 and calls["at_kill"] is None and self.live and self.live["generated_tokens"] > 4:
            calls["at_kill"] = [str(p.relative_to(root)) for p in shards]
            raise Killed  # mid-batch: the running shard has generated tokens, none of them written

    monkeypatch.setattr(pipeline._Progress, "generated", generated)
    with pytest.raises(Killed):
        pipeline.prepare(cut, model, tok, ident, rank=0, world=1, out=None)
    on_disk = sorted(str(p.relative_to(root)) for p in root.rglob("shard-*.safetensors"))
    assert on_disk == calls["at_kill"] and not (root / "summary.json").exists()
    assert not any(p.name.endswith(".tmp") or ".tmp" in p.name for p in root.rglob("*"))
    kept = {k: v for k, v in _digests(root).items() if k in on_disk}
    assert kept == {k: want[k] for k in on_disk}  # what was written before the kill is already final

    monkeypatch.setattr(pipeline._Progress, "generated", real)
    regenerated = []
    real_build = pipeline.build_records

    def build(*args, **kwargs):
        regenerated.append(len(args[2]))
        return real_build(*args, **kwargs)

    monkeypatch.setattr(pipeline, "build_records", build)
    summary = pipeline.prepare(cut, model, tok, ident, rank=0, world=1, out=None)
    assert summary["complete"]
    got = _digests(root)
    assert got == want
    n_shards = sum(1 for k in want if k.endswith(".safetensors") and "shard" in k)
    assert len(regenerated) == n_shards - len(on_disk)  # finished shards were not regenerated again


def test_summary_states_the_share_of_replies_cut(varied, varied_dir, data_file, tmp_path):
    model, tok, ident = varied
    cfg = _cfg(varied_dir, data_file, tmp_path, "prep.max_new_tokens=6")
    summary = pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    eos = end_of_turn_ids(tok, model)
    turns = cut = 0
    for split in ("train", "val"):
        reader = CacheReader(default_cache_dir(cfg) / split)
        for i in range(len(reader)):
            r = reader[i]
            m, ids = r["loss_mask"].tolist(), r["input_ids"].tolist()
            ends = [t for t in range(len(m)) if m[t] and (t + 1 == len(m) or not m[t + 1])]
            turns += len(ends)
            cut += sum(1 for t in ends if ids[t] not in eos)
    assert summary["regen_turns"] == turns > 0 and summary["regen_truncated_turns"] == cut > 0
    text = pipeline.format_summary(summary)
    assert f"regenerated replies: {turns:,}, cut by prep.max_new_tokens / data.max_length" in text
    assert f"{cut:,} ({100 * cut / turns:.1f}%)" in text


def test_regeneration_progress_counts_conversations_with_rate_and_eta(varied, varied_dir, data_file, tmp_path,
                                                                      capsys):
    model, tok, ident = varied
    cfg = _cfg(varied_dir, data_file, tmp_path, "prep.progress=true")
    summary = pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    err = capsys.readouterr().err
    n = summary["records_read"] - sum(v for k, v in summary["dropped"].items() if k != "no_assistant_tokens")
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert f"{n}/{n}" in last and ("conv/s" in last or "s/conv" in last)
    assert "tok/s" in last and "cut" in last and "%)" in last
    # a resumed run starts the bar at the shards already on disk
    pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    err = capsys.readouterr().err
    assert f"{n}/{n}" in err.replace("\r", "\n").strip().splitlines()[0]


def _reply_ends(mask: list[bool]) -> list[int]:
    """Positions of the last generated token of each reply (the end of each run of True)."""
    return [t for t in range(len(mask)) if mask[t] and (t + 1 == len(mask) or not mask[t + 1])]


def test_finite_value_guard_drops_and_counts_a_regenerated_conversation(varied, varied_dir, data_file, tmp_path,
                                                                         monkeypatch):
    """labels=regenerate keeps main's finite-value guard: a conversation whose regenerated features
    hold a NaN is dropped and counted (non_finite_hidden, with its example), the rest are cached, and
    regen_turns counts the replies as regenerated (the dropped conversation's included)."""
    model, tok, ident = varied
    real_regen, real_ff = pipeline.regenerate, pipeline.forward_features
    outputs: dict[tuple, list[bool]] = {}
    poisoned: list[tuple] = []

    def regen(*args, **kwargs):
        out = real_regen(*args, **kwargs)
        outputs.update({tuple(ids): list(mask) for recs in out for ids, mask in recs})
        return out

    def ff(model_, seqs, pad_id, layers, **kw):
        out = real_ff(model_, seqs, pad_id, layers, **kw)
        if not poisoned:
            poisoned.append(tuple(seqs[0]))
            out[0]["hidden"][max(layers)] = out[0]["hidden"][max(layers)].clone()
            out[0]["hidden"][max(layers)][len(seqs[0]) // 2, 3] = float("nan")
        return out

    monkeypatch.setattr(pipeline, "regenerate", regen)
    monkeypatch.setattr(pipeline, "forward_features", ff)
    cfg = _cfg(varied_dir, data_file, tmp_path)
    summary = pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    assert summary["dropped"].get("non_finite_hidden") == 1
    assert summary["drop_examples"]["non_finite_hidden"]["message"].startswith("nan at layer")
    kept, turns = 0, 0
    for split in ("train", "val"):
        reader = CacheReader(default_cache_dir(cfg) / split)
        for i in range(len(reader)):
            r = reader[i]
            assert tuple(r["input_ids"].tolist()) != poisoned[0]
            assert all(torch.isfinite(t).all() for t in (r["hidden"], *r["aux_hidden"].values()))
            turns += len(_reply_ends(r["loss_mask"].tolist()))
            kept += 1
    assert kept == sum(1 for m in outputs.values() if any(m)) - 1
    assert summary["regen_turns"] == turns + len(_reply_ends(outputs[poisoned[0]])) > turns
    text = pipeline.format_summary(summary)
    assert "non_finite_hidden 1" in text and f"regenerated replies: {summary['regen_turns']:,}" in text


def test_a_reply_ended_by_another_eos_is_closed_as_the_template_closes_it():
    """A base whose generation config has two eos ids (Qwen2.5-Instruct: <|im_end|>, <|endoftext|>) may
    end a reply with the one the template does not close turns with.  At inference the reply stops
    there and the template writes its own closing token before the next turn
    (evaluation.turns.follow_up_prompt); the regenerated conversation's next turn is trained on that
    same context, not on <|endoftext|>\\n<|im_start|>user."""
    from core.tiny import tiny_llama, tiny_tokenizer
    from evaluation.prompts import Prompt, template
    from evaluation.turns import follow_up_prompt

    tok = tiny_tokenizer()
    model = tiny_llama(seed=0, vocab_size=len(tok))
    model.config._attn_implementation = "eager"
    model.generation_config.eos_token_id = [2, 0]  # <|im_end|> (the template's), <|endoftext|>
    eot = end_of_turn_ids(tok, model)
    assert eot == {0, 2} and tok.convert_ids_to_tokens(0) == "<|endoftext|>"
    msgs = [{"role": "user", "content": "Hello! How can I help you today?"},
            {"role": "assistant", "content": "The quick brown fox"},
            {"role": "user", "content": "Please write a short poem about the sea."},
            {"role": "assistant", "content": "jumps over the lazy dog."}]
    from data_prep.front import template_conversations
    from data_prep.labels import regen_sources
    from data_prep.sharegpt import Conversation, ReadStats

    templated = list(template_conversations(tok, [Conversation("c", msgs)], eot, 200, ReadStats()))
    calls = {"n": 0}

    def endoftext_at_step_5(module, inputs, out):  # the 4th generated token of turn 1 is <|endoftext|>
        calls["n"] += 1
        if calls["n"] == 5:
            out = out.clone()
            out[..., 0] = 1e4
        return out

    hook = model.lm_head.register_forward_hook(endoftext_at_step_5)
    stats: Counter = Counter()
    ((ids, mask),), = regenerate(model, tok, regen_sources(templated), eot, 8, 200, stats=stats)
    hook.remove()
    starts = [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]
    end1 = max(k for k in range(starts[0], starts[1]) if mask[k])
    assert ids[end1] == 2 and stats["closed_by_template"] == 1  # generated 0, closed as the template does
    first = Prompt("c", msgs[:1], template(tok, msgs[:1]), follow_ups=(msgs[2]["content"],))
    assert first.input_ids.tolist() == ids[:starts[0]]
    generated = ids[starts[0]:end1] + [0]  # what vanilla decoding emitted
    assert ids[:starts[1]] == follow_up_prompt(tok, first, generated, sorted(eot)).input_ids.tolist()
    # data prep counts it, and the summary says so
    calls["n"] = 0
    hook = model.lm_head.register_forward_hook(endoftext_at_step_5)
    records, counts = pipeline.build_records(model, tok, templated, labels_mode="regenerate",
                                             max_length=200, max_new_tokens=8, layers=[], final_layer=4,
                                             batch_tokens=4096, gen_batch_size=1)
    hook.remove()
    assert list(records[0]["input_ids"]) == ids and counts["regen_closed_by_template"] == 1
    text = pipeline.format_summary({"complete": True, "cache_dir": "c", "conversations": 1, "splits": {}, "tokens": 1,
                                    "assistant_tokens": 1, "records_read": 1, "dropped": {}, "bytes": 1,
                                    "bytes_per_token": 1.0, "regen_turns": 2, "regen_truncated_turns": 0,
                                    "regen_closed_by_template": 1, "unparsed_bytes": None})
    assert "ended by another eos of the base, closed with the template's end-of-turn: 1" in text


# -- templates that rewrite history: later turns follow the regenerated replies ----------------

def _with_template(tok, name):
    from tests.test_data_prep_views import TEMPLATES

    out = copy.deepcopy(tok)
    out.chat_template = TEMPLATES[name]
    return out


@pytest.mark.parametrize("name", ["qwen3_like", "deepseek_r1_like", "trim_earlier_replies"])
def test_history_rewriting_templates_regenerate_each_turn_from_the_regenerated_replies(varied, data_file, name):
    """Every turn's context is the evaluation's multi-turn prompt over the *regenerated* replies
    (evaluation.turns.follow_up_prompt), never the dataset's: a template that re-renders the history
    starts a new record from its own rendering of the regenerated conversation; one that extends it
    keeps one record, even where the dataset's replies forced a split."""
    from data_prep.front import template_conversations
    from data_prep.sharegpt import ReadStats
    from evaluation.prompts import template

    model, chatml, _ = varied
    tok = _with_template(chatml, name)
    convs = _messages(data_file, 10)
    eos = _eos_emitted(model, tok, convs, 160)
    sources = regen_sources_of(tok, convs, eos, 160)
    stats = Counter()
    got = regenerate(model, tok, sources, eos, 10, 160, batch_size=3, stats=stats)
    assert got == [reference_regeneration(model, tok, s, eos, 10, 160) for s in sources]
    turns_written = sum(sum(1 for a, b in zip([False] + m, m) if b and not a) for recs in got for _, m in recs)
    assert turns_written == stats["turns"] and any(len(s.turns) > 1 for s in sources)
    continued = [(s, recs) for s, recs in zip(sources, got) if sum(
        sum(1 for a, b in zip([False] + m, m) if b and not a) for _, m in recs) > 1]
    assert continued, "no conversation reached a second turn"
    if name == "qwen3_like":
        # the dataset's replies render differently in history (their empty think block), so templating
        # splits the conversations; the regenerated replies hold no reasoning and extend the prompt
        split = list(template_conversations(tok, convs, eos, 160, ReadStats()))
        assert len(split) > len(sources) and all(len(recs) == 1 for _, recs in continued)
        assert stats["rerendered_turns"] == 0
    else:
        assert stats["rerendered_turns"] > 0 and any(len(recs) > 1 for _, recs in continued)
        # the second record's context: the template over the regenerated first reply, not the dataset's
        differs = 0
        for s, recs in continued:
            if len(recs) < 2:  # a reply of at most 6 characters: the trimming template kept it whole
                continue
            ids, mask = recs[1]
            context = ids[:mask.index(True)]
            differs += context != template(tok, s.messages[: s.turns[1]]).tolist()
        assert differs > 0


def test_shards_keep_a_conversations_records_together_under_regeneration():
    """A conversation's records (one messages list) share a shard; two conversations that repeat an id
    (a mixture whose sources both number their records) stay two conversations."""
    from data_prep.front import TemplatedConversation
    from data_prep.labels import regen_sources
    from data_prep.template import Segment

    def conv(cid, n_records, turns=(1, 3, 5)):
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{cid}{i}"} for i in range(6)]
        return [TemplatedConversation(cid if k == 0 else f"{cid}#{k}", cid,
                                      [Segment("assistant", [1, 2, 3], header=1, body=2, turn=t)
                                       for t in turns[k::n_records]], msgs) for k in range(n_records)]

    recs = conv("a", 1) + conv("b", 3) + conv("c", 1) + conv("a", 2) + conv("d", 1)
    by_conv = pipeline.shard_records(recs, 2, by_conversation=True)
    assert [[r.id for r in s] for s in by_conv] == [["a", "b", "b#1", "b#2"], ["c", "a", "a#1"], ["d"]]
    assert [[r.id for r in s] for s in pipeline.shard_records(recs, 2)] == [["a", "b"], ["b#1", "b#2"], ["c", "a"],
                                                                            ["a#1", "d"]]
    sources = regen_sources(recs)
    # the second "a" holds its turns out of order (1, 5 in one record, 3 in the next): only turn 1 is consecutive
    assert [(s.id, s.turns) for s in sources] == [("a", [1, 3, 5]), ("b", [1, 3, 5]), ("c", [1, 3, 5]), ("a", [1]),
                                                  ("d", [1, 3, 5])]
    assert sources[3].messages is recs[5].messages and sources[0].messages is not sources[3].messages
    # a kept turn after a dropped one is left out (its context would hold the dataset's reply) and counted
    stats = Counter()
    gap = regen_sources(conv("e", 1, turns=(1, 5)), stats)
    assert gap[0].turns == [1] and stats["turns_after_a_dropped_turn"] == 1
    assert regen_sources(conv("f", 1, turns=(3, 5)))[0].turns == [3, 5]  # from the first kept turn


def test_regen_prompt_of_a_first_kept_turn_after_an_empty_reply():
    """A first segment whose reply rendered no tokens is context, not a turn to write: the first kept
    turn's generation prompt is every token before its body (that segment whole, then its header)."""
    from data_prep.front import TemplatedConversation
    from data_prep.labels import regen_sources
    from data_prep.template import Segment, flatten

    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(6)]
    segments = [Segment("assistant", [10, 11, 12, 13], header=3, body=0, turn=1),
                Segment("assistant", [20, 21, 22, 23, 24], header=2, body=2, turn=3),
                Segment("assistant", [30, 31, 32], header=1, body=1, turn=5)]
    (source,) = regen_sources([TemplatedConversation("z", "z", segments, msgs)])
    ids, mask = flatten(segments)
    assert source.turns == [3, 5]
    assert source.prompt == [10, 11, 12, 13, 20, 21] == ids[: mask.index(True)]


def test_regenerated_cache_under_a_history_rewriting_template(varied, varied_dir, data_file, tmp_path):
    """Data prep writes the records of a re-rendered conversation as ``<id>``, ``<id>#1``, ... in one
    shard, every generated token the base's greedy label at the position before it (an end-of-turn the
    template closes with its own token excepted), and counts the re-rendered turns."""
    model, chatml, ident = varied
    tok = _with_template(chatml, "trim_earlier_replies")
    eos = _eos_emitted(model, tok, _messages(data_file, 14), 96)
    old = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = sorted(eos)  # a token the random base emits ends its turns
    try:
        cfg = _cfg(varied_dir, data_file, tmp_path)
        summary = pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    finally:
        model.generation_config.eos_token_id = old
    assert summary["regen_rerendered_turns"] > 0
    assert "later turns whose context the template re-rendered" in pipeline.format_summary(summary)
    ids, shards = [], {}
    for split in ("train", "val"):
        reader = CacheReader(default_cache_dir(cfg) / split)
        for i in range(len(reader)):
            r = reader[i]
            ids.append(r["id"])
            shards.setdefault(r["id"].split("#")[0], set()).add((split, bisect.bisect_right(reader._starts, i)))
            pos = r["loss_mask"].nonzero().flatten()
            generated = [int(p) for p in pos if int(r["input_ids"][p]) not in eos]
            assert generated and all(int(r["labels"][p - 1]) == int(r["input_ids"][p]) for p in generated)
    later = [i for i in ids if "#" in i]
    assert later and all(i.split("#")[0] in ids for i in later)
    assert all(len(v) == 1 for v in shards.values())  # a conversation's records in one shard


def test_a_regenerated_reply_the_template_cannot_render_ends_its_conversation_counted_and_named(varied, data_file):
    """A template that raises on the base's reply (here: on any reply that does not open like the
    dataset's) ends that conversation after the reply, keeps what was written, counts it and names
    the first; the other conversations go on."""
    model, chatml, _ = varied
    tok = copy.deepcopy(chatml)
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' and m.content[:2] not in "
        "['Th', 'ju', 'He', 'Pl', 'de', 're', '1 ', 'Sp', 'an'] %}{{ raise_exception('not a dataset reply') }}"
        "{% endif %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    convs = _messages(data_file, 8)
    eos = _eos_emitted(model, chatml, convs, 160)
    sources = regen_sources_of(tok, convs, eos, 160)
    assert any(len(s.turns) > 1 for s in sources)
    stats, errors = Counter(), {}
    got = regenerate(model, tok, sources, eos, 10, 160, batch_size=3, stats=stats, errors=errors)
    ended = [recs for recs in got if recs and recs[-1][0][-1] in eos]  # replies that ended: their template raised
    assert stats["template_errors"] == len(ended) > 0
    assert all(len(recs) == 1 and sum(1 for a, b in zip([False] + m, m) if b and not a) == 1
               for recs in ended for _, m in recs)  # one reply written, nothing after it
    assert "not a dataset reply" in errors["template_errors"] and "turn 1" in errors["template_errors"]


@pytest.mark.parametrize("mode, packs", [("true", True), ("false", False), ("auto", False)])
def test_regeneration_packs_its_weights_as_asked_and_featurises_unpacked(varied, varied_dir, data_file, tmp_path,
                                                                          monkeypatch, mode, packs):
    """prep.prepack_weights packs the base for regeneration only (auto: bf16 where packed bf16 was measured the
    fastest, never fp32), restores it before the features are computed, and is no part of the cache's identity."""
    import copy

    from decoding.prepacked import can_pack, packed_layers

    if not can_pack(torch.bfloat16):
        pytest.skip("this CPU's oneDNN does not pack bf16")
    model = copy.deepcopy(varied[0]).to(torch.bfloat16)
    tok, ident = varied[1], varied[2]
    during, real = [], pipeline.regenerate
    featurised = []
    real_features = pipeline.forward_features

    def spy(m, *a, **k):
        during.append(packed_layers(m))
        return real(m, *a, **k)

    def spy_features(m, *a, **k):
        featurised.append(packed_layers(m))
        return real_features(m, *a, **k)

    monkeypatch.setattr(pipeline, "regenerate", spy)
    monkeypatch.setattr(pipeline, "forward_features", spy_features)
    cfg = _cfg(varied_dir, data_file, tmp_path, "model.dtype=bfloat16", f"prep.prepack_weights={mode}")
    pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    assert during and all((n > 0) == packs for n in during)
    assert featurised and set(featurised) == {0} and packed_layers(model) == 0
    assert default_cache_dir(cfg) == default_cache_dir(_cfg(varied_dir, data_file, tmp_path, "model.dtype=bfloat16"))
