"""Label counts in the cache (data_prep.label_counts): brute force, ranks, old caches, coverage."""
from __future__ import annotations

import io
from collections import Counter

import pytest
import torch

from data_prep import label_counts as lc
from data_prep import pipeline
from data_prep.cache import CacheReader, default_cache_dir
from tests.test_data_prep import _cfg, data_file  # noqa: F401  (fixture)


def _brute(reader: CacheReader, v: int) -> torch.Tensor:
    c = Counter()
    for i in range(len(reader)):
        r = reader[i]
        for lab, m in zip(r["labels"].tolist(), r["loss_mask"].tolist()):
            if m:
                c[lab] += 1
    out = torch.zeros(v, dtype=torch.int64)
    for k, n in c.items():
        out[k] = n
    return out


@pytest.fixture(scope="module")
def prepared(tiny_base, tiny_model_dir, data_file, tmp_path_factory):  # noqa: F811
    model, tok, ident = tiny_base
    cfg = _cfg(tiny_model_dir, data_file, tmp_path_factory.mktemp("lc"))
    out = io.StringIO()
    pipeline.prepare(cfg, model, tok, ident, rank=0, world=1, out=out)
    return default_cache_dir(cfg), out.getvalue(), int(model.config.vocab_size)


def test_counts_equal_brute_force_per_split(prepared):
    root, _, v = prepared
    for split in ("train", "val"):
        stored = lc.load_counts(root / split, scan=False)
        assert stored.dtype == torch.int64 and stored.shape == (v,)
        brute = _brute(CacheReader(root / split), v)
        assert torch.equal(stored, brute)
        assert int(stored.sum()) == CacheReader(root / split).manifest["num_assistant_tokens"]


def test_ranks_add_up(tiny_base, tiny_model_dir, data_file, tmp_path, prepared):  # noqa: F811
    model, tok, ident = tiny_base
    root, _, _ = prepared
    two = _cfg(tiny_model_dir, data_file, tmp_path / "two")
    pipeline.prepare(two, model, tok, ident, rank=1, world=2, out=None)
    assert not (default_cache_dir(two) / "train" / lc.FILE).exists()  # incomplete split: no counts yet
    pipeline.prepare(two, model, tok, ident, rank=0, world=2, out=None)
    for split in ("train", "val"):
        assert (default_cache_dir(two) / split / lc.FILE).read_bytes() == (root / split / lc.FILE).read_bytes()


def test_summary_prints_heldout_coverage(prepared):
    root, text, _ = prepared
    assert "held-out split" in text
    train, val = lc.load_counts(root / "train"), lc.load_counts(root / "val")
    rows = lc.coverage_table(train, val)
    # the tiny vocabulary is < 2048: every requested size clips to V, one row with full coverage
    assert [r["N"] for r in rows] == [train.numel()] and rows[0]["heldout_coverage"] == 1.0
    # a smaller N: coverage = brute-force share of held-out labels in the top-N training tokens
    rows = lc.coverage_table(train, val, sizes=[5])
    order = sorted(range(train.numel()), key=lambda i: (-int(train[i]), i))[:5]
    assert rows[0]["heldout_coverage"] == pytest.approx(int(val[order].sum()) / int(val.sum()))


def test_old_cache_is_scanned_and_cli_writes(prepared, tmp_path, capsys):
    import shutil

    root, _, _ = prepared
    old = tmp_path / "old"
    shutil.copytree(root, old)
    for split in ("train", "val"):
        (old / split / lc.FILE).unlink()
    with pytest.raises(FileNotFoundError, match="label_counts"):
        lc.load_counts(old / "train", scan=False)
    assert torch.equal(lc.load_counts(old / "train"), lc.load_counts(root / "train", scan=False))
    assert not (old / "train" / lc.FILE).exists()  # a scan writes nothing
    assert lc.main([str(old), "--write", "--sizes", "4,8"]) == 0
    assert "top" in capsys.readouterr().out
    assert (old / "train" / lc.FILE).read_bytes() == (root / "train" / lc.FILE).read_bytes()


def test_scan_impossible_is_a_clear_error(prepared, tmp_path, capsys):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    root, _, _ = prepared
    bad = tmp_path / "bad"
    shutil.copytree(root, bad)
    (bad / "train" / lc.FILE).unlink()
    shard = bad / "train" / "shard-00000.safetensors"
    tensors = load_file(str(shard))
    del tensors["labels"]
    save_file(tensors, str(shard), metadata={"ids": json.dumps([])})
    with pytest.raises(ValueError, match="shard-00000.safetensors has no labels"):
        lc.load_counts(bad / "train")
    assert lc.main([str(bad)]) == 2
    assert "shard-00000.safetensors" in capsys.readouterr().err


def test_count_labels_rejects_out_of_range():
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        lc.count_labels(torch.tensor([0, 4]), torch.tensor([True, True]), 4)
    assert lc.count_labels(torch.tensor([0, 4, 1]), torch.tensor([True, False, True]), 4).tolist() == [1, 1, 0, 0]


def test_coverage_of_an_empty_held_out_split_prints_no_nan():
    """A two-conversation data file leaves the held-out split empty: its coverage is NaN, printed as '-'."""
    from data_prep.label_counts import coverage_table, format_coverage

    train = torch.tensor([5, 3, 2, 0, 0, 0], dtype=torch.int64)
    text = format_coverage(coverage_table(train, torch.zeros(6, dtype=torch.int64), sizes=[2, 4]), 0)
    assert "nan" not in text.lower()
    assert text.splitlines()[1:] == ["  top      2: held-out       -   train  80.00%",
                                     "  top      4: held-out       -   train 100.00%"]
