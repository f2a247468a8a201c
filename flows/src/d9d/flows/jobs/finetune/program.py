"""The fine-tune rank program: `torchrun --nproc-per-node N -m d9d.flows.jobs.finetune.program --config ft.yaml`.

Every rank runs the same wiring as pretrain (`build_rank_model` on the section's topology, packed data sharded over
cp, the task, the clipper), with a PEFT method injected into the meta-device model before the parallel plan (so
FSDP and the tensor-parallel plan shard the adapters too), the base weights loaded from a job checkpoint or
safetensors (d9d layout, or through `stage.base_mapping`, e.g. straight from a Hugging Face directory), and an
optimizer over the trainable parameters only. The `Trainer` resumes from
`checkpoints` (adapter-only job checkpoints; the base is loaded first). At the end it writes into `output`:

- `adapter/`: the trained parameters alone (d9d-layout safetensors), with `peft.json` (the method) beside it;
- `merged/`: the adapters folded into the base weights (d9d-layout safetensors, the base model's names) with its
  `parameters.json`, so `d9d convert --mapping qwen3-d9d-to-hf merged/ DIR` gives a `transformers` directory;
- `hf_peft/` (with `export_hf_peft`): `adapter_model.safetensors` + `adapter_config.json` for HF `peft`;
- `finetune.json`: validation loss before and after, parameter counts.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, assert_never

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from d9d.core.config import load_config
from d9d.core.data.loader_config import SequentialOrderConfig, ShuffledOrderConfig
from d9d.core.dist import DistributedContext
from d9d.core.loop import BuiltModel, DataSource, EventBus, ModelLoader, TrainResult, build_trainer, evaluate
from d9d.core.loop.reduce import token_group
from d9d.core.lr import build_lr_scheduler
from d9d.core.optim import build_optimizer
from d9d.flows.jobs.finetune.base import load_base, resolve_base
from d9d.flows.jobs.finetune.config import FinetuneRankConfig
from d9d.flows.jobs.launch import prepare_rank
from d9d.flows.jobs.optimizer_kernels import register_optimizer_kernels
from d9d.flows.jobs.rank_wiring import (
    PackedCausalLMTask,
    build_rank_model,
    data_parallel_size,
    gradient_clipper,
    log_topology,
    packed_loader,
    packed_source,
    packed_task,
    report_progress,
)
from d9d.metrics.trackers import build_tracker
from d9d.models.catalogue import (
    AnyModelConfig,
    Qwen3DenseModelConfig,
    Qwen3MoeModelConfig,
    write_parameters,
)
from d9d.models.qwen3 import mapper_to_huggingface_qwen3_dense, mapper_to_huggingface_qwen3_moe
from d9d.peft import PeftInjectionResult, PeftMethod, build_peft_method, inject_peft_and_freeze, merge_peft
from d9d.peft.export import export_hf_peft_adapter
from d9d.peft.loading import save_trainable_state
from d9d.states import save_model_state
from d9d.states.mapper import ModelStateMapper

REPORT_FILE = "finetune.json"
MERGED_DIR = "merged"
ADAPTER_DIR = "adapter"
PEFT_FILE = "peft.json"


@dataclass(frozen=True, kw_only=True)
class FinetuneResult:
    train: TrainResult
    base: Path
    validation_loss_before: float | None  # the base model's (fresh adapters change nothing)
    validation_loss_after: float | None
    trainable_parameters: int
    total_parameters: int


def validation_loss(
    config: FinetuneRankConfig, ctx: DistributedContext, built: BuiltModel, task: PackedCausalLMTask
) -> float | None:
    """Token-weighted loss over the first `validation_steps` batches of the validation shards (None: none set),
    one micro-batch per step (pipelined: the schedule's forward-only program)."""
    if config.validation_shards is None:
        return None
    loader = packed_loader(
        ctx,
        config.validation_shards,
        seq_len=config.seq_len,
        global_batch_rows=config.stage.validation_rows_per_step,
        order=SequentialOrderConfig(),
        epochs=None,
    )
    data = packed_source(ctx, loader, 1)
    steps = config.stage.validation_steps
    return evaluate(
        built.model, task, data, steps=steps, group=token_group(ctx), device=ctx.device, schedule=built.schedule
    ).loss


def to_hf_mapper(model: AnyModelConfig) -> ModelStateMapper:
    match model:
        case Qwen3DenseModelConfig():
            return mapper_to_huggingface_qwen3_dense(model.parameters)
        case Qwen3MoeModelConfig():
            return mapper_to_huggingface_qwen3_moe(model.parameters)
        case _:
            assert_never(model)


def export_outputs(
    config: FinetuneRankConfig,
    ctx: DistributedContext,
    model: nn.Module,
    method: PeftMethod,
    injection: PeftInjectionResult,
) -> None:
    """Adapters first (they are gone once merged), then the merged model; every rank takes part."""
    output = config.output
    output.mkdir(parents=True, exist_ok=True)
    save_trainable_state(output / ADAPTER_DIR, model, overwrite=True)
    if config.stage.export_hf_peft:
        export_hf_peft_adapter(model, to_hf_mapper(config.model), output / "hf_peft", write=ctx.is_main_process)
    merge_peft(method, model)
    merged = {name: value for name, value in model.state_dict().items() if name not in injection.adapter_names}
    save_model_state(output / MERGED_DIR, merged, overwrite=True)
    if ctx.is_main_process:
        write_parameters(output / MERGED_DIR, config.model.parameters)  # a model directory says what it holds
        (output / PEFT_FILE).write_text(config.stage.peft.model_dump_json(indent=2) + "\n", encoding="utf-8")


def run_finetune(config: FinetuneRankConfig, ctx: DistributedContext, events: EventBus | None = None) -> FinetuneResult:
    """Fine-tune on this rank (every rank of the job calls it with the same config)."""
    stage = config.stage
    method = build_peft_method(stage.peft)
    base = resolve_base(config.base)
    injections: list[PeftInjectionResult] = []

    def prepare(model: nn.Module) -> None:
        injections.append(inject_peft_and_freeze(method, model))

    def load(model: nn.Module) -> None:
        load_base(base, model, injections[-1], stage.base_mapping)

    trainer_config = stage.trainer_config(config.checkpoints, trainable_only=True)  # the base is loaded first
    built: list[BuiltModel] = []

    def model_provider(ctx: DistributedContext, loader: ModelLoader | None) -> BuiltModel:
        microbatches = trainer_config.microbatches_per_step(data_parallel_size(ctx))
        built.append(
            build_rank_model(
                stage, config.model, ctx, microbatches_per_step=microbatches, prepare=prepare, loader=loader
            )
        )
        return built[-1]

    def data_provider(ctx: DistributedContext, microbatches_per_step: int) -> DataSource[Any]:
        loader = packed_loader(
            ctx,
            config.train_shards,
            seq_len=config.seq_len,
            global_batch_rows=stage.global_batch_rows,
            order=ShuffledOrderConfig(seed=stage.shuffle_seed),
            epochs=None,
        )
        return packed_source(ctx, loader, microbatches_per_step)

    def optimizer_provider(model: nn.Module) -> Optimizer:
        register_optimizer_kernels(stage.optimizer)
        # Only what trains: the optimizer then holds state for the adapters alone.
        return build_optimizer(stage.optimizer, [param for param in model.parameters() if param.requires_grad])

    def lr_provider(optimizer: Optimizer, total_steps: int) -> LRScheduler:
        return build_lr_scheduler(stage.lr_schedule, optimizer, total_steps)

    task = packed_task(stage, config.model)
    tracker = build_tracker(
        config.tracker, enabled=ctx.is_main_process, hparams=config.model_dump(mode="json"), name="finetune"
    )
    trainer = build_trainer(
        ctx,
        trainer_config,
        model_provider=model_provider,
        task=task,
        data_provider=data_provider,
        optimizer_provider=optimizer_provider,
        lr_scheduler_provider=lr_provider,
        loader=load,
        clipper=gradient_clipper(ctx),
        tracker=tracker,
        events=events,
    )
    model = trainer.parts.model
    before = validation_loss(config, ctx, built[-1], task)
    result = trainer.train()
    tracker.close()
    after = validation_loss(config, ctx, built[-1], task)
    if not result.preempted:
        export_outputs(config, ctx, model, method, injections[-1])
    finetune = FinetuneResult(
        train=result,
        base=base,
        validation_loss_before=before,
        validation_loss_after=after,
        trainable_parameters=sum(param.numel() for param in model.parameters() if param.requires_grad),
        total_parameters=sum(param.numel() for param in model.parameters()),
    )
    if ctx.is_main_process and not result.preempted:
        report = {key: value for key, value in asdict(finetune).items() if key != "train"}
        report |= {"base": str(base), "last_step": result.last_step}
        (config.output / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return finetune


def main(argv: Sequence[str] | None = None) -> int:
    prepare_rank()  # its Python stack on SIGUSR2, for the launcher's report of a failed group
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    config = load_config(FinetuneRankConfig, args.config, args.overrides)  # the one validation in this process
    stage = config.stage
    timeout = timedelta(seconds=stage.trainer_config(config.checkpoints).collective_timeout_s)
    with DistributedContext.build(stage.degrees, device=stage.device, timeout=timeout) as ctx:
        events = EventBus()
        if ctx.is_main_process:  # progress lines for the launcher (the fine-tune stage's progress and losses)
            report_progress(events, stage.steps)
        log_topology("finetune", stage, ctx)
        result = run_finetune(config, ctx, events)
        ctx.logger.info(
            "finetune finished at step %d: validation loss %s -> %s",
            result.train.last_step,
            result.validation_loss_before,
            result.validation_loss_after,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
