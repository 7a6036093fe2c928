"""The head diagnostics in ``scripts/`` (``validate_head.py``, ``falcon_attention.py``) share one
command line (``scripts/_heads_cli.py``): their metrics do not depend on the batch size, and an
ordinary input error is one ``error:`` line with exit 2, found before the base model loads where it
can be (it was a traceback)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from _heads_cli import run_per_checkpoint  # noqa: E402
from validate_head import validate  # noqa: E402


@pytest.fixture(scope="module")
def cache(tiny_model_dir, tmp_path_factory):
    from data_prep.synthetic import write_random_cache

    return write_random_cache(tmp_path_factory.mktemp("scripts_cache"), tiny_model_dir, n_train=4, n_val=7,
                              length_range=(6, 20), shard_size=3)


@pytest.fixture(scope="module")
def checkpoints(tiny_base, tmp_path_factory):
    import heads
    from core.config import compose

    base, _, identity = tiny_base
    root = tmp_path_factory.mktemp("scripts_ckpt")
    out = {}
    for name, args in (("falcon_k1", ["heads=falcon_k1"]), ("eagle3", ["heads=eagle3", "heads.layers=[1,2,3]"])):
        heads.save(heads.build(compose(args).heads, base), root / name, identity.to_dict())
        out[name] = root / name
    return out


def _argv(tiny_model_dir, cache, *ckpts, extra=()):
    return [str(c) for c in ckpts] + ["--cache", str(cache), "--model-path", str(tiny_model_dir), *extra]


def test_validate_metrics_do_not_depend_on_the_batch_size(tiny_model_dir, cache, checkpoints, tmp_path, capsys):
    """Σ sum / Σ count over the whole split: one batch of all 7 records equals batches of 2 (the last of 1)."""
    ck = checkpoints["falcon_k1"]
    whole = run_per_checkpoint("", validate, _argv(tiny_model_dir, cache, ck, extra=["--batch-size", "7"]))
    out = tmp_path / "m.json"
    small = run_per_checkpoint("", validate, _argv(tiny_model_dir, cache, ck, extra=["--batch-size", "2",
                                                                                     "--out", str(out)]))
    assert whole[str(ck)].keys() == small[str(ck)].keys() and "acc" in whole[str(ck)]
    for k, v in whole[str(ck)].items():
        assert small[str(ck)][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert out.is_file()
    capsys.readouterr()


@pytest.mark.parametrize("case,message", [
    ("missing", "checkpoint .*nope: no such directory"),
    ("run_folder", "is a training run's folder: pass .*best"),
    ("split", r"cache split .*test not found \(no manifest.json\)"),
    ("out_under_file", r"--out .*: .* is a file, not a folder"),
    ("batch", "--batch-size 0: must be >= 1"),
    ("layers", r"the eagle3 head reads hidden states hs\[1, 2, 3\] but cache split .* prep.layers=\[1,2,3\]"),
])
def test_input_errors_are_one_line(tiny_model_dir, cache, checkpoints, tmp_path, capsys, monkeypatch, case, message):
    import core.base_model

    ck, extra = checkpoints["falcon_k1"], []
    loads = []
    real_load = core.base_model.load_base_model
    monkeypatch.setattr("_heads_cli.load_base_model", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    if case == "missing":
        ck = tmp_path / "nope"
    elif case == "run_folder":
        import shutil

        shutil.copytree(checkpoints["falcon_k1"], tmp_path / "run" / "best")
        ck = tmp_path / "run"
    elif case == "split":
        extra = ["--split", "test"]
    elif case == "out_under_file":
        (tmp_path / "f").write_text("x")
        extra = ["--out", str(tmp_path / "f" / "m.json")]
    elif case == "batch":
        extra = ["--batch-size", "0"]
    elif case == "layers":
        ck = checkpoints["eagle3"]
    with pytest.raises(SystemExit) as exc:
        run_per_checkpoint("", validate, _argv(tiny_model_dir, cache, ck, extra=extra))
    err = capsys.readouterr().err
    # after the base loaded (the layers case) transformers' own loading bar may precede the error line
    last = err.rstrip("\n").split("\n")[-1]
    assert exc.value.code == 2 and last.startswith("error: ") and err.count("error: ") == 1, err
    assert "Traceback" not in err and (case == "layers" or err.count("\n") == 1), err
    import re

    assert re.search(message, err), err
    assert (loads == [1]) == (case == "layers")  # only the head's own needs are known after loading
