"""vtc_kernels: tensor ops shared by compression methods and vtc's runtime.

Each op is a plain torch function (the reference, runs anywhere); fused Triton versions will sit beside
their reference and be selected on CUDA tensors. Tests compare every op with a straightforward loop, and
every op has a caller (a plugin or the runtime).
"""

from vtc_kernels.clustering import assign_to_centers, dpc_knn_centers, dpc_knn_scores
from vtc_kernels.merge import chain_anchors, mean_into_anchors
from vtc_kernels.quant import QuantizedGroups, concat_groups, dequantize_groups, quantize_groups
from vtc_kernels.select import reconcile_count, topk_indices, topk_mask
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
    "adjacent_frame_similarity",
    "assign_to_centers",
    "chain_anchors",
    "chain_order",
    "chain_similarity",
    "concat_groups",
    "cosine",
    "dequantize_groups",
    "dpc_knn_centers",
    "dpc_knn_scores",
    "frame_cosine",
    "mean_into_anchors",
    "quantize_groups",
    "reconcile_count",
    "sinkhorn",
    "topk_indices",
    "topk_mask",
]
