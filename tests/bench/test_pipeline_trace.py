"""`bench/pipeline_trace.py` splits a rank's step into GPU compute, waiting inside NCCL kernels (a peer's data not
there yet) and starved (no kernel at all), from a Chrome trace. A hand-made trace with known intervals pins the
arithmetic; the benchmark's own traces come from `pipeline_schedules.py --trace-dir`."""

import json
import sys
from pathlib import Path

import pytest

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
sys.path.insert(0, BENCH)  # the benchmark scripts import each other by module name
try:
    from pipeline_trace import summarise
finally:
    sys.path.remove(BENCH)


def _event(name: str, category: str, start: float, duration: float) -> dict[str, object]:
    return {"ph": "X", "name": name, "cat": category, "ts": start, "dur": duration, "pid": 0, "tid": 0}


def test_compute_waiting_and_starved_add_up_to_the_step(tmp_path):
    events = [
        _event("pp:step", "user_annotation", 1000, 100_000),
        _event("gemm_kernel", "kernel", 11_000, 20_000),  # compute 10-30 ms
        _event("ncclDevKernel_SendRecv", "kernel", 26_000, 20_000),  # NCCL 25-45 ms, overlapping compute until 30
        _event("elementwise", "kernel", 51_000, 10_000),  # compute 50-60 ms
        _event("ncclDevKernel_SendRecv", "kernel", 71_000, 10_000),  # NCCL 70-80 ms
        _event("late_kernel", "kernel", 200_000, 5_000),  # after the step: not counted
        _event("pp:FORWARD:s0:m0", "user_annotation", 1500, 4000),
        _event("pp:FORWARD:s0:m1", "user_annotation", 6000, 2000),
        _event("pp:BACKWARD_INPUT:s1:m0", "user_annotation", 9000, 3000),
        _event("cudaStreamSynchronize", "cuda_runtime", 40_000, 7000),
    ]
    path = tmp_path / "pipeline-zbv-rows1-rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    row = summarise(path)
    assert row["wall_ms"] == pytest.approx(100.0)
    assert row["compute_ms"] == pytest.approx(30.0)
    assert row["waiting_peer_ms"] == pytest.approx(25.0)  # 30-45 and 70-80: NCCL with no compute beside it
    assert row["starved_ms"] == pytest.approx(45.0)
    assert row["host_ms_by_action"] == {"BACKWARD_INPUT": (1, 3.0), "FORWARD": (2, 6.0)}
    assert row["host_blocking_ms"] == {"cudaStreamSynchronize": pytest.approx(7.0)}
