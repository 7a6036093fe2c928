"""Command-line configuration: YAML files under ``configs/`` composed with omegaconf.

Every entry point takes arguments of two kinds:

* **group selections** ``group=option`` (no dot in the key): ``heads=ctc`` loads
  ``configs/heads/ctc.yaml`` into ``cfg.heads``.  The groups are the sub-directories of
  ``configs/`` (except ``sweeps``); their defaults are listed under ``defaults:`` in
  ``configs/config.yaml``.
* **overrides** ``key=value`` in omegaconf dotlist syntax: ``train.lr=3e-4``,
  ``prep.layers=[8,15,22]``, ``labels=teacher_forced``.

An unknown group, group option or key raises :class:`ConfigError` naming the valid choices.
The composed config is struct-mode (no new keys) and is validated by :func:`validate`.
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from core.io import atomic_write_text, output_dir_problem, sha256_json

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = Path(os.environ.get("DRAFTHEADS_CONFIG_DIR", REPO_ROOT / "configs"))
NON_GROUP_DIRS = {"sweeps"}


class ConfigError(ValueError):
    """A bad command-line argument or config value; the message names the key and the valid choices."""


def groups() -> list[str]:
    """Names of the config groups: the sub-directories of ``configs/`` that hold YAML options."""
    return sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir() and p.name not in NON_GROUP_DIRS)


def group_options(group: str) -> list[str]:
    """Option names (YAML stems) available in config group ``group``."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def _split_args(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    selections: dict[str, str] = {}
    overrides: list[str] = []
    valid_groups = groups()
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(
                f"argument {arg!r} is not key=value; groups: {', '.join(valid_groups)}; "
                "overrides look like section.key=value"
            )
        key, value = arg.split("=", 1)
        key = key.lstrip("+")
        if "." not in key and key in valid_groups:
            selections[key] = value
        else:
            overrides.append(f"{key}={value}")
    return selections, overrides


def _valid_keys(cfg: DictConfig, dotted: str) -> tuple[str, list[str]]:
    parts = dotted.split(".")
    node = cfg
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, DictConfig) and part in node and isinstance(node[part], DictConfig):
            node = node[part]
        else:
            return ".".join(parts[: i + 1]), sorted(node.keys()) if isinstance(node, DictConfig) else []
    return ".".join(parts[:-1]) or "<root>", sorted(node.keys()) if isinstance(node, DictConfig) else []


def compose(argv: Sequence[str] = ()) -> DictConfig:
    """Compose ``configs/config.yaml``, the selected group options and the dotlist overrides.

    Args:
        argv: command-line arguments, e.g. ``["heads=ctc", "train.max_steps=10"]``.

    Returns:
        A struct-mode ``DictConfig``.  ``cfg.choices`` records the selected option of every group.

    Raises:
        ConfigError: an argument is not ``key=value``, a value is empty (``key=``, which OmegaConf would
            read as null, i.e. the default data or prompts), a group option does not exist, a key is
            unknown (the message lists the valid keys of that section), or :func:`validate` fails.

    A value starting with ``~/`` is expanded to the home directory: bash expands ``~`` only at the start of
    a word or after ``=`` in a valid variable name, never in ``data.path=~/x``.  A key of :data:`TEXT_KEYS`
    (a path or a name) keeps a value YAML would read as a number as the text typed (``train.run_name=2024``).
    """
    base = OmegaConf.load(CONFIG_DIR / "config.yaml")
    defaults = dict(base.pop("defaults", {}) or {})
    selections, overrides = _split_args(argv)
    for group in groups():
        defaults.setdefault(group, None)
    choices = {}
    for group, default in defaults.items():
        if group not in groups():
            raise ConfigError(f"config.yaml defaults name unknown group {group!r}; groups: {', '.join(groups())}")
        option = selections.get(group, default)
        if option is None:
            continue
        path = CONFIG_DIR / group / f"{option}.yaml"
        if not path.exists():
            raise ConfigError(
                f"unknown option {group}={option}; valid choices: {', '.join(group_options(group))}"
            )
        base[group] = OmegaConf.load(path)
        choices[group] = option
    base["choices"] = choices
    OmegaConf.set_struct(base, True)
    defaults = copy.deepcopy(base)  # a key's type is its default's, not an earlier override's (a wrapper's list, then off)
    for item in overrides:
        key, value = item.split("=", 1)
        if not value.strip():  # OmegaConf reads `key=` as null: an unset shell variable would pick the default data/prompts
            raise ConfigError(f"{key} is empty ({item!r}, e.g. an unset shell variable): give a value, or {key}=null "
                              "for the default")
        try:
            parsed = OmegaConf.from_dotlist([item])
            new = OmegaConf.select(parsed, key)
            if key in TEXT_KEYS and isinstance(new, (int, float)) and not isinstance(new, bool):
                new = value.strip()  # a folder or run named 2024: YAML read a number, the key names a path or name
            if isinstance(new, str) and new.startswith("~/"):  # the shell leaves `key=~/x` unexpanded (a lone ~ is YAML's null)
                new = os.path.expanduser(new)
            check_override_type(key, OmegaConf.select(defaults, key, default=None, throw_on_missing=False), new)
            OmegaConf.update(base, key, new, merge=True)
        except (ConfigKeyError, ConfigAttributeError):
            where, valid = _valid_keys(base, key)
            raise ConfigError(
                f"unknown config key {key!r} (in {where!r}); valid keys there: {', '.join(valid)}"
            ) from None
        except OmegaConfBaseException as exc:
            raise ConfigError(f"bad override {item!r}: {exc}") from None
        except yaml.YAMLError as exc:  # malformed value, e.g. an unclosed [ or {
            raise ConfigError(f"bad override {item!r}: not a valid YAML value ({' '.join(str(exc).split())})") from None
    validate(base)
    return base


#: keys that hold a path or a name: a value YAML reads as a number (``train.cache_dir=2024``, a folder named
#: 2024) is kept as the text typed; as a number it was a TypeError traceback wherever the path was opened
TEXT_KEYS = frozenset({"output_root", "resume", "data.path", "model.path", "model.cache_dir", "prep.cache_dir",
                       "train.cache_dir", "train.run_name", "train.wandb_project", "eval.checkpoint", "eval.prompts",
                       "eval.output_dir"})


def _kind(value) -> str | None:
    """The type family of a config value: bool, int, number (float), list, mapping; None for str/null."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "number"
    if isinstance(value, (list, tuple, ListConfig)):
        return "list"
    if isinstance(value, (dict, DictConfig)):
        return "mapping"
    return None


_KIND_TEXT = {"bool": "true or false", "int": "an integer", "number": "a number", "list": "a list, e.g. [1,2]",
              "mapping": "a mapping, e.g. {a: 1}"}


def check_override_type(key: str, default, value) -> None:
    """Typed validation of one override against the value it replaces (the YAML default).

    The default's type is the key's type: a boolean key takes ``true``/``false``, an integer key an
    integer, a float key any number, a list key a list, a mapping key a mapping.  ``null`` is always
    accepted here (the section's registered checks decide whether the key may be null); keys whose
    default is a string or null accept any value (they are unions such as ``train.devices`` or
    ``resume``, checked by their section's validator).  A non-finite number (``.nan``, ``.inf``,
    ``-.inf``, alone or inside a list or mapping) is refused for every key: NaN passes every range
    check (``nan < 0`` is false) and trains NaN weights, an inf overflows where it is used.  Used by :func:`compose` for every
    ``key=value`` and by ``evaluation.methods.variant_configs`` for every ``eval.variants`` entry.

    Raises:
        ConfigError: ``key=value`` has the wrong type, or holds a non-finite number; the message names
            the key, the value and the expected type.
    """
    bad = _non_finite(value)
    if bad is not None:  # YAML reads .nan / .inf as floats: a NaN passes every `<` range check, an inf overflows later
        raise ConfigError(f"{key}={_plain_text(value)} must be finite (it holds {bad}; every number in a config must be)"
                          + (f" (default: {_plain_text(default)})" if default is not None else ""))
    want = _kind(default)
    if want is None or value is None:
        return
    got = _kind(value)
    if got == want or (want == "number" and got == "int"):
        return
    raise ConfigError(f"{key}={_plain_text(value)} must be {_KIND_TEXT[want]} (default: {_plain_text(default)})")


def _plain_text(value) -> str:
    """``value`` (a config node or plain value) as JSON text for a message (NaN / inf as Python writes them)."""
    return json.dumps(OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value)


def _non_finite(value) -> str | None:
    """``'nan'``, ``'inf'`` or ``'-inf'`` for the first non-finite float in ``value`` (a number, or one
    inside a list or mapping), else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((bad for v in items if (bad := _non_finite(v)) is not None), None)


# --------------------------------------------------------------------------------------------
# Validation.  Modules register checks; each raises ConfigError naming the key.
# --------------------------------------------------------------------------------------------
_VALIDATORS: list[Callable[[DictConfig], None]] = []


def register_validator(fn: Callable[[DictConfig], None]) -> Callable[[DictConfig], None]:
    """Decorator: add ``fn(cfg)`` to the checks :func:`validate` runs."""
    _VALIDATORS.append(fn)
    return fn


def check_choice(cfg: DictConfig, key: str, allowed: Iterable) -> None:
    """Raise :class:`ConfigError` unless ``cfg.<key>`` (dotted) is one of ``allowed``."""
    allowed = list(allowed)
    value = OmegaConf.select(cfg, key, default=None)
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not valid; choices: {', '.join(map(str, allowed))}")


def check_range(cfg: DictConfig, key: str, lo: float | None = None, hi: float | None = None) -> None:
    """Raise :class:`ConfigError` unless ``cfg.<key>`` is a finite number with ``lo <= value <= hi`` (bounds optional)."""
    value = OmegaConf.select(cfg, key, default=None)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be a number")
    if not math.isfinite(value):  # NaN fails no comparison below, and an inf overflows where it is used
        raise ConfigError(f"{key}={value!r} must be a finite number")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        want = (f"lie in [{lo}, {hi}]" if lo is not None and hi is not None
                else f"be >= {lo}" if lo is not None else f"be <= {hi}")
        raise ConfigError(f"{key}={value!r} must {want}")


def check_output_path(cfg: DictConfig, key: str) -> None:
    """Raise :class:`ConfigError` naming ``key`` when ``cfg.<key>`` (an output folder; unset or null is
    skipped) cannot become a folder to write into (:func:`core.io.output_dir_problem`): checked
    before a stage loads the base, so a bad path costs nothing."""
    value = OmegaConf.select(cfg, key, default=None)
    if value is None:
        return
    problem = output_dir_problem(str(value))
    if problem is not None:
        raise ConfigError(f"{key}={value!r} cannot be written: {problem}")


#: the largest ``seed`` (numpy's, which ``lightning.seed_everything`` seeds too)
MAX_SEED = 2**32 - 1
DTYPES = ("float32", "bfloat16", "float16")
#: ``model.dtype`` values: a dtype, or ``auto`` (resolved per stage by :mod:`core.precision`)
MODEL_DTYPES = ("auto", *DTYPES)


@register_validator
def _core_checks(cfg: DictConfig) -> None:
    if "model" in cfg:
        check_choice(cfg, "model.dtype", MODEL_DTYPES)  # auto: resolved per stage (core.precision)
        if OmegaConf.is_missing(cfg.model, "path"):
            raise ConfigError("model.path is required with model=hf: a local Hugging Face folder, a hub id "
                              "or a .gguf file (model=smollm2 uses the packaged SmolLM2)")
    if "labels" in cfg:
        check_choice(cfg, "labels", ("teacher_forced", "regenerate"))
    seed = cfg.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        # Lightning's seed_everything raised a ValueError / TypeError traceback at the start of training
        raise ConfigError(f"seed={seed!r} must be an integer in [0, {MAX_SEED}] (numpy's seed range)")
    if "output_root" in cfg and (not isinstance(cfg.output_root, str) or not cfg.output_root.strip()):
        raise ConfigError(f"output_root={cfg.output_root!r} must be a folder path (every stage writes under it)")
    check_output_path(cfg, "output_root")  # every stage writes under it (runs, caches, cost models)


def validate(cfg: DictConfig) -> None:
    """Run every registered check (import the packages that register theirs first)."""
    _import_validators()
    for fn in _VALIDATORS:
        fn(cfg)


def _import_validators() -> None:
    import importlib

    for mod in ("data_prep.config_checks", "heads", "train.config_checks", "evaluation.config_checks"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name is None or not mod.startswith(exc.name):
                raise


# --------------------------------------------------------------------------------------------
def to_container(cfg: DictConfig | ListConfig) -> dict:
    """Plain, resolved Python containers (JSON-safe) of ``cfg``."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


#: the config keys an offline run trains on from its cache whatever data prep's defaults say, with the
#: field of the cache's feature definition (``data_prep.features.FeatureDefinition``) each comes from
FEATURE_CONFIG_KEYS = {"labels": "labels", "prep.layers": "layers", "prep.dtype": "storage_dtype"}


def feature_config_values(features: dict) -> dict:
    """The :data:`FEATURE_CONFIG_KEYS` values a recorded feature definition stands for
    (``data_prep.features.FeatureDefinition.to_dict()``, or a checkpoint's ``extra.features``):
    ``{"labels": str, "prep.layers": sorted ids, "prep.dtype": str}``; a field the record lacks (or
    leaves empty, as caches made before it was recorded do) is left out."""
    out: dict = {}
    for key, field in FEATURE_CONFIG_KEYS.items():
        value = features.get(field)
        if field == "layers" and value is not None:
            out[key] = sorted(int(l) for l in value)
        elif value:
            out[key] = str(value)
    return out


def flatten_dotted(obj, prefix: str = "") -> dict:
    """``{"a.b.c": value}`` for a nested dict (a resolved config container); an empty nested dict
    stays a value (``{"a.b": {}}``), lists are values."""
    if isinstance(obj, dict):
        out: dict = {}
        for k, v in obj.items():
            out.update(flatten_dotted(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: obj}


def config_hash(cfg: DictConfig, keys: Sequence[str]) -> str:
    """SHA-256 (hex) over the resolved sub-configs ``keys`` (dotted), e.g. the cache-defining ones."""
    return sha256_json({k: OmegaConf.to_container(OmegaConf.select(cfg, k), resolve=True)
                        if isinstance(OmegaConf.select(cfg, k), (DictConfig, ListConfig))
                        else OmegaConf.select(cfg, k) for k in keys})


def save_config(cfg: DictConfig, directory: str | os.PathLike, name: str = "config.yaml") -> Path:
    """Write the resolved config as YAML into ``directory`` atomically; return the file path."""
    path = Path(directory) / name
    atomic_write_text(path, OmegaConf.to_yaml(cfg, resolve=True))
    return path


HELP_FLAGS = ("-h", "--help", "help")


def usage(doc: str | None = None) -> str:
    """Usage text: the entry point's docstring, then the config groups and their options."""
    lines = [doc.strip(), ""] if doc else []
    lines.append("Arguments are group=option selections and section.key=value overrides (omegaconf dotlist).")
    lines.append("Groups and options (configs/<group>/<option>.yaml):")
    base = OmegaConf.load(CONFIG_DIR / "config.yaml")
    defaults = dict(base.get("defaults", {}) or {})
    for group in groups():
        lines.append(f"  {group}: {', '.join(group_options(group))}  (default: {defaults.get(group)})")
    lines.append("Top-level keys: " + ", ".join(k for k in base.keys() if k != "defaults"))
    lines.append("Every key of a section with its default, for the selections given: --help <section> "
                 f"({', '.join(groups())}), e.g. --help train")
    return "\n".join(lines)


def section_usage(section: str, argv: Sequence[str] = ()) -> str:
    """``section.key=default`` for every key of one config section, composed with ``argv``'s
    group selections (``heads=falcon --help heads`` lists the falcon head's keys).

    Raises:
        ConfigError: ``section`` is not a section of the composed config.
    """
    cfg = compose([a for a in argv if "=" in a and "." not in a.split("=", 1)[0]])
    # `choices` records the group options selected (compose), it is no section of settings
    sections = [k for k in cfg if isinstance(cfg[k], DictConfig) and k != "choices"]
    if section not in sections:
        raise ConfigError(f"--help {section}: not a config section; sections: {', '.join(sections)}")
    flat = flatten_dotted(OmegaConf.to_container(cfg[section], resolve=True), f"{section}.")
    return "\n".join(override(k, v) for k, v in flat.items())


def cli(argv: Sequence[str] | None = None, doc: str | None = None) -> DictConfig:
    """Compose the config from ``sys.argv``.

    ``-h`` / ``--help`` / ``help`` prints :func:`usage` (with ``doc``, the entry point's
    docstring), or :func:`section_usage` when a section name follows it, and exits with 0; a
    :class:`ConfigError` is printed and exits with 2.  Known irrelevant library output is silenced
    first (:func:`core.quiet.silence_known_noise`).
    """
    from core.quiet import silence_known_noise

    silence_known_noise()  # before the libraries that print it are imported
    args = list(sys.argv[1:] if argv is None else argv)
    helps = [i for i, a in enumerate(args) if a in HELP_FLAGS]
    if helps:
        section = args[helps[0] + 1] if helps[0] + 1 < len(args) and "=" not in args[helps[0] + 1] else None
        try:
            print(usage(doc) if section is None else section_usage(section, args))
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        raise SystemExit(0)
    try:
        return compose(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def run_cli(fn: Callable[[DictConfig], object], argv: Sequence[str] | None = None, doc: str | None = None,
            interrupted: str = "interrupted (Ctrl-C)"):
    """Compose the config (:func:`cli`), then run ``fn(cfg)``.

    A missing input file (``FileNotFoundError``), a :class:`UserInputError` or a :class:`ConfigError`
    found while running (e.g. ``core.precision`` refusing bf16 on this machine), and any other
    ``OSError`` (:func:`describe_os_error`), is printed as one ``error:`` line and exits with 2 instead
    of a traceback; a ``KeyboardInterrupt`` (Ctrl-C) prints ``interrupted`` (what is kept and how to
    go on) and exits with 130; anything else propagates.
    """
    cfg = cli(argv, doc)
    return report_errors(lambda: fn(cfg), interrupted)


def report_errors(call: Callable[[], Any], interrupted: str = "interrupted (Ctrl-C)"):
    """``call()``, with the ordinary failures of a command line turned into one line each: a missing
    input file (``FileNotFoundError``), a :class:`UserInputError` or :class:`ConfigError`, or any other
    ``OSError`` (:func:`describe_os_error`) prints ``error: ...`` and exits with 2; Ctrl-C prints
    ``interrupted`` and exits with 130; anything else propagates.  Used by :func:`run_cli` and the
    scripts with their own argument parsers (``scripts/_heads_cli.py``)."""
    try:
        return call()
    except KeyboardInterrupt:
        print(f"\n{interrupted}", file=sys.stderr)
        raise SystemExit(130) from None
    except (FileNotFoundError, UserInputError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as exc:  # a full disk, a path through a file: one line naming the file
        print(f"error: {describe_os_error(exc)}", file=sys.stderr)
        raise SystemExit(2) from None


def describe_os_error(exc: OSError) -> str:
    """``<file>: <reason>`` for an ``OSError`` (both files for a rename), the exception text when it
    names no file."""
    if exc.filename is None:
        return str(exc)
    files = f"{exc.filename} -> {exc.filename2}" if exc.filename2 is not None else str(exc.filename)
    return f"{files}: {exc.strerror or exc}"


def override(key: str, value: Any) -> str:
    """``key=value`` as a command line takes it, to paste from a message: a list or tuple without
    spaces (``prep.layers=[2,15,27]``; ``[2, 15, 27]`` would be three shell words), None as ``null``."""
    def text(v: Any) -> str:
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(text(x) for x in v) + "]"
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    return f"{key}={text(value)}"


class UserInputError(ValueError):
    """Bad user input found while running (an empty dataset, an empty split); the message says
    what to change."""
