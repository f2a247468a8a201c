"""Expert dispatch on real gloo groups: the all-to-all dispatcher against the local permute path, and selection.

The local reference is the same arithmetic in one process: every rank's tokens, each copy multiplied by a scale
of its expert, weighted and summed. Dispatch only moves rows and combine only moves them back and applies the same
weights, so float32 results agree to rounding of the weighted sums (1e-6).
"""

import importlib.util

import pytest
import torch
import torch.distributed as dist

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.kernels import BackendUnavailable, Capabilities
from d9d.kernels.expert_dispatch import (
    AllToAllDispatchConfig,
    AllToAllDispatcher,
    DeepEpDispatchConfig,
    build_token_dispatcher,
    detect_expert_dispatch_config,
    gather_sorted_rows,
    permute_rows,
    resolve_expert_dispatch_config,
    sort_by_expert,
    weighted_unsort,
)

NUM_EXPERTS, TOP_K, HIDDEN = 8, 2, 6
# Experts 3 and 6 are never chosen; rank 1 has no tokens at all (it sends nothing but still receives and computes).
TOKENS_PER_RANK = [5, 0, 9, 3]
UNUSED = (3, 6)


def _routing(rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    tokens = TOKENS_PER_RANK[rank]
    used = torch.tensor([e for e in range(NUM_EXPERTS) if e not in UNUSED])
    choices = [used[torch.randperm(len(used), generator=generator)[:TOP_K]] for _ in range(tokens)]
    indices = torch.stack(choices).long() if choices else torch.empty(0, TOP_K, dtype=torch.int64)
    if tokens >= 3:
        indices[2, 1] = -1  # a copy dropped by a capacity limit goes nowhere and adds nothing
    weights = torch.rand(tokens, TOP_K, generator=generator) + 0.1
    x = torch.randn(tokens, HIDDEN, generator=generator)
    return x, indices, weights / weights.sum(dim=-1, keepdim=True)


def _expert_scale(global_expert: torch.Tensor) -> torch.Tensor:
    return (global_expert.float() + 1.0)[:, None]


def _local_reference(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    scale = torch.where(indices >= 0, indices.float() + 1.0, torch.zeros_like(indices, dtype=torch.float32))
    return (x[:, None, :] * scale[..., None] * weights[..., None]).sum(dim=1)


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.distributed(world_size=4, timeout=120)
def test_all_to_all_dispatch_then_combine_matches_the_local_computation(ep):
    ctx = DistributedContext.build(MeshDegrees(dp_shard=4, ep=ep))
    group = ctx.mesh_for("expert")["ep"].get_group()
    dispatcher = AllToAllDispatcher(group, NUM_EXPERTS)
    ep_rank = dist.get_rank(group)
    first_local = ep_rank * dispatcher.num_local_experts
    for seed in range(3):
        x, indices, weights = _routing(ctx.rank, seed)
        x.requires_grad_(True)
        weights.requires_grad_(True)
        dispatched = dispatcher.dispatch(x, indices, weights)
        assert dispatched.group_sizes.shape == (dispatcher.num_local_experts,)
        # Identity experts: dispatch then combine gives back sum_k w_k x = x for tokens with no dropped copy.
        identity = dispatcher.combine(dispatched.rows, dispatched)
        kept = (indices >= 0).all(dim=-1)
        torch.testing.assert_close(identity[kept], x[kept].detach(), rtol=1e-6, atol=1e-6)
        # Expert e scales its rows by e + 1: checks every row reached the right expert and came back.
        local_expert = torch.repeat_interleave(
            torch.arange(dispatcher.num_local_experts), dispatched.group_sizes.long()
        )
        out = dispatcher.combine(dispatched.rows * _expert_scale(local_expert + first_local), dispatched)
        expected = _local_reference(x, indices, weights)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        # Backward runs the exchanges in reverse: gradients equal the local formula's.
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 10 * ctx.rank))
        grad_x, grad_w = torch.autograd.grad((out * upstream).sum(), (x, weights))
        ref_x, ref_w = torch.autograd.grad((expected * upstream).sum(), (x, weights))
        torch.testing.assert_close(grad_x, ref_x, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad_w, ref_w, rtol=1e-6, atol=1e-6)
        for unused in UNUSED:
            if first_local <= unused < first_local + dispatcher.num_local_experts:
                assert int(dispatched.group_sizes[unused - first_local]) == 0


@pytest.mark.distributed(world_size=2, timeout=120)
def test_rows_arrive_grouped_by_local_expert_from_every_source():
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2, ep=2))
    dispatcher = AllToAllDispatcher(ctx.mesh_for("expert")["ep"].get_group(), 4)
    # Each rank sends token t (value 10 * rank + t) to expert (t % 4): both ranks feed both ranks' experts.
    x = (10.0 * ctx.rank + torch.arange(4.0))[:, None]
    indices = (torch.arange(4) % 4)[:, None]
    dispatched = dispatcher.dispatch(x, indices, torch.ones(4, 1))
    first = 2 * ctx.rank
    assert dispatched.group_sizes.tolist() == [2, 2]
    # Local expert 0 gets token `first` from rank 0 then rank 1; local expert 1 token `first + 1` likewise.
    assert dispatched.rows[:, 0].tolist() == [first, 10 + first, first + 1, 11 + first]


@pytest.mark.distributed(world_size=2, timeout=120)
def test_compiled_code_around_the_exchange_compiles_once_for_every_routing():
    # dispatch and combine are graph breaks (their split sizes are host lists); what runs between them (here a
    # stand-in for experts) sees a row count that changes with the routing, marked dynamic so it compiles once.
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2, ep=2))
    dispatcher = AllToAllDispatcher(ctx.mesh_for("expert")["ep"].get_group(), NUM_EXPERTS)

    def exchange(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        dispatched = dispatcher.dispatch(x.sin(), indices, weights)
        # `x` is used after the break: Dynamo skips a resumed frame whose locals hold no tensor it can see.
        return dispatcher.combine(dispatched.rows * 3.0 + 1.0, dispatched).cos() + x

    compiled = torch.compile(exchange, backend="aot_eager")
    row_counts = set()
    for seed in range(4):
        x, indices, weights = _routing(2 + ctx.rank, seed)  # the ranks with 9 and 3 tokens
        before = dispatcher.rows_received
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):
            got = compiled(x, indices, weights)
        row_counts.add(dispatcher.rows_received - before)
        torch.testing.assert_close(got, exchange(x, indices, weights), rtol=0, atol=0)
        if seed == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs
    assert len(row_counts) > 1, "every routing sent the same row counts"


def test_sort_by_expert_puts_dropped_copies_last_and_counts_only_kept():
    sort = sort_by_expert(torch.tensor([[2, -1], [0, 2]]), 3, may_drop=True)
    assert sort.group_sizes.tolist() == [1, 0, 2]
    assert sort.order.tolist() == [2, 0, 3, 1]
    assert torch.equal(sort.order[sort.inverse], torch.arange(4))


CPU = Capabilities(device_type="cpu")
H100_DEEP_EP = Capabilities(device_type="cuda", cuda_capability=(9, 0), installed=frozenset({"deep_ep"}))


@pytest.mark.parametrize("drop", [False, True])
def test_row_movement_gradients_equal_plain_indexing(drop):
    # The gather-only backwards (inverse gathers, slot-order sums) against autograd through plain `tensor[index]`
    # (index_put_ accumulation), float64 so the two summation orders agree to 1e-12; with dropped copies (-1) too.
    generator = torch.Generator().manual_seed(3)
    tokens, top_k, hidden, experts = 11, 3, 5, 4
    indices = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    if drop:
        indices[[0, 4, 7], [1, 0, 2]] = -1
    sort = sort_by_expert(indices, experts, may_drop=drop)
    kept = int(sort.group_sizes.sum())
    x = torch.randn(tokens, hidden, dtype=torch.float64, generator=generator, requires_grad=True)
    weights = torch.rand(tokens, top_k, dtype=torch.float64, generator=generator, requires_grad=True)
    scale = torch.randn(kept, hidden, dtype=torch.float64, generator=generator)
    perm = torch.randperm(kept, generator=generator)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(kept)
    upstream = torch.randn(tokens, hidden, dtype=torch.float64, generator=generator)

    rows = permute_rows(gather_sorted_rows(x, sort, top_k, kept), perm, inverse) * scale
    out = weighted_unsort(permute_rows(rows, inverse, perm), sort, weights)
    grads = torch.autograd.grad((out * upstream).sum(), (x, weights))

    plain_rows = x[sort.order[:kept] // top_k][perm] * scale
    padded = torch.cat([plain_rows[inverse], plain_rows.new_zeros(1, hidden)])
    by_slot = padded[sort.inverse.clamp(max=kept)].view(tokens, top_k, hidden)
    expected_out = (by_slot * weights[..., None]).sum(dim=1)
    expected = torch.autograd.grad((expected_out * upstream).sum(), (x, weights))
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-12)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_detection_picks_deep_ep_only_on_hopper_with_it_installed(monkeypatch):
    monkeypatch.delenv("D9D_BACKEND_AUTO_EXPERT_DISPATCH", raising=False)
    assert detect_expert_dispatch_config(CPU) == AllToAllDispatchConfig()
    assert detect_expert_dispatch_config(Capabilities(device_type="cuda", cuda_capability=(9, 0))) == (
        AllToAllDispatchConfig()
    )
    assert detect_expert_dispatch_config(H100_DEEP_EP) == DeepEpDispatchConfig()


def test_explicit_beats_environment_beats_detection(monkeypatch):
    monkeypatch.setenv("D9D_BACKEND_AUTO_EXPERT_DISPATCH", '{"kind": "all_to_all"}')
    assert resolve_expert_dispatch_config(capabilities=H100_DEEP_EP) == AllToAllDispatchConfig()
    explicit = DeepEpDispatchConfig(num_sms=20)
    assert resolve_expert_dispatch_config(explicit, capabilities=CPU) == explicit
    monkeypatch.setenv("D9D_BACKEND_AUTO_EXPERT_DISPATCH", '{"kind": "nccl"}')
    valid = "all_to_all, all_to_all_capacity, all_to_all_tokens, deep_ep"
    with pytest.raises(ValueError, match=rf"D9D_BACKEND_AUTO_EXPERT_DISPATCH.*{valid}"):
        resolve_expert_dispatch_config(capabilities=CPU)


def test_deep_ep_config_rejects_an_odd_sm_count():
    with pytest.raises(ValueError, match="num_sms"):
        DeepEpDispatchConfig(num_sms=23)


@pytest.mark.distributed(world_size=2, timeout=120)
def test_asking_for_deep_ep_without_it_names_the_package_and_the_build_script(monkeypatch):
    monkeypatch.delenv("D9D_BACKEND_AUTO_EXPERT_DISPATCH", raising=False)
    group = dist.group.WORLD
    assert group is not None
    # gloo: detection looks at what the group can move (CPU tensors), so it is all-to-all whatever GPUs exist.
    assert build_token_dispatcher(None, group=group, num_experts=4).name == "all_to_all"
    if importlib.util.find_spec("deep_ep") is None:
        with pytest.raises(BackendUnavailable, match=r"deep_ep.*bench/build_deepep\.sh.*all_to_all"):
            build_token_dispatcher(DeepEpDispatchConfig(), group=group, num_experts=4)
    with pytest.raises(ValueError, match="num_experts=5 must be divisible by the expert-parallel degree ep=2"):
        build_token_dispatcher(AllToAllDispatchConfig(), group=group, num_experts=5)
