"""Resolving ``model.path``: the packaged GGUF converted once, also when several processes ask for it
at the same moment, and a missing local path named as missing.

Ranks, Slurm tasks and parallel test workers all call ``core.base_model.convert_gguf`` on a fresh
machine; without a lock each one converted the file and the last ``os.replace`` could delete the
folder another process was already loading from.
"""
from __future__ import annotations

import os
import re
import threading
import time

import pytest

import core.base_model as base_model


def test_concurrent_conversions_of_one_gguf_convert_it_once(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF stand-in: only its bytes are hashed before the conversion")
    calls, inside, overlap = [], [0], []

    def fake_convert(src, digest, target):  # the real one takes 15-40 s on the packaged model
        inside[0] += 1
        overlap.append(inside[0])
        calls.append(target)
        time.sleep(0.3)  # long enough for every other thread to reach the lock
        target.mkdir()
        (target / "source.json").write_text("{}")
        inside[0] -= 1

    monkeypatch.setattr(base_model, "_convert_into", fake_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(base_model.convert_gguf(gguf, tmp_path / "cache")))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1, calls  # converted once, by whichever caller took the lock first
    assert max(overlap) == 1
    assert len(results) == 4 and len(set(results)) == 1 and (results[0] / "source.json").exists()
    assert base_model.convert_gguf(gguf, tmp_path / "cache") == results[0] and len(calls) == 1


@pytest.mark.parametrize("path", ["./nope", "/no/such/model", "models/smol/v2", "~/no-such-model", "..\\nope"])
def test_a_missing_local_model_path_is_named_not_sent_to_the_hub(path, capsys):
    """Before, transformers answered "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"."""
    from core.base_model import resolve_model_dir
    from evaluation.__main__ import main

    with pytest.raises(FileNotFoundError, match=rf"model.path={re.escape(repr(path))}: no such model folder"):
        resolve_model_dir({"path": path})
    assert main([f"model.path={path}", "checkpoint=oracle"]) == 2
    said = os.path.expanduser(path) if path.startswith("~/") else path  # the command line expands ~/ (core.config)
    assert capsys.readouterr().err.strip() == f"error: model.path={said!r}: no such model folder"


def test_a_hub_id_is_left_to_transformers():
    from core.base_model import resolve_model_dir

    assert resolve_model_dir({"path": "HuggingFaceTB/SmolLM2-135M-Instruct"})[:2] == ("HuggingFaceTB/SmolLM2-135M-Instruct",) * 2


def test_a_model_path_that_is_no_model_is_named(tmp_path, capsys):
    """An empty folder got a 5-line transformers message about sentencepiece; a text file the same."""
    from core.base_model import resolve_model_dir

    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(FileNotFoundError, match="has no config.json: not a Hugging Face model folder"):
        resolve_model_dir({"path": str(tmp_path / "empty")})
    with pytest.raises(FileNotFoundError, match="is a file: give a Hugging Face model folder or a .gguf file"):
        resolve_model_dir({"path": str(tmp_path / "notes.txt")})


@pytest.mark.parametrize("damage,said", [
    ("no_tokenizer", r"its tokenizer could not be read from .* a base folder needs its tokenizer files"),
    ("torn_weights", r"its weights could not be read from .*\(SafetensorError: "),
    ("small_vocab", r"its tokenizer has 384 ids but the model's vocab_size is 200: ids 200\.\.383 have no embedding row"),
    ("random_gguf", r"the GGUF file could not be read from .*not a GGUF file"),
    ("short_gguf", r"the GGUF file could not be read from .*\(error: unpack"),
])
def test_a_damaged_model_input_is_one_line_and_writes_nothing(tmp_path, capsys, damage, said):
    """A folder without tokenizer files, a torn model.safetensors, a tokenizer larger than the model's
    vocabulary and a GGUF that is none each ended in a traceback (the vocabulary one deep in data prep's
    first forward, with the cache folder already made)."""
    import os
    import shutil

    from core.tiny import save_tiny_model, tiny_llama, tiny_tokenizer
    from data_prep.__main__ import main

    good = save_tiny_model(tmp_path / "good", seed=0)
    path = tmp_path / damage
    if damage == "no_tokenizer":
        shutil.copytree(good, path)
        for f in path.glob("tokenizer*"):
            f.unlink()
    elif damage == "torn_weights":
        shutil.copytree(good, path)
        w = path / "model.safetensors"
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    elif damage == "small_vocab":
        tiny_llama(seed=0, vocab_size=200).save_pretrained(path)
        tiny_tokenizer(384).save_pretrained(path)
    else:
        path = tmp_path / f"{damage}.gguf"
        path.write_bytes(os.urandom(4096) if damage == "random_gguf" else b"GGUF\x03\x00\x00\x00")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main([f"model.path={path}", "model.dtype=float32", "data.max_conversations=4", f"output_root={out}",
              f"model.cache_dir={tmp_path / 'models'}", "prep.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and re.search(rf"^error: model.path={re.escape(repr(str(path)))}: {said}", err[-1]), err
    assert "Traceback" not in "\n".join(err) and not (out / "cache").exists()


def test_a_base_defined_by_its_own_code_names_model_trust_remote_code(tmp_path):
    """A folder whose config.json maps to code in the folder (auto_map) and model.trust_remote_code unset: the error
    kept only transformers' first line ("contains custom code which must be executed"), which names no setting;
    it now names model.trust_remote_code."""
    import json

    from core.base_model import load_base_config, load_tokenizer
    from core.config import UserInputError
    from core.tiny import save_tiny_model

    d = save_tiny_model(tmp_path / "custom", seed=0)
    config = json.loads((d / "config.json").read_text())
    config.update(model_type="draftheads_custom", auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    (d / "config.json").write_text(json.dumps(config))
    (d / "configuration_custom.py").write_text("from transformers import LlamaConfig\n\n\nclass CustomConfig(LlamaConfig):\n"
                                               "    model_type = 'draftheads_custom'\n")
    for load in (load_base_config, load_tokenizer):
        with pytest.raises(UserInputError, match=r"contains custom code.*set model.trust_remote_code=true"):
            load({"path": str(d)})
