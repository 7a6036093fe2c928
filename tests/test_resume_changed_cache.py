"""Resume against a cache rebuilt meanwhile (issue 28, item 3).

A checkpoint restores the draft vocabulary ``d2t`` / ``t2d``; everything derived from it (the
draft-index table, the frozen rows W[d2t] that score drafts and the soft teachers) must follow the
loaded state, and a resume whose checkpoint was trained on other data than the cache opened now is
refused with the difference, before anything is written.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import heads
from core.config import UserInputError, compose
from heads.draft_vocab import select_d2t, slice_rows, t2d_index

N = 64
LAYERS = [1, 2, 3]


def _head_cfg(name: str) -> dict:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose([f"heads={name}"]).heads, resolve=True)
    if name in ("adadecode", "eagle3"):
        cfg["layers"] = LAYERS
    if name in ("ctc", "falcon"):
        cfg["attn_implementation"] = "eager"
    cfg["draft_vocab_size"] = N
    return cfg


@pytest.mark.parametrize("name", ["ctc", "falcon", "adadecode", "eagle3"])
def test_loaded_draft_vocabulary_rebuilds_every_derived_lookup(name, tiny_base):
    """A head built from one cache's counts, loaded with a state from another: its draft-index table
    and W[d2t] rows are those of the loaded d2t (they kept the build's before), and EAGLE-3's loaded
    trainable head is not overwritten."""
    base = tiny_base[0]
    V = int(base.config.vocab_size)
    counts_a = torch.arange(V, dtype=torch.int64)          # top N: the highest ids
    counts_b = torch.arange(V, 0, -1, dtype=torch.int64)   # top N: the lowest ids
    torch.manual_seed(0)
    head_a = heads.build(_head_cfg(name), base, label_counts=counts_a, counts_source="a")
    torch.manual_seed(1)
    head_b = heads.build(_head_cfg(name), base, label_counts=counts_b, counts_source="b")
    d2t_b = select_d2t(counts_b, N)
    assert not torch.equal(head_a.d2t, d2t_b)
    state = head_b.state_dict()
    head_a.load_state_dict(state)
    assert torch.equal(head_a.d2t, d2t_b)
    assert torch.equal(head_a.draft_index, t2d_index(d2t_b, V))
    assert torch.equal(head_a.draft_lm_head_rows, slice_rows(head_a.lm_head_weight, d2t_b))
    ids = torch.tensor([int(d2t_b[0]), int(d2t_b[-1]), int(select_d2t(counts_a, N)[-1])])
    assert head_a.to_draft_ids(ids).tolist() == [0, N - 1, -1]
    for key, value in state.items():  # every loaded tensor stays as loaded (EAGLE-3's trainable rows too)
        assert torch.equal(head_a.state_dict()[key], value), key


# ---------------------------------------------------------------------------------------------
class Kill(RuntimeError):
    pass


def _kill_at(step: int):
    from lightning.pytorch.callbacks import Callback

    class KillAt(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step >= step:
                raise Kill(step)

    return KillAt()


def _cfg(tmp, cache, name, extra=()):
    return compose(["heads=falcon", "heads.attn_implementation=eager", f"heads.draft_vocab_size={N}",
                    "train.logger=csv", "train.progress_bar=false", "train.sanity_val_steps=0", f"output_root={tmp}",
                    f"train.cache_dir={cache}", f"train.run_name={name}", "train.accelerator=cpu", "train.devices=1",
                    "train.batch_size=4", "train.max_steps=4", "train.val_every_n_steps=2",
                    "train.scheduler.warmup_steps=1", "train.optimizer.lr=0.01", *extra])


def _write_cache(root: Path, model_dir, length_range=(6, 16)) -> Path:
    from data_prep.synthetic import write_random_cache

    return write_random_cache(root, model_dir, n_train=12, n_val=4, length_range=length_range, shard_size=8)


def _rewrite_one_hidden_row(cache: Path) -> None:
    """Change one hidden-state value of the first train shard (labels, so d2t, unchanged), as a
    rebuilt cache with another base forward would, and rewrite its sidecar and manifest."""
    from data_prep import cache as C

    split = cache / "train"
    manifest = json.loads((split / "manifest.json").read_text())
    path = split / manifest["shards"][0]["file"]
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    tensors["hidden"][0, 0] += 1.0
    save_file(tensors, path, metadata=meta)
    entry = json.loads((split / "shard-00000.json").read_text())
    entry.update(bytes=path.stat().st_size, sha256=C.sha256_file(path))
    (split / "shard-00000.json").write_text(json.dumps(entry))
    header = {k: v for k, v in manifest.items() if k not in ("format", "num_shards", "num_records", "num_tokens",
                                                             "num_assistant_tokens", "bytes", "dropped", "shards")}
    C.write_manifest(split, manifest["num_shards"], header)


def _label_counts(cache: Path) -> torch.Tensor:
    from data_prep.label_counts import load_counts

    return load_counts(cache / "train")


def test_resume_against_a_rebuilt_cache_is_refused_with_the_difference(tiny_model_dir, tiny_base, tmp_path):
    from train.run import train

    cache = _write_cache(tmp_path / "cache", tiny_model_dir)
    with pytest.raises(Kill):
        train(_cfg(tmp_path, cache, "run"), base=tiny_base, callbacks=[_kill_at(3)])
    run = tmp_path / "runs" / "falcon" / "run"
    before = sorted(p.relative_to(run) for p in run.rglob("*"))

    # 1. rebuilt with other conversations: other labels, so another draft vocabulary
    d2t_old = select_d2t(_label_counts(cache), N)
    import shutil

    shutil.rmtree(cache)
    _write_cache(cache, tiny_model_dir, length_range=(5, 14))
    assert not torch.equal(select_d2t(_label_counts(cache), N), d2t_old)  # the precondition of this case
    with pytest.raises(UserInputError, match=r"refused.*train data changed.*draft vocabulary d2t"):
        train(_cfg(tmp_path, cache, "run", ["resume=auto"]), base=tiny_base)
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing written

    # 2. rebuilt with the same labels (same d2t) but other features: refused on the data identity
    shutil.rmtree(cache)
    _write_cache(cache, tiny_model_dir)
    assert torch.equal(select_d2t(_label_counts(cache), N), d2t_old)
    _rewrite_one_hidden_row(cache)
    with pytest.raises(UserInputError, match=r"train data changed") as err:
        train(_cfg(tmp_path, cache, "run", ["resume=auto"]), base=tiny_base)
    assert "draft vocabulary d2t" not in str(err.value) and "val data" not in str(err.value)
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before

    # 3. rebuilt identically (a deterministic re-run of data prep): the resume goes on
    shutil.rmtree(cache)
    _write_cache(cache, tiny_model_dir)
    result = train(_cfg(tmp_path, cache, "run", ["resume=auto"]), base=tiny_base)
    assert result["exports"] and int(result["trainer"].global_step) == 4


def test_resume_on_another_number_of_ranks_is_refused_before_anything_is_written(tiny_model_dir, tiny_base, tmp_path):
    """A checkpoint's data position counts finished batches per rank (rank r trains global positions r,
    r + W, ...): written by 2 ranks after 3 batches each (global 0-5), replayed on one rank it would
    train global positions 3-5 again; the resume is refused, naming both world sizes, and nothing is
    written.  The same world size resumes; a checkpoint from before the key counts its gathered RNG states."""
    from train.checkpoint_io import SafetensorsCheckpointIO
    from train.resume import last_checkpoint, saved_world_size
    from train.run import train

    cache = _write_cache(tmp_path / "cache", tiny_model_dir)
    with pytest.raises(Kill):
        train(_cfg(tmp_path, cache, "run"), base=tiny_base, callbacks=[_kill_at(3)])
    run = tmp_path / "runs" / "falcon" / "run"
    ckpt = last_checkpoint(run)
    io = SafetensorsCheckpointIO()
    state = io.load_checkpoint(ckpt)
    assert state["world_size"] == 1 and saved_world_size(state) == 1
    state["world_size"] = 2
    io.save_checkpoint(state, ckpt)
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
    with pytest.raises(UserInputError, match=r"refused: it was written by 2 rank\(s\) and this launch has 1 .*"
                                             r"Resume with 2 rank\(s\) in all"):
        train(_cfg(tmp_path, cache, "run", ["resume=auto"]), base=tiny_base)
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before  # nothing written
    assert saved_world_size({"rng_states": {}, "rng_states_per_rank": [{}, {}, {}]}) == 3  # older checkpoints
    assert saved_world_size({"rng_states": {}}) == 1
    state["world_size"] = 1
    io.save_checkpoint(state, ckpt)
    result = train(_cfg(tmp_path, cache, "run", ["resume=auto"]), base=tiny_base)
    assert int(result["trainer"].global_step) == 4
