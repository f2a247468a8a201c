"""Wires d9d-pipeline's split backward into d9d-kernels, which never import the pipeline: the one place that does.

Two registrations, both made on import (every block that can take part imports this module):
- the backward phase (`d9d.kernels.split_backward`): kernels with hand-written halves (the fused loss) skip the half
  the graph-walk split's current pass ignores;
- the weight-gradient sink (`d9d.kernels.weight_gradient_sink`): under the weight-gradient store (design note 0024)
  the deferrable linears and grouped experts queue their weight gradients in the store.
"""

from __future__ import annotations

from d9d.kernels.split_backward import register_backward_halves
from d9d.kernels.weight_gradient_sink import register_weight_gradient_sink
from d9d.pipeline.runtime.phase import BackwardPhase, current_backward_phase
from d9d.pipeline.runtime.weight_store import PIPELINE_WEIGHT_GRADIENT_SINK


def _pipeline_backward_halves() -> tuple[bool, bool]:
    phase = current_backward_phase()
    return phase is not BackwardPhase.WEIGHT, phase is not BackwardPhase.INPUT


register_backward_halves(_pipeline_backward_halves)
register_weight_gradient_sink(PIPELINE_WEIGHT_GRADIENT_SINK)
