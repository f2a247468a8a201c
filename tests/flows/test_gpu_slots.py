"""Every GPU-using stage holds `nodes x gpus_per_node` slots of the `gpus` global concurrency limit while it runs:
two pretrain runs started at once against a limit of one stage's worth run one after the other, through the real
embedded Prefect API (its global concurrency limit, leases and all).

The stages here run on CPU ranks; `pretrain.launcher.gpu_slots=2` makes each count as a 2-GPU stage (what it
would take by default with `device=cuda`). Isolated: Prefect starts threads; the two flow runs are two threads.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from d9d.flows.jobs.data_prep import prepare_data
from d9d.flows.jobs.launchers.checks import gpu_slots
from d9d.flows.jobs.loading import load_job_config
from d9d.flows.stage_flow import FLOWS, GPU_LIMIT

pytestmark = pytest.mark.isolated


def test_the_gpu_slots_a_stage_takes() -> None:
    config = load_job_config(
        preset_name="micro",
        overrides=["pretrain.device=cuda", "pretrain.launcher.kind=slurm", "pretrain.launcher.nodes=3"],
    )
    assert gpu_slots(config.pretrain) == 3 * 2  # nodes x nproc_per_node (one GPU per rank)
    assert gpu_slots(config.data_prep) == 0
    cpu = load_job_config(preset_name="micro", overrides=["pretrain.launcher.kind=slurm"])
    assert gpu_slots(cpu.pretrain) == 0  # device=cpu in the micro preset: no GPU, no slot


def test_two_runs_against_one_stages_worth_of_gpus_wait_for_each_other(prefect_api: Any, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from d9d.flows.embedded_api import embedded_api_url, using_api

    api_url = embedded_api_url(Path(os.environ["PREFECT_HOME"]), startup_timeout=300)  # what `d9d run` starts

    base = load_job_config(preset_name="micro", overrides=[f"workdir={tmp_path}"])
    prepare_data(base.data_prep, base.data_prep_output)
    configs = [
        load_job_config(
            preset_name="micro",
            overrides=[
                f"workdir={tmp_path}",
                f"pretrain.output={tmp_path / name}",
                "pretrain.init_from=random",
                "pretrain.steps=2",
                "pretrain.checkpoint_every=2",
                "pretrain.launcher.gpu_slots=2",
            ],
        )
        for name in ("first", "second")
    ]
    with using_api(api_url), get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(GPU_LIMIT, 2)
        try:
            states: list[Any] = [None, None]

            def run(index: int) -> None:
                with using_api(api_url):  # Prefect's settings are per context, and a thread starts with none
                    states[index] = FLOWS["pretrain"](configs[index], return_state=True)

            threads = [threading.Thread(target=run, args=(index,)) for index in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=900)
            assert all(state is not None and state.is_completed() for state in states), states
            spans = []
            for state in states:
                flow_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
                (task,) = [t for t in client.read_task_runs(flow_run_filter=flow_run) if t.name.startswith("run")]
                spans.append((task.start_time, task.end_time))
            (_, first_end), (second_start, _) = sorted(spans)
            # The run task starts once the slots are held and ends before they are released.
            assert second_start >= first_end, f"the stages overlapped: {spans}"
            assert client.read_global_concurrency_limit_by_name(GPU_LIMIT).active_slots == 0  # both released
        finally:
            client.delete_global_concurrency_limit_by_name(GPU_LIMIT)
