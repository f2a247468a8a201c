"""Pipeline parallelism for d9d: programs of typed actions per rank (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZBV,
DualPipeV, forward only), their validator and simulator, split backward, an executor over gloo or NCCL
point-to-point, and a step schedule for the core Trainer.

Imports only d9d.core. See docs/pipeline.md and design note 0008.
"""

from d9d.pipeline.balance import SplitSimulation, simulate_split, suggest_virtual_layers
from d9d.pipeline.build import PipelineAuxLosses, build_pipeline_schedule, pipeline_group, pipeline_upstream_group
from d9d.pipeline.config import (
    AnyScheduleConfig,
    DualPipeVConfig,
    GPipeConfig,
    Interleaved1F1BConfig,
    OneFOneBConfig,
    PipelineConfig,
    PipelinePlan,
    ZeroBubbleH1Config,
    ZeroBubbleVConfig,
    plan_pipeline,
)
from d9d.pipeline.costs import PipelineCosts, WorkCost
from d9d.pipeline.export import gather_pipeline_state, gather_pipeline_tensors
from d9d.pipeline.measure import measure_stage_costs
from d9d.pipeline.runtime.executor import PipelineExecutor, SplitBackward
from d9d.pipeline.runtime.model_view import merge_stage_modules
from d9d.pipeline.runtime.phase import BackwardPhase, backward_phase, current_backward_phase
from d9d.pipeline.runtime.split_backward import backward_input, backward_weight
from d9d.pipeline.runtime.weight_store import (
    PIPELINE_WEIGHT_GRADIENT_SINK,
    WeightGradientStore,
    collecting_weight_gradients,
    deferring_weight_gradients,
    store_backward_input,
    store_backward_weight,
)
from d9d.pipeline.schedule import PipelineSchedule
from d9d.pipeline.stage import SINGLE_STAGE, PipelineStage
from d9d.pipeline.task import ActivationSpec, PipelineTask

__all__ = [
    "PIPELINE_WEIGHT_GRADIENT_SINK",
    "SINGLE_STAGE",
    "ActivationSpec",
    "AnyScheduleConfig",
    "BackwardPhase",
    "DualPipeVConfig",
    "GPipeConfig",
    "Interleaved1F1BConfig",
    "OneFOneBConfig",
    "PipelineAuxLosses",
    "PipelineConfig",
    "PipelineCosts",
    "PipelineExecutor",
    "PipelinePlan",
    "PipelineSchedule",
    "PipelineStage",
    "PipelineTask",
    "SplitBackward",
    "SplitSimulation",
    "WeightGradientStore",
    "WorkCost",
    "ZeroBubbleH1Config",
    "ZeroBubbleVConfig",
    "backward_input",
    "backward_phase",
    "backward_weight",
    "build_pipeline_schedule",
    "collecting_weight_gradients",
    "current_backward_phase",
    "deferring_weight_gradients",
    "gather_pipeline_state",
    "gather_pipeline_tensors",
    "measure_stage_costs",
    "merge_stage_modules",
    "pipeline_group",
    "pipeline_upstream_group",
    "plan_pipeline",
    "simulate_split",
    "store_backward_input",
    "store_backward_weight",
    "suggest_virtual_layers",
]
