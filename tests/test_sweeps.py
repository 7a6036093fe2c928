"""Every W&B sweep under configs/sweeps/ is runnable by a W&B agent, checked without a W&B server.

For each sweep YAML: the command uses ``${args_no_hyphens}`` (so parameters arrive as
``key=value``, the syntax of ``core.config``); every swept parameter is a real config key of the
config the command selects; and for sampled parameter values (every combination of the listed
``values``, and min / middle / max of continuous distributions) the argument list that
``wandb agent`` would build - with wandb's own ``create_sweep_command_args`` and the agent's macro
substitution - parses in the CLI (``core.config.cli`` -> ``compose`` incl. every registered
validator) and sets exactly the swept value.
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from core.config import CONFIG_DIR, cli, compose

SWEEPS = sorted((CONFIG_DIR / "sweeps").glob("*.yaml"))
MAX_COMBINATIONS = 400


def test_the_three_sweeps_exist():
    names = {p.stem for p in SWEEPS}
    assert {"falcon_lambda", "adadecode_threshold", "ctc"} <= names, names


def sample_values(name: str, spec: dict) -> list:
    """Values a W&B sweep can assign to parameter ``name``: all listed values, or the bounds and
    the middle of a distribution (integers for int / q distributions)."""
    if "value" in spec:
        return [spec["value"]]
    if "values" in spec:
        assert spec["values"], f"{name}: empty values"
        return list(spec["values"])
    dist = spec.get("distribution", "uniform" if "min" in spec else None)
    assert dist is not None and "min" in spec and "max" in spec, f"{name}: no values, value or min/max: {spec}"
    lo, hi = spec["min"], spec["max"]
    assert lo <= hi, f"{name}: min {lo} > max {hi}"
    if dist in ("int_uniform", "q_uniform", "q_log_uniform_values", "q_normal"):
        q = spec.get("q", 1)
        return sorted({int(lo), int(round((lo + hi) / 2 / q) * q), int(hi)})
    if dist == "log_uniform_values":
        return [lo, math.sqrt(lo * hi), hi]
    if dist == "log_uniform":  # bounds are natural logs
        return [math.exp(lo), math.exp((lo + hi) / 2), math.exp(hi)]
    assert dist in ("uniform", "normal", "log_normal", "inv_log_uniform_values"), f"{name}: distribution {dist}"
    return [lo, (lo + hi) / 2, hi]


def agent_argv(sweep: dict, params: dict) -> list[str]:
    """The command ``wandb agent`` runs for one trial (wandb_agent.Agent._run_job, non-Windows)."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command, create_sweep_command_args

    sweep_vars = create_sweep_command_args({"args": {k: {"value": v} for k, v in params.items()}})
    sweep_vars["interpreter"] = ["python"]
    sweep_vars["program"] = [sweep["program"]]
    sweep_vars["env"] = ["/usr/bin/env"]
    out: list[str] = []
    for c in create_sweep_command(list(sweep["command"])):
        c = str(c)
        if c.startswith("${") and c.endswith("}"):
            out += sweep_vars.get(c[2:-1]) or []
        else:
            out.append(c)
    return out


def cli_args(argv: list[str]) -> list[str]:
    """The arguments after ``python -m train`` (what ``train.__main__`` hands to ``core.config.cli``)."""
    i = argv.index("-m")
    assert argv[i + 1] == "train", f"sweep command must run `-m train`: {argv}"
    return argv[i + 2:]


@pytest.mark.parametrize("path", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_sweep_is_valid_against_the_cli(path: Path, capsys):
    sweep = yaml.safe_load(path.read_text())
    for key in ("program", "method", "metric", "parameters", "command"):
        assert key in sweep, f"{path.name}: no {key!r}"
    assert sweep["method"] in ("grid", "random", "bayes")
    assert "${args_no_hyphens}" in sweep["command"], f"{path.name}: command must use ${{args_no_hyphens}}"
    assert sweep["metric"]["goal"] in ("minimize", "maximize") and sweep["metric"]["name"].startswith(("val/", "train/"))
    params = sweep["parameters"]
    assert params, f"{path.name}: no parameters"

    fixed = [a for a in cli_args(agent_argv(sweep, {})) if a]
    base = compose(fixed)
    for name in params:
        assert "=" not in name and not name.startswith("-"), name
        node, _, leaf = name.rpartition(".")
        parent = OmegaConf.select(base, node) if node else base
        assert parent is not None and leaf in parent, f"{path.name}: {name} is not a config key of `{' '.join(fixed)}`"

    names = list(params)
    grids = [sample_values(n, params[n]) for n in names]
    combos = list(itertools.product(*grids))
    if len(combos) > MAX_COMBINATIONS:  # vary one parameter at a time around the first values
        combos = [tuple(g[0] for g in grids)]
        combos += [tuple(v if j == i else g[0] for j, g in enumerate(grids)) for i, g in enumerate(grids) for v in g]
    for combo in combos:
        trial = dict(zip(names, combo))
        args = cli_args(agent_argv(sweep, trial))
        assert [a for a in args if "=" not in a] == [], f"{path.name}: non key=value argument in {args}"
        try:
            cfg = cli(args)
        except SystemExit as exc:
            err = capsys.readouterr().err
            raise AssertionError(f"{path.name}: the CLI rejects {args}: {err.strip()} (exit {exc.code})") from None
        for name, value in trial.items():
            got = OmegaConf.select(cfg, name)
            if isinstance(value, float):
                assert got == pytest.approx(value), f"{path.name}: {name}={value} became {got!r}"
            else:
                assert got == value, f"{path.name}: {name}={value!r} became {got!r}"


def test_agent_formatting_matches_wandb():
    """The emulation is wandb's: key=value with Python's str() of the value, in parameter order."""
    sweep = {"program": "train", "command": ["${env}", "${interpreter}", "-m", "train", "heads=ctc", "${args_no_hyphens}"]}
    argv = agent_argv(sweep, {"heads.slots": 6, "train.optimizer.lr": 0.0003, "train.shuffle": False})
    assert argv == ["/usr/bin/env", "python", "-m", "train", "heads=ctc", "heads.slots=6",
                    "train.optimizer.lr=0.0003", "train.shuffle=False"]
    cfg = compose(cli_args(argv))
    assert cfg.heads.slots == 6 and cfg.train.optimizer.lr == 0.0003 and cfg.train.shuffle is False


def test_an_unknown_swept_key_is_rejected(capsys):
    sweep = {"program": "train", "command": ["${env}", "${interpreter}", "-m", "train", "heads=ctc", "${args_no_hyphens}"]}
    with pytest.raises(SystemExit):
        cli(cli_args(agent_argv(sweep, {"heads.no_such_key": 1})))
    assert "heads.no_such_key" in capsys.readouterr().err
