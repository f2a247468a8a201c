"""Small models, data and a single-process reference for the data-parallel parity tests.

Imported by the tests in this directory (pytest puts it on sys.path). The reference is plain PyTorch: one process,
the whole global batch in one backward, AdamW. Mixed precision in the reference means what every d9d data-parallel
style means by it: float32 master parameters, forward and backward with parameters and inputs cast to bfloat16,
gradients arriving in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional

from d9d.core.dist import DistributedContext, MeshDegrees, MeshDomain
from d9d.parallel import (
    FsdpConfig,
    HsdpConfig,
    MixedPrecisionConfig,
    ReplicateConfig,
    build_data_parallel,
    clip_grad_norm_,
)

D_IN, D_MODEL, SEQ, HEADS = 16, 16, 8, 2
STEPS, MICROBATCHES, GLOBAL_BATCH = 20, 2, 16
LR, WEIGHT_DECAY = 1e-2, 0.1

# By bf16 (mixed precision) or not; the reasoning is in test_data_parallel_parity.py's docstring.
TOLERANCES = {
    False: {"loss": 1e-5, "grad_norm": 1e-5, "params": 1e-5, "params_abs": 1e-5},
    True: {"loss": 2e-3, "grad_norm": 5e-3, "params": 2.5e-2, "params_abs": float("inf")},
}


class TinyMLP(nn.Module):
    """Per-token MLP; 37 hidden units so FSDP shards unevenly over 4 ranks (10, 10, 10, 7 rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D_IN, 37)
        self.down = nn.Linear(37, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(functional.gelu(self.up(x)))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No bias: the key bias would get an exactly-zero gradient (softmax ignores a per-query constant), and Adam
        # would turn its rounding noise into full-size updates that no two summation orders agree on.
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
        self.out = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, HEADS, D_MODEL // HEADS).permute(2, 0, 3, 1, 4)
        attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, seq, D_MODEL))


class TinyBlock(nn.Module):
    """Pre-norm transformer block: attention and a 36-wide MLP (9 rows per rank under FSDP on 4 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(D_MODEL)
        self.attn = Attention()
        self.norm2 = nn.LayerNorm(D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 36), nn.GELU(), nn.Linear(36, D_MODEL))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


# FSDP units of each model, by name (never by class).
UNITS = {"mlp": ["up", "down"], "block": ["attn", "mlp"]}


def make_model(kind: str, device: torch.device | str = "cpu") -> nn.Module:
    torch.manual_seed(1234)
    model = TinyMLP() if kind == "mlp" else TinyBlock()
    for param in model.parameters():  # LayerNorm starts at (1, 0); perturb so every parameter matters
        param.data.add_(0.05 * torch.randn_like(param))
    return model.to(device)


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # [B, SEQ, D_IN]
    targets: torch.Tensor  # [B, SEQ, D_MODEL]
    mask: torch.Tensor  # [B, SEQ] bool: which tokens count; lengths vary per sample

    def rows(self, start: int, stop: int) -> Batch:
        return Batch(self.inputs[start:stop], self.targets[start:stop], self.mask[start:stop])

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.inputs.to(device), self.targets.to(device), self.mask.to(device))

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


def make_batches(
    steps: int = STEPS, global_batch: int = GLOBAL_BATCH, device: torch.device | str = "cpu"
) -> list[Batch]:
    generator = torch.Generator().manual_seed(99)
    batches = []
    for _ in range(steps):
        lengths = torch.randint(1, SEQ + 1, (global_batch,), generator=generator)
        batches.append(
            Batch(
                inputs=torch.randn(global_batch, SEQ, D_IN, generator=generator),
                targets=torch.randn(global_batch, SEQ, D_MODEL, generator=generator),
                mask=torch.arange(SEQ)[None, :] < lengths[:, None],
            ).to(device)
        )
    return batches


def loss_sum(output: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Sum over counted tokens of the per-token squared error, in float32 (divide by the global token count)."""
    per_token = (output.float() - batch.targets).pow(2).sum(-1)
    return (per_token * batch.mask).sum()


@dataclass(frozen=True)
class StepRecord:
    loss: float
    grad_norm: float
    params: dict[str, torch.Tensor]


def max_norm_for(kind: str) -> float:
    """Small enough that clipping is active on most steps, so a wrong norm changes the trajectory."""
    return 0.5 if kind == "mlp" else 1.0


def reference_run(kind: str, *, bf16: bool, device: torch.device | str = "cpu") -> list[StepRecord]:
    model = make_model(kind, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    records = []
    for batch in make_batches(device=device):
        optimizer.zero_grad()
        if bf16:
            cast = {name: param.to(torch.bfloat16) for name, param in model.named_parameters()}
            output = torch.func.functional_call(model, cast, (batch.inputs.to(torch.bfloat16),))
        else:
            output = model(batch.inputs)
        loss = loss_sum(output, batch) / batch.tokens
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm_for(kind))
        optimizer.step()
        records.append(
            StepRecord(
                loss=loss.item(),
                grad_norm=norm.item(),
                params={name: param.detach().clone() for name, param in model.named_parameters()},
            )
        )
    return records


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual = actual.detach()
    return float((actual.float() - expected.float()).norm() / max(expected.float().norm().item(), 1e-12))


def close(actual: float, expected: float, rtol: float) -> bool:
    return math.isclose(actual, expected, rel_tol=rtol, abs_tol=rtol * 1e-3)


@dataclass(frozen=True)
class Deviation:
    """Largest step-wise deviation of a distributed run from the reference over all steps."""

    loss: float  # relative
    grad_norm: float  # relative
    params: float  # relative L2 error of a parameter tensor, worst tensor and step
    params_abs: float  # largest absolute element error

    def describe(self) -> str:
        return (
            f"loss rel {self.loss:.2e}, grad-norm rel {self.grad_norm:.2e}, "
            f"param rel-L2 {self.params:.2e}, param max-abs {self.params_abs:.2e}"
        )


def train_data_parallel(kind: str, strategy: str, *, bf16: bool, world_size: int = 4) -> Deviation:
    """Run the workload under `strategy` on the current group (gloo on CPU, or NCCL when D9D_DEVICE=cuda); return
    its deviation from the single-process reference."""
    mixed = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32") if bf16 else None
    degrees, config = {
        "replicate": (MeshDegrees(dp_replicate=world_size), ReplicateConfig(mixed_precision=mixed)),
        "fsdp": (MeshDegrees(dp_shard=world_size), FsdpConfig(units=UNITS[kind], mixed_precision=mixed)),
        "hsdp": (
            MeshDegrees(dp_replicate=2, dp_shard=world_size // 2),
            HsdpConfig(units=UNITS[kind], mixed_precision=mixed),
        ),
    }[strategy]
    ctx = DistributedContext.build(degrees)
    mesh = ctx.mesh_for(MeshDomain.DENSE)["dp_replicate", "dp_cp_shard"]
    reference = reference_run(kind, bf16=bf16, device=ctx.device)

    model = make_model(kind, ctx.device)
    sync = build_data_parallel(config, model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    dp_rank, dp_size = ctx.coordinate(MeshDomain.BATCH)["dp"], ctx.degrees.dp
    local = GLOBAL_BATCH // dp_size
    micro = local // MICROBATCHES
    worst = {"loss": 0.0, "grad_norm": 0.0, "params": 0.0, "params_abs": 0.0}
    for step, batch in enumerate(make_batches(device=ctx.device)):
        shard = batch.rows(dp_rank * local, (dp_rank + 1) * local)
        global_tokens = torch.tensor(float(shard.tokens), device=ctx.device)
        dist.all_reduce(global_tokens)  # the exact token count of the step, over every data-parallel rank
        sync.begin_step(MICROBATCHES)
        step_loss = torch.zeros((), device=ctx.device)
        for index in range(MICROBATCHES):
            microbatch = shard.rows(index * micro, (index + 1) * micro)
            loss = loss_sum(model(microbatch.inputs), microbatch) / global_tokens
            loss.backward()
            step_loss += loss.detach()
        sync.wait()
        norm = clip_grad_norm_(model.parameters(), max_norm_for(kind))
        optimizer.step()
        dist.all_reduce(step_loss)

        expected = reference[step]
        worst["loss"] = max(worst["loss"], abs(step_loss.item() - expected.loss) / abs(expected.loss))
        worst["grad_norm"] = max(worst["grad_norm"], abs(norm.item() - expected.grad_norm) / expected.grad_norm)
        for name, param in model.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            worst["params"] = max(worst["params"], relative_error(full, expected.params[name]))
            worst["params_abs"] = max(worst["params_abs"], (full.detach() - expected.params[name]).abs().max().item())
    ctx.close()
    return Deviation(**worst)
