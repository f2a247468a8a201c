"""What `d9d run` shows while it works, captured as a user's terminal or CI log receives it: bars with a count and the
time left, live tokenizer training, a live wait for the Prefect API, and no "done" or "0.0 .../s" where nothing
was done."""

import io
import logging
import re
import threading
import time

import pytest
from flows_corpora import small_job

from d9d.flows.console import TerminalProgress, Waiting
from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.data_prep import prepare_data
from d9d.flows.jobs.progress import LogProgress, rate


class _Terminal(io.StringIO):
    """What rich writes to an interactive terminal (colours and redraws included), kept for reading."""

    def isatty(self) -> bool:
        return True


def _lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_a_log_shows_the_step_count_and_the_time_left_of_a_training_bar():
    log = io.StringIO()
    progress = TerminalProgress(log)
    progress.start("pretrain", total=20.0, unit="steps")
    for _ in range(20):
        time.sleep(0.001)
        progress.advance(1.0, "loss 4.2")
    progress.finish()
    lines = _lines(log)
    assert lines[0].startswith("  pretrain:  10% 2/20 steps, about ") and lines[0].endswith(" s left (loss 4.2)")
    assert len(lines) == 11  # a line per tenth, then the end
    assert re.fullmatch(r"  pretrain: done in \d+\.\d s \(\d+\.\d steps/s\)", lines[-1])


def test_a_terminal_bar_shows_the_step_count_and_the_time_left():
    terminal = _Terminal()
    progress = TerminalProgress(terminal)
    progress.start("pretrain", total=400.0, unit="steps")
    progress.advance(120.0, "loss 5.1")
    progress.finish()
    shown = terminal.getvalue()
    assert "120/400" in shown and "steps" in shown and "loss 5.1" in shown
    assert re.search(r"-:--:--|\d:\d\d:\d\d", shown)  # rich's time-remaining column
    assert "pretrain: done in" in shown


@pytest.mark.parametrize("stream", [io.StringIO, _Terminal])
def test_a_stage_that_fails_or_is_stopped_says_how_far_it_got_not_done(stream):
    out = stream()
    progress = TerminalProgress(out)
    progress.start("pretrain", total=400.0, unit="steps")
    progress.advance(37.0)
    progress.finish(failed=True)
    shown = out.getvalue()
    assert "done in" not in shown
    assert re.search(r"pretrain: stopped after \d+\.\d s \(37 of 400\)", shown)


def test_finishing_work_that_never_started_prints_nothing():
    log = io.StringIO()
    TerminalProgress(log).finish(failed=True)  # e.g. torchrun failed before the rank program said "started"
    assert log.getvalue() == ""


def test_evaluate_never_reports_zero_evaluations_per_second(caplog):
    log = io.StringIO()
    slow = TerminalProgress(log)
    slow.start("evaluate", total=6.0, unit="evaluations")
    slow.advance(6.0)
    slow.finish()
    # A fast run's rate ends in "0.0 evaluations/s" too (e.g. 797660.0): the zero rate is the whole number.
    assert not re.search(r"\(0\.0 evaluations/s\)", log.getvalue())
    assert re.search(r"evaluate: done in \d+\.\d s \(\d+\.\d (evaluations/s|s/evaluation)\)", log.getvalue())
    assert rate(3, 12.0, "evaluations") == "4.0 s/evaluation"
    nothing = io.StringIO()
    counted_none = TerminalProgress(nothing)
    counted_none.start("evaluate", total=6.0, unit="evaluations")
    counted_none.finish()
    assert re.fullmatch(r"  evaluate: done in \d+\.\d s\n", nothing.getvalue())
    caplog.set_level(logging.INFO)
    logged = LogProgress(logging.getLogger("test"))
    logged.start("evaluate", total=6.0, unit="evaluations")
    logged.finish()
    assert "evaluations/s" not in caplog.text and "evaluate: done in" in caplog.text


def test_a_note_alone_adds_no_log_line():
    log = io.StringIO()
    progress = TerminalProgress(log)
    progress.start("tokenizer training", total=4.0, unit="documents")
    progress.advance(4.0)
    for _ in range(5):
        progress.advance(0.0, "merging pairs")  # the poll while the trainer merges
    assert len(_lines(log)) == 1


def test_tokenizer_training_shows_the_documents_read_and_a_fresh_tokenize_bar_no_earlier_attempt(tmp_path, corpus_dir):
    log = io.StringIO()
    config = JobConfig.model_validate(small_job(tmp_path, corpus_dir)).resolved(tmp_path)
    assert prepare_data(config.data_prep, config.data_prep_output, progress=TerminalProgress(log)).status == "ran"
    lines = _lines(log)
    training = [line for line in lines if line.startswith("  tokenizer training")]
    # 10 documents, 2 held out for validation: the trainer reads 8, counted from its worker process.
    assert training[-2].startswith("  tokenizer training: 100% 8/8 documents")
    assert re.fullmatch(r"  tokenizer training: done in \d+\.\d s \(.*document.*\)", training[-1])
    tokenize = [line for line in lines if line.startswith("  tokenize:")]
    assert tokenize and not any("earlier attempt" in line for line in lines)


def test_tokenizer_training_updates_a_terminal_bar_while_it_runs(tmp_path, corpus_dir):
    terminal = _Terminal()
    config = JobConfig.model_validate(small_job(tmp_path, corpus_dir)).resolved(tmp_path)
    prepare_data(config.data_prep, config.data_prep_output, progress=TerminalProgress(terminal))
    shown = terminal.getvalue()
    assert "tokenizer training" in shown and "8/8" in shown and "documents" in shown


def test_waiting_for_the_api_counts_seconds_in_a_log_and_says_how_long_it_took():
    log = io.StringIO()
    threads = threading.active_count()
    with Waiting("d9d: starting Prefect", log, every=0.05):
        time.sleep(0.3)
    assert threading.active_count() == threads  # its reporting thread is gone (the flows fork and spawn later)
    lines = _lines(log)
    seconds_so_far = [line for line in lines if re.fullmatch(r"d9d: starting Prefect: \d+ s so far", line)]
    assert len(seconds_so_far) >= 2  # the line updates while it waits, not one static line
    assert re.fullmatch(r"d9d: starting Prefect: ready in 0\.\d s", lines[-1])


def test_waiting_on_a_terminal_shows_a_spinner_with_elapsed_time():
    terminal = _Terminal()
    threads = threading.active_count()
    with Waiting("d9d: starting Prefect", terminal):
        time.sleep(0.3)
    assert threading.active_count() == threads  # rich's refresh thread is gone
    shown = terminal.getvalue()
    assert "0:00:00" in shown  # rich's elapsed column, redrawn by its refresh thread
    assert re.search(r"d9d: starting Prefect: ready in 0\.\d s", shown)


def test_a_failed_wait_says_stopped_not_ready():
    log = io.StringIO()
    with pytest.raises(TimeoutError), Waiting("d9d: starting Prefect", log, every=10.0):
        raise TimeoutError("not healthy")
    assert "ready" not in log.getvalue()
    assert re.fullmatch(r"d9d: starting Prefect: stopped after 0\.\d s\n", log.getvalue())
