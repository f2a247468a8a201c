"""`kind='single'` (no FSDP on one data-parallel rank) trains like FSDP on one rank.

A tiny Qwen3 dense model, 8 steps of AdamW with clipping, built on meta, parallelised by `parallelize_qwen3_dense` and
materialised with the same seed, both ways on the same batches:

- float32, no mixed precision: the same arithmetic (FSDP on one rank copies, it does not sum), so losses, gradient
  norms and parameters agree to 1e-5 relative (float32 summation order inside fused ops only).
- bfloat16 parameters, float32 gradients (`reduce_dtype`), StochasticAdamW: FSDP reduces in float32 and hands the
  optimizer bfloat16 gradients, the single-device path keeps float32 ones, and the two draw different rounding noise
  (the shard coordinate enters the seed). Losses agree to 2e-2 relative over 8 steps: the bfloat16 compute's own
  noise (2^-8) times a few steps of divergence.
- bfloat16 parameters with StochasticAdamW against float32 parameters with AdamW (the master-weight run), 30 steps:
  losses within 3% relative at every step (measured 0.70% while the loss falls from 4.16 to 1.93: bfloat16
  compute noise plus the unbiased rounding
  noise of the weights, which does not accumulate into a drift).
"""

import pytest
import torch
from torch.distributed.tensor import DTensor

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.optim import StochasticAdamW
from d9d.core.testing import run_on_ranks
from d9d.kernels.adamw import register_triton_stochastic_adamw
from d9d.kernels.attention import ATTENTION_CONFIG_ADAPTER
from d9d.models import DecoderConfig, materialize_
from d9d.models.blocks.compilation import compile_model
from d9d.models.qwen3 import Qwen3DenseForCausalLM, Qwen3DenseParameters, parallelize_qwen3_dense
from d9d.parallel import FsdpConfig, MixedPrecisionConfig, SingleDeviceConfig, cast_parameters_, clip_grad_norm_

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")

PARAMS = Qwen3DenseParameters(
    hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    vocab_size=64,
)  # fmt: skip
STEPS = 8


def _train(
    kind: str,
    bf16: bool,
    steps: int = STEPS,
    *,
    device: str = "cpu",
    params: Qwen3DenseParameters = PARAMS,
    decoder: DecoderConfig | None = None,
    whole_model_compile: bool = False,
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    ctx = DistributedContext.build(MeshDegrees(), device=device)
    with torch.device("meta"):
        model = Qwen3DenseForCausalLM(params, config=decoder or DecoderConfig())
    if bf16 and kind == "fsdp":
        cast_parameters_(model, torch.bfloat16)  # the same stored dtype as the single-device path
    precision = MixedPrecisionConfig() if bf16 else None
    config = (
        SingleDeviceConfig(mixed_precision=precision) if kind == "single" else FsdpConfig(mixed_precision=precision)
    )
    sync = parallelize_qwen3_dense(model, ctx, config)
    torch.manual_seed(0)
    materialize_(model, device)
    if whole_model_compile:
        compile_model(model)
    if bf16:
        fused = device == "cuda"  # the Triton step of d9d-kernels on GPUs, the PyTorch reference on CPU
        if fused:
            register_triton_stochastic_adamw()
        optimizer = StochasticAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, seed=1, fused=fused)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    generator = torch.Generator().manual_seed(2)
    losses, norms = [], []
    pool = [torch.randint(0, params.vocab_size, (2, 16), generator=generator) for _ in range(2)]  # learnable
    for step in range(steps):
        ids = pool[step % 2].to(device)
        sync.begin_step(1)
        loss = model(ids, labels=torch.roll(ids, -1, dims=1)).losses.sum() / ids.numel()
        loss.backward()
        sync.wait()
        norms.append(float(clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)))
        optimizer.step()
        losses.append(loss.item())
    params = {
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().float().clone()
        for name, param in model.named_parameters()
    }
    ctx.close()
    return losses, norms, params


@pytest.mark.distributed(world_size=1, timeout=300)
def test_single_device_matches_fsdp_on_one_rank_in_float32():
    single, fsdp = _train("single", bf16=False), _train("fsdp", bf16=False)
    torch.testing.assert_close(single[0], fsdp[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(single[1], fsdp[1], rtol=1e-5, atol=0)
    for name, value in single[2].items():
        torch.testing.assert_close(value, fsdp[2][name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.distributed(world_size=1, timeout=300)
def test_single_device_bf16_parameters_train_like_fsdp_with_float32_gradients():
    single_losses, _, single_params = _train("single", bf16=True)
    fsdp_losses, _, _ = _train("fsdp", bf16=True)
    torch.testing.assert_close(single_losses, fsdp_losses, rtol=2e-2, atol=0)
    assert single_losses[-1] < single_losses[0]  # it trains
    assert all(value.dtype == torch.float32 for value in single_params.values())  # (compared as float32 copies)


@pytest.mark.distributed(world_size=1, timeout=120)
def test_single_device_stores_compute_dtype_and_accumulates_in_reduce_dtype():
    ctx = DistributedContext.build(MeshDegrees(), device="cpu")
    with torch.device("meta"):
        model = Qwen3DenseForCausalLM(PARAMS)
    sync = parallelize_qwen3_dense(model, ctx, SingleDeviceConfig(mixed_precision=MixedPrecisionConfig()))
    materialize_(model, "cpu")
    assert {param.dtype for param in model.parameters()} == {torch.bfloat16}
    assert not any(isinstance(param, DTensor) for param in model.parameters())
    assert all(buffer.dtype != torch.bfloat16 for buffer in model.buffers() if buffer.is_floating_point())
    sync.begin_step(1)
    ids = torch.randint(0, PARAMS.vocab_size, (1, 8))
    model(ids, labels=ids).losses.sum().backward()
    assert {param.grad.dtype for param in model.parameters() if param.grad is not None} == {torch.float32}
    ctx.close()


@pytest.mark.distributed(world_size=2, timeout=120)
def test_single_device_refuses_more_than_one_data_parallel_rank():
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2), device="cpu")
    with torch.device("meta"):
        model = Qwen3DenseForCausalLM(PARAMS)
    with pytest.raises(ValueError, match=r"kind='single' trains one data-parallel rank, but .* has 2 ranks"):
        parallelize_qwen3_dense(model, ctx, SingleDeviceConfig())
    ctx.close()


@pytest.mark.distributed(world_size=1, timeout=300)
def test_bf16_weights_with_stochastic_adamw_follow_the_float32_master_run():
    low, _, _ = _train("single", bf16=True, steps=30)
    master, _, _ = _train("fsdp", bf16=False, steps=30)
    deviation = max(abs(a - b) / abs(b) for a, b in zip(low, master, strict=True))
    assert deviation < 3e-2, f"max relative loss deviation {deviation:.3%} over 30 steps"
    assert master[-1] < master[0] * 0.9  # the run learns something, so following it means something


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "cudnn", "flex"])
@pytest.mark.parametrize("whole_model_compile", [False, True], ids=["eager", "compiled"])
def test_gpu_levers_follow_the_float32_fsdp_run(attention, whole_model_compile):
    # bench/trainer_step.py's combined row at a tiny size: no FSDP, bf16 weights with the fused Triton stochastic
    # AdamW step, an attention backend, optionally the whole model compiled; against float32 FSDP with SDPA. Same 3%
    # over 30 steps as the CPU test above (bfloat16 compute noise; attention kernels differ in summation order only).
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    params = PARAMS.model_copy(update={"hidden_size": 64, "head_dim": 32})  # flex and cuDNN want head_dim >= 16
    decoder = DecoderConfig(attention=ATTENTION_CONFIG_ADAPTER.validate_python({"kind": attention}))

    def fast():
        return _train(
            "single", True, 30, device="cuda", params=params, decoder=decoder, whole_model_compile=whole_model_compile
        )[0]

    def reference():
        torch.backends.cuda.matmul.allow_tf32 = False
        return _train("fsdp", False, 30, device="cuda", params=params)[0]

    low = run_on_ranks(1, fast, init_process_group=False, timeout_seconds=600)[0]
    master = run_on_ranks(1, reference, init_process_group=False, timeout_seconds=600)[0]
    deviation = max(abs(a - b) / abs(b) for a, b in zip(low, master, strict=True))
    print(f"{attention}, compiled={whole_model_compile}: max relative loss deviation {deviation:.3%}")
    assert deviation < 3e-2 and master[-1] < master[0] * 0.9, (low, master)
