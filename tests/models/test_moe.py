"""MoE blocks: routing, permutation, the layer against a per-token loop, load counts, auxiliary losses."""

import pytest
import torch
from torch.nn import functional

from d9d.kernels.grouped_mm import EagerGroupedMm, TorchGroupedMm
from d9d.models import materialize_
from d9d.models.blocks.checkpointing import run_layer, set_activation_checkpointing
from d9d.models.blocks.moe import (
    MoELayer,
    RouterScoring,
    TopKRouter,
    drop_over_capacity,
    expert_load_metrics,
    force_routing,
    load_balancing_loss,
    permute_tokens,
    router_z_loss,
    unpermute_tokens,
)


def _moe(**overrides):
    options = dict(hidden_size=16, num_experts=6, top_k=2, expert_intermediate_size=8, grouped_mm=EagerGroupedMm())
    torch.manual_seed(0)
    with torch.device("meta"):
        layer = MoELayer(**{**options, **overrides})
    materialize_(layer, "cpu")
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0)
    return layer


def _loop_reference(layer, x, kept=None):
    """Each token through each of its chosen experts, one at a time (only the copies in `kept`, if given)."""
    flat = x.reshape(-1, x.shape[-1])
    routing = layer.router(flat)
    out = torch.zeros_like(flat)
    experts = layer.experts
    for t in range(flat.shape[0]):
        for slot in range(routing.expert_indices.shape[1]):
            if kept is not None and not kept[t, slot]:
                continue
            e = routing.expert_indices[t, slot]
            gate = functional.linear(flat[t], experts.gate_proj.weight[e])
            up = functional.linear(flat[t], experts.up_proj.weight[e])
            y = functional.linear(functional.silu(gate) * up, experts.down_proj.weight[e])
            out[t] += routing.expert_weights[t, slot] * y
    if layer.shared_experts is not None:
        out += layer.shared_experts(flat)
    return out.view_as(x)


@pytest.mark.parametrize("backend", [EagerGroupedMm(), TorchGroupedMm()], ids=lambda b: b.name)
@pytest.mark.parametrize("shared", [0, 12])
def test_layer_matches_a_per_token_loop(backend, shared):
    layer = _moe(grouped_mm=backend, shared_intermediate_size=shared)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(x), _loop_reference(layer, x), atol=1e-5, rtol=1e-5)


def test_permutation_round_trip_and_group_sizes():
    x = torch.arange(5.0)[:, None].expand(5, 3)
    indices = torch.tensor([[2, 0], [2, 1], [0, 3], [3, 2], [1, 0]])
    permuted = permute_tokens(x, indices, num_experts=4)
    assert permuted.group_sizes.tolist() == [3, 2, 3, 2]
    assert permuted.rows[:, 0].tolist() == [0, 2, 4, 1, 4, 0, 1, 3, 2, 3]  # by expert, tokens in order
    weights = torch.full((5, 2), 0.5)
    torch.testing.assert_close(unpermute_tokens(permuted.rows, permuted, weights), x)


def test_softmax_router_weights_are_renormalised_top_k_probabilities():
    router = TopKRouter(8, 5, 2)
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(4, 8)
    result = router(x)
    probs = torch.softmax(x @ router.weight.T, -1)
    top = probs.topk(2, -1)
    assert torch.equal(result.expert_indices, top.indices)
    torch.testing.assert_close(result.expert_weights, top.values / top.values.sum(-1, keepdim=True))


def test_sigmoid_bias_steers_selection_but_not_weights():
    router = TopKRouter(8, 4, 1, scoring=RouterScoring.SIGMOID, normalize_top_k=False, expert_bias=True)
    with torch.no_grad():
        router.weight.normal_()
        router.expert_bias.zero_()
    x = torch.randn(6, 8)
    before = router(x)
    with torch.no_grad():
        router.expert_bias[3] = 10.0
    after = router(x)
    assert torch.all(after.expert_indices == 3)
    torch.testing.assert_close(after.expert_weights.squeeze(-1), torch.sigmoid(x @ router.weight[3]))
    assert not torch.equal(before.expert_indices, after.expert_indices)


def test_expert_bias_update_moves_towards_balance():
    router = TopKRouter(8, 4, 1, scoring=RouterScoring.SIGMOID, expert_bias=True)
    router.expert_bias.zero_()
    router.update_expert_bias_(torch.tensor([10.0, 0.0, 5.0, 5.0]), rate=0.1)
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    with pytest.raises(ValueError, match="needs sigmoid scoring"):
        TopKRouter(8, 4, 1, expert_bias=True)


def test_load_counts_accumulate_until_reset_and_skip_recomputation():
    layer = _moe()
    set_activation_checkpointing(layer)
    x = torch.randn(2, 7, 16, requires_grad=True)
    for _ in range(2):
        run_layer(layer, x).square().sum().backward()
    assert layer.tokens_per_expert.sum().item() == 2 * 14 * 2  # two passes of 14 tokens x top-2, no recompute
    layer.reset_load()
    assert layer.tokens_per_expert.sum().item() == 0
    assert "tokens_per_expert" not in layer.state_dict()


def test_compiled_layer_counts_real_forwards_without_a_graph_break():
    """Compiled (aot_eager: the same graphs as Inductor without code generation, fast on CPU) with activation
    checkpointing, the load counts and the auxiliary-loss sum match eager exactly (integers, and the same float ops
    on the same values): the recomputation inside backward counts nothing. The recomputation test used to be a graph
    break per MoE layer; only the eager grouped-matmul loop (compiler-disabled by design) may break the graph now."""
    from torch._dynamo.utils import counters

    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(5), requires_grad=True)
    results = []
    for compiled in (False, True):
        layer = _moe(load_balancing_coef=0.1, z_loss_coef=0.01)
        set_activation_checkpointing(layer)
        torch._dynamo.reset()
        counters.clear()
        run = torch.compile(layer, backend="aot_eager") if compiled else layer
        for _ in range(2):
            run_layer(run, x).square().sum().backward()
        results.append((layer.tokens_per_expert.clone(), layer.take_weighted_aux_loss()))
        if compiled:
            assert counters["stats"]["unique_graphs"] > 0  # it did compile
            reasons = list(counters["graph_break"])
            assert all("EagerGroupedMm" in reason for reason in reasons), reasons
    (eager_load, eager_aux), (compiled_load, compiled_aux) = results
    assert eager_load.sum().item() == 2 * 14 * 2
    assert torch.equal(compiled_load, eager_load)
    torch.testing.assert_close(compiled_aux, eager_aux, rtol=0, atol=0)


def test_aux_losses_reach_the_router_gradient_as_if_added_to_the_loss():
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(3))
    with_aux = _moe(load_balancing_coef=0.1, z_loss_coef=0.01)
    with_aux(x).square().sum().backward()
    plain = _moe()
    out = plain(x)
    routing = plain.router(x.reshape(-1, 16))
    permuted = permute_tokens(x.reshape(-1, 16), routing.expert_indices, 6)
    manual = 0.1 * load_balancing_loss(routing.scores, permuted.group_sizes, 2) + 0.01 * router_z_loss(routing.logits)
    (out.square().sum() + manual).backward()
    torch.testing.assert_close(with_aux.router.weight.grad, plain.router.weight.grad)
    assert set(with_aux.aux_losses) == {"load_balancing", "z_loss"}
    assert not torch.equal(with_aux.router.weight.grad, _router_grad_without_aux(x))


def _router_grad_without_aux(x):
    layer = _moe()
    layer(x).square().sum().backward()
    return layer.router.weight.grad


def test_load_balancing_loss_is_one_at_perfect_balance():
    scores = torch.full((8, 4), 0.25)
    assert load_balancing_loss(scores, torch.tensor([4, 4, 4, 4]), top_k=2).item() == pytest.approx(1.0)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).expand(8, 4)
    assert load_balancing_loss(skewed, torch.tensor([8, 8, 0, 0]), top_k=2).item() > 1.0


def test_forced_routing_replays_choices_and_keeps_router_gradients():
    layer = _moe()
    x = torch.randn(1, 4, 16)
    forced = torch.tensor([[0, 1], [2, 3], [4, 5], [0, 5]])
    with force_routing({layer.router: forced}):
        layer(x).sum().backward()
        assert torch.equal(layer.router(x.reshape(-1, 16)).expert_indices, forced)
    assert layer.router.forced_indices is None
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    assert layer.tokens_per_expert.tolist() == [2, 1, 1, 1, 1, 2]


def test_capacity_drops_the_copies_beyond_each_experts_limit_in_token_order():
    indices = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    # capacity = ceil(0.75 * 4 tokens * 2 / 3 experts) = 2 copies per expert
    dropped = drop_over_capacity(indices, num_experts=3, capacity_factor=0.75)
    assert dropped.tolist() == [[0, 1], [0, 2], [-1, 1], [-1, -1]]
    assert torch.equal(drop_over_capacity(indices, num_experts=3, capacity_factor=10.0), indices)


def test_layer_with_capacity_factor_drops_copies_and_counts_what_the_router_chose():
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    roomy, tight = _moe(capacity_factor=100.0), _moe(capacity_factor=0.5)
    torch.testing.assert_close(roomy(x), _moe()(x), atol=0, rtol=0)
    out = tight(x)
    routing = tight.router(x.reshape(-1, 16))
    kept = drop_over_capacity(routing.expert_indices, 6, 0.5) >= 0
    assert not bool(kept.all()), "the test needs copies over capacity"
    torch.testing.assert_close(out, _loop_reference(tight, x, kept), atol=1e-5, rtol=1e-5)
    expected_load = torch.bincount(routing.expert_indices.reshape(-1), minlength=6).float()
    assert torch.equal(tight.tokens_per_expert, expected_load)
    out.sum().backward()
    assert tight.router.weight.grad is not None


def test_capacity_factor_must_be_positive():
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        _moe(capacity_factor=0.0)


def test_expert_load_metrics_give_shares_and_imbalance():
    metrics = expert_load_metrics({"1": torch.tensor([6.0, 2.0, 0.0, 0.0]), "0": torch.zeros(2)})
    assert metrics["expert_load/1/0"] == 0.75 and metrics["expert_load/1/2"] == 0.0
    assert metrics["expert_imbalance/1"] == 3.0
    assert metrics["expert_load/0/1"] == 0.0 and metrics["expert_imbalance/0"] == 0.0
