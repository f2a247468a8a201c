"""Where a pipelined step's time goes on each rank, from the Chrome traces of `pipeline_schedules.py --trace-dir`.

    python bench/pipeline_trace.py TRACE_DIR            # every pipeline-*-rank*.json there
    python bench/pipeline_trace.py TRACE_DIR --delays   # + how late each rank's GPU started its actions, after what

Per rank: the step's wall time; the GPU's compute time (non-NCCL kernels, merged); its idle time split into time
inside an NCCL kernel only (waiting for a peer: the pipeline's bubble proper) and time with no kernel at all (the
device starved by its host: launch-bound); the host's time inside each kind of executor action and inside blocking
CUDA calls (synchronize, device-to-host copies), which stop the host from running ahead of its device.

`--costs` adds each stage's measured GPU time per compute action (F, I, W, B): the kernels an action launched (found
through the profiler's correlation ids from the launch call inside the action's host range to the kernel, NCCL
excluded), summed, median over micro-batches. Unlike the step's wall time these exclude every wait for a peer, so
replaying the program with them (`pipeline_schedules.py` does, column `simulated, measured costs`) separates what the
schedule and the split cost from what the runtime adds.

`--delays` says where that runtime share goes: every rank's traces of one step share the host's clock, so each
action's first kernel can be compared with the moment it could have started (the later of the rank's previous
action's last kernel and the last kernel of every action whose output it consumes, on whichever rank). Lateness
after a peer's input is the message's latency and its receive; after the rank's own previous action it is the host
or the stream; before the first action and after the last one it is the step's work outside the program.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trace_summary import union_length

ACTION = re.compile(r"^pp:([A-Z_]+):s(\d+):m(\d+)$")
BLOCKING = re.compile(r"Synchronize|cudaMemcpy(?!Async)|cudaStreamWaitEvent_blocking", re.I)


def clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def subtract(length_of: list[tuple[float, float]], minus: list[tuple[float, float]]) -> float:
    """Length covered by `length_of` and not by `minus`."""
    return union_length(length_of + minus) - union_length(minus)


LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # Triton launches through the driver API


Action = tuple[str, int, int]  # (kind, stage, micro-batch)


@dataclass
class ActionKernels:
    """The non-NCCL kernels one action launched: their summed duration and the span from the first one's start to the
    last one's end (microseconds, the trace's clock)."""

    busy: float = 0.0
    start: float = float("inf")
    end: float = float("-inf")


def action_kernels(events: list[dict[str, Any]]) -> dict[Action, ActionKernels]:
    """Every compute action of one rank's trace with the non-NCCL kernels launched inside its host range."""
    complete = [e for e in events if e.get("ph") == "X"]
    # Matched by time, not by thread: a backward's kernels are launched from autograd's device thread while the
    # executor's thread waits inside the action's range (the actions of one rank never overlap in time).
    ranges = sorted(
        (e["ts"], e["ts"] + e["dur"], match.group(1), int(match.group(2)), int(match.group(3)))
        for e in complete
        if e.get("cat") == "user_annotation" and (match := ACTION.match(e.get("name", "")))
    )
    starts = [r[0] for r in ranges]
    action_of: dict[Any, tuple[str, int, int]] = {}
    for event in complete:
        correlation = event.get("args", {}).get("correlation")
        if event.get("cat") not in LAUNCH_CATEGORIES or correlation is None:
            continue
        index = bisect.bisect_right(starts, event["ts"]) - 1
        if index >= 0:
            _, end, kind, stage, microbatch = ranges[index]
            if event["ts"] <= end:
                action_of[correlation] = (kind, stage, microbatch)
    per_action: dict[Action, ActionKernels] = defaultdict(ActionKernels)
    for event in complete:
        if event.get("cat") != "kernel" or "nccl" in event.get("name", "").lower():
            continue
        action = action_of.get(event.get("args", {}).get("correlation"))
        if action is not None:
            kernels = per_action[action]
            kernels.busy += event["dur"]
            kernels.start = min(kernels.start, event["ts"])
            kernels.end = max(kernels.end, event["ts"] + event["dur"])
    return dict(per_action)


def action_gpu_ms(events: list[dict[str, Any]]) -> dict[tuple[str, int], list[float]]:
    """GPU ms of every compute action in one rank's trace, keyed by (action kind, stage), one entry per micro-batch:
    the summed durations of the non-NCCL kernels launched inside the action's host range."""
    by_kind: dict[tuple[str, int], list[float]] = defaultdict(list)
    for (kind, stage, _), kernels in sorted(action_kernels(events).items()):
        by_kind[(kind, stage)].append(kernels.busy / 1e3)
    return dict(by_kind)


def _inputs(action: Action, last_stage: int) -> list[Action]:
    """The actions whose results `action` consumes (a backward also its own forward's activations)."""
    kind, stage, microbatch = action
    if kind == "FORWARD":
        return [("FORWARD", stage - 1, microbatch)] if stage > 0 else []
    if kind == "BACKWARD_WEIGHT":
        return [("BACKWARD_INPUT", stage, microbatch)]
    upstream = [("BACKWARD_INPUT", stage + 1, microbatch), ("BACKWARD", stage + 1, microbatch)]
    return [("FORWARD", stage, microbatch)] + (upstream if stage < last_stage else [])


def _launched_inputs(action: Action, last_stage: int, launched: Mapping[Action, ActionKernels]) -> list[Action]:
    """`_inputs` where an input launched no kernel (the first stage's `I`, which does nothing) stands for its own
    inputs."""
    found: list[Action] = []
    for source in _inputs(action, last_stage):
        found += [source] if source in launched else _launched_inputs(source, last_stage, launched)
    return found


@dataclass
class RankDelays:
    """Where one rank's GPU started an action later than it could have (ms): after the rank's previous action
    (`local`: its host or stream was late), after an input produced on another rank (`transfer`: the message's
    latency and its receive), and the step's time before the first action and after the last one of any rank
    (`edges`: its work outside the program, such as the optimizer and clipping)."""

    local: float = 0.0
    transfer: float = 0.0
    edges: float = 0.0
    worst: list[tuple[float, str]] = field(default_factory=list)  # (ms, description), largest first


def runtime_delays(paths: list[Path]) -> dict[str, RankDelays]:
    """Per trace of one step (every rank of one run, one shared clock: one host), the delays no replay models: each
    compute action's first kernel against the later of the rank's previous action's last kernel and its inputs' last
    kernels (wherever they ran). What remains of the idle time is the program's own bubble."""
    spans: dict[str, dict[Action, ActionKernels]] = {}
    bounds: dict[str, tuple[float, float]] = {}
    for path in paths:
        events = json.loads(path.read_text())["traceEvents"]
        spans[path.name] = action_kernels(events)
        step = next(e for e in events if e.get("name") == "pp:step" and e.get("cat") == "user_annotation")
        bounds[path.name] = (step["ts"], step["ts"] + step["dur"])
    everywhere = {action: kernels for per_rank in spans.values() for action, kernels in per_rank.items()}
    last_stage = max((stage for _, stage, _ in everywhere), default=0)
    first = min((kernels.start for kernels in everywhere.values()), default=0.0)
    last = max((kernels.end for kernels in everywhere.values()), default=0.0)
    result: dict[str, RankDelays] = {}
    for name, actions in spans.items():
        delays = RankDelays(edges=(first - bounds[name][0] + bounds[name][1] - last) / 1e3 if actions else 0.0)
        previous_end = float("-inf")  # the rank's first action can only be late for its inputs
        for action, kernels in sorted(actions.items(), key=lambda item: item[1].start):
            inputs = [(everywhere[i].end, i) for i in _launched_inputs(action, last_stage, everywhere)]
            input_end, source = max(inputs, default=(float("-inf"), None))
            ready = max(previous_end, input_end)
            late = max(0.0, kernels.start - ready) / 1e3 if ready > float("-inf") else 0.0
            remote = source is not None and source not in actions and input_end >= previous_end
            if remote:
                delays.transfer += late
            else:
                delays.local += late
            label = f"{action[0]} s{action[1]} m{action[2]}" + (f" after {source[0]} s{source[1]}" if remote else "")
            delays.worst.append((late, label))
            previous_end = max(previous_end, kernels.end)
        delays.worst = sorted(delays.worst, reverse=True)[:3]
        result[name] = delays
    return result


def measured_costs(paths: list[Path]) -> dict[int, dict[str, float]]:
    """Per global stage, the median GPU ms of each compute kind (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT,
    BACKWARD) over its micro-batches, from every rank's trace of one step."""
    costs: dict[int, dict[str, float]] = defaultdict(dict)
    for path in paths:
        for (kind, stage), values in action_gpu_ms(json.loads(path.read_text())["traceEvents"]).items():
            if kind in ("FORWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "BACKWARD"):
                costs[stage][kind] = statistics.median(values)
    return dict(sorted(costs.items()))


def summarise(path: Path) -> dict[str, Any]:
    events = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in events if e.get("ph") == "X"]
    step = next(e for e in complete if e.get("name") == "pp:step" and e.get("cat") == "user_annotation")
    lo, hi = step["ts"], step["ts"] + step["dur"]
    kernels = [e for e in complete if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    nccl = clip([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()], lo, hi)
    compute = clip([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()], lo, hi)
    wall = hi - lo
    busy = union_length(compute)
    waiting = subtract(nccl, compute)  # a peer's data not there yet (or a send not yet taken)
    starved = wall - busy - waiting
    host_by_kind: dict[str, list[float]] = defaultdict(list)
    for event in complete:
        match = ACTION.match(event.get("name", ""))
        if match and event.get("cat") == "user_annotation":
            host_by_kind[match.group(1)].append(event["dur"])
    blocking = [e for e in complete if e.get("cat") == "cuda_runtime" and BLOCKING.search(e.get("name", ""))]
    blocking_ms: dict[str, float] = defaultdict(float)
    for event in blocking:
        if lo <= event["ts"] <= hi:
            blocking_ms[event["name"]] += event["dur"] / 1e3
    return {
        "trace": path.name,
        "wall_ms": wall / 1e3,
        "compute_ms": busy / 1e3,
        "waiting_peer_ms": waiting / 1e3,
        "starved_ms": starved / 1e3,
        "host_ms_by_action": {kind: (len(d), sum(d) / 1e3) for kind, d in sorted(host_by_kind.items())},
        "host_blocking_ms": dict(sorted(blocking_ms.items(), key=lambda item: -item[1])[:4]),
    }


def print_delays(paths: list[Path]) -> None:
    """`runtime_delays` of one run's traces as a table, each rank's largest delays beneath it."""
    print("\n| trace | ms late after own previous action | after a peer's input | outside the actions |")
    print("|---|---|---|---|")
    for name, delays in runtime_delays(paths).items():
        print(f"| {name} | {delays.local:.1f} | {delays.transfer:.1f} | {delays.edges:.1f} |")
        print(f"#   {name} largest: " + "; ".join(f"{ms:.2f} ms {label}" for ms, label in delays.worst))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--costs", action="store_true", help="also each stage's GPU ms per compute action")
    parser.add_argument(
        "--delays", action="store_true", help="also how late each rank's GPU started its actions, and after what"
    )
    args = parser.parse_args()
    print("| trace | wall ms | GPU compute | waiting on a peer | starved (no kernel) | host in actions (count, ms) |")
    print("|---|---|---|---|---|---|")
    for path in sorted(args.trace_dir.glob("pipeline-*-rank*.json")):
        row = summarise(path)
        actions = ", ".join(f"{k} {n}: {ms:.0f}" for k, (n, ms) in row["host_ms_by_action"].items())
        print(
            f"| {row['trace']} | {row['wall_ms']:.0f} | {row['compute_ms']:.0f} | {row['waiting_peer_ms']:.0f}"
            f" | {row['starved_ms']:.0f} | {actions} |"
        )
        if row["host_blocking_ms"]:
            print(f"#   {row['trace']} host blocked in: {row['host_blocking_ms']}")
    groups: dict[str, list[Path]] = defaultdict(list)
    for path in sorted(args.trace_dir.glob("pipeline-*-rank*.json")):
        groups[path.name.rsplit("-rank", 1)[0]].append(path)
    if args.delays:
        for paths in groups.values():
            print_delays(paths)
    if args.costs:
        for name, paths in groups.items():
            print(f"\n{name}: GPU ms per action (median over micro-batches)\n")
            print("| stage | F | I | W | B |\n|---|---|---|---|---|")
            for stage, kinds in measured_costs(paths).items():
                cells = [kinds.get(kind) for kind in ("FORWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "BACKWARD")]
                print(f"| {stage} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
