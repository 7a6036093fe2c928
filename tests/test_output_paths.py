"""Output folders that cannot be written are refused by key before any stage loads the base, and an
OSError while running is one ``error:`` line naming the file (exit 2), never a traceback."""
from __future__ import annotations

import os
import re

import pytest


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("not a folder")
    return f


def test_output_dir_problem_names_the_offending_path(tmp_path, a_file, monkeypatch):
    from core.io import output_dir_problem

    assert output_dir_problem(tmp_path / "new" / "deeper") is None
    assert output_dir_problem(tmp_path) is None
    assert output_dir_problem(a_file) == f"{a_file} is a file, not a folder"
    assert output_dir_problem(a_file / "sub" / "x") == f"{a_file} is a file, not a folder"
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "missing")
    assert output_dir_problem(link / "x") == f"{link} is a broken link, not a folder"
    (tmp_path / "ok").mkdir()
    assert output_dir_problem(tmp_path / "ok" / "run") is None
    # the deepest existing folder decides writability (root passes os.access everywhere, so fake it)
    monkeypatch.setattr(os, "access", lambda p, mode: str(p) != str(tmp_path / "ok"))
    assert output_dir_problem(tmp_path / "ok" / "run") == f"{tmp_path / 'ok'} is a folder this user cannot write into"
    assert output_dir_problem(tmp_path / "other") is None
    monkeypatch.chdir(tmp_path)
    assert output_dir_problem("afile/x") == f"{a_file} is a file, not a folder"  # relative to the cwd
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".draftheads-probe")] == []  # probes removed


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs procfs")
def test_a_folder_root_passes_os_access_for_but_cannot_write_is_refused():
    """Root passes os.access everywhere, so eval.output_dir=/proc/x loaded the base, measured and calibrated
    for 30 s, then failed in mkdir with a bare errno; the probe folder tells at once."""
    from core.io import output_dir_problem

    assert output_dir_problem("/proc/x/run").startswith("/proc is a folder nothing can be created in (")


def test_output_root_through_a_file_is_refused_at_compose(a_file):
    from core.config import ConfigError, compose

    with pytest.raises(ConfigError, match=re.escape(f"output_root='{a_file}/runs' cannot be written: {a_file} is a file")):
        compose([f"output_root={a_file}/runs"])
    compose([f"output_root={a_file.parent}/fresh"])  # a folder still to be made is fine


def test_stage_output_keys_are_checked_before_the_base_loads(a_file, tmp_path):
    from core.config import ConfigError, compose
    from data_prep.pipeline import prepare
    from evaluation.runner import run_evaluation

    root = f"output_root={tmp_path / 'out'}"
    with pytest.raises(ConfigError, match=re.escape(f"prep.cache_dir='{a_file}/c' cannot be written")):
        prepare(compose([root, f"prep.cache_dir={a_file}/c"]), out=None)
    with pytest.raises(ConfigError, match=re.escape(f"eval.output_dir='{a_file}/e' cannot be written")):
        run_evaluation(compose([root, f"eval.output_dir={a_file}/e"]))
    assert not (tmp_path / "out").exists()  # nothing written


def test_export_and_compare_refuse_an_output_through_a_file(a_file, tmp_path):
    import subprocess
    import sys

    from heads.export import ExportError, export

    with pytest.raises(ExportError, match=re.escape(f"output {a_file}/e cannot be written: {a_file} is a file")):
        export(tmp_path / "no-checkpoint-needed", "vllm", a_file / "e")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "scripts/compare.py", f"output_dir={a_file}/r", "--dry-run"],
                       cwd=repo, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"output_dir='{a_file}/r' cannot be written: {a_file} is a file, not a folder" in r.stderr


def test_describe_os_error():
    from core.config import describe_os_error

    assert describe_os_error(OSError(28, "No space left on device", "/data/shard.safetensors")) == \
        "/data/shard.safetensors: No space left on device"
    assert describe_os_error(OSError(18, "Invalid cross-device link", "/a", None, "/b")) == \
        "/a -> /b: Invalid cross-device link"
    assert describe_os_error(OSError("plain")) == "plain"


def test_run_cli_prints_an_os_error_as_one_line(capsys):
    from core.config import run_cli

    def full_disk(cfg):
        raise OSError(28, "No space left on device", "/data/x.tmp")

    with pytest.raises(SystemExit) as e:
        run_cli(full_disk, [])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "error: /data/x.tmp: No space left on device"


def test_ctrl_c_prints_what_is_kept_without_a_traceback(capsys, monkeypatch):
    """Ctrl-C in data prep or training (its second one) ends with the command's own line and 130,
    and in the evaluation with 130 after the runner's resume hint: never a traceback."""
    from core.config import run_cli
    from data_prep.__main__ import main as data_prep_main
    from evaluation.cli import run_and_report

    def interrupted(cfg):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        run_cli(interrupted, [], interrupted="stopped: the shards written are kept")
    assert e.value.code == 130
    assert capsys.readouterr().err.strip() == "stopped: the shards written are kept"
    monkeypatch.setattr("data_prep.__main__.prepare", interrupted)
    with pytest.raises(SystemExit) as e:
        data_prep_main([])
    assert e.value.code == 130 and "every shard written is kept; run the same command again" in capsys.readouterr().err
    assert run_and_report(lambda: (_ for _ in ()).throw(KeyboardInterrupt())) == 130
    err = capsys.readouterr().err
    assert err.strip() == "evaluation interrupted (Ctrl-C)" and "Traceback" not in err


def test_evaluation_exit_statuses(capsys):
    from evaluation.cli import run_and_report
    from evaluation.runner import ParityError

    def raises(exc):
        def run():
            raise exc
        return run

    assert run_and_report(raises(NotADirectoryError(20, "Not a directory", "/x/y"))) == 2
    assert capsys.readouterr().err.strip() == "error: /x/y: Not a directory"
    assert run_and_report(raises(ParityError("prompt 3 differs"))) == 1
    assert "PARITY FAILURE: prompt 3 differs" in capsys.readouterr().err
    assert run_and_report(raises(ValueError("eval.num_prompts=0"))) == 2
    assert capsys.readouterr().err.strip() == "error: eval.num_prompts=0"
    assert run_and_report(lambda: None) == 0
    assert capsys.readouterr().out == ""
