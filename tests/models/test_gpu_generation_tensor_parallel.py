"""Generation on a tensor-parallel Qwen3 on CUDA + NCCL (run on the GPU machine; skipped cleanly without 2 GPUs).

tp=2 (x dp_shard=2 with 4 GPUs), dense and MoE, loaded from a transformers checkpoint: greedy and seeded sampled
tokens equal single-GPU generation on the same weights and are identical on every rank; logits within 1e-4 (float32
with TF32 off; NCCL's all-reduce sums in another order than the CPU test's gloo, whose bound is 1e-5). Then the
compiled decode step (`compile=True`) under tp gives the eager tokens.
"""

import os

import pytest
import torch
import torch.distributed as dist
from tiny import EAGER, d9d_from_hf, hf_dense, hf_moe

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.testing import gpu_world_size, run_on_ranks
from d9d.models import materialize_
from d9d.models.generation import GenerationConfig, SamplingConfig, generate
from d9d.models.qwen3 import (
    Qwen3DenseForCausalLM,
    Qwen3MoeForCausalLM,
    detect_experts_format,
    mapper_from_huggingface_qwen3_dense,
    mapper_from_huggingface_qwen3_moe,
    parallelize_qwen3_dense,
    parallelize_qwen3_moe,
    qwen3_dense_parameters_from_hf,
    qwen3_moe_parameters_from_hf,
)
from d9d.parallel import FsdpConfig
from d9d.parallel.tensor import TensorParallelConfig
from d9d.states import load_model_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*:UserWarning"),
    pytest.mark.filterwarnings("ignore:Slicing a flattened dim:UserWarning"),
]

PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [12, 7], [33, 2, 71]]
NEW = 12


def _world() -> int:
    world = gpu_world_size()
    if world < 2:
        pytest.skip(f"needs 2 GPUs; {world} visible")
    return world


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_nccl_tp_generation_equals_single_gpu(family, tmp_path):
    world = _world()
    hf = hf_dense(seed=5, num_hidden_layers=2) if family == "dense" else hf_moe(seed=5, num_hidden_layers=2)
    hf.save_pretrained(tmp_path / "hf")
    greedy = GenerationConfig(max_new_tokens=NEW)
    sampled = GenerationConfig(
        max_new_tokens=NEW, sampling=SamplingConfig(do_sample=True, temperature=1.3, top_p=0.95), seed=11
    )

    def body():
        os.environ["D9D_DEVICE"] = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = False
        config = hf.config.to_dict()
        ctx = DistributedContext.build(MeshDegrees(dp_shard=world // 2, tp=2), device="cuda")
        if family == "dense":
            params = qwen3_dense_parameters_from_hf(config)
            cls, parallelize = Qwen3DenseForCausalLM, parallelize_qwen3_dense
            mapper = mapper_from_huggingface_qwen3_dense(params)
        else:
            from safetensors.torch import load_file

            params = qwen3_moe_parameters_from_hf(config)
            cls, parallelize = Qwen3MoeForCausalLM, parallelize_qwen3_moe
            on_disk = {}
            for file in (tmp_path / "hf").glob("*.safetensors"):
                on_disk.update(load_file(file))
            mapper = mapper_from_huggingface_qwen3_moe(params, experts_format=detect_experts_format(on_disk))
        with torch.device("meta"):
            model = cls(params, config=EAGER)
        parallelize(model, ctx, FsdpConfig(), tensor_parallel=TensorParallelConfig(sequence_parallel=False))
        materialize_(model, "cuda")
        load_model_state(tmp_path / "hf", model, mapper)
        model.eval()
        group = dist.group.WORLD
        ours = generate(model, PROMPTS, greedy, process_group=group, return_logits=True)
        drawn = generate(model, PROMPTS, sampled, process_group=group).tokens
        try:  # reported after the eager parity, so a compile failure does not hide it
            compiled = generate(model, PROMPTS, greedy.model_copy(update={"compile": True}), process_group=group).tokens
        except Exception as error:  # any compile failure is the finding
            compiled = f"{type(error).__name__}: {error}"
        ctx.close()
        return ours.tokens, ours.logits.cpu(), drawn, compiled

    results = run_on_ranks(world, body, init_process_group=False, timeout_seconds=600)
    torch.backends.cuda.matmul.allow_tf32 = False
    reference, _ = d9d_from_hf(hf)
    reference = reference.cuda()
    expected = generate(reference, PROMPTS, greedy, return_logits=True)
    expected_drawn = generate(reference, PROMPTS, sampled).tokens
    for tokens, logits, drawn, _ in results:  # every rank holds the same tokens
        assert tokens == expected.tokens
        torch.testing.assert_close(logits, expected.logits.cpu(), atol=1e-4, rtol=1e-4)
        assert drawn == expected_drawn
    for *_, compiled in results:
        assert compiled == expected.tokens
