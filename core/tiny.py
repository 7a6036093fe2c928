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
