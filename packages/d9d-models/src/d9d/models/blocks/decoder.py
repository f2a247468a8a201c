"""The decoder skeleton every causal LM in the catalogue shares: stage-aware backbone and LM-head wrapper.

A model file supplies its layer (what differs between families); this block owns the rest: the embedding on the
first stage, this stage's layers (with role and activation-checkpointing set), the final norm and LM head on the last
stage, positions, RoPE tables and the document mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from d9d.models.blocks.checkpointing import CheckpointPolicy, run_layer, set_activation_checkpointing
from d9d.models.blocks.compilation import compile_layer
from d9d.models.blocks.embedding import SplitTokenEmbedding
from d9d.models.blocks.head import SplitLanguageModellingHead
from d9d.models.blocks.inputs import CausalLMOutput, causal_mask, resolve_positions
from d9d.models.blocks.kernels import apply_block_kernels, build_block_kernels
from d9d.models.blocks.norm import RMSNorm
from d9d.models.blocks.rope import RotaryEmbedding
from d9d.models.config import DecoderConfig
from d9d.models.roles import Role, with_role
from d9d.models.stage import PipelineStage


class DecoderParameters(Protocol):
    """What the skeleton reads from a model family's `*Parameters`."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def init_std(self) -> float: ...
    def segments(self) -> dict[str, int]: ...


class DecoderBackbone(nn.Module):
    """Embedding (first stage), this stage's layers, final norm (last stage); `(batch, seq, hidden)` out."""

    def __init__(
        self,
        params: DecoderParameters,
        *,
        config: DecoderConfig,
        stage: PipelineStage,
        rotary: RotaryEmbedding,
        build_layer: Callable[[int], nn.Module],
    ) -> None:
        super().__init__()
        self.params, self.stage = params, stage
        self.embed_tokens = (
            with_role(
                SplitTokenEmbedding(params.segments(), params.hidden_size, init_std=params.init_std), Role.EMBEDDING
            )
            if stage.is_first
            else None
        )
        self.rotary_emb = rotary
        self.layers = nn.ModuleDict()
        for index in stage.layers(params.num_layers):
            layer = with_role(build_layer(index), Role.DECODER_LAYER)
            checkpointed = config.checkpoints_layer(index)
            set_activation_checkpointing(layer, CheckpointPolicy(config.checkpoint_policy) if checkpointed else False)
            if config.compile_layers:
                compile_layer(layer, backend=config.compile_backend)
            self.layers[str(index)] = layer
        self.norm = RMSNorm(params.hidden_size, eps=params.rms_norm_eps) if stage.is_last else None
        apply_block_kernels(self, build_block_kernels(config))
        # Set by a context-parallel plan: each rank then holds a shard of every sequence, whose positions cannot be
        # derived locally (see d9d.parallel.context.shard_batch_for_context).
        self.sequence_sharded = False
        # Set by a tensor-parallel plan: the 1-D `tp` mesh on which the activations between blocks are `Shard(1)`
        # DTensors (sequence parallelism). Pipeline stages hand over plain tensors, so a stage returns its rank's
        # local sequence shard `(batch, seq / tp, hidden)` and the next stage wraps the one it receives back.
        self.sequence_parallel_mesh: DeviceMesh | None = None

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`input_ids` on the first stage, else the previous stage's `hidden_states`."""
        if self.embed_tokens is not None:
            if input_ids is None:
                raise ValueError("the first stage needs input_ids")
            hidden: torch.Tensor = self.embed_tokens(input_ids)
        elif hidden_states is not None:
            hidden = hidden_states
            if self.sequence_parallel_mesh is not None and not isinstance(hidden, DTensor):
                hidden = DTensor.from_local(hidden, self.sequence_parallel_mesh, (Shard(1),), run_check=False)
        else:
            raise ValueError(
                f"stage {self.stage.index} of {self.stage.count} needs hidden_states from the previous stage"
            )
        batch, seq = hidden.shape[:2]
        if self.sequence_sharded and position_ids is None:
            raise ValueError(
                "this model runs context-parallel (each rank holds a shard of every sequence), so the batch must "
                "carry position_ids computed on the full sequence; prepare batches with "
                "d9d.parallel.context.shard_batch_for_context or ContextParallelDataSource"
            )
        positions = resolve_positions(batch, seq, hidden.device, position_ids, document_ids)
        rope = self.rotary_emb(positions, hidden.dtype)
        mask = causal_mask(document_ids)
        for layer in self.layers.values():
            hidden = run_layer(layer, hidden, rope, mask)
        if self.norm is not None:
            normed: torch.Tensor = self.norm(hidden)
            return normed
        if isinstance(hidden, DTensor):  # a stage boundary under sequence parallelism: hand over the local shard
            return hidden.to_local()
        return hidden


class DecoderForCausalLM(nn.Module):
    """Backbone plus the LM head (last stage). Returns the losses (per token and their sum) when given labels,
    else logits."""

    def __init__(
        self, backbone: DecoderBackbone, params: DecoderParameters, *, config: DecoderConfig, stage: PipelineStage
    ) -> None:
        super().__init__()
        self.model = backbone
        self.lm_head = (
            with_role(
                SplitLanguageModellingHead(
                    params.segments(),
                    params.hidden_size,
                    init_std=params.init_std,
                    loss_chunk_size=config.loss_chunk_size,
                    loss_gradients_in_forward=config.loss_gradients_in_forward,
                ),
                Role.LM_HEAD,
            )
            if stage.is_last
            else None
        )
        if self.lm_head is not None:
            apply_block_kernels(self.lm_head, build_block_kernels(config))

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """`labels[b, t]` is the target of position `t` (already shifted), -100 for none."""
        hidden = self.model(
            input_ids, hidden_states=hidden_states, position_ids=position_ids, document_ids=document_ids
        )
        if self.lm_head is None:
            return CausalLMOutput(hidden_states=hidden)
        if labels is not None:
            loss = self.lm_head(hidden, labels)
            return CausalLMOutput(losses=loss.losses, loss_sum=loss.loss_sum)
        return CausalLMOutput(logits=self.lm_head(hidden))  # through forward: FSDP gathers the head's weight
