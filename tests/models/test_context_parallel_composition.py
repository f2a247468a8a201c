"""Context parallelism composed with LoRA fine-tuning, the Inference loop and Hugging Face export (cp=2 x dp_shard=2,
4 gloo ranks, tiny Qwen3 dense on packed documents), each against one process on the same data.

LoRA adapters on the attention projections train under cp exactly as in one process (losses within 1e-5, float32,
summation order only); the Inference loop's token-weighted loss over cp shards equals the whole-batch loss (1e-5);
the merged model exported through d9d-states to the Hugging Face layout (DTensor shards gathered) holds the
reference's merged weights (1e-5: Adam on adapters whose gradients sit at the noise level, see
tests/peft/test_data_parallel.py, stays well below this over 4 steps).
"""

import pytest
import torch
import torch.distributed as dist
from cp_workload import (
    DENSE_HF,
    VOCAB,
    PackedTask,
    build_tiny,
    data_provider_for,
    packed_global_batch,
    train_distributed,
    train_reference,
)
from safetensors.torch import load_file

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import Inference
from d9d.models import materialize_
from d9d.models.qwen3 import mapper_to_huggingface_qwen3_dense, parallelize_qwen3_dense, qwen3_dense_parameters_from_hf
from d9d.parallel import FsdpConfig
from d9d.parallel.context import ContextParallelConfig
from d9d.peft import (
    LoRAConfig,
    LoRAParameters,
    adapter_state_names,
    build_peft_method,
    inject_peft_and_freeze,
    merge_peft,
)
from d9d.states import save_model_state

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")

STEPS, ROWS = 4, 4
TOLERANCE = 1e-5


def _lora():
    config = LoRAConfig(module_name_pattern=r".*\.self_attn\.(q|k|v|o)_proj", params=LoRAParameters(r=4, alpha=8))
    method = build_peft_method(config)
    return method, lambda model: inject_peft_and_freeze(method, model)


def _reference_evaluation(model, steps: int) -> float:
    total, tokens = 0.0, 0
    with torch.no_grad():
        for step in range(steps):
            batch = packed_global_batch(step, ROWS)
            total += float(
                model(batch["input_ids"], document_ids=batch["document_ids"], labels=batch["labels"]).losses.sum()
            )
            tokens += int((batch["labels"] != -100).sum())
    return total / tokens


@pytest.mark.distributed(world_size=4, timeout=400)
def test_lora_inference_and_hf_export_under_cp2_dp2_equal_one_process(tmp_path):
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2, cp=2), device="cpu")
    method, prepare = _lora()
    run = train_distributed(ctx, "dense", STEPS, ROWS, "ring", prepare=prepare)
    frozen = [name for name, param in run.model.named_parameters() if not param.requires_grad]
    assert frozen and all("lora" not in name for name in frozen)

    evaluation = Inference(ctx, model=run.model, task=PackedTask(), data=data_provider_for(ROWS, 1)(ctx, 2)).run(2)

    merge_peft(method, run.model)
    adapters = adapter_state_names(run.model)
    merged = {name: value for name, value in run.model.state_dict().items() if name not in adapters}
    params = qwen3_dense_parameters_from_hf(DENSE_HF)
    save_model_state(tmp_path / "hf", merged, mapper_to_huggingface_qwen3_dense(params))

    if ctx.rank == 0:
        reference_method, reference_prepare = _lora()
        reference = train_reference("dense", STEPS, ROWS, prepare=reference_prepare)
        worst = max(abs(a - b) for a, b in zip(run.losses, reference.losses, strict=True))
        assert worst <= TOLERANCE, (run.losses, reference.losses)
        reference.model.eval()
        expected_evaluation = _reference_evaluation(reference.model, 2)
        assert abs(evaluation.loss - expected_evaluation) <= TOLERANCE, (evaluation.loss, expected_evaluation)

        merge_peft(reference_method, reference.model)
        exported = {}
        for file in sorted((tmp_path / "hf").glob("*.safetensors")):
            exported.update(load_file(file))
        expected = mapper_to_huggingface_qwen3_dense(params)
        for group in expected.state_dependency_groups():
            mapped = expected.apply({name: reference.model.state_dict()[name] for name in group.inputs})
            for name, value in mapped.items():
                torch.testing.assert_close(exported[name], value, rtol=0, atol=TOLERANCE, msg=name)
        assert exported["model.embed_tokens.weight"].shape[0] == VOCAB
        print(f"LoRA x cp: max loss diff {worst:.2e}; inference {abs(evaluation.loss - expected_evaluation):.2e}")
    dist.barrier()


@pytest.mark.distributed(world_size=2, timeout=120)
def test_a_sequence_sharded_model_refuses_batches_without_global_positions():
    ctx = DistributedContext.build(MeshDegrees(cp=2), device="cpu")
    model = build_tiny("dense")
    parallelize_qwen3_dense(model, ctx, FsdpConfig(), context=ContextParallelConfig(attention="all_gather"))
    materialize_(model, ctx.device)
    assert {type(module.backend).__name__ for module in model.modules() if hasattr(module, "backend")} == {
        "ContextParallelAttention"
    }
    with pytest.raises(ValueError, match="must carry position_ids"):
        model(torch.zeros(1, 4, dtype=torch.long))
