"""Where a training step's time goes, from a `torch.profiler` Chrome trace: GPU busy vs idle, the largest idle gaps
with the host-side operations that were running during them, and device time by kernel family and by kernel.

    python bench/trace_summary.py TRACE.json[.gz] [--top 25] [--gap-ms 0.2]

Step boundaries are the profiler's `ProfilerStep#N` ranges (the Trainer's `StepProfiler` steps the profiler once per
training step). GPU busy time is the union of kernel and memcpy/memset intervals on every stream, so overlapping
streams count once; idle = step wall time - busy.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

FAMILIES = [  # first match wins; ordered from specific to general
    ("attention", re.compile(r"flash|fmha|cudnn|attn|sdpa|flex", re.I)),
    ("loss (fused linear+CE)", re.compile(r"_stats_kernel|_gradient_kernel", re.I)),
    ("optimizer", re.compile(r"adam|_foreach|multi_tensor", re.I)),
    ("gemm", re.compile(r"gemm|sm90_xmma|cutlass|nvjet|matmul|cublas|_mm_|wgmma", re.I)),
    ("nccl", re.compile(r"nccl", re.I)),
    ("memcpy/memset", re.compile(r"memcpy|memset|Memcpy|Memset", re.I)),
    ("triton (inductor fused)", re.compile(r"^triton_", re.I)),
    ("reduction/norm", re.compile(r"reduce|norm|softmax", re.I)),
]


def family(name: str) -> str:
    for label, pattern in FAMILIES:
        if pattern.search(name):
            return label
    return "other elementwise/copies"


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by `intervals` (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def gaps(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    found, cursor = [], lo
    for start, stop in sorted(intervals):
        if start > cursor:
            found.append((cursor, start))
        cursor = max(cursor, stop)
    if hi > cursor:
        found.append((cursor, hi))
    return found


def summarise(trace: dict[str, Any], *, top: int, gap_us: float) -> str:
    events = [event for event in trace.get("traceEvents", []) if event.get("ph") == "X"]
    steps = sorted(
        (event["ts"], event["ts"] + event["dur"], event["name"])
        for event in events
        if event.get("name", "").startswith("ProfilerStep#")
    )
    device = [event for event in events if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host = [event for event in events if event.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    lines: list[str] = []
    by_family: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for start, stop, name in steps or [(min(e["ts"] for e in device), max(e["ts"] + e["dur"] for e in device), "all")]:
        inside = [(e["ts"], e["ts"] + e["dur"], e) for e in device if start <= e["ts"] < stop]
        busy = union_length([(a, min(b, stop)) for a, b, _ in inside])
        wall = stop - start
        lines.append(
            f"{name}: wall {wall / 1e3:.2f} ms, GPU busy {busy / 1e3:.2f} ms ({busy / wall:.1%}), "
            f"idle {(wall - busy) / 1e3:.2f} ms, {len(inside)} device events"
        )
        for a, b, event in inside:
            by_family[family(event["name"])] += b - a
            slot = by_kernel[event["name"][:110]]
            slot[0] += b - a
            slot[1] += 1
        idle = sorted(gaps([(a, b) for a, b, _ in inside], start, stop), key=lambda g: g[0] - g[1])
        for gap_start, gap_stop in idle[:8]:
            if gap_stop - gap_start < gap_us:
                break
            during = sorted(
                {
                    h["name"][:60]
                    for h in host
                    if h["ts"] < gap_stop
                    and h["ts"] + h["dur"] > gap_start
                    and h["dur"] >= 0.5 * (gap_stop - gap_start)
                }
            )
            lines.append(
                f"  idle {(gap_stop - gap_start) / 1e3:6.2f} ms at +{(gap_start - start) / 1e3:7.2f} ms; host in: "
                + "; ".join(during[:6])
            )
    count = max(1, len(steps))
    lines.append(f"\ndevice time per step by family (mean over {count} steps):")
    for label, value in sorted(by_family.items(), key=lambda item: -item[1]):
        lines.append(f"  {label:28s} {value / count / 1e3:8.2f} ms")
    lines.append(f"\ntop {top} kernels by device time per step:")
    for name, (value, calls) in sorted(by_kernel.items(), key=lambda item: -item[1][0])[:top]:
        lines.append(f"  {value / count / 1e3:8.2f} ms  x{calls // count:<4d} {name}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--gap-ms", type=float, default=0.2, help="smallest idle gap listed")
    args = parser.parse_args()
    # bench/expert_parallel.py writes its traces gzipped
    text = gzip.decompress(args.trace.read_bytes()).decode() if args.trace.suffix == ".gz" else args.trace.read_text()
    print(summarise(json.loads(text), top=args.top, gap_us=args.gap_ms * 1e3))


if __name__ == "__main__":
    main()
