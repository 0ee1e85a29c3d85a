"""EarlyTom's tensor functions: exact equality with a literal transcription of the official code
(viridisGreen/EarlyTom at b90932217325d986d11364c5d31466ab1812caa1: `SigLipEncoder.compression` / `coarse_segment` /
`fine_segment` in `LLaVA-NeXT/llava/model/multimodal_encoder/siglip_encoder.py`; `cluster_dpc_knn`,
`merge_tokens_by_clustering`, `merge_tokens_by_attention_frame`, `merge_tokens_by_local_window`,
`spatial_compression`, `divided_static_dynamic`, `add_newline_token` and the video part of
`prepare_inputs_labels_for_multimodal` in `earlytom/llava_arch.py`; `get_2dPool` in `LLaVA-NeXT/llava/model/
llava_arch.py`; the merge at INNER_k in `earlytom/modeling_qwen2.py`), and known answers (identical frames share
a group and mix, a scene cut starts a group, M caps a group at M - 1 frames, the EMA remembers, local windows take
each window's most attended token, the Stage II counts for given T0, T', r)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from vtc_plugins.earlytom import (
    DEFAULTS,
    SCRIPT_SETTINGS,
    FramePlan,
    coarse_segment,
    compress_frames,
    fine_segment,
    frame_budgets,
    frame_fate,
    group_token_count,
    inner_merge,
    pool_2d,
    received_attention,
    rescaled_ratio,
    select_dominant,
    select_local_windows,
    spatial_stage,
    split_static_dynamic,
    streaming_segments,
    task_setting,
    video_token_count,
)

# --- the official functions, transcribed as literally as possible --------------------------------------------------


class OfficialEncoder:
    """`SigLipEncoder`'s EarlyTom part (env settings passed in instead of read)."""

    def __init__(self, ema=0.9, mode="mixing", max_window=8):
        self.ema = ema
        self.mode = mode
        assert self.mode in ["naive_mixing", "mixing", "merging"], "Wrong mode"
        self.max_window = max_window

    def compression(self, hidden_state, attn_weight, tau=None, last_layer=False, init_layer=False):
        hidden_state_normed = F.normalize(hidden_state, p=2, dim=-1)
        num_frames = hidden_state_normed.size(0)

        if num_frames <= 1:
            return hidden_state, attn_weight, [(0, num_frames - 1)]

        selected_frames = []
        start_idx = 0
        ref_feat = hidden_state_normed[0]
        sim = 1.0

        for i in range(1, num_frames):
            curr_feat = hidden_state_normed[i]
            cur_sim = F.cosine_similarity(ref_feat, curr_feat, dim=-1).mean()
            sim = self.ema * cur_sim + (1 - self.ema) * sim
            if sim < tau or (i - start_idx + 1) >= self.max_window:
                end_idx = i - 1
                selected_frames.append((start_idx, end_idx))
                start_idx = i
                ref_feat = hidden_state_normed[i]
                sim = 1.0

        selected_frames.append((start_idx, num_frames - 1))

        merged_frames, merged_attn, _ = self.coarse_segment(
            hidden_state, attn_weight, selected_frames, hidden_state_normed
        )

        if last_layer:
            selected_frames_refined = []
            merged_frames_normed = F.normalize(merged_frames, p=2, dim=-1)
            start_idx = 0
            ref_feat = merged_frames_normed[0]
            sim = 1.0
            for i in range(1, merged_frames_normed.shape[0]):
                cur_feat = merged_frames_normed[i]
                cur_sim = F.cosine_similarity(ref_feat, cur_feat, dim=-1).mean()
                sim = self.ema * cur_sim + (1 - self.ema) * sim
                if sim < tau or (i - start_idx + 1) >= self.max_window:
                    end_idx = i - 1
                    selected_frames_refined.append((start_idx, end_idx))
                    start_idx = i
                    ref_feat = merged_frames[i]
                    sim = 1.0
            selected_frames_refined.append((start_idx, merged_frames.shape[0] - 1))
            selected_frames = selected_frames_refined

        return merged_frames, merged_attn, selected_frames

    def coarse_segment(self, pooled_image_feat, attn_weights, groups, hidden_state_normed):
        out_feats, out_attns, mixed_index = [], [], []

        for s, e in groups:
            length = e - s + 1
            if length <= 0:
                continue
            if length == 1:
                f = pooled_image_feat[s].unsqueeze(0)
                a = attn_weights[s].unsqueeze(0)
            elif length == 2:
                f = torch.stack([pooled_image_feat[s], pooled_image_feat[e]], dim=0)
                a = torch.stack([attn_weights[s], attn_weights[e]], dim=0)
            else:
                mid_feat = pooled_image_feat[s + 1 : e]
                mid_att = attn_weights[s + 1 : e]

                tau = F.cosine_similarity(hidden_state_normed[s], hidden_state_normed[e], dim=-1).mean(dim=-1)
                mf, ma = self.fine_segment(mid_feat, mid_att, tau=tau)
                f = torch.cat([pooled_image_feat[s].unsqueeze(0), mf, pooled_image_feat[e].unsqueeze(0)], dim=0)
                a = torch.cat([attn_weights[s].unsqueeze(0), ma, attn_weights[e].unsqueeze(0)], dim=0)

            out_feats.append(f)
            out_attns.append(a)
            mixed_index.append(f.size(0))

        if len(out_feats) == 0:
            return pooled_image_feat, attn_weights, []
        merged_feats = torch.cat(out_feats, dim=0)
        merged_attns = torch.cat(out_attns, dim=0)
        return merged_feats, merged_attns, mixed_index

    def fine_segment(self, feat, attn, tau):
        if feat.size(0) < 2:
            return feat, attn

        if self.mode == "naive_mixing":
            mf = feat.mean(dim=0, keepdim=True)
            ma = attn.mean(dim=0, keepdim=True)
            return mf, ma

        T, S, _ = feat.shape
        feat_norm = F.normalize(feat, dim=-1)
        sims = F.cosine_similarity(feat_norm[:-1], feat_norm[1:], dim=-1).mean(dim=-1)

        mixed_feats, mixed_attn = [], []
        i = 0
        while i < T - 1:
            cur_sim = sims[i]
            if i + 1 < T - 1:
                next_sim = sims[i + 1]
                should_merge = cur_sim > tau and cur_sim > next_sim
            else:
                next_sim = 0.0
                should_merge = cur_sim > tau
            if should_merge:
                weight = cur_sim / (cur_sim + next_sim) if next_sim != 0 else 1.0
                mixed_feats.append(weight * feat[i] + (1 - weight) * feat[i + 1])
                mixed_attn.append(weight * attn[i] + (1 - weight) * attn[i + 1])
                i += 2
            else:
                mixed_feats.append(feat[i])
                mixed_attn.append(attn[i])
                i += 1
        mixed_feats = torch.stack(mixed_feats, dim=0)
        mixed_attn = torch.stack(mixed_attn, dim=0)
        return mixed_feats, mixed_attn


def official_get_2dPool(image_feature, side, mode, stride=2):
    height = width = side
    num_frames, num_tokens, num_dim = image_feature.shape
    image_feature = image_feature.view(num_frames, height, width, -1)
    image_feature = image_feature.permute(0, 3, 1, 2).contiguous()
    if mode == "average":
        image_feature = torch.nn.functional.avg_pool2d(image_feature, stride)
    elif mode == "max":
        image_feature = torch.nn.functional.max_pool2d(image_feature, stride)
    elif mode == "bilinear":
        height, width = image_feature.shape[2:]
        scaled_shape = [math.ceil(height / stride), math.ceil(width / stride)]
        image_feature = torch.nn.functional.interpolate(image_feature, size=scaled_shape, mode="bilinear")
    image_feature = image_feature.permute(0, 2, 3, 1)
    image_feature = image_feature.view(num_frames, -1, num_dim)
    return image_feature


def official_cluster_dpc_knn(x, cluster_num, k=7):
    with torch.no_grad():
        batch_size, seq_len, embed_dim = x.shape

        dist_matrix = torch.cdist(x.float(), x.float()) / (embed_dim**0.5)

        dist_nearest, index_nearest = torch.topk(dist_matrix, k, dim=-1, largest=False)
        density = (-(dist_nearest**2).mean(dim=-1)).exp()
        density = density + torch.rand(density.shape, device=density.device, dtype=density.dtype) * 1e-6

        mask = (density[:, None, :] > density[:, :, None]).type(x.dtype)
        dist_max = dist_matrix.flatten(1).max(dim=-1).values[:, None, None]
        dist, index_parent = (dist_matrix * mask + dist_max * (1 - mask)).min(dim=-1)

        score = dist * density
        _, index_center = score.topk(cluster_num, dim=-1)

        return index_center, dist_matrix


def official_merge_tokens_by_clustering(feat, target_indices, dist_matrix, cluster_num, Beta):
    batch_size, seq_len, embed_dim = feat.shape
    all_indices = torch.arange(seq_len, device=feat.device)
    all_indices = all_indices.unsqueeze(0).expand(batch_size, -1)
    non_target_indices = torch.zeros((batch_size, seq_len - cluster_num), dtype=torch.long, device=feat.device)
    for b in range(batch_size):
        non_target_mask = ~torch.isin(all_indices[b], target_indices[b])
        non_target_indices[b] = all_indices[b][non_target_mask]

    non_target_feat = torch.gather(feat, dim=1, index=non_target_indices.unsqueeze(-1).expand(-1, -1, feat.size(-1)))

    dist_matrix = torch.gather(
        dist_matrix, dim=1, index=non_target_indices.unsqueeze(-1).expand(-1, -1, dist_matrix.size(-1))
    )
    dist_matrix = torch.gather(
        dist_matrix, dim=2, index=target_indices.unsqueeze(1).expand(-1, dist_matrix.size(1), -1)
    )

    idx_cluster = torch.argmin(dist_matrix, dim=-1)

    cluster_tokens = []
    for b in range(batch_size):
        batch_tokens = []
        for i in range(cluster_num):
            mask = idx_cluster[b] == i
            if mask.any():
                cluster_features = non_target_feat[b][mask]
                if os.environ.get("NO_BETA", "0") == "0":
                    cluster_means = cluster_features.mean(dim=0)
                    batch_tokens.append(Beta * feat[b][target_indices[b][i]] + (1 - Beta) * cluster_means)
                else:
                    all_features = torch.cat([feat[b][target_indices[b][i]].unsqueeze(0), cluster_features], dim=0)
                    batch_tokens.append(all_features.mean(dim=0))
            else:
                batch_tokens.append(feat[b][target_indices[b][i]])
        cluster_tokens.append(torch.stack(batch_tokens))
    cluster_tokens = torch.stack(cluster_tokens)

    return cluster_tokens


def official_merge_tokens_by_attention_frame(feat, attn, pos, retain_ratio, D, Beta, K, fixed_pos=False):
    """Literal; `fixed_pos=True` replaces the crashing `pos.masked_select(mask.unsqueeze(-1))` by
    `pos.masked_select(mask)` (the only change), so the D > 0 branch can be compared."""
    batch_size, seq_len, embed_dim = feat.shape
    dominant_num = round(math.ceil(seq_len * retain_ratio) * (1 - D))
    contextual_num = math.ceil(seq_len * retain_ratio) - dominant_num

    if dominant_num > 0:
        all_indices = attn.topk(dominant_num, dim=1).indices
        mask = torch.ones_like(feat[:, :, 0], dtype=torch.bool, device=feat.device).scatter_(1, all_indices, False)
        dominant_tokens = feat.masked_select(~mask.unsqueeze(-1)).view(batch_size, dominant_num, embed_dim)
        dominant_pos = pos.masked_select(~mask).view(batch_size, dominant_num)
    else:
        mask = torch.ones_like(feat[:, :, 0], dtype=torch.bool, device=feat.device)
        dominant_tokens = torch.empty((-1, embed_dim), device=feat.device)
        dominant_pos = torch.empty((batch_size, 0), device=feat.device)

    if contextual_num > 0:
        feat_filtered = feat.masked_select(mask.unsqueeze(-1)).view(batch_size, seq_len - dominant_num, embed_dim)
        if fixed_pos:
            contextual_pos = pos.masked_select(mask).view(batch_size, seq_len - dominant_num)
        else:
            contextual_pos = pos.masked_select(mask.unsqueeze(-1)).view(batch_size, seq_len - dominant_num)
        target_indices, dist_matrix = official_cluster_dpc_knn(feat_filtered, contextual_num, k=min(K, contextual_num))
        target_indices = torch.sort(target_indices, dim=-1)[0]
        contextual_pos = torch.stack([contextual_pos[b][target_indices[b]] for b in range(batch_size)])
        contextual_tokens = official_merge_tokens_by_clustering(
            feat_filtered, target_indices, dist_matrix, contextual_num, Beta
        )
    else:
        contextual_tokens = torch.empty((batch_size, 0, embed_dim), device=feat.device)
        contextual_pos = torch.empty((batch_size, 0), device=feat.device)

    image_feat = []
    image_pos = []
    for b in range(batch_size):
        batch_tokens = torch.cat([dominant_tokens[b], contextual_tokens[b]], dim=0)
        batch_pos = torch.cat([dominant_pos[b], contextual_pos[b]], dim=0)
        image_feat.append(batch_tokens)
        image_pos.append(batch_pos)
    image_feat = torch.stack(image_feat)
    image_pos = torch.stack(image_pos)

    return image_feat, image_pos


def official_merge_tokens_by_local_window(feat, attn, pos, retain_ratio, local_k=1, num_windows=None):
    B, N, C = feat.shape
    assert attn.shape == (B, N)
    device = feat.device
    target_n = max(1, round(N * retain_ratio))

    if num_windows is None:
        num_windows = max(1, math.ceil(target_n / local_k))

    min_win_size = local_k
    if N // num_windows < min_win_size:
        local_k = max(1, N // num_windows)
        num_windows = math.ceil(target_n / local_k)

    base_size = N // num_windows
    remainder = N % num_windows
    window_sizes = [base_size + 1 if i < remainder else base_size for i in range(num_windows)]

    feat_windows = torch.split(feat, window_sizes, dim=1)
    attn_windows = torch.split(attn, window_sizes, dim=1)

    selected = []
    selected_pos = []
    cur_pos = 0
    for wf, wa in zip(feat_windows, attn_windows):
        win_size = wf.shape[1]
        k = min(local_k, win_size)
        if k == 0:
            continue

        _, idx_local = wa.topk(k=k, dim=1)
        idx_global = idx_local + cur_pos
        cur_pos += win_size

        batch_idx = torch.arange(B, device=device).unsqueeze(1).expand(-1, k)
        token = feat[batch_idx, idx_global, :]
        pos_ = pos[batch_idx, idx_global]

        selected.append(token)
        selected_pos.append(pos_)

    if not selected:
        return feat[:, :target_n, :], pos[:, target_n]

    merged = torch.cat(selected, dim=1)
    merged_pos = torch.cat(selected_pos, dim=1)

    cur_n = merged.shape[1]

    if cur_n > target_n:
        step = cur_n / target_n
        idx = torch.round(torch.arange(0, cur_n, step, device=device)).long()
        merged = merged[:, idx, :]
        merged_pos = merged_pos[:, idx]
    elif cur_n < target_n:
        pad = target_n - cur_n
        pad_tok = merged[:, -1:, :].expand(-1, pad, -1)
        pad_pos = merged_pos[:, -1:].expand(-1, pad)

        merged = torch.cat([merged, pad_tok], dim=1)
        merged_pos = torch.cat([merged_pos, pad_pos], dim=1)

    return merged, merged_pos


def official_add_newline_token(feat, pos, grid_size, newline_token):
    row_pos = pos // grid_size
    expanded_feat_list = []
    for cur_feat, cur_row_pos in zip(feat, row_pos):
        expanded_feat = []
        for row in range(grid_size):
            find_row_feat = cur_feat[cur_row_pos == row]
            if len(find_row_feat) > 0:
                expanded_feat.append(torch.cat((find_row_feat, newline_token), dim=0))
            else:
                expanded_feat.append(find_row_feat)
        batch_feat = torch.cat(expanded_feat, dim=0)
        expanded_feat_list.append(batch_feat)

    image_feat = torch.cat(expanded_feat_list, dim=0)
    return image_feat


def official_spatial_compression(
    static_feat,
    static_attn,
    dynamic_feat,
    dynamic_attn,
    static_pos,
    dynamic_pos,
    window_size,
    retain_ratio,
    D,
    Beta,
    K,
    images_dtype,
    mm_newline_position,
    image_newline=None,
    fixed_pos=False,
):
    has_static = static_feat is not None
    newline_token = image_newline[None] if mm_newline_position == "grid" else None

    grid_size = int(math.sqrt(dynamic_feat.shape[1]))
    if window_size <= 2:
        dynamic_feat, dynamic_pos = official_merge_tokens_by_attention_frame(
            dynamic_feat, dynamic_attn, dynamic_pos, retain_ratio, D, Beta, K, fixed_pos
        )
        if mm_newline_position != "grid":
            feat = dynamic_feat.flatten(0, 1)
        else:
            feat = dynamic_feat.flatten(0, 1)
            pos = dynamic_pos.flatten(0, 1)
            feat = official_add_newline_token(feat, pos, grid_size, newline_token).to(images_dtype)
        return feat.to(images_dtype)
    else:
        dynamic_feat, dynamic_pos = official_merge_tokens_by_attention_frame(
            dynamic_feat, dynamic_attn, dynamic_pos, retain_ratio, D, Beta, K, fixed_pos
        )
        static_feat, static_pos = official_merge_tokens_by_local_window(
            static_feat, static_attn, static_pos, retain_ratio
        )

        if mm_newline_position != "grid":
            if has_static:
                feat = torch.cat([dynamic_feat[0, :, :], static_feat.flatten(0, 1), dynamic_feat[-1, :, :]])
            else:
                feat = dynamic_feat.flatten(0, 1)
        else:
            if has_static:
                first_feat = dynamic_feat[0, :, :]
                middle_feat = static_feat.flatten(0, 1)
                end_feat = dynamic_feat[-1, :, :]
                feat = torch.cat([first_feat, middle_feat, end_feat], dim=0)
                pos = torch.cat([dynamic_pos[0, :], static_pos.flatten(0, 1), dynamic_pos[-1, :]], dim=0)
                feat = official_add_newline_token(first_feat, pos, grid_size, newline_token)
            else:
                pos = dynamic_feat.shape[0] * dynamic_feat.shape[1]
                feat = official_add_newline_token(dynamic_feat, pos, grid_size, newline_token)
        return feat.to(images_dtype)


def official_divided_static_dynamic(image_feat, attn_weights, selected_frames):
    T, S, D = image_feat.shape
    device = image_feat.device
    all_pos_indices = torch.arange(S, device=device).unsqueeze(0)

    static_feat_list, static_attn_list, static_pos_list = [], [], []
    dynamic_feat_list, dynamic_attn_list, dynamic_pos_list = [], [], []

    for start, end in selected_frames:
        group_frames = end - start + 1

        if group_frames <= 2:
            dyn_feat = image_feat[start : end + 1]
            dyn_attn = attn_weights[start : end + 1]
            dyn_pos = all_pos_indices.expand(group_frames, -1)

            static_feat_list.append(None)
            static_attn_list.append(None)
            static_pos_list.append(None)

            dynamic_feat_list.append(dyn_feat)
            dynamic_attn_list.append(dyn_attn)
            dynamic_pos_list.append(dyn_pos)

        else:
            dyn_feat = torch.stack([image_feat[start], image_feat[end]], dim=0)
            dyn_attn = torch.stack([attn_weights[start], attn_weights[end]], dim=0)
            dyn_pos = all_pos_indices.expand(2, -1)

            static_feat = image_feat[start + 1 : end]
            static_attn = attn_weights[start + 1 : end]
            static_pos = all_pos_indices.expand(static_feat.shape[0], -1)

            static_feat_list.append(static_feat)
            static_attn_list.append(static_attn)
            static_pos_list.append(static_pos)

            dynamic_feat_list.append(dyn_feat)
            dynamic_attn_list.append(dyn_attn)
            dynamic_pos_list.append(dyn_pos)

    return (static_feat_list, static_attn_list, static_pos_list, dynamic_feat_list, dynamic_attn_list, dynamic_pos_list)


def official_video_features(pooled_image_feat, attn_weights, selected_frames, init_frames, retain_ratio, D, Beta, K):
    """The video part of `prepare_inputs_labels_for_multimodal` (L394-415) after pooling, one_token path."""
    reduced_frames, seq_len, _ = pooled_image_feat.shape
    total_tokens = init_frames * seq_len
    reduced_tokens = (init_frames - reduced_frames) * seq_len
    retain_ratio = min(retain_ratio / ((total_tokens - reduced_tokens) / total_tokens), 1)
    static_feat, static_attn, static_pos, dynamic_feat, dynamic_attn, dynamic_pos = official_divided_static_dynamic(
        pooled_image_feat, attn_weights, selected_frames
    )
    segment_features = []
    for idx, (start, end) in enumerate(selected_frames):
        window_size = end - start + 1
        segment_features.append(
            official_spatial_compression(
                static_feat[idx],
                static_attn[idx],
                dynamic_feat[idx],
                dynamic_attn[idx],
                static_pos[idx],
                dynamic_pos[idx],
                window_size,
                retain_ratio,
                D,
                Beta,
                K,
                pooled_image_feat.dtype,
                "one_token",
                fixed_pos=D > 0,
            )
        )
    return torch.cat(segment_features, dim=0)


def official_inner_merge(hidden_states, last_layer_attention, start, length, r):
    """`Qwen2Model_earlytom.forward` L240-305 (last_layer_attention: [B, H, L, L] of layer INNER_k - 1)."""
    INNER_image_token_start_index, INNER_image_token_length, INNER_r = start, length, r
    seq_length_with_past = hidden_states.shape[1]
    last_layer_attention_avg = torch.mean(last_layer_attention, dim=1)[0]
    last_layer_attention_avg_last_tok = last_layer_attention_avg[-1]
    last_layer_attention_avg_last_tok_image = last_layer_attention_avg_last_tok[
        INNER_image_token_start_index : INNER_image_token_start_index + INNER_image_token_length
    ]
    top_attention_rank_index = (
        last_layer_attention_avg_last_tok_image.topk(round(INNER_image_token_length * (1 - INNER_r))).indices
        + INNER_image_token_start_index
    )

    device = hidden_states.device
    all_indices = torch.arange(INNER_image_token_length, device=device)
    non_topk_mask = ~torch.isin(all_indices, top_attention_rank_index - INNER_image_token_start_index)
    non_topk_indices = all_indices[non_topk_mask] + INNER_image_token_start_index
    non_topk_states = hidden_states[:, non_topk_indices, :]
    topk_states = hidden_states[:, top_attention_rank_index, :]
    non_topk_norm = torch.norm(non_topk_states, dim=-1, keepdim=True)
    topk_norm = torch.norm(topk_states, dim=-1, keepdim=True)
    dot_product = torch.bmm(non_topk_states, topk_states.transpose(1, 2))
    sim_matrix = dot_product / (non_topk_norm * topk_norm.transpose(1, 2))
    sim_max, sim_max_index = torch.max(sim_matrix, dim=-1)
    for b in range(hidden_states.size(0)):
        for i in range(len(non_topk_indices)):
            non_topk_idx = non_topk_indices[i]
            most_similar_topk_idx = top_attention_rank_index[sim_max_index[b, i]]
            hidden_states[b, most_similar_topk_idx, :] = (
                hidden_states[b, most_similar_topk_idx, :] + hidden_states[b, non_topk_idx, :]
            ) / 2

    keep_indexs = torch.cat(
        (
            torch.arange(INNER_image_token_start_index, device=device),
            top_attention_rank_index,
            torch.arange(INNER_image_token_start_index + INNER_image_token_length, seq_length_with_past, device=device),
        )
    )
    keep_indexs = keep_indexs.sort().values
    hidden_states = hidden_states[:, keep_indexs, :]
    return hidden_states, keep_indexs


# --- random inputs -------------------------------------------------------------------------------------------------


def scene_video(g: torch.Generator, frames: int, tokens: int, dim: int, dtype=torch.float32) -> torch.Tensor:
    """Frames [T, S, D] of a few scenes (random cuts) with per-frame noise of varying strength, so that mean cosines
    spread over (0, 1) and every branch of the segmentation is taken."""
    scenes = int(torch.randint(1, 4, (1,), generator=g))
    base = torch.randn(scenes, tokens, dim, generator=g)
    scene_of = torch.sort(torch.randint(0, scenes, (frames,), generator=g)).values
    noise = 0.1 + 1.2 * torch.rand(frames, 1, 1, generator=g)
    return (base[scene_of] + noise * torch.randn(frames, tokens, dim, generator=g)).to(dtype)


def attention_maps(g: torch.Generator, frames: int, heads: int, tokens: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(frames, heads, tokens, tokens, generator=g).softmax(dim=-1).to(dtype)


def random_groups(g: torch.Generator, frames: int, longest: int = 6) -> list[tuple[int, int]]:
    groups, start = [], 0
    while start < frames:
        n = int(torch.randint(1, longest + 1, (1,), generator=g))
        groups.append((start, min(frames, start + n) - 1))
        start += n
    return groups


# --- Stage I: equality with the official code ----------------------------------------------------------------------

STAGE1_CASES = [  # (frames, tokens, dim, heads)
    (1, 6, 4, 2),
    (2, 6, 4, 2),
    (7, 9, 5, 2),
    (12, 16, 8, 2),
    (20, 9, 6, 1),
]


SETTINGS = [  # (tau, M, mode, last prune layer)
    (0.4, 4, "mixing", False),
    (0.8, 8, "mixing", True),
    (0.6, 6, "naive_mixing", True),
    (0.85, 4, "merging", False),
    (0.3, 8, "mixing", True),
    (0.95, 6, "mixing", False),
]


@pytest.mark.parametrize("dtype,seeds", [(torch.float32, 4), (torch.bfloat16, 1), (torch.float16, 1)])
def test_compression_equals_the_official_code(dtype, seeds):
    """5 shapes x seeds (4 in float32, 1 in bfloat16 / float16) x 6 settings (tau, M, mode, last layer) = 120 / 30
    cases: merged frames, merged attention maps and groups identical (torch.equal), the plan's bookkeeping
    consistent; in float32 every branch is taken (cuts by tau and by M, mixes with a weight and with weight 1,
    kept middle frames, means, drops)."""
    g = torch.Generator().manual_seed(0)
    seen: set[str] = set()
    checked = 0
    for frames, tokens, dim, heads in STAGE1_CASES:
        for _ in range(seeds):
            hidden = scene_video(g, frames, tokens, dim, dtype)
            attn = attention_maps(g, frames, heads, tokens, dtype)
            for tau, max_window, mode, last in SETTINGS:
                official = OfficialEncoder(0.9, mode, max_window)
                ref_h, ref_a, ref_groups = official.compression(hidden, attn, tau, last_layer=last)
                plan, groups = compress_frames(hidden, tau, 0.9, max_window, mode, last_layer=last)
                assert isinstance(plan, FramePlan)
                assert torch.equal(plan.apply(hidden), ref_h) and torch.equal(plan.apply(attn), ref_a)
                assert groups == ref_groups, (frames, tau, max_window, mode, last)
                assert plan.num_output == ref_h.shape[0] and plan.output_groups[-1][1] == plan.num_output - 1
                sizes = [e - s + 1 for s, e in plan.groups]
                assert max(sizes) <= max(1, max_window - 1)
                seen |= {"cap" for n in sizes[:-1] if n == max_window - 1} | {"cut" for n in sizes[:-1] if n < 3}
                for out in plan.outputs:
                    seen.add(out.kind if out.kind != "mix" else "mix1" if out.weight == 1.0 else "mixw")
                seen |= {"drop"} if plan.dropped else set()
                checked += 1
    assert checked == 5 * seeds * len(SETTINGS)
    if dtype == torch.float32:
        assert seen == {"cap", "cut", "copy", "mix1", "mixw", "mean", "drop"}, seen


def test_coarse_and_fine_segment_equal_the_official_code_on_given_groups():
    """3 shapes x 5 seeds x 2 modes = 30 cases: `coarse_segment` on random groups (up to 7 frames) equals the
    official one, and `fine_segment` directly on random middle stacks with random tau (4 taus each)."""
    g = torch.Generator().manual_seed(1)
    for frames, tokens, dim in ((9, 8, 4), (15, 12, 6), (24, 6, 3)):
        for _ in range(5):
            hidden = scene_video(g, frames, tokens, dim)
            attn = attention_maps(g, frames, 2, tokens)
            groups = random_groups(g, frames, longest=7)
            normed = F.normalize(hidden, p=2, dim=-1)
            for mode in ("mixing", "naive_mixing"):
                official = OfficialEncoder(mode=mode)
                ref_h, ref_a, sizes = official.coarse_segment(hidden, attn, groups, normed)
                plan = coarse_segment(hidden, groups, normed, mode)
                assert torch.equal(plan.apply(hidden), ref_h) and torch.equal(plan.apply(attn), ref_a)
                assert [e - s + 1 for s, e in plan.output_groups] == sizes
                for tau in (0.1, 0.4, 0.7, 0.95):
                    mid = hidden[1 : frames - 1]
                    ref_f, ref_m = official.fine_segment(mid, attn[1 : frames - 1], torch.tensor(tau))
                    ours = fine_segment(mid, torch.tensor(tau), mode)
                    assert torch.equal(torch.stack([m.apply(mid) for m in ours]), ref_f)


def test_frame_fate_tracks_every_original_frame():
    """2 seeds x 2 modes, three prune layers in a row (float64, no layer in between): the composed fate matrix maps
    the input stack onto the output, rows sum to 1 and dropped frames are zero columns."""
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        hidden = scene_video(g, 24, 9, 5, torch.float64)
        for mode in ("mixing", "naive_mixing"):
            x, plans = hidden, []
            for layer in range(3):
                plan, _ = compress_frames(x, 0.5, 0.9, 6, mode, last_layer=layer == 2)
                plans.append(plan)
                x = plan.apply(x)
            fate = frame_fate(plans)
            assert fate.shape == (x.shape[0], 24)
            assert torch.allclose(fate.sum(dim=1), torch.ones(x.shape[0], dtype=torch.float64))
            assert torch.allclose(torch.einsum("ot,tsd->osd", fate, hidden), x)
            for plan in plans:
                assert all(plan.matrix()[:, f].sum() == 0 for f in plan.dropped)


# --- Stage I: known answers ----------------------------------------------------------------------------------------


def test_identical_frames_share_a_group_and_similar_frames_mix():
    """3 cases. 5 identical frames (one-hot tokens, every cosine exactly 1) form one group, but nothing mixes:
    s_i > tau fails on the exact tie with tau = cos(first, last), so frames 0, 1, 2, 4 stay and frame 3 (the last
    middle frame) is dropped; naive_mixing averages the 3 middle frames. Frames drifting away from frame 1 by
    growing steps (tau = cos(first, last) low, s0 > s1) mix frames 1 and 2 with w = s0 / (s0 + s1)."""
    frame = torch.eye(6, 4)[None]
    hidden = frame.expand(5, 6, 4).contiguous()
    plan, groups = compress_frames(hidden, tau=0.5, max_window=8, mode="mixing")
    assert groups == [(0, 4)]
    assert [(m.kind, m.frames) for m in plan.outputs] == [
        ("copy", (0,)),
        ("copy", (1,)),
        ("copy", (2,)),
        ("copy", (4,)),
    ]
    assert plan.dropped == (3,) and torch.equal(plan.apply(hidden), frame.expand(4, 6, 4))
    naive, _ = compress_frames(hidden, tau=0.5, max_window=8, mode="naive_mixing")
    assert [(m.kind, m.frames) for m in naive.outputs][1] == ("mean", (1, 2, 3)) and naive.num_output == 3
    assert naive.matrix()[1].tolist() == [0.0, 1 / 3, 1 / 3, 1 / 3, 0.0]

    g = torch.Generator().manual_seed(3)
    a, step = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)
    drift = torch.stack([a + c * step for c in (0.0, 0.3, 0.32, 0.5, 0.8)])
    plan, groups = compress_frames(drift, tau=0.1, max_window=8)
    assert groups == [(0, 4)]
    assert [(m.kind, m.frames) for m in plan.outputs] == [("copy", (0,)), ("mix", (1, 2)), ("copy", (4,))]
    normed = F.normalize(drift, dim=-1)
    s0, s1 = (F.cosine_similarity(normed[i], normed[i + 1], dim=-1).mean() for i in (1, 2))
    assert torch.allclose(plan.outputs[1].weight, s0 / (s0 + s1)) and plan.dropped == (3,)
    assert torch.allclose(plan.matrix()[1, 1:3], torch.stack([s0, s1]) / (s0 + s1))


def test_fine_segment_mixes_a_local_maximum_with_its_weight():
    """1 case: middle frames m0, m1 ~ m0, m2 unrelated: s0 > tau and s0 > s1, so m0 and m1 mix with
    w = s0 / (s0 + s1); m2 (the last middle frame) is dropped."""
    g = torch.Generator().manual_seed(3)
    m0 = torch.randn(8, 4, generator=g)
    mid = torch.stack([m0, m0 + 0.1 * torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)])
    normed = F.normalize(mid, dim=-1)
    s = F.cosine_similarity(normed[:-1], normed[1:], dim=-1).mean(dim=-1)
    out = fine_segment(mid, 0.5)
    assert len(out) == 1 and out[0].kind == "mix" and out[0].frames == (0, 1)
    w = s[0] / (s[0] + s[1])
    assert torch.equal(out[0].weight, w)
    assert torch.allclose(out[0].apply(mid), w * mid[0] + (1 - w) * mid[1])


def test_scene_change_starts_a_group_and_m_caps_groups():
    """3 cases: A A A B B cuts before the first B; 10 identical frames with M = 4 give groups of M - 1 = 3 frames;
    a group of 3 keeps all its frames (one middle frame is kept as is)."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
    hidden = torch.stack([a, a, a, b, b])
    assert streaming_segments(F.normalize(hidden, dim=-1), tau=0.5) == [(0, 2), (3, 4)]
    same = a.expand(10, 16, 8)
    assert streaming_segments(F.normalize(same, dim=-1), tau=0.5, max_window=4) == [(0, 2), (3, 5), (6, 8), (9, 9)]
    plan, _ = compress_frames(hidden[:3].contiguous(), tau=0.5)
    assert plan.num_output == 3 and plan.dropped == ()


def test_ema_remembers_the_previous_similarity():
    """1 case: one token per frame at cosine 0.57 to the reference, tau 0.6: frame 1 stays (0.9 * 0.57 + 0.1 = 0.613),
    frame 2 at the same cosine cuts (0.9 * 0.57 + 0.1 * 0.613 = 0.574); without memory (EMA = 1) frame 1 cuts."""
    angle = math.acos(0.57)
    vec = torch.tensor([[1.0, 0.0], [math.cos(angle), math.sin(angle)], [math.cos(angle), math.sin(angle)]])
    frames = vec[:, None, :].double()
    assert streaming_segments(frames, tau=0.6, ema=0.9) == [(0, 1), (2, 2)]
    assert streaming_segments(frames, tau=0.6, ema=1.0) == [(0, 0), (1, 2)]  # no memory: 0.57 cuts at once


# --- Stage II: equality with the official code ---------------------------------------------------------------------


def test_pool_and_received_attention_equal_the_official_code():
    """3 modes x 2 shapes = 6 cases: `pool_2d` equals `get_2dPool` (27x27 and 24x24 grids), and attention maps
    reduce by the mean over heads and queries."""
    g = torch.Generator().manual_seed(5)
    for side in (27, 24):
        x = torch.randn(3, side * side, 4, generator=g)
        for mode in ("bilinear", "average", "max"):
            assert torch.equal(pool_2d(x, side, 2, mode), official_get_2dPool(x, side, mode))
    attn = attention_maps(g, 3, 4, 9)
    assert torch.equal(received_attention(attn), attn.mean(dim=(1, 2)))
    assert pool_2d(torch.randn(2, 729, 1, generator=g), 27).shape == (2, 196, 1)


def test_local_windows_equal_the_official_code():
    """4 seeds x 4 ratios x 4 (local_k, num_windows) settings = 64 cases, including the resample path (local_k 2)
    and more windows than tokens (30 for 23)."""
    g = torch.Generator().manual_seed(6)
    for _ in range(4):
        feat, attn = torch.randn(3, 23, 4, generator=g), torch.rand(3, 23, generator=g)
        pos = torch.arange(23).expand(3, -1)
        for ratio in (0.05, 0.2, 0.5, 1.0):
            for local_k, windows in ((1, None), (2, None), (3, 4), (1, 30)):
                ref = official_merge_tokens_by_local_window(feat, attn, pos, ratio, local_k, windows)
                ours = select_local_windows(feat, attn, pos, ratio, local_k, windows)
                assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def test_dominant_selection_equals_the_official_code(monkeypatch):
    """D = 0: 4 seeds x 4 ratios = 16 cases (top-k in index order). D in (0.3, 0.9) x beta rule on / off x
    2 seeds = 8 cases against the official function with its `pos` line fixed (the literal one raises)."""
    g = torch.Generator().manual_seed(7)
    for seed in range(4):
        feat, attn = torch.randn(2, 30, 6, generator=g), torch.rand(2, 30, generator=g)
        pos = torch.arange(30).expand(2, -1)
        for ratio in (0.05, 0.2, 0.5, 1.0):
            ref = official_merge_tokens_by_attention_frame(feat, attn, pos, ratio, 0.0, 0.6, 7)
            ours = select_dominant(feat, attn, pos, ratio)
            assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
        for d in (0.3, 0.9) if seed < 2 else ():
            for use_beta in (True, False):
                monkeypatch.setenv("NO_BETA", "0" if use_beta else "1")
                torch.manual_seed(11)
                ref = official_merge_tokens_by_attention_frame(feat, attn, pos, 0.5, d, 0.6, 7, fixed_pos=True)
                torch.manual_seed(11)
                ours = select_dominant(feat, attn, pos, 0.5, d, 0.6, 7, use_beta)
                assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
                assert ours[0].shape[1] == math.ceil(30 * 0.5)
    with pytest.raises(RuntimeError):  # the official D > 0 branch: pos [B, S] against a [B, S, 1] mask
        official_merge_tokens_by_attention_frame(feat, attn, pos, 0.5, 0.5, 0.6, 7)


@pytest.mark.parametrize("d", [0.0, 0.5])
def test_spatial_stage_equals_the_official_video_features(d):
    """D = 0: 6 seeds x 3 ratios = 18 cases; D = 0.5 (DPC-kNN, slow): 2 seeds x 2 ratios = 4 cases. The whole
    Stage II (rescaled ratio, static / dynamic split, per-group selections, token order) equals
    `prepare_inputs_labels_for_multimodal`'s video features, and the count matches `video_token_count`."""
    g = torch.Generator().manual_seed(8)
    for _ in range(6 if d == 0 else 2):
        reduced, side = int(torch.randint(3, 14, (1,), generator=g)), 5
        feat = torch.randn(reduced, side * side, 6, generator=g)
        attn = torch.rand(reduced, side * side, generator=g)
        groups = random_groups(g, reduced)
        for ratio in (0.1, 0.25, 0.4) if d == 0 else (0.1, 0.25):
            torch.manual_seed(12)
            ref = official_video_features(feat, attn, groups, 16, ratio, d, 0.6, 7)
            torch.manual_seed(12)
            r2 = rescaled_ratio(ratio, 16, reduced, side * side)
            ours = spatial_stage(feat, attn, groups, r2, d)
            assert torch.equal(ours.tokens, ref)
            assert len(ours.frame) == len(ours.position) == ref.shape[0]
            sizes = [e - s + 1 for s, e in groups]
            assert video_token_count(sizes, side * side, ratio, 16, newline=False) == ref.shape[0]
            if d == 0:  # every token is a copy of the pooled feature it names
                assert torch.equal(ours.tokens, feat[ours.frame, ours.position])


# --- Stage II: known answers ---------------------------------------------------------------------------------------


def test_local_windows_pick_each_windows_most_attended_token():
    """2 cases: 10 tokens at r = 0.3 -> 3 windows of sizes 4, 3, 3, one token each (the window's max); r = 0.25 ->
    round(2.5) = 2 (Python rounding) windows of 5."""
    attn = torch.tensor([[0.1, 0.9, 0.2, 0.3, 0.5, 0.1, 0.2, 0.0, 0.1, 0.7]])
    feat = torch.arange(10.0).view(1, 10, 1)
    pos = torch.arange(10).view(1, 10)
    tokens, where = select_local_windows(feat, attn, pos, 0.3)
    assert where.tolist() == [[1, 4, 9]] and tokens.flatten().tolist() == [1.0, 4.0, 9.0]
    _, where = select_local_windows(feat, attn, pos, 0.25)
    assert where.tolist() == [[1, 9]]


def test_stage2_counts():
    """3 cases: r = 0.1, T0 = 32, T' = 24, S = 196 -> r' = 0.1333, 27 tokens per dynamic frame and 26 per static
    frame; groups [5, 2, 1, 4, 5, 3, 4] give 637 tokens + 1 newline, and `spatial_stage` yields exactly 637; r' is
    capped at 1; the split puts first / last frames of long groups in the dynamic set."""
    ratio = rescaled_ratio(0.1, 32, 24, 196)
    assert math.isclose(ratio, 0.1 * 32 / 24) and frame_budgets(196, ratio) == (27, 26)
    sizes = [5, 2, 1, 4, 5, 3, 4]
    assert [group_token_count(n, 196, ratio) for n in sizes] == [132, 54, 27, 106, 132, 80, 106]
    assert video_token_count(sizes, 196, 0.1, 32) == 638
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    groups = [(s, s + n - 1) for s, n in zip(starts, sizes)]
    feat, attn = torch.randn(24, 196, 2), torch.rand(24, 196)
    assert spatial_stage(feat, attn, groups, ratio).tokens.shape[0] == 637
    assert rescaled_ratio(0.25, 32, 4, 196) == 1
    assert split_static_dynamic([(0, 1), (2, 5)]) == [((0, 1), ()), ((2, 5), (3, 4))]


def test_official_grid_newline_path_keeps_only_the_first_frame():
    """1 case (documents the official LLaVA-Video "grid" path, not reproduced): a group of 3 frames at r' = 0.2
    over 5x5 tokens gives first-frame tokens each followed by a newline (2 x 5 = 10), middle and last frames lost."""
    g = torch.Generator().manual_seed(9)
    feat, attn = torch.randn(3, 25, 4, generator=g), torch.rand(3, 25, generator=g)
    static, st_attn, st_pos, dyn, dyn_attn, dyn_pos = official_divided_static_dynamic(feat, attn, [(0, 2)])
    newline = torch.full((4,), 7.0)
    out = official_spatial_compression(
        static[0],
        st_attn[0],
        dyn[0],
        dyn_attn[0],
        st_pos[0],
        dyn_pos[0],
        3,
        0.2,
        0,
        0.6,
        7,
        feat.dtype,
        "grid",
        newline,
    )
    assert out.shape[0] == 10 and torch.equal(out[1::2], newline.expand(5, 4))
    assert group_token_count(3, 25, 0.2) == 15  # what vtc (one_token order) keeps


# --- Stage III -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inner_merge_equals_the_official_loop(dtype):
    """Seeds (2 in float32, 1 in bfloat16) x 2 batch sizes x 3 ratios = 12 / 6 cases, plus 1 case where every
    visual token folds into one kept token (the halving order matters): hidden states and kept indices identical."""
    g = torch.Generator().manual_seed(10)
    for _ in range(2 if dtype == torch.float32 else 1):
        for batch in (1, 2):
            seq, start, length = 30, 5, 20
            hidden = torch.randn(batch, seq, 8, generator=g).to(dtype)
            attention = torch.rand(batch, 2, seq, seq, generator=g).to(dtype)
            for r in (0.25, 0.5, 0.9):
                ref_h, ref_keep = official_inner_merge(hidden.clone(), attention, start, length, r)
                scores = attention.mean(dim=1)[0][-1][start : start + length]
                ours_h, ours_keep = inner_merge(hidden, scores, start, length, r)
                assert torch.equal(ours_keep, ref_keep) and torch.equal(ours_h, ref_h)
                assert ours_h.shape[1] == seq - length + round(length * (1 - r))
    hidden = torch.randn(1, 12, 4, generator=g)
    hidden[0, 2:10] = hidden[0, 2] + 0.01 * torch.randn(8, 4, generator=g)  # all visual tokens nearly parallel
    attention = torch.zeros(1, 1, 12, 12)
    attention[0, 0, -1, 3] = 1.0  # keep one token (r = 0.875 of 8)
    ref_h, ref_keep = official_inner_merge(hidden.clone(), attention, 2, 8, 0.875)
    ours_h, ours_keep = inner_merge(hidden, attention[0, 0, -1, 2:10], 2, 8, 0.875)
    assert torch.equal(ours_keep, ref_keep) and torch.equal(ours_h, ref_h) and ours_keep.tolist()[2] == 3


# --- settings ------------------------------------------------------------------------------------------------------


def test_defaults_and_script_table():
    """6 cases: the env defaults, and rows of the OneVision / LLaVA-Video scripts (README example included)."""
    assert (DEFAULTS.tau, DEFAULTS.max_window, DEFAULTS.ema, DEFAULTS.prune_layers) == (0.6, 8, 0.9, (6, 21, 23))
    assert (DEFAULTS.mode, DEFAULTS.d, DEFAULTS.knn, DEFAULTS.beta, DEFAULTS.inner_k) == ("mixing", 0.0, 7, 0.6, None)
    readme = task_setting("llava-onevision-7b", "videomme", 0.20)
    assert (readme.tau, readme.prune_layers) == (0.5, (8, 21, 23))
    assert task_setting("llava-onevision-7b", "longvideobench_val_v", 0.25).prune_layers == (4, 14, 24)
    assert task_setting("llava-video-7b", "longvideobench_val_v", 0.25).prune_layers == (6, 21, 23)
    ov = SCRIPT_SETTINGS["llava-onevision-7b"]
    assert (ov.frames, ov.max_window, ov.inner_k, ov.inner_r) == (32, 6, 18, 0.5)


# --- the method on the LLaVA towers (vtc.hf.tower) ------------------------------------------------------------------


def _tiny(family):
    from vtc.testing.fixtures import model_and_processor, single_inputs

    model, _ = model_and_processor(family)
    return model, single_inputs(family)


def reference_stage_one(layers, x, prune, tau, max_window, cls):
    """Stage I as the official encoder forward runs it (siglip_encoder.py L585-639): every layer as the tower's own
    module, and after each prune layer `compression` on its output (patch tokens only on CLIP: vtc's choice), the
    frames mixed; returns the last layer's output and the refined groups."""
    groups = None
    for index, layer in enumerate(layers):
        x = layer(x, None)
        if index in prune:
            plan, groups = compress_frames(x[:, cls:], tau, 0.9, max_window, "mixing", index == max(prune))
            x = plan.apply(x)
    return x, groups


@pytest.mark.parametrize("family", ["llava_onevision", "llava_next_video"])
def test_stage_one_in_the_tower_equals_the_official_encoder_loop(family):
    """2 cases: SigLIP (the official tower) and CLIP with its class token mixed along with its frame."""
    from vtc.core.pipeline import Pipeline
    from vtc.core.tokens import Context
    from vtc.hf.adapters import resolve_adapter
    from vtc.hf.tower import LlavaTower
    from vtc_plugins.earlytom import EarlyTom

    model, inputs = _tiny(family)
    adapter = resolve_adapter(model)
    tower = LlavaTower(adapter)
    pixels = inputs["pixel_values_videos"][0]
    frames = pixels.shape[0]
    method = EarlyTom(tau=0.0, prune_layers=(0, 1))
    with torch.no_grad():
        x = tower.model.embeddings(pixels)
        if hasattr(tower.model, "pre_layrnorm"):
            x = tower.model.pre_layrnorm(x)
        cls = int(tower.class_token)
        want, groups = reference_stage_one(tower.layers[:2], x, (0, 1), 0.0, 6, cls)
        pipeline = Pipeline(method, retention=0.25, family=family)
        ctx = Context(family=family, video_index=0)
        features, alive, run = tower.run(
            pixels, [frames], 1, pipeline, [ctx.replace(state=pipeline._stores["earlytom"])]
        )
    assert alive[0].numel() == want.shape[0] < frames  # frames were mixed away
    torch.testing.assert_close(features[0][alive[0]], want, rtol=1e-5, atol=1e-5)
    assert bool((features[0][[f for f in range(frames) if f not in alive[0].tolist()]] == 0).all())
    assert pipeline._stores["earlytom"][0]["groups"] == groups


@pytest.mark.parametrize("family", ["llava_onevision", "llava_next_video"])
def test_the_llm_sees_stage_two_of_the_frames_stage_one_left(family):
    """2 cases: the count is the official formula on the refined groups; tau above 1 at retention 1.0 is the
    unpatched model."""
    import vtc

    model, inputs = _tiny(family)
    with torch.no_grad():
        want = model(**inputs).logits
        with vtc.patch(model, "earlytom", retention=1.0, tau=1.5):
            assert torch.equal(model(**inputs).logits, want)
        with vtc.patch(model, "earlytom", retention=0.25, tau=0.0) as handle:
            model(**inputs)
            stats = handle.stats()
            groups = handle.pipeline._stores["earlytom"][0]["groups"]
    t, h, w = stats.grids[0]
    sizes = [end - start + 1 for start, end in groups]
    assert sum(sizes) < t
    assert stats.llm_tokens_in == video_token_count(sizes, h * w, 0.25, t, newline=False)
    assert [(r.stage, r.tokens_in, r.tokens_out) for r in stats.stages] == [
        ("encode", t * h * w, sum(sizes) * h * w),
        ("connect", sum(sizes) * h * w, stats.llm_tokens_in),
    ]


def test_earlytom_refusals_name_the_problem():
    import vtc
    from vtc.testing.fixtures import model_and_processor

    qwen, _ = model_and_processor("qwen2_vl")
    with pytest.raises(ValueError, match="earlytom.*patch_grid"):
        vtc.patch(qwen, "earlytom", retention=0.25)
    model, inputs = _tiny("llava_onevision")
    with pytest.raises(ValueError, match="mixes frames cell by cell"), torch.no_grad():
        with vtc.patch(model, "tome+earlytom", r=10, retention=0.25):
            model(**inputs)
    with pytest.raises(ValueError, match="prune layer 5 is past"), torch.no_grad():
        with vtc.patch(model, "earlytom", prune_layers=(0, 5), retention=0.25):
            model(**inputs)
    with pytest.raises(ValueError, match="prune_layers must be"):
        vtc.registry()["earlytom"](prune_layers=(-1,))
