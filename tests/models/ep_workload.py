"""A tiny Qwen3-MoE, its data and a training loop shared by the expert-parallel tests and their references.

The reference is one process training on the whole global batch; the parallel run gives each data rank its rows of
every micro-batch. Both divide the summed token losses by the step's global token count, clip to a global norm of
1 and take AdamW steps (per-parameter loop: the parallel side holds DTensors on two meshes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tiny import EAGER, MOE_HF
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.core.dist import DistributedContext
from d9d.core.loop.reduce import sum_tensors_over
from d9d.models import materialize_
from d9d.models.blocks.late_init import init_normal_
from d9d.models.blocks.moe import MoELayer, TopKRouter
from d9d.models.qwen3 import Qwen3MoeForCausalLM, qwen3_moe_parameters_from_hf
from d9d.parallel import clip_grad_norm_

VOCAB = MOE_HF["vocab_size"]
PARAMS = qwen3_moe_parameters_from_hf(
    {
        **MOE_HF,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_hidden_layers": 2,
        "mlp_only_layers": [],
        "moe_intermediate_size": 16,
    }
)
GLOBAL_BATCH, SEQ, MICROBATCHES, LR = 8, 8, 2, 3e-3
ROUTER_STD = 0.5  # spread router logits so the k-th and (k+1)-th expert of a token are far apart (no near-ties)
MIN_TOP_K_GAP = 5e-5  # logits; the runs differ in them by far less (parameters agree to ~1e-6)


@dataclass
class Trace:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    loads: list[torch.Tensor] = field(default_factory=list)  # per step: routed copies per global expert, all layers
    min_gap: float = float("inf")


def build_meta(config=EAGER) -> Qwen3MoeForCausalLM:
    with torch.device("meta"):
        return Qwen3MoeForCausalLM(PARAMS, config=config)


def materialize_with_spread_routers(model: nn.Module, seed: int = 7, device: str | torch.device = "cpu") -> None:
    """Initialise like a single process would (same seed), then draw the router weights wider, layout-independent
    (on one device type: CUDA draws other numbers than the CPU)."""
    torch.manual_seed(seed)
    materialize_(model, device)
    torch.manual_seed(seed + 1)
    for module in model.modules():
        if isinstance(module, TopKRouter):
            init_normal_(module.weight, ROUTER_STD)


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + micro)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH // MICROBATCHES, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (GLOBAL_BATCH // MICROBATCHES, SEQ), generator=generator)
    labels[0, : SEQ // 2] = -100
    return ids, labels


def step_tokens(step: int) -> int:
    return sum(int((batch(step, micro)[1] != -100).sum()) for micro in range(MICROBATCHES))


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    trainable = [param for param in model.parameters() if param.requires_grad]
    return torch.optim.AdamW(trainable, lr=LR, weight_decay=0.1, foreach=False)


def record_top_k_gaps(model: nn.Module, trace: Trace) -> list[torch.utils.hooks.RemovableHandle]:
    """Track the smallest gap between a token's k-th and (k+1)-th router logit (ties would make parity luck).

    Logits, not scores: selection is monotonic in them, and they are what summation-order noise perturbs.
    """

    def hook(module: nn.Module, _inputs: object, output: object) -> None:
        logits = output.logits.detach()  # type: ignore[attr-defined]
        top = torch.topk(logits, module.top_k + 1, dim=-1).values  # type: ignore[arg-type]
        trace.min_gap = min(trace.min_gap, float((top[:, -2] - top[:, -1]).min()))

    return [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, TopKRouter)]


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: range,
    *,
    ctx: DistributedContext | None = None,
    sync=None,
    trace: Trace | None = None,
) -> Trace:
    """Run `steps`; with `ctx`, this rank trains on its data rank's rows and losses are summed over data ranks."""
    trace = trace or Trace()
    dp_rank, dp_size = (0, 1)
    if ctx is not None:
        dp_rank = ctx.coordinate("batch")["dp"]
        dp_size = ctx.degrees.dp
    rows_per_rank = GLOBAL_BATCH // MICROBATCHES // dp_size
    params = [param for param in model.parameters() if param.requires_grad]
    device = params[0].device  # the batches are drawn on the CPU (the same numbers everywhere) and moved there
    for step in steps:
        tokens = step_tokens(step)
        if sync is not None:
            sync.begin_step(MICROBATCHES)
        else:
            optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for micro in range(MICROBATCHES):
            ids, labels = batch(step, micro)
            rows = slice(dp_rank * rows_per_rank, (dp_rank + 1) * rows_per_rank)
            loss = model(ids[rows].to(device), labels=labels[rows].to(device)).losses.sum() / tokens
            loss.backward()
            loss_sum += loss.detach()
        if sync is not None:
            sync.wait()
            norm = clip_grad_norm_(params, 1.0)
            torch.distributed.all_reduce(loss_sum, group=ctx.mesh_for("batch")["dp"].get_group())
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        layers = [module for module in model.modules() if isinstance(module, MoELayer)]
        loads = torch.stack([layer.tokens_per_expert for layer in layers])
        if ctx is not None:  # what the Trainer does before a bias update: sum over the data ranks
            loads = sum_tensors_over({"loads": loads}, ctx.mesh_for("batch")["dp"].get_group())["loads"]
        trace.loads.append(loads.reshape(len(layers), -1).clone())
        for layer in layers:
            layer.reset_load()
        trace.losses.append(float(loss_sum))
        trace.grad_norms.append(float(norm))
    return trace


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
