"""vtc_kernels: tensor ops shared by compression methods and vtc's runtime.

Each op is a torch reference (the spec, runs anywhere) declared with `dispatch.kernel_op`; where it pays, a
Triton kernel in `vtc_kernels.triton.<topic>` is picked automatically on CUDA tensors (`use_backend` overrides,
see `vtc_kernels.dispatch`). Each op states its tolerance contract next to it. Tests compare every op with a
straightforward loop and every kernel with its reference, and every op has a caller (a plugin or the runtime).
See docs/kernels.md.
"""

from vtc_kernels.attention import attention_rows
from vtc_kernels.clustering import assign_to_centers, dpc_knn_centers, dpc_knn_scores
from vtc_kernels.dispatch import Tolerance, kernel_ops, trace, use_backend
from vtc_kernels.diverse import cosine_distance_matrix, max_min_select
from vtc_kernels.matching import best_match
from vtc_kernels.merge import chain_anchors, mean_into_anchors, merge_into_anchors
from vtc_kernels.quant import QuantizedGroups, dequantize_groups, quantize_groups
from vtc_kernels.select import reconcile_count, segmented_topk, topk_gather, topk_indices, topk_mask
from vtc_kernels.similarity import (
    adjacent_frame_similarity,
    chain_order,
    chain_similarity,
    cosine,
    frame_cosine,
)
from vtc_kernels.transport import sinkhorn

__all__ = [
    "QuantizedGroups",
    "Tolerance",
    "adjacent_frame_similarity",
    "assign_to_centers",
    "attention_rows",
    "best_match",
    "chain_anchors",
    "chain_order",
    "chain_similarity",
    "cosine",
    "cosine_distance_matrix",
    "dequantize_groups",
    "dpc_knn_centers",
    "dpc_knn_scores",
    "frame_cosine",
    "kernel_ops",
    "max_min_select",
    "mean_into_anchors",
    "merge_into_anchors",
    "quantize_groups",
    "reconcile_count",
    "segmented_topk",
    "sinkhorn",
    "topk_gather",
    "topk_indices",
    "topk_mask",
    "trace",
    "use_backend",
]
