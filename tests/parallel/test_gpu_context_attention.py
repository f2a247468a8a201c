"""Ring and all-gather-KV attention on CUDA + NCCL against full attention (run on the GPU machine; skipped without
GPUs). float32 runs the eager block kernel (tolerance 2e-5 as on CPU, TF32 off); bfloat16 runs PyTorch's flash
kernel for the causal and unmasked blocks (document-masked blocks stay eager), compared with a float32 reference of
the same bf16-rounded inputs: 3e-2 absolute (bf16 has 8 bits of mantissa; outputs and gradients are O(1)).
"""

import os

import pytest
import torch
from test_context_attention import BATCH, DIM, HEADS, KV_HEADS, _documents, reference_attention

from d9d.core.testing import gpu_world_size, run_on_ranks

pytestmark = pytest.mark.gpu
TOLERANCES = {"float32": 2e-5, "bfloat16": 3e-2}


def _body(variant: str, packed: bool, dtype_name: str, seq: int) -> float:
    os.environ["D9D_DEVICE"] = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    from d9d.core.dist import DistributedContext, MeshDegrees
    from d9d.core.dist.domains import MeshDomain
    from d9d.parallel.context import all_gather_attention, ring_attention, shard_sequence

    ctx = DistributedContext.build(MeshDegrees(cp=gpu_world_size()))
    group = ctx.mesh_for(MeshDomain.BATCH)["cp"].get_group()
    rank, cp, device = group.rank(), group.size(), ctx.device
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(BATCH, seq, HEADS, DIM, generator=generator).to(dtype)
    k = torch.randn(BATCH, seq, KV_HEADS, DIM, generator=generator).to(dtype)
    v = torch.randn(BATCH, seq, KV_HEADS, DIM, generator=generator).to(dtype)
    grad = torch.randn(BATCH, seq, HEADS, DIM, generator=generator)
    documents = _documents(seq, generator) if packed else None
    scale = DIM**-0.5
    full = [t.float().to(device).requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*full, None if documents is None else documents.to(device), scale)
    expected.backward(grad.to(device))
    local = [shard_sequence(t, rank, cp).to(device).requires_grad_() for t in (q, k, v)]
    shards = None
    if documents is not None:
        shards = torch.stack([shard_sequence(documents, r, cp) for r in range(cp)]).to(device)
    attention = ring_attention if variant == "ring" else all_gather_attention
    out = attention(*local, group=group, scale=scale, documents=shards)
    out.backward(shard_sequence(grad, rank, cp).to(device).to(dtype))
    worst = (out.float() - shard_sequence(expected, rank, cp)).abs().max().item()
    for mine, theirs in zip(local, full, strict=True):
        worst = max(worst, (mine.grad.float() - shard_sequence(theirs.grad, rank, cp)).abs().max().item())
    ctx.close()
    return worst


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("variant", ["ring", "all_gather"])
def test_nccl_context_attention_equals_full_attention(variant, packed, dtype_name):
    world = gpu_world_size()
    if world < 2:
        pytest.skip(f"context parallelism on GPUs needs 2 of them; {world} visible")
    worst = run_on_ranks(world, lambda: _body(variant, packed, dtype_name, 256), init_process_group=False)
    print(f"{variant}/{'documents' if packed else 'causal'}/{dtype_name} on {world} GPUs: worst {max(worst):.2e}")
    assert max(worst) <= TOLERANCES[dtype_name], worst
