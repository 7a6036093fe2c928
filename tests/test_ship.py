"""heads.ship (issue 27: the head of record ships as bf16 safetensors): floating weights cast to
bf16, d2t unchanged, the run record copied, the shipped head loads and drafts what the fp32 head
drafts up to bf16 rounding, and bad input writes nothing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import heads
from omegaconf import OmegaConf

from core.config import compose
from heads.ship import main, ship


@pytest.fixture
def checkpoint(tiny_base, tiny_model_dir, tmp_path):
    cfg = compose([f"model.path={tiny_model_dir}", "heads=falcon_k1", "heads.draft_vocab_size=64"])
    torch.manual_seed(0)
    counts = torch.randint(0, 1000, (tiny_base[0].config.vocab_size,), generator=torch.Generator().manual_seed(1))
    head = heads.build(cfg.heads, tiny_base[0], label_counts=counts, counts_source="test")
    features = {"source": "offline", "labels": "teacher_forced", "layers": [3, 1], "storage_dtype": "float8_e4m3fn",
                "compute_dtype": "float32", "attn_implementation": "eager", "final_layer": 4}
    run = tmp_path / "run"
    ckpt = heads.save(head, run / "best", tiny_base[2].to_dict(), {"step": 7, "features": features})
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))  # data prep's defaults, as older runs recorded
    (run / "record.json").write_text(json.dumps({"validations": [{"step": 7, "metrics": {"sim_tau": 1.5}}]}))
    return head, ckpt, run


def test_ship_casts_weights_keeps_d2t_and_loads(checkpoint, tiny_base, tmp_path):
    head, ckpt, run = checkpoint
    cache = tmp_path / "cache"
    (cache / "train").mkdir(parents=True)
    (cache / "train" / "manifest.json").write_text(json.dumps({"config_hash": "abc", "num_records": 3, "num_tokens": 99}))
    out = ship(ckpt, tmp_path / "shipped", "bfloat16", run, cache)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f32, safe_open(str(out / "model.safetensors"), "pt") as b16:
        assert set(f32.keys()) == set(b16.keys())
        for k in f32.keys():
            a, b = f32.get_tensor(k), b16.get_tensor(k)
            if a.is_floating_point():
                assert a.dtype == torch.float32 and b.dtype == torch.bfloat16
                assert torch.equal(b, a.to(torch.bfloat16))
            else:  # d2t and other index tensors are copied bit for bit
                assert b.dtype == a.dtype and torch.equal(a, b)
    assert any(not t.is_floating_point() for t in [safe_open(str(out / "model.safetensors"), "pt").get_tensor(k)
                                                  for k in safe_open(str(out / "model.safetensors"), "pt").keys()])
    assert (out / "model.safetensors").stat().st_size < 0.6 * (ckpt / "model.safetensors").stat().st_size
    meta = json.loads((out / "config.json").read_text())
    assert meta["extra"]["stored_dtype"] == "bfloat16" and meta["extra"]["step"] == 7
    assert len(meta["extra"]["shipped_from"]["sha256"]) == 64
    train = meta["extra"]["cache"]["splits"]["train"]
    assert train["records"] == 3 and train["tokens"] == 99 and train["config_hash"] == "abc"
    assert len(train["manifest_sha256"]) == 64 and "val" not in meta["extra"]["cache"]["splits"]
    assert json.loads((out / "record.json").read_text())["validations"][0]["metrics"]["sim_tau"] == 1.5
    # the shipped config.yaml says what the weights trained on (the checkpoint's features), not the defaults
    assert (cfg := OmegaConf.load(run / "config.yaml")).labels == "regenerate" and list(cfg.prep.layers) == []
    shipped = OmegaConf.load(out / "config.yaml")
    assert shipped.labels == "teacher_forced" and list(shipped.prep.layers) == [1, 3]
    assert shipped.prep.dtype == "float8_e4m3fn" and shipped.heads.draft_vocab_size == 64
    loaded, _ = heads.load(out, base_model=tiny_base[0])
    ref = {k: v.to(torch.bfloat16).float() for k, v in head.trainable_state_dict().items() if v.is_floating_point()}
    for k, v in loaded.trainable_state_dict().items():
        if v.is_floating_point():
            assert v.dtype == torch.float32 and torch.equal(v, ref[k]), k


def test_ship_refuses_bad_input_and_writes_nothing(checkpoint, tmp_path, capsys):
    _, ckpt, run = checkpoint
    assert main([str(tmp_path / "nope"), str(tmp_path / "o1")]) == 2
    assert "no such directory" in capsys.readouterr().err and not (tmp_path / "o1").exists()
    assert main([str(ckpt), str(ckpt)]) == 2 and "the checkpoint itself" in capsys.readouterr().err
    assert main([str(ckpt), str(tmp_path / "o2"), "--run", str(tmp_path / "norun")]) == 2
    assert not (tmp_path / "o2").exists()
    from safetensors.torch import load_file, save_file

    state = load_file(ckpt / "model.safetensors")
    name = next(k for k, v in state.items() if v.is_floating_point())
    state[name] = state[name].clone()
    state[name].view(-1)[0] = 1e6  # finite in fp32, +inf in fp16
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "draftheads"})
    assert main([str(ckpt), str(tmp_path / "o3"), "--dtype", "float16"]) == 2
    assert name in capsys.readouterr().err and not (tmp_path / "o3").exists()


def test_ship_checks_its_destination_its_run_and_its_input(checkpoint, tiny_base, tmp_path, capsys):
    """Shipping into another head's or an export's folder mixed two heads' files; --run of another run copied
    that run's record as this head's; an output path through a file was a traceback; an engine export was
    shipped as if it were a checkpoint."""
    head, ckpt, run = checkpoint
    first = ship(ckpt, tmp_path / "s", "bfloat16", run)
    assert (first / "record.json").is_file()
    assert ship(ckpt, first, "bfloat16") == first  # an earlier ship is replaced ...
    assert not (first / "record.json").exists()  # ... and without --run keeps no earlier training record
    export = tmp_path / "export"
    export.mkdir()
    (export / "hot_token_ids.json").write_text("[]")
    (export / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle"]}))
    (export / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
    assert main([str(ckpt), str(export)]) == 2
    assert f"output {export} holds config.json, hot_token_ids.json, model.safetensors, not a shipped head" in \
        capsys.readouterr().err
    assert main([str(export), str(tmp_path / "o4")]) == 2  # an engine export is no head checkpoint
    assert "config.json is not a head config" in capsys.readouterr().err
    other = heads.save(heads.build({"type": "ctc"}, tiny_base[0]), tmp_path / "other" / "best",
                       tiny_base[2].to_dict())
    assert main([str(ckpt), str(tmp_path / "o5"), "--run", str(other.parent)]) == 2
    assert "neither its best/ nor its last/ is the checkpoint" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert main([str(ckpt), str(tmp_path / "afile" / "x")]) == 2
    assert f"output {tmp_path / 'afile' / 'x'} cannot be written" in capsys.readouterr().err
    assert not any((tmp_path / n).exists() for n in ("o4", "o5"))
    import shutil

    copy = shutil.copytree(ckpt, tmp_path / "copy")  # a copy of the run's best/ ships with that run's record
    assert (ship(copy, tmp_path / "o6", "bfloat16", run) / "record.json").is_file()


@pytest.mark.parametrize("head_dir", sorted(p.name for p in (Path(__file__).parents[1] / "heads_of_record").iterdir()
                                            if (p / "config.json").is_file()))
def test_a_shipped_head_of_record_says_what_it_trained_on(head_dir):
    """The committed heads' config.yaml names the labels and features of the cache their weights trained
    on (config.json's extra.features), as heads.ship writes them; both said regenerate / no layers /
    bf16 storage before, data prep's defaults."""
    from core.config import feature_config_values

    root = Path(__file__).parents[1] / "heads_of_record" / head_dir
    features = json.loads((root / "config.json").read_text())["extra"]["features"]
    cfg = OmegaConf.load(root / "config.yaml")
    want = feature_config_values(features)
    assert want == {"labels": "teacher_forced", "prep.layers": [2, 8, 15, 22, 27], "prep.dtype": "float8_e4m3fn"}
    assert {k: (sorted(OmegaConf.select(cfg, k)) if k == "prep.layers" else OmegaConf.select(cfg, k)) for k in want} == want


def test_a_ship_stopped_mid_write_leaves_the_earlier_ship_whole(checkpoint, tmp_path, monkeypatch):
    """A ship wrote model.safetensors and then config.json into the destination: stopped between the two while
    replacing an earlier ship, the folder held one head's weights beside another's config.json.  Every file now
    goes into a fresh sibling, swapped in whole (core.io.replace_dir)."""
    import heads.ship as ship_mod

    _, ckpt, run = checkpoint
    out = ship(ckpt, tmp_path / "shipped", "bfloat16", run_dir=run)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def stop(*args, **kwargs):
        raise KeyboardInterrupt  # the process stopped after the weights were written
    monkeypatch.setattr(ship_mod, "atomic_write_json", stop)
    with pytest.raises(KeyboardInterrupt):
        ship(ckpt, out, "float16")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".shipped")] == []  # nothing left beside it


@pytest.mark.parametrize("atomic_exchange", [True, False])
def test_replace_dir_swaps_whole_folders_and_names_an_interrupted_swap(tmp_path, monkeypatch, atomic_exchange):
    """core.io.replace_dir: the target ends holding exactly the new folder's files and nothing is left beside it;
    without the atomic exchange, a stop between its two renames leaves the old folder whole as .<name>.old-<pid>,
    which the checkpoint check then names."""
    import core.io as io
    from heads.registry import check_checkpoint_dir

    if not atomic_exchange:
        monkeypatch.setattr(io, "_exchange", lambda a, b: False)
    target = tmp_path / "best"
    target.mkdir()
    (target / "a").write_text("old")
    (target / "gone").write_text("old")
    new = io.make_tmp_dir(".best.", tmp_path)
    (new / "a").write_text("new")
    io.replace_dir(new, target)
    assert {p.name: p.read_text() for p in target.iterdir()} == {"a": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]
    if atomic_exchange:
        return
    new = io.make_tmp_dir(".best.", tmp_path)
    real_replace, calls = io.os.replace, []

    def stopped_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_replace(src, dst)
    monkeypatch.setattr(io.os, "replace", stopped_second)
    with pytest.raises(KeyboardInterrupt):
        io.replace_dir(new, target)
    left = io.interrupted_swap(target)
    assert not target.exists() and left is not None and (left / "a").read_text() == "new"
    with pytest.raises(FileNotFoundError, match=r"holds its previous contents, whole.*rename it back to best"):
        check_checkpoint_dir(target)


def test_a_full_disk_names_the_file_being_written(tmp_path, monkeypatch):
    """A full disk during an atomic write (a cache shard, a checkpoint) read "[Errno 28] No space left on device",
    naming no file; the file it was replacing keeps its contents and no temporary file is left."""
    import errno

    import core.io as io

    target = tmp_path / "shard-00000.safetensors"
    target.write_bytes(b"before")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(io.os, "fsync", full)
    with pytest.raises(OSError, match=r"No space left on device while writing .*shard-00000.safetensors \(5 bytes\)") as e:
        io.atomic_write_bytes(target, b"after")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target)
    assert target.read_bytes() == b"before" and [p.name for p in tmp_path.iterdir()] == [target.name]
