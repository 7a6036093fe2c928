"""heads.draft_vocab: selection rule (brute force), validation errors, mapping round-trips, slicing."""
from __future__ import annotations

import itertools

import pytest
import torch

from heads import draft_vocab as dv


def _brute_top(counts: list[int], n: int) -> list[int]:
    """Top-n ids by (count desc, id asc), by exhaustive ranking: a token beats another iff its
    count is higher, or equal with a lower id."""
    v = len(counts)
    beaten_by = [sum(1 for j in range(v) if counts[j] > counts[i] or (counts[j] == counts[i] and j < i)) for i in range(v)]
    return sorted(i for i in range(v) if beaten_by[i] < n)


def test_select_matches_brute_force_with_ties():
    g = torch.Generator().manual_seed(1)
    for trial in range(30):
        v = int(torch.randint(2, 40, (1,), generator=g))
        counts = torch.randint(0, 4, (v,), generator=g)  # many ties
        for n in {2, v, max(2, v // 2), max(2, v // 3)}:
            got = dv.select_d2t(counts, n)
            assert got.dtype == torch.int64
            assert got.tolist() == _brute_top(counts.tolist(), n), (counts.tolist(), n)


def test_ties_go_to_lower_id_and_result_sorted():
    counts = torch.tensor([5, 1, 5, 0, 5, 9])
    assert dv.select_d2t(counts, 3).tolist() == [0, 2, 5]
    assert dv.select_d2t(counts, 2).tolist() == [0, 5]


@pytest.mark.parametrize("size", [0, 1, 7, -3, 2.5, "8", True])
def test_check_size_rejects(size):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        dv.check_size(size, 6)


def test_check_size_accepts():
    assert dv.check_size(None, 6) is None
    assert dv.check_size(2, 6) == 2 and dv.check_size(6, 6) == 6 and dv.check_size(4.0, 6) == 4


@pytest.mark.parametrize(
    "d2t,size,match",
    [
        ([0, 2, 2, 5], None, "appears more than once"),
        ([0, 2, 6], None, "out of range"),
        ([-1, 2, 3], None, "out of range"),
        ([0, 2, 3], 4, "expected draft_vocab_size=4"),
        ([3], None, "must be in"),
        ([3, 1, 2], None, "not sorted"),
    ],
)
def test_validate_d2t_errors(d2t, size, match):
    with pytest.raises(ValueError, match=match):
        dv.validate_d2t(torch.tensor(d2t), 6, size)


def test_validate_rejects_float():
    with pytest.raises(ValueError, match="integer"):
        dv.validate_d2t(torch.tensor([0.0, 1.0]), 6)


def test_round_trip_all_subsets():
    v = 6
    for n in range(2, v + 1):
        for sub in itertools.combinations(range(v), n):
            vocab = dv.DraftVocab.from_d2t(torch.tensor(sub), v)
            t2d = vocab.t2d
            assert t2d.tolist() == [i in sub for i in range(v)]
            base = torch.arange(v)
            draft = vocab.to_draft(base)
            assert ((draft >= 0) == t2d).all()
            assert vocab.to_base(draft[t2d]).tolist() == list(sub)
            assert vocab.to_draft(vocab.d2t).tolist() == list(range(n))
            assert (dv.d2t_offsets(vocab.d2t) + torch.arange(n)).tolist() == list(sub)


def test_tensors_round_trip_through_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file

    vocab = dv.DraftVocab.from_counts(torch.tensor([3, 0, 7, 7, 1, 2, 9, 0]), 4)
    save_file(vocab.tensors(), tmp_path / "m.safetensors")
    back = dv.DraftVocab.from_tensors(load_file(tmp_path / "m.safetensors"), 8, size=4)
    assert torch.equal(back.d2t, vocab.d2t) and back.d2t.tolist() == [0, 2, 3, 6]
    bad = vocab.tensors()
    bad["t2d"][1] = True
    with pytest.raises(ValueError, match="t2d"):
        dv.DraftVocab.from_tensors(bad, 8, size=4)
    with pytest.raises(ValueError, match="no 'd2t'"):
        dv.DraftVocab.from_tensors({}, 8)


def test_slice_rows_gives_subset_logits():
    w = torch.randn(10, 4)
    h = torch.randn(3, 4)
    vocab = dv.DraftVocab.from_d2t(torch.tensor([1, 4, 7]), 10)
    sub = vocab.slice_rows(w)
    assert sub.shape == (3, 4)
    torch.testing.assert_close(h @ sub.T, (h @ w.T)[:, [1, 4, 7]])
    assert dv.slice_rows(w, None) is w
    with pytest.raises(ValueError, match="rows"):
        vocab.slice_rows(torch.randn(9, 4))


def test_coverage():
    counts = torch.tensor([3, 0, 7, 7, 1, 2])
    assert dv.coverage(counts, torch.tensor([2, 3])) == pytest.approx(14 / 20)
    assert dv.coverage(counts, None) == 1.0


def test_auto_size_is_full_for_small_vocabularies():
    assert dv.check_size("auto", 384) is None  # the tiny test model keeps its full vocabulary
    assert dv.check_size("auto", 49152) == dv.AUTO_SIZE < 49152
