"""vtc_kernels: tensor ops shared by compression methods.

Each op is a plain torch function (the reference, runs anywhere); fused Triton versions will sit beside
their reference and be selected on CUDA tensors. Tests compare every op with a straightforward loop.
"""

from vtc_kernels.clustering import assign_to_centers, dpc_knn_centers, dpc_knn_scores
from vtc_kernels.matching import bipartite_soft_matching
from vtc_kernels.merge import chain_anchors, chain_merge_mean, scatter_mean
from vtc_kernels.select import gather_tokens, reconcile_count, topk_indices, topk_mask
from vtc_kernels.similarity import adjacent_frame_similarity, chain_order, chain_similarity, cosine
from vtc_kernels.transport import sinkhorn

__all__ = [
    "adjacent_frame_similarity",
    "assign_to_centers",
    "bipartite_soft_matching",
    "dpc_knn_centers",
    "dpc_knn_scores",
    "reconcile_count",
    "sinkhorn",
    "chain_anchors",
    "chain_merge_mean",
    "chain_order",
    "chain_similarity",
    "cosine",
    "gather_tokens",
    "scatter_mean",
    "topk_indices",
    "topk_mask",
]
