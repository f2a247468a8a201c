"""The evaluate stage's report: the numbers of every checkpoint as one flat score table (`scores`), the markdown a
person reads (`report_markdown`), the rows of the Prefect table artifact (`table_rows`), and the deltas against an
earlier report (`compare_reports`).

A score is named `<measure>/<what>`: `loss/<split>`, `bits_per_byte/<split>` for held-out data, `<task>/<metric>`
for an lm-eval task (`d9d_cloze_milton/perplexity`). Its direction comes from `higher_is_better` (held-out figures
are better lower; a task's from lm_eval's own metric definition).
"""

from __future__ import annotations

from typing import Any

HELD_OUT_MEASURES = ("loss", "bits_per_byte")
NEWEST_FIRST = ("finetune", "pretrain", "base")  # the checkpoint a nightly verdict is about: the newest trained one


def scores(summary: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per checkpoint, every number of the report by score name (held-out loss and bits per byte, task metrics)."""
    table: dict[str, dict[str, float]] = {}
    for name, splits in summary.get("checkpoints", {}).items():
        row = table.setdefault(name, {})
        for split, report in splits.items():
            for measure in HELD_OUT_MEASURES:
                row[f"{measure}/{split}"] = float(report[measure])
    for name, tasks in summary.get("tasks", {}).items():
        row = table.setdefault(name, {})
        for task, result in tasks.items():
            for metric, value in result["metrics"].items():
                row[f"{task}/{metric}"] = float(value)
    return table


def higher_is_better(summary: dict[str, Any]) -> dict[str, bool]:
    """Which way each score is better (held-out figures: lower)."""
    better: dict[str, bool] = {}
    for row in scores(summary).values():
        for score in row:
            better.setdefault(score, False)
    for tasks in summary.get("tasks", {}).values():
        for task, result in tasks.items():
            for metric, value in result.get("higher_is_better", {}).items():
                better[f"{task}/{metric}"] = bool(value)
    return better


def compare_reports(current: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any]:
    """Per checkpoint in both reports, per score in both: previous, current, delta and whether it got better; and
    per checkpoint how many scores improved and how many got worse. Scores only one report has are left out (a task
    added or dropped); `comparable` is False when the held-out sets or task documents differ in size."""
    now, then = scores(current), scores(previous)
    direction = higher_is_better(current) | {
        name: value for name, value in higher_is_better(previous).items() if name not in higher_is_better(current)
    }
    checkpoints: dict[str, Any] = {}
    for name in now:
        if name not in then:
            continue
        deltas = {}
        for score, value in now[name].items():
            if score not in then[name]:
                continue
            old = then[name][score]
            delta = value - old
            better = delta > 0 if direction.get(score, False) else delta < 0
            deltas[score] = {"previous": old, "current": value, "delta": delta, "better": better and delta != 0}
        improved = sum(1 for entry in deltas.values() if entry["better"])
        worse = sum(1 for entry in deltas.values() if not entry["better"] and entry["delta"] != 0)
        checkpoints[name] = {"scores": deltas, "improved": improved, "worse": worse}
    comparable = current.get("validation_tokens") == previous.get("validation_tokens") and _documents(
        current
    ) == _documents(previous)
    return {"checkpoints": checkpoints, "comparable": comparable}


def _documents(summary: dict[str, Any]) -> dict[str, int]:
    return {
        task: int(result.get("documents", 0))
        for tasks in summary.get("tasks", {}).values()
        for task, result in tasks.items()
    }


def verdict_line(previous: dict[str, Any] | None) -> str | None:
    """One line on the newest trained checkpoint against the previous report (None without one)."""
    if not previous:
        return None
    compared = previous["comparison"]["checkpoints"]
    name = next((name for name in NEWEST_FIRST if name in compared), None)
    if name is None:
        return f"no checkpoint in common with the previous report {previous['path']}"
    entry = compared[name]
    total = len(entry["scores"])
    verdict = "better" if entry["improved"] > entry["worse"] else "NOT better"
    caveat = "" if previous["comparison"]["comparable"] else " (held-out sets or task sizes differ)"
    return (
        f"{name} vs the previous report ({previous['created_at']}): {verdict}, {entry['improved']} of {total} scores "
        f"improved, {entry['worse']} worse{caveat}"
    )


def _format(value: float) -> str:
    return f"{value:.4f}" if abs(value) < 1000 else f"{value:,.1f}"


def _arrow(better: bool) -> str:
    return "higher is better" if better else "lower is better"


def report_markdown(summary: dict[str, Any]) -> str:
    """The report a person reads: every score per checkpoint side by side, the sample continuations, the
    fine-tune verdict, the comparison with the previous report, and notes."""
    table = scores(summary)
    names = list(table)
    better = higher_is_better(summary)
    lines = ["# Evaluation", ""]
    if names:
        lines += [f"| score | {' | '.join(names)} |", f"|---|{'---|' * len(names)}"]
        for score, direction in better.items():
            cells = [_format(table[name][score]) if score in table[name] else "—" for name in names]
            lines.append(f"| {score} ({_arrow(direction)}) | {' | '.join(cells)} |")
        lines.append("")
    lines += _held_out_table(summary)
    lines += _task_notes(summary)
    lines += _samples(summary)
    verdict = comparison_line(summary.get("comparison"))
    if verdict:
        lines += [verdict, ""]
    lines += _previous(summary.get("previous"))
    lines += [*[f"- {note}" for note in summary.get("notes", [])], ""]
    return "\n".join(lines)


def _held_out_table(summary: dict[str, Any]) -> list[str]:
    lines = [
        "## Held-out data",
        "",
        "| checkpoint | split | loss | perplexity | bits per byte | tokens |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {row['checkpoint']} | {row['split']} | {row['loss']:.4f} | {row['perplexity']:.2f} "
        f"| {row['bits_per_byte']:.4f} | {row['tokens']:,} |"
        for row in table_rows(summary)
    ]
    return [*lines, ""]


def _task_notes(summary: dict[str, Any]) -> list[str]:
    documents = _documents(summary)
    if not documents:
        return []
    counts = ", ".join(f"{task} {count}" for task, count in documents.items())
    return [f"Tasks scored by lm_eval's evaluator through d9d's adapter; documents per task: {counts}.", ""]


def _samples(summary: dict[str, Any]) -> list[str]:
    samples: dict[str, list[dict[str, str]]] = summary.get("samples", {})
    prompts = next((entry for entry in samples.values() if entry), [])
    if not prompts:
        return []
    lines = [f"## Sample continuations (greedy, up to {summary.get('max_new_tokens', '?')} new tokens)", ""]
    for index, sample in enumerate(prompts):
        lines += [f"### {_inline(sample['prompt'])}", ""]
        for name, entries in samples.items():
            if index < len(entries):
                lines.append(f"- **{name}**: …{_inline(entries[index]['continuation'])}")
        lines.append("")
    return lines


def _inline(text: str) -> str:
    """Markdown-safe on one line: newlines shown as ⏎, markup characters escaped."""
    escaped = "".join(f"\\{char}" if char in "\\`*_[]<>#|" else char for char in text)
    return escaped.replace("\r", "").replace("\n", " ⏎ ")


def _previous(previous: dict[str, Any] | None) -> list[str]:
    if not previous:
        return []
    compared = previous["comparison"]
    names = list(compared["checkpoints"])
    lines = [
        "## Compared with the previous report",
        "",
        f"previous: `{previous['path']}` ({previous['created_at']})",
        "",
    ]
    verdict = verdict_line(previous)
    if verdict:
        lines += [verdict, ""]
    if not compared["comparable"]:
        lines += ["The held-out sets or task sizes differ from the previous report's: deltas mix data and model.", ""]
    if not names:
        return lines
    lines += [f"| score | {' | '.join(f'{name} (delta)' for name in names)} |", f"|---|{'---|' * len(names)}"]
    every = list(dict.fromkeys(score for name in names for score in compared["checkpoints"][name]["scores"]))
    for score in every:
        cells = []
        for name in names:
            entry = compared["checkpoints"][name]["scores"].get(score)
            if entry is None:
                cells.append("—")
                continue
            mark = "better" if entry["better"] else ("worse" if entry["delta"] else "same")
            cells.append(f"{_format(entry['current'])} ({entry['delta']:+.4f}, {mark})")
        lines.append(f"| {score} | {' | '.join(cells)} |")
    return [*lines, ""]


def comparison_line(compared: dict[str, Any] | None) -> str | None:
    if not compared:
        return None
    verdict = "lower" if compared["lower"] else "NOT lower"
    return (
        f"fine-tuned vs pretrained held-out loss on {compared['split']}: {compared['finetune']:.4f} vs "
        f"{compared['pretrain']:.4f} ({verdict})"
    )


def table_rows(statistics: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per checkpoint and split, for a table artifact."""
    return [
        {
            "checkpoint": name,
            "split": split,
            "loss": round(float(report["loss"]), 4),
            "perplexity": round(float(report["perplexity"]), 2),
            "bits_per_byte": round(float(report["bits_per_byte"]), 4),
            "tokens": int(report["tokens"]),
            "path": report["checkpoint"],
        }
        for name, splits in statistics.get("checkpoints", {}).items()
        for split, report in splits.items()
    ]


def score_rows(statistics: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per score with a column per checkpoint, for the scores table artifact."""
    table = scores(statistics)
    return [
        {"score": score, "better": "higher" if direction else "lower"}
        | {name: round(row[score], 4) for name, row in table.items() if score in row}
        for score, direction in higher_is_better(statistics).items()
    ]
