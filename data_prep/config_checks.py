"""Value checks for the ``data`` and ``prep`` config sections (registered with core.config)."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from core.config import ConfigError, check_choice, check_range, register_validator


@register_validator
def _data_prep_checks(cfg: DictConfig) -> None:
    if "data" in cfg:
        check_range(cfg, "data.heldout_fraction", 0.0, 1.0)
        if cfg.data.get("sources") and cfg.data.get("path"):
            raise ConfigError(f"data.path={cfg.data.path!r} and data.sources are both set, and data.sources would "
                              "silently win: list the file in data.sources ({path: ...}) or unset one of them")
        check_range(cfg, "data.max_length", 2)
        if cfg.data.get("max_conversations") is not None:
            check_range(cfg, "data.max_conversations", 1)
        for key, choices in (("format", ("auto", "sharegpt", "messages")), ("reader", ("auto", "tolerant", "datasets")),
                             ("split_key", ("root", "id"))):
            if cfg.data.get(key) is not None:
                check_choice(cfg, f"data.{key}", choices)
        if not str(cfg.data.get("split_salt", "")):
            raise ConfigError("data.split_salt must be a non-empty string")
    if "prep" in cfg:
        check_choice(cfg, "prep.dtype", ("bfloat16", "float16", "float32", "float8_e4m3fn"))
        check_range(cfg, "prep.shard_size", 1)
        check_range(cfg, "prep.batch_tokens", 1)
        check_range(cfg, "prep.gen_batch_size", 1)
        from decoding.prepacked import prepack_mode

        if prepack_mode(cfg.prep.get("prepack_weights", "auto")) is None:
            raise ConfigError(f"prep.prepack_weights={cfg.prep.prepack_weights!r}: use auto, true or false")
        if cfg.prep.get("max_new_tokens") is not None:
            check_range(cfg, "prep.max_new_tokens", 1)
        layers = OmegaConf.select(cfg, "prep.layers")
        if layers is None or not OmegaConf.is_list(layers) or not all(
                isinstance(l, int) and not isinstance(l, bool) and l >= 1 for l in layers):
            raise ConfigError(f"prep.layers={layers!r} must be a list of intermediate hidden-state indices >= 1 "
                              "(hs[l], 1 <= l < L; the final layer L is always cached), e.g. prep.layers=[8,15,22]")
        if len(set(layers)) != len(layers):  # stored once, but a second hash of the same cache
            raise ConfigError(f"prep.layers={list(layers)} repeats a layer; list each once")
