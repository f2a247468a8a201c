"""Batched autoregressive decoding with a static-shape KV cache: one prefill forward, then one token per step.

Rows are left-aligned: a batch of prompts becomes `(batch, prompt_len)` with padding in front, and each row's
positions count from its own first token, so every row writes the same cache slot at each step and the decode
forward has the same shapes every step (`compile=True` compiles it once per generation). Stopping is per row
(stop token ids, stop strings through a `decode` callback, `max_new_tokens`); the loop ends when every row has
stopped, on every rank of `process_group` when one is given (a sharded model's ranks must run the same number of
forwards, since each forward gathers parameters).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from d9d.models.generation.cache import allowed_slots, attach_kv_cache
from d9d.models.generation.sampling import SamplingConfig, next_tokens
from d9d.parallel import compute_device


class GenerationConfig(BaseModel):
    """How to continue prompts. `seed` seeds the `torch.Generator` that sampling draws from, so a generation is
    reproducible; `pad_token_id` fills padding and finished rows (never read); `compile` compiles the decode step
    with `torch.compile` (worth it on GPU; the shapes are static)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(gt=0)
    sampling: SamplingConfig = SamplingConfig()
    stop_token_ids: list[int] = Field(default_factory=list)
    stop_strings: list[str] = Field(default_factory=list)
    seed: int = 0
    pad_token_id: int = Field(default=0, ge=0)
    compile: bool = False


class FinishReason(enum.StrEnum):
    STOP_TOKEN = "stop_token"  # noqa: S105 (a finish reason, not a secret)
    STOP_STRING = "stop_string"
    LENGTH = "length"


@dataclass(frozen=True)
class GenerationResult:
    """Per row: `tokens` generated (a stop token included, as `transformers` does), `texts` decoded and cut before
    the first stop string (when a `decode` callback was given), why it stopped; `logits` `(batch, steps, vocab)`
    float32 of every step (rows past their stop hold the padding steps' logits) when asked for."""

    tokens: list[list[int]]
    finish_reasons: list[FinishReason]
    texts: list[str] | None = None
    logits: torch.Tensor | None = None


def _prompt_rows(
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    prompt_lengths: Sequence[int] | torch.Tensor | None,
    padding_side: Literal["left", "right"],
) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        if prompts.ndim != 2:
            raise ValueError(f"prompts must be (batch, seq) token ids, got shape {tuple(prompts.shape)}")
        width = prompts.shape[1]
        lengths = [width] * prompts.shape[0] if prompt_lengths is None else [int(n) for n in prompt_lengths]
        if len(lengths) != prompts.shape[0] or any(not 0 < n <= width for n in lengths):
            raise ValueError(f"prompt_lengths={lengths} must give one length in [1, {width}] per row")
        table = prompts.tolist()
        if padding_side == "left":
            return [row[width - n :] for row, n in zip(table, lengths, strict=True)]
        return [row[:n] for row, n in zip(table, lengths, strict=True)]
    if prompt_lengths is not None:
        raise ValueError("prompt_lengths applies to a padded prompt tensor; lists of token ids carry their length")
    rows = [list(row) for row in prompts]
    if not rows or any(len(row) == 0 for row in rows):
        raise ValueError("prompts must be a non-empty batch of non-empty token id sequences")
    return rows


def _left_aligned(rows: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(batch, prompt_len)` ids with padding in front, and each row's first real slot."""
    prompt_len = max(len(row) for row in rows)
    ids = torch.full((len(rows), prompt_len), pad, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, prompt_len - len(row) :] = torch.tensor(row, dtype=torch.long)
    start = torch.tensor([prompt_len - len(row) for row in rows])
    return ids.to(device), start.to(device)


def _check_supported(model: nn.Module, config: GenerationConfig, decode: Callable[[list[int]], str] | None) -> None:
    if config.stop_strings and decode is None:
        raise ValueError(f"stop_strings={config.stop_strings} need a decode callback to turn tokens into text")
    check_whole_sequences(model)


def check_whole_sequences(model: nn.Module) -> None:
    """Refuse a model whose ranks split sequences. A decode step feeds one token per row (and scoring any length),
    so context parallelism (each rank holds a shard of every sequence) and sequence parallelism (tensor parallelism's
    training layout) cannot run it; tensor parallelism with replicated activations can.

    Raises:
        NotImplementedError: naming the module that splits sequences and how to parallelize instead.
    """
    for name, module in model.named_modules():
        where = name or "the model"
        if getattr(module, "sequence_sharded", False):
            raise NotImplementedError(
                f"generation does not support context-parallel models: {where} holds a shard of every sequence "
                "(cp > 1), and a decode step has one token per row to split; parallelize the model for generation "
                "with cp=1 (tp and FSDP/HSDP data parallelism are supported)"
            )
        mesh = getattr(module, "sequence_parallel_mesh", None)
        if mesh is not None:
            raise NotImplementedError(
                f"generation needs tensor parallelism without sequence parallelism: {where} splits its activations "
                f"along the sequence over tp={mesh.size()}, and a decode step has one token per row; parallelize "
                "with tensor_parallel=TensorParallelConfig(sequence_parallel=False) (same parameter layout, so the "
                "same checkpoint loads)"
            )


def _tensor_parallel_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The `tp` group of a tensor-parallel model (its ranks hold slices of the same layers), else None."""
    for parameter in model.parameters():
        mesh = getattr(parameter, "device_mesh", None)
        names = getattr(mesh, "mesh_dim_names", None) or ()
        if mesh is not None and "tp" in names and mesh.size(names.index("tp")) > 1:
            group: dist.ProcessGroup = mesh.get_group("tp")
            return group
    return None


def _check_same_on_tp_ranks(
    model: nn.Module, rows: list[list[int]], config: GenerationConfig, device: torch.device
) -> None:
    """The ranks of a tensor-parallel model's `tp` group compute one generation together: they must be given the
    same prompts and config (a mismatch would otherwise hang or silently mix rows)."""
    group = _tensor_parallel_group(model)
    if group is None:
        return
    text = repr((rows, config.model_dump(mode="json")))
    digest = torch.tensor(
        [int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")], device=device
    )
    lowest, highest = digest.clone(), digest.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
    if int(lowest) != int(highest):
        raise ValueError(
            f"the tp ranks {dist.get_process_group_ranks(group)} were given different prompts or generation configs; "
            "tensor-parallel ranks generate the same rows together (give each data-parallel rank its own prompts, "
            "the same on all of its tp ranks)"
        )


def _model_device(model: nn.Module) -> torch.device:
    # Not the first parameter's device: CPU-offloaded FSDP keeps CPU shards of a GPU mesh, and computes on the GPU.
    return compute_device(model)


def _last_logits(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    logits = model(ids, position_ids=positions).logits
    if logits is None:
        raise ValueError("generation needs the whole model (a pipeline stage without the LM head has no logits)")
    last: torch.Tensor = logits[:, -1].float()
    return last


def _all_stopped(done: torch.Tensor, process_group: dist.ProcessGroup | None) -> bool:
    running = (~done).sum()
    if process_group is not None:
        dist.all_reduce(running, group=process_group)
    return int(running.item()) == 0


def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    config: GenerationConfig,
    *,
    prompt_lengths: Sequence[int] | torch.Tensor | None = None,
    padding_side: Literal["left", "right"] = "left",
    decode: Callable[[list[int]], str] | None = None,
    process_group: dist.ProcessGroup | None = None,
    return_logits: bool = False,
) -> GenerationResult:
    """Continue each prompt (a list of token-id lists, or a padded `(batch, seq)` tensor with `prompt_lengths` and
    its `padding_side`) with `model`, a whole causal LM from the catalogue. A sharded model works: FSDP/HSDP (pass
    `process_group`, every rank that joins the model's collectives, so they all run the same number of forwards)
    and tensor parallelism without sequence parallelism (`TensorParallelConfig(sequence_parallel=False)`; the ranks
    of a `tp` group must be given the same prompts and config, and get the same tokens: every rank samples from the
    same gathered full-vocabulary logits with the same seeded generator)."""
    _check_supported(model, config, decode)
    rows = _prompt_rows(prompts, prompt_lengths, padding_side)
    device = _model_device(model)
    _check_same_on_tp_ranks(model, rows, config, device)
    ids, start = _left_aligned(rows, config.pad_token_id, device)
    batch, prompt_len = ids.shape
    max_len = prompt_len + config.max_new_tokens
    prompt_slots = torch.arange(prompt_len, device=device)
    positions = (prompt_slots[None, :] - start[:, None]).clamp(min=0)

    generator = torch.Generator(device=device).manual_seed(config.seed)
    stop_ids = torch.tensor(config.stop_token_ids, dtype=torch.long, device=device)
    checks_stops = bool(config.stop_token_ids or config.stop_strings)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    reasons = [FinishReason.LENGTH] * batch
    kept_steps = [config.max_new_tokens] * batch  # tokens each row keeps (through its stop)
    chosen: list[torch.Tensor] = []
    step_logits: list[torch.Tensor] = []
    step = torch.compile(_last_logits, dynamic=False) if config.compile else _last_logits

    with torch.no_grad(), attach_kv_cache(model, batch=batch, max_len=max_len) as state:
        state.slots, state.allowed = prompt_slots, allowed_slots(start, prompt_slots, max_len)
        logits = _last_logits(model, ids, positions)  # prefill: eager, its shape differs per batch of prompts
        if state.step_slots is None or state.step_allowed is None or state.step_slots.device != device:
            state.step_slots = torch.zeros(1, dtype=torch.long, device=device)
            state.step_allowed = allowed_slots(start, state.step_slots, max_len)
        state.slots, state.allowed = state.step_slots, state.step_allowed
        for index in range(config.max_new_tokens):
            if return_logits:
                step_logits.append(logits)
            token = torch.where(done, config.pad_token_id, next_tokens(logits, config.sampling, generator))
            chosen.append(token)
            if checks_stops:
                newly = ~done & torch.isin(token, stop_ids)
                if config.stop_strings and decode is not None:
                    newly |= _hits_stop_string(torch.stack(chosen, dim=1), done, config.stop_strings, decode)
                for row in newly.nonzero().flatten().tolist():
                    hit_token = int(token[row]) in config.stop_token_ids
                    reasons[row] = FinishReason.STOP_TOKEN if hit_token else FinishReason.STOP_STRING
                    kept_steps[row] = index + 1
                done |= newly
            last_step = index + 1 == config.max_new_tokens
            # Without stop conditions nothing can end early: skip the per-step host sync.
            if last_step or ((checks_stops or process_group is not None) and _all_stopped(done, process_group)):
                break
            slot = prompt_len + index
            state.slots.fill_(slot)  # in place: the compiled step sees the same tensors every time
            state.allowed.copy_(allowed_slots(start, state.slots, max_len))
            logits = step(model, token[:, None], (slot - start)[:, None])

    tokens = torch.stack(chosen, dim=1).tolist()
    kept = [row[:steps] for row, steps in zip(tokens, kept_steps, strict=True)]
    texts = None
    if decode is not None:
        texts = [_cut_at_stop_string(decode(row), config.stop_strings) for row in kept]
    return GenerationResult(
        tokens=kept,
        finish_reasons=reasons,
        texts=texts,
        logits=torch.stack(step_logits, dim=1) if return_logits else None,
    )


def _hits_stop_string(
    tokens: torch.Tensor, done: torch.Tensor, stops: list[str], decode: Callable[[list[int]], str]
) -> torch.Tensor:
    """`(batch,)` whether each running row's decoded continuation now contains one of `stops`."""
    hits = torch.zeros_like(done)
    for row, ids in enumerate(tokens.tolist()):
        if not bool(done[row]) and any(stop in decode(ids) for stop in stops):
            hits[row] = True
    return hits


def _cut_at_stop_string(text: str, stops: list[str]) -> str:
    cut = min((text.index(stop) for stop in stops if stop in text), default=len(text))
    return text[:cut]
