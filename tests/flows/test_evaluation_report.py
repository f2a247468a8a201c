"""The evaluate stage's report and history: scores per checkpoint with their direction, deltas against an earlier
report, the markdown a person reads, and the history that finds the previous report. Pure functions over report
dicts shaped as the stage writes them (the micro pipeline test in test_flows_prefect.py checks a real one)."""

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from d9d.flows.jobs.evaluate.config import EvaluateStageConfig
from d9d.flows.jobs.evaluate.history import history_dir, previous_report, read_report, record
from d9d.flows.jobs.evaluate.report import (
    compare_reports,
    higher_is_better,
    report_markdown,
    score_rows,
    scores,
    verdict_line,
)
from d9d.flows.jobs.evaluate.stage import local_task_corpora


def _held_out(loss, bpb, tokens=1000):
    return {"loss": loss, "perplexity": 2.718**loss, "bits_per_byte": bpb, "tokens": tokens, "checkpoint": "/c"}


def _task(metrics, better, documents=40):
    return {"metrics": metrics, "higher_is_better": better, "documents": documents}


def _summary(*, finetune_loss=4.0, finetune_acc=0.5, cloze_ppl=300.0):
    cloze = {"acc": False, "perplexity": False} | {"acc": True}
    return {
        "created_at": "2026-11-26T01:00:00+00:00",
        "checkpoints": {
            "base": {"pretrain-data": _held_out(8.3, 3.2)},
            "finetune": {"pretrain-data": _held_out(finetune_loss, 1.9)},
        },
        "tasks": {
            "base": {
                "d9d_next_line_milton": _task({"acc": 0.25}, {"acc": True}),
                "d9d_cloze_milton": _task({"acc": 0.0, "perplexity": 9000.0}, cloze),
            },
            "finetune": {
                "d9d_next_line_milton": _task({"acc": finetune_acc}, {"acc": True}),
                "d9d_cloze_milton": _task({"acc": 0.0, "perplexity": cloze_ppl}, cloze),
            },
        },
        "samples": {
            "base": [{"prompt": "The king", "continuation": " zz`*|\nqq"}],
            "finetune": [{"prompt": "The king", "continuation": " is dead"}],
        },
        "max_new_tokens": 24,
        "validation_tokens": {"pretrain-data": 1000},
        "notes": ["base: the convert output"],
        "comparison": None,
    }


def test_scores_name_every_number_with_its_direction():
    summary = _summary()
    table = scores(summary)
    assert table["finetune"] == {
        "loss/pretrain-data": 4.0,
        "bits_per_byte/pretrain-data": 1.9,
        "d9d_next_line_milton/acc": 0.5,
        "d9d_cloze_milton/acc": 0.0,
        "d9d_cloze_milton/perplexity": 300.0,
    }
    better = higher_is_better(summary)
    assert better["loss/pretrain-data"] is False and better["bits_per_byte/pretrain-data"] is False
    assert better["d9d_next_line_milton/acc"] is True and better["d9d_cloze_milton/perplexity"] is False
    rows = {row["score"]: row for row in score_rows(summary)}
    assert rows["d9d_cloze_milton/perplexity"] == {
        "score": "d9d_cloze_milton/perplexity", "better": "lower", "base": 9000.0, "finetune": 300.0,
    }  # fmt: skip


def test_deltas_follow_each_scores_direction():
    previous = _summary(finetune_loss=4.5, finetune_acc=0.4, cloze_ppl=300.0)
    current = _summary(finetune_loss=4.0, finetune_acc=0.3, cloze_ppl=300.0)
    del previous["tasks"]["base"]["d9d_next_line_milton"]  # a task the previous run did not score: no delta
    previous["tasks"]["finetune"]["d9d_cloze_milton"]["documents"] = 30  # it scored fewer documents
    compared = compare_reports(current, previous)
    assert compared["comparable"] is False
    finetune = compared["checkpoints"]["finetune"]
    assert finetune["scores"]["loss/pretrain-data"] == pytest.approx(
        {"previous": 4.5, "current": 4.0, "delta": -0.5, "better": True}
    )
    assert finetune["scores"]["d9d_next_line_milton/acc"]["better"] is False  # accuracy went down: worse
    assert finetune["scores"]["d9d_cloze_milton/perplexity"] == {
        "previous": 300.0, "current": 300.0, "delta": 0.0, "better": False,
    }  # fmt: skip
    assert (finetune["improved"], finetune["worse"]) == (1, 1)
    assert "d9d_next_line_milton/acc" not in compared["checkpoints"]["base"]["scores"]
    line = verdict_line({"path": "/p.json", "created_at": "then", "comparison": compared})
    assert line == (
        "finetune vs the previous report (then): NOT better, 1 of 5 scores improved, 1 worse (held-out sets or task "
        "sizes differ)"
    )
    assert compare_reports(current, current)["comparable"] is True
    assert compare_reports(current, current | {"validation_tokens": {"pretrain-data": 999}})["comparable"] is False


def test_markdown_holds_every_score_sample_and_delta():
    current = _summary()
    current["previous"] = {
        "path": "/h/1.json",
        "created_at": "then",
        "comparison": compare_reports(current, _summary(finetune_loss=4.2)),
    }
    markdown = report_markdown(current)
    assert "| score | base | finetune |" in markdown
    assert "| d9d_cloze_milton/perplexity (lower is better) | 9,000.0 | 300.0000 |" in markdown
    assert "| d9d_next_line_milton/acc (higher is better) | 0.2500 | 0.5000 |" in markdown
    assert "| loss/pretrain-data (lower is better) | 8.3000 | 4.0000 |" in markdown
    assert "## Sample continuations (greedy, up to 24 new tokens)" in markdown
    assert "- **base**: … zz\\`\\*\\| ⏎ qq" in markdown  # one line, markup escaped
    assert "- **finetune**: … is dead" in markdown
    assert "| loss/pretrain-data | 8.3000 (+0.0000, same) | 4.0000 (-0.2000, better) |" in markdown
    assert "finetune vs the previous report (then): better, 1 of 5 scores improved, 0 worse" in markdown


def test_history_keeps_every_report_and_finds_the_newest_readable(tmp_path):
    output = tmp_path / "evaluation"
    assert history_dir(output) == tmp_path / "evaluation-history"
    assert previous_report(output, None) is None
    then = datetime(2026, 11, 25, 1, 0, tzinfo=UTC)
    first = record(output, _summary(finetune_loss=4.5), now=then)
    second = record(output, _summary(finetune_loss=4.2), now=then + timedelta(days=1))
    assert sorted(history_dir(output).iterdir()) == [first, second]
    path, report = previous_report(output, None)
    assert path == second and report["checkpoints"]["finetune"]["pretrain-data"]["loss"] == 4.2
    (history_dir(output) / "29990101T000000000000Z.json").write_text("{ half written")  # never fatal
    assert previous_report(output, None)[0] == second
    assert previous_report(output, first)[0] == first  # evaluate.compare_with wins over the history
    (tmp_path / "other.json").write_text('{"loss": 1}')
    with pytest.raises(ValueError, match=r"evaluate.compare_with=.*other.json: not an evaluation.json"):
        read_report(tmp_path / "other.json")
    with pytest.raises(ValueError, match=r"evaluate.compare_with=.*missing.json: cannot read"):
        previous_report(output, tmp_path / "missing.json")


def test_the_section_refuses_unusable_task_settings():
    with pytest.raises(ValidationError, match="names a task twice"):
        EvaluateStageConfig(tasks=["d9d_cloze_milton", "d9d_cloze_milton"])
    with pytest.raises(ValidationError, match="empty prompt"):
        EvaluateStageConfig(prompts=["The king", ""])
    with pytest.raises(ValidationError, match="max_new_tokens"):
        EvaluateStageConfig(max_new_tokens=0)
    assert local_task_corpora(["d9d_cloze_milton", "hellaswag", "d9d_next_line_milton"]) == ["milton"]
    assert local_task_corpora(["hellaswag"]) == []
