"""The comparison at an equal budget (issue 27): validation τ at equal tokens and at equal wall
clock from the run records, never putting runs on different shares of the machine on one clock."""
from __future__ import annotations

import json

import pytest


def _record(points, threads=(2,), world_size=1, tokens=None):
    """A run record with validations at (train_seconds, sim_tau) points, 1,000 tokens a second."""
    vals = [{"step": k + 1, "epoch": 0, "tokens_seen": int(1000 * s), "train_seconds": s,
             "metrics": {"loss": 1.0 / (k + 1), "sim_tau": t}} for k, (s, t) in enumerate(points)]
    return {"format": "draftheads-run-record-v1", "validations": vals, "train_seconds": points[-1][0],
            "tokens_seen": tokens if tokens is not None else vals[-1]["tokens_seen"],
            "threads": list(threads) if threads is not None else None, "world_size": world_size}


def test_metric_at_seconds_interpolates_between_validations_and_never_extrapolates():
    from train.budget import metric_at_seconds

    r = _record([(10.0, 1.1), (20.0, 1.3), (40.0, 1.5)])
    assert metric_at_seconds(r, 10.0) == pytest.approx(1.1)
    assert metric_at_seconds(r, 30.0) == pytest.approx(1.4)  # halfway between 1.3 @20 s and 1.5 @40 s
    assert metric_at_seconds(r, 40.0) == pytest.approx(1.5)
    assert metric_at_seconds(r, 5.0) is None and metric_at_seconds(r, 41.0) is None
    untimed = _record([(10.0, 1.1)])
    untimed["validations"][0]["train_seconds"] = None  # resumed from a checkpoint without the clock
    assert metric_at_seconds(untimed, 10.0) is None


def test_equal_wall_clock_per_machine_share():
    """W is the shortest run's seconds within runs of the same threads x ranks; another share gets
    its own W; the end and best τ are each run's own (equal tokens)."""
    from train.budget import budget_rows

    records = {
        "ctc": _record([(10.0, 1.2), (30.0, 1.5), (60.0, 1.6)], threads=(1,)),
        "ctc_ce": _record([(10.0, 1.1), (50.0, 1.4), (90.0, 1.55)], threads=(1,)),
        "falcon_k1": _record([(20.0, 1.3), (40.0, 1.7), (45.0, 1.65)], threads=(2,)),
    }
    rows = {r["name"]: r for r in budget_rows(records)}
    assert rows["ctc"]["wall_seconds"] == rows["ctc_ce"]["wall_seconds"] == 60.0
    assert rows["ctc"]["at_wall"] == pytest.approx(1.6)
    assert rows["ctc_ce"]["at_wall"] == pytest.approx(1.4 + 0.15 * 10 / 40)  # 60 s between 50 s and 90 s
    assert rows["falcon_k1"]["wall_seconds"] == 45.0 and rows["falcon_k1"]["at_wall"] == pytest.approx(1.65)
    assert rows["falcon_k1"]["group"] != rows["ctc"]["group"] == rows["ctc_ce"]["group"]
    assert rows["falcon_k1"]["end"] == pytest.approx(1.65) and rows["falcon_k1"]["best"] == pytest.approx(1.7)
    assert rows["falcon_k1"]["best_tokens"] == 40000
    late = dict(records, ctc=dict(records["ctc"], train_seconds=75.0))  # trained on after its last validation
    assert {r["name"]: r for r in budget_rows(late)}["ctc_ce"]["wall_seconds"] == 60.0
    fixed = {r["name"]: r for r in budget_rows(records, seconds=30.0)}
    assert fixed["ctc"]["at_wall"] == pytest.approx(1.5) and fixed["falcon_k1"]["at_wall"] == pytest.approx(1.5)


def test_budget_cli_names_a_bad_record_and_writes_the_table(tmp_path, capsys):
    from train.budget import main

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "record.json").write_text(json.dumps(_record([(10.0, 1.2), (20.0, 1.4)])))
    (tmp_path / "b.json").write_text(json.dumps(_record([(15.0, 1.3), (25.0, 1.5)])))
    out = tmp_path / "budget.md"
    assert main([f"a={tmp_path / 'a'}", f"b={tmp_path / 'b.json'}", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| a | 20,000 | 20 | 2 × 1 | 1.400 | 1.400 (20,000) | 1.400 (20) |" in text
    assert "| b | 25,000 | 25 | 2 × 1 | 1.500 | 1.500 (25,000) | 1.400 (20) |" in text
    (tmp_path / "bad.json").write_text("{\"validations\": 3}")
    assert main([f"c={tmp_path / 'bad.json'}"]) == 2
    assert "bad.json: not a run record" in capsys.readouterr().err
    (tmp_path / "nostep.json").write_text(json.dumps({"validations": [{"metrics": {"sim_tau": 1.2}}]}))
    assert main([f"e={tmp_path / 'nostep.json'}"]) == 2
    assert "nostep.json: validation 0 lacks step, tokens_seen" in capsys.readouterr().err
    assert main([f"a={tmp_path / 'a'}", "--seconds", "abc"]) == 2
    assert "--seconds 'abc': expected a finite, non-negative number of seconds" in capsys.readouterr().err
    assert main([f"d={tmp_path / 'missing'}"]) == 2
    assert "missing" in capsys.readouterr().err
    no_tau = _record([(10.0, 1.2)])
    no_tau["validations"][0]["metrics"] = {"loss": 1.0}
    (tmp_path / "ada.json").write_text(json.dumps(no_tau))
    assert main([f"adadecode={tmp_path / 'ada.json'}"]) == 2
    assert "adadecode: its run record has no validation with 'sim_tau'" in capsys.readouterr().err


def test_budget_cli_plots_runs_from_several_places_on_one_chart(tmp_path, capsys):
    """--plot draws every given run (a run directory and a loose record.json alike) on one PNG; a
    --plot path in a missing directory is refused before the table is written."""
    from train.budget import main

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "record.json").write_text(json.dumps(_record([(10.0, 1.2), (20.0, 1.4)])))
    (tmp_path / "shipped.json").write_text(json.dumps(_record([(15.0, 1.3), (25.0, 1.5)])))
    png, out = tmp_path / "curves.png", tmp_path / "budget.md"
    assert main([f"ctc={tmp_path / 'run'}", f"falcon_k1={tmp_path / 'shipped.json'}", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"validation τ curves of ctc, falcon_k1 -> {png}" in capsys.readouterr().out
    assert main([f"ctc={tmp_path / 'run'}", "--out", str(out), "--plot", str(tmp_path / "no" / "c.png")]) == 2
    assert "--plot " + str(tmp_path / "no" / "c.png") + ": expected a file path in an existing directory" in (
        capsys.readouterr().err)
    assert not out.exists()


@pytest.mark.parametrize("field, value, message", [
    ("step", None, "validation 1: step=None: expected a non-negative int"),
    ("step", 2.5, "validation 1: step=2.5: expected a non-negative int"),
    ("tokens_seen", "20000", "validation 1: tokens_seen='20000': expected a non-negative int"),
    ("metrics", ["sim_tau"], "validation 1: metrics=['sim_tau']: expected a mapping"),
    ("sim_tau", "1.4", "validation 1: metrics.sim_tau='1.4': expected a finite number or null"),
    ("sim_tau", float("nan"), "validation 1: metrics.sim_tau=nan: expected a finite number or null"),
    ("train_seconds", -3.0, "validation 1: train_seconds=-3.0: expected a non-negative number or null"),
    ("threads", {"n": 2}, "threads={'n': 2}: expected null, a positive int or a list of them"),
    ("world_size", [0], "world_size=[0]: expected null, a positive int or a list of them"),
])
def test_a_mistyped_record_is_named_not_a_traceback(tmp_path, capsys, field, value, message):
    from train.budget import main

    r = _record([(10.0, 1.2), (20.0, 1.4)])
    if field in ("threads", "world_size"):
        r[field] = value
    elif field == "sim_tau":
        r["validations"][1]["metrics"]["sim_tau"] = value
    else:
        r["validations"][1][field] = value
    f = tmp_path / "r.json"
    f.write_text(json.dumps(r))
    assert main([f"a={f}"]) == 2
    err = capsys.readouterr().err
    assert f"{f}: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("seconds", ["nan", "inf", "-inf", "-1"])
def test_seconds_must_be_finite_and_non_negative(tmp_path, capsys, seconds):
    from train.budget import budget_rows, main

    f = tmp_path / "r.json"
    f.write_text(json.dumps(_record([(10.0, 1.2), (20.0, 1.4)])))
    assert main([f"a={f}", "--seconds", seconds]) == 2
    assert f"--seconds {seconds!r}: expected a finite, non-negative number" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expected a finite, non-negative number"):
        budget_rows({"a": _record([(10.0, 1.2)])}, seconds=float(seconds))


def test_out_must_be_a_file_in_an_existing_directory(tmp_path, capsys):
    from train.budget import main

    f = tmp_path / "r.json"
    f.write_text(json.dumps(_record([(10.0, 1.2), (20.0, 1.4)])))
    assert main([f"a={f}", "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path}: expected a file path in an existing directory" in capsys.readouterr().err
    assert main([f"a={f}", "--out", str(tmp_path / "no" / "such.md")]) == 2
    assert not (tmp_path / "no").exists()


def test_validations_at_one_second_are_ordered_by_step():
    """Two validations at the same train_seconds (a resumed segment that validated before training a
    batch): the later step is the value at that second and the start of the next interval, whatever
    the two values are."""
    from train.budget import metric_at_seconds

    r = _record([(10.0, 1.5), (20.0, 1.2), (20.0, 1.6), (30.0, 1.8)])
    assert metric_at_seconds(r, 25.0) == pytest.approx(1.7)  # from step 3's 1.6 at 20 s to 1.8 at 30 s
    assert metric_at_seconds(r, 15.0) == pytest.approx(1.35)  # from 1.5 at 10 s to step 2's 1.2 at 20 s
    flipped = _record([(10.0, 1.5), (20.0, 1.6), (20.0, 1.2), (30.0, 1.8)])
    assert metric_at_seconds(flipped, 25.0) == pytest.approx(1.5)  # step 3's 1.2 -> 1.8


def test_records_without_a_machine_share_are_each_their_own_clock():
    """Records written before threads / world_size were kept say nothing about the share of the
    machine they trained on: they are never put on one clock with each other or with a known share."""
    from train.budget import budget_rows

    records = {"old_a": _record([(10.0, 1.2), (30.0, 1.5)], threads=None, world_size=None),
               "old_b": _record([(10.0, 1.1), (60.0, 1.6)], threads=None, world_size=None),
               "new": _record([(10.0, 1.3), (60.0, 1.7)], threads=(2,))}
    rows = {r["name"]: r for r in budget_rows(records)}
    assert len({r["group"] for r in rows.values()}) == 3
    assert rows["old_a"]["wall_seconds"] == 30.0 and rows["old_b"]["wall_seconds"] == 60.0
    assert rows["old_b"]["at_wall"] == pytest.approx(1.6)
