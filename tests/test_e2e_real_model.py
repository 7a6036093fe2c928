"""End to end on the real packaged SmolLM2-135M-Instruct over a few real ShareGPT conversations."""
from __future__ import annotations

import pytest
import torch

from core.config import compose
from data_prep import pipeline
from data_prep.cache import CacheReader, collate, default_cache_dir
from data_prep.sharegpt import ReadStats, iter_records


@pytest.mark.slow
def test_real_model_real_sharegpt_regenerate(tmp_path):
    from core.base_model import load_base_model

    # the packaged file is cut off mid-record: every complete record is recovered
    from data_prep.sharegpt import resolve_path

    stats = ReadStats()
    with resolve_path(None) as path:
        n = sum(1 for _ in iter_records(path, stats))
    assert stats.finished and n == stats.records and 17_500 < n < 17_800 and stats.unparsed_bytes > 0

    cfg = compose(["data.max_conversations=3", "data.max_length=192", "prep.max_new_tokens=8", "prep.shard_size=2",
                   "prep.layers=[15]", "prep.progress=false", f"output_root={tmp_path}"])
    assert cfg.labels == "regenerate"
    model, tok, ident = load_base_model(cfg.model)
    summary = pipeline.prepare(cfg, model, tok, ident, out=None)
    assert summary["complete"] and summary["conversations"] == 3
    assert summary["dropped"].get("bad_first_turn", 0) >= 0 and summary["bytes_per_token"] > 576 * 2 * 2
    root = default_cache_dir(cfg)
    for split in ("train", "val"):
        reader = CacheReader(root / split, verify=True)
        assert reader.manifest["final_layer"] == 30 and reader.manifest["base"]["hidden_size"] == 576
        for i in range(len(reader)):
            rec = reader[i]
            with torch.no_grad():
                out = model(rec["input_ids"][None], output_hidden_states=True)
            torch.testing.assert_close(rec["hidden"].float(), out.hidden_states[30][0], atol=3e-2, rtol=2e-2)
            torch.testing.assert_close(rec["aux_hidden"][15].float(), out.hidden_states[15][0], atol=0.1, rtol=2e-2)
            agree = (rec["labels"] == out.logits[0].argmax(-1)).float().mean()
            assert agree > 0.99  # batched vs single forward may flip a near-tie
            pos = rec["loss_mask"].nonzero().flatten()
            assert 0 < len(pos) <= 8 * 4  # regenerated turns, at most max_new_tokens each
            assert torch.equal(rec["labels"][pos - 1], rec["input_ids"][pos])
        if len(reader):
            batch = collate([reader[i] for i in range(len(reader))], reader.pad_id)
            assert batch["hidden"].shape[-1] == 576
