"""Where a pipelined step's time goes on each rank, from the Chrome traces of `pipeline_schedules.py --trace-dir`.

    python bench/pipeline_trace.py TRACE_DIR            # every pipeline-*-rank*.json there

Per rank: the step's wall time; the GPU's compute time (non-NCCL kernels, merged); its idle time split into time
inside an NCCL kernel only (waiting for a peer: the pipeline's bubble proper) and time with no kernel at all (the
device starved by its host: launch-bound); the host's time inside each kind of executor action and inside blocking
CUDA calls (synchronize, device-to-host copies), which stop the host from running ahead of its device.
"""

from __future__ import annotations

import argparse
import json
import re
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


if __name__ == "__main__":
    main()
