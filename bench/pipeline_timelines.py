"""Simulated pipeline schedules: timeline PNGs for docs/pipeline.md and the table of bubble fractions.

Every schedule's program (the same one the executor runs) is replayed with uniform costs: a whole rank's forward
= 1, input gradient = 1, weight gradient = 1 (full backward = 2), a rank holding v stages spends 1/v per stage
action, no communication latency. Closed forms where they exist: GPipe and 1F1B (p-1)/(m+p-1); interleaved 1F1B
with v stages per rank (p-1)/(vm+p-1); ZB-H1 (p-1)(F+I-W) of bubble per rank, i.e. (p-1)/(3m+p-1) here.

    python bench/pipeline_timelines.py                 # writes docs/pipeline/*.png, prints the markdown table
    python bench/pipeline_timelines.py --out /tmp/x    # elsewhere
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from pathlib import Path

from d9d.pipeline.program import (
    Program,
    build_program,
    dual_pipe_v,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    replay,
    zero_bubble_h1,
    zero_bubble_v,
)
from d9d.pipeline.program.plot import plot_timelines

SCHEDULES: dict[str, Callable[[int, int], object]] = {
    "GPipe": gpipe,
    "1F1B": one_f_one_b,
    "interleaved 1F1B (v=2)": partial(interleaved_one_f_one_b, v=2),
    "ZB-H1": zero_bubble_h1,
    "ZBV": zero_bubble_v,
    "DualPipeV": dual_pipe_v,
}


def formula(name: str, p: int, m: int) -> str:
    match name:
        case "GPipe" | "1F1B":
            return f"{(p - 1) / (m + p - 1):.3f}"
        case "interleaved 1F1B (v=2)":
            return f"{(p - 1) / (2 * m + p - 1):.3f}"
        case "ZB-H1":
            return f"{(p - 1) / (3 * m + p - 1):.3f}"
        case _:
            return "0 (idealised, m >= 2p)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "pipeline")
    args = parser.parse_args()
    p = args.pp
    rows = []
    for m in args.microbatches:
        timelines = []
        for name, builder in SCHEDULES.items():
            program: Program = build_program(name, partial(builder, p, m), m)  # type: ignore[arg-type]
            timeline = replay(program)
            timelines.append((name, timeline))
            rows.append((name, m, timeline.bubble_fraction, formula(name, p, m)))
        path = plot_timelines(timelines, args.out / f"timelines_pp{p}_m{m}.png")
        print(f"wrote {path}")
    print(f"\n| schedule | micro-batches | simulated bubble (pp={p}) | formula |\n|---|---|---|---|")
    for name, m, bubble, closed in rows:
        print(f"| {name} | {m} | {bubble:.3f} | {closed} |")


if __name__ == "__main__":
    main()
