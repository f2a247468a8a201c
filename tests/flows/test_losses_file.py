"""The losses file of a training stage survives a writer killed mid-line: the torn last line is skipped by the reader
and cut off by the next append, so a resumed run neither fails on it nor buries it mid-file."""

import json

import pytest

from d9d.flows.jobs.torchrun_stage import append_loss, read_losses


def test_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "losses.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.25}\n{"step": 3, "lo', encoding="utf-8")
    assert read_losses(path) == {1: 2.5, 2: 2.25}


def test_an_append_after_a_torn_line_cuts_it_off_and_the_step_is_logged_again(tmp_path):
    path = tmp_path / "losses.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "lo', encoding="utf-8")
    append_loss(path, 2, 2.0)
    append_loss(path, 3, 1.5)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert read_losses(path) == {1: 2.5, 2: 2.0, 3: 1.5}


def test_a_file_that_is_one_torn_line_is_empty_and_is_repaired_by_the_next_append(tmp_path):
    path = tmp_path / "losses.jsonl"
    path.write_text('{"st', encoding="utf-8")
    assert read_losses(path) == {}
    append_loss(path, 1, 3.0)
    assert read_losses(path) == {1: 3.0}


def test_damage_before_the_last_line_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "losses.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\nnot json\n{"step": 3, "loss": 1.0}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"losses.jsonl:2 is not a loss record"):
        read_losses(path)
