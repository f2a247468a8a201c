"""`PipelineExecutor.annotate_actions` puts each compute action in a profiler range `pp:KIND:sSTAGE:mMICROBATCH`, so
a trace can charge kernels to actions (bench/pipeline_trace.py). On CPU the interpreter runs; the CUDA-graph replay
wraps each replayed action the same way (tests/pipeline/test_gpu_cuda_graphs.py runs that path). Off by default: a
range per action costs host time with no profiler running.

ZBV at pp=1 (both stages of the V on one rank, no communication), tiny Qwen3 dense, 4 micro-batches of one row.
"""

from collections import Counter

from pipeline_workload import CausalLMPipelineTask, context, dense_schedule, synthetic_source
from torch.profiler import ProfilerActivity, profile

from d9d.core.testing import run_on_ranks
from d9d.pipeline import PipelineConfig, ZeroBubbleVConfig

MICROBATCHES = 4


def _ranges_per_step() -> tuple[Counter[str], Counter[str], Counter[str]]:
    config = PipelineConfig(schedule=ZeroBubbleVConfig())
    schedule = dense_schedule(context(1), config, num_layers=4, num_microbatches=MICROBATCHES)
    task = CausalLMPipelineTask()
    batches = synthetic_source(seed=5, global_rows=MICROBATCHES).next_step()

    def traced_ranges() -> Counter[str]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            schedule.run(schedule.model, task, batches, loss_scale=1.0, backward=True)
        return Counter(event.name for event in prof.events() if event.name.startswith("pp:"))

    plain = traced_ranges()
    schedule.executor.annotate_actions = True
    annotated = traced_ranges()
    program = schedule.program(MICROBATCHES, training=True)
    expected = Counter(
        f"pp:{action.kind.name}:s{action.stage}:m{action.microbatch}"
        for action in program.for_rank(0)
        if action.kind.is_compute
    )
    return plain, annotated, expected


def test_each_compute_action_gets_one_named_range_only_when_asked():
    plain, annotated, expected = run_on_ranks(1, _ranges_per_step, timeout_seconds=240)[0]
    assert not plain
    assert annotated == expected
    assert {name.split(":")[1] for name in expected} == {"FORWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT"}
    assert all(count == 1 for count in expected.values())
