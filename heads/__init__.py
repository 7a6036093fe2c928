"""Draft heads: a registry, so a new head is one new module plus one config file.

``heads.build(cfg_heads, base_model)`` constructs the head named by ``cfg_heads.type`` and
attaches the base model's frozen weights; ``heads.save`` / ``heads.load`` write and read a
checkpoint directory (``model.safetensors`` + ``config.json``, no pickle).
"""
from heads.registry import HEADS, build, load, register, save  # noqa: F401
from heads.base import DraftHead, Progress  # noqa: F401


def _register_config_checks() -> None:
    from core.config import ConfigError, register_validator

    @register_validator
    def _heads_checks(cfg) -> None:
        """``heads.type`` names a registered head; its class's ``check_config(dict)`` (if any) passes."""
        if "heads" not in cfg or cfg.heads.get("type") is None:
            return
        from omegaconf import OmegaConf

        from heads.registry import head_class

        try:
            cls = head_class(str(cfg.heads.type))
        except KeyError as exc:
            raise ConfigError(f"heads.type: {exc.args[0]}") from None
        size = cfg.heads.get("draft_vocab_size")
        if size is not None and size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 2):
            raise ConfigError(f"heads.draft_vocab_size={size!r}: expected an integer >= 2 (at most the base "
                              "vocabulary size), auto, or null for the full vocabulary")
        check = getattr(cls, "check_config", None)
        if check is not None:
            try:
                check(OmegaConf.to_container(cfg.heads, resolve=True))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            except (TypeError, KeyError) as exc:  # e.g. a key set to null that must hold a value
                nulls = sorted(k for k, v in OmegaConf.to_container(cfg.heads).items() if v is None)
                raise ConfigError(f"heads={cfg.choices.get('heads', cfg.heads.type) if 'choices' in cfg else cfg.heads.type}: "
                                  f"bad value ({exc})" + (f"; keys set to null: heads.{', heads.'.join(nulls)}"
                                                          if nulls else "")) from None


_register_config_checks()
