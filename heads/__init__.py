"""Draft heads: a registry, so a new head is one new module plus one config file.

``heads.build(cfg_heads, base_model)`` constructs the head named by ``cfg_heads.type`` and
attaches the base model's frozen weights; ``heads.save`` / ``heads.load`` write and read a
checkpoint directory (``model.safetensors`` + ``config.json``, no pickle).
"""
from heads.registry import HEADS, build, load, register, save  # noqa: F401
from heads.base import DraftHead, Progress  # noqa: F401
