"""Does verification's node order change bf16 rounding? (issue 26; docs/precision_eval.md)

On the packaged SmolLM2 base in bf16 with row-consistent one-token steps (:mod:`decoding.numerics`),
along vanilla greedy decoding of a few fixed instructions (not MT-bench), every 3rd position gets a
branching tree: vanilla's next 6 tokens as the top-ranked path plus two wrong siblings per depth.
The tree is verified twice from a copy of vanilla's cache: in the canonical breadth-first node
order (siblings interleaved with the path) and by :func:`decoding.verify.verify_tree` (depth-first:
the path in consecutive slots).  Printed: the share of path rows bitwise equal to vanilla's
one-token step for each order.

    PYTHONPATH=$PWD nice -n 5 python benchmarks/bench_tree_order.py
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.base_model import load_base_model  # noqa: E402
from decoding.numerics import pad_one_row_products  # noqa: E402
from decoding.tree import DraftTree  # noqa: E402
from decoding.vanilla import greedy_generate  # noqa: E402
from decoding.verify import base_forward, new_cache, verify_tree  # noqa: E402

TEXTS = ["Explain how a refrigerator works in simple terms.", "Write a short poem about autumn leaves falling.",
         "What are the main causes of inflation in an economy?"]


@torch.no_grad()
def main(new_tokens: int = 48, depth: int = 6) -> dict:
    torch.set_num_threads(1)
    m, tok, _ = load_base_model({"path": None, "dtype": "bfloat16", "attn_implementation": "eager"})
    pad_one_row_products(m)
    vocab = m.config.vocab_size
    res = {"breadth_first": [0, 0], "depth_first (verify_tree)": [0, 0]}
    for text in TEXTS:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_tensors="pt")
        ids = (ids["input_ids"] if hasattr(ids, "keys") else ids)[0]
        van, _ = greedy_generate(m, ids, new_tokens, [])
        cache = new_cache(m)
        lg, _ = base_forward(m, ids, cache, logits_to_keep=1)
        steps, snaps = [lg[-1]], {}
        for j, t in enumerate(van[:-1]):
            if j % 3 == 0 and j + depth + 2 < len(van):
                snaps[j + 1] = copy.deepcopy(cache)
            lg, _ = base_forward(m, torch.tensor([t]), cache)
            steps.append(lg[-1])
        for t, snap in snaps.items():
            paths = [van[t:t + d] + [(van[t + d] + k * 97) % vocab] for d in range(depth) for k in (1, 2)]
            tree = DraftTree.from_paths(van[t - 1], paths + [van[t:t + depth]], scores=[-1.0] * len(paths) + [0.0])
            c = copy.deepcopy(snap)
            past = c.get_seq_length()
            bfs, _ = base_forward(m, tree.tokens, c, position_ids=tree.position_ids(past),
                                  attention_mask=tree.attention_mask(past, m.dtype))
            r = verify_tree(m, copy.deepcopy(snap), tree)
            for i, node in enumerate(r.accepted_nodes):
                for name, rows in (("breadth_first", bfs), ("depth_first (verify_tree)", r.logits)):
                    res[name][0] += 1
                    res[name][1] += bool(torch.equal(rows[node], steps[t + i]))
    return {k: f"{v[1]}/{v[0]} path rows bitwise equal to the one-token steps" for k, v in res.items()}


if __name__ == "__main__":
    print(main())
