"""The official repositories' way of computing each shared op, for `vtc bench-kernels`.

Each function here follows the torch operations and the loop structure of one official code (named in its
docstring with repository, commit, file and function), re-expressed for the benchmark: same tensors in, the
same kind of result out as the vtc op it is timed against. They are not ports to use: they keep the official
costs on purpose (a Python loop per pick, `.item()` per iteration, full attention matrices, per-segment calls).

Where an official code draws random numbers (the density noise of DPC-kNN) the function takes a generator
instead of the global RNG, so a benchmark can feed vtc the same draws; that is the only change of substance,
and each docstring says where the shapes or arguments were adapted.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


# --- DivPrune: greedy Max-Min diversity --------------------------------------------------------------------------


def divprune_max_min(dist: Tensor, count: int) -> Tensor:
    """DivPrune's selection loop on a cosine-distance matrix [L, L]: `count` indices in pick order.

    Follows vbdi/divprune @799e2d95, `LLaVA/llava/model/llava_arch.py`, `LlavaMetaForCausalLM.DivPrune`:
    pick 1 is the argmax of every column's second-smallest distance (`topk(2, dim=0, largest=False)`); every
    later pick gathers ALL rows picked so far (`index_select` of the picks `s[:i]`) and takes their column-wise
    `torch.min` before the argmax, so step i reads i rows of L (quadratic in the count). The distance matrix
    is an input (the official builds it just before the loop; vtc's op takes it the same way).
    """
    picks = torch.empty(count, dtype=torch.long, device=dist.device)
    for i in range(count):
        if i == 0:
            scores = torch.topk(dist, 2, dim=0, largest=False).values[1, :]
        else:
            # the official indexes the picks through an arange of the first i positions, then the matrix rows
            picked = torch.index_select(picks, 0, torch.arange(0, i, device=dist.device))
            scores = torch.min(torch.index_select(dist, 0, picked), dim=0).values
        picks[i] = torch.argmax(scores)
    return picks


def divprune_videos(dists: Sequence[Tensor], counts: Sequence[int]) -> list[Tensor]:
    """`divprune_max_min` on each video's own matrix, one call per video (the official prunes one image or video
    token span per call, in a Python loop over the batch)."""
    return [divprune_max_min(d, c) for d, c in zip(dists, counts)]


# --- DPC-kNN density-peak scores (TCFormer's cluster_dpc_knn) -------------------------------------------------------


def cluster_dpc_knn_scores(x: Tensor, k: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Density-peak scores of x [B, N, C] -> (score [B, N], dist [B, N, N]).

    Follows TCFormer's `cluster_dpc_knn` as copied into PruneVid (Visual-AI/PruneVid @b12600c6,
    `models/pllava/modeling_pllava.py`, `cluster_dpc_knn`) and HoliTom (cokeshao/HoliTom @e9b2972f,
    `holitom/llava_arch.py`, `LlavaMetaForCausalLM_holitom.cluster_dpc_knn`): `torch.cdist` in float32 scaled
    by 1/sqrt(C); density from the k nearest (self included) `exp(-mean(d^2))` plus U(0, 1e-6) noise; the
    "higher density" mask as a float matrix multiplied into the distances (`dist * mask + max * (1 - mask)`,
    then `min`); score = delta * density. Stops before the official `topk` of the centers (vtc's op returns
    the scores; the centers are one `topk` on either side). Noise from `generator` instead of the global RNG.
    """
    _, _, dim = x.shape
    dist = torch.cdist(x.float(), x.float()) / (dim**0.5)
    nearest, _ = torch.topk(dist, k=k, dim=-1, largest=False)
    density = (-(nearest**2).mean(dim=-1)).exp()
    noise = torch.rand(density.shape, generator=generator, dtype=density.dtype)
    density = density + noise.to(density.device) * 1e-6
    mask = (density[:, None, :] > density[:, :, None]).type(x.dtype)
    dist_max = dist.flatten(1).max(dim=-1)[0][:, None, None]
    delta, _ = (dist * mask + dist_max * (1 - mask)).min(dim=-1)
    return delta * density, dist


def dpc_knn_segments(
    segments: Sequence[Tensor], k: int, generators: Sequence[torch.Generator] | None = None
) -> list[Tensor]:
    """Scores of each segment [n_s, C], one `cluster_dpc_knn_scores` call per segment: HoliTom calls
    `cluster_dpc_knn` once per temporal window (`holitom`, `merge_tokens_by_density`) and PruneVid once per
    window (`merge_frames_dynamic` -> `spatial_merge_tokens`), each in a Python loop."""
    gens = list(generators) if generators is not None else [None] * len(segments)
    return [cluster_dpc_knn_scores(x[None], min(k, x.shape[0]), g)[0][0] for x, g in zip(segments, gens)]


# --- AOT's Sinkhorn ------------------------------------------------------------------------------------------------


def aot_sinkhorn(cost: Tensor, epsilon: float = 0.1, max_iter: int = 100, thresh: float = 1e-2) -> Tensor:
    """Transport plan [B, M, N] for cost [B, M, N] between uniform marginals.

    Follows TyroneLi/AOT @88455ee3, `LLaVA-NeXT/llava/model/llava_arch.py`: the caller's `K = exp(-cost / eps)`
    and uniform `mu`, `nu` (`ota_merge_time` / `token_merging_siglip_with_OTA`), then `Sinkhorn_v1`: a Python
    loop that updates r = u / (K c), c = v / (K^T r) with `K.permute(0, 2, 1).contiguous()` rebuilt every
    iteration, and a host sync (`err.item()`) per iteration for the stop test; T = (r c^T) * K.
    """
    batch, m, n = cost.shape
    kernel = torch.exp(-cost / epsilon)
    u = torch.full((batch, m), 1.0 / m, dtype=kernel.dtype, device=kernel.device)
    v = torch.full((batch, n), 1.0 / n, dtype=kernel.dtype, device=kernel.device)
    r = torch.ones_like(u)
    c = torch.ones_like(v)
    for _ in range(max_iter):
        r0 = r
        r = u / torch.matmul(kernel, c.unsqueeze(-1)).squeeze(-1)
        c = v / torch.matmul(kernel.permute(0, 2, 1).contiguous(), r.unsqueeze(-1)).squeeze(-1)
        err = (r - r0).abs().mean()
        if err.item() < thresh:
            break
    return torch.matmul(r.unsqueeze(-1), c.unsqueeze(-2)) * kernel


# --- VidCom2: per-frame top-k with per-frame budgets, then one gather -----------------------------------------------


def vidcom2_select(scores: Tensor, ks: Sequence[int]) -> Tensor:
    """Keep the k_f lowest-scored tokens of every frame: global indices [sum k], frame after frame, ascending.

    Follows xuyang-liu16/VidCom2 @944a17d1, `token_compressor/vidcom2/vidcom2.py`: `select_outlier_indices`
    (a Python loop over frames, `torch.topk(scores[i], k, largest=False, sorted=False)` then `.sort()` of each
    frame's indices) and `_map_linear_offset` (frame offsets added per frame, then `torch.cat`). scores [F, P]
    (one row per frame), ks one budget per frame (the official turns its per-frame scales into such a list with
    `.tolist()`).
    """
    per_frame = []
    for i, k in enumerate(ks):
        _, idx = torch.topk(scores[i], k=k, largest=False, sorted=False)
        per_frame.append(idx.sort().values)
    offsets = torch.arange(len(per_frame), device=scores.device) * scores.shape[1]
    return torch.cat([idx + off for idx, off in zip(per_frame, offsets)])


def vidcom2_select_gather(scores: Tensor, ks: Sequence[int], flat: Tensor) -> tuple[Tensor, Tensor]:
    """`vidcom2_select`, then the kept rows of the flat features [F * P, D] (`map_features`' `flat[global_idx]`):
    (global indices [sum k], rows [sum k, D])."""
    global_idx = vidcom2_select(scores, ks)
    return global_idx, flat[global_idx]


# --- VisionZip: contextual tokens (best match + merge) --------------------------------------------------------------


def visionzip_contextual(metric: Tensor, hidden: Tensor, contextual_num: int) -> tuple[Tensor, Tensor, Tensor]:
    """VisionZip's contextual-token merge on each frame's non-dominant tokens.

    Follows dvlab-research/VisionZip @3151f6df, `visionzip/clip_encoder.py`, `CLIPVisionTower_VisionZip.forward`
    ("Contextual Visual Tokens"): keys normalised by their norm (no epsilon); targets every `step`-th token;
    the other tokens found with `torch.isin`; their best target by `bmm` + `argmax`; a one-hot assignment
    built with `scatter_`; per-target counts; the merged sum by a second `bmm` divided by the counts; the
    contextual token = target + that mean. metric [B, n, d] (attention keys), hidden [B, n, D] (features).
    Returns (contextual tokens [B, c, D], target indices [c], best target of every other token [B, n - c]).
    """
    metric_normalized = metric / metric.norm(dim=-1, keepdim=True)
    n = metric_normalized.shape[1]
    step = max(1, n // contextual_num)
    target_indices = torch.arange(0, n, step, device=metric.device)[:contextual_num]
    target_tokens = metric_normalized[:, target_indices, :]
    others = ~torch.isin(torch.arange(n, device=metric.device), target_indices)
    tokens_to_merge = metric_normalized[:, others, :]
    similarity = torch.bmm(tokens_to_merge, target_tokens.transpose(1, 2))
    best = similarity.argmax(dim=2)
    assign_one_hot = torch.zeros(
        tokens_to_merge.shape[0], tokens_to_merge.shape[1], contextual_num, dtype=hidden.dtype, device=metric.device
    )
    assign_one_hot.scatter_(2, best.unsqueeze(-1), 1)
    counts = assign_one_hot.sum(dim=1).clamp(min=1).unsqueeze(-1)
    hidden_to_merge = hidden[:, ~torch.isin(torch.arange(hidden.shape[1], device=hidden.device), target_indices), :]
    aggregated = torch.bmm(assign_one_hot.transpose(1, 2), hidden_to_merge) / counts
    return hidden[:, target_indices, :] + aggregated, target_indices, best


# --- adjacent-frame cosine -----------------------------------------------------------------------------------------


def holitom_frame_similarity(x: Tensor) -> Tensor:
    """x [T, P, D] -> [T - 1, P]: cosine of each patch with the same patch in the next frame.

    Follows cokeshao/HoliTom @e9b2972f, `holitom/llava_arch.py`, `prepare_inputs_labels_for_multimodal`:
    `F.normalize(p=2, dim=-1)` of the pooled frame features, then `F.cosine_similarity(x[:-1], x[1:], dim=-1)`
    (already vectorised over frames in the official code)."""
    normed = F.normalize(x, p=2, dim=-1)
    return F.cosine_similarity(normed[:-1], normed[1:], dim=-1)


def dycoke_pair_similarity(image_feature: Tensor, tokens_per_frame: int) -> Tensor:
    """DyCoke's first-pass frame-pair similarity: [T * P, D] -> [floor(T / 2), P], pairs (0, 1), (2, 3), ...

    Follows KD-TAO/DyCoke @dd746349, `llava/model/llava_arch.py`, `dycole_ttm`: a Python loop over the even
    frames, slicing both frames of the pair out of the flat features, `F.normalize` of each, then
    `F.cosine_similarity(dim=1)`; the list is stacked after copying every entry (the official wraps each in
    `torch.tensor(...)`, a copy)."""
    num_frames = image_feature.shape[0] // tokens_per_frame
    similarities = []
    for i in range(0, num_frames - 1, 2):
        frame1 = image_feature[i * tokens_per_frame : (i + 1) * tokens_per_frame]
        frame2 = image_feature[(i + 1) * tokens_per_frame : (i + 2) * tokens_per_frame]
        frame1_norm = F.normalize(frame1, p=2, dim=1)
        frame2_norm = F.normalize(frame2, p=2, dim=1)
        similarities.append(F.cosine_similarity(frame1_norm, frame2_norm, dim=1))
    return torch.stack([s.clone() for s in similarities])


# --- StreamingTOM OQM: group quantisation of the KV cache -----------------------------------------------------------


def oqm_quantize(tensor: Tensor, bits: int = 4, group_size: int = 50) -> tuple[Tensor, Tensor, Tensor]:
    """KV [B, H, S, D] -> (packed uint8 [B, H, S / p, D], scales [B, H, S / g, D], mins [B, H, S / g, D]).

    Follows YIGE24/StreamingTOM @6c66b05, `streamingtom/modules/oqm.py`, `OQM._quantize_tensor` and
    `OQM._pack_Nbit` (read through the code index; the repository itself could not be fetched here): the
    tensor is permuted to [B, H, D, S] and made contiguous, cut into groups of `group_size` tokens, min-max
    quantised in the tensor's dtype (scale floored at 1e-8, clamp, `round_`, uint8), packed along the tokens
    by shifting each of the p = 8 / bits codes and summing, and the packed codes, scales and minima are
    permuted back (the packed codes made contiguous again)."""
    b, h, s, d = tensor.shape
    levels = 2**bits - 1
    pack = 8 // bits
    groups = s // group_size
    flat = tensor.permute(0, 1, 3, 2).contiguous().reshape(b * h * d, groups, group_size)
    mins = flat.min(dim=-1)[0]
    maxs = flat.max(dim=-1)[0]
    scales = torch.clamp((maxs - mins) / levels, min=1e-8)
    normalized = (flat - mins.unsqueeze(-1)) / scales.unsqueeze(-1)
    quantized = normalized.clamp(0, levels).round_().to(torch.uint8).reshape(b, h, d, s)
    # _pack_Nbit: p consecutive tokens per byte, token i of the byte shifted by i * bits
    shifts = torch.arange(pack, device=tensor.device) * bits
    packed = (quantized.reshape(b, h, d, s // pack, pack) << shifts).sum(dim=-1).to(torch.uint8)
    scales = scales.reshape(b, h, d, groups).permute(0, 1, 3, 2)
    mins = mins.reshape(b, h, d, groups).permute(0, 1, 3, 2)
    return packed.permute(0, 1, 3, 2).contiguous(), scales, mins


def oqm_dequantize(packed: Tensor, scales: Tensor, mins: Tensor, bits: int = 4, group_size: int = 50) -> Tensor:
    """The inverse: [B, H, S, D] in the scales' dtype.

    Follows YIGE24/StreamingTOM @6c66b05, `streamingtom/modules/oqm.py`, `OQM._dequantize_tensor` and
    `OQM._unpack_Nbit` (read through the code index): packed codes permuted to [B, H, D, S / p] and made
    contiguous, unpacked by expanding every byte p times and shifting, reshaped into groups, cast to the scales'
    dtype, `q * scale + min`, then permuted back to [B, H, S, D] and made contiguous."""
    b, h, _, d = packed.shape
    pack = 8 // bits
    mask = (1 << bits) - 1
    packed = packed.permute(0, 1, 3, 2).contiguous()
    n = packed.shape[-1]
    s = n * pack
    groups = s // group_size
    shifts = torch.arange(pack, device=packed.device) * bits
    unpacked = ((packed.unsqueeze(-1).expand(b, h, d, n, pack) >> shifts) & mask).reshape(b, h, d, s)
    codes = unpacked.reshape(b * h * d, groups, group_size).to(scales.dtype)
    scales_flat = scales.permute(0, 1, 3, 2).reshape(b * h * d, groups)
    mins_flat = mins.permute(0, 1, 3, 2).reshape(b * h * d, groups)
    out = codes * scales_flat.unsqueeze(-1) + mins_flat.unsqueeze(-1)
    return out.reshape(b, h, d, s).permute(0, 1, 3, 2).contiguous()


# --- FastV: attention of the last prompt token, from the full eager attention matrix -------------------------------


def causal_additive_mask(n: int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """The [1, 1, n, n] additive causal mask (dtype's minimum above the diagonal) that the official LLaMA code
    (`_prepare_decoder_attention_mask`) builds once per forward and adds in every layer's eager attention."""
    mask = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return mask[None, None]


def fastv_last_token_topk(
    query: Tensor, key: Tensor, mask: Tensor, image_start: int, image_len: int, rank: int
) -> Tensor:
    """FastV's token ranking at the pruning layer: indices (into the sequence) of the `rank` image tokens the last
    token attends to most, averaged over heads.

    Follows pkunlp-icler/FastV @d1659729, `src/transformers/src/transformers/models/llama/modeling_llama.py`:
    `LlamaAttention.forward` with output_attentions (`repeat_kv` of the keys by expand + reshape, the full
    [B, H, n, n] `matmul / sqrt(head_dim)`, the additive mask, softmax in float32 cast back to the model dtype),
    then `LlamaModel.forward` at AGG_LAYER: `mean(dim=1)[0]` over heads, the last row, the image slice,
    `topk(ATTENTION_RANK)` + SYS_LENGTH. The eager layer's `attn_weights @ value` is left out: the layer
    output is not part of the ranking, and vtc computes it with SDPA either way.
    query [B, H, n, d], key [B, Hkv, n, d] (post-RoPE), mask [B or 1, 1, n, n] additive.
    """
    batch, kv_heads, n, head_dim = key.shape
    n_rep = query.shape[1] // kv_heads
    if n_rep > 1:  # repeat_kv
        key = key[:, :, None, :, :].expand(batch, kv_heads, n_rep, n, head_dim).reshape(batch, -1, n, head_dim)
    weights = torch.matmul(query, key.transpose(2, 3)) / math.sqrt(head_dim)
    weights = weights + mask
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    last = torch.mean(weights, dim=1)[0][-1]
    return last[image_start : image_start + image_len].topk(rank).indices + image_start
