"""The token-level static-capacity dispatcher (`all_to_all_tokens`, design 0031) on real gloo groups.

Against the all-to-all dispatcher when nothing is dropped: the experts receive the same rows in the same order
(local expert, source rank, token), then padding; with scaled experts the outputs and the gradients of the tokens
and of the combine weights agree to float32 rounding (rtol 1e-6, atol 1e-6: the tokens' partial sums are added in
another order, per destination rank rather than per slot). Against a one-process reference that applies the
documented dropping rules (a loop) when both capacities are small. Every rank dispatches the same number of tokens;
rank 1 routes nothing, experts 3 and 6 get no tokens, and one copy of another rank is dropped upstream (`-1`).
"""

import math

import pytest
import torch
import torch.distributed as dist
from dispatch_cases import HIDDEN, NUM_EXPERTS, SILENT_RANK, dispatch_and_combine, routing
from pydantic import ValidationError

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.kernels.expert_dispatch import (
    EXPERT_DISPATCH_CONFIG_ADAPTER,
    AllToAllDispatcher,
    AllToAllTokenCapacityDispatcher,
    AllToAllTokensDispatchConfig,
    build_token_dispatcher,
    expert_row_capacity,
    resolve_expert_dispatch_config,
    token_pair_capacity,
)
from d9d.kernels.expert_dispatch.capacity_tokens import check_token_capacity_factors

TOP_K, TOKENS = 3, 12
RTOL = ATOL = 1e-6


def _routing(rank: int, seed: int, tokens: int = TOKENS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return routing(rank, seed, tokens=tokens, top_k=TOP_K)


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.distributed(world_size=4, timeout=120)
def test_without_drops_it_equals_the_all_to_all_dispatcher(ep):
    ctx = DistributedContext.build(MeshDegrees(dp_shard=4, ep=ep))
    group = ctx.mesh_for("expert")["ep"].get_group()
    # token factor 1.0: a token goes to a rank once, C >= T; copy factor ep: M holds every copy ep sources can send.
    tokens = AllToAllTokenCapacityDispatcher(group, NUM_EXPERTS, 1.0, float(ep))
    reference = AllToAllDispatcher(group, NUM_EXPERTS)
    first_local = dist.get_rank(group) * tokens.num_local_experts
    for seed in range(3):
        x, indices, weights = _routing(ctx.rank, seed)
        upstream = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed + 10 * ctx.rank))
        out, dispatched, grads = dispatch_and_combine(tokens, x, indices, weights, first_local, upstream)
        ref_out, ref_dispatched, ref_grads = dispatch_and_combine(reference, x, indices, weights, first_local, upstream)
        assert dispatched.rows.shape == (expert_row_capacity(TOKENS, TOP_K, ep, float(ep)), HIDDEN)
        valid = ref_dispatched.rows.shape[0]
        assert torch.equal(dispatched.rows[:valid], ref_dispatched.rows)
        assert torch.equal(dispatched.group_sizes, ref_dispatched.group_sizes)
        torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        assert int(tokens.dropped_copies) == 0
        if ctx.rank == SILENT_RANK:
            assert not out.any() and not grads[0].any()


def _dropping_reference(
    all_indices: list[torch.Tensor], num_ranks: int, token_capacity: int, row_capacity: int
) -> list[torch.Tensor]:
    """Every source's `expert_indices` with the dropped copies set to -1, by the documented rules as loops: a token is
    sent to a rank if it is among the first `token_capacity` tokens (in token order) that its source sends there;
    a rank keeps the first `row_capacity` of the copies it receives in (local expert, source, token, slot) order."""
    num_local = NUM_EXPERTS // num_ranks
    kept = [indices.clone() for indices in all_indices]
    for out in kept:
        sent = [0] * num_ranks
        for token in range(out.shape[0]):
            dests = {int(e) // num_local for e in out[token] if e >= 0}
            for dest in dests:
                if sent[dest] >= token_capacity:
                    out[token][(out[token] >= 0) & (out[token] // num_local == dest)] = -1
                sent[dest] += 1
    for dest in range(num_ranks):
        arrived = [
            (int(out[t, j]), source, t, j)
            for source, out in enumerate(kept)
            for t in range(out.shape[0])
            for j in range(out.shape[1])
            if out[t, j] >= 0 and int(out[t, j]) // num_local == dest
        ]
        for _, source, t, j in sorted(arrived)[row_capacity:]:
            kept[source][t, j] = -1
    return kept


@pytest.mark.distributed(world_size=4, timeout=120)
def test_over_capacity_copies_are_dropped_like_a_single_process_reference():
    ctx = DistributedContext.build(MeshDegrees(dp_shard=4, ep=4))
    group = ctx.mesh_for("expert")["ep"].get_group()
    # 40 tokens, C = 16: every token wants rank 0 (expert 0), so each source drops 24 tokens there; M = 32 of the
    # 3 x 40 copies a rank may get drops at the receivers too.
    num_tokens, token_factor, copy_factor = 40, 0.25, 0.25
    tokens = AllToAllTokenCapacityDispatcher(group, NUM_EXPERTS, token_factor, copy_factor)
    reference = AllToAllDispatcher(group, NUM_EXPERTS)
    first_local = dist.get_rank(group) * tokens.num_local_experts
    for seed in range(2):
        x, indices, weights = _routing(ctx.rank, seed, num_tokens)
        skewed = indices.clone()
        if ctx.rank != SILENT_RANK:
            skewed[:, 0] = 0
        everyone = [torch.empty_like(skewed) for _ in range(4)]
        dist.all_gather(everyone, skewed)
        capacity = token_pair_capacity(num_tokens, token_factor)
        rows = expert_row_capacity(num_tokens, TOP_K, 4, copy_factor)
        assert (capacity, rows) == (16, 32)
        expected = _dropping_reference(everyone, 4, capacity, rows)[ctx.rank]
        upstream = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed + 10 * ctx.rank))
        before = int(tokens.dropped_copies)
        out, _, grads = dispatch_and_combine(tokens, x, skewed, weights, first_local, upstream)
        ref_out, _, ref_grads = dispatch_and_combine(reference, x, expected, weights, first_local, upstream)
        torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        dropped = torch.tensor(int(tokens.dropped_copies) - before)
        dist.all_reduce(dropped)
        all_expected = _dropping_reference(everyone, 4, capacity, rows)
        routed = sum(int((e >= 0).sum()) for e in everyone)
        assert int(dropped) == routed - sum(int((e >= 0).sum()) for e in all_expected) > 0


@pytest.mark.distributed(world_size=2, timeout=180)
def test_dispatch_and_combine_compile_into_one_graph():
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2, ep=2))
    group = ctx.mesh_for("expert")["ep"].get_group()
    tokens = build_token_dispatcher(AllToAllTokensDispatchConfig(), group=group, num_experts=NUM_EXPERTS)
    assert isinstance(tokens, AllToAllTokenCapacityDispatcher) and tokens.traceable

    def layer(x, indices, weights):
        dispatched = tokens.dispatch(x, indices, weights)
        return tokens.combine(dispatched.rows * 2.0, dispatched)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    for seed in range(2):
        x, indices, weights = _routing(ctx.rank, seed)
        torch.testing.assert_close(compiled(x, indices, weights), layer(x, indices, weights), rtol=RTOL, atol=ATOL)


def test_capacities_round_up_and_never_exceed_every_copy():
    assert token_pair_capacity(8192, 1.0) == 8192
    assert token_pair_capacity(12, 0.5) == 16
    assert expert_row_capacity(8192, 8, 4, 2.0) == 131072
    assert expert_row_capacity(12, 3, 2, 100.0) == 72  # at most what 2 sources can send: 2 x 12 x 3


BAD_FACTORS = [
    ("token_capacity_factor", 0.0),
    ("token_capacity_factor", 1.5),
    ("copy_capacity_factor", -1.0),
    ("copy_capacity_factor", math.inf),
]


@pytest.mark.parametrize(("field", "bad"), BAD_FACTORS)
def test_bad_capacity_factors_name_the_field_and_the_value(field, bad):
    with pytest.raises(ValidationError, match=field):
        AllToAllTokensDispatchConfig(**{field: bad})
    token, copy = (bad, 2.0) if field == "token_capacity_factor" else (1.0, bad)
    with pytest.raises(ValueError, match=rf"{field}.*got {field}={bad!r}"):
        check_token_capacity_factors(token, copy)


def test_selected_by_config_and_environment_but_never_by_detection(monkeypatch):
    config = EXPERT_DISPATCH_CONFIG_ADAPTER.validate_python({"kind": "all_to_all_tokens"})
    assert isinstance(config, AllToAllTokensDispatchConfig) and config.token_capacity_factor == 1.0
    monkeypatch.setenv("D9D_BACKEND_AUTO_EXPERT_DISPATCH", '{"kind": "all_to_all_tokens"}')
    assert isinstance(resolve_expert_dispatch_config(None), AllToAllTokensDispatchConfig)
    monkeypatch.delenv("D9D_BACKEND_AUTO_EXPERT_DISPATCH")
    assert not isinstance(resolve_expert_dispatch_config(None), AllToAllTokensDispatchConfig)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_the_pytorch_reference(dtype):
    # The GPU path's kernels, run in Triton's interpreter on CPU tensors, against the per-column PyTorch reference.
    # Both add in the same order in float32; the kernel rounds once, the reference once: equal up to the dtype's
    # rounding of the result (bfloat16: one ulp, rtol 8e-3).
    from d9d.kernels.expert_dispatch.capacity_tokens import gather_sum, row_dots, triton_gather_sum, triton_row_dots

    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(10, 40, generator=generator).to(dtype)
    index = torch.randint(0, 14, (7, 3), generator=generator)  # 10..13: none
    weights = torch.rand(7, 3, generator=generator)
    tol = {"rtol": 8e-3, "atol": 8e-3} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    for w in (None, weights):
        got = triton_gather_sum(rows, index, w, torch.float32)
        torch.testing.assert_close(got, gather_sum(rows, index, w, torch.float32), **tol)
        explicit = torch.stack(
            [sum((rows[i].float() * (1.0 if w is None else w[o, j])) for j, i in enumerate(index[o]) if i < 10)
             if (index[o] < 10).any() else torch.zeros(40) for o in range(7)]
        )  # fmt: skip
        torch.testing.assert_close(got, explicit, **tol)
    a_index = torch.randint(0, 10, (5,), generator=generator)
    b = torch.randn(5, 40, generator=generator).to(dtype)
    torch.testing.assert_close(triton_row_dots(rows, a_index, b), row_dots(rows, a_index, b), **tol)
