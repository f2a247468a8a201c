"""The static-capacity all-to-all dispatcher on real gloo groups: against the all-to-all dispatcher when nothing is
dropped (bit-equal rows, outputs and gradients: the same rows move and the same weighted sums run in the same order),
against a one-process reference that drops the same copies when the capacity is small, and compiled in one graph.

Every rank dispatches the same number of tokens (the capacity dispatcher's contract); rank 1 routes nothing (all its
copies are `-1`), experts 3 and 6 get no tokens, and one copy of another rank is dropped upstream (`-1`).
"""

import math

import pytest
import torch
import torch.distributed as dist
from dispatch_cases import HIDDEN, NUM_EXPERTS, SILENT_RANK, dispatch_and_combine, expert_scale, routing
from pydantic import ValidationError

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.kernels.expert_dispatch import (
    EXPERT_DISPATCH_CONFIG_ADAPTER,
    AllToAllCapacityDispatchConfig,
    AllToAllCapacityDispatcher,
    AllToAllDispatcher,
    build_token_dispatcher,
    pair_capacity,
    resolve_expert_dispatch_config,
)
from d9d.kernels.expert_dispatch.capacity import token_count_mismatch_message

TOP_K, TOKENS = 2, 12


def _routing(rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return routing(rank, seed, tokens=TOKENS, top_k=TOP_K)


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.distributed(world_size=4, timeout=120)
def test_without_drops_it_equals_the_all_to_all_dispatcher_exactly(ep):
    ctx = DistributedContext.build(MeshDegrees(dp_shard=4, ep=ep))
    group = ctx.mesh_for("expert")["ep"].get_group()
    # capacity_factor = ep: C >= T * k, so no copy can be over capacity whatever the routing.
    capacity = AllToAllCapacityDispatcher(group, NUM_EXPERTS, capacity_factor=float(ep))
    reference = AllToAllDispatcher(group, NUM_EXPERTS)
    first_local = dist.get_rank(group) * capacity.num_local_experts
    for seed in range(3):
        x, indices, weights = _routing(ctx.rank, seed)
        upstream = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed + 10 * ctx.rank))
        out, dispatched, grads = dispatch_and_combine(capacity, x, indices, weights, first_local, upstream)
        ref_out, ref_dispatched, ref_grads = dispatch_and_combine(reference, x, indices, weights, first_local, upstream)
        num_rows = ep * pair_capacity(TOKENS, TOP_K, ep, float(ep))
        assert dispatched.rows.shape == (num_rows, HIDDEN)
        valid = ref_dispatched.rows.shape[0]
        # Same rows in the same order (local expert, source rank, token), then zero padding outside every group.
        assert torch.equal(dispatched.rows[:valid], ref_dispatched.rows)
        assert not dispatched.rows[valid:].any()
        assert torch.equal(dispatched.group_sizes, ref_dispatched.group_sizes)
        # Identity experts give back sum_k w_k x; with scaled experts, outputs and gradients are the reference's.
        assert torch.equal(out, ref_out)
        for got, want in zip(grads, ref_grads, strict=True):
            assert torch.equal(got, want)
        assert int(capacity.dropped_copies) == 0
        if ctx.rank == SILENT_RANK:
            assert not out.any()  # nothing routed: every token's expert output is zero


def _dropping_reference(
    all_indices: list[torch.Tensor], num_ranks: int, capacity: int
) -> tuple[list[torch.Tensor], int]:
    """Per source rank, its `expert_indices` with every copy beyond the first `capacity` (in (token, slot) order) to
    each destination rank set to -1, and the number dropped: the documented rule, written as a plain loop."""
    num_local = NUM_EXPERTS // num_ranks
    kept, dropped = [], 0
    for indices in all_indices:
        counts = [0] * num_ranks
        out = indices.clone()
        for token in range(indices.shape[0]):
            for slot in range(indices.shape[1]):
                expert = int(indices[token, slot])
                if expert < 0:
                    continue
                dest = expert // num_local
                if counts[dest] >= capacity:
                    out[token, slot] = -1
                    dropped += 1
                counts[dest] += 1
        kept.append(out)
    return kept, dropped


@pytest.mark.distributed(world_size=4, timeout=120)
def test_over_capacity_copies_are_dropped_like_a_single_process_reference():
    ctx = DistributedContext.build(MeshDegrees(dp_shard=4, ep=4))
    group = ctx.mesh_for("expert")["ep"].get_group()
    # T * k / ep = 20 copies per destination on average, C = 32 at factor 1. Skewed routing (every rank sends most
    # copies to experts 0 and 1, rank 0's) overflows each rank's block for rank 0.
    tokens, capacity_factor = 40, 1.0
    capacity = pair_capacity(tokens, TOP_K, 4, capacity_factor)
    assert capacity == 32  # ceil(1.0 * 40 * 2 / 4) = 20, rounded up to 32
    dispatcher = build_token_dispatcher(
        AllToAllCapacityDispatchConfig(capacity_factor=capacity_factor), group=group, num_experts=NUM_EXPERTS
    )
    assert isinstance(dispatcher, AllToAllCapacityDispatcher)
    all_indices, all_x, all_w = [], [], []
    for rank in range(4):
        generator = torch.Generator().manual_seed(rank)
        skewed = torch.stack([torch.tensor([0, 1])[torch.randperm(2, generator=generator)] for _ in range(tokens)])
        spread = torch.randint(0, NUM_EXPERTS, (tokens, TOP_K), generator=generator)
        pick = torch.rand(tokens, 1, generator=generator) < 0.6
        indices = torch.where(pick, skewed, spread)
        indices[:, 1] = torch.where(indices[:, 1] == indices[:, 0], (indices[:, 0] + 1) % NUM_EXPERTS, indices[:, 1])
        all_indices.append(indices)
        all_x.append(torch.randn(tokens, HIDDEN, generator=generator))
        all_w.append(torch.softmax(torch.randn(tokens, TOP_K, generator=generator), dim=-1))
    kept, expected_dropped = _dropping_reference(all_indices, 4, capacity)
    assert expected_dropped > 0, "the skewed routing must overflow a block"
    x = all_x[ctx.rank].clone().requires_grad_(True)
    w = all_w[ctx.rank].clone().requires_grad_(True)
    dispatched = dispatcher.dispatch(x, all_indices[ctx.rank], w)
    scale = expert_scale(dispatched.group_sizes, ctx.rank * 2, dispatched.rows.shape[0])
    out = dispatcher.combine(dispatched.rows * scale, dispatched)
    upstream = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(99 + ctx.rank))
    grads = torch.autograd.grad((out * upstream).sum(), (x, w))
    # Reference: the same arithmetic in one process on the kept copies (dropped ones add zero).
    mine = kept[ctx.rank]
    ref_x = all_x[ctx.rank].clone().requires_grad_(True)
    ref_w = all_w[ctx.rank].clone().requires_grad_(True)
    scale_ref = torch.where(mine >= 0, mine.float() + 1.0, torch.zeros_like(mine, dtype=torch.float32))
    expected = (ref_x[:, None, :] * scale_ref[..., None] * ref_w[..., None]).sum(dim=1)
    ref_grads = torch.autograd.grad((expected * upstream).sum(), (ref_x, ref_w))
    # float32: the weighted sums of k = 2 terms round alike; the scale product is exact in one case and not the
    # other only through the order of two multiplications (1 ulp).
    torch.testing.assert_close(out, expected.detach(), rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    dropped = dispatcher.dropped_copies.clone()
    assert dropped.device == x.device
    dist.all_reduce(dropped)
    assert int(dropped) == expected_dropped


@pytest.mark.distributed(world_size=2, timeout=180)
def test_dispatch_and_combine_compile_into_one_graph_that_serves_every_routing():
    # No host copy and static shapes: the whole exchange traces (fullgraph), and new routings reuse the graph.
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2, ep=2))
    dispatcher = AllToAllCapacityDispatcher(ctx.mesh_for("expert")["ep"].get_group(), NUM_EXPERTS, 2.0)

    def exchange(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        dispatched = dispatcher.dispatch(x.sin(), indices, weights)
        return dispatcher.combine(dispatched.rows * 3.0 + 1.0, dispatched).cos()

    compiled = torch.compile(exchange, backend="aot_eager", fullgraph=True)
    for seed in range(3):
        x, indices, weights = _routing(ctx.rank, seed)
        x.requires_grad_(True)
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):
            got = compiled(x, indices, weights)
        expected = exchange(x, indices, weights)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        (grad,) = torch.autograd.grad(got.sum(), x)
        (want,) = torch.autograd.grad(expected.sum(), x)
        torch.testing.assert_close(grad, want, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


@pytest.mark.distributed(world_size=2, timeout=120)
def test_ranks_dispatching_different_token_counts_are_refused_before_the_exchange():
    # The pair capacity derives from T, so ranks with different T would exchange blocks of different sizes (a hang on
    # NCCL). T travels with the counts, and every rank refuses before the rows move (an asynchronous device assert on
    # a GPU; on the CPU it raises at once, naming T).
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2, ep=2))
    group = ctx.mesh_for("expert")["ep"].get_group()
    dispatcher = AllToAllCapacityDispatcher(group, NUM_EXPERTS)
    tokens = TOKENS + 4 * ctx.rank
    x, indices, weights = _routing(0, seed=5)
    x, indices, weights = x.repeat(2, 1)[:tokens], indices.repeat(2, 1)[:tokens], weights.repeat(2, 1)[:tokens]
    with pytest.raises(RuntimeError, match=rf"T={tokens} tokens and another rank.*a different T"):
        dispatcher.dispatch(x, indices, weights)
    same = dispatcher.dispatch(x[:TOKENS], indices[:TOKENS], weights[:TOKENS])  # the group still works afterwards
    received = same.group_sizes.sum()
    dist.all_reduce(received, group=group)
    assert int(received) == 2 * int((indices[:TOKENS] >= 0).sum())  # both ranks routed the same copies


def test_the_token_count_message_fits_cudas_device_assert():
    # CUDA's `_assert_async` raises "Message length must be smaller than 255" before it checks anything (gloo and
    # the CPU accept any length), so a long message would break every NCCL dispatch; the largest T still fits.
    assert len(token_count_mismatch_message(2**62)) < 255


def test_capacity_rounds_up_to_the_alignment():
    assert pair_capacity(4096 * 2, 8, 4, 2.0) == 32768
    assert pair_capacity(10, 2, 4, 1.0) == 16
    assert pair_capacity(100, 2, 2, 1.5) == 160  # ceil(150) -> 160
    assert pair_capacity(0, 8, 4, 2.0) == 0


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_bad_capacity_factor_names_the_field_and_the_value(bad):
    with pytest.raises(ValidationError, match="capacity_factor"):
        AllToAllCapacityDispatchConfig(capacity_factor=bad)
    with pytest.raises(ValueError, match=rf"capacity_factor must be a finite number > 0.*capacity_factor={bad!r}"):
        pair_capacity(8, 2, 2, bad)


def test_selected_by_config_and_environment_but_never_by_detection(monkeypatch):
    from d9d.kernels import Capabilities

    cpu = Capabilities(device_type="cpu")
    monkeypatch.delenv("D9D_BACKEND_AUTO_EXPERT_DISPATCH", raising=False)
    assert resolve_expert_dispatch_config(capabilities=cpu).kind == "all_to_all"
    monkeypatch.setenv("D9D_BACKEND_AUTO_EXPERT_DISPATCH", '{"kind": "all_to_all_capacity", "capacity_factor": 1.5}')
    assert resolve_expert_dispatch_config(capabilities=cpu) == AllToAllCapacityDispatchConfig(capacity_factor=1.5)
    explicit = AllToAllCapacityDispatchConfig()
    assert explicit.capacity_factor == 2.0
    assert EXPERT_DISPATCH_CONFIG_ADAPTER.validate_json('{"kind": "all_to_all_capacity"}') == explicit
    monkeypatch.setenv("D9D_BACKEND_AUTO_EXPERT_DISPATCH", '{"kind": "all_to_all_capacity", "capacity_factor": 0}')
    with pytest.raises(ValueError, match="capacity_factor"):
        resolve_expert_dispatch_config(capabilities=cpu)
