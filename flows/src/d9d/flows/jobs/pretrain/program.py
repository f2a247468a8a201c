"""The pretrain rank program: `torchrun --nproc-per-node N -m d9d.flows.jobs.pretrain.program --config job.yaml`.

Every rank runs the same wiring: distributed context, the model from d9d-models' catalogue (meta -> parallel plan
-> materialise -> optional `init_weights` load through d9d-states), packed token-shard data through
`build_data_loader`, optimizer and LR schedule from the section, and the d9d-core `Trainer` (which resumes from the
newest complete checkpoint in `checkpoints`). At the end, `model_output` gets the trained model as a self-describing
d9d model directory (safetensors + `parameters.json`), every pipeline stage's tensors gathered at `pp > 1`. No
Prefect here.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from d9d.core.config import load_config
from d9d.core.dist import DistributedContext
from d9d.core.loop import BuiltModel, EventBus, ModelLoader, TrainResult
from d9d.flows.jobs.pretrain.config import PretrainRankConfig
from d9d.flows.jobs.rank_wiring import (
    build_rank_model,
    build_stage_trainer,
    data_parallel_size,
    packed_task,
    training_rank_main,
)
from d9d.flows.jobs.weights import load_converted_weights, save_model_directory
from d9d.metrics.trackers import build_tracker


def run_pretrain(config: PretrainRankConfig, ctx: DistributedContext, events: EventBus | None = None) -> TrainResult:
    """Train on this rank (every rank of the job calls it with the same config); `events` sees the loop's events."""
    stage = config.stage

    trainer_config = stage.trainer_config(config.checkpoints)

    def model_provider(ctx: DistributedContext, loader: ModelLoader | None) -> BuiltModel:
        microbatches = trainer_config.microbatches_per_step(data_parallel_size(ctx))
        return build_rank_model(stage, stage.model, ctx, microbatches_per_step=microbatches, loader=loader)

    init_weights = config.init_weights
    loader: ModelLoader | None = None
    if init_weights is not None:

        def load(model: nn.Module) -> None:
            load_converted_weights(init_weights, model, pipeline_stages=stage.degrees.pp > 1)

        loader = load

    tracker = build_tracker(
        config.tracker, enabled=ctx.is_main_process, hparams=config.model_dump(mode="json"), name="pretrain"
    )
    trainer = build_stage_trainer(
        ctx,
        stage,
        checkpoints=config.checkpoints,
        train_shards=config.train_shards,
        seq_len=stage.seq_len,
        model_provider=model_provider,
        task=packed_task(stage, stage.model),
        loader=loader,
        tracker=tracker,
        events=events,
    )
    result = trainer.train()
    tracker.close()  # only after a normal return: a crashed attempt must not flush steps it will replay
    # At pp > 1 each rank holds only its stages: the writer gathers them (docs/design/0015).
    if config.model_output is not None and not result.preempted:
        save_model_directory(config.model_output, trainer.parts.model.state_dict(), stage.model.parameters, ctx)
    return result


def _train(config: PretrainRankConfig, ctx: DistributedContext, events: EventBus) -> str:
    result = run_pretrain(config, ctx, events)
    return f"pretrain finished at step {result.last_step} (preempted: {result.preempted})"


def main(argv: Sequence[str] | None = None) -> int:
    return training_rank_main(
        argv,
        "pretrain",
        __doc__,
        lambda path, overrides: load_config(PretrainRankConfig, path, overrides),  # the one validation on a rank
        _train,
    )


if __name__ == "__main__":
    raise SystemExit(main())
