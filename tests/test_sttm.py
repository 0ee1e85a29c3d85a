"""STTM: the quadtree and the temporal chains against a transcription of the official code on 96 random videos,
frames whose answer is known (a blank half, a static clip, the two places vtc differs from the official code), the
threshold search and the exact count, and the patched models: what layer 2 receives equals the official function
applied to what the unpatched model gives it, logits match a layer-by-layer reference, a one-frame (T = 1) item
merges spatially, and a video's compressed KV cache answers a second question with only its text tokens run through
the LLM, with the same logits as recomputing everything."""

from __future__ import annotations

import copy
import math

import einops
import pytest
import torch
import torch.nn.functional as F

import vtc
from tests.conftest import model_and_processor, single_inputs
from tests.reference import compressible_video_mask, start
from vtc.core.tokens import Context, VideoTokens
from vtc.testing.fixtures import QUESTIONS, token_grids, videos
from vtc_plugins.sttm import (
    DEFAULT_TAU_S,
    DEFAULT_TAU_T,
    INPUT_TAU_S,
    INPUT_TAU_T,
    STTM,
    STTMConnect,
    build_pyramid,
    exact_count_plan,
    merge_plan,
    merged_count,
    pool_to_even_side,
    pyramid_sizes,
    thresholds_for_count,
    union_min,
)

# --- the official code, transcribed -----------------------------------------------------------------------------------
# HYUNJS/STTM at 00736c795265faea52c576ce32dce9c449af1819: token_merging_utils/quadtree_spatial_merger.py
# (`avgpool_to_even_side_feature`, `pool_to_even_side_index_video`), quadtree_builder.py
# (`quadtree_build_iteration_video`, `quadtree_build_video`) and quadtree_temporal_merger.py
# (`get_cross_frame_node_pairs_fast`, `filter_cross_frame_node_pairs`, `get_merge_dst_idx_safe`,
# `agg_feature_and_metadata`, `cross_frame_node_merging_fast`), with the paths the evaluation runs (weighted_avg=False,
# no positional embeddings, head_dim=None, the fast temporal merger). Two switches, off by default (verbatim):
# `valid_children_only` masks the unused child slots in the stop test, `until_components` runs the union-find loop
# until every kept pair agrees: with both on it is what vtc means to compute.
STRIDE = 2


def official_avgpool_to_even_side_feature(video_feature):
    T, C, ori_h, ori_w = video_feature.shape
    new_h, new_w = math.ceil(ori_h / 2), math.ceil(ori_w / 2)
    device = video_feature.device
    even_height_flag, even_width_flag = ori_h % STRIDE == 0, ori_w % STRIDE == 0
    if even_height_flag and even_width_flag:
        video_feature_next_level = F.avg_pool2d(video_feature, (STRIDE, STRIDE))
    else:
        video_feature_next_level = torch.empty((T, C, new_h, new_w), device=device, dtype=video_feature.dtype)
        if not even_height_flag and even_width_flag:
            top = video_feature[:, :, 0, :]
            top = top.reshape(T, C, new_w, STRIDE).mean(dim=-1)
            video_feature_next_level[:, :, 0, :] = top
            bottom = video_feature[:, :, 1:, :]
            bottom = F.avg_pool2d(bottom, kernel_size=(STRIDE, STRIDE))
            video_feature_next_level[:, :, 1:, :] = bottom
        if even_height_flag and not even_width_flag:
            left = video_feature[:, :, :, 0]
            left = left.reshape(T, C, new_h, STRIDE).mean(dim=-1)
            video_feature_next_level[:, :, :, 0] = left
            right = video_feature[:, :, :, 1:]
            right = F.avg_pool2d(right, kernel_size=(STRIDE, STRIDE))
            video_feature_next_level[:, :, :, 1:] = right
        if not even_height_flag and not even_width_flag:
            video_feature_next_level[:, :, 0, 0] = video_feature[:, :, 0, 0]
            trs = video_feature[:, :, 0, 1:]
            trs = trs.reshape(T, C, new_w - 1, STRIDE).mean(dim=-1)
            video_feature_next_level[:, :, 0, 1:] = trs
            bls = video_feature[:, :, 1:, 0]
            bls = bls.reshape(T, C, new_h - 1, STRIDE).mean(dim=-1)
            video_feature_next_level[:, :, 1:, 0] = bls
            brs = F.avg_pool2d(video_feature[:, :, 1:, 1:], kernel_size=(STRIDE, STRIDE))
            video_feature_next_level[:, :, 1:, 1:] = brs
    return video_feature_next_level


def official_pool_to_even_side_index_video(video_feature, prev_tyxyx_tlbr):
    T, ori_h, ori_w, _ = video_feature.shape
    device = video_feature.device
    new_h, new_w = math.ceil(ori_h / 2), math.ceil(ori_w / 2)
    even_height_flag, even_width_flag = ori_h % STRIDE == 0, ori_w % STRIDE == 0
    if even_height_flag and even_width_flag:
        grid_t = torch.arange(0, T, device=device, dtype=torch.int32)
        grid_y = torch.arange(0, new_h, device=device, dtype=torch.int32) * 2
        grid_x = torch.arange(0, new_w, device=device, dtype=torch.int32) * 2
        gt, gy, gx = torch.meshgrid(grid_t, grid_y, grid_x, indexing="ij")
        top_left = torch.stack([gt, gy, gx], dim=-1).unsqueeze(-2)
        offsets = torch.tensor([[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]], device=device, dtype=torch.int32)
        offsets = offsets.view(1, 1, 1, 4, 3)
        child_tyx_coords = top_left + offsets
        child_tyxyx_tlbr = torch.zeros((T, new_h, new_w, 5), device=device, dtype=torch.int32)
        child_tyxyx_tlbr[:, :, :, 0] = prev_tyxyx_tlbr[:, 0::2, 0::2, 0]
        child_tyxyx_tlbr[:, :, :, 1:3] = prev_tyxyx_tlbr[:, 0::2, 0::2, 1:3]
        child_tyxyx_tlbr[:, :, :, 3:5] = prev_tyxyx_tlbr[:, 1::2, 1::2, 3:5]
        child_valid_mask = torch.ones((T, new_h, new_w, 4), device=device, dtype=torch.bool)
    else:
        child_yx_coords = torch.zeros((new_h, new_w, 4, 2), device=device, dtype=torch.int32)
        child_valid_mask = torch.zeros((new_h, new_w, 4), device=device, dtype=torch.bool)
        child_tyxyx_tlbr = torch.zeros((T, new_h, new_w, 5), device=device, dtype=torch.int32)
        if not even_height_flag and even_width_flag:
            h_start = 1 + 2 * torch.arange(0, new_h - 1, device=device, dtype=torch.int32)
            w_start = 2 * torch.arange(0, new_w, device=device, dtype=torch.int32)
            child_yx_coords[0, :, [0, 1], 1] = torch.stack([w_start, w_start + 1], dim=-1)
            child_valid_mask[0, :, [0, 1]] = True
            child_tyxyx_tlbr[:, 0, :, 0] = prev_tyxyx_tlbr[:, 0, 0::2, 0]
            child_tyxyx_tlbr[:, 0, :, 1:3] = prev_tyxyx_tlbr[:, 0, 0::2, 1:3]
            child_tyxyx_tlbr[:, 0, :, 3:5] = prev_tyxyx_tlbr[:, 0, 1::2, 3:5]
            child_yx_coords[1:, :, [0, 1, 2, 3], 0] = (
                torch.stack([*([h_start] * 2), *([h_start + 1] * 2)], dim=-1).unsqueeze(1).repeat(1, new_w, 1)
            )
            child_yx_coords[1:, :, [0, 1, 2, 3], 1] = (
                torch.stack([w_start, w_start + 1], dim=-1).repeat(1, 2).unsqueeze(0).repeat(new_h - 1, 1, 1)
            )
            child_valid_mask[1:, :, [0, 1, 2, 3]] = True
            child_tyxyx_tlbr[:, 1:, :, 0] = prev_tyxyx_tlbr[:, 1::2, 0::2, 0]
            child_tyxyx_tlbr[:, 1:, :, 1:3] = prev_tyxyx_tlbr[:, 1::2, 0::2, 1:3]
            child_tyxyx_tlbr[:, 1:, :, 3:5] = prev_tyxyx_tlbr[:, 2::2, 1::2, 3:5]
        if even_height_flag and not even_width_flag:
            h_start = 2 * torch.arange(0, new_h, device=device, dtype=torch.int32)
            w_start = 1 + 2 * torch.arange(0, new_w - 1, device=device, dtype=torch.int32)
            child_yx_coords[:, 0, [0, 2], 0] = torch.stack([h_start, h_start + 1], dim=-1)
            child_valid_mask[:, 0, [0, 2]] = True
            child_tyxyx_tlbr[:, :, 0, 0] = prev_tyxyx_tlbr[:, 0::2, 0, 0]
            child_tyxyx_tlbr[:, :, 0, 1:3] = prev_tyxyx_tlbr[:, 0::2, 0, 1:3]
            child_tyxyx_tlbr[:, :, 0, 3:5] = prev_tyxyx_tlbr[:, 1::2, 0, 3:5]
            child_yx_coords[:, 1:, [0, 1, 2, 3], 0] = (
                torch.stack([*([h_start] * 2), *([h_start + 1] * 2)], dim=-1).unsqueeze(1).repeat(1, new_w - 1, 1)
            )
            child_yx_coords[:, 1:, [0, 1, 2, 3], 1] = (
                torch.stack([w_start, w_start + 1], dim=-1).repeat(1, 2).unsqueeze(0).repeat(new_h, 1, 1)
            )
            child_valid_mask[:, 1:, [0, 1, 2, 3]] = True
            child_tyxyx_tlbr[:, :, 1:, 0] = prev_tyxyx_tlbr[:, 0::2, 1::2, 0]
            child_tyxyx_tlbr[:, :, 1:, 1:3] = prev_tyxyx_tlbr[:, 0::2, 1::2, 1:3]
            child_tyxyx_tlbr[:, :, 1:, 3:5] = prev_tyxyx_tlbr[:, 1::2, 2::2, 3:5]
        if not even_height_flag and not even_width_flag:
            h_start = 1 + 2 * torch.arange(0, new_h - 1, device=device, dtype=torch.int32)
            w_start = 1 + 2 * torch.arange(0, new_w - 1, device=device, dtype=torch.int32)
            child_valid_mask[0, 0, 0] = True
            child_tyxyx_tlbr[:, 0, 0] = prev_tyxyx_tlbr[:, 0, 0]
            tr_index = [0, 1]
            child_yx_coords[0, 1:, tr_index, 1] = torch.stack([w_start, w_start + 1], dim=-1)
            child_valid_mask[0, 1:, tr_index] = True
            child_tyxyx_tlbr[:, 0, 1:, 0] = prev_tyxyx_tlbr[:, 0, 1::2, 0]
            child_tyxyx_tlbr[:, 0, 1:, 1:3] = prev_tyxyx_tlbr[:, 0, 1::2, 1:3]
            child_tyxyx_tlbr[:, 0, 1:, 3:5] = prev_tyxyx_tlbr[:, 0, 2::2, 3:5]
            bl_index = [0, 2]
            child_yx_coords[1:, 0, bl_index, 0] = torch.stack([h_start, h_start + 1], dim=-1)
            child_valid_mask[1:, 0, bl_index] = True
            child_tyxyx_tlbr[:, 1:, 0, 0] = prev_tyxyx_tlbr[:, 1::2, 0, 0]
            child_tyxyx_tlbr[:, 1:, 0, 1:3] = prev_tyxyx_tlbr[:, 1::2, 0, 1:3]
            child_tyxyx_tlbr[:, 1:, 0, 3:5] = prev_tyxyx_tlbr[:, 2::2, 0, 3:5]
            br_index = [0, 1, 2, 3]
            child_yx_coords[1:, 1:, br_index, 0] = (
                torch.stack([*([h_start] * 2), *([h_start + 1] * 2)], dim=-1).unsqueeze(1).repeat(1, new_w - 1, 1)
            )
            child_yx_coords[1:, 1:, br_index, 1] = (
                torch.stack([w_start, w_start + 1], dim=-1).repeat(1, 2).unsqueeze(0).repeat(new_h - 1, 1, 1)
            )
            child_valid_mask[1:, 1:, br_index] = True
            child_tyxyx_tlbr[:, 1:, 1:, 0] = prev_tyxyx_tlbr[:, 1::2, 1::2, 0]
            child_tyxyx_tlbr[:, 1:, 1:, 1:3] = prev_tyxyx_tlbr[:, 1::2, 1::2, 1:3]
            child_tyxyx_tlbr[:, 1:, 1:, 3:5] = prev_tyxyx_tlbr[:, 2::2, 2::2, 3:5]
        t_idx = torch.arange(0, T, device=device, dtype=torch.int32)
        t_coords = t_idx.reshape(-1, 1, 1, 1, 1).repeat(1, new_h, new_w, 4, 1)
        _child_yx_coords = child_yx_coords.unsqueeze(0).repeat(T, 1, 1, 1, 1)
        child_tyx_coords = torch.cat([t_coords, _child_yx_coords], dim=-1)
        child_valid_mask = child_valid_mask.unsqueeze(0).repeat(T, 1, 1, 1)
    return child_tyx_coords, child_valid_mask, child_tyxyx_tlbr


def official_quadtree_build_iteration_video(
    parent_tyx_coords_3d,
    video_features_per_level,
    node_tyxyx_tlbr_per_level,
    child_tyx_coords_per_level,
    child_valid_mask_per_level,
    quadtree_features_list,
    quadtree_tyxyx_tlbr_list,
    curr_lvl,
    n_level,
    threshold,
    valid_children_only=False,
):
    if curr_lvl == n_level - 1:
        last_node_features = video_features_per_level[curr_lvl]
        last_node_tyxyx_tlbr = node_tyxyx_tlbr_per_level[curr_lvl]
        p_t, p_y, p_x = parent_tyx_coords_3d.T
        quadtree_features_list.append(last_node_features[p_t, p_y, p_x])
        quadtree_tyxyx_tlbr_list.append(last_node_tyxyx_tlbr[p_t, p_y, p_x])
        return None
    parent_features = video_features_per_level[curr_lvl]
    parent_node_tyxyx_tlbr = node_tyxyx_tlbr_per_level[curr_lvl]
    p_t, p_y, p_x = parent_tyx_coords_3d.T
    tgt_parent_features = parent_features[p_t, p_y, p_x, :]
    tgt_parent_node_tyxyx_tlbr = parent_node_tyxyx_tlbr[p_t, p_y, p_x]
    child_features = video_features_per_level[curr_lvl + 1]
    child_tyx_coords = child_tyx_coords_per_level[curr_lvl]
    child_valid_mask = child_valid_mask_per_level[curr_lvl]
    tgt_child_tyx_coords = child_tyx_coords[p_t, p_y, p_x]
    tgt_child_valid_mask = child_valid_mask[p_t, p_y, p_x]
    tgt_child_tyx_coords_3d = tgt_child_tyx_coords.flatten(0, 1)
    c_t, c_y, c_x = tgt_child_tyx_coords_3d.T
    tgt_child_features = einops.rearrange(child_features[c_t, c_y, c_x], "(n s) c -> n s c", s=4)
    tgt_parent_features_fp32 = tgt_parent_features.unsqueeze(1).float()
    tgt_child_features_fp32 = tgt_child_features.float()
    similarity = F.cosine_similarity(tgt_parent_features_fp32, tgt_child_features_fp32, dim=-1)
    if valid_children_only:  # switch (not official): the unused slots do not vote
        similarity = similarity.masked_fill(~tgt_child_valid_mask, math.inf)
    stop_mask = (similarity >= threshold).all(dim=-1)
    split_node_mask = torch.logical_and((~stop_mask).unsqueeze(1), tgt_child_valid_mask).flatten(0, 1)
    parent_tyx_coords_3d = tgt_child_tyx_coords_3d[split_node_mask]
    quadtree_features_list.append(tgt_parent_features[stop_mask])
    quadtree_tyxyx_tlbr_list.append(tgt_parent_node_tyxyx_tlbr[stop_mask])
    return parent_tyx_coords_3d


def official_get_cross_frame_node_pairs_fast(quadtree_tyxyx_tlbr):
    device = quadtree_tyxyx_tlbr.device
    N_node = quadtree_tyxyx_tlbr.size(0)
    new_frame_idx_list = (
        torch.nonzero(quadtree_tyxyx_tlbr[0:-1, 0] != quadtree_tyxyx_tlbr[1:, 0]).squeeze(1) + 1
    ).tolist()
    new_frame_idx_list = [0, *new_frame_idx_list, len(quadtree_tyxyx_tlbr)]
    new_frame_idx = torch.tensor(new_frame_idx_list, device=device, dtype=torch.int32)
    num_nodes_per_frame = new_frame_idx[1:] - new_frame_idx[:-1]
    max_num_node = num_nodes_per_frame.max().item()
    N_frame = len(new_frame_idx_list) - 1
    node_idx = torch.arange(N_node, device=device, dtype=torch.int32)
    frame_ids = torch.bucketize(node_idx, new_frame_idx[1:-1], out_int32=True, right=True)
    frame_starts = new_frame_idx[frame_ids]
    local_idx = node_idx - frame_starts
    src2tgt_index = local_idx + frame_ids * max_num_node
    tlbr_padded = torch.zeros(N_frame * max_num_node, 4, device=device, dtype=torch.int32)
    valid_mask_padded = torch.zeros(N_frame * max_num_node, device=device, dtype=torch.int32)
    tlbr_padded.index_add_(0, src2tgt_index, quadtree_tyxyx_tlbr[:, 1:])
    # verbatim: the official code discards this comparison (the int mask still works below)
    valid_mask_padded.index_add_(0, src2tgt_index, torch.ones(N_node, device=device, dtype=torch.int32)) > 0  # noqa: B015
    tlbr_padded = tlbr_padded.reshape(N_frame, max_num_node, 4)
    valid_mask_padded = valid_mask_padded.reshape(N_frame, max_num_node)
    cur_nodes_tlbr, nxt_nodes_tlbr = tlbr_padded[:-1], tlbr_padded[1:]
    cur_valid_mask, nxt_valid_mask = valid_mask_padded[:-1], valid_mask_padded[1:]
    diff = cur_nodes_tlbr.unsqueeze(2) - nxt_nodes_tlbr.unsqueeze(1)
    cur_contain_nxt = ((diff[..., :2] <= 0).all(dim=-1)) & ((diff[..., 2:] >= 0).all(dim=-1))
    nxt_contain_cur = ((diff[..., :2] >= 0).all(dim=-1)) & ((diff[..., 2:] <= 0).all(dim=-1))
    valid_node_mask = cur_valid_mask.unsqueeze(2) & nxt_valid_mask.unsqueeze(1)
    pair_mask = (cur_contain_nxt | nxt_contain_cur) & valid_node_mask
    pair_indices = torch.nonzero(pair_mask)
    b_idx, cur_idx, nxt_idx = pair_indices.T
    cur_idx_offset = new_frame_idx[:-2]
    nxt_idx_offset = new_frame_idx[1:-1]
    cur_idx = cur_idx + cur_idx_offset[b_idx]
    nxt_idx = nxt_idx + nxt_idx_offset[b_idx]
    return torch.stack([cur_idx, nxt_idx], dim=1)


def official_filter_cross_frame_node_pairs(quadtree_features_video, pair_idxs, temporal_thresh):
    quadtree_features_video_float32 = quadtree_features_video.float()
    quadtree_features_norm = quadtree_features_video_float32 / (
        quadtree_features_video_float32.norm(dim=-1, keepdim=True) + 1e-8
    )
    pair_sim = (quadtree_features_norm[pair_idxs[:, 0]] * quadtree_features_norm[pair_idxs[:, 1]]).sum(dim=-1)
    merging_mask = pair_sim >= temporal_thresh
    return pair_idxs[merging_mask]


def official_get_merge_dst_idx_safe(pair_idxs_for_merging, N_node, until_components=False):
    device = pair_idxs_for_merging.device
    final_representative = torch.arange(N_node, device=device, dtype=torch.int32)
    while True:
        dst_idx = pair_idxs_for_merging[:, 0]
        src_idx = pair_idxs_for_merging[:, 1]
        dst_rep = final_representative[dst_idx]
        src_rep = final_representative[src_idx]
        min_rep = torch.minimum(src_rep, dst_rep)
        final_representative.scatter_reduce_(0, dst_idx, min_rep, reduce="amin")
        final_representative.scatter_reduce_(0, src_idx, min_rep, reduce="amin")
        final_representative = final_representative[final_representative]
        if torch.equal(final_representative, final_representative[final_representative]):
            agree = torch.equal(final_representative[dst_idx], final_representative[src_idx])
            if agree or not until_components:  # switch (not official): run until every pair agrees
                break
    return final_representative


def official_agg_feature_and_metadata(quadtree_features_video, quadtree_num_patches_per_node, tlbr, final_rep):
    device = quadtree_features_video.device
    N_node = quadtree_features_video.size(0)
    final_rep = final_rep.long()
    feature_accum = torch.zeros_like(quadtree_features_video)
    feature_count = torch.zeros(N_node, device=device, dtype=torch.int32)
    feature_accum.index_add_(0, final_rep, quadtree_features_video)
    feature_count.index_add_(0, final_rep, torch.ones_like(feature_count))
    survived_node_mask = feature_count > 0
    agg_num_patches_per_node = torch.zeros(N_node, device=device, dtype=torch.int32)
    agg_num_patches_per_node.index_add_(0, final_rep, quadtree_num_patches_per_node)
    agg_num_patches_per_node = agg_num_patches_per_node[survived_node_mask]
    agg_tyxyx_tlbr = tlbr[survived_node_mask]
    agg_features = feature_accum[survived_node_mask] / feature_count[survived_node_mask].unsqueeze(-1)
    return agg_features, agg_num_patches_per_node, agg_tyxyx_tlbr


def official_cross_frame_node_merging_fast(features, tlbr, temporal_thresh, num_patches, until_components=False):
    pair_idxs = official_get_cross_frame_node_pairs_fast(tlbr)
    pair_idxs_for_merging = official_filter_cross_frame_node_pairs(features, pair_idxs, temporal_thresh)
    final_representative = official_get_merge_dst_idx_safe(pair_idxs_for_merging, features.size(0), until_components)
    return official_agg_feature_and_metadata(features, num_patches, tlbr, final_representative)


def official_quadtree_build_video(
    _video_feature, threshold, temporal_thresh=-1.0, root_level=0, valid_children_only=False, until_components=False
):
    """`quadtree_build_video` on [T, C, H, W] -> (features [K, C], patches per token [K], tlbr [K, 5])."""
    _video_feature_lv0 = _video_feature
    device = _video_feature_lv0.device
    t, _, h, w = _video_feature.shape
    size_per_level = [(h, w)]
    while h != 2 and w != 2:
        w = math.ceil(w / 2)
        h = math.ceil(h / 2)
        size_per_level.insert(0, (h, w))
    video_features_per_level = [_video_feature_lv0]
    _video_feature_nxt_lvl = _video_feature_lv0
    while video_features_per_level[0].size(-1) != size_per_level[root_level][1]:
        _video_feature_nxt_lvl = official_avgpool_to_even_side_feature(_video_feature_nxt_lvl)
        video_features_per_level.insert(0, _video_feature_nxt_lvl)
    n_level = len(video_features_per_level)
    for i in range(n_level):
        video_features_per_level[i] = video_features_per_level[i].permute(0, 2, 3, 1)
    T, H, W, _ = video_features_per_level[-1].shape
    grid_t = torch.arange(0, T, device=device, dtype=torch.int32)
    grid_y = torch.arange(0, H, device=device, dtype=torch.int32)
    grid_x = torch.arange(0, W, device=device, dtype=torch.int32)
    gt_lv0, gy_lv0, gx_lv0 = torch.meshgrid(grid_t, grid_y, grid_x, indexing="ij")
    node_tyxyx_tlbr_lv0 = torch.stack([gt_lv0, gy_lv0, gx_lv0, gy_lv0 + 1, gx_lv0 + 1], dim=-1)
    node_tyxyx_tlbr_nxt_lvl = node_tyxyx_tlbr_lv0
    node_tyxyx_tlbr_per_level = [node_tyxyx_tlbr_nxt_lvl]
    child_tyx_coords_per_level, child_valid_mask_per_level = [], []
    for i in range(n_level - 1):
        tgt_lvl = n_level - 1 - i
        child_tyx_coords_nxt_lvl, child_valid_mask_nxt_lvl, node_tyxyx_tlbr_nxt_lvl = (
            official_pool_to_even_side_index_video(video_features_per_level[tgt_lvl], node_tyxyx_tlbr_nxt_lvl)
        )
        node_tyxyx_tlbr_per_level.insert(0, node_tyxyx_tlbr_nxt_lvl)
        child_tyx_coords_per_level.insert(0, child_tyx_coords_nxt_lvl)
        child_valid_mask_per_level.insert(0, child_valid_mask_nxt_lvl)
    if n_level == 1:
        quadtree_features_video = video_features_per_level[0].flatten(0, 2)
        quadtree_tyxyx_tlbr = node_tyxyx_tlbr_lv0.flatten(0, 2)
        node_height = quadtree_tyxyx_tlbr[:, 3] - quadtree_tyxyx_tlbr[:, 1]
        node_width = quadtree_tyxyx_tlbr[:, 4] - quadtree_tyxyx_tlbr[:, 2]
        quadtree_num_patches_per_node = node_height * node_width
        if temporal_thresh > 0:
            quadtree_features_video, quadtree_num_patches_per_node, quadtree_tyxyx_tlbr = (
                official_cross_frame_node_merging_fast(
                    quadtree_features_video,
                    quadtree_tyxyx_tlbr,
                    temporal_thresh,
                    quadtree_num_patches_per_node,
                    until_components,
                )
            )
        return quadtree_features_video, quadtree_num_patches_per_node, quadtree_tyxyx_tlbr
    T, H_lvl0, W_lvl0, _ = video_features_per_level[0].shape
    grid_t_lvl0 = torch.arange(0, T, device=device, dtype=torch.int32)
    grid_y_lvl0 = torch.arange(0, H_lvl0, device=device, dtype=torch.int32)
    grid_x_lvl0 = torch.arange(0, W_lvl0, device=device, dtype=torch.int32)
    gt, gy, gx = torch.meshgrid(grid_t_lvl0, grid_y_lvl0, grid_x_lvl0, indexing="ij")
    parent_tyx_coords = torch.stack([gt, gy, gx], dim=-1)
    parent_tyx_coords_3d = parent_tyx_coords.flatten(0, 2)
    quadtree_features_list, quadtree_tyxyx_tlbr_list = [], []
    for curr_lvl in range(n_level):
        parent_tyx_coords_3d = official_quadtree_build_iteration_video(
            parent_tyx_coords_3d,
            video_features_per_level,
            node_tyxyx_tlbr_per_level,
            child_tyx_coords_per_level,
            child_valid_mask_per_level,
            quadtree_features_list,
            quadtree_tyxyx_tlbr_list,
            curr_lvl,
            n_level,
            threshold,
            valid_children_only,
        )
    quadtree_features_video = torch.cat(quadtree_features_list)
    quadtree_tyxyx_tlbr = torch.cat(quadtree_tyxyx_tlbr_list)
    tyx_offsets = torch.tensor([H * W, W, 1], device=device, dtype=torch.int32)
    quadtree_1d_index = (quadtree_tyxyx_tlbr[:, :3] * tyx_offsets.unsqueeze(0)).sum(dim=-1)
    sorted_idx = torch.argsort(quadtree_1d_index)
    quadtree_features_video = quadtree_features_video[sorted_idx]
    quadtree_tyxyx_tlbr = quadtree_tyxyx_tlbr[sorted_idx]
    node_height = quadtree_tyxyx_tlbr[:, 3] - quadtree_tyxyx_tlbr[:, 1]
    node_width = quadtree_tyxyx_tlbr[:, 4] - quadtree_tyxyx_tlbr[:, 2]
    quadtree_num_patches_per_node = node_height * node_width
    if temporal_thresh > 0:
        quadtree_features_video, quadtree_num_patches_per_node, quadtree_tyxyx_tlbr = (
            official_cross_frame_node_merging_fast(
                quadtree_features_video,
                quadtree_tyxyx_tlbr,
                temporal_thresh,
                quadtree_num_patches_per_node,
                until_components,
            )
        )
    return quadtree_features_video, quadtree_num_patches_per_node, quadtree_tyxyx_tlbr


# --- helpers ----------------------------------------------------------------------------------------------------------
def structured_video(t: int, h: int, w: int, c: int = 24, seed: int = 0) -> torch.Tensor:
    """[T, H, W, C]: a smooth field with 3 x 3 regions of different roughness, drifting from frame to frame, so both
    thresholds cut at every level somewhere."""
    g = torch.Generator().manual_seed(seed)
    field = torch.randn(1, c, 3, 3, generator=g)
    smooth = F.interpolate(field, size=(h, w), mode="bilinear", align_corners=False)[0].permute(1, 2, 0)
    rough = F.interpolate(torch.rand(1, 1, 3, 3, generator=g), size=(h, w), mode="nearest")[0, 0, :, :, None]
    frames = []
    for _ in range(t):
        frames.append(smooth + rough * torch.randn(h, w, c, generator=g))
        smooth = smooth + 0.25 * torch.rand(1, generator=g) * torch.randn(h, w, c, generator=g)
    return torch.stack(frames) + 0.5


def official_on(x: torch.Tensor, tau_s, tau_t, root_level=1, valid_children_only=False, until_components=False):
    feats, patches, tlbr = official_quadtree_build_video(
        x.permute(0, 3, 1, 2), tau_s, tau_t, root_level, valid_children_only, until_components
    )
    _, h, w, _ = x.shape
    anchors = (tlbr[:, 0] * h * w + tlbr[:, 1] * w + tlbr[:, 2]).long()
    return feats, patches.long(), anchors


GRIDS = [(3, 14, 14), (4, 12, 12), (2, 11, 13), (4, 7, 7), (3, 5, 6), (1, 14, 14), (5, 8, 8), (2, 16, 10)]
EVEN_GRIDS = [(4, 12, 12), (5, 8, 8), (3, 16, 16)]  # every level even: the strip quirk never fires
CASES = [(g, s) for g in GRIDS for s in range(6)]  # 48 cases


def case_thresholds(seed: int) -> tuple[float, float]:
    g = torch.Generator().manual_seed(1000 + seed)
    return 0.80 + 0.19 * float(torch.rand(1, generator=g)), 0.5 + 0.45 * float(torch.rand(1, generator=g))


# --- against the official code --------------------------------------------------------------------------------------
@pytest.mark.parametrize("valid_children_only", [False, True])
def test_matches_the_official_transcription_on_48_random_videos(valid_children_only):
    """48 videos (8 grids, odd and even sides, T = 1 included) x random (tau_S, tau_T): the tokens (anchors, in order),
    their sizes and features equal the official function's, both with the official stop test (vtc's switch) and with
    vtc's valid-children test (the official code with that one switch); the union-find as vtc means it (run until
    every pair agrees)."""
    merged_somewhere = 0
    for (t, h, w), seed in CASES:
        x = structured_video(t, h, w, seed=seed)
        tau_s, tau_t = case_thresholds(seed)
        feats, patches, anchors = official_on(x, tau_s, tau_t, 1, valid_children_only, until_components=True)
        plan = merge_plan(build_pyramid(x, 1, valid_children_only), tau_s, tau_t)
        assert torch.equal(plan.anchors, anchors), ((t, h, w), seed)
        assert torch.equal(torch.bincount(plan.group, minlength=len(plan)), patches)
        torch.testing.assert_close(plan.features, feats, atol=1e-6, rtol=1e-6)
        assert plan.nodes == len(official_on(x, tau_s, -1.0, 1, valid_children_only)[2])
        merged_somewhere += plan.nodes < t * h * w and len(plan) < plan.nodes
    assert merged_somewhere >= 40  # the cases exercise both the quadtree and the chains


def test_equals_the_verbatim_official_code_where_its_union_find_reaches_components():
    """The verbatim official code (no switch) on 18 videos of even grids (the strip quirk cannot fire): equal to vtc
    exactly when its union-find ends with every kept pair agreeing; where it stops earlier (the documented
    difference) vtc's tokens are the official ones with the left-out nodes joined to their chains."""
    equal = differ = 0
    for grid in EVEN_GRIDS:
        for seed in range(6):
            x = structured_video(*grid, seed=seed)
            tau_s, tau_t = case_thresholds(seed)
            feats, _, anchors = official_on(x, tau_s, tau_t)
            # the official union-find on the official pairs: does every kept pair end with one label?
            node_feats, _, tlbr = official_quadtree_build_video(x.permute(0, 3, 1, 2), tau_s, -1.0, 1)
            pairs = official_get_cross_frame_node_pairs_fast(tlbr)
            kept = official_filter_cross_frame_node_pairs(node_feats, pairs, tau_t)
            labels = official_get_merge_dst_idx_safe(kept, len(tlbr))
            agree = torch.equal(labels[kept[:, 0]], labels[kept[:, 1]])
            plan = merge_plan(build_pyramid(x, 1, valid_children_only=False), tau_s, tau_t)
            assert torch.equal(plan.anchors, anchors) == agree, (grid, seed)
            if agree:
                torch.testing.assert_close(plan.features, feats, atol=1e-6, rtol=1e-6)
                equal += 1
            else:
                assert set(plan.anchors.tolist()) < set(anchors.tolist())  # vtc only joins more
                differ += 1
    assert equal >= 6 and differ >= 3


def test_pyramid_sizes_and_pooling_follow_the_official_code():
    assert pyramid_sizes(14, 14) == [(2, 2), (4, 4), (7, 7), (14, 14)]
    assert pyramid_sizes(11, 13) == [(2, 2), (3, 4), (6, 7), (11, 13)]
    assert pyramid_sizes(12, 12) == [(2, 2), (3, 3), (6, 6), (12, 12)]
    assert pyramid_sizes(2, 9) == [(2, 9)] and pyramid_sizes(1, 1) == [(1, 1)]  # the official loop never ends on 1 x 1
    for h, w in [(7, 7), (6, 7), (7, 6), (8, 8), (5, 5)]:
        x = torch.randn(2, 5, h, w)
        assert torch.equal(pool_to_even_side(x), official_avgpool_to_even_side_feature(x))
    row = torch.arange(5.0).view(1, 1, 1, 5)  # a side of 1 (the official code cannot pool it)
    assert pool_to_even_side(row).flatten().tolist() == [0.0, 1.5, 3.5]


# --- known answers ----------------------------------------------------------------------------------------------------
def test_a_blank_half_merges_into_big_nodes_and_the_busy_half_stays():
    """8 x 8 frame, root level 1 (4 x 4 nodes of 2 x 2 cells): the blank left half becomes 8 tokens at the top-left of
    each 2 x 2 block, the random right half keeps its 32 cells; from root level 0 the blank half is 2 tokens."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, 8, 16, generator=g)
    x[:, :, :4] = torch.randn(16, generator=g)
    plan = merge_plan(build_pyramid(x, 1), 0.9, None)
    blank = [y * 8 + c for y in (0, 2, 4, 6) for c in (0, 2)]
    busy = [y * 8 + c for y in range(8) for c in range(4, 8)]
    assert plan.anchors.tolist() == sorted(blank + busy) and plan.nodes == 40
    torch.testing.assert_close(plan.features[plan.group[0]], x[0, 0, 0])
    coarse = merge_plan(build_pyramid(x, 0), 0.9, None)
    assert len(coarse) == 34 and {0, 4 * 8}.issubset(set(coarse.anchors.tolist()))


def test_a_static_clip_is_one_frame_of_tokens_placed_in_the_first_frame():
    g = torch.Generator().manual_seed(1)
    frame = torch.randn(1, 6, 6, 16, generator=g)
    plan = merge_plan(build_pyramid(frame.expand(5, -1, -1, -1).contiguous(), 1), 0.99, 0.9)
    assert plan.anchors.tolist() == list(range(36))  # every chain at its frame-0 cell
    torch.testing.assert_close(plan.features, frame.reshape(36, 16))
    assert torch.equal(plan.group.view(5, 36), torch.arange(36).expand(5, -1))
    torch.testing.assert_close(plan.weight, torch.full((180,), 0.2))  # each cell is a fifth of its chain


def test_a_chain_through_a_coarse_node_joins_every_node_it_touches():
    """Frame 0: four fine nodes; frame 1: one node containing them, similar to all. The chains are connected
    components (all five join, at frame 0's top-left); the official union-find stops after one pass with only the
    first fine node joined (the documented difference)."""
    pairs = torch.tensor([[0, 4], [1, 4], [2, 4], [3, 4]])
    assert union_min(pairs, 5).tolist() == [0, 0, 0, 0, 0]
    assert official_get_merge_dst_idx_safe(pairs, 5).tolist() == [0, 1, 2, 3, 0]
    assert official_get_merge_dst_idx_safe(pairs, 5, until_components=True).tolist() == [0, 0, 0, 0, 0]
    # a chain 0 -> 5 -> 9 -> 12 through four frames: every node to 0 in both
    chain = torch.tensor([[0, 5], [5, 9], [9, 12]])
    assert union_min(chain, 13)[[0, 5, 9, 12]].tolist() == [0, 0, 0, 0]


def test_the_strip_quirk_of_the_official_stop_test():
    """7 x 7 grid, root level 1: levels 4 x 4 and 7 x 7, whose top row of 4 x 4 nodes covers 1-wide strips. A strip node
    whose two children equal it stays one token in vtc; the official test also compares it with the child (0, 0),
    here different, and splits it."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 7, 7, 16, generator=g)
    x[0, 0, 1:3] = torch.randn(16, generator=g)  # node (0, 1) of the 4 x 4 level covers cells (0, 1) and (0, 2)
    ours = merge_plan(build_pyramid(x, 1), 0.95, None)
    official = merge_plan(build_pyramid(x, 1, valid_children_only=False), 0.95, None)
    assert 2 not in ours.anchors.tolist() and 1 in ours.anchors.tolist() and len(ours) == 48
    assert {1, 2}.issubset(set(official.anchors.tolist())) and len(official) == 49
    assert torch.equal(official.anchors, official_on(x, 0.95, -1.0)[2])


def test_weights_rebuild_the_features_for_side_features():
    """The per-cell weights are the linear map of the merged features (what side features such as DeepStack follow)."""
    x = structured_video(3, 11, 13, seed=3)
    plan = merge_plan(build_pyramid(x, 1), 0.9, 0.7)
    rebuilt = torch.zeros(len(plan), x.shape[-1]).index_add_(0, plan.group, plan.weight[:, None] * x.reshape(-1, 24))
    torch.testing.assert_close(rebuilt, plan.features, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.zeros(len(plan)).index_add_(0, plan.group, plan.weight), torch.ones(len(plan)))


def test_one_frame_is_the_quadtree_alone():
    x = structured_video(1, 14, 14, seed=4)
    plan = merge_plan(build_pyramid(x, 1), 0.9, 0.6)
    assert len(plan) == plan.nodes < 196
    assert torch.equal(plan.anchors, official_on(x, 0.9, 0.6, valid_children_only=True)[2])


# --- counts -----------------------------------------------------------------------------------------------------------
def test_threshold_search_and_exact_count():
    x = structured_video(4, 12, 12, seed=5)
    pyramid = build_pyramid(x, 1)
    n = x.shape[0] * 144
    for target in (1, 17, 288, n):
        tau_s, tau_t, reachable = thresholds_for_count(pyramid, target, 0.85, 0.6)
        got = merged_count(pyramid, tau_s, tau_t)
        assert abs(tau_s - tau_t - 0.25) < 1e-6  # one offset for both thresholds
        assert reachable == (target >= 9) and (not reachable or abs(got - target) <= 3 * 9), (target, got)
        plan, _, _ = exact_count_plan(pyramid, target, 0.85, 0.6)
        assert len(plan) == target and plan.anchors.unique().numel() == target
        assert torch.equal(torch.sort(plan.anchors).values, plan.anchors)
    assert merged_count(pyramid, 2.85, 2.6) == n  # above every cosine nothing merges
    assert merged_count(pyramid, -1.15, -1.4) == 9  # below every cosine: the 3 x 3 root nodes, joined over frames


def test_defaults_and_cards():
    assert STTM().tau_s is None and STTM().root_level == 1 and STTM().layer == 2
    assert STTM().thresholds("qwen2_vl") == (DEFAULT_TAU_S, DEFAULT_TAU_T["mrope"]) == (0.85, 0.60)
    assert STTM().thresholds("llava_onevision") == (0.85, 0.55)
    assert STTM(tau_t=0.65).thresholds("llava_onevision") == (0.85, 0.65)  # LLaVA-OneVision-7B's Video-MME row
    assert STTMConnect().thresholds("qwen2_vl") == (INPUT_TAU_S, INPUT_TAU_T) == (0.94, 0.82)
    card = vtc.registry()["sttm"].card
    assert card.stages == ("prefill",) and not card.fixed_count and not card.query_aware
    assert card.retention_reference == "last_layer"
    connect = vtc.registry()["sttm-connect"].card
    assert connect.stages == ("connect",) and connect.fixed_count_mode == "optional" and connect.whole_frames
    assert STTM().bind(0.3).budget() == 0.3 and STTM(tau_s=0.9).bind(0.3).budget() is None  # explicit wins
    assert STTMConnect(fixed_count=True).bind(None).retained_count(1568, (8, 14, 14), "llava_onevision") == 784
    assert STTMConnect(fixed_count=True).bind(0.3).retained_count(576, (4, 12, 12), "qwen2_vl") == 173
    assert STTMConnect().bind(0.3).retained_count(576, (4, 12, 12), "qwen2_vl") is None


def test_bad_parameters_are_clear_errors():
    with pytest.raises(ValueError, match=r"sttm: tau_s must be in \[-1, 1\], got 1.5"):
        STTM(tau_s=1.5)
    with pytest.raises(ValueError, match=r"sttm: root_level must be in \[0, inf\), got -1"):
        STTM(root_level=-1)
    with pytest.raises(ValueError, match=r"sttm-connect: fixed_count must be bool"):
        STTMConnect(fixed_count="yes")
    model, _ = model_and_processor("qwen2_vl")
    with vtc.patch(model, "sttm", layer=9):
        with pytest.raises(ValueError, match="sttm: merge before layer 9 but the language model has only 4 layers"):
            model(**single_inputs("qwen2_vl"))
    with vtc.patch(model, "random+sttm", retention=0.5):
        with pytest.raises(RuntimeError, match="STTM builds its quadtree on whole frames"):
            model(**single_inputs("qwen2_vl"))
    with pytest.raises(ValueError, match="sttm-connect"):
        vtc.patch(model, "random+sttm-connect")


# --- the patched models -----------------------------------------------------------------------------------------------
def layer_inputs(model, inputs, layer: int, method=None, **params):
    """(hidden [n, D], cos rows [n, d]) entering decoder `layer` for one prompt, with `method` patched in."""
    seen = {}

    def grab(module, args, kwargs):
        seen["hidden"] = (args[0] if args else kwargs["hidden_states"])[0].clone()
        seen["cos"] = kwargs["position_embeddings"][0][0].clone()

    adapter = vtc.api.resolve_adapter(model)
    handle = vtc.patch(model, method, **params) if method else None
    probe = adapter.decoder_layers[layer].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            logits = model(**inputs).logits
    finally:
        probe.remove()
        stats = handle.stats() if handle else None
        if handle:
            handle.unpatch()
    return seen["hidden"], seen["cos"], logits, stats


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_layer_two_receives_the_official_merge_and_logits_match_a_reference(family):
    """What layer 2 receives under `sttm` equals the official function applied to what layer 2 receives unpatched:
    the text rows unchanged, the merged tokens at their anchors' places and original RoPE rows; the logits equal a
    layer-by-layer run of that sequence."""
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    (grid,) = token_grids(model, inputs)
    tau_s, tau_t = 0.95, 0.7
    hidden, cos, _, _ = layer_inputs(model, inputs, 2)
    visual = torch.nonzero(compressible_video_mask(model, inputs["input_ids"])).flatten()
    feats, _, anchors = official_on(hidden[visual].view(*grid, -1), tau_s, tau_t, 1, True, True)
    assert 0 < len(anchors) < visual.numel()
    keep = torch.sort(
        torch.cat([torch.nonzero(~compressible_video_mask(model, inputs["input_ids"])).flatten(), visual[anchors]])
    ).values
    expected = hidden.clone()
    expected[visual[anchors]] = feats
    got, got_cos, logits, stats = layer_inputs(model, inputs, 2, "sttm", tau_s=tau_s, tau_t=tau_t)
    torch.testing.assert_close(got, expected[keep], atol=1e-6, rtol=1e-6)
    assert torch.equal(got_cos, cos[keep])
    assert stats.layer_visual_tokens == [visual.numel()] * 2 + [len(anchors)] * 2
    assert stats.reports["sttm"]["kept"] == [len(anchors)]
    # the rest of the LLM from that sequence, layer by layer
    ref, _, x, full, rope_cos, rope_sin, _ = start(model, inputs)
    h = expected[keep][None]
    c, s = rope_cos[:, keep], rope_sin[:, keep]
    with torch.no_grad():
        for i in (2, 3):
            h = ref.mlp_block(i, ref.attention_block(i, h, c, s))
        torch.testing.assert_close(logits[:, -1], ref.logits(h)[:, -1], atol=2e-5, rtol=1e-4)


def test_retention_one_is_the_unpatched_model_and_a_retention_is_met():
    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    with torch.no_grad():
        ref = model(**inputs).logits
    with vtc.patch(model, "sttm", retention=1.0):
        with torch.no_grad():
            assert torch.equal(model(**inputs).logits, ref)
    with vtc.patch(model, "sttm", retention=0.3) as handle:
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
    assert abs(stats.visual_tokens_out - 0.3 * 576) <= 3 * 4  # a quadtree step per frame at most
    (used,) = stats.reports["sttm"]["thresholds"][0]
    assert abs(used[0] - used[1] - (0.85 - 0.60)) < 1e-6


def test_one_frame_items_merge_spatially():
    """Two frames make one temporal patch on Qwen2-VL: a one-frame grid (T = 1), merged by the quadtree alone."""
    model, processor = model_and_processor("qwen2_vl")
    inputs = vtc.prepare_inputs(processor, videos()[0], QUESTIONS[0], num_frames=2, fps=8)
    (grid,) = token_grids(model, inputs)
    assert grid[0] == 1
    hidden, _, _, _ = layer_inputs(model, inputs, 2)
    visual = torch.nonzero(compressible_video_mask(model, inputs["input_ids"])).flatten()
    _, _, anchors = official_on(hidden[visual].view(*grid, -1), 0.95, 0.7, 1, True, True)
    _, _, _, stats = layer_inputs(model, inputs, 2, "sttm", tau_s=0.95, tau_t=0.7)
    assert stats.visual_tokens_out == len(anchors) < grid[1] * grid[2]


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_the_compressed_cache_of_a_video_answers_a_second_question(family):
    """STTM reads no question, and the video comes before it: the KV cache of the prompt up to the question (layers 0-1
    full, layers 2-3 merged) is computed once; each question then runs only its own tokens through the LLM, and its
    logits equal those of the whole prompt compressed from scratch."""
    model, processor = model_and_processor(family)
    prompts = [vtc.prepare_inputs(processor, videos()[0], q, num_frames=8, fps=8) for q in QUESTIONS]
    ids = [p["input_ids"] for p in prompts]
    shared = next(i for i in range(min(x.shape[1] for x in ids)) if ids[0][0, i] != ids[1][0, i])
    visual = compressible_video_mask(model, ids[0])
    assert int(torch.nonzero(visual).max()) < shared  # the video is in the shared prefix
    seen: list[int] = []
    probe = (
        vtc.api.resolve_adapter(model)
        .decoder_layers[0]
        .register_forward_pre_hook(
            lambda m, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
            with_kwargs=True,
        )
    )
    try:
        with vtc.patch(model, "sttm", retention=0.3) as handle, torch.no_grad():
            full = [model(**p).logits for p in prompts]  # each prompt compressed from scratch
            prefix = {
                k: (v[:, :shared] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v)
                for k, v in prompts[0].items()
            }
            seen.clear()
            cache = model(**prefix, use_cache=True).past_key_values
            kept = handle.stats().visual_tokens_out
            assert seen == [shared]
            lengths = [cache.layers[i].keys.shape[2] for i in range(4)]
            assert lengths == [shared] * 2 + [shared - int(visual.sum()) + kept] * 2
            for q in (1, 0):
                seen.clear()
                out = model(input_ids=ids[q][:, shared:], past_key_values=copy.deepcopy(cache), use_cache=True)
                assert seen == [ids[q].shape[1] - shared]  # only the question's tokens ran through the LLM
                # the text rows of the whole prompt's logits (the LLM's output is shortened by the merged tokens)
                torch.testing.assert_close(out.logits, full[q][:, -out.logits.shape[1] :], atol=2e-5, rtol=1e-4)
    finally:
        probe.remove()


def test_connect_variant_merges_before_the_llm_and_keeps_exact_counts():
    """`sttm-connect` on the embeddings: the LLM's input holds the official merge of the video's embeddings (at the
    layer-0 defaults); with fixed_count the count is exactly round(r N); DeepStack features follow the weights."""
    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    (grid,) = token_grids(model, inputs)
    embeds, _, _, _ = layer_inputs(model, inputs, 0)
    visual = torch.nonzero(compressible_video_mask(model, inputs["input_ids"])).flatten()
    feats, _, anchors = official_on(embeds[visual].view(*grid, -1), INPUT_TAU_S, INPUT_TAU_T, 1, True, True)
    got, _, _, stats = layer_inputs(model, inputs, 0, "sttm-connect")
    assert stats.llm_tokens_in == len(anchors)
    keep = torch.sort(
        torch.cat([torch.nonzero(~compressible_video_mask(model, inputs["input_ids"])).flatten(), visual[anchors]])
    ).values
    expected = embeds.clone()
    expected[visual[anchors]] = feats
    torch.testing.assert_close(got, expected[keep], atol=1e-6, rtol=1e-6)
    for r in (0.5, 0.2):
        _, _, _, stats = layer_inputs(model, inputs, 0, "sttm-connect", retention=r, fixed_count=True)
        assert stats.llm_tokens_in == round(r * 576)
    # side features (Qwen3-VL DeepStack) follow the per-cell weights of the merge
    x = structured_video(2, 6, 6, seed=6)
    tokens = VideoTokens.from_grid(x.reshape(72, 24), (2, 6, 6), mrope=True)
    tokens.extras["deepstack"] = torch.randn(72, 3, 8)
    method = STTMConnect(fixed_count=True).bind(0.25)
    out = method.connect(tokens, Context(family="qwen3_vl"))
    plan, _, _ = method.video_plan(x, "qwen3_vl", 18)
    assert len(out) == 18 and torch.equal(out.embeds, plan.features) and torch.equal(out.frame, plan.anchors // 36)
    side = torch.zeros(18, 3, 8).index_add_(0, plan.group, plan.weight[:, None, None] * tokens.extras["deepstack"])
    torch.testing.assert_close(out.extras["deepstack"], side, atol=1e-6, rtol=1e-6)
