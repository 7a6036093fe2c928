"""Data-prep pipeline on the tiny Llama: features vs a fresh forward pass, labels, resume, ranks,
greedy regeneration, reader + collate."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch

from core.config import UserInputError, compose, save_config
from data_prep import cache as cache_mod
from data_prep import pipeline
from data_prep.cache import CacheReader, collate, default_cache_dir, rank_world
from data_prep.labels import regenerate
from data_prep.template import end_of_turn_ids

WORDS = ["The quick brown fox", "jumps over the lazy dog.", "Hello! How can I help you today?",
         "Please write a short poem about the sea.", "def add(a, b):", "return a + b", "1 2 3 4 5",
         "Speculative decoding drafts several tokens", "and verifies them in one forward pass."]


def _conversations(n: int, prompt_phrases=lambda i: 1 + i % 2, bad_record: bool = True) -> list[dict]:
    """``n`` ShareGPT records ``conv-<i>`` of 1-3 turns; a prompt of conversation i has
    ``prompt_phrases(i)`` phrases of :data:`WORDS`; ``bad_record`` inserts one that starts with
    the assistant (dropped by the record checks) at position 3."""
    out = []
    for i in range(n):
        turns = []
        for j in range(1 + i % 3):
            turns.append({"from": "human", "value": " ".join(WORDS[(i + j + k) % len(WORDS)] for k in range(prompt_phrases(i)))})
            turns.append({"from": "gpt", "value": " ".join(WORDS[(2 * i + j + k) % len(WORDS)] for k in range(1 + (i + j) % 4))})
        out.append({"id": f"conv-{i}", "conversations": turns})
    if bad_record:
        out.insert(3, {"id": "bad", "conversations": [{"from": "gpt", "value": "starts with gpt"}]})
    return out


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sharegpt") / "data.json"
    path.write_text(json.dumps(_conversations(13)))
    return path


def _cfg(tiny_model_dir, data_file, out_dir, *extra):
    return compose([f"model.path={tiny_model_dir}", "model.dtype=float32", "model.attn_implementation=eager",
                    f"data.path={data_file}", "data.max_conversations=null", "data.heldout_fraction=0.25",
                    "data.max_length=96", "prep.shard_size=3", "prep.batch_tokens=200", "prep.progress=false",
                    "labels=teacher_forced", f"output_root={out_dir}", *extra])


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".") and p.name != "config.yaml"}


def test_cache_equals_fresh_forward_pass_and_argmax_labels(tiny_base, tiny_model_dir, data_file, tmp_path):
    model, tok, ident = tiny_base
    cfg = _cfg(tiny_model_dir, data_file, tmp_path, "prep.dtype=float32", "prep.layers=[1,3]")
    summary = pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    root = default_cache_dir(cfg)
    assert (root / "config.yaml").is_file() and (root / "summary.json").is_file()
    assert summary["dropped"] == {"no_assistant_turn": 1}  # [gpt] alone: the leading assistant turn is dropped, nothing left
    assert summary["splits"]["train"]["conversations"] + summary["splits"]["val"]["conversations"] == 13
    assert summary["splits"]["val"]["conversations"] > 0
    seen = set()
    W = model.get_output_embeddings().weight
    for split in ("train", "val"):
        reader = CacheReader(root / split, verify=True)
        assert reader.manifest["layers"] == [1, 3] and reader.manifest["final_layer"] == 4
        for i in range(len(reader)):
            rec = reader[i]
            seen.add(rec["id"])
            with torch.no_grad():
                out = model(rec["input_ids"][None], output_hidden_states=True)
            hs = out.hidden_states
            assert torch.allclose(W @ hs[-1][0].T, out.logits[0].T, atol=1e-5)  # hs[L] is what the head reads
            torch.testing.assert_close(rec["hidden"], hs[4][0], atol=2e-5, rtol=1e-4)
            for l in (1, 3):
                torch.testing.assert_close(rec["aux_hidden"][l], hs[l][0], atol=2e-5, rtol=1e-4)
            assert torch.equal(rec["labels"], out.logits[0].argmax(-1))
            assert rec["input_ids"].dtype == torch.long and rec["loss_mask"].dtype == torch.bool
            assert rec["loss_mask"].any() and len(rec["input_ids"]) <= 96
    assert len(seen) == 13 and "bad" not in seen


def test_default_dtype_is_bf16_and_bytes_close_to_raw(tiny_base, tiny_model_dir, data_file, tmp_path):
    model, tok, ident = tiny_base
    cfg = _cfg(tiny_model_dir, data_file, tmp_path)
    pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    reader = CacheReader(default_cache_dir(cfg) / "train")
    rec = reader[0]
    assert rec["hidden"].dtype == torch.bfloat16
    with torch.no_grad():
        ref = model(rec["input_ids"][None], output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(rec["hidden"].float(), ref, atol=2e-2, rtol=1e-2)
    m = reader.manifest
    raw = m["num_tokens"] * (4 + 4 + 1 + 64 * 2) + 8 * (m["num_records"] + m["num_shards"])
    assert raw <= m["bytes"] <= 1.02 * raw + 2048 * m["num_shards"]  # one small header per shard


def test_cache_dir_follows_cache_defining_config(tiny_model_dir, data_file, tmp_path):
    a = default_cache_dir(_cfg(tiny_model_dir, data_file, tmp_path))
    assert a == default_cache_dir(_cfg(tiny_model_dir, data_file, tmp_path, "prep.batch_tokens=999"))
    assert a != default_cache_dir(_cfg(tiny_model_dir, data_file, tmp_path, "data.max_length=64"))
    assert a != default_cache_dir(_cfg(tiny_model_dir, data_file, tmp_path, "labels=regenerate"))
    assert default_cache_dir(_cfg(tiny_model_dir, data_file, tmp_path, f"prep.cache_dir={tmp_path}/x")) == tmp_path / "x"


def test_killed_mid_shard_and_resumed_is_byte_identical(tiny_base, tiny_model_dir, data_file, tmp_path, monkeypatch):
    model, tok, ident = tiny_base
    ref_cfg = _cfg(tiny_model_dir, data_file, tmp_path / "ref")
    pipeline.prepare(ref_cfg, model, tok, ident, rank=0, world=1, out=None)
    ref = _files(default_cache_dir(ref_cfg))

    cfg = _cfg(tiny_model_dir, data_file, tmp_path / "run")
    root = default_cache_dir(cfg)
    real_forward = pipeline.forward_features
    calls = {"n": 0}

    def dying_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:  # inside the 3rd shard: earlier batches of it are done, nothing written yet
            raise KeyboardInterrupt("simulated kill")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(pipeline, "forward_features", dying_forward)
    with pytest.raises(KeyboardInterrupt):
        pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    monkeypatch.setattr(pipeline, "forward_features", real_forward)
    assert not (root / "train" / "manifest.json").exists()
    partial = sorted(p.name for p in (root / "train").glob("shard-*.safetensors"))
    assert 0 < len(partial) < len(list((default_cache_dir(ref_cfg) / "train").glob("shard-*.safetensors")))

    # tear one finished shard (as a crash of a non-atomic copy would) — resume must rewrite it
    torn = root / "train" / partial[0]
    torn.write_bytes(torn.read_bytes()[:100])
    written = []
    real_write = cache_mod.write_shard
    monkeypatch.setattr(cache_mod, "write_shard", lambda d, k, *a: written.append((d.name, k)) or real_write(d, k, *a))
    pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    assert ("train", 0) in written and ("train", 1) not in written  # intact shards skipped
    assert _files(root) == ref


def test_one_and_two_ranks_give_the_same_cache(tiny_base, tiny_model_dir, data_file, tmp_path):
    model, tok, ident = tiny_base
    one = _cfg(tiny_model_dir, data_file, tmp_path / "one")
    pipeline.prepare(one, model, tok, ident, rank=0, world=1, out=None)
    two = _cfg(tiny_model_dir, data_file, tmp_path / "two")
    s0 = pipeline.prepare(two, model, tok, ident, rank=0, world=2, out=None)
    assert not s0["complete"] and not (default_cache_dir(two) / "train" / "manifest.json").exists()
    s1 = pipeline.prepare(two, model, tok, ident, rank=1, world=2, out=None)
    assert s1["complete"]
    assert _files(default_cache_dir(two)) == _files(default_cache_dir(one))


def test_rank_world_from_torchrun_or_slurm():
    assert rank_world({}) == (0, 1)
    assert rank_world({"RANK": "2", "WORLD_SIZE": "4"}) == (2, 4)
    assert rank_world({"SLURM_PROCID": "1", "SLURM_NTASKS": "3"}) == (1, 3)
    with pytest.raises(ValueError, match="RANK"):
        rank_world({"RANK": "4", "WORLD_SIZE": "4"})


def regen_sources_of(tok, convs, eos, max_length):
    """:class:`data_prep.labels.RegenSource` of each conversation whose first reply starts within
    ``max_length`` (the turns templating keeps), as data prep builds them."""
    from data_prep.front import template_conversations
    from data_prep.labels import regen_sources
    from data_prep.sharegpt import ReadStats

    return regen_sources(list(template_conversations(tok, convs, eos, max_length, ReadStats())))


def _reference_regeneration(model, tok, source, eos, max_new_tokens, max_length):
    """Unbatched reference: the evaluation's multi-turn prompts (``evaluation.turns.follow_up_prompt``,
    each turn's prompt built from the answers before it), each answered by HF ``generate`` at batch 1
    (greedy, its own KV cache).  A turn whose prompt does not extend the previous record starts a new
    record; the last reply is closed as the template renders the conversation ending there."""
    from core.follow_up import follow_up
    from evaluation.prompts import Prompt, template
    from evaluation.turns import follow_up_prompt

    msgs, turns = source.messages, source.turns
    user_turns = tuple(msgs[u]["content"] for u in turns[1:] for u in [u - 1])
    prompt = Prompt(source.id, msgs[:turns[0]], template(tok, msgs[:turns[0]]), follow_ups=user_turns)
    records, ids, mask = [], prompt.input_ids.tolist(), [False] * prompt.input_ids.numel()
    for k in range(len(turns)):
        context = prompt.input_ids.tolist()
        if k and prompt.rendering == "re-rendered":
            records.append((ids[:max_length], mask[:max_length]))
            ids, mask = list(context), [False] * len(context)
        elif k:
            mask += [False] * (len(context) - len(ids))
            ids = list(context)
        if len(ids) >= max_length:
            break
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=min(max_new_tokens, max_length - len(ids)),
                             eos_token_id=sorted(eos), pad_token_id=2)[0, len(ids):].tolist()
        body = []
        for t in out:
            body.append(t)
            if t in eos:
                break
        ids, mask = ids + body, mask + [True] * len(body)
        if body[-1] not in eos:
            break
        if k + 1 == len(turns) or follow_up_prompt(tok, prompt, body, sorted(eos)).rendering == "re-rendered":
            close = follow_up(tok, prompt.messages, context, body, [], eos)  # the conversation ends with this reply
            if close.extended and close.tail:
                ids, mask = ids[:-1] + close.tail, mask + [False] * (len(close.tail) - 1)
        if k + 1 == len(turns):
            break
        prompt = follow_up_prompt(tok, prompt, body, sorted(eos))
        if prompt.rendering == "extended":
            ids[len(ids) - 1] = prompt.input_ids[len(ids) - 1].item()  # the template's closing token
    if any(mask):
        records.append((ids[:max_length], mask[:max_length]))
    return records


def test_regenerate_equals_the_base_models_own_greedy_continuation(tiny_base, data_file):
    model, tok, _ = tiny_base
    from data_prep.sharegpt import iter_conversations

    convs = list(iter_conversations(data_file))[:6]
    eos = end_of_turn_ids(tok, model)
    sources = regen_sources_of(tok, convs, eos, 160)
    # the random tiny model rarely emits <|im_end|>; treat a token it does emit as end-of-turn too,
    # so multi-turn regeneration (footer + next user turn) is exercised
    (first,), = regenerate(model, tok, sources[:1], eos, 6, 160)[:1]
    eos = eos | {first[0][[i for i, m in enumerate(first[1]) if m][2]]}
    sources = regen_sources_of(tok, convs, eos, 160)
    got = regenerate(model, tok, sources, eos, 12, 160, batch_size=4)
    ref = [_reference_regeneration(model, tok, s, eos, 12, 160) for s in sources]
    assert got == ref
    assert all(len(r) == 1 for r in got)  # ChatML: one record per conversation
    assert any(sum(1 for a, b in zip(m, m[1:]) if b and not a) > 1 for (_, m), in got)  # some multi-turn


def test_regenerate_pipeline_labels_match_generated_tokens(tiny_base, tiny_model_dir, data_file, tmp_path):
    model, tok, ident = tiny_base
    cfg = _cfg(tiny_model_dir, data_file, tmp_path, "labels=regenerate", "prep.max_new_tokens=10",
               "prep.dtype=float32")
    pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    reader = CacheReader(default_cache_dir(cfg) / "train")
    assert reader.manifest["labels"] == "regenerate" and len(reader) > 0
    for i in range(len(reader)):
        rec = reader[i]
        pos = rec["loss_mask"].nonzero().flatten()
        assert len(pos) > 0
        # every generated token is the base's greedy label at the previous position
        assert torch.equal(rec["labels"][pos - 1], rec["input_ids"][pos])


def test_collate_pads_with_correct_masks(tiny_base, tiny_model_dir, data_file, tmp_path):
    model, tok, ident = tiny_base
    cfg = _cfg(tiny_model_dir, data_file, tmp_path, "prep.layers=[2]")
    pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    reader = CacheReader(default_cache_dir(cfg) / "train")
    recs = [reader[i] for i in range(3)]
    batch = collate(recs, reader.pad_id)
    T = max(len(r["input_ids"]) for r in recs)
    assert batch["input_ids"].shape == (3, T) and batch["hidden"].shape == (3, T, 64)
    assert batch["aux_hidden"][2].shape == (3, T, 64)
    for b, r in enumerate(recs):
        n = len(r["input_ids"])
        assert batch["lengths"][b] == n and batch["ids"][b] == r["id"]
        assert torch.equal(batch["input_ids"][b, :n], r["input_ids"]) and (batch["input_ids"][b, n:] == reader.pad_id).all()
        assert batch["attention_mask"][b, :n].all() and not batch["attention_mask"][b, n:].any()
        assert torch.equal(batch["loss_mask"][b, :n], r["loss_mask"]) and not batch["loss_mask"][b, n:].any()
        assert (batch["labels"][b, n:] == 0).all() and torch.equal(batch["hidden"][b, :n], r["hidden"])
    with pytest.raises(IndexError):
        reader[len(reader)]


def test_heldout_prompts_are_first_user_turns_of_val_conversations(tiny_base, tiny_model_dir, data_file, tmp_path):
    model, tok, ident = tiny_base
    cfg = _cfg(tiny_model_dir, data_file, tmp_path)
    pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    val_ids = {CacheReader(default_cache_dir(cfg) / "val")[i]["id"] for i in range(len(CacheReader(default_cache_dir(cfg) / "val")))}
    prompts = list(pipeline.heldout_prompts(cfg.data))
    assert {i for i, _ in prompts} == val_ids
    for _, msgs in prompts:
        assert msgs[-1]["role"] == "user" and all(m["role"] != "assistant" for m in msgs)


def test_bad_prep_config_is_rejected(tiny_model_dir, data_file, tmp_path):
    from core.config import ConfigError

    with pytest.raises(ConfigError, match="prep.dtype"):
        _cfg(tiny_model_dir, data_file, tmp_path, "prep.dtype=int8")
    with pytest.raises(ConfigError, match="prep.layers"):
        _cfg(tiny_model_dir, data_file, tmp_path, "prep.layers=[-1]")
    with pytest.raises(ConfigError, match="prep.prepack_weights='maybe': use auto, true or false"):
        _cfg(tiny_model_dir, data_file, tmp_path, "prep.prepack_weights=maybe")
    # refused at compose, where each ran a base load (and a whole data prep) before
    with pytest.raises(ConfigError, match=r"prep.layers=\[0\] must be a list of intermediate hidden-state indices >= 1"):
        _cfg(tiny_model_dir, data_file, tmp_path, "prep.layers=[0]")  # was ">= 0", then [0] refused after the load
    with pytest.raises(ConfigError, match=r"prep.layers=\[8, 8\] repeats a layer"):
        _cfg(tiny_model_dir, data_file, tmp_path, "prep.layers=[8,8]")
    with pytest.raises(UserInputError, match=r"data.heldout_fraction=1.0 holds every conversation out"):
        pipeline.prepare(_cfg(tiny_model_dir, data_file, tmp_path, "data.heldout_fraction=1.0"), out=None)
    with pytest.raises(ConfigError, match=r"data.path=.* and data.sources are both set"):
        _cfg(tiny_model_dir, data_file, tmp_path, f"data.sources=[{{path: {data_file}}}]")


def test_prepared_cache_is_never_overwritten_by_other_settings(tiny_base, tiny_model_dir, data_file, tmp_path):
    from core.config import UserInputError
    from data_prep.pipeline import prepare

    cache = tmp_path / "cache"
    cfg = _cfg(tiny_model_dir, data_file, tmp_path, f"prep.cache_dir={cache}", "data.max_conversations=4")
    prepare(cfg, *tiny_base, out=None)
    before = _files(cache) | {"config.yaml": (cache / "config.yaml").read_bytes()}
    other = _cfg(tiny_model_dir, data_file, tmp_path, f"prep.cache_dir={cache}", "data.max_conversations=4",
                 "data.heldout_fraction=0.5")
    with pytest.raises(UserInputError, match=r"prepared with other settings \(data.heldout_fraction: 0.25 -> 0.5\)"):
        prepare(other, *tiny_base, out=None)
    with pytest.raises(UserInputError, match=r"prep.layers=\[9\]: \[9\] are not intermediate layers .*L=4; ids must lie in \[1, 4\)"):
        prepare(_cfg(tiny_model_dir, data_file, tmp_path, f"prep.cache_dir={cache}", "prep.layers=[9]"), *tiny_base, out=None)
    # positions past the base's context are not what it computes at inference (the tiny base has 2048)
    with pytest.raises(UserInputError, match=r"data.max_length=4096 exceeds the base model's context "
                                             r"\(max_position_embeddings=2048\).*data.max_length<=2048"):
        prepare(_cfg(tiny_model_dir, data_file, tmp_path, "data.max_length=4096"), *tiny_base, out=None)
    assert _files(cache) | {"config.yaml": (cache / "config.yaml").read_bytes()} == before
    prepare(cfg, *tiny_base, out=None)  # the same settings resume (nothing to do)
    assert _files(cache) == {k: v for k, v in before.items() if k != "config.yaml"}


@pytest.mark.parametrize("setting, match", [
    ("prep.layers=[2,100]", r"prep.layers=\[2, 100\]: \[100\] are not intermediate layers of the base .*L=4"),
    ("data.max_length=4096", r"data.max_length=4096 exceeds the base model's context \(max_position_embeddings=2048\)"),
])
def test_settings_the_base_cannot_serve_are_refused_before_it_loads(tiny_model_dir, data_file, tmp_path, monkeypatch,
                                                                    setting, match):
    """Read from the base's config alone, after the data is read: no model load, no templating, nothing written."""
    import core.base_model
    from core.config import UserInputError
    from data_prep.pipeline import prepare

    def no_load(*_a, **_k):
        raise AssertionError("the base was loaded")

    monkeypatch.setattr(core.base_model, "load_base_model", no_load)
    monkeypatch.setattr(pipeline, "template_split", no_load)
    cache = tmp_path / "cache"
    with pytest.raises(UserInputError, match=match):
        prepare(_cfg(tiny_model_dir, data_file, tmp_path, f"prep.cache_dir={cache}", setting), out=None)
    assert not cache.exists()


def test_a_cache_dir_of_other_settings_or_no_cache_is_refused_before_the_base_loads(tiny_model_dir, data_file, tmp_path,
                                                                                    monkeypatch):
    import core.base_model
    from data_prep.pipeline import prepare

    monkeypatch.setattr(core.base_model, "load_base_model", lambda *a, **k: pytest.fail("the base was loaded"))
    other = tmp_path / "other"
    other.mkdir()
    save_config(_cfg(tiny_model_dir, data_file, tmp_path, "data.heldout_fraction=0.5"), other)
    with pytest.raises(UserInputError, match=r"prepared with other settings \(data.heldout_fraction: 0.5 -> 0.25\)"):
        prepare(_cfg(tiny_model_dir, data_file, tmp_path, f"prep.cache_dir={other}"), out=None)
    evaluation = tmp_path / "eval"
    evaluation.mkdir()
    (evaluation / "report.json").write_text("{}")
    save_config(_cfg(tiny_model_dir, data_file, tmp_path), evaluation)
    with pytest.raises(UserInputError, match=re.escape(f"{evaluation} is not a data-prep cache (it holds report.json)")):
        prepare(_cfg(tiny_model_dir, data_file, tmp_path, f"prep.cache_dir={evaluation}"), out=None)


def test_full_length_regeneration_equals_batch_1_greedy_and_counts_truncated_turns(tiny_base, data_file):
    model, tok, _ = tiny_base
    from collections import Counter

    from data_prep.sharegpt import iter_conversations

    convs = list(iter_conversations(data_file))[:8]
    eos = end_of_turn_ids(tok, model)
    sources = regen_sources_of(tok, convs, eos, 96)
    # the random model never emits <|im_end|>: with the full-length default every first turn runs
    # to max_length, is counted, and is not given an end-of-turn it did not generate
    stats = Counter()
    got = regenerate(model, tok, sources, eos, None, 96, batch_size=3, stats=stats)
    assert got == [_reference_regeneration(model, tok, s, eos, 10**9, 96) for s in sources]
    assert stats["truncated_turns"] == len(sources)
    for (ids, mask), in got:
        assert len(ids) == 96 and mask[-1] and ids[-1] not in eos and all(mask[mask.index(True):])
    # a token it does emit as end-of-turn too: multi-turn, full length, equal to batch-1 greedy
    (first,), = regenerate(model, tok, sources[:1], eos, 6, 96)
    eos = eos | {first[0][[i for i, m in enumerate(first[1]) if m][2]]}
    sources = regen_sources_of(tok, convs, eos, 96)
    stats = Counter()
    got = regenerate(model, tok, sources, eos, None, 96, batch_size=3, stats=stats)
    assert got == [_reference_regeneration(model, tok, s, eos, 10**9, 96) for s in sources]
    records = [r for recs in got for r in recs]
    assert stats["truncated_turns"] == sum(1 for ids, m in records if m[-1] and ids[-1] not in eos)
    assert any(sum(1 for a, b in zip(m, m[1:]) if b and not a) > 1 for _, m in records)  # some multi-turn


def test_empty_source_fails_before_the_model_loads_or_a_directory_exists(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "only", "conversations": [{"from": "gpt", "value": "no question"}]}))
    out = tmp_path / "out"
    cfg = compose([f"model.path={tmp_path / 'no-such-model'}", f"data.path={bad}", f"output_root={out}",
                   "prep.progress=false"])
    with pytest.raises(UserInputError, match=r"no usable conversation in .*bad\.jsonl.*no_assistant_turn.*'only'"):
        pipeline.prepare(cfg, rank=0, world=1, out=None)
    assert not out.exists()


def test_mixture_is_recorded_in_the_manifest_and_summary(tiny_base, tiny_model_dir, data_file, tmp_path):
    model, tok, ident = tiny_base
    msgs = tmp_path / "m.jsonl"
    msgs.write_text("\n".join(json.dumps({"id": f"m{i}_0", "messages": [
        {"role": "assistant", "content": "leading"}, {"role": "user", "content": WORDS[i]},
        {"role": "assistant", "content": WORDS[i + 1]}]}) for i in range(4)))
    cfg = _cfg(tiny_model_dir, data_file, tmp_path, "data.path=null",
               f"data.sources=[{{path: {data_file}, max: 5}}, {{path: {msgs}}}]")
    summary = pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=None)
    man = json.loads((default_cache_dir(cfg) / "train" / "manifest.json").read_text())
    assert [(s["path"], s["conversations"]) for s in man["data_sources"]] == [(str(data_file), 5), (str(msgs), 4)]
    # the 5 ShareGPT records map human/gpt; the 4 messages records drop a leading assistant turn
    assert summary["conversations"] == 9 and summary["fixed"] == {
        "leading_assistant_dropped": 4, "role_mapped_gpt_to_assistant": 5, "role_mapped_human_to_user": 5}
    assert man["data_read"]["fixed"] == summary["fixed"]


def test_end_of_turn_ids_before_the_base_loads_are_the_loaded_bases(tmp_path, data_file):
    """``python -m data_prep`` templates before the base loads.  A folder without generation_config.json
    whose config.json ends turns with another id than the tokenizer's eos (Qwen2.5 base and others) got
    the tokenizer's eos alone there, while the loaded base, evaluation and online training take both:
    the same config hash held other records with or without the base passed in.  Now both sides read
    the generation config transformers derives from config.json, and the caches are equal."""
    from core.base_model import load_base_model, load_tokenizer
    from core.tiny import save_tiny_model
    from data_prep.cache import CacheReader
    from data_prep.template import end_of_turn_ids
    from decoding.vanilla import eos_token_ids

    folder = save_tiny_model(tmp_path / "m", seed=0)  # config.eos_token_id = 2 (<|im_end|>)
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "eos_token": "<|endoftext|>"}))
    (folder / "generation_config.json").unlink()
    base = load_base_model({"path": str(folder), "dtype": "float32", "attn_implementation": "eager"})
    model, tok, _ = base
    assert tok.eos_token_id == 0 and model.config.eos_token_id == 2
    before = pipeline.eos_ids_before_model(_cfg(folder, data_file, tmp_path).model, load_tokenizer({"path": str(folder)}))
    assert before == end_of_turn_ids(tok, model) == set(eos_token_ids(tok, model)) == {0, 2}
    caches = []
    for k, given in enumerate((None, base)):
        cfg = _cfg(folder, data_file, tmp_path / f"o{k}", "prep.dtype=float32", f"prep.cache_dir={tmp_path / f'c{k}'}")
        pipeline.prepare(cfg, *(given or (None, None, None)), rank=0, world=1, out=None)
        reader = CacheReader(tmp_path / f"c{k}" / "train")
        caches.append([reader[i]["input_ids"].tolist() for i in range(len(reader))])
    assert caches[0] == caches[1] and caches[0]


def test_a_tokenizer_without_pad_or_eos_pads_with_the_bases_end_of_turn_id(tmp_path, data_file):
    """A tokenizer with neither a pad nor an eos token, whose end of turn is only in
    generation_config.json: templating and regeneration took the generation config's eos, while the
    cache's pad id was int(None), a TypeError.  One rule pads everywhere (pad, eos, else the base's
    smallest end-of-turn id); with none at all the error names what to set."""
    from types import SimpleNamespace

    from core.config import UserInputError
    from core.tiny import save_tiny_model
    from data_prep.cache import CacheReader
    from data_prep.template import pad_token_id

    folder = save_tiny_model(tmp_path / "m", seed=0)  # generation_config.json: eos_token_id 2
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "eos_token": None, "pad_token": None}))
    cfg = _cfg(folder, data_file, tmp_path, "prep.dtype=float32", f"prep.cache_dir={tmp_path / 'c'}")
    pipeline.prepare(cfg, None, None, None, rank=0, world=1, out=None)
    assert CacheReader(tmp_path / "c" / "train").manifest["pad_id"] == 2
    with pytest.raises(UserInputError, match="no pad or eos token .* set the tokenizer's pad_token"):
        pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=None), set())


@pytest.mark.parametrize("change", ["weights", "data", "template"])
def test_a_cache_is_not_resumed_over_inputs_that_changed_under_the_same_settings(tmp_path, change):
    """A resumed data prep kept the finished shards of the old weights (or of an edited data file or chat
    template) and stamped the new base's identity into the manifest: training then passed its base check
    on hidden states of other weights.  Now the resume is refused, naming the shard, and nothing changes."""
    import shutil

    from core.config import UserInputError
    from core.tiny import save_tiny_model
    from data_prep.pipeline import prepare

    model_dir = save_tiny_model(tmp_path / "base", seed=0)
    data = tmp_path / "data.json"
    data.write_text(json.dumps(_conversations(13)))
    cache = tmp_path / "cache"
    cfg = _cfg(model_dir, data, tmp_path, f"prep.cache_dir={cache}")
    prepare(cfg, out=None)
    # an interruption: the last shards and the manifests are gone, the first ones stay
    for split in ("train", "val"):
        (cache / split / "manifest.json").unlink()
    last = sorted((cache / "train").glob("shard-*.json"))[-1]
    last.unlink()
    before = _files(cache)
    if change == "weights":
        other = save_tiny_model(tmp_path / "other", seed=5)
        shutil.copy(other / "model.safetensors", model_dir / "model.safetensors")
        match = r"cache shard .*shard-00000.safetensors was made by another base model than the one loaded \(weights_sha256: "
    elif change == "data":
        convs = _conversations(13)
        convs[0]["conversations"][1]["value"] = "an edited reply"
        data.write_text(json.dumps(convs))
        match = r"was made from other conversations or another templating than this run's \(the data file, "
    else:
        tpl = model_dir / "tokenizer_config.json"
        conf = json.loads(tpl.read_text())
        if "chat_template" in conf:
            conf["chat_template"] = conf["chat_template"].replace("<|im_start|>", "<|im_start|> ")
            tpl.write_text(json.dumps(conf))
        else:
            jinja = model_dir / "chat_template.jinja"
            jinja.write_text(jinja.read_text().replace("<|im_start|>", "<|im_start|> "))
        match = r"was made from other conversations or another templating"
    with pytest.raises(UserInputError, match=match):
        prepare(cfg, out=None)
    assert _files(cache) == before


def test_shards_record_their_inputs_and_base(tiny_base, tiny_model_dir, data_file, tmp_path):
    from core.base_model import IDENTITY_FIELDS
    from data_prep.pipeline import prepare

    cache = tmp_path / "cache"
    prepare(_cfg(tiny_model_dir, data_file, tmp_path, f"prep.cache_dir={cache}"), *tiny_base, out=None)
    side = json.loads((cache / "train" / "shard-00000.json").read_text())
    assert len(side["inputs_sha256"]) == 64
    assert side["base"] == {f: tiny_base[2].to_dict()[f] for f in IDENTITY_FIELDS}
    prepare(_cfg(tiny_model_dir, data_file, tmp_path, f"prep.cache_dir={cache}"), *tiny_base, out=None)  # resumes


def test_summary_counts_what_max_length_cuts(tiny_base, tiny_model_dir, tmp_path):
    """Issue 27 asks for the share of replies data.max_length cuts; teacher-forced data prep dropped a
    later reply past it without a count.  max_length is set where the chat template (rendered by the
    tokenizer itself) ends the first reply of the two-turn conversation: that reply is whole, the
    second is cut, and the one-turn conversation is whole."""
    from data_prep.pipeline import prepare

    tok = tiny_base[1]
    two = [{"role": "user", "content": "Tell me about the sea."}, {"role": "assistant", "content": "It is big."},
           {"role": "user", "content": "And the sky?"}, {"role": "assistant", "content": "It is blue and wide."}]
    cut = len(tok.apply_chat_template(two[:2], tokenize=True, return_dict=True)["input_ids"])
    data = tmp_path / "d.json"
    data.write_text(json.dumps([
        {"id": "two", "conversations": [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                                        for m in two]},
        {"id": "one", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}]))
    out = io.StringIO()
    cache = tmp_path / "cache"
    prepare(_cfg(tiny_model_dir, data, tmp_path, f"prep.cache_dir={cache}", f"data.max_length={cut}",
                 "data.heldout_fraction=0"), *tiny_base, out=out)
    summary = json.loads((cache / "summary.json").read_text())
    assert {k: summary[k] for k in ("tf_conversations", "tf_cut_conversations", "tf_turns", "tf_cut_turns")} == \
        {"tf_conversations": 2, "tf_cut_conversations": 1, "tf_turns": 3, "tf_cut_turns": 1}
    assert "cut by data.max_length: 1 of 2 conversations (50.0%), 1 of 3 assistant replies (33.3%)" in out.getvalue()
    assert "tf_" not in " ".join(summary["dropped"])


def test_enumerated_ids_on_one_side_of_the_split_get_the_split_key_advice(tiny_base, tiny_model_dir, tmp_path, capsys):
    """``conv_0`` ... ``conv_39`` share the root ``conv``: all land on one side.  Data prep said "raise
    data.heldout_fraction" (worse when every one was held out) and wrote a cache with an empty train split."""
    from core.config import UserInputError
    from data_prep.pipeline import prepare
    from data_prep.split import heldout_score

    convs = _conversations(40, bad_record=False)
    for i, c in enumerate(convs):
        c["id"] = f"conv_{i}"
    data = tmp_path / "d.json"
    data.write_text(json.dumps(convs))
    assert heldout_score("conv", "0") >= 0.25 > heldout_score("conv", "a")  # salt 0: all train; salt a: all held out
    for salt, train_side in (("0", True), ("a", False)):
        cache = tmp_path / f"cache-{salt}"
        cfg = _cfg(tiny_model_dir, data, tmp_path, f"prep.cache_dir={cache}", f"data.split_salt={salt}")
        advice = "40 of its 40 conversations share the root id 'conv' under data.split_key=root"
        if train_side:
            prepare(cfg, *tiny_base, out=None)
            err = capsys.readouterr().err
            assert "warning: the 'val' split" in err and advice in err and "set data.split_key=id" in err
        else:
            with pytest.raises(UserInputError, match=rf"every one of the 40 conversations read is held out.*{advice}"):
                prepare(cfg, *tiny_base, out=None)
            assert not cache.exists()
    cache = tmp_path / "cache-id"
    prepare(_cfg(tiny_model_dir, data, tmp_path, f"prep.cache_dir={cache}", "data.split_key=id"), *tiny_base, out=None)
    summary = json.loads((cache / "summary.json").read_text())
    assert summary["splits"]["train"]["conversations"] > 0 and summary["splits"]["val"]["conversations"] > 0


def test_duplicate_ids_are_dropped_and_counted(tmp_path):
    """Three records with one id, or one file listed twice in data.sources, were all cached with no count;
    the held-out split, the cache's records and evaluation results are keyed by id."""
    from data_prep.front import read_split

    convs = _conversations(6, bad_record=False)
    convs += [dict(convs[2]), dict(convs[2], conversations=convs[3]["conversations"])]  # conv-2 twice more
    path = tmp_path / "d.json"
    path.write_text(json.dumps(convs))
    base = compose(["data.max_conversations=null", "data.heldout_fraction=0.3", f"data.path={path}"])
    data = read_split(base.data)
    ids = [c.id for c in (*data.train, *data.val)]
    assert sorted(ids) == [f"conv-{i}" for i in range(6)]
    assert data.stats.dropped["duplicate_id"] == 2 and data.stats.examples["duplicate_id"]["id"] == "conv-2"
    twice = compose(["data.max_conversations=null", "data.heldout_fraction=0.3", "data.path=null",
                     f"data.sources=[{{path: '{path}'}}, {{path: '{path}'}}]"])
    data = read_split(twice.data)
    assert sorted(c.id for c in (*data.train, *data.val)) == [f"conv-{i}" for i in range(6)]
    assert data.stats.dropped["duplicate_id"] == 10  # the first listing's 2 repeats, then all 8 records again
    assert data.stats.examples["duplicate_id"]["message"].startswith("the id of an earlier conversation")


def test_length_budget_counts_what_data_prep_would_cut(tiny_base, tiny_model_dir, tmp_path, capsys):
    """``python -m data_prep.length_budget`` sizes data.max_length before a cache is built: at the configured
    length its counts are the ones data prep's summary gives for the cache it builds (here no conversation
    starts past it), and a longer limit cuts no more."""
    from data_prep.length_budget import main as budget_main
    from data_prep.pipeline import prepare

    data = tmp_path / "d.json"
    data.write_text(json.dumps(_conversations(24)))
    cache = tmp_path / "cache"
    args = [f"model.path={tiny_model_dir}", "model.dtype=float32", f"data.path={data}", "data.max_conversations=null",
            "data.heldout_fraction=0.25", "data.max_length=72", "labels=teacher_forced", f"output_root={tmp_path}"]
    prepare(compose([*args, f"prep.cache_dir={cache}", "prep.progress=false"]), *tiny_base, out=None)
    summary = json.loads((cache / "summary.json").read_text())
    assert summary["dropped"].get("no_assistant_tokens", 0) == 0 and summary["tf_cut_turns"] > 0
    rows = {r["max_length"]: r for r in budget_main(args)}
    assert sorted(rows) == [72, 512, 1024, 2048, 4096]
    assert (rows[72]["conversations"], rows[72]["cut_conversations"], rows[72]["turns"], rows[72]["cut_turns"]) == \
        (summary["tf_conversations"], summary["tf_cut_conversations"], summary["tf_turns"], summary["tf_cut_turns"])
    assert rows[72]["tokens_kept"] == summary["tokens"]
    assert rows[512]["cut_turns"] == 0 and rows[512]["cut_conversations"] == 0
    printed = capsys.readouterr().out
    assert "| data.max_length | conversations cut | replies not whole | templated tokens kept |" in printed
    assert f"| 72 | {summary['tf_cut_conversations']:,} / {summary['tf_conversations']:,} (" in printed


def test_two_data_preps_of_other_settings_writing_into_one_folder_never_mix_in_a_manifest(
        tiny_base, tiny_model_dir, data_file, tmp_path, monkeypatch):
    """Two runs started into one prep.cache_dir at once both pass the start's settings check (neither has written
    config.yaml yet); a shard the other run rewrote meanwhile went into this run's manifest under this run's
    config hash and base, silently.  The manifest is refused instead, naming the sidecar."""
    import shutil

    other = tmp_path / "other"
    pipeline.prepare(_cfg(tiny_model_dir, data_file, tmp_path, f"prep.cache_dir={other}", "data.heldout_fraction=0.5"),
                     *tiny_base, out=None)
    cache = tmp_path / "cache"
    real = cache_mod.write_shard

    def and_the_other_run_too(directory, index, *args, **kwargs):
        entry = real(directory, index, *args, **kwargs)
        if directory.name == "train" and index == 0:  # the other run rewrites shard 0 right after this one
            for ext in (".safetensors", ".json"):
                shutil.copy(other / "train" / f"shard-00000{ext}", directory / f"shard-00000{ext}")
        return entry

    monkeypatch.setattr(cache_mod, "write_shard", and_the_other_run_too)
    with pytest.raises(UserInputError, match=r"shard-00000.json was written under config hash '[0-9a-f]+', not this "
                                             r"run's .*another data prep with other settings writes into"):
        pipeline.prepare(_cfg(tiny_model_dir, data_file, tmp_path, f"prep.cache_dir={cache}"), *tiny_base, out=None)
    assert not (cache / "train" / "manifest.json").exists()
