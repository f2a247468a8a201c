"""Model building blocks and the d9d model catalogue (Qwen3 dense and MoE).

Build on the meta device, parallelise, materialise:

    with torch.device("meta"):
        model = Qwen3DenseForCausalLM(params, config=DecoderConfig(), stage=PipelineStage(0, 1))
    parallelize_qwen3_dense(model, ctx, FsdpConfig())      # optional
    materialize_(model, ctx.device)
"""

from d9d.models.blocks.late_init import materialize_
from d9d.models.config import DecoderConfig
from d9d.models.roles import Role
from d9d.models.stage import PipelineStage

__all__ = ["DecoderConfig", "PipelineStage", "Role", "materialize_"]
