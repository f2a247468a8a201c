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
    from pipeline_trace import action_gpu_ms, measured_costs, runtime_delays, summarise
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


def _launch(category: str, start: float, correlation: int, tid: int) -> dict[str, object]:
    return {
        "ph": "X",
        "name": "launch",
        "cat": category,
        "ts": start,
        "dur": 5,
        "pid": 0,
        "tid": tid,
        "args": {"correlation": correlation},
    }


def _kernel(name: str, start: float, duration: float, correlation: int) -> dict[str, object]:
    return {
        "ph": "X",
        "name": name,
        "cat": "kernel",
        "ts": start,
        "dur": duration,
        "pid": 0,
        "tid": 7,
        "args": {"correlation": correlation},
    }


def test_each_action_is_charged_the_kernels_it_launched_wherever_they_ran(tmp_path):
    # The executor's thread (tid 1) holds the action ranges; a backward's kernels are launched from autograd's device
    # thread (tid 2) and Triton's through the driver API. Kernels run later than their launch (the host runs ahead)
    # and are matched by correlation id, NCCL kernels never count, and a launch outside every action is nobody's.
    events = [
        _event("pp:FORWARD:s1:m0", "user_annotation", 0, 100) | {"tid": 1},
        _launch("cuda_runtime", 10, 1, tid=1),
        _launch("cuda_driver", 20, 2, tid=1),
        _event("pp:BACKWARD_INPUT:s1:m0", "user_annotation", 200, 100) | {"tid": 1},
        _launch("cuda_runtime", 210, 3, tid=2),
        _launch("cuda_runtime", 220, 4, tid=2),
        _event("pp:FORWARD:s1:m1", "user_annotation", 400, 100) | {"tid": 1},
        _launch("cuda_runtime", 410, 5, tid=1),
        _launch("cuda_runtime", 600, 6, tid=1),  # the optimizer step, outside every action
        _kernel("gemm", 1000, 3000, 1),
        _kernel("triton_rms_norm", 4000, 1000, 2),
        _kernel("flash_bwd", 6000, 5000, 3),
        _kernel("ncclDevKernel_SendRecv", 11000, 9000, 4),
        _kernel("gemm", 20000, 6000, 5),
        _kernel("adam", 30000, 2000, 6),
    ]
    assert action_gpu_ms(events) == {
        ("FORWARD", 1): [pytest.approx(4.0), pytest.approx(6.0)],
        ("BACKWARD_INPUT", 1): [pytest.approx(5.0)],
    }
    rank0 = tmp_path / "pipeline-zbv-rows1-rank0.json"
    rank0.write_text(json.dumps({"traceEvents": events}))
    rank1 = tmp_path / "pipeline-zbv-rows1-rank1.json"
    rank1.write_text(
        json.dumps(
            {
                "traceEvents": [
                    _event("pp:BACKWARD_WEIGHT:s0:m0", "user_annotation", 0, 100),
                    _launch("cuda_runtime", 1, 9, tid=0),
                    _kernel("wgrad", 50, 2500, 9),
                ]
            }
        )
    )
    assert measured_costs([rank0, rank1]) == {
        0: {"BACKWARD_WEIGHT": pytest.approx(2.5)},
        1: {"FORWARD": pytest.approx(5.0), "BACKWARD_INPUT": pytest.approx(5.0)},  # medians over micro-batches
    }


def _rank_trace(path: Path, step: tuple[float, float], actions: list[tuple[str, float, float]]) -> None:
    """A rank's trace with the step range and, per action, one launch and one kernel at [start, end) (us)."""
    # The profiler also writes a GPU copy of each range (the span of its kernels); it must not be taken for the step.
    events: list[dict[str, object]] = [
        _event("pp:step", "gpu_user_annotation", step[0] + 500, step[1] - step[0] - 1000),
        _event("pp:step", "user_annotation", step[0], step[1] - step[0]),
    ]
    for correlation, (name, start, end) in enumerate(actions, start=1):
        host = start - 50  # the host runs ahead of its GPU
        events += [
            _event(f"pp:{name}", "user_annotation", host, 10),
            _launch("cuda_runtime", host + 1, correlation, tid=0),
            _kernel("gemm", start, end - start, correlation),
        ]
    path.write_text(json.dumps({"traceEvents": events}))


def test_lateness_is_charged_to_the_peer_input_or_to_the_rank_itself(tmp_path):
    # Stage 0 on rank 0, stage 1 on rank 1, one micro-batch each way; times in us (1000 = 1 ms).
    _rank_trace(
        tmp_path / "pipeline-1f1b-rows1-rank0.json",
        (0, 40_000),
        [("FORWARD:s0:m0", 1_000, 5_000), ("FORWARD:s0:m1", 5_500, 9_000), ("BACKWARD_INPUT:s0:m0", 20_000, 24_000)],
    )
    _rank_trace(
        tmp_path / "pipeline-1f1b-rows1-rank1.json",
        (0, 40_000),
        [("FORWARD:s1:m0", 7_000, 10_000), ("BACKWARD_INPUT:s1:m0", 10_000, 17_000)],
    )
    delays = runtime_delays(sorted(tmp_path.glob("*.json")))
    rank0, rank1 = delays["pipeline-1f1b-rows1-rank0.json"], delays["pipeline-1f1b-rows1-rank1.json"]
    # Rank 0: F m1 0.5 ms after its own F m0; I m0 3 ms after rank 1's I m0 ended at 17 ms.
    assert rank0.local == pytest.approx(0.5)
    assert rank0.transfer == pytest.approx(3.0)
    assert rank0.edges == pytest.approx(1.0 + 16.0)  # before any rank's first kernel, after any rank's last
    assert rank0.worst[0] == (pytest.approx(3.0), "BACKWARD_INPUT s0 m0 after BACKWARD_INPUT s1")
    # Rank 1: F m0 2 ms after rank 0's F m0 ended at 5 ms; its I m0 started as soon as its F did.
    assert rank1.transfer == pytest.approx(2.0)
    assert rank1.local == pytest.approx(0.0)
    assert rank1.edges == pytest.approx(1.0 + 16.0)  # its own idle start is the pipeline's fill, not an edge


def test_the_first_stages_weight_pass_waits_for_the_second_stages_gradient(tmp_path):
    # The first stage's I launches no kernel (its W is the whole backward): W s0 m0 depends on I s1 m0 on rank 1.
    _rank_trace(
        tmp_path / "pipeline-zbv-rows1-rank0.json",
        (0, 30_000),
        [("FORWARD:s0:m0", 1_000, 3_000), ("BACKWARD_WEIGHT:s0:m0", 12_000, 20_000)],
    )
    _rank_trace(
        tmp_path / "pipeline-zbv-rows1-rank1.json",
        (0, 30_000),
        [("FORWARD:s1:m0", 3_000, 5_000), ("BACKWARD_INPUT:s1:m0", 5_000, 11_500)],
    )
    rank0 = runtime_delays(sorted(tmp_path.glob("*.json")))["pipeline-zbv-rows1-rank0.json"]
    assert rank0.transfer == pytest.approx(0.5)  # from I s1 m0's end at 11.5 ms, not from its own F at 3 ms
    assert rank0.local == pytest.approx(0.0)
    assert rank0.worst[0] == (pytest.approx(0.5), "BACKWARD_WEIGHT s0 m0 after BACKWARD_INPUT s1")
