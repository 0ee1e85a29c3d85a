"""GRT's tensor functions against literal transcriptions of the official code (Hai-chao-Zhang/DenseVideoUnderstand at
251ba39a: `llava_ov_dense_video.py::GatedVisionEmbeddings.forward`, `_frame_type_key_mask`, `_scene_token_merge`,
`_get_motion_scores_for_scene_merge`, `_apply_scene_merge_packing`, `_vision_merge_hook`,
`_patch_packed_prune_pooling`; `llava_hf.py::GatedSiglipVisionEmbeddings`; `qwen2_5_vl.py::GatedQwenVisionPatchEmbed`
and `qwen2_5_vl_dual_route.py::RouteFloorGatedQwenVisionPatchEmbed`) on drifting random videos with scene cuts, in
several shapes and dtypes, plus known answers (a static video reuses every patch, a cut makes a key frame, identical
key frames match at divergence 0, packing keeps the top-k in index order, the cached reference bounds drift); then
the method on the tiny LLaVA models: stage 1 in the tower, stage 2 in the connect hook, the count, the refusals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vtc_plugins.grt import (
    GRT,
    HF_RELEASE,
    HF_ROUTE31,
    HIGHMOTION_HISTORICAL,
    QWEN,
    QWEN_FLOOR_OCR,
    RESEARCH_WRAPPER,
    gate_patches,
    gated_patch_embeddings,
    gather_sources,
    gather_tokens,
    jensen_shannon,
    keep_floor,
    key_frames,
    match_key_frames,
    official_divergence,
    pack_indices,
    pack_scores,
    packed_count,
    patch_dissimilarity,
    pool_packed,
    retention_keep,
    scene_pack,
    ssim_dissimilarity,
    tokens_per_frame,
    unfold_patches,
    upcast_logits,
)

# --- the official functions, transcribed as literally as possible -------------------------------------------------


def official_patch_ssim_dissimilarity(curr, prev):  # GatedVisionEmbeddings / GatedSiglipVisionEmbeddings (identical)
    x = curr.float()
    y = prev.float()
    mu_x = x.mean(dim=-1)
    mu_y = y.mean(dim=-1)
    xc = x - mu_x.unsqueeze(-1)
    yc = y - mu_y.unsqueeze(-1)
    var_x = (xc * xc).mean(dim=-1)
    var_y = (yc * yc).mean(dim=-1)
    cov_xy = (xc * yc).mean(dim=-1)
    dynamic_range = torch.maximum(
        x.amax(dim=-1) - x.amin(dim=-1),
        y.amax(dim=-1) - y.amin(dim=-1),
    ).clamp_min(1.0)
    c1 = (0.01 * dynamic_range) ** 2
    c2 = (0.03 * dynamic_range) ** 2
    numerator = (2 * mu_x * mu_y + c1) * (2 * cov_xy + c2)
    denominator = (mu_x.square() + mu_y.square() + c1) * (var_x + var_y + c2)
    ssim = numerator / denominator.clamp_min(1e-12)
    return (1.0 - ssim).clamp(min=0.0, max=2.0)


def official_research_forward(pixel_values, conv, diff_threshold, gate_policy, gate_metric):
    """GatedVisionEmbeddings.forward (motion / all), 4-D input, without the position embedding."""
    weight_flat = conv.weight.view(conv.weight.shape[0], -1)
    bias = conv.bias
    embed_dim = weight_flat.shape[0]
    BF, C, H, W = pixel_values.shape
    B, Fr = 1, BF
    x_bchw = pixel_values.contiguous()
    p = conv.kernel_size[0]
    Hf, Wf = H // p, W // p
    N = Hf * Wf
    P = C * p * p
    BF = B * Fr
    patches = torch.nn.functional.unfold(x_bchw, kernel_size=p, stride=p)
    patches = patches.transpose(1, 2).contiguous()
    if patches.dtype != weight_flat.dtype:
        patches = patches.to(weight_flat.dtype)
    patches = patches.view(B, Fr, N, P)
    keep = torch.zeros(B, Fr, N, dtype=torch.bool)
    score = torch.zeros(B, Fr, N, dtype=torch.float32)
    keep[:, 0, :] = True
    score[:, 0, :] = 1.0
    if Fr > 1:
        if gate_metric == "ssim":
            diffs = official_patch_ssim_dissimilarity(patches[:, 1:], patches[:, :-1])
        else:
            diffs = (patches[:, 1:] - patches[:, :-1]).norm(dim=-1)
        motion_keep = diffs > diff_threshold
        diffs_f = diffs.float()
        denom = diffs_f.amax(dim=-1, keepdim=True).clamp_min(1e-12)
        motion_score = diffs_f / denom
        if diff_threshold < 0:
            motion_keep.fill_(True)
            motion_score.fill_(1.0)
        if gate_policy == "all":
            keep[:, 1:, :].fill_(True)
            score[:, 1:, :].fill_(1.0)
        elif gate_policy == "motion":
            keep[:, 1:, :] = motion_keep
            score[:, 1:, :] = motion_score
    p0 = patches[:, 0].reshape(-1, N, P)
    e0 = torch.nn.functional.linear(p0.reshape(-1, P), weight_flat, bias).view(-1, N, embed_dim)
    emb_full = e0.new_empty(BF, N, embed_dim)
    emb_full[:B] = e0
    for t in range(1, Fr):
        prev = emb_full[(t - 1) * B : t * B].clone()
        kt = keep[:, t]
        if kt.any():
            pt = patches[:, t].reshape(-1, N, P)
            kt_flat = kt.reshape(-1)
            et_sel = torch.nn.functional.linear(pt.reshape(-1, P)[kt_flat], weight_flat, bias)
            prev.view(-1, embed_dim)[kt_flat] = et_sel
        emb_full[t * B : (t + 1) * B] = prev
    return keep.view(BF, N), score.view(BF, N), emb_full


def official_hf_forward(pixel_values, conv, frames, diff_threshold, gate_metric, projection_mode, refresh_interval):
    """GatedSiglipVisionEmbeddings.forward (gate_policy=motion), without the position embedding."""
    flat_batch, channels, height, width = pixel_values.shape
    batch = flat_batch // frames
    values = pixel_values.to(dtype=conv.weight.dtype)
    patches = torch.nn.functional.unfold(
        values.contiguous(), kernel_size=conv.kernel_size, dilation=conv.dilation, padding=0, stride=conv.stride
    ).transpose(1, 2)
    patches = patches.contiguous()
    patches_per_frame = patches.shape[1]
    patch_vector_dim = patches.shape[2]
    patches = patches.view(batch, frames, patches_per_frame, patch_vector_dim)
    keep = torch.zeros(batch, frames, patches_per_frame, dtype=torch.bool)
    score = torch.zeros(batch, frames, patches_per_frame, dtype=torch.float32)
    keep[:, 0, :] = True
    score[:, 0, :] = 1.0
    cached_source_patches = patches[:, 0].clone()
    forced_refresh_frame_indices = []
    for frame_index in range(1, frames):
        current_patches = patches[:, frame_index]
        if gate_metric == "ssim":
            diffs = official_patch_ssim_dissimilarity(current_patches, cached_source_patches)
        else:
            diffs = (current_patches - cached_source_patches).norm(dim=-1)
        frame_keep = diffs > diff_threshold
        if refresh_interval > 0 and frame_index % refresh_interval == 0:
            frame_keep = torch.ones_like(frame_keep)
            forced_refresh_frame_indices.append(frame_index)
        keep[:, frame_index] = frame_keep
        denominator = diffs.float().amax(dim=-1, keepdim=True).clamp_min(1e-12)
        score[:, frame_index] = diffs.float() / denominator
        cached_source_patches = torch.where(frame_keep.unsqueeze(-1), current_patches, cached_source_patches)
    embed_dim = conv.weight.shape[0]
    video_values = values.reshape(batch, frames, channels, height, width)
    first_embeddings = conv(video_values[:, 0]).flatten(2).transpose(1, 2)
    embeddings = first_embeddings.new_empty(batch, frames, patches_per_frame, embed_dim)
    embeddings[:, 0] = first_embeddings
    weight = conv.weight.flatten(1)
    bias = conv.bias
    for frame_index in range(1, frames):
        current = embeddings[:, frame_index - 1].clone()
        frame_keep = keep[:, frame_index]
        if projection_mode == "native_on_full" and frame_keep.all():
            current = conv(video_values[:, frame_index]).flatten(2).transpose(1, 2)
        elif frame_keep.any():
            selected_patches = patches[:, frame_index].reshape(-1, patch_vector_dim)[frame_keep.reshape(-1)]
            selected_embeddings = torch.nn.functional.linear(selected_patches, weight, bias)
            current.reshape(-1, embed_dim)[frame_keep.reshape(-1)] = selected_embeddings
        embeddings[:, frame_index] = current
    return keep, score, forced_refresh_frame_indices, embeddings


def official_qwen_forward(hidden_states, proj, rows, diff_threshold, floor=None):
    """GatedQwenVisionPatchEmbed.forward (motion), and with `floor` RouteFloorGatedQwenVisionPatchEmbed's phase 1
    decision (True: the native fallback). Returns (keep, scores, out, fell_back)."""
    in_channels, tp, p = proj.in_channels, proj.kernel_size[0], proj.kernel_size[1]
    embed_dim = proj.out_channels
    target_dtype = proj.weight.dtype
    patches_5d = hidden_states.view(-1, in_channels, tp, p, p)
    token_count = int(patches_5d.shape[0])
    patches_flat = patches_5d.to(dtype=target_dtype).reshape(token_count, -1)
    weight_flat = proj.weight.view(embed_dim, -1)
    bias = proj.bias
    outputs, keep_parts, score_parts = [], [], []
    offset = 0
    for grid_t, grid_h, grid_w in rows:
        spatial_tokens = grid_h * grid_w
        segment_tokens = grid_t * spatial_tokens
        segment = patches_flat[offset : offset + segment_tokens]
        offset += segment_tokens
        segment = segment.view(grid_t, spatial_tokens, -1)
        keep = torch.zeros((grid_t, spatial_tokens), dtype=torch.bool)
        scores = torch.zeros((grid_t, spatial_tokens), dtype=torch.float32)
        keep[0] = True
        scores[0] = 1.0
        if grid_t > 1:
            cached_source = segment[0].clone()
            for t_idx in range(1, grid_t):
                diffs = (segment[t_idx].float() - cached_source.float()).norm(dim=-1)
                selected = diffs > diff_threshold
                keep[t_idx] = selected
                scores[t_idx] = diffs / diffs.amax().clamp_min(1e-6)
                cached_source = torch.where(selected.unsqueeze(-1), segment[t_idx], cached_source)
        out_segment = torch.empty((grid_t, spatial_tokens, embed_dim), dtype=target_dtype)
        segment_start = offset - segment_tokens
        first_tubes = patches_5d[segment_start : segment_start + spatial_tokens]
        out_segment[0] = proj(first_tubes.to(dtype=target_dtype)).view(-1, embed_dim)
        for t_idx in range(1, grid_t):
            out_segment[t_idx] = out_segment[t_idx - 1]
            selected = keep[t_idx]
            if selected.all():
                tube_start = segment_start + t_idx * spatial_tokens
                tubes = patches_5d[tube_start : tube_start + spatial_tokens]
                out_segment[t_idx] = proj(tubes.to(dtype=target_dtype)).view(-1, embed_dim)
            elif int(selected.sum().item()):
                out_segment[t_idx, selected] = F.linear(segment[t_idx, selected], weight_flat, bias)
        outputs.append(out_segment.reshape(segment_tokens, embed_dim))
        keep_parts.append(keep.reshape(-1))
        score_parts.append(scores.reshape(-1))
    keep_all = torch.cat(keep_parts)
    fell_back = floor is not None and int(keep_all.sum().item()) / token_count < floor
    return keep_all, torch.cat(score_parts), torch.cat(outputs), fell_back


def official_frame_type_key_mask(fr, keep_flat, scene_cut_factor):  # without codec frame types
    key_frames = torch.zeros(fr, dtype=torch.bool)
    key_frames[0] = True
    if keep_flat is not None and torch.is_tensor(keep_flat) and keep_flat.dim() == 2 and keep_flat.shape[0] == fr:
        moved_counts = keep_flat.sum(dim=1)
        cuts = moved_counts > (scene_cut_factor * keep_flat.shape[1])
        key_frames[cuts] = True
    return key_frames


def official_scene_token_merge(feats, keep_flat, lm_head, jsd_threshold, scene_cut_factor):
    """_scene_token_merge: returns (kept frame idx, key mask, merge ratio, has semantic match, [dists])."""
    _, Fr, D = feats.shape
    key_frames = official_frame_type_key_mask(Fr, keep_flat, scene_cut_factor)
    kf_idxs = key_frames.nonzero(as_tuple=False).squeeze(1)
    if kf_idxs.numel() < 2:
        return (kf_idxs if kf_idxs.numel() > 0 else torch.arange(Fr)), key_frames, 1.0, False, []

    def jsd(p, q):
        m = 0.5 * (p + q)
        return 0.5 * (F.kl_div(p.log(), m, reduction="sum") + F.kl_div(q.log(), m, reduction="sum"))

    merged_feats = feats.clone()
    cols_to_remove = []
    dists = []
    for i in range(len(kf_idxs) - 1):
        a, b = kf_idxs[i].item(), kf_idxs[i + 1].item()
        pi, pj = merged_feats[0, a], merged_feats[0, b]
        dist = jsd(F.softmax(lm_head(pi), dim=-1), F.softmax(lm_head(pj), dim=-1))
        dists.append((b, dist))
        if dist >= jsd_threshold:
            continue
        merged_feats[0, a] = 0.5 * (pi + pj)
        cols_to_remove.append(b)
    keep = [i for i in range(merged_feats.size(1)) if i not in cols_to_remove]
    idx = torch.tensor(keep, dtype=torch.long)
    merged_feats_left = merged_feats.index_select(dim=1, index=idx)
    merge_ratio = (merged_feats_left.shape[0] * merged_feats_left.shape[1]) / (
        merged_feats.shape[0] * merged_feats.shape[1]
    )
    return idx, key_frames, float(merge_ratio), bool(cols_to_remove), dists


def official_motion_scores_for_scene_merge(out_feats, diff_score_flat):
    scores = diff_score_flat.float()
    denom = scores.amax(dim=1, keepdim=True).clamp_min(1e-12)
    return scores / denom


def official_apply_scene_merge_packing(
    out_feats, key_mask, kept_frame_idx, diff_score_flat, keep_ratio, min_tokens, require_match, has_match, last_ratio
):
    """_apply_scene_merge_packing (scene merge on): returns (features, idx or None)."""
    bf, n, d = out_feats.shape
    ratio = keep_ratio
    if ratio is None:
        ratio = last_ratio if last_ratio is not None else 1.0
    ratio = min(max(float(ratio), 0.0), 1.0)
    if require_match and not has_match:
        return out_feats, None
    k = max(int(min_tokens), int(math.ceil(n * ratio)))
    k = min(max(k, 1), n)
    if k >= n:
        return out_feats, None
    kept_mask = torch.zeros(bf, dtype=torch.bool)
    if kept_frame_idx is not None and torch.is_tensor(kept_frame_idx) and kept_frame_idx.numel() > 0:
        kept_mask[kept_frame_idx.long().clamp(min=0, max=bf - 1)] = True
    else:
        kept_mask = key_mask.clone()
    motion_scores = official_motion_scores_for_scene_merge(out_feats, diff_score_flat)
    semantic_scores = out_feats.float().norm(dim=-1)
    semantic_scores = semantic_scores / semantic_scores.amax(dim=1, keepdim=True).clamp_min(1e-12)
    scores = motion_scores.clone()
    full_key_rows = key_mask & kept_mask
    if full_key_rows.any():
        scores[full_key_rows] = semantic_scores[full_key_rows] + 1.0
    idx = torch.topk(scores, k=k, dim=1, largest=True, sorted=False).indices
    idx, _ = torch.sort(idx, dim=1)
    gather_idx = idx.unsqueeze(-1).expand(-1, -1, d)
    return out_feats.gather(dim=1, index=gather_idx), idx


def official_vision_merge_hook(out_feats, keep_flat, diff_score_flat, lm_head, cfg):
    """_vision_merge_hook with use_vision_merge=True, pruning off: (features, idx, key mask, kept frame idx)."""
    frame_feats = out_feats.mean(dim=1).unsqueeze(0)
    kept_frame_idx, key_mask, ratio, has_match, _ = official_scene_token_merge(
        frame_feats, keep_flat, lm_head, cfg["jsd_threshold"], cfg["scene_cut_factor"]
    )
    feats, idx = official_apply_scene_merge_packing(
        out_feats,
        key_mask,
        kept_frame_idx,
        diff_score_flat,
        cfg["keep_ratio"],
        cfg["min_tokens"],
        cfg["require_semantic_match"],
        has_match,
        ratio,
    )
    return feats, idx, key_mask, kept_frame_idx


def official_packed_aware_get_2d_pool(image_feature, stride, pool_mode):
    num_frames, num_tokens, _ = image_feature.shape
    pool_stride = max(int(stride), 1)
    if pool_stride <= 1 or num_tokens <= 1:
        return image_feature
    target_tokens = max(int(math.ceil(num_tokens / float(pool_stride * pool_stride))), 1)
    seq = image_feature.transpose(1, 2).contiguous()
    if pool_mode == "average":
        seq = F.avg_pool1d(seq, kernel_size=pool_stride * pool_stride, stride=pool_stride * pool_stride, ceil_mode=True)
    elif pool_mode == "max":
        seq = F.max_pool1d(seq, kernel_size=pool_stride * pool_stride, stride=pool_stride * pool_stride, ceil_mode=True)
    elif pool_mode == "bilinear":
        seq = F.interpolate(seq, size=target_tokens, mode="linear", align_corners=False)
    if seq.shape[-1] != target_tokens:
        seq = F.interpolate(seq, size=target_tokens, mode="linear", align_corners=False)
    return seq.transpose(1, 2).contiguous()


# --- inputs ---------------------------------------------------------------------------------------------------------


def drifting_video(frames, size, patch, seed, cuts=(), channels=3):
    """[T, C, H, W] in [-1, 1]-ish: a random image whose patches take random-walk steps of very different sizes
    (some still, some slow, some fast) and fresh random frames at `cuts`."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(1, channels, size, size, generator=g) * 2 - 1
    grid = size // patch
    amplitude = torch.rand(frames, 1, grid, grid, generator=g) ** 3 * 0.2
    amplitude = amplitude.repeat_interleave(patch, dim=2).repeat_interleave(patch, dim=3)
    steps = torch.randn(frames, channels, size, size, generator=g) * amplitude
    steps[0] = 0
    video = base + steps.cumsum(0)
    for cut in cuts:
        video[cut:] += torch.rand(1, channels, size, size, generator=g) * 2 - 1 - video[cut]
    return video


def middle_threshold(values, quantile=0.5):
    """A threshold strictly between two distinct values of `values` near the quantile."""
    flat = values.double().flatten().unique()
    i = min(max(int(quantile * flat.numel()), 1), flat.numel() - 1)
    return float((flat[i - 1] + flat[i]) / 2)


def close(dtype):
    return {"rtol": 1e-5, "atol": 1e-5} if dtype in (torch.float32, torch.float64) else {"rtol": 2e-2, "atol": 2e-2}


# --- reference tests ------------------------------------------------------------------------------------------------


def test_unfold_patches_is_the_conv_im2col():
    """2 cases: unfold_patches @ weight.flatten(1).T + bias equals the Conv2d (the official patch vector order)."""
    for size, patch in ((12, 4), (15, 5)):
        frames = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(size))
        conv = torch.nn.Conv2d(3, 7, patch, patch)
        expected = conv(frames).flatten(2).transpose(1, 2)
        got = F.linear(unfold_patches(frames, patch), conv.weight.flatten(1), conv.bias)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_ssim_matches_official_exactly(dtype):
    """4 dtypes x 3 shapes = 12 cases, each with random, identical, constant and scaled patch pairs: equal bits."""
    g = torch.Generator().manual_seed(7)
    for shape in ((5, 48), (2, 3, 75), (1, 588)):
        x = torch.randn(shape, generator=g).to(dtype)
        y = (x.float() + 0.3 * torch.randn(shape, generator=g)).to(dtype)
        pairs = [(x, y), (x, x), (torch.full_like(x, 0.25), torch.full_like(x, 0.25)), (x, (x.float() * 3).to(dtype))]
        for a, b in pairs:
            assert torch.equal(ssim_dissimilarity(a, b), official_patch_ssim_dissimilarity(a, b))
    same = ssim_dissimilarity(x, x)
    assert torch.equal(same, torch.zeros_like(same))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_research_gate_matches_official(dtype):
    """2 dtypes x 3 videos x 2 metrics x 4 gates (motion at two thresholds, all, threshold < 0) = 48 cases: keep and
    scores equal bit for bit, embeddings (kept patches projected, others copied) to float tolerance."""
    cases, mixed = 0, 0
    for seed, (frames, size, cuts) in enumerate(((2, 12, ()), (5, 16, (3,)), (7, 20, (2, 5)))):
        video = drifting_video(frames, size, 4, seed, cuts).to(dtype)
        conv = torch.nn.Conv2d(3, 6, 4, 4).to(dtype)
        patches = unfold_patches(video, 4)
        for metric in ("l2", "ssim"):
            step = patch_dissimilarity(patches[1:], patches[:-1], metric)
            settings = [("motion", middle_threshold(step, 0.3)), ("motion", middle_threshold(step, 0.7))]
            settings += [("all", 0.1), ("motion", -1.0)]
            for policy, threshold in settings:
                keep, score, emb = official_research_forward(video, conv, threshold, policy, metric)
                gate = gate_patches(patches, threshold, metric, "previous", policy=policy)
                assert torch.equal(gate.keep, keep)
                assert torch.equal(gate.score, score)
                assert torch.equal(gate.reference[1:], torch.arange(frames - 1)[:, None].expand(-1, keep.shape[1]))
                with torch.no_grad():
                    got = gated_patch_embeddings(patches, gate, conv.weight.flatten(1), conv.bias)
                torch.testing.assert_close(got, emb, **close(dtype))
                cases += 1
                mixed += bool(0 < gate.keep[1:].float().mean() < 1)
    assert cases == 24
    assert mixed >= 10  # the positive thresholds make a mix of re-projected and reused patches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_release_gate_matches_official(dtype):
    """2 dtypes x 3 videos x 2 metrics x 2 refresh intervals x 2 projection modes = 48 cases: keep, scores and
    forced frames equal bit for bit, the sources reproduce the official cached-embedding reuse (to tolerance); the
    cached reference decides differently from the previous-frame one on some of these videos."""
    cases, differs = 0, 0
    for seed, (frames, size, cuts) in enumerate(((3, 12, ()), (6, 16, (4,)), (9, 12, (3, 7)))):
        video = drifting_video(frames, size, 4, 10 + seed, cuts).to(dtype)
        conv = torch.nn.Conv2d(3, 5, 4, 4).to(dtype)
        patches = unfold_patches(video, 4)
        for metric in ("ssim", "l2"):
            threshold = middle_threshold(patch_dissimilarity(patches[1:], patches[:-1], metric), 0.6)
            for refresh in (0, 3):
                for mode in ("native_on_full", "linear_consistent"):
                    with torch.no_grad():
                        keep, score, forced, emb = official_hf_forward(
                            video, conv, frames, threshold, metric, mode, refresh
                        )
                        gate = gate_patches(patches, threshold, metric, "cached", refresh_interval=refresh)
                        got = gated_patch_embeddings(patches, gate, conv.weight.flatten(1), conv.bias)
                    assert torch.equal(gate.keep, keep[0])
                    assert torch.equal(gate.score, score[0])
                    assert gate.refreshed.nonzero().flatten().tolist() == forced
                    torch.testing.assert_close(got, emb[0], **close(dtype))
                    # the reference of frame t is the source of frame t - 1
                    assert torch.equal(gate.reference[1:], gate.source[:-1])
                    cases += 1
                    differs += not torch.equal(gate.keep, gate_patches(patches, threshold, metric, "previous").keep)
    assert cases == 24 and differs > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen_gate_matches_official(dtype):
    """2 dtypes x 2 requests (1 and 3 videos) x 2 thresholds x 2 floors = 16 cases: per-video `gate_patches` on the
    processor's tubes (L2 in float32, score clamp 1e-6) equals GatedQwenVisionPatchEmbed bit for bit (keep, scores),
    its outputs to tolerance, and `keep_floor` decides as RouteFloorGatedQwenVisionPatchEmbed (the floor 0.6 falls
    back at the higher threshold only)."""
    g = torch.Generator().manual_seed(3)
    proj = torch.nn.Conv3d(3, 8, (2, 2, 2), (2, 2, 2), bias=False).to(dtype)
    fallbacks = set()
    for rows in ([(4, 2, 6)], [(3, 4, 4), (1, 2, 2), (5, 2, 4)]):
        segments = []
        for t, h, w in rows:
            start = torch.randn(1, h * w, 24, generator=g)
            amplitude = torch.rand(t, h * w, 1, generator=g) ** 3
            walk = start + (torch.randn(t, h * w, 24, generator=g) * amplitude).cumsum(0)
            segments.append(walk.reshape(t * h * w, 24))
        hidden = torch.cat(segments).to(dtype)
        steps = [s.view(t, h * w, -1) for s, (t, h, w) in zip(segments, rows) if t > 1]
        all_diffs = torch.cat([(s[1:] - s[:-1]).norm(dim=-1).flatten() for s in steps])
        for quantile in (0.3, 0.7):
            threshold = middle_threshold(all_diffs, quantile)
            for floor in (None, 0.6):
                with torch.no_grad():
                    keep, scores, out, fell_back = official_qwen_forward(hidden, proj, rows, threshold, floor)
                offset, gates = 0, []
                for t, h, w in rows:
                    tubes = hidden[offset : offset + t * h * w].view(t, h * w, -1)
                    offset += t * h * w
                    gates.append(gate_patches(tubes, threshold, **_qwen_args()))
                assert torch.equal(torch.cat([gate.keep.flatten() for gate in gates]), keep)
                assert torch.equal(torch.cat([gate.score.flatten() for gate in gates]), scores)
                weight = proj.weight.view(proj.out_channels, -1)
                with torch.no_grad():
                    got = torch.cat(
                        [
                            gated_patch_embeddings(tubes_of(hidden, rows, i), gate, weight).flatten(0, 1)
                            for i, gate in enumerate(gates)
                        ]
                    )
                torch.testing.assert_close(got, out, **close(dtype))
                if len(rows) == 1:  # the floor is decided over the request: one video here
                    floored = keep_floor(gates[0], floor)
                    assert bool(floored.keep.all()) == (fell_back or bool(gates[0].keep.all()))
                fallbacks.add(fell_back)
    assert fallbacks == {False, True}


def _qwen_args():
    return dict(metric=QWEN.gate_metric, reference=QWEN.gate_reference, upcast=QWEN.upcast, score_eps=QWEN.score_eps)


def tubes_of(hidden, rows, index):
    offset = sum(t * h * w for t, h, w in rows[:index])
    t, h, w = rows[index]
    return hidden[offset : offset + t * h * w].view(t, h * w, -1)


def test_key_frames_match_official():
    """4 shapes x 3 factors = 12 cases of random keep masks (densities 0.2-0.95)."""
    g = torch.Generator().manual_seed(5)
    for frames, count in ((1, 9), (4, 16), (8, 49), (12, 729)):
        density = torch.rand(frames, 1, generator=g) * 0.75 + 0.2
        keep = torch.rand(frames, count, generator=g) < density
        keep[0] = True
        for factor in (0.0, 0.5, 0.8):
            assert torch.equal(key_frames(keep, factor), official_frame_type_key_mask(frames, keep, factor))


@pytest.mark.parametrize(("dtype", "scale"), [(torch.float32, 1.0), (torch.float16, 1.0), (torch.float16, 8.0)])
def test_match_key_frames_matches_official(dtype, scale):
    """3 settings x 4 videos x 3 thresholds = 36 cases, videos with exact and near repeats of the previous frame and
    distinct frames; fp16 with a large head (scale 8) underflows the softmax (the official NaN / inf divergences):
    the same frames lose key status, the same divergences (NaN in the same places), the same "has a match"."""
    g = torch.Generator().manual_seed(11)
    vocab, dim = 300, 12
    head = torch.nn.Linear(dim, vocab, bias=False)
    with torch.no_grad():
        head.weight.mul_(scale)
    head = head.to(dtype)
    outcomes = set()
    for frames, count in ((2, 9), (5, 16), (7, 25), (9, 4)):
        features = torch.randn(frames, 1, dim, generator=g) + 0.5 * torch.randn(frames, count, dim, generator=g)
        for t in range(1, frames, 2):  # exact (t % 4 == 1) and near repeats of the previous frame
            features[t] = features[t - 1] + (0.0 if t % 4 == 1 else 0.05) * torch.randn(count, dim, generator=g)
        features = features.to(dtype)
        keep = torch.rand(frames, count, generator=g) < 0.9
        keep[0] = True
        for threshold in (0.02, 0.1, 0.4):
            with torch.no_grad():
                idx, key, ratio, matched, dists = official_scene_token_merge(
                    features.mean(dim=1).unsqueeze(0), keep, head, threshold, 0.8
                )
                match = match_key_frames(features, key_frames(keep, 0.8), head, threshold)
            kept = torch.zeros(frames, dtype=torch.bool)
            kept[idx] = True
            assert torch.equal(match.kept_key, key & kept)
            assert match.matched == matched
            assert match.compared.nonzero().flatten().tolist() == [b for b, _ in dists]
            if dists:
                expected = torch.stack([d.float() for _, d in dists])
                got = match.divergence[match.compared]
                torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3, equal_nan=True)
                outcomes |= {"nan" if d.isnan() else ("match" if d < threshold else "keep") for d in expected}
    assert "nan" in outcomes if scale > 1 else outcomes == {"match", "keep"}


def test_packing_and_hook_match_official():
    """3 videos x 3 JSD thresholds x 4 packing settings (ratio 0.5 / 0.25 / None, min 16, semantic match required)
    = 36 cases: `scene_pack` (key frames, matching, k, scores, top-k in index order) equals the research wrapper's
    `_vision_merge_hook` on projected features, gate masks and motion scores: same indices, same packed features
    (matched and unmatched key frames, packed and unpacked videos)."""
    g = torch.Generator().manual_seed(17)
    head = torch.nn.Linear(10, 64, bias=False)
    cases, outcomes = 0, set()
    for frames, count in ((3, 49), (6, 81), (8, 100)):
        video = drifting_video(frames, int(count**0.5) * 2, 2, frames, cuts=(frames // 2,))
        gate = gate_patches(unfold_patches(video, 2), 0.3)
        features = 1.5 * torch.randn(frames, 1, 10, generator=g) + torch.randn(frames, count, 10, generator=g)
        features[1] = features[0]
        for jsd_threshold in (1e-7, 0.2, 10.0):
            for ratio, minimum, require in ((0.5, 16, False), (0.25, 16, False), (None, 4, False), (0.5, 16, True)):
                cfg = dict(jsd_threshold=jsd_threshold, scene_cut_factor=0.8, keep_ratio=ratio, min_tokens=minimum)
                cfg["require_semantic_match"] = require
                with torch.no_grad():
                    feats, idx, key, _ = official_vision_merge_hook(features, gate.keep, gate.score, head, cfg)
                    packed = scene_pack(features, gate.keep, gate.score, head, **cfg)
                assert torch.equal(packed.key, key)
                assert (packed.indices is None) == (idx is None)
                if idx is not None:
                    assert torch.equal(packed.indices, idx)
                assert torch.equal(packed.features, feats)
                cases += 1
                outcomes.add((packed.indices is None, bool((packed.key & ~packed.kept_key).any())))
    assert cases == 36
    assert outcomes == {(False, True), (True, False), (False, False)}


@pytest.mark.parametrize("mode", ["bilinear", "average", "max"])
def test_pool_packed_matches_official(mode):
    """3 modes x 6 lengths x 3 strides = 54 cases: the packed 1-D pooling equals `packed_aware_get_2d_pool`."""
    g = torch.Generator().manual_seed(2)
    for tokens in (1, 2, 5, 16, 93, 365):
        x = torch.randn(3, tokens, 4, generator=g)
        for stride in (1, 2, 3):
            expected = official_packed_aware_get_2d_pool(x, stride, mode)
            got = pool_packed(x, stride, mode)
            assert torch.equal(got, expected)
            assert got.shape[1] == (tokens if stride == 1 or tokens == 1 else math.ceil(tokens / stride**2))


# --- known answers --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reference", ["previous", "cached"])
@pytest.mark.parametrize("metric", ["l2", "ssim"])
def test_static_video_reuses_every_patch(metric, reference):
    """4 cases (2 metrics x 2 references), threshold 0: a video of one repeated frame projects frame 0 only, every
    patch's source is frame 0, dissimilarities are 0 and so are the motion scores of later frames."""
    frame = drifting_video(1, 16, 4, 0)
    patches = unfold_patches(frame.expand(5, -1, -1, -1), 4)
    gate = gate_patches(patches, 0.0, metric, reference)
    assert gate.keep[0].all() and not gate.keep[1:].any()
    assert not gate.source.any() and not gate.diff.any() and not gate.score[1:].any()
    assert torch.equal(key_frames(gate.keep), torch.tensor([True, False, False, False, False]))


def test_scene_cut_makes_a_key_frame():
    """1 case: frames 0-2 static, frame 3 a new scene, frames 4-5 static: SSIM and L2 gates re-project all of
    frame 3 only, so the key frames are 0 and 3 (the research wrapper's defaults, `HF_ROUTE31`'s threshold)."""
    first, second = drifting_video(1, 16, 4, 1), drifting_video(1, 16, 4, 2)
    video = torch.cat([first.expand(3, -1, -1, -1), second.expand(3, -1, -1, -1)])
    patches = unfold_patches(video, 4)
    for gate in (
        gate_patches(patches, RESEARCH_WRAPPER.gate_threshold, RESEARCH_WRAPPER.gate_metric),
        gate_patches(patches, HF_ROUTE31.gate_threshold, HF_ROUTE31.gate_metric, HF_ROUTE31.gate_reference),
    ):
        assert gate.keep.sum(dim=1).tolist() == [16, 0, 0, 16, 0, 0]
        assert gate.source[:, 0].tolist() == [0, 0, 0, 3, 3, 3]
        assert key_frames(gate.keep, RESEARCH_WRAPPER.scene_cut_factor).nonzero().flatten().tolist() == [0, 3]


def test_identical_key_frames_match_at_zero_divergence():
    """2 cases: key frames 0 and 3 with identical features have divergence 0 (official and true JSD) and match, so
    frame 3 loses key status; a different frame 3 stays key (divergence above the threshold)."""
    head = torch.nn.Linear(8, 40)
    features = torch.randn(4, 9, 8, generator=torch.Generator().manual_seed(4))
    key = torch.tensor([True, False, False, True])
    same = features.clone()
    same[3] = same[0]
    with torch.no_grad():
        for kind in ("official", "jsd"):
            match = match_key_frames(same, key, head, 0.4, kind)
            assert match.divergence[3] == 0 and match.matched
            assert match.kept_key.tolist() == [True, False, False, False]
        other = features.clone()
        other[3] = -10 * other[0]
        match = match_key_frames(other, key, head, 1e-3)
    assert match.divergence[3] > 1e-3 and not match.matched
    assert match.kept_key.tolist() == [True, False, False, True]


def test_official_divergence_is_not_jsd_and_nans_on_shared_zeros():
    """3 cases: the official quantity is 0.5 (KL(m||p) + KL(m||q)) (disjoint two-point distributions: +inf, where
    JSD = ln 2); a zero shared by p and q gives NaN, which the official `dist >= threshold` treats as a match."""
    p, q = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    assert official_divergence(p, q) == math.inf
    assert math.isclose(jensen_shannon(p, q).item(), math.log(2), rel_tol=1e-6)
    p, q = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.25, 0.75, 0.0])
    assert official_divergence(p, q).isnan()
    head = lambda x: torch.cat([x, torch.full_like(x[..., :1], -1e4)], dim=-1)  # noqa: E731 (one entry underflows)
    features = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(8))
    match = match_key_frames(features, torch.tensor([True, True]), head, threshold=1e-9)
    assert match.divergence[1].isnan() and match.matched and match.kept_key.tolist() == [True, False]


def test_packing_keeps_top_k_in_index_order():
    """2 cases: hand-made scores: each frame keeps its k best indices sorted ascending, key-frame tokens rank by
    norm (+1), ties go to the lower index; k follows max(min_tokens, ceil(N * ratio))."""
    scores = torch.tensor([[0.1, 0.9, 0.3, 0.8, 0.2], [0.5, 0.5, 0.0, 0.5, 1.0]])
    assert pack_indices(scores, 3).tolist() == [[1, 2, 3], [0, 1, 4]]
    motion = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 2.0, 1.0, 4.0]])
    features = torch.tensor([[[1.0], [4.0], [2.0], [3.0]], [[9.0], [9.0], [9.0], [9.0]]])
    mixed = pack_scores(motion, features, torch.tensor([True, False]))
    assert torch.equal(mixed, torch.tensor([[1.25, 2.0, 1.5, 1.75], [0.0, 0.5, 0.25, 1.0]]))
    indices = pack_indices(mixed, 2)
    assert indices.tolist() == [[1, 3], [1, 3]]
    assert torch.equal(gather_tokens(features, indices)[0, :, 0], torch.tensor([4.0, 3.0]))
    assert [packed_count(729, r, 16) for r in (0.5, 0.0, 0.01, 1.0, 2.0)] == [365, 16, 16, 729, 729]
    assert packed_count(8, 0.5, 16) == 8


def test_cached_reference_bounds_drift_and_refresh():
    """3 cases: a patch brightening by 0.6 x threshold (L2) per frame is never re-projected against the previous
    frame (the embedding drifts without bound), re-projected every second frame against the cached source; a
    refresh interval of 2 re-projects frames 2 and 4 whole."""
    step = torch.zeros(1, 8)
    step[0, :] = 0.6 / 8**0.5  # L2 of one step: 0.6
    patches = (torch.arange(5.0)[:, None, None] * step).expand(5, 1, 8).clone()
    previous = gate_patches(patches, 1.0, "l2", "previous")
    cached = gate_patches(patches, 1.0, "l2", "cached")
    assert previous.keep[:, 0].tolist() == [True, False, False, False, False]
    assert cached.keep[:, 0].tolist() == [True, False, True, False, True]
    assert cached.source[:, 0].tolist() == [0, 0, 2, 2, 4]
    assert cached.reference[:, 0].tolist() == [0, 0, 0, 2, 2]
    refreshed = gate_patches(patches, 1.0, "l2", "previous", refresh_interval=2)
    assert refreshed.refreshed.tolist() == [False, False, True, False, True]
    assert refreshed.keep[:, 0].tolist() == [True, False, True, False, True]


def test_pixel_substitution_equals_embedding_reuse():
    """1 case: projecting every patch after `gather_sources` on the raw patches equals the official projection of
    the kept patches plus copies (the projection is linear), which lets a caller substitute pixels before the tower."""
    video = drifting_video(6, 16, 4, 9, cuts=(4,))
    patches = unfold_patches(video, 4)
    gate = gate_patches(patches, HF_RELEASE.gate_threshold, HF_RELEASE.gate_metric, HF_RELEASE.gate_reference)
    weight, bias = torch.randn(5, patches.shape[-1]), torch.randn(5)
    substituted = F.linear(gather_sources(patches, gate.source), weight, bias)
    torch.testing.assert_close(substituted, gated_patch_embeddings(patches, gate, weight, bias))
    assert 0 < gate.keep[1:].float().mean() < 1


def test_tokens_per_frame_and_defaults():
    """5 cases: LLaVA-OV's 27 x 27 grid gives 92 tokens a frame packed at the defaults, 196 unpacked (keep ratio 1
    or no packing), 169 for average pooling unpacked; the published profiles' values."""
    assert tokens_per_frame(27, 27, RESEARCH_WRAPPER.keep_ratio, RESEARCH_WRAPPER.min_tokens) == 92
    assert tokens_per_frame(27, 27, 1.0) == tokens_per_frame(27, 27, None) == 196
    assert tokens_per_frame(27, 27, None, mode="average") == 169
    assert tokens_per_frame(27, 27, 0.01, 16) == 4
    assert (HF_ROUTE31.gate_metric, HF_ROUTE31.gate_threshold, HF_ROUTE31.frames) == ("ssim", 0.001, 8)
    assert (HIGHMOTION_HISTORICAL.jsd_threshold, HIGHMOTION_HISTORICAL.require_semantic_match) == (0.02, True)
    assert (QWEN_FLOOR_OCR.gate_threshold, QWEN_FLOOR_OCR.min_keep_ratio) == (30.0, 0.55)


# --- the method on the tiny LLaVA models (vtc.hf.tower, the connect hook) ------------------------------------------

LLAVA = ["llava_onevision", "llava_next_video"]


def _static_inputs(family):
    """The tiny model of `family` and its processor's inputs for `static_clip` (a still slide with a moving square:
    most patches repeat the previous frame exactly, a few change a little, the square's change a lot)."""
    from vtc.api import prepare_inputs
    from vtc.media.video import static_clip
    from vtc.testing.fixtures import QUESTIONS, model_and_processor

    model, processor = model_and_processor(family)
    return model, prepare_inputs(processor, static_clip(8), QUESTIONS[0], num_frames=8)


@pytest.mark.parametrize(
    ("family", "params"),
    [(f, p) for f in LLAVA for p in ({}, dict(gate_metric="ssim", gate_threshold=0.01, gate_reference="cached"))],
    ids=lambda x: x if isinstance(x, str) else ("hf-release" if x else "research"),
)
def test_stage_one_in_the_tower_equals_the_official_gated_embeddings(family, params):
    """4 cases (SigLIP, and CLIP with its class token and pre-layernorm; the research wrapper's gate and the HF
    release's): the tower's first block on vtc's gated embeddings equals it on the official ones
    (`gated_patch_embeddings` with the tiny tower's own patch weights, plus the position embeddings); the gate's
    keep mask and motion scores are stage 1's record; most patches are reused, some with a nonzero dissimilarity
    (so the substitution changes values)."""
    from vtc.core.pipeline import Pipeline
    from vtc.core.tokens import Context
    from vtc.hf.adapters import resolve_adapter
    from vtc.hf.tower import LlavaTower

    model, inputs = _static_inputs(family)
    tower = LlavaTower(resolve_adapter(model))
    pixels = inputs["pixel_values_videos"][0]
    frames = pixels.shape[0]
    embeddings = tower.model.embeddings
    conv = embeddings.patch_embedding
    method = GRT(**params)
    patches = unfold_patches(pixels.to(conv.weight.dtype), conv.kernel_size[0])
    gate = gate_patches(patches, method.gate_threshold, method.gate_metric, method.gate_reference)
    cls = int(tower.class_token)
    with torch.no_grad():
        position = embeddings.position_embedding.weight
        official = gated_patch_embeddings(patches, gate, conv.weight.flatten(1), conv.bias) + position[cls:]
        if cls:  # CLIP: the class embedding leads every frame
            lead = (embeddings.class_embedding + position[0]).expand(frames, 1, -1)
            official = torch.cat([lead, official], dim=1)
        if hasattr(tower.model, "pre_layrnorm"):
            official = tower.model.pre_layrnorm(official)
        want = tower.layers[0](official, None)
        pipeline = Pipeline(method, retention=0.25, family=family)
        ctx = Context(family=family, video_index=0, state=pipeline._stores["grt"])
        features, _, _ = tower.run(pixels, [frames], 0, pipeline, [ctx])
    torch.testing.assert_close(features[0], want, rtol=1e-5, atol=1e-5)
    record = pipeline._stores["grt"][0]
    assert torch.equal(record["keep"], gate.keep) and torch.equal(record["score"], gate.score)
    assert record["recomputed"].tolist() == gate.keep.sum(dim=1).tolist()
    assert (~gate.keep[1:]).float().mean() > 0.9 and gate.keep[1:].any()
    assert ((gate.diff > 0) & ~gate.keep)[1:].any()


@pytest.mark.parametrize("family", LLAVA)
def test_stage_two_in_the_connect_hook_equals_scene_pack_and_pool_packed(family, monkeypatch):
    """2 cases, the official keep ratio 0.5: what the connect hook hands the LLM equals `scene_pack` (on the captured
    pre-pool features, projected on LLaVA-NeXT-Video, with stage 1's record) then `pool_packed` with the model's
    pooling mode (LLaVA-NeXT-Video: then its projector), ceil(365 / 4) = 92 (OneVision) or ceil(288 / 4) = 72 tokens
    a frame, in frame order; the LLM's input holds exactly these rows, contiguously."""
    from vtc.hf.adapters import resolve_adapter
    from vtc.testing.fixtures import model_and_processor, single_inputs

    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    seen, llm = [], []
    connect = GRT.connect

    def spy(self, tokens, ctx):
        out = connect(self, tokens, ctx)
        seen.append((ctx.prepool, ctx.project, ctx.geometry.pooling, dict(ctx.state[ctx.video_index]), out))
        return out

    monkeypatch.setattr(GRT, "connect", spy)
    text_model = resolve_adapter(model).text_model
    with torch.no_grad(), vtc_patch(model, "grt", keep_ratio=0.5) as handle:
        # registered after vtc's own hooks: it sees what the language model really gets
        hook = text_model.register_forward_pre_hook(
            lambda m, a, kw: llm.append(kw["inputs_embeds"][0]), with_kwargs=True
        )
        try:
            model(**inputs)
        finally:
            hook.remove()
        stats = handle.stats()
    [(prepool, project, mode, record, out)], [embeds] = seen, llm
    frames, rows, cols, _ = prepool.shape
    features = prepool.reshape(frames, rows * cols, -1)
    head = model.get_output_embeddings()
    with torch.no_grad():
        packed = scene_pack(project(features), record["keep"], record["score"], head, keep_ratio=0.5, min_tokens=16)
        want = project(pool_packed(gather_tokens(features, packed.indices), 2, mode))
    per_frame = math.ceil(packed_count(rows * cols, 0.5, 16) / 4)
    assert want.shape[:2] == (frames, per_frame) == (8, {"llava_onevision": 92, "llava_next_video": 72}[family])
    assert torch.equal(out.embeds, want.flatten(0, 1))
    assert out.frame.tolist() == [f for f in range(frames) for _ in range(per_frame)]
    assert stats.llm_tokens_in == frames * per_frame == handle.retained_count(stats.grids[0])
    start = int(torch.nonzero((embeds == out.embeds[0]).all(dim=-1)).flatten()[0])
    assert torch.equal(embeds[start : start + len(out)], out.embeds)


def vtc_patch(model, spec, **params):
    import vtc

    return vtc.patch(model, spec, **params)


def test_the_llm_sees_the_retained_count_and_retention_one_is_the_model():
    """The count is T * ceil(k / 4) from the grid alone (Pipeline.retained_count, before any model): the retention
    mapping on both families (r of 196 / 144 a frame, 182 or 196 at the top of OneVision's range, the floor of 4
    with a warning), keep_ratio overriding it; on the tiny OneVision model the LLM sees exactly that, and retention
    1.0 gives the unpatched model's logits (both stages off)."""
    from vtc.core.pipeline import Pipeline
    from vtc.testing.fixtures import model_and_processor, single_inputs

    def count(family, grid, retention, **params):
        return Pipeline("grt", retention, params, family=family).retained_count(grid)

    ov, nv = (8, 14, 14), (8, 12, 12)
    assert [count("llava_onevision", ov, r) for r in (0.25, 0.5, 0.93, 0.95, 0.97, 1.0)] == [
        8 * n for n in (49, 98, 182, 182, 196, 196)
    ]
    assert [count("llava_next_video", nv, r) for r in (0.25, 0.5, 0.99, 1.0)] == [8 * n for n in (36, 72, 143, 144)]
    assert count("llava_onevision", ov, None) == count("llava_onevision", ov, 0.1, keep_ratio=0.5) == 8 * 92
    assert count("llava_onevision", ov, 1.0, keep_ratio=1.0) == 8 * 196
    assert count("llava_onevision", (8, 10, 10), 0.25) is None  # not the published 27 x 27 tower
    with pytest.warns(RuntimeWarning, match="grt: retention 0.01 .* keeping 4"):
        assert count("llava_onevision", ov, 0.01) == 8 * 4
    assert [retention_keep(729, 196, r) for r in (0.25, 0.95, 0.97)] == [196, 728, 729]

    model, _ = model_and_processor("llava_onevision")
    inputs = single_inputs("llava_onevision")
    with torch.no_grad():
        want = model(**inputs).logits
        with vtc_patch(model, "grt", retention=1.0):
            assert torch.equal(model(**inputs).logits, want)
        with vtc_patch(model, "grt", retention=0.3) as handle:
            model(**inputs)
            stats = handle.stats()
    assert stats.llm_tokens_in == handle.retained_count(stats.grids[0]) == 8 * 59


def test_grt_refusals_name_the_problem():
    """The Qwen families lack the pre-pool grid (the official Qwen route is stage 1 only, routed by the prompt);
    bad parameters; the content-dependent official options are not offered; no stage 1 record."""
    from vtc.core.pipeline import Pipeline
    from vtc.core.tokens import Context, VideoTokens
    from vtc.testing.fixtures import model_and_processor

    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        with pytest.raises(ValueError, match=f"'grt' does not support {family}: it needs prepool"):
            Pipeline("grt", 0.25, family=family)
    with pytest.raises(ValueError, match="grt: gate_metric must be one of 'l2', 'ssim'"):
        GRT(gate_metric="cosine")
    with pytest.raises(ValueError, match=r"grt: keep_ratio must be in \(0, 1\]"):
        GRT(keep_ratio=0.0)
    with pytest.raises(ValueError, match=r"grt: min_tokens_per_frame must be in \[1, inf\)"):
        GRT(min_tokens_per_frame=0)
    model, _ = model_and_processor("llava_onevision")
    with pytest.raises(ValueError, match="unknown parameter 'require_semantic_match'"):
        vtc_patch(model, "grt", require_semantic_match=True)
    tokens = VideoTokens.from_grid(torch.zeros(2 * 196, 4), (2, 14, 14))
    ctx = Context(family="llava_onevision", prepool=torch.zeros(2, 27, 27, 4))
    with pytest.raises(RuntimeError, match="no stage 1 record"):
        GRT().bind(0.25).connect(tokens, ctx)


def test_float32_logits_keep_the_matching_finite_where_fp16_underflows():
    """1 case, the fp16 video and large head of `test_match_key_frames_matches_official` that make the official
    divergence NaN / inf: with the head's logits in float32 (`upcast_logits`, what the method passes) every
    divergence is finite and a near repeat of the previous key frame still matches."""
    g = torch.Generator().manual_seed(11)
    head = torch.nn.Linear(12, 300, bias=False)
    with torch.no_grad():
        head.weight.mul_(8.0)
    head = head.to(torch.float16)
    features = torch.randn(4, 1, 12, generator=g) + 0.5 * torch.randn(4, 9, 12, generator=g)
    features[2] = features[1] + 0.05 * torch.randn(9, 12, generator=g)
    features = features.to(torch.float16)
    key = torch.ones(4, dtype=torch.bool)
    with torch.no_grad():
        fp16 = match_key_frames(features, key, head, 0.4)
        fp32 = match_key_frames(features, key, upcast_logits(head), 0.4)
    assert not torch.isfinite(fp16.divergence[fp16.compared]).all()
    assert torch.isfinite(fp32.divergence[fp32.compared]).all() and not fp32.kept_key[2]
