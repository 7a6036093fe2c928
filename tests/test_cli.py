"""Entry-point behaviour a user meets first: --help, and clean errors for bad input."""
from __future__ import annotations

import pytest

from core.config import cli, usage


def test_help_lists_groups_and_options_and_exits_zero(capsys):
    with pytest.raises(SystemExit) as exc:
        cli(["heads=ctc", "--help"], doc="python -m something: does a thing")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("python -m something: does a thing")
    assert "heads: adadecode, ctc, eagle3, falcon, falcon_k1, falcon_noglance  (default: ctc)" in out
    assert "strategy: auto, ddp, deepspeed_zero1, deepspeed_zero2, deepspeed_zero3" in out
    assert usage() in out


def test_help_of_a_section_lists_its_keys_as_pasteable_overrides(capsys):
    """``--help <section>`` lists every key with its default for the groups selected, in the form an
    override takes; an unknown section is one error line, exit 2."""
    with pytest.raises(SystemExit) as exc:
        cli(["heads=falcon_k1", "--help", "heads"])
    assert exc.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert "heads.type=falcon" in lines and "heads.block_size=1" in lines
    with pytest.raises(SystemExit) as exc:
        cli(["--help", "data"])
    out = capsys.readouterr().out.splitlines()
    assert "data.max_conversations=128" in out and "data.streaming=false" in out and "data.path=null" in out
    with pytest.raises(SystemExit) as exc:
        cli(["--help", "nope"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--help nope: not a config section" in err
    assert "data" in err.split("sections: ")[1] and "choices" not in err  # the selected options are no section
    with pytest.raises(SystemExit) as exc:
        cli(["--help", "choices"])
    assert exc.value.code == 2 and "--help choices: not a config section" in capsys.readouterr().err


def test_empty_dataset_is_a_one_line_error_with_exit_2(tmp_path, tiny_model_dir, capsys):
    from data_prep.__main__ import main

    data = tmp_path / "empty.jsonl"
    data.write_text('{"id": "a", "conversations": [{"from": "gpt", "value": "no user turn"}]}\n')
    with pytest.raises(SystemExit) as exc:
        main([f"model.path={tiny_model_dir}", f"data.path={data}", "labels=teacher_forced",
              "prep.progress=false", f"output_root={tmp_path / 'out'}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: no usable conversation in" in err and "no_assistant_turn" in err and "first 'a'" in err


def test_missing_data_file_is_a_one_line_error_with_exit_2(tmp_path, tiny_model_dir, capsys):
    from data_prep.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main([f"model.path={tiny_model_dir}", f"data.path={tmp_path / 'nope.json'}", "prep.progress=false",
              f"output_root={tmp_path / 'out'}"])
    assert exc.value.code == 2
    assert "nope.json" in capsys.readouterr().err
