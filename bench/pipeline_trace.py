"""Where a pipelined step's time goes on each rank, from the Chrome traces of `pipeline_schedules.py --trace-dir`.

    python bench/pipeline_trace.py TRACE_DIR            # every pipeline-*-rank*.json there

Per rank: the step's wall time; the GPU's compute time (non-NCCL kernels, merged); its idle time split into time
inside an NCCL kernel only (waiting for a peer: the pipeline's bubble proper) and time with no kernel at all (the
device starved by its host: launch-bound); the host's time inside each kind of executor action and inside blocking
CUDA calls (synchronize, device-to-host copies), which stop the host from running ahead of its device.

`--costs` adds each stage's measured GPU time per compute action (F, I, W, B): the kernels an action launched (found
through the profiler's correlation ids from the launch call inside the action's host range to the kernel, NCCL
excluded), summed, median over micro-batches. Unlike the step's wall time these exclude every wait for a peer, so
replaying the program with them (`pipeline_schedules.py` does, column `simulated, measured costs`) separates what the
schedule and the split cost from what the runtime adds.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import statistics
from collections import defaultdict
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


def action_gpu_ms(events: list[dict[str, Any]]) -> dict[tuple[str, int], list[float]]:
    """GPU ms of every compute action in one rank's trace, keyed by (action kind, stage), one entry per micro-batch:
    the summed durations of the non-NCCL kernels launched inside the action's host range."""
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
    per_action: dict[tuple[str, int, int], float] = defaultdict(float)
    for event in complete:
        if event.get("cat") != "kernel" or "nccl" in event.get("name", "").lower():
            continue
        action = action_of.get(event.get("args", {}).get("correlation"))
        if action is not None:
            per_action[action] += event["dur"] / 1e3
    by_kind: dict[tuple[str, int], list[float]] = defaultdict(list)
    for (kind, stage, _), ms in sorted(per_action.items()):
        by_kind[(kind, stage)].append(ms)
    return dict(by_kind)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--costs", action="store_true", help="also each stage's GPU ms per compute action")
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
    if args.costs:
        groups: dict[str, list[Path]] = defaultdict(list)
        for path in sorted(args.trace_dir.glob("pipeline-*-rank*.json")):
            groups[path.name.rsplit("-rank", 1)[0]].append(path)
        for name, paths in groups.items():
            print(f"\n{name}: GPU ms per action (median over micro-batches)\n")
            print("| stage | F | I | W | B |\n|---|---|---|---|---|")
            for stage, kinds in measured_costs(paths).items():
                cells = [kinds.get(kind) for kind in ("FORWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "BACKWARD")]
                print(f"| {stage} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
