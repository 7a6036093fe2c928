"""CTC drafter in the lossless speculative runtime: parity with vanilla greedy, sim_tau vs real τ."""
from __future__ import annotations

import pytest
import torch

from decoding.speculative import SpeculativeDecoder
from decoding.vanilla import greedy_generate
from heads.ctc import CTCHead


def _prompts(tok):
    texts = ["Hello! How can I help you today?", "def add(a, b):", "The quick brown fox"]
    return [torch.tensor(tok(t)["input_ids"], dtype=torch.long) for t in texts]


def test_parity_untrained_head(tiny_base):
    base, tok, _ = tiny_base
    torch.manual_seed(0)
    head = CTCHead({"type": "ctc", "attn_implementation": "eager"}, base.config)
    head.attach_base(base)
    head.eval()
    dec = SpeculativeDecoder(base, head.make_drafter(base), eos_token_ids=[])
    for prompt in _prompts(tok):
        ref, _ = greedy_generate(base, prompt, 20, eos_token_ids=[])
        out, stats = dec.generate(prompt, 20)
        assert out == ref
        assert stats["base_forwards"] <= len(ref)


class OracleCTCHead(CTCHead):
    """A head forced to draft the base's greedy tokens: every slot row carries its anchor feature
    f_t (identity layer); the logits are one-hot on a CTC alignment of ℓ_j = labels[t+j], j <= N
    (a blank between repeats, blanks after), found by nearest-neighbour lookup of f_t in a table built from a greedy record."""

    def set_table(self, feats: torch.Tensor, labels: torch.Tensor, decoy: bool = False) -> None:
        self.decoy = decoy  # slot 1 prefers a wrong token; the right one is only its 2nd choice
        self.table_feats = feats
        self.table_labels = labels.tolist()

    def slot_inputs(self, bonus_ids, feats):
        return feats.to(self._dtype()).unsqueeze(-2).expand(*feats.shape[:-1], self.num_slots, feats.shape[-1])

    def run_layer(self, hidden, mask, position_ids, cache=None):
        return hidden

    def slot_logits(self, h):
        flat = h.reshape(-1, self.num_slots, h.shape[-1])[:, 0]
        idx = torch.cdist(flat.float(), self.table_feats.float()).argmin(-1).tolist()
        out = torch.full((len(idx), self.num_slots, self.vocab_size + 1), -20.0)
        blank = self.vocab_size
        for a, t in enumerate(idx):
            alignment = []  # ℓ_1..ℓ_N with a blank between equal neighbours, then blanks
            for lab in self.table_labels[t + 1: t + 1 + self.num_targets]:
                if alignment and alignment[-1] == lab:
                    alignment.append(blank)
                alignment.append(lab)
            alignment = (alignment + [blank] * self.num_slots)[: self.num_slots]
            for j, cls in enumerate(alignment):
                out[a, j, cls] = 20.0
            if self.decoy:
                out[a, 0, (alignment[0] + 1) % self.vocab_size] = 21.0
        return out.reshape(*h.shape[:-1], self.vocab_size + 1)


@pytest.mark.parametrize("decoy", [False, True])
def test_sim_tau_matches_real_acceptance_for_greedy_oracle(tiny_base, decoy):
    base, tok, _ = tiny_base
    prompt = _prompts(tok)[0]
    gen, _ = greedy_generate(base, prompt, 30, eos_token_ids=[])
    ids = torch.cat([prompt, torch.tensor(gen)])[None]
    with torch.no_grad():
        out = base(ids, output_hidden_states=True)
    labels, hidden = out.logits.argmax(-1), out.hidden_states[-1]
    assert torch.equal(labels[0, prompt.numel() - 1:-1], ids[0, prompt.numel():])  # regenerate-style record
    t_len = ids.shape[1]
    loss_mask = torch.arange(t_len)[None] >= prompt.numel()
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(loss_mask), "loss_mask": loss_mask,
             "labels": labels, "hidden": hidden, "aux_hidden": {}, "lengths": torch.tensor([t_len]), "ids": ["p0"]}
    head = OracleCTCHead({"type": "ctc", "val_anchors_per_seq": 1000}, base.config)
    head.attach_base(base)
    head.set_table(hidden[0], labels[0], decoy=decoy)
    n = head.num_targets
    val = head.validation_metrics(batch)
    sim_tau = float(val["sim_tau"][0] / val["sim_tau"][1])
    assert sim_tau == n + 1  # every eligible anchor accepts all N drafted tokens + the bonus
    spec_out, stats = SpeculativeDecoder(base, head.make_drafter(base), eos_token_ids=[]).generate(prompt, 30)
    assert spec_out == gen
    steps = stats["emitted_per_step"]
    # every step but the last (truncated at max_new_tokens / table end) emits exactly N+1 = sim_tau
    assert steps[:-1] == [n + 1] * (len(steps) - 1) and len(steps) >= 5
    assert sum(steps) + 1 == len(gen)  # + the first token from prefill
    if decoy:  # the tree branched at depth 1 and verification took the second-ranked branch
        assert stats["tree_nodes"] > sum(steps)
