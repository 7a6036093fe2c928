"""A tiny random Llama and a tiny ChatML tokenizer, built locally with no download.

Unit tests and CPU benchmarks use these in place of the real base model.  The tokenizer is a
byte-level BPE trained in memory on a fixed corpus, with SmolLM2's ChatML special tokens and
chat template, so the data-prep path (``apply_chat_template``, loss masks) is exercised
exactly as with the real model.
"""
from __future__ import annotations

from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts several tokens and verifies them in one forward pass.",
    "Hello! How can I help you today? Please write a short poem about the sea.",
    "def add(a, b):\n    return a + b\n",
    "1 2 3 4 5 6 7 8 9 10 + - * / = ( ) [ ] { } : ; , . ? ! ' \"",
    "system user assistant You are a helpful AI assistant.",
] * 20


def tiny_tokenizer(vocab_size: int = 384):
    """A ``PreTrainedTokenizerFast`` (byte-level BPE, ChatML template, eos = ``<|im_end|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_llama_config(vocab_size: int = 384, hidden_size: int = 64, num_layers: int = 4, **overrides):
    """A ``LlamaConfig`` with SmolLM2's shape ratios (tied embeddings, GQA 4:2) at toy size."""
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_llama(seed: int = 0, **config_overrides):
    """A randomly initialised, frozen, fp32 ``LlamaForCausalLM`` from :func:`tiny_llama_config`."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**config_overrides)).eval()
    model.requires_grad_(False)
    return model


def save_tiny_model(directory: str | Path, seed: int = 0, **config_overrides) -> Path:
    """Write a tiny model + tokenizer as a local HF folder (what ``model.path`` accepts)."""
    directory = Path(directory)
    tok = tiny_tokenizer(config_overrides.get("vocab_size", 384))
    model = tiny_llama(seed=seed, vocab_size=len(tok), **{k: v for k, v in config_overrides.items() if k != "vocab_size"})
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


def write_random_cache(root: str | Path, model_dir: str | Path, *, n_train: int, n_val: int, layers=(),
                       length_range: tuple[int, int] = (6, 20), mask_start=None, shard_size: int = 8,
                       tag: str = "test") -> Path:
    """A cache in the real ``data_prep.cache`` format over random token sequences.

    Each record is a random sequence of length ``T ~ U[length_range)`` run through the base model
    at ``model_dir`` (fp32, eager attention): greedy ``labels`` are the argmax of its logits,
    ``hidden`` the final post-norm layer hs[L] plus ``layers``.  The loss mask is True from
    ``mask_start(T, generator)`` on (default: a random start in [1, 4), drawn after the ids).
    Splits ``root/train`` (seed 1) and ``root/val`` (seed 2); the manifest's config hash is ``tag``.

    Returns:
        ``root``.
    """
    from core.base_model import load_base_model
    from data_prep import cache as C

    root = Path(root)
    layers = [int(l) for l in layers]
    if mask_start is None:
        mask_start = lambda T, g: int(torch.randint(1, 4, (1,), generator=g))  # noqa: E731
    model, _, identity = load_base_model({"path": str(model_dir), "dtype": "float32", "attn_implementation": "eager"})
    L = int(model.config.num_hidden_layers)
    for split, n, seed in (("train", n_train, 1), ("val", n_val, 2)):
        g = torch.Generator().manual_seed(seed)
        records = []
        for i in range(n):
            T = int(torch.randint(*length_range, (1,), generator=g))
            ids = torch.randint(3, int(model.config.vocab_size), (1, T), generator=g)
            with torch.no_grad():
                out = model(input_ids=ids, output_hidden_states=True)
            mask = torch.zeros(T, dtype=torch.bool)
            mask[mask_start(T, g):] = True
            records.append({"input_ids": ids[0], "loss_mask": mask, "labels": out.logits[0].argmax(-1),
                            "hidden": {l: out.hidden_states[l][0] for l in {L, *layers}}, "id": f"{split}{i}"})
        directory = root / split
        directory.mkdir(parents=True, exist_ok=True)
        shards = [records[i:i + shard_size] for i in range(0, len(records), shard_size)]
        for k, recs in enumerate(shards):
            C.write_shard(directory, k, C.build_shard_tensors(recs, layers, L, torch.float32),
                          [r["id"] for r in recs], {"config_hash": tag, "dropped": {}})
        C.write_manifest(directory, len(shards), {"config_hash": tag, "base": identity.to_dict(), "final_layer": L,
                                                  "layers": list(layers), "hidden_size": int(model.config.hidden_size),
                                                  "pad_id": 2, "split": split})
    return root
