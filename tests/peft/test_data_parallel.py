"""LoRA under FSDP (2 ranks), HSDP (2x2 ranks) and tp2 x dp_shard2 with the Trainer equals single-process whole-batch
training: injected on the meta model before the plan, so the adapters are sharded DTensors like every other parameter;
only they train and only they have optimizer state; merging gathers them and changes no output."""

import pytest
import torch
import torch.distributed as dist
from peft_models import ATTENTION, DENSE, EAGER, EXPERTS, MOE, VOCAB
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.core.determinism import seed_everything
from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.dist.domains import MeshDomain
from d9d.core.loop import (
    BuiltModel,
    LossResult,
    SyntheticTokenSource,
    TokenBatch,
    TrainerConfig,
    build_trainer,
    synthetic_global_batch,
)
from d9d.core.loop.reduce import dp_group
from d9d.core.lr import ConstantScheduleConfig, build_lr_scheduler
from d9d.models import materialize_
from d9d.models.qwen3 import Qwen3DenseForCausalLM, Qwen3MoeForCausalLM, parallelize_qwen3_dense, parallelize_qwen3_moe
from d9d.parallel import FsdpConfig, HsdpConfig, clip_grad_norm_
from d9d.peft import LoRAConfig, LoRAParameters, build_peft_method, inject_peft_and_freeze, merge_peft

pytestmark = [
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning"),
    pytest.mark.filterwarnings("ignore:Slicing a flattened dim:UserWarning"),
]

STEPS, ROWS, SEQ, SEED, LR = 4, 8, 12, 3, 0.02
# fp32 on both sides; only the summation order of the data-parallel reduction differs (measured below 1e-6).
TOLERANCE = 2e-5
LAYOUTS = {
    "fsdp": (MeshDegrees(dp_shard=2), FsdpConfig()),
    "hsdp": (MeshDegrees(dp_replicate=2, dp_shard=2), HsdpConfig()),
    # tensor parallel: the adapters of q/k/v/o are split by parameter name (lora_B with a column split, lora_A with
    # a row split), those of the experts are sharded over dp x tp with the MoE block.
    "tp": (MeshDegrees(dp_shard=2, tp=2), FsdpConfig()),
}


def _lora(moe: bool) -> LoRAConfig:
    pattern = rf"{ATTENTION}|{EXPERTS}" if moe else ATTENTION
    return LoRAConfig(module_name_pattern=pattern, params=LoRAParameters(r=4, alpha=8))


def _meta_model(moe: bool) -> nn.Module:
    with torch.device("meta"):
        return Qwen3MoeForCausalLM(MOE, config=EAGER) if moe else Qwen3DenseForCausalLM(DENSE, config=EAGER)


class Task:
    def count_tokens(self, batch: TokenBatch) -> int:
        return int((batch.labels != -100).sum())

    def compute_loss(self, model: nn.Module, batch: TokenBatch) -> LossResult:
        return LossResult(loss_sum=model(batch.input_ids, labels=batch.labels).losses.sum())


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [param for param in model.parameters() if param.requires_grad]


def _reference(moe: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _meta_model(moe)
    inject_peft_and_freeze(build_peft_method(_lora(moe)), model)
    seed_everything(SEED)
    materialize_(model, "cpu")
    optimizer = torch.optim.AdamW(_trainable(model), lr=LR)
    losses = []
    for step in range(STEPS):
        batch = synthetic_global_batch(seed=5, step=step, rows=ROWS, seq_len=SEQ, vocab_size=VOCAB, ignore_fraction=0.3)
        optimizer.zero_grad(set_to_none=True)
        loss = model(batch.input_ids, labels=batch.labels).losses.sum() / (batch.labels != -100).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(_trainable(model), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, {name: value.detach().clone() for name, value in model.state_dict().items()}


def _check(layout: str, moe: bool) -> None:
    degrees, data_parallel = LAYOUTS[layout]
    ctx = DistributedContext.build(degrees, device="cpu")
    method = build_peft_method(_lora(moe))

    def model_provider(ctx: DistributedContext, loader: object) -> BuiltModel:
        model = _meta_model(moe)
        inject_peft_and_freeze(method, model)
        parallelize = parallelize_qwen3_moe if moe else parallelize_qwen3_dense
        sync = parallelize(model, ctx, data_parallel)
        return BuiltModel(model=materialize_(model, ctx.device), gradient_sync=sync)

    def data_provider(ctx: DistributedContext, microbatches: int) -> SyntheticTokenSource:
        group = dp_group(ctx)
        dp_size = 1 if group is None else group.size()
        return SyntheticTokenSource(
            seed=5, global_rows=ROWS, microbatch_rows=ROWS // dp_size // microbatches, seq_len=SEQ,
            vocab_size=VOCAB, dp_rank=ctx.coordinate(MeshDomain.BATCH)["dp"], dp_size=dp_size, ignore_fraction=0.3,
        )  # fmt: skip

    config = TrainerConfig(total_steps=STEPS, global_batch_rows=ROWS, microbatch_rows=1, seed=SEED, gc_every=None)
    trainer = build_trainer(
        ctx,
        config,
        model_provider=model_provider,
        task=Task(),
        data_provider=data_provider,
        optimizer_provider=lambda model: torch.optim.AdamW(_trainable(model), lr=LR),
        lr_scheduler_provider=lambda optimizer, steps: build_lr_scheduler(ConstantScheduleConfig(), optimizer, steps),
        clipper=clip_grad_norm_,
    )
    result = trainer.train()
    model, optimizer = trainer.parts.model, trainer.parts.optimizer
    adapters = {name: param for name, param in model.named_parameters() if name.endswith(("lora_A", "lora_B"))}
    assert all(isinstance(param, DTensor) for param in adapters.values())  # sharded like every parameter
    assert {id(param) for param in optimizer.state} == {id(param) for param in adapters.values()}

    reference_losses, reference_state = _reference(moe)
    losses = [result.losses[step] for step in range(1, STEPS + 1)]
    assert max(abs(a - b) for a, b in zip(losses, reference_losses, strict=True)) <= TOLERANCE
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if name in adapters:
            # Adam divides each element's gradient by its own RMS: an element whose gradient sits at the noise
            # level moves by a different fraction of lr (0.02) under another summation order (worst seen 1.1e-4).
            torch.testing.assert_close(full, reference_state[name], rtol=0, atol=1e-3)
        else:
            assert torch.equal(full, reference_state[name]), name  # frozen: bitwise the initial weights

    batch = synthetic_global_batch(seed=9, step=0, rows=2, seq_len=SEQ, vocab_size=VOCAB)
    with torch.no_grad():
        unmerged = model.eval()(batch.input_ids, labels=batch.labels).losses
        merge_peft(method, model)
        merged = model(batch.input_ids, labels=batch.labels).losses
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)  # fp32: one extra rounding of W + sBA
    dist.barrier()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.distributed(world_size=2, timeout=180)
def test_lora_under_fsdp_matches_single_process_training(moe):
    _check("fsdp", moe)


@pytest.mark.distributed(world_size=4, timeout=300)
def test_lora_under_hsdp_matches_single_process_training():
    _check("hsdp", moe=False)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.distributed(world_size=4, timeout=300)
def test_lora_under_tensor_parallel_matches_single_process_training(moe):
    _check("tp", moe)
