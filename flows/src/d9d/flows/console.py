"""What the `d9d` command shows: progress while stages run, and a summary of where every output went."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import IO, Any

from d9d.flows.jobs.contract import StageResult
from d9d.flows.jobs.evaluate.report import verdict_line
from d9d.flows.jobs.progress import Progress, rate


class _Display:
    progress: Progress | None = None


def set_progress(progress: Progress | None) -> None:
    """The progress display that stage flows in this process report to (the CLI sets a terminal one)."""
    _Display.progress = progress


def current_progress() -> Progress | None:
    return _Display.progress


class TerminalProgress:
    """A live bar on an interactive terminal; a line per tenth of the work otherwise (CI logs stay readable)."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self._stream = stream or sys.stderr
        self._interactive = self._stream.isatty()
        self._bar: Any = None
        self._task: Any = None
        self._total = 0.0
        self._done = 0.0
        self._next = 0.0
        self._description = ""
        self._unit = ""
        self._started: float | None = None  # None: not started (nothing to finish)

    def note(self, message: str) -> None:
        self._write(f"  {message}")

    def start(self, description: str, total: float, unit: str) -> None:
        self._description, self._total, self._unit = description, total, unit
        self._done, self._next, self._started = 0.0, total / 10, time.perf_counter()
        if self._interactive:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )
            from rich.progress import Progress as RichProgress

            columns = [TextColumn("  {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn()]
            if unit != "B":  # e.g. "pretrain ━━━━━ 120/400 steps 0:00:31 eta 0:01:12"
                columns = [
                    TextColumn("  {task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn(unit),
                    TimeRemainingColumn(),
                ]
            self._bar = RichProgress(
                *columns,
                TimeElapsedColumn(),
                TextColumn("{task.fields[note]}"),
                console=Console(file=self._stream),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task(description, total=total, note="")

    def advance(self, amount: float, note: str = "") -> None:
        self._done += amount
        if self._bar is not None:
            self._bar.update(self._task, advance=amount, note=note)
            return
        if amount > 0 and (self._done >= self._next or self._done >= self._total):  # a note alone: no new line
            self._next = self._done + self._total / 10
            share = 100.0 * self._done / self._total if self._total else 100.0
            eta = ""
            if 0 < self._done < self._total and self._started is not None:
                left = (time.perf_counter() - self._started) * (self._total - self._done) / self._done
                eta = f", about {left:.0f} s left"
            counted = "" if self._unit == "B" else f" {self._done:.0f}/{self._total:.0f} {self._unit}"
            self._write(f"  {self._description}: {share:3.0f}%{counted}{eta}{f' ({note})' if note else ''}")

    def finish(self, *, failed: bool = False) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self._started is None:  # the work failed before it started (e.g. torchrun never came up): no bar to end
            return
        seconds, self._started = time.perf_counter() - self._started, None
        if failed:  # an error or a signal stopped it: say how far it got, not "done"
            self._write(f"  {self._description}: stopped after {seconds:.1f} s ({self._done:.0f} of {self._total:.0f})")
            return
        speed = f" ({rate(self._done, seconds, self._unit)})" if self._done > 0 else ""
        self._write(f"  {self._description}: done in {seconds:.1f} s{speed}")

    def _write(self, line: str) -> None:
        self._stream.write(line + "\n")
        self._stream.flush()


class Waiting:
    """A wait with no amount to count (the Prefect API starting): a spinner with live elapsed seconds on a terminal,
    a line every `every` seconds otherwise; at the end one line saying how long it took, or that it failed."""

    def __init__(self, description: str, stream: IO[str] | None = None, *, every: float = 5.0) -> None:
        self._description = description
        self._stream = stream or sys.stderr
        self._every = every
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._spinner: Any = None
        self._started = 0.0

    def __enter__(self) -> Waiting:
        self._started = time.perf_counter()
        if self._stream.isatty():
            from rich.console import Console
            from rich.progress import Progress as RichProgress
            from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

            self._spinner = RichProgress(
                SpinnerColumn(),
                TextColumn(self._description),
                TimeElapsedColumn(),
                console=Console(file=self._stream),
                transient=True,
                auto_refresh=False,  # redrawn by our own thread, which is joined before the flows start processes
            )
            self._spinner.start()
            self._spinner.add_task(self._description, total=None)
        self._thread = threading.Thread(target=self._report, name="d9d-waiting", daemon=True)
        self._thread.start()
        return self

    def _report(self) -> None:
        if self._spinner is not None:
            while not self._stop.wait(0.1):  # the spinner turns and the seconds count
                self._spinner.refresh()
            return
        while not self._stop.wait(self._every):
            self._write(f"{self._description}: {time.perf_counter() - self._started:.0f} s so far")

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._spinner is not None:
            self._spinner.stop()
        seconds = time.perf_counter() - self._started
        self._write(f"{self._description}: {'stopped after' if kind is not None else 'ready in'} {seconds:.1f} s")

    def _write(self, line: str) -> None:
        self._stream.write(line + "\n")
        self._stream.flush()


def format_summary(results: Sequence[StageResult], *, seconds: float, target: str) -> str:
    """Where every output went, per stage, and what each stage did."""
    lines = [f"d9d: finished in {seconds:.1f} s (flows reported to {target})"]
    for result in results:
        lines.append(f"  {result.stage}: {result.status}{f' ({result.reason})' if result.reason else ''}")
        lines.append(f"    {'output':18} {result.output}")
        for label, path in result.artifacts.items():
            lines.append(f"    {label:18} {path}")
        lines.append(f"    {'manifest':18} {result.manifest}")
        lines += [f"    {line}" for line in _statistics_lines(result)]
    lines += _report_lines(results)
    return "\n".join(lines)


def _report_lines(results: Sequence[StageResult]) -> list[str]:
    """The closing report: the fine-tune verdict, bits per byte per checkpoint, the PNGs, tracker runs, outputs."""
    lines = ["  report"]
    for result in results:
        if result.stage != "evaluate":
            continue
        compared = result.statistics.get("comparison")
        if compared:
            verdict = "lower" if compared["lower"] else "NOT lower"
            lines.append(
                f"    {'fine-tuned':22} {compared['finetune']:.4f} vs pretrained {compared['pretrain']:.4f} "
                f"held-out loss on {compared['split']}: {verdict}"
            )
        for name, splits in result.statistics.get("checkpoints", {}).items():
            per_split = ", ".join(f"{report['bits_per_byte']:.4f} on {split}" for split, report in splits.items())
            lines.append(f"    {'bits/byte ' + name:22} {per_split}")
        lines += _task_lines(result.statistics)
        lines += [f"    {label:22} {path}" for label, path in result.artifacts.items() if label.endswith("curve")]
        for label in ("report", "report json"):
            if label in result.artifacts:
                lines.append(f"    {'evaluation ' + label:22} {result.artifacts[label]}")
    for result in results:
        if "tracker run" in result.artifacts:
            lines.append(f"    {'tracker ' + result.stage:22} {result.artifacts['tracker run']}")
    lines += [f"    {'output ' + result.stage:22} {result.output}" for result in results]
    return lines


def _task_lines(stats: dict[str, Any]) -> list[str]:
    """Per checkpoint its task scores on one line, then the verdict against the previous report."""
    lines = []
    for name, tasks in stats.get("tasks", {}).items():
        scores = ", ".join(
            f"{task} {metric} {value:.4g}"
            for task, result in tasks.items()
            for metric, value in result["metrics"].items()
        )
        if scores:
            lines.append(f"    {'tasks ' + name:22} {scores}")
    verdict = verdict_line(stats.get("previous"))
    if verdict:
        lines.append(f"    {'vs previous report':22} {verdict}")
    return lines


def _statistics_lines(result: StageResult) -> list[str]:
    stats = result.statistics
    if result.stage == "pretrain" and "final_loss" in stats:
        return [
            f"{'trained':18} {stats['steps']} steps on {stats['ranks']} ranks, final loss {stats['final_loss']:.4f}",
            f"{'started from':18} {stats.get('init')}",
        ]
    if result.stage == "finetune" and "final_loss" in stats:
        return [
            (
                f"{'trained':18} {stats['method']}, {stats['steps']} steps on {stats['ranks']} ranks, final loss "
                f"{stats['final_loss']:.4f}; {stats['trainable_parameters']:,} of {stats['total_parameters']:,} "
                "parameters trained"
            ),
            f"{'started from':18} {stats.get('base')}",
        ]
    if result.stage == "evaluate":
        return _evaluation_lines(stats)
    splits = stats.get("splits")
    if not isinstance(splits, dict):
        return []
    lines = []
    for split, numbers in splits.items():
        lines.append(
            f"{split + ' split':18} {numbers['documents']:,} documents, {numbers['tokens']:,} tokens, "
            f"{numbers['bytes']:,} bytes of text, {numbers['shards']} shards"
        )
    tokenizer = stats.get("tokenizer", {})
    if tokenizer:
        lines.append(
            f"{'tokenizer':18} {tokenizer.get('source')}, {tokenizer.get('vocab_size')} tokens, "
            f"{stats.get('bytes_per_token')} bytes/token"
        )
    return lines


def _evaluation_lines(stats: dict[str, Any]) -> list[str]:
    lines = [f"{'checkpoint':10} {'split':14} {'loss':>8} {'perplexity':>11} {'bits/byte':>10}"]
    for name, splits in stats.get("checkpoints", {}).items():
        for split, report in splits.items():
            lines.append(
                f"{name:10} {split:14} {report['loss']:8.4f} {report['perplexity']:11.2f} "
                f"{report['bits_per_byte']:10.4f}  {report['checkpoint']}"
            )
    lines += [f"{'note':18} {note}" for note in stats.get("notes", []) if "not evaluated" in note or "no loss" in note]
    return lines
