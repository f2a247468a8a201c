"""The execution engine: `Trainer` and `Inference` over injected providers, typed events, schedules."""

from d9d.core.loop.config import CheckpointingConfig, NonFiniteConfig, TrainerConfig
from d9d.core.loop.cuda_graph import CudaGraphedStep
from d9d.core.loop.defaults import NoGradientSync, clip_grad_norm_torch
from d9d.core.loop.evaluation import EvaluationResult, evaluate
from d9d.core.loop.events import (
    CheckpointSaved,
    CheckpointStarted,
    CheckpointWritten,
    EventBus,
    ForwardBackwardFinished,
    OptimizerStepped,
    StepFinished,
    StepSkipped,
    StepStarted,
    TrainingFinished,
    TrainingStarted,
    ValidationFinished,
)
from d9d.core.loop.inference import Inference
from d9d.core.loop.loader_source import LoaderDataSource, PositionedLoader
from d9d.core.loop.profiling import ProfilingConfig, StepProfiler
from d9d.core.loop.protocols import (
    AuxLossWeighting,
    BuiltModel,
    ByteCountingTask,
    DataProvider,
    DataSource,
    EventSubscriber,
    Exporter,
    GradientClipper,
    GradientSync,
    LossResult,
    LRSchedulerProvider,
    ModelLoader,
    ModelProvider,
    OptimizerProvider,
    Tracker,
    TrainTask,
)
from d9d.core.loop.schedule import AccumulationSchedule, ScheduleResult, StepSchedule
from d9d.core.loop.synthetic import SyntheticTokenSource, TokenBatch, synthetic_global_batch
from d9d.core.loop.trainer import NonFiniteStepError, Trainer, TrainerParts, TrainResult
from d9d.core.loop.wiring import build_trainer, dp_size_of

__all__ = [
    "AccumulationSchedule",
    "AuxLossWeighting",
    "BuiltModel",
    "ByteCountingTask",
    "CheckpointSaved",
    "CheckpointStarted",
    "CheckpointWritten",
    "CheckpointingConfig",
    "CudaGraphedStep",
    "DataProvider",
    "DataSource",
    "EvaluationResult",
    "EventBus",
    "EventSubscriber",
    "Exporter",
    "ForwardBackwardFinished",
    "GradientClipper",
    "GradientSync",
    "Inference",
    "LRSchedulerProvider",
    "LoaderDataSource",
    "LossResult",
    "ModelLoader",
    "ModelProvider",
    "NoGradientSync",
    "NonFiniteConfig",
    "NonFiniteStepError",
    "OptimizerProvider",
    "OptimizerStepped",
    "PositionedLoader",
    "ProfilingConfig",
    "ScheduleResult",
    "StepFinished",
    "StepProfiler",
    "StepSchedule",
    "StepSkipped",
    "StepStarted",
    "SyntheticTokenSource",
    "TokenBatch",
    "Tracker",
    "TrainResult",
    "TrainTask",
    "Trainer",
    "TrainerConfig",
    "TrainerParts",
    "TrainingFinished",
    "TrainingStarted",
    "ValidationFinished",
    "build_trainer",
    "clip_grad_norm_torch",
    "dp_size_of",
    "evaluate",
    "synthetic_global_batch",
]
