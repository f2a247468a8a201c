"""Qwen3 dense and Qwen3-MoE: models, Hugging Face mappings, parallel plans."""

from d9d.models.qwen3.dense import Qwen3DenseForCausalLM, Qwen3DenseLayer, Qwen3DenseModel
from d9d.models.qwen3.huggingface import (
    Qwen3Layout,
    Qwen3MoeExpertsFormat,
    detect_experts_format,
    hf_config_from_qwen3_dense,
    hf_config_from_qwen3_moe,
    mapper_from_huggingface_qwen3_dense,
    mapper_from_huggingface_qwen3_moe,
    mapper_to_huggingface_qwen3_dense,
    mapper_to_huggingface_qwen3_moe,
    qwen3_dense_parameters_from_hf,
    qwen3_moe_parameters_from_hf,
)
from d9d.models.qwen3.moe import Qwen3MoeForCausalLM, Qwen3MoeLayer, Qwen3MoeModel
from d9d.models.qwen3.parallelize import parallelize_qwen3_dense, parallelize_qwen3_moe
from d9d.models.qwen3.params import Qwen3DenseParameters, Qwen3MoeParameters
from d9d.models.qwen3.tensor_parallel import (
    TensorParallelPlan,
    apply_qwen3_tensor_parallel,
    check_qwen3_tp_degrees,
    qwen3_dense_tp_plan,
    qwen3_moe_tp_plan,
)

__all__ = [
    "Qwen3DenseForCausalLM",
    "Qwen3DenseLayer",
    "Qwen3DenseModel",
    "Qwen3DenseParameters",
    "Qwen3Layout",
    "Qwen3MoeExpertsFormat",
    "Qwen3MoeForCausalLM",
    "Qwen3MoeLayer",
    "Qwen3MoeModel",
    "Qwen3MoeParameters",
    "TensorParallelPlan",
    "apply_qwen3_tensor_parallel",
    "check_qwen3_tp_degrees",
    "detect_experts_format",
    "hf_config_from_qwen3_dense",
    "hf_config_from_qwen3_moe",
    "mapper_from_huggingface_qwen3_dense",
    "mapper_from_huggingface_qwen3_moe",
    "mapper_to_huggingface_qwen3_dense",
    "mapper_to_huggingface_qwen3_moe",
    "parallelize_qwen3_dense",
    "parallelize_qwen3_moe",
    "qwen3_dense_parameters_from_hf",
    "qwen3_dense_tp_plan",
    "qwen3_moe_parameters_from_hf",
    "qwen3_moe_tp_plan",
]
