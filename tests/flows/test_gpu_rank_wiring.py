"""The packed causal-LM task on a GPU: a micro-batch that arrives on the host reaches the model without synchronizing
the stream (run on the GPU machine; skipped cleanly without CUDA).

A blocking host-to-device copy waits for every kernel queued before it, so each micro-batch, and in a pipeline each
forward action, would start with the GPU drained and the host launching into an idle device. The check runs the
task's calls under `torch.cuda.set_sync_debug_mode("error")`, which raises at synchronizing CUDA calls (a blocking
host-to-device copy goes through `memcpy_and_sync`, which checks the mode), and compares the loss with the same
batch handed over on the device beforehand: the same kernels on the same values, so the sums must be equal.
"""

import pytest
import torch

from d9d.flows.jobs.rank_wiring import PackedCausalLMTask
from d9d.models import DecoderConfig, materialize_
from d9d.models.qwen3 import Qwen3DenseForCausalLM, Qwen3DenseParameters
from d9d.pipeline import PipelineStage

pytestmark = pytest.mark.gpu

PARAMS = Qwen3DenseParameters(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)


def _batch() -> dict[str, torch.Tensor]:
    """Two packed rows of 64 tokens, three documents in the first, on the host (as the data loader yields them)."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, PARAMS.vocab_size, (2, 64), generator=generator)
    document_ids = torch.stack([torch.repeat_interleave(torch.arange(3), torch.tensor([20, 30, 14])), torch.zeros(64)])
    document_ids = document_ids.long()
    position_ids = torch.stack([torch.cat([torch.arange(20), torch.arange(30), torch.arange(14)]), torch.arange(64)])
    labels = input_ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "document_ids": document_ids}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_batches_reach_the_model_without_a_stream_sync():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen3DenseForCausalLM(PARAMS, config=DecoderConfig())
    materialize_(model, "cuda")
    task = PackedCausalLMTask(hidden_size=PARAMS.hidden_size)
    batch = _batch()
    on_device = {name: tensor.cuda() for name, tensor in batch.items()}
    expected = task.compute_loss(model, on_device).loss_sum
    # Warm-up outside the check: the first calls initialize kernels and caches (which may synchronize once).
    task.compute_loss(model, batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        from_host = task.compute_loss(model, batch).loss_sum
        staged = task.forward_stage(model, batch, stage=PipelineStage(0, 1), hidden=None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not isinstance(staged, torch.Tensor)
    assert torch.equal(from_host, expected)
    assert torch.equal(staged.loss_sum, expected)
