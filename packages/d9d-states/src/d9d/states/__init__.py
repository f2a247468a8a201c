"""Streaming, graph-based model-state conversion over sharded safetensors.

from d9d.states import convert_checkpoint, load_model_state, mapper as m

convert_checkpoint("hf-model/", "ours/", m.Sequential([...]))   # streams, memory ~ the largest group
load_model_state("ours/", model)                                  # DTensor params read only their shards
"""

from d9d.states import mapper
from d9d.states.convert import ConvertReport, MappingFactory, convert_checkpoint, plan_conversion
from d9d.states.engine.plan import PlannedGroup, StatePlan, plan_states
from d9d.states.engine.stream import StateStream
from d9d.states.errors import CheckpointError, MappingError, StateMismatchError, StatesError
from d9d.states.io.shards import DEFAULT_SHARD_BYTES
from d9d.states.io.source import CheckpointSource
from d9d.states.mapper import ModelStateMapper, StateGroup
from d9d.states.meta import Box, TensorMeta
from d9d.states.module.load import LoadReport, load_model_state, read_model_state
from d9d.states.module.save import SaveReport, save_model_state

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "Box",
    "CheckpointError",
    "CheckpointSource",
    "ConvertReport",
    "LoadReport",
    "MappingError",
    "MappingFactory",
    "ModelStateMapper",
    "PlannedGroup",
    "SaveReport",
    "StateGroup",
    "StateMismatchError",
    "StatePlan",
    "StateStream",
    "StatesError",
    "TensorMeta",
    "convert_checkpoint",
    "load_model_state",
    "mapper",
    "plan_conversion",
    "plan_states",
    "read_model_state",
    "save_model_state",
]
