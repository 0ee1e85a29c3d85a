"""Pipeline parallel: what a stage that is not the first one needs of vtc.

Only the first pipeline stage sees a request's media: it encodes the video, compresses it and merges the
embeddings (under vLLM's V2 model runner the later stages do not even hold the vision tower; they hold a
`StageMissingLayer` in its place). Two things follow:

* a stage without the tower skips the vision statistics and the compression (`holds_module`);
* the positions of a compressed prompt's media slots are known only once the first stage has encoded the media
  (`vtc.vllm.positions`), and vLLM computes each stage's positions on its own. So the first stage sends its
  positions on with the hidden states (`positions_to_next_stage`, an extra entry of the intermediate tensors), and
  every later stage uses the ones it receives (`positions_from_previous_stage`): each layer of every stage then
  sees the same positions.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

Tensor = torch.Tensor
STAGE_POSITIONS = "vtc_positions"  # intermediate-tensor entry: the M-RoPE positions [tokens, 3]


def holds_module(module: Any) -> bool:
    """False when `module` is vLLM's placeholder for a part of the model this pipeline stage does not hold."""
    try:
        from vllm.model_executor.models.utils import StageMissingLayer
    except ImportError:  # a vLLM without placeholders builds every part on every stage
        return True
    return not isinstance(module, StageMissingLayer)


def with_stage_positions(make_empty: Callable[..., Any]) -> Callable[..., Any]:
    """A model's `make_empty_intermediate_tensors` with room for the positions a stage receives."""

    @functools.wraps(make_empty)
    def make(batch_size: int, dtype: torch.dtype, device: torch.device):
        tensors = make_empty(batch_size=batch_size, dtype=dtype, device=device)
        tensors[STAGE_POSITIONS] = torch.zeros(batch_size, 3, dtype=torch.long, device=device)
        return tensors

    return make


def positions_from_previous_stage(positions: Tensor, intermediate_tensors: Any) -> tuple[Tensor, Any]:
    """(positions this stage runs with, the intermediate tensors without vtc's entry). When the previous stage sent
    its positions they are copied into `positions` in place: the runner's buffer is what a captured CUDA graph
    reads."""
    if intermediate_tensors is None or STAGE_POSITIONS not in intermediate_tensors.tensors:
        return positions, intermediate_tensors
    tensors = dict(intermediate_tensors.tensors)
    received = tensors.pop(STAGE_POSITIONS)[: positions.shape[-1]]
    positions.copy_(received.T)
    return positions, type(intermediate_tensors)(tensors)


def positions_to_next_stage(output: Any, positions: Tensor) -> Any:
    """`output` with this stage's M-RoPE positions added, when it goes to a next stage (intermediate tensors)."""
    tensors = getattr(output, "tensors", None)
    if isinstance(tensors, dict) and positions.dim() == 2:
        tensors[STAGE_POSITIONS] = positions.T.to(torch.long).contiguous()
    return output
