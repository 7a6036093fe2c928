"""Falcon decoding (METHODS.md §1.5): tree template, batched drafting vs a fresh forward, parity."""
from __future__ import annotations

import itertools

import pytest
import torch

from decoding.falcon import FalconTreeTemplate
from decoding.masks import additive_mask


# -- tree template -------------------------------------------------------------------------------
def test_tree_from_node_children():
    spec = {"node_children": {"root": 3, "0": 2, "1": 1, "0,0": 2, "0,0,1": 1, "0,0,1,0": 5}}
    t = FalconTreeTemplate.from_config(spec, block_size=2, passes=2)  # depth cap 4
    want = [(), (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 1, 0)]
    assert t.paths == want and t.num_nodes == 10
    for i, p in enumerate(t.paths):
        assert t.depths[i] == len(p)
        assert t.parents[i] == (-1 if i == 0 else t.paths.index(p[:-1]))
        assert t.ranks[i] == (-1 if i == 0 else p[-1])
    assert t.top_k == 3
    # anchors/slots: depth-1,2 nodes come from the root block, depth-3,4 from the block of their depth-2 ancestor
    assert [t.anchor(i) for i in range(1, 10)] == [0, 0, 0, 0, 0, 0, 4, 4, 4]
    assert [t.slot(i) for i in range(1, 10)] == [0, 0, 0, 1, 1, 1, 0, 0, 1]
    assert t.block_creators() == [[4]] and t.num_passes() == 2
    t3 = FalconTreeTemplate.from_config(spec, block_size=2, passes=3)
    assert t3.num_nodes == 15 and t3.num_passes() == 3 and t3.block_creators() == [[4], [9]]


def test_a_node_children_key_that_no_parent_reaches_is_refused():
    """``{root: 2, '5': 3}`` drafted 2 nodes and ignored rank 5's 3 children without a word."""
    with pytest.raises(ValueError, match=r"paths \[\(5,\)\] are not reachable from the root"):
        FalconTreeTemplate.from_config({"node_children": {"root": 2, "5": 3}}, block_size=1, passes=4)
    with pytest.raises(ValueError, match=r"paths \[\(0, 3\)\] are not reachable"):
        FalconTreeTemplate.from_config({"node_children": {"root": 2, "0": 1, "0,3": 1}}, block_size=1, passes=4)
    # past the depth cap a key is cut (documented), not refused
    assert FalconTreeTemplate.from_config({"node_children": {"root": 1, "0": 1, "0,0": 1}}, 1, 1).num_nodes == 2


def test_tree_from_depth_children_and_paths():
    t = FalconTreeTemplate.from_config({"depth_children": [3, 2, 2]}, block_size=1, passes=4)
    assert t.num_nodes == 1 + 3 + 6 + 12
    for i, p in enumerate(t.paths[1:], start=1):
        assert t.paths[t.parents[i]] == p[:-1]
    assert sorted(t.paths[1:]) == sorted(p for d in (1, 2, 3) for p in itertools.product(*[range(c) for c in [3, 2, 2][:d]]))
    assert t.num_passes() == 3  # k=1: creators at depths 1 and 2
    tp = FalconTreeTemplate.from_config({"paths": [[0, 1, 2], [1]]}, block_size=3, passes=1)
    assert tp.paths == [(), (0,), (1,), (0, 1), (0, 1, 2)] and tp.parents == [-1, 0, 0, 1, 3]
    assert tp.num_passes() == 1
    with pytest.raises(ValueError, match="exactly one"):
        FalconTreeTemplate.from_config({"paths": [[0]], "depth_children": [1]}, 2, 2)


# -- drafting equals a fresh (uncached) forward ----------------------------------------------------
def _expected_paths(head, template, toks, feats, gids):
    """Token paths of the tree, recomputed block by block with one uncached forward each.

    toks: x_1..x_n (slot inputs), feats: f_0..f_{n−1}, gids: global block id of every true slot.
    """
    k = head.k
    n = feats.shape[0]
    memo_blocks = {}
    node_tok = {0: None}

    def block(anchor):  # outputs [k, H] of the block created by `anchor` (0 = root block)
        if anchor in memo_blocks:
            return memo_blocks[anchor]
        chain = []
        v = anchor
        while v != 0:
            chain.append(v)
            v = template.anchor(v)
        chain = chain[::-1]
        F, X, G = [feats], [toks], list(gids)
        P = list(range(n))
        for j, u in enumerate(chain, start=1):
            F.append(block(template.anchor(u)))
            path, v = [], u
            for _ in range(k):
                path.append(token(v))
                v = template.parents[v]
            X.append(torch.tensor(path[::-1]))
            G += [(99, j)] * k
            P += [n - k + j * k + i for i in range(k)]
        Fc, Xc = torch.cat(F), torch.cat(X)
        vis = torch.tensor([[gj <= gi for gj in G] for gi in G])
        out = head(Fc[None], Xc[None], torch.tensor(P)[None], additive_mask(vis, torch.float32)[None, None])[0]
        memo_blocks[anchor] = out[-k:]
        return out[-k:]

    node_lp = {}

    def token(u):
        if u not in node_tok or node_tok[u] is None:
            logp = torch.log_softmax(head.lm_head(block(template.anchor(u)))[template.slot(u)].float(), -1)
            top = logp.topk(template.top_k)
            node_tok[u] = int(top.indices[template.ranks[u]])
            node_lp[u] = float(top.values[template.ranks[u]])
        return node_tok[u]

    paths = {}
    for u in range(1, template.num_nodes):
        p, v, score = [], u, 0.0
        while v != 0:
            p.append(token(v))
            score += node_lp[v]
            v = template.parents[v]
        paths[tuple(p[::-1])] = score
    return paths


def _same_tree(tree, expected):
    """Same token paths, and every node's score (cumulative log-probability) equal to a relative 1e-4."""
    got = {tuple(tree.token_path(i)[1:]): float(tree.scores[i]) for i in range(1, tree.num_nodes)}
    return got.keys() == expected.keys() and all(abs(got[p] - expected[p]) < 1e-4 * max(1.0, abs(expected[p])) for p in got)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_batched_drafting_matches_fresh_forward(tiny_base, k):
    from heads.registry import build

    base = tiny_base[0]
    tree = {"node_children": {"root": 3, "0": 2, "1": 2, "0,0": 2, "0,1": 1, "1,0": 1, "0,0,0": 2, "0,0,1": 1,
                              "0,1,0": 1, "0,0,0,0": 2, "0,0,0,0,0": 1}}
    head = build({"type": "falcon", "block_size": k, "glancing": {"enabled": k > 1},
                  "decoding": {"passes": 3, "tree": tree}}, base).eval()
    with torch.no_grad():  # larger weights than the init: peaky attention makes any mask/KV slip visible
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15, generator=torch.Generator().manual_seed(p.numel()))
    drafter = head.make_drafter(base)
    g = torch.Generator().manual_seed(k)
    seq = torch.randint(3, 300, (16,), generator=g)
    with torch.no_grad():
        f = base(seq[None], output_hidden_states=True).hidden_states[-1][0]
    n1 = 9
    drafter.start(seq[:n1], f[:n1])
    t1 = drafter.draft(int(seq[n1]))
    assert t1.drafter_passes == drafter.template.num_passes()
    gids1 = [(0, (t - n1) // k) for t in range(n1)]
    with torch.no_grad():
        assert _same_tree(t1, _expected_paths(head, drafter.template, seq[1:n1 + 1], f[:n1], gids1))
    # step 2: 3 tokens accepted (root + 2).  Every context slot is aligned to step 2's root block,
    # whatever step 1's alignment was (issue 12): k = 1, 3 reuse step 1's cache (n1 ≡ n2 mod k),
    # k = 2 starts the cache of the other alignment and keeps step 1's for later
    drafter.accept(seq[n1:n1 + 3], f[n1:n1 + 3])
    n2 = n1 + 3
    t2 = drafter.draft(int(seq[n2]))
    gids2 = [(0, (t - n2) // k) for t in range(n2)]
    with torch.no_grad():
        assert _same_tree(t2, _expected_paths(head, drafter.template, seq[1:n2 + 1], f[:n2], gids2))
    assert drafter.caches[n2 % k].get_seq_length() == n2 - k
    assert drafter.caches[n1 % k].get_seq_length() == (n2 - k if n1 % k == n2 % k else n1 - k)
    assert drafter.context_slots == n1 + (n2 - (n1 - k) if n1 % k == n2 % k else n2)


# -- parity with vanilla greedy decoding ------------------------------------------------------------
def _train_tiny_head(base, k, steps=60, seed=0):
    """Fit a head briefly on the tiny base's own greedy continuations, so drafts get accepted."""
    from heads.base import Progress
    from heads.registry import build

    torch.manual_seed(seed)
    head = build({"type": "falcon", "block_size": k, "glancing": {"enabled": k > 1},
                  "decoding": {"passes": 3, "tree": {"depth_children": [3, 2, 2, 1, 1, 1]}}}, base)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 300, (8, 6), generator=g)
    with torch.no_grad():
        ids = base.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=40, do_sample=False,
                            pad_token_id=0, eos_token_id=None)
        hs = base(ids, output_hidden_states=True).hidden_states[-1]
    am = torch.ones_like(ids, dtype=torch.bool)
    lm = am.clone()
    lm[:, :6] = False
    batch = dict(input_ids=ids, hidden=hs, attention_mask=am, loss_mask=lm, labels=base.lm_head(hs).argmax(-1))
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    head.train()
    for step in range(steps):
        loss, _ = head.training_loss(batch, Progress(step=step, total_steps=steps))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval(), prompts


@pytest.mark.parametrize("k", [1, 2])
def test_parity_with_vanilla_greedy(tiny_base, k):
    from decoding.speculative import SpeculativeDecoder
    from decoding.vanilla import greedy_generate

    base, tok, _ = tiny_base
    head, prompts = _train_tiny_head(base, k)
    drafter = head.make_drafter(base)
    eos = [tok.eos_token_id]
    accepted = 0
    g = torch.Generator().manual_seed(5)
    cases = [prompts[0], prompts[3], torch.randint(3, 300, (5,), generator=g)]
    for prompt in cases:
        ref, _ = greedy_generate(base, prompt, 32, eos)
        out, stats = SpeculativeDecoder(base, drafter, eos).generate(prompt, 32)
        assert out == ref
        accepted += sum(stats["accepted_per_depth"])
        assert stats["drafter_passes"] <= stats["steps"] * drafter.template.num_passes()
    assert accepted > 0  # the accept path (KV bookkeeping after multi-token acceptance) is exercised


# -- end to end: the generic trainer, checkpoint export, reload, speculative decoding --------------
def test_train_export_reload_and_decode(tiny_base, tmp_path):
    import heads
    from core.config import compose
    from data_prep import cache as C
    from decoding.speculative import SpeculativeDecoder
    from decoding.vanilla import greedy_generate
    from train.run import train

    model, tok, identity = tiny_base
    L = identity.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 8), ("val", 4)):
        recs = []
        for i in range(n):
            ids = torch.randint(3, 300, (1, int(torch.randint(8, 20, (1,), generator=g))), generator=g)
            with torch.no_grad():
                o = model(input_ids=ids, output_hidden_states=True)
            mask = torch.zeros(ids.shape[1], dtype=torch.bool)
            mask[2:] = True
            recs.append({"input_ids": ids[0], "loss_mask": mask, "labels": o.logits[0].argmax(-1),
                         "hidden": {L: o.hidden_states[L][0]}, "id": f"{split}{i}"})
        d = tmp_path / "cache" / split
        d.mkdir(parents=True)
        C.write_shard(d, 0, C.build_shard_tensors(recs, [], L, torch.float32), [r["id"] for r in recs],
                      {"config_hash": "test", "dropped": {}})
        C.write_manifest(d, 1, {"config_hash": "test", "base": identity.to_dict(), "final_layer": L, "layers": [],
                                "hidden_size": identity.hidden_size, "pad_id": 2, "split": split})
    cfg = compose(["heads=falcon", "train.logger=csv", "train.progress_bar=false", "train.sanity_val_steps=0",
                   f"output_root={tmp_path}", f"train.cache_dir={tmp_path / 'cache'}", "train.run_name=f",
                   "train.accelerator=cpu", "train.devices=1", "train.max_steps=4", "train.batch_size=4",
                   "train.val_every_n_steps=2", "train.scheduler.warmup_steps=1", "heads.glancing.unit=step"])
    result = train(cfg, base=tiny_base)
    head, meta = heads.load(result["run_dir"] / "best", base_model=model)
    assert meta["head_type"] == "falcon" and head.k == 2 and head.cfg["glancing"]["enabled"]
    assert "sim_tau" in result["module"].validation_results
    prompt = torch.randint(3, 300, (7,), generator=g)
    ref, _ = greedy_generate(model, prompt, 12, [tok.eos_token_id])
    out, stats = SpeculativeDecoder(model, head.eval().make_drafter(model), [tok.eos_token_id]).generate(prompt, 12)
    assert out == ref
    # 4 passes per step (k = 2, depth 8), except where fewer tokens are left: a step with R tokens left
    # verifies depths <= R - 1 only and runs only the ceil((R - 1) / k) passes that produce them
    emitted, made, want = stats["emitted_per_step"], 1, 0
    for e in emitted:
        want += min(4, -(-(12 - made - 1) // 2))
        made += e
    assert stats["drafter_passes"] == want < 4 * stats["steps"]
