"""The Triton kernels at the anchor shapes on a GPU, forward and backward, against the eager references (bf16).

Marked `gpu`: skipped cleanly without CUDA. Tolerances: bf16 outputs carry one rounding (2^-8 relative) and the
kernels keep float32 where eager rounds an intermediate to bf16, so values differ by about one bf16 ulp; reductions
over thousands of rows (weight gradients) are compared by relative norm error instead of elementwise.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _bf16(*shape, seed, scale=1.0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=generator) * scale).to(torch.bfloat16)


def _relative(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _fwd_bwd(fn, inputs, grads):
    leaves = [t.clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(list(outs), grads[: len(outs)])
    return [o.detach() for o in outs], [t.grad for t in leaves]


def _compare(triton_fn, eager_fn, inputs, grads, *, elementwise=2e-2, norm=1e-2):
    got_out, got_grads = _fwd_bwd(triton_fn, inputs, grads)
    want_out, want_grads = _fwd_bwd(eager_fn, inputs, grads)
    for got, want in zip(got_out, want_out, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=elementwise, rtol=elementwise)
    for got, want in zip(got_grads, want_grads, strict=True):
        assert _relative(got, want) < norm


def test_rms_norm_with_residual_at_anchor_shape():
    from d9d.kernels.rms_norm import TritonRmsNorm, rms_norm_reference

    x, r, w = _bf16(16384, 1024, seed=0), _bf16(16384, 1024, seed=1), 1 + _bf16(1024, seed=2, scale=0.1)
    grads = [_bf16(16384, 1024, seed=3), _bf16(16384, 1024, seed=4)]
    kernel = TritonRmsNorm()
    _compare(
        lambda x, r, w: kernel(x, w, eps=1e-6, residual=r),
        lambda x, r, w: rms_norm_reference(x, w, eps=1e-6, residual=r),
        [x, r, w],
        grads,
    )


def test_swiglu_at_anchor_shape():
    from d9d.kernels.swiglu import TritonSwiGlu, swiglu_reference

    gate, up = _bf16(16384, 3072, seed=0, scale=2.0), _bf16(16384, 3072, seed=1)
    _compare(TritonSwiGlu(), swiglu_reference, [gate, up], [_bf16(16384, 3072, seed=2)])


def test_rope_q_and_k_at_anchor_shape():
    from d9d.kernels.rope import TritonRope, rope_reference

    q, k = _bf16(4, 4096, 16, 128, seed=0), _bf16(4, 4096, 8, 128, seed=1)
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda") / 128))
    angles = torch.arange(4096, device="cuda")[:, None] * inv
    angles = torch.cat([angles, angles], dim=-1)[None].expand(4, 4096, 128)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    kernel = TritonRope()
    _compare(
        lambda q, k: kernel(q, k, cos, sin),
        lambda q, k: (rope_reference(q, cos, sin), rope_reference(k, cos, sin)),
        [q, k],
        [_bf16(*q.shape, seed=2), _bf16(*k.shape, seed=3)],
    )


def test_fused_linear_cross_entropy_at_full_vocabulary():
    from d9d.kernels.linear_cross_entropy import TritonLinearCrossEntropy, linear_cross_entropy_reference

    hidden, weight = _bf16(4096, 1024, seed=0), _bf16(151936, 1024, seed=1, scale=0.02)
    labels = torch.randint(0, 151936, (4096,), device="cuda")
    labels[:100] = -100
    kernel = TritonLinearCrossEntropy()
    # Losses: float32 from bf16 logits in both; gradients: bf16 matmuls over 151,936 / 4,096 terms.
    _compare(
        lambda h, w: kernel(h, w, labels, chunk_size=2048),
        lambda h, w: linear_cross_entropy_reference(h, w, labels),
        [hidden, weight],
        [torch.rand(4096, device="cuda")],
        elementwise=1e-3,
    )


def test_summed_fused_linear_cross_entropy_at_full_vocabulary():
    from d9d.kernels.linear_cross_entropy import TritonLinearCrossEntropy, linear_cross_entropy_reference

    hidden, weight = _bf16(6000, 1024, seed=0), _bf16(151936, 1024, seed=1, scale=0.02)  # 3 chunks, the last short
    labels = torch.randint(0, 151936, (6000,), device="cuda")
    labels[:100] = -100
    kernel = TritonLinearCrossEntropy()
    # Gradients computed in forward, scaled in backward by 1 / 6000 (as a task normalises by its token count): the
    # loss sum is float32 over the same bf16 logits; the gradients are bf16 matmuls, compared by relative norm.
    _compare(
        lambda h, w: kernel.summed(h, w, labels, chunk_size=2048).total,
        lambda h, w: linear_cross_entropy_reference(h, w, labels).sum(),
        [hidden, weight],
        [torch.tensor(1 / 6000, device="cuda")],
        elementwise=1e-4,
    )
    with torch.no_grad():
        summed = kernel.summed(hidden, weight, labels, chunk_size=2048)
        want = linear_cross_entropy_reference(hidden, weight, labels)
    torch.testing.assert_close(summed.losses, want, atol=1e-3, rtol=1e-3)


def test_float32_weight_gradient_accumulation_inside_the_matmul_is_no_less_accurate():
    from d9d.kernels.linear_cross_entropy import addmm_float32_
    from d9d.kernels.linear_cross_entropy.accumulate import fused_float32_addmm_supported

    supported = fused_float32_addmm_supported(torch.device("cuda"), torch.bfloat16)
    print(f"addmm.dtype_out into a float32 accumulator: {'supported' if supported else 'not supported'}")
    a, b = _bf16(2048, 151936, seed=2).T, _bf16(2048, 1024, seed=3)  # one chunk's grad_logits.T @ hidden
    start = _bf16(151936, 1024, seed=4).float()
    exact = start.double() + a.double() @ b.double()
    got = addmm_float32_(start.clone(), a, b)
    fallback = start + (a @ b).float()  # the product rounded to bf16, then added
    assert _relative(got, exact) <= _relative(fallback, exact) * 1.01 + 1e-7


def test_moe_permute_at_anchor_shape():
    from d9d.kernels.moe_permute import EagerMoePermute, TritonMoePermute, sort_by_expert

    tokens, top_k, experts = 8192, 8, 64
    indices = torch.rand(tokens, experts, device="cuda").argsort(dim=1)[:, :top_k]
    order, inverse, sizes = sort_by_expert(indices, experts)
    assert int(sizes.sum()) == tokens * top_k
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda"), dim=-1).to(torch.bfloat16)

    def routed(permuter):
        return lambda x, w: permuter.unpermute(permuter.permute(x, order, top_k) * 1.5, inverse, w)

    _compare(
        routed(TritonMoePermute()), routed(EagerMoePermute()), [_bf16(tokens, 1024, seed=0), weights],
        [_bf16(tokens, 1024, seed=1)],
    )  # fmt: skip


def test_grouped_gemm_at_anchor_shape_with_skewed_groups():
    from d9d.kernels.grouped_mm import EagerGroupedMm, TritonGroupedMm

    # Four hot experts, 56 with an odd count (not a multiple of any block size), three idle ones, and the rest.
    sizes = torch.tensor([4608] * 4 + [783] * 56 + [0] * 3 + [65536 - 4 * 4608 - 56 * 783], device="cuda")
    assert int(sizes.sum()) == 65536 and int(sizes.min()) >= 0  # a negative count made the kernel read out of bounds
    x, w = _bf16(65536, 1024, seed=0), _bf16(64, 768, 1024, seed=1, scale=1024**-0.5)
    _compare(
        lambda a, b: TritonGroupedMm()(a, b, sizes),
        lambda a, b: EagerGroupedMm()(a, b, sizes),
        [x, w],
        [_bf16(65536, 768, seed=2)],
        elementwise=3e-2,
    )


def test_stochastic_adamw_step_matches_the_reference_within_one_ulp():
    from d9d.core.optim import StochasticAdamW
    from d9d.kernels.adamw import register_triton_stochastic_adamw

    register_triton_stochastic_adamw()
    fused = torch.nn.Parameter(_bf16(2**24, seed=0))
    plain = torch.nn.Parameter(fused.detach().clone())
    for param, is_fused in ((fused, True), (plain, False)):
        param.grad = _bf16(2**24, seed=1)
        StochasticAdamW([param], fused=is_fused, lr=1e-2).step()
    ulp = torch.finfo(torch.bfloat16).eps * plain.detach().float().abs()
    assert torch.all((fused.detach().float() - plain.detach().float()).abs() <= ulp * 1.0001)


# The dense anchor's kinds of parameters (embedding, attention and FFN projections, norms), plus an empty tensor, one
# element, and a size that is not a multiple of 16 (its bucket takes the kernel's unvectorised path).
_ADAMW_SHAPES = [(151936, 1024), (2048, 1024), (1024, 2048), (3072, 1024), (1024, 3072), (1024,), (128,), (0,), (1,)]


@pytest.mark.parametrize("layout", ["aligned", "odd-size", "odd-address"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32-moments", "bf16-moments"])
def test_multi_tensor_adamw_step_matches_the_per_tensor_step_to_rounding_boundaries(layout, state_dtype):
    from d9d.core.optim import AdamWStepParameters
    from d9d.kernels.adamw import triton_stochastic_adamw_multi_step, triton_stochastic_adamw_step

    shapes = _ADAMW_SHAPES + ([(1000, 77)] if layout == "odd-size" else [])

    def slots(seed):
        out = []
        for number, shape in enumerate(shapes):
            param, grad = _bf16(*shape, seed=seed + 4 * number), _bf16(*shape, seed=seed + 4 * number + 1)
            exp_avg = (0.1 * _bf16(*shape, seed=seed + 4 * number + 2)).to(state_dtype)
            exp_avg_sq = _bf16(*shape, seed=seed + 4 * number + 3).square().to(state_dtype)
            if layout == "odd-address":  # a view one element into its buffer: not 16-byte aligned
                param = torch.cat([param.new_zeros(1), param.flatten()])[1:].view(shape)
            out.append([param, grad, exp_avg, exp_avg_sq])
        return out

    per_tensor, multi = slots(0), slots(0)
    for step in (1, 2):
        hyper = AdamWStepParameters(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step)
        seeds = [(2**62 + 3 * i + step, 2**40 * i + step, 7 * i + 100 * step) for i in range(len(shapes))]
        for tensors, triple in zip(per_tensor, seeds, strict=True):
            triton_stochastic_adamw_step(*tensors, hyper=hyper, seeds=triple)
        triton_stochastic_adamw_multi_step(
            *(list(column) for column in zip(*multi, strict=True)), hyper=hyper, seeds=seeds
        )
    for shape, want, got in zip(shapes, per_tensor, multi, strict=True):
        for name, w, g in zip(("param", "grad", "exp_avg", "exp_avg_sq"), want, got, strict=True):
            bits = torch.int16 if w.dtype == torch.bfloat16 else torch.int32
            differs = (g.contiguous().view(bits) != w.contiguous().view(bits)).sum().item()
            if differs == 0:
                continue
            # Same noise, same float32 formulas, but two kernels that ptxas schedules (and contracts into FMAs)
            # independently. A float32 moment may therefore differ by a few float32 ulps (measured on an H100:
            # exp_avg_sq of the embedding, 19% of its elements, up to 3 ulps, i.e. < 4e-7 relative: rounding of
            # one formula, not a different one). A bfloat16 tensor (the parameter, bfloat16 moments) differs only
            # where such a float32 value sits on a rounding boundary: one bfloat16 ulp on a few elements
            # (measured: 2 of 155,582,464 embedding elements). Anything beyond that is a bug.
            ulps = (g.contiguous().view(bits).long() - w.contiguous().view(bits).long()).abs().max().item()
            if w.dtype == torch.float32:
                assert ulps <= 4, f"{name} {shape}: {differs} of {g.numel()} elements differ, by up to {ulps} ulp(s)"
                continue
            assert ulps <= 1 and differs <= max(8, g.numel() // 10**6), (
                f"{name} {shape}: {differs} of {g.numel()} elements differ, by up to {ulps} ulp(s)"
            )


def test_inductor_compiles_a_block_through_the_custom_ops():
    from d9d.kernels.rms_norm import TritonRmsNorm
    from d9d.kernels.swiglu import TritonSwiGlu

    norm, act = TritonRmsNorm(), TritonSwiGlu()
    w = torch.nn.Parameter(torch.ones(1024, device="cuda", dtype=torch.bfloat16))
    up = torch.nn.Linear(1024, 2 * 2048, device="cuda", dtype=torch.bfloat16)

    def block(x, r):
        normed, summed = norm(x, w, eps=1e-6, residual=r)
        gate, value = up(normed).chunk(2, dim=-1)
        return act(gate, value).sum() + summed.float().sum()

    x, r = _bf16(4096, 1024, seed=0).requires_grad_(), _bf16(4096, 1024, seed=1)
    torch.compile(block, fullgraph=True)(x, r).backward()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


def test_swiglu_tunes_once_per_size_class_not_per_row_count():
    """Expert parallelism hands the grouped experts a different row count every step and layer; each new
    autotuning key benchmarks every config (about 0.1 s each), which made ep=2 on the MoE anchor 50x slower than
    FSDP. Twenty row counts of one power-of-two size class must tune at most once."""
    from d9d.kernels.swiglu import TritonSwiGlu, triton_kernels

    before = len(triton_kernels._forward_kernel.cache), len(triton_kernels._backward_kernel.cache)
    backend = TritonSwiGlu()
    for rows in range(8200, 8200 + 20 * 37, 37):  # x 768 columns: all within (4M, 8M] elements
        gate = _bf16(rows, 768, seed=rows).requires_grad_()
        up = _bf16(rows, 768, seed=rows + 1).requires_grad_()
        backend(gate, up).backward(_bf16(rows, 768, seed=rows + 2))
    torch.cuda.synchronize()
    after = len(triton_kernels._forward_kernel.cache), len(triton_kernels._backward_kernel.cache)
    assert after[0] - before[0] <= 1 and after[1] - before[1] <= 1, (before, after)
