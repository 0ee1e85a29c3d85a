"""FlashVID: the connect stage (DySeg, ADTS, TSTM, DPC-kNN) against a transcription of the official tensor code
(Fanziyang-v/FlashVID @ 1d37422c, `flashvid/utils.py` and `flashvid/token_selection.py`), known answers, the
in-LLM pruning against a layer-by-layer reference, the patched tiny models, and clear errors."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import vtc
from tests.conftest import model_and_processor, single_inputs
from tests.reference import CAPTURED, ManualLLM, last_rows_attention
from vtc.core.geometry import default_geometry
from vtc.core.tokens import Context, VideoTokens
from vtc.core.vision_stats import VisionStat
from vtc_plugins.flashvid import (
    FlashVID,
    calibrated_distances,
    cluster_counts,
    flashvid_plan,
    frame_budget,
    llm_kept_count,
    segment_lengths,
    select_tokens,
    tree_merge,
)

# --- the official code, transcribed (flashvid/token_selection.py, flashvid/utils.py @ 1d37422c) --------------------
# Verbatim but for marked changes: the DPC-kNN noise `torch.rand_like(density)` draws from a seeded generator (vtc's
# `ctx.generator`); `fix=True` leaves the ADTS picks out of a single-frame segment's merge (the official code keeps
# them in: `test_official_single_frame_segment_repeats_an_index`); `mean=True` passes each merged token's count to
# its parent, so a tree becomes the mean of its tokens (the official code passes 1 per direct child:
# `test_official_trees_divide_by_one_plus_the_direct_children`).


def official_pairwise_cosine_distances(image_features):
    normed_features = image_features / image_features.norm(p=2, dim=-1, keepdim=True)
    similarities = torch.bmm(normed_features, normed_features.transpose(-1, -2))
    return 1.0 - similarities


def official_attn_div(features, cls_attention, num_retained_tokens):
    original_features = features
    features = features.float()
    cls_attention = cls_attention.float() * 1e6
    bsz, num_visual_tokens, feat_dim = features.shape
    dist_matrix = official_pairwise_cosine_distances(features)
    dist_matrix = dist_matrix * cls_attention.unsqueeze(1)
    keep_indices = torch.zeros(bsz, num_retained_tokens, dtype=torch.long)
    min_dist = torch.topk(dist_matrix, k=2, dim=1, largest=False).values[:, 1, :]
    keep_indices[:, 0] = torch.argmax(min_dist, dim=-1)
    for i in range(1, num_retained_tokens):
        dist_sub_matrix = torch.gather(
            dist_matrix, dim=1, index=keep_indices[:, :i].unsqueeze(-1).expand(-1, -1, num_visual_tokens)
        )
        min_dist = torch.min(dist_sub_matrix, dim=1).values
        min_dist.scatter_(1, keep_indices[:, :i], -1)
        keep_indices[:, i] = torch.argmax(min_dist, dim=-1)
    keep_indices = keep_indices.sort().values
    selected = torch.gather(original_features, dim=1, index=keep_indices.unsqueeze(-1).expand(-1, -1, feat_dim))
    return selected, keep_indices


def official_attn_div_v2(features, cls_attention, num_retained_tokens):
    original_features = features
    features = features.float()
    pooled_features = features.mean(1)
    global_cls_attention = cls_attention.float() * 1e6
    bsz, num_visual_tokens, feat_dim = features.shape
    dist_matrix = official_pairwise_cosine_distances(features)
    calibration_term1 = global_cls_attention.unsqueeze(1)
    local_cls_attention = torch.einsum("b n d, c d -> b c n", features, pooled_features).mean(1)
    calibration_term2 = local_cls_attention.unsqueeze(1)
    dist_matrix = dist_matrix * calibration_term1 * calibration_term2
    keep_indices = torch.zeros(bsz, num_retained_tokens, dtype=torch.long)
    min_dist = torch.topk(dist_matrix, k=2, dim=1, largest=False).values[:, 1, :]
    keep_indices[:, 0] = torch.argmax(min_dist, dim=-1)
    for i in range(1, num_retained_tokens):
        dist_sub_matrix = torch.gather(
            dist_matrix, dim=1, index=keep_indices[:, :i].unsqueeze(-1).expand(-1, -1, num_visual_tokens)
        )
        min_dist = torch.min(dist_sub_matrix, dim=1).values
        keep_indices[:, i] = torch.argmax(min_dist, dim=-1)
    keep_indices = keep_indices.sort().values
    selected = torch.gather(original_features, dim=1, index=keep_indices.unsqueeze(-1).expand(-1, -1, feat_dim))
    return selected, keep_indices


def official_attn(features, cls_attention, num_retained_tokens):
    bsz, num_visual_tokens, feat_dim = features.shape
    topk_indices = torch.topk(cls_attention, k=num_retained_tokens, dim=-1).indices.sort().values
    selected = torch.gather(features, dim=1, index=topk_indices.unsqueeze(-1).expand(-1, -1, feat_dim))
    return selected, topk_indices


def official_div(features, num_retained_tokens):
    original_features = features
    features = features.float()
    bsz, num_visual_tokens, feat_dim = features.shape
    dist_matrix = official_pairwise_cosine_distances(features)
    min_dist = torch.topk(dist_matrix, k=2, dim=1, largest=False).values[:, 1, :]
    keep_indices = torch.zeros(bsz, num_retained_tokens, dtype=torch.long)
    keep_indices[:, 0] = torch.argmax(min_dist, dim=-1)
    for i in range(1, num_retained_tokens):
        dist_sub_matrix = torch.gather(
            dist_matrix, dim=1, index=keep_indices[:, :i].unsqueeze(-1).expand(-1, -1, num_visual_tokens)
        )
        min_dist = torch.min(dist_sub_matrix, dim=1).values
        min_dist.scatter_(1, keep_indices[:, :i], -1)
        keep_indices[:, i] = torch.argmax(min_dist, dim=-1)
    keep_indices = keep_indices.sort().values
    selected = torch.gather(original_features, dim=1, index=keep_indices.unsqueeze(-1).expand(-1, -1, feat_dim))
    return selected, keep_indices


OFFICIAL_SELECTION = {"attn": official_attn, "attn_div_v2": official_attn_div_v2, "attn_div": official_attn_div}
OFFICIAL_SELECTION["div"] = official_div


def official_segment(video_features, segment_threshold, min_segment_num, complementary_segment=True):
    num_frames, feat_dim = video_features.shape
    normed_video_features = video_features / video_features.norm(p=2, dim=-1, keepdim=True)
    transition_similarities = torch.sum(normed_video_features[:-1] * normed_video_features[1:], dim=-1)
    cut_indices = torch.where(transition_similarities < segment_threshold)[0]
    num_segments = cut_indices.numel() + 1
    if num_segments < min_segment_num and complementary_segment:
        num_remaining_cut_indices = min_segment_num - num_segments
        transition_similarities[transition_similarities < segment_threshold] = 1.0
        complementary_cut_indices = torch.topk(
            transition_similarities,
            k=min(num_remaining_cut_indices, transition_similarities.shape[0]),
            largest=False,
        ).indices
        cut_indices = torch.cat([cut_indices, complementary_cut_indices]).sort().values
    padded_cut_indices = F.pad(cut_indices, (1, 1), value=0)
    padded_cut_indices[0] = -1
    padded_cut_indices[-1] = num_frames - 1
    return torch.diff(padded_cut_indices, n=1, dim=0)


def official_dpc_knn(features, num_clusters, k, generator):
    bsz, seq_len, feat_dim = features.shape
    dists = torch.cdist(features.float(), features.float()) / math.sqrt(feat_dim)
    nearest_dist = torch.topk(dists, k=k, dim=-1, largest=False).values
    density = torch.mean(-(nearest_dist**2), dim=-1).exp()
    density = density + torch.rand(density.shape, generator=generator, dtype=density.dtype) * 1e-6  # changed
    mask = density[:, None, :] > density[:, :, None]
    max_dist = dists.view(bsz, -1).max(dim=-1)[0].view(-1, 1, 1)
    modified_dists = torch.where(mask, dists, max_dist)
    dist, _ = torch.min(modified_dists, dim=-1)
    score = dist * density
    cluster_center_indices = torch.topk(score, k=num_clusters, dim=-1).indices
    dists = torch.gather(dists, dim=-1, index=cluster_center_indices.unsqueeze(1).expand(-1, seq_len, -1))
    cluster_indices = torch.argmin(dists, dim=-1)
    cluster_indices.scatter_(
        dim=-1,
        index=cluster_center_indices,
        src=torch.arange(num_clusters).to(cluster_indices).unsqueeze(0).expand(bsz, -1),
    )
    return cluster_indices, cluster_center_indices


def official_spatiotemporal_compression(video_features, temporal_threshold, token_mask, config, mean=False):
    num_frames, num_visual_tokens, feat_dim = video_features.shape
    lower_bound = (config.num_attn_div_tokens + config.num_sttm_tokens) * num_frames
    normed_video_features = video_features / video_features.norm(p=2, dim=-1, keepdim=True)
    cosine_similarities = torch.einsum("b n d, b m d -> b n m", normed_video_features[1:], normed_video_features[:-1])
    cosine_similarities[~token_mask[1:].unsqueeze(-1).expand(-1, -1, num_visual_tokens)] = -1.0
    cosine_similarities[~token_mask[:-1].unsqueeze(1).expand(-1, num_visual_tokens, -1)] = -1.0
    max_sims, max_sim_indices = torch.max(cosine_similarities, dim=-1)
    padded_max_sims = F.pad(max_sims, (0, 0, 1, 0), value=-1)
    padded_max_sim_indices = F.pad(max_sim_indices, (0, 0, 1, 0), value=-1)
    token_counts = torch.ones(num_frames, num_visual_tokens).to(video_features)
    mask = padded_max_sims > temporal_threshold
    retaining_token_mask = ~mask
    if retaining_token_mask.int().sum() < lower_bound:
        soft_threshold = padded_max_sims.view(-1).topk(k=(num_frames * num_visual_tokens) - lower_bound).values[-1]
        soft_threshold = max(soft_threshold, -1.0 + 1e-6)
        mask = padded_max_sims > soft_threshold
        retaining_token_mask = ~mask
    for frame_idx in range(num_frames - 1, -1, -1):
        frame_features = video_features[frame_idx]
        frame_token_counts = token_counts[frame_idx]
        frame_max_sim_indices = padded_max_sim_indices[frame_idx]
        tokens_to_merge = frame_features[~mask[frame_idx]]
        to_merge_token_counts = frame_token_counts[~mask[frame_idx]]
        if tokens_to_merge.numel() > 0:
            aggregated_tokens = tokens_to_merge / to_merge_token_counts.unsqueeze(-1).to(tokens_to_merge.dtype)
            video_features[frame_idx][~mask[frame_idx]] = aggregated_tokens
            token_counts[frame_idx][~mask[frame_idx]] = 1
        other_tokens = frame_features[mask[frame_idx]]
        if other_tokens.numel() > 0:
            anchor_token_indices = frame_max_sim_indices[mask[frame_idx]]
            assigned_one_hot = F.one_hot(anchor_token_indices, num_classes=num_visual_tokens).to(video_features.dtype)
            aggregated_tokens = torch.einsum("m n, m d -> n d", assigned_one_hot, other_tokens)
            aggregated_token_counts = assigned_one_hot.sum(dim=0)
            if mean:  # changed: the children's own counts
                aggregated_token_counts = assigned_one_hot.T @ frame_token_counts[mask[frame_idx]]
            video_features[frame_idx - 1] += aggregated_tokens
            token_counts[frame_idx - 1] += aggregated_token_counts
            token_counts[frame_idx][mask[frame_idx]] = 0
    final_tokens, retained_token_indices = [], []
    for i in range(num_frames):
        frame_mask = retaining_token_mask[i] & token_mask[i]
        final_tokens.append(video_features[i][frame_mask])
        retained_token_indices.append(torch.where(frame_mask)[0])
    return final_tokens, retained_token_indices


def official_segment_compression(segment_features, segment_global_indices, cls_attention, config, generator, fix, mean):
    num_frames, num_visual_tokens, feat_dim = segment_features.shape
    if config.alpha > 0:
        method = config.token_selection_method
        additional_kwargs = {"cls_attention": cls_attention} if "attn" in method else {}
        selected_features, selected_indices = OFFICIAL_SELECTION[method](
            features=segment_features, num_retained_tokens=config.num_attn_div_tokens, **additional_kwargs
        )
        selected_global_indices = segment_global_indices.gather(1, index=selected_indices).view(-1)
    mask = torch.ones(num_frames, num_visual_tokens, dtype=torch.bool)
    mask.scatter_(1, selected_indices, False)
    num_other_tokens = config.num_sttm_tokens * num_frames
    if num_other_tokens > 0 and config.temporal_threshold < 1.0:
        if num_frames > 1:
            temp_merged_token_list, temp_merged_indices_list = official_spatiotemporal_compression(
                segment_features, config.temporal_threshold, mask, config, mean
            )
            temp_merged_global_indices_list = [
                segment_global_indices.view(num_frames, -1)[i][temp_merged_indices]
                for i, temp_merged_indices in enumerate(temp_merged_indices_list)
            ]
        elif fix:  # changed: the frame's tokens that ADTS did not pick
            temp_merged_token_list = [segment_features[0][mask[0]]]
            temp_merged_global_indices_list = [segment_global_indices[0][mask[0]]]
        else:
            temp_merged_token_list = [segment_features[0]]
            temp_merged_global_indices_list = [segment_global_indices[0]]
    else:
        temp_merged_token_list = []
        temp_merged_global_indices_list = []
    all_tokens = [selected_features.view(-1, feat_dim)]
    all_global_indices = [selected_global_indices]
    if num_other_tokens > 0:
        num_current_retained_tokens = sum(len(tokens) for tokens in temp_merged_token_list)
        adapative_contextual_ratio = num_other_tokens / num_current_retained_tokens
        for temp_merged_tokens, temp_merged_global_indices in zip(
            temp_merged_token_list, temp_merged_global_indices_list
        ):
            num_tokens, _ = temp_merged_tokens.shape
            aggregated_tokens = temp_merged_tokens
            global_token_indices = temp_merged_global_indices
            num_clusters = math.ceil(num_tokens * adapative_contextual_ratio)
            if num_clusters > 0 and adapative_contextual_ratio < 1.0:
                cluster_indices, cluster_center_indices = official_dpc_knn(
                    temp_merged_tokens.unsqueeze(0), num_clusters, min(num_clusters, 7), generator
                )
                assigned_one_hot = F.one_hot(cluster_indices[0], num_classes=num_clusters).to(segment_features.dtype)
                aggregated_tokens = torch.einsum("n c, n d -> c d", assigned_one_hot, temp_merged_tokens)
                aggregated_tokens = aggregated_tokens / assigned_one_hot.sum(dim=0).unsqueeze(-1)
                global_token_indices = temp_merged_global_indices[cluster_center_indices[0]]
            all_tokens.append(aggregated_tokens)
            all_global_indices.append(global_token_indices)
    return torch.cat(all_tokens, dim=0), torch.cat(all_global_indices, dim=0)


def official_flashvid_compression(video_features, cls_attention, config, generator, fix=True, mean=True):
    video_features = video_features.clone()  # the official code writes into its input
    num_frames, num_visual_tokens, feat_dim = video_features.shape
    if config.do_segment:
        segment_lengths_ = official_segment(
            video_features.mean(1), config.segment_threshold, config.min_segment_num, config.complementary_segment
        )
    else:
        segment_lengths_ = torch.tensor([num_frames], dtype=torch.long)
    global_indices = torch.arange(num_frames * num_visual_tokens, dtype=torch.long)
    token_budget = math.ceil(num_visual_tokens * config.retention_ratio * config.expansion)
    config.num_attn_div_tokens = math.ceil(token_budget * config.alpha)
    config.num_sttm_tokens = token_budget - config.num_attn_div_tokens
    all_segment_features, all_segment_indices = [], []
    offset = 0
    for seg_idx in range(segment_lengths_.shape[0]):
        seg_len = segment_lengths_[seg_idx]
        segment_features, segment_global_indices = official_segment_compression(
            video_features[offset : offset + seg_len],
            global_indices.view(num_frames, num_visual_tokens)[offset : offset + seg_len],
            cls_attention[offset : offset + seg_len],
            config,
            generator,
            fix,
            mean,
        )
        all_segment_features.append(segment_features)
        all_segment_indices.append(segment_global_indices)
        offset += seg_len
    final_tokens = torch.cat(all_segment_features, dim=0)
    final_global_indices = torch.cat(all_segment_indices, dim=0)
    sorted_indices = final_global_indices.argsort()
    return final_tokens[sorted_indices], final_global_indices[sorted_indices], segment_lengths_.tolist()


def official_config(**overrides) -> SimpleNamespace:
    """The flashvid() wrapper's defaults (flashvid/__init__.py), overridden."""
    config = dict(
        retention_ratio=0.25,
        do_segment=True,
        segment_threshold=0.9,
        min_segment_num=8,
        complementary_segment=True,
        token_selection_method="attn_div_v2",
        alpha=0.7,
        temporal_threshold=0.8,
        expansion=1.25,
    )
    config.update(overrides)
    return SimpleNamespace(**config)


# --- inputs with temporal structure ---------------------------------------------------------------------------------


def clip_features(seed: int, frames: int = 8, n: int = 36, dim: int = 16, cuts=(3, 6), dtype=torch.float32):
    """[F, N, D] features of a clip with scene cuts after the frames in `cuts`: within a scene each frame is the
    scene's tokens, shifted in space by a random permutation of a few positions, plus noise (so trees link tokens
    at other positions); a positive offset keeps every event relevance (ADTS v2) positive. And [F, N] attention
    (softmax rows)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    scene = torch.randn(n, dim, generator=g)
    for t in range(frames):
        if t in cuts:
            scene = torch.randn(n, dim, generator=g)
        perm = torch.arange(n)
        swap = torch.randperm(n, generator=g)[:6]
        perm[swap] = swap[torch.randperm(6, generator=g)]
        out.append(scene[perm] + 0.25 * torch.randn(n, dim, generator=g))
    features = torch.stack(out) + 3.0
    attention = torch.softmax(torch.randn(frames, n, generator=g) * 2, dim=-1)
    return features.to(dtype), attention


def run_both(features, attention, generator_seed=0, official_tree_sum=False, **config):
    """(official (tokens, indices, segments), vtc plan) on identical inputs and identically seeded noise; the tree
    divisor of the official code with `official_tree_sum`, else the mean on both sides."""
    cfg = official_config(**config)
    tokens, indices, segments = official_flashvid_compression(
        features, attention, cfg, torch.Generator().manual_seed(generator_seed), mean=not official_tree_sum
    )
    plan = flashvid_plan(
        features,
        attention,
        retention_ratio=cfg.retention_ratio,
        expansion=cfg.expansion,
        alpha=cfg.alpha,
        token_selection_method=cfg.token_selection_method,
        temporal_threshold=cfg.temporal_threshold,
        do_segment=cfg.do_segment,
        segment_threshold=cfg.segment_threshold,
        min_segment_num=cfg.min_segment_num,
        complementary_segment=cfg.complementary_segment,
        official_tree_sum=official_tree_sum,
        generator=torch.Generator().manual_seed(generator_seed),
    )
    return (tokens, indices, segments), plan


REFERENCE_CASES = [
    (seed, method, ratio, segments, official_sum)
    for seed in range(2)
    for method in ("attn_div_v2", "attn_div", "attn", "div")
    for ratio, segments, official_sum in ((0.1, 1, False), (0.25, 4, False), (0.1, 4, True), (0.25, 1, True))
]


@pytest.mark.parametrize("seed, method, ratio, min_segments, official_sum", REFERENCE_CASES)
def test_connect_stage_equals_the_official_code_32_cases(seed, method, ratio, min_segments, official_sum):
    """32 cases (2 clips x 4 selection methods x 4 pairs of retention ratio 0.1 / 0.25, min_segment_num 1 / 4 and
    tree divisor, the official one or the mean on both sides, covering each pair of their values): the same output
    tokens, bit for bit, at the same indices, in the same segments."""
    features, attention = clip_features(seed)
    (tokens, indices, segments), plan = run_both(
        features,
        attention,
        official_tree_sum=official_sum,
        retention_ratio=ratio,
        token_selection_method=method,
        min_segment_num=min_segments,
    )
    assert plan.segments == segments
    assert torch.equal(plan.anchors, indices)
    assert torch.equal(plan.embeds, tokens)
    assert any(length > 1 for length in segments)  # the trees of TSTM ran


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("official_sum", [False, True])
def test_connect_stage_equals_the_official_code_on_single_frame_segments_and_one_segment_16_cases(seed, official_sum):
    """16 cases (4 clips x 2 tree divisors x 2 layouts): every frame its own segment (min_segment_num = frames,
    the fixed single-frame path on both sides), and the whole clip as one segment (do_segment=False) with a
    temporal threshold that links many tokens into long trees."""
    features, attention = clip_features(seed, frames=6, cuts=())
    (tokens, indices, segments), plan = run_both(
        features, attention, official_tree_sum=official_sum, min_segment_num=6, segment_threshold=-1.0
    )
    assert segments == [1] * 6 and plan.segments == segments
    assert torch.equal(plan.anchors, indices) and torch.equal(plan.embeds, tokens)
    (tokens, indices, segments), plan = run_both(
        features, attention, official_tree_sum=official_sum, do_segment=False, temporal_threshold=0.5
    )
    assert segments == [6] and torch.equal(plan.anchors, indices) and torch.equal(plan.embeds, tokens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("official_sum", [False, True])
def test_connect_stage_equals_the_official_code_in_other_dtypes_4_cases(dtype, official_sum):
    """The arithmetic stays in the features' dtype as the official code's (trees, clusters); 4 cases."""
    features, attention = clip_features(5, dtype=dtype)
    (tokens, indices, _), plan = run_both(
        features, attention, official_tree_sum=official_sum, retention_ratio=0.2, min_segment_num=3
    )
    assert plan.embeds.dtype == dtype
    assert torch.equal(plan.anchors, indices) and torch.equal(plan.embeds, tokens)


@pytest.mark.parametrize("official_sum", [False, True])
def test_the_linear_map_gives_the_output_tokens(official_sum):
    """keep_weight / src / dst / src_weight restate every output as a weighted sum of the input tokens (float64
    features, float32 weights: the same numbers up to the weights' rounding), and every input token is counted
    exactly once; with the mean every output's weights sum to 1, with the official divisor long trees weigh more."""
    features, attention = clip_features(2, dtype=torch.float64)
    plan = flashvid_plan(features, attention, retention_ratio=0.15, min_segment_num=3, official_tree_sum=official_sum)
    x = features.reshape(-1, features.shape[-1])
    mixed = plan.keep_weight.double()[:, None] * x[plan.anchors]
    mixed = mixed.index_add(0, plan.dst, plan.src_weight.double()[:, None] * x[plan.src])
    torch.testing.assert_close(mixed, plan.embeds, atol=1e-6, rtol=1e-6)  # float32 weights (1/3, 1/7, ...)
    covered = torch.cat([plan.anchors[plan.keep_weight > 0], plan.src])
    assert torch.equal(torch.sort(covered).values, torch.arange(x.shape[0]))  # each input in one output
    total = plan.keep_weight.double().index_add(0, plan.dst, plan.src_weight.double())
    if official_sum:
        assert bool((total >= 1 - 1e-6).all()) and float(total.max()) > 1.2
    else:
        torch.testing.assert_close(total, torch.ones_like(total))  # every output is a mean


# --- the official faults vtc does not copy ------------------------------------------------------------------------


def test_official_single_frame_segment_repeats_an_index():
    """A single-frame segment: the official code clusters every token of the frame, ADTS picks included, so a
    cluster centred on an ADTS pick repeats its index (two tokens at one position); vtc clusters the frame's other
    tokens: the same count, no index twice, and the official output with that one change."""
    for seed in range(3):
        features, attention = clip_features(seed, frames=4, n=25, cuts=(1, 2, 3))
        cfg = official_config(retention_ratio=0.4, min_segment_num=4)
        _, official, _ = official_flashvid_compression(features, attention, cfg, torch.Generator(), fix=False)
        (_, fixed, _), plan = run_both(features, attention, retention_ratio=0.4, min_segment_num=4)
        assert plan.segments == [1, 1, 1, 1] and official.unique().numel() < official.numel()
        assert torch.equal(plan.anchors, fixed) and plan.anchors.unique().numel() == len(plan)
        # ceil(n (t / n)) clusters is t, or t + 1 by float rounding, on either side: per frame
        assert abs(len(plan) - official.numel()) <= len(plan.segments)


def test_official_trees_divide_by_one_plus_the_direct_children():
    """A token present in three frames (a chain a <- b <- c): the official loop adds c's sum to b, then b's sum
    (b + c) to a, but counts only one child each time, so the root is (a + b + c) / 2; vtc's default is the mean,
    (a + b + c) / 3, and official_tree_sum=True reproduces the official token."""
    torch.manual_seed(3)
    a = torch.randn(1, 8)
    features = torch.stack([a, a + 0.01 * torch.randn(1, 8), a + 0.02 * torch.randn(1, 8)])  # [3, 1, 8]
    features = torch.cat([features, torch.randn(3, 1, 8)], dim=1)  # a second, unrelated token per frame
    none = torch.zeros(3, 2, dtype=torch.bool)
    chain = features[:, 0].sum(0)
    mean = tree_merge(features, none, 0.99, lower_bound=1)
    assert mean.root_of[2, 0] == 0 and mean.size[0, 0] == 3
    torch.testing.assert_close(mean.features[0, 0], chain / 3)
    official = tree_merge(features, none, 0.99, lower_bound=1, official_sum=True)
    torch.testing.assert_close(official.features[0, 0], chain / 2)
    assert official.divisor[0, 0] == 2 and mean.divisor[0, 0] == 3
    cfg = SimpleNamespace(num_attn_div_tokens=0, num_sttm_tokens=0)
    tokens, _ = official_spatiotemporal_compression(features.clone(), 0.99, ~none, cfg)
    torch.testing.assert_close(tokens[0][0], chain / 2)  # the transcription, unchanged


def test_complementary_cuts_never_repeat_a_cut():
    """Two identical frames have a similarity that can round above 1 (here 1 + 2^-22): the official top-k over the
    similarities, with the cut transitions set to 1.0, then picks the cut again (an empty segment); vtc adds the
    lowest uncut transition."""
    v = torch.randn(8, generator=torch.Generator().manual_seed(0))  # its normalised self-dot is 1.0000002
    w = -v + 0.1
    means = torch.stack([v, v, w])  # transitions: 1.0000002 (uncut), about -1 (cut)
    assert official_segment(means.clone(), 0.9, 3).tolist() == [2, 0, 1]
    assert segment_lengths(means, 0.9, 3) == [1, 1, 1]


def test_adts_v2_never_picks_a_token_twice():
    """Duplicate tokens have zero distance to each other: once the distinct tokens are used up, the official v2
    (no -1 mask) picks an already chosen token again; vtc picks distinct tokens."""
    distinct = torch.randn(3, 8) + 3
    features = torch.cat([distinct, distinct[:1].expand(5, 8)])[None]  # 3 distinct, 5 copies of the first
    attention = torch.full((1, 8), 1 / 8)
    _, official = official_attn_div_v2(features, attention, 5)
    ours = select_tokens(features, attention, 5, "attn_div_v2")
    assert official.unique().numel() < 5
    assert ours.unique().numel() == 5


# --- known answers --------------------------------------------------------------------------------------------------


def test_budget_follows_the_official_expressions():
    assert frame_budget(196, 0.10, 1.25, 0.7) == (18, 7)  # B = ceil(24.5) = 25: the paper's 10 % on LLaVA-OV
    assert frame_budget(196, 0.25, 1.25, 0.7) == (44, 18)  # ceil(61.25) = 62, ceil(43.4) = 44
    assert frame_budget(169, 0.10, 1.25, 0.7) == (16, 6)  # LLaVA-Video: ceil(21.125) = 22, ceil(15.4) = 16
    assert frame_budget(100, 0.5, 1.25, 1.0) == (63, 0)
    assert llm_kept_count(100, 0.3) == 30 and llm_kept_count(101, 0.3) == 31  # ceil(V r), not round
    assert llm_kept_count(275, 0.1) == 28


def test_left_half_blank_frame_keeps_at_most_one_blank_token():
    """A frame whose left half is one repeated (blank) token: every diversity selection takes at most one of
    them while distinct tokens remain; attention alone takes the most attended."""
    torch.manual_seed(0)
    n, dim = 16, 8
    features = torch.randn(1, n, dim) + 3
    blank = torch.arange(n) % 4 < 2  # left half of a 4 x 4 grid
    features[0, blank] = features[0, 0].clone()
    attention = torch.full((1, n), 1.0 / n)
    for method in ("attn_div", "attn_div_v2", "div"):
        picks = select_tokens(features, attention, 7, method)[0]
        assert int(blank[picks].sum()) <= 1, method
    attention[0, blank] = 10.0 / n
    assert bool(blank[select_tokens(features, attention, 7, "attn")[0]].all())


def test_attention_scales_the_columns():
    """v1: Dist[i, j] = (1 - cos) a_j 1e6; v2 also times e_j = mean_c <x_j, p_c>."""
    x = torch.randn(2, 5, 4) + 2
    a = torch.rand(2, 5)
    plain = calibrated_distances(x, a, "div")
    v1 = calibrated_distances(x, a, "attn_div")
    torch.testing.assert_close(v1, plain * a[:, None, :] * 1e6)
    relevance = torch.stack([(x[b] @ x.mean(1).T).mean(1) for b in range(2)])
    torch.testing.assert_close(calibrated_distances(x, a, "attn_div_v2"), v1 * relevance[:, None, :])


def test_trees_follow_moved_tokens_and_average_at_the_root():
    """Frame 1 is frame 0 with two tokens swapped (plus noise); frame 2 repeats frame 1. Every free token of frames 1
    and 2 joins the token it came from, at its old position: one tree per frame-0 token, whose root holds the mean
    of its three members."""
    torch.manual_seed(1)
    n, dim = 6, 16
    f0 = torch.randn(n, dim)
    perm = torch.tensor([1, 0, 2, 3, 4, 5])
    f1 = f0[perm] + 0.01 * torch.randn(n, dim)
    f2 = f1 + 0.01 * torch.randn(n, dim)
    features = torch.stack([f0, f1, f2])
    selected = torch.zeros(3, n, dtype=torch.bool)
    selected[:, 5] = True  # one ADTS pick per frame takes no part
    trees = tree_merge(features, selected, threshold=0.8, lower_bound=3 * 2)
    assert trees.roots[0, :5].all() and not trees.roots[1:].any() and not trees.roots[:, 5].any()
    assert trees.root_of[1, 0] == 1 and trees.root_of[1, 1] == 0  # the swapped tokens follow their origin
    assert trees.root_of[2, 0] == 1 and trees.root_of[2, 2] == 2
    assert (trees.root_of[:, 5] == -1).all() and trees.size[0, :5].tolist() == [3] * 5
    expected = (f0[1] + f1[0] + f2[0]) / 3
    torch.testing.assert_close(trees.features[0, 1], expected)


def test_trees_stop_at_the_lower_bound():
    """Identical frames link every token, but the lower bound caps the merges: the threshold becomes the k-th
    largest similarity, so at most F N - lower_bound tokens merge (all equal: none, with the strict '>')."""
    frame = torch.randn(4, 8)
    features = torch.stack([frame, frame + 1e-3 * torch.randn(4, 8), frame + 2e-3 * torch.randn(4, 8)])
    none = torch.zeros(3, 4, dtype=torch.bool)
    assert int(tree_merge(features, none, 0.8, lower_bound=4).roots.sum()) == 4  # all of frames 1, 2 merge
    capped = tree_merge(features, none, 0.8, lower_bound=7).roots.sum()
    assert int(capped) >= 7


def test_cluster_counts():
    assert cluster_counts([5, 3, 0, 4], 12, exact=False) is None  # as many roots as the budget
    assert cluster_counts([10, 6, 4], 7, exact=False) == [4, 3, 2]  # ceil(n 0.35): 9 > 7
    exact = cluster_counts([10, 6, 4], 7, exact=True)
    assert sum(exact) == 7 and exact == [4, 2, 1]
    exact = cluster_counts([1, 1, 1, 1, 40], 10, exact=True)  # small frames keep one cluster each
    assert exact == [1, 1, 1, 1, 6]
    assert cluster_counts([25], 7, exact=False) == [8]  # ceil(25 * (7 / 25)) = 8 in Python floats, as official
    assert cluster_counts([25], 7, exact=True) == [7]


def test_dyseg_cuts_at_scene_changes_then_the_lowest_transitions():
    scenes = torch.randn(3, 16)
    means = torch.stack([scenes[0]] * 3 + [scenes[1]] * 3 + [scenes[2]] * 2) + 0.01 * torch.randn(8, 16)
    assert segment_lengths(means, 0.9, 1) == [3, 3, 2]
    assert segment_lengths(means, 0.9, 3) == [3, 3, 2]  # already three
    four = segment_lengths(means, 0.9, 4)
    assert len(four) == 4 and sum(four) == 8
    assert segment_lengths(means, 0.9, 4, complementary=False) == [3, 3, 2]
    assert segment_lengths(means[:1], 0.9, 8) == [1]


def test_fixed_count_keeps_exactly_the_budget():
    for seed in range(2):
        features, attention = clip_features(seed)
        plan = flashvid_plan(features, attention, retention_ratio=0.2, min_segment_num=3, exact=True)
        assert len(plan) == 8 * sum(frame_budget(36, 0.2, 1.25, 0.7)) and plan.anchors.unique().numel() == len(plan)
        adaptive = flashvid_plan(features, attention, retention_ratio=0.2, min_segment_num=3)
        assert len(adaptive) >= len(plan)


def test_full_budget_keeps_every_token():
    features, attention = clip_features(0)
    assert flashvid_plan(features, attention, retention_ratio=0.8) is None  # B = ceil(36) = N
    assert flashvid_plan(features, attention, retention_ratio=0.7) is not None


# --- the method -----------------------------------------------------------------------------------------------------


def test_defaults_are_the_official_ones():
    p = FlashVID().bind(None)
    assert p.ratio() == 0.25  # flashvid() wrapper default
    assert (p.alpha, p.temporal_threshold, p.expansion, p.segment_threshold) == (0.7, 0.8, 1.25, 0.9)
    assert p.do_segment and p.complementary_segment and not p.fixed_count
    assert p.connect_settings("llava_onevision") == {"token_selection_method": "attn_div_v2", "min_segment_num": 8}
    assert p.connect_settings("llava_next_video") == {"token_selection_method": "attn_div_v2", "min_segment_num": 8}
    assert p.connect_settings("qwen2_5_vl") == {"token_selection_method": "attn_div", "min_segment_num": 4}
    assert p.connect_settings("qwen2_vl") == {"token_selection_method": "attn_div", "min_segment_num": 4}
    assert p.llm_stage("qwen2_5_vl") == p.llm_stage("llava_onevision") == (20, 0.3)
    assert p.llm_stage("qwen3_vl") == (28, 0.1)  # scripts/qwen3_vl.sh
    explicit = FlashVID(retention_ratio=0.1, pruning_layer=5, llm_retention_ratio=0.5, min_segment_num=2)
    explicit = explicit.bind(0.3)
    assert explicit.ratio() == 0.1 and explicit.llm_stage("qwen3_vl") == (5, 0.5)
    assert explicit.connect_settings("qwen2_vl")["min_segment_num"] == 2
    # the paper's setting: R is the mean over the official 28 layers; Qwen3-VL's 36 with K = 28, r = 0.1
    for layers, (k, r) in ((28, (20, 0.3)), (36, (28, 0.1))):
        assert (k * 1.25 + (layers - k) * 1.25 * r) / layers == pytest.approx(1.0)


def test_card():
    cls = vtc.registry()["flashvid"]
    card = cls.card
    assert card.stages == ("connect", "prefill") and card.acts_in_llm and card.query_aware
    assert card.fixed_count_mode == "optional" and card.retention_reference == "layer_mean"
    assert card.whole_frames and card.vision_stats and card.owns == frozenset({"llm_token_schedule"})
    assert card.temporal and not card.acts_on_images  # videos only: images never reach it
    assert set(card.families) >= {"llava_onevision", "llava_next_video", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"}
    assert FlashVID().bind(0.25).vision_stats("llava_onevision") == [VisionStat("received", -1)]
    assert FlashVID().bind(0.25).vision_stats("qwen2_5_vl") == [VisionStat("received", -1)]
    assert FlashVID().bind(0.25).vision_stats("llava_next_video") == [VisionStat("cls", -1)]
    assert FlashVID().bind(1.0).vision_stats("qwen2_vl") == []


def test_counts():
    p = FlashVID(fixed_count=True).bind(0.1)
    # LLaVA-OneVision, 32 frames of 14 x 14: 25 per frame at the connector, ceil(800 * 0.3) = 240 from layer 20
    assert p.retained_count(32 * 196, (32, 14, 14), "llava_onevision") == 240
    assert p.retained_count(16 * 196, (16, 14, 14), "qwen3_vl") == math.ceil(16 * 25 * 0.1)
    assert p.retained_count(8 * 196, (32, 14, 14), "qwen2_vl") == 60  # a sampler left 8 whole frames
    assert FlashVID().bind(0.1).retained_count(32 * 196, (32, 14, 14), "qwen2_vl") is None  # adaptive default
    assert FlashVID().bind(1.0).retained_count(1568, (8, 14, 14), "qwen2_vl") == 1568


@pytest.mark.parametrize(
    "params, message",
    [
        ({"alpha": 1.5}, r"flashvid: alpha must be in \[0, 1\]"),
        ({"temporal_threshold": 1.0}, r"flashvid: temporal_threshold must be in \(-1, 1\)"),
        ({"token_selection_method": "fps"}, "flashvid: token_selection_method must be one of"),
        ({"retention_ratio": 0.0}, r"flashvid: retention_ratio must be in \(0, 1\]"),
        ({"pruning_layer": 0}, r"flashvid: pruning_layer must be in \[1, inf\)"),
        ({"llm_retention_ratio": 0.0}, r"flashvid: llm_retention_ratio must be in \(0, 1\]"),
        ({"expansion": 0.0}, r"flashvid: expansion must be in \(0, inf\)"),
        ({"min_segment_num": 0}, r"flashvid: min_segment_num must be in \[1, inf\)"),
    ],
)
def test_bad_parameters_are_clear_errors(params, message):
    with pytest.raises(ValueError, match=message):
        FlashVID(**params)


def test_an_image_is_refused_with_a_clear_error():
    plugin = FlashVID().bind(0.25)
    tokens = VideoTokens.from_grid(torch.randn(16, 8), (1, 4, 4))
    with pytest.raises(ValueError, match="flashvid applies to videos only"):
        plugin.connect(tokens, Context(family="qwen2_vl", media="image"))


def test_a_prompt_with_an_image_is_refused_or_passes_the_image_whole():
    """FlashVID needs time: a prompt with an image is refused, naming why, and with images=False the image reaches
    the LLM whole while the video is compressed."""
    from vtc.testing.fixtures import mixed_inputs

    model, _ = model_and_processor("qwen2_vl")
    inputs = mixed_inputs("qwen2_vl")
    with vtc.patch(model, "flashvid", retention=0.25, pruning_layer=2):
        with pytest.raises(ValueError, match=r"flashvid: needs time \(frames of a video\)"):
            model(**inputs)
    with vtc.patch(model, "flashvid", retention=0.25, pruning_layer=2, images=False) as handle:
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
    assert [(item.kind, item.compressed) for item in stats.items] == [("video", True), ("image", False)]
    reports = stats.reports["flashvid"]
    assert reports["kept"] == [stats.visual_tokens_out] and len(reports["plan"]) == 1


def test_pruning_layer_beyond_the_model_is_a_clear_error():
    model, _ = model_and_processor("qwen2_vl")
    with vtc.patch(model, "flashvid", retention=0.25):  # K = 20 on a 4-layer model
        with pytest.raises(ValueError, match="flashvid: pruning_layer=20 but the language model has only 4 layers"):
            model(**single_inputs("qwen2_vl"))


def test_vtc_serve_refuses_the_in_llm_pruning():
    from vtc.vllm.config import ServeConfig

    with pytest.raises(ValueError, match="flashvid acts inside the LLM"):
        ServeConfig.from_dict({"methods": "flashvid", "retention": 0.1})


def test_one_frame_video_and_deepstack_of_the_anchor():
    """A one-frame video runs the official single-frame path; side features (Qwen3-VL DeepStack) are the anchor's
    own, as the official `deepstack_visual_embed[keep]`, not merged."""
    torch.manual_seed(0)
    tokens = VideoTokens.from_grid(torch.randn(36, 8) + 2, (1, 6, 6), mrope=True)
    tokens.extras["deepstack"] = torch.randn(36, 2, 8)
    geometry = default_geometry("qwen3_vl")
    vision = {VisionStat("received", -1): torch.rand(1, 36)}
    ctx = Context(family="qwen3_vl", geometry=geometry, vision=vision, generator=torch.Generator().manual_seed(0))
    out = FlashVID().bind(0.25).connect(tokens, ctx)
    (plan,) = ctx.reports["plan"]
    assert plan.segments == [1] and len(out) == len(plan) < 36
    assert torch.equal(out.extras["deepstack"], tokens.extras["deepstack"][plan.anchors])
    assert torch.equal(out.positions, tokens.positions[:, plan.anchors]) and torch.equal(out.embeds, plan.embeds)
    assert float(out.weight.sum()) == 36  # every token counted once


# --- the patched models ---------------------------------------------------------------------------------------------

TSTM = {"segment_threshold": -1.0, "min_segment_num": 2, "pruning_layer": 2}  # two segments on the tiny clips


def layer_inputs(model, inputs, **params):
    """(hidden, cos, sin) entering decoder layer 0, and the stats, of a patched forward."""
    seen = {}

    def probe(module, args, kwargs):
        seen.setdefault("x", (args[0] if args else kwargs["hidden_states"], kwargs["position_embeddings"]))

    layer0 = vtc.api.resolve_adapter(model).decoder_layers[0]
    with vtc.patch(model, "flashvid", **params) as handle:
        hook = layer0.register_forward_pre_hook(probe, with_kwargs=True)
        try:
            with torch.no_grad():
                logits = model(**inputs).logits
        finally:
            hook.remove()
        stats = handle.stats()
    hidden, (cos, sin) = seen["x"]
    return hidden, cos, sin, stats, logits


@pytest.mark.parametrize("family", ["llava_onevision", "qwen2_vl"])
def test_patched_model_equals_the_layer_by_layer_reference(family):
    """The connector's tokens enter the LLM as the plan says (features, in grid order); from layer K = 2 on the
    reference keeps the top ceil(V 0.3) by layer 1's last-row attention (float32 softmax, head mean), positions
    kept: the same logits."""
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    hidden, cos, sin, stats, logits = layer_inputs(model, inputs, retention=0.25, **TSTM)
    (plan,) = stats.reports["flashvid"]["plan"]
    assert len(plan.segments) == 2 and stats.llm_tokens_in == len(plan)
    video_id = vtc.api.resolve_adapter(model).video_token_id
    first = int(torch.nonzero(inputs["input_ids"][0] == video_id)[0])
    slots = torch.arange(first, first + len(plan))
    torch.testing.assert_close(hidden[0, slots], plan.embeds.to(hidden.dtype))
    kept = llm_kept_count(len(plan), 0.3)
    assert stats.layer_visual_tokens == [len(plan)] * 2 + [kept] * 2
    assert stats.reports["flashvid"]["kept"] == [kept] == [stats.visual_tokens_out]
    ref = ManualLLM(model)
    with ref.capturing(), torch.no_grad():
        for i in range(len(ref.layers)):
            if i == 2:
                query, key = CAPTURED[1]
                scores = last_rows_attention(query, key, 1, upcast=True).float().mean(dim=1)[0, -1]
                top = slots[torch.topk(scores[slots], kept).indices]
                keep = torch.ones(hidden.shape[1], dtype=torch.bool)
                keep[slots] = False
                keep[top] = True
                hidden, cos, sin = hidden[:, keep], cos[:, keep], sin[:, keep]
            hidden = ref.attention_block(i, hidden, cos, sin)
            hidden = ref.mlp_block(i, hidden)
        ref_logits = ref.logits(hidden)
    torch.testing.assert_close(logits[:, -1], ref_logits[:, -1], atol=2e-5, rtol=1e-4)


def test_qwen3_vl_keeps_the_vision_start_and_end_markers():
    """The official Qwen3-VL code drops every <|vision_start|> / <|vision_end|> from the sequence; vtc keeps them
    (only video tokens are compressed), and the frames' timestamps with them."""
    model, processor = model_and_processor("qwen3_vl")
    inputs = single_inputs("qwen3_vl")
    ids = inputs["input_ids"][0]
    config = model.config
    markers = (ids == config.vision_start_token_id) | (ids == config.vision_end_token_id)
    hidden, _, _, stats, _ = layer_inputs(model, inputs, retention=0.25, **TSTM)
    embed = model.get_input_embeddings()
    for token in (config.vision_start_token_id, config.vision_end_token_id):
        row = embed.weight[token]
        assert int((hidden[0] == row).all(-1).sum()) == int((ids == token).sum()) > 0
    text = int((ids != config.video_token_id).sum())  # timestamps, markers and the rest of the prompt
    assert hidden.shape[1] == text + stats.llm_tokens_in and int(markers.sum()) > 0


def test_retention_is_the_mean_over_the_layers_of_an_official_depth(monkeypatch):
    """On a 28-layer model with the official K = 20, r = 0.3 and e = 1.25, the mean fraction of visual tokens over
    the layers is the retention: exactly with fixed_count (12 x 12 frames: B = 45 at 25 %), within the per-frame
    ceil of the clusters without."""
    from vtc.testing import tiny
    from vtc.testing.tiny import SIZES, TinySize

    monkeypatch.setitem(SIZES, "deep28", TinySize(layers=28))
    model, processor = tiny.build("qwen2_vl", size="deep28")
    inputs = vtc.prepare_inputs(processor, vtc.media.video.synthetic_video(16, 168, 168), "What?", num_frames=8)
    for fixed in (True, False):
        with vtc.patch(model, "flashvid", retention=0.25, fixed_count=fixed) as handle:
            with torch.no_grad():
                model(**inputs)
            stats = handle.stats()
        assert len(stats.layer_visual_tokens) == 28
        if fixed:
            assert stats.grids == [(4, 12, 12)] and stats.llm_tokens_in == 4 * 45
            assert stats.mean_layer_retention == pytest.approx(0.25)
        else:
            assert 0.25 <= stats.mean_layer_retention <= 0.25 * (1 + 4 / 180)


def test_retention_one_is_the_unpatched_model():
    model, _ = model_and_processor("llava_onevision")
    inputs = single_inputs("llava_onevision")
    with torch.no_grad():
        ref = model(**inputs).logits
    with vtc.patch(model, "flashvid", retention=1.0) as handle:
        with torch.no_grad():
            out = model(**inputs).logits
        assert handle.stats().visual_tokens_out == handle.stats().visual_tokens_in
    assert torch.equal(out, ref)


def test_fixed_count_on_the_patched_model():
    model, _ = model_and_processor("qwen2_5_vl")
    with vtc.patch(model, "flashvid", retention=0.25, fixed_count=True, **TSTM) as handle:
        with torch.no_grad():
            model(**single_inputs("qwen2_5_vl"))
        stats = handle.stats()
        t, h, w = stats.grids[0]
        budget = sum(frame_budget(h * w, 0.25, 1.25, 0.7))
        assert stats.llm_tokens_in == t * budget
        assert stats.visual_tokens_out == handle.retained_count(stats.grids[0]) == llm_kept_count(t * budget, 0.3)
