"""Lossless greedy speculative-decoding runtime (see docs/design.md "Decoding runtime API").

Modules: :mod:`decoding.tree` (draft token trees, tree attention masks), :mod:`decoding.verify`
(one base forward over a tree, greedy acceptance, KV-cache compaction), :mod:`decoding.vanilla`
(KV-cached greedy reference), :mod:`decoding.speculative` (the Drafter/Decoder protocols and the
generic speculative loop), :mod:`decoding.reference` (oracle and random reference drafters).
"""
from decoding.tree import DraftTree, TreeError  # noqa: F401
from decoding.verify import VerifyResult, prefill, verify_tree  # noqa: F401,E402
from decoding.vanilla import VanillaDecoder, eos_token_ids, greedy_generate  # noqa: F401,E402
from decoding.speculative import Decoder, Drafter, SpeculativeDecoder, tau  # noqa: F401,E402
