"""FastVID: DySeg, budgets and anchor quotas against loop re-derivations of the official code, the DTM merge on
inputs whose answer is known, the three official versions (LLaVA-OneVision parallel, LLaVA-Video, Qwen2.5-VL)
against re-derivations written in the official code's structure, SigLIP's MAP head (`head=`) against HF's own
head, the fixed-count mode, the retention mapping, and the patched models end to end."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vtc
from tests.conftest import FAMILIES, batch_inputs, grid_tokens, model_and_processor, single_inputs
from tests.probes import connect_inputs, llm_inputs
from vtc.core.geometry import default_geometry
from vtc.core.tokens import Context, VideoTokens
from vtc.core.vision_stats import VisionStat
from vtc_plugins.fastvid import (
    FEATURES,
    VERSIONS,
    FastVID,
    MAPHead,
    assemble,
    dtm_merge,
    dyseg,
    fastvid_plan,
    fixed_target,
    llava_anchor_quotas,
    llava_frame_budget,
    llava_video_segment_quotas,
    load_map_head,
    map_head_outputs,
    normalize_rows,
    qwen25_segment_quotas,
    salience_map,
)

# --- loop / official-structure re-derivations ---------------------------------------------------------------------


def official_segments(glob, c, tau):
    """DySeg as `Qwen2Model.forward` (LLaVA-OV) computes it."""
    g = glob / glob.norm(dim=1, keepdim=True)
    sim = (g[:-1] * g[1:]).sum(dim=1)
    cut_topk = torch.topk(sim, c - 1, largest=False).indices
    cut_cos = torch.nonzero(sim < tau, as_tuple=False).squeeze(1)
    cuts = torch.unique(torch.cat([cut_topk, cut_cos])).sort().values
    padded = F.pad(cuts, (1, 1), value=-1)
    padded[-1] = glob.shape[0] - 1
    return padded.diff().tolist()


def density_scores(tokens):
    """Density-peak score of the official code (cdist / sqrt(D), 4 nearest, no tie-breaking noise): [B, n, D]."""
    dim = tokens.shape[-1]
    dist = torch.cdist(tokens.float(), tokens.float()) / dim**0.5
    nearest = torch.topk(dist, k=4, dim=-1, largest=False).values
    density = (-(nearest**2).mean(dim=-1)).exp()
    mask = (density[:, None, :] > density[:, :, None]).type(tokens.dtype)
    dist_max = dist.flatten(1).max(dim=-1)[0][:, None, None]
    dist0 = (dist * mask + dist_max * (1 - mask)).min(dim=-1).values
    return dist0 * density


def official_merge(targets, members, beta):
    """The DTM update of one anchor set (both versions): targets [a, D] (raw), members [m, D] (raw)."""
    tn = targets / targets.norm(dim=-1, keepdim=True)
    mn = members / members.norm(dim=-1, keepdim=True)
    one_hot = torch.zeros(members.shape[0], targets.shape[0], dtype=members.dtype)
    one_hot.scatter_(1, (mn @ tn.T).argmax(dim=1).unsqueeze(-1), 1)
    weights = (1 / (one_hot.sum(dim=0).unsqueeze(-1) + 1)).clamp(min=beta)
    counts = one_hot.sum(dim=0).clamp(min=1).unsqueeze(-1)
    return weights * targets + (1 - weights) * (one_hot.T @ members) / counts


def official_llava(video, attn, glob, r, c, tau, d, p, beta):
    """The LLaVA-OV parallel code, in its own structure: video [F, n, D], attn [F, n], glob [F, D].
    Returns {global token index: feature} of the tokens the LLM keeps."""
    frames, n, dim = video.shape
    sizes = official_segments(glob, c, tau)
    retain = int(n * r)
    salient_num = retain - int(retain * d)
    context_num = retain - salient_num
    quota = torch.zeros(frames, dtype=torch.int)
    offset = 0
    for length in sizes:
        per = (context_num * length) // ((length + p - 1) // p)
        mask = torch.arange(length - 1, -1, -1) % p == 0
        quota[offset : offset + length][mask] = per
        offset += length
    out = {}
    top = torch.topk(attn, salient_num, dim=1).indices
    for f in range(frames):
        for i in top[f].tolist():
            out[f * n + i] = video[f, i]
    keep_mask = torch.ones(frames, n, dtype=torch.bool)
    keep_mask.scatter_(1, top, False)
    filtered = torch.arange(n).expand(frames, -1)[keep_mask].view(frames, n - salient_num)
    tokens = torch.stack([video[f, filtered[f]] for f in range(frames)])
    score = density_scores(tokens)
    for f in range(frames):
        if int(quota[f]) == context_num and context_num > 0:
            sampled = torch.topk(score[f], context_num).indices
            merged = official_merge(tokens[f, sampled], tokens[f], beta)
            for s, m in zip(sampled.tolist(), merged):
                out[f * n + int(filtered[f, s])] = m
    offset = 0
    for length in sizes:
        if length > 1:
            seg = range(offset, offset + length)
            members = torch.cat([tokens[f] for f in seg])
            for f in seg:
                if int(quota[f]) > context_num:
                    sampled = torch.topk(score[f], int(quota[f])).indices
                    merged = official_merge(tokens[f, sampled], members, beta)
                    for s, m in zip(sampled.tolist(), merged):
                        out[f * n + int(filtered[f, s])] = m
        offset += length
    return out


def official_qwen_quotas(seg_len, frm_len, frame_retain_num, cur_segment_sizes, d, p):
    """The per-frame quota loops of the official Qwen2.5-VL code, as written there."""
    seg_retain_num = frame_retain_num * seg_len
    seg_context_num = max(int(seg_retain_num * d), 1)
    seg_salient_num = seg_retain_num - seg_context_num
    if seg_len == 1:
        return [seg_salient_num], [seg_context_num]
    valid_seg_len = len(cur_segment_sizes)
    chunk, rem = seg_salient_num // valid_seg_len, seg_salient_num % valid_seg_len
    frm_salient_num = [chunk + (1 if i < rem else 0) for i in range(valid_seg_len)]
    temp_num = (valid_seg_len + p - 1) // p
    chunk, rem = seg_context_num // temp_num, seg_context_num % temp_num
    temp_context_num = [chunk + (1 if i < rem else 0) for i in range(temp_num)]
    tmp_ctx_idx = 0
    frm_context_num = []
    for tmp_i in range(valid_seg_len):
        if tmp_i % p == 0:
            frm_context_num.append(min(temp_context_num[tmp_ctx_idx], frm_len // 2))
            if temp_context_num[tmp_ctx_idx] + frm_context_num[-1] > frm_len:
                temp_context_num[tmp_ctx_idx] = frm_len - frm_context_num[-1]
            tmp_ctx_idx += 1
        else:
            frm_context_num.append(0)
    frm_context_num.reverse()
    salient, context = [], []
    for i in range(valid_seg_len):
        salient.extend([0] * (cur_segment_sizes[i] - 1))
        context.extend([0] * (cur_segment_sizes[i] - 1))
        if frm_context_num[i] == 0:
            salient.append(min(frm_salient_num[i], frm_len))
            context.append(0)
        elif frm_context_num[i] > 0:
            context.append(min(frm_context_num[i], frm_len // 2))
            salient.append(min(frm_salient_num[i], frm_len - context[-1]))
    return salient, context


def official_qwen(video, attn, glob, r, c, tau, ignore, d, p, beta):
    """The Qwen2.5-VL code, in its own structure (no tie-breaking noise). Returns {token index: feature}."""
    frames, n, dim = video.shape
    g = glob / glob.norm(dim=1, keepdim=True)
    sizes = official_segments(glob, c, tau)
    out = {}
    start = 0
    for length in sizes:
        hidden = video[start : start + length]
        weights = attn[start : start + length]
        if length == 1:
            subs = [1]
        else:
            sim = (g[start : start + length][:-1] * g[start : start + length][1:]).sum(dim=1)
            cuts = torch.nonzero(sim < ignore).squeeze(1).sort().values
            if cuts.shape[0] > 0:
                subs = [cuts[0].item() + 1] + [cuts[i].item() - cuts[i - 1].item() for i in range(1, cuts.shape[0])]
                subs.append(length - cuts[-1].item() - 1)
            else:
                subs = [length]
        sal, ctx = official_qwen_quotas(length, n, int(n * r), subs, d, p)
        salient_idx, context_idx = [], []
        for f in range(length):
            top = torch.topk(weights[f], sal[f]).indices if sal[f] > 0 else None
            if ctx[f] > 0:
                everything = torch.arange(n)
                remaining = everything[~torch.isin(everything, top)] if top is not None else everything
                score = density_scores(hidden[f][remaining].unsqueeze(0))
                sampled = torch.topk(score, k=ctx[f], dim=-1).indices[0].sort().values
                context_idx.append(remaining[sampled] + f * n)
            if top is not None:
                salient_idx.append(top + f * n)
        flat = hidden.reshape(length * n, -1)
        salient_idx = torch.cat(salient_idx)
        for i in salient_idx.tolist():
            out[start * n + i] = flat[i]
        everything = torch.arange(length * n)
        for anchors in context_idx:
            merge = everything[~torch.isin(everything, torch.cat([salient_idx, anchors]))]
            merged = official_merge(flat[anchors], flat[merge], beta)
            for a, m in zip(anchors.tolist(), merged):
                out[start * n + a] = m
        start += length
    return out


def official_llava_video_quotas(seg_len, frame_retain_num, d, p):
    """The per-frame quota loops of the official LLaVA-Video code (`fastvid_llavavideo/.../modeling_qwen2.py`)."""
    seg_retain_num = frame_retain_num * seg_len
    seg_context_num = int(seg_retain_num * d)
    seg_salient_num = seg_retain_num - seg_context_num
    if seg_len == 1:
        return [seg_salient_num], [seg_context_num]
    chunk_size, remainder = seg_salient_num // seg_len, seg_salient_num % seg_len
    frm_salient_num = [chunk_size + (1 if i < remainder else 0) for i in range(seg_len)]
    temp_num = (seg_len + p - 1) // p
    chunk_size, remainder = seg_context_num // temp_num, seg_context_num % temp_num
    temp_context_num = [chunk_size + (1 if i < remainder else 0) for i in range(temp_num)]
    tmp_ctx_idx = 0
    frm_context_num = []
    for tmp_i in range(seg_len):
        if tmp_i % p == 0:
            frm_context_num.append(temp_context_num[tmp_ctx_idx])
            tmp_ctx_idx += 1
        else:
            frm_context_num.append(0)
    frm_context_num.reverse()
    assert sum(frm_salient_num) == seg_salient_num and sum(frm_context_num) == seg_context_num
    return frm_salient_num, frm_context_num


def official_llava_video(video, attn, glob, r, c, tau, d, p, beta):
    """The LLaVA-Video code, in its own structure (no tie-breaking noise, no grid newlines: the token grid has
    none in HF). Returns {token index: feature}."""
    frames, n, dim = video.shape
    sizes = official_segments(glob, c, tau)
    frame_retain_num = int(n * r)
    out = {}
    start = 0
    for length in sizes:
        hidden = video[start : start + length]
        weights = attn[start : start + length]
        sal, ctx = official_llava_video_quotas(length, frame_retain_num, d, p)
        salient_idx, context_idx = [], []
        for f in range(length):
            top = torch.topk(weights[f], sal[f]).indices if sal[f] > 0 else None
            if ctx[f] > 0:
                everything = torch.arange(n)
                remaining = everything[~torch.isin(everything, top)] if top is not None else everything
                score = density_scores(hidden[f][remaining].unsqueeze(0))
                sampled = torch.topk(score, k=ctx[f], dim=-1).indices[0].sort().values
                context_idx.append(remaining[sampled] + f * n)
            if top is not None:
                salient_idx.append(top + f * n)
        flat = hidden.reshape(length * n, -1)
        salient_idx = torch.cat(salient_idx)
        for i in salient_idx.tolist():
            out[start * n + i] = flat[i]
        everything = torch.arange(length * n)
        for anchors in context_idx:
            merge = everything[~torch.isin(everything, torch.cat([salient_idx, anchors]))]
            merged = official_merge(flat[anchors], flat[merge], beta)
            for a, m in zip(anchors.tolist(), merged):
                out[start * n + a] = m
        start += length
    return out


def smooth_video(frames, n, dim, seed, scene_every=3):
    """Frames that drift slowly inside scenes of `scene_every` frames (so segments of several frames appear)."""
    g = torch.Generator().manual_seed(seed)
    scenes = [torch.randn(n, dim, generator=g, dtype=torch.float64) for _ in range(frames)]
    video = torch.stack(
        [scenes[f // scene_every] + 0.3 * torch.randn(n, dim, generator=g, dtype=torch.float64) for f in range(frames)]
    )
    return video, torch.rand(frames, n, generator=g, dtype=torch.float64)


# --- DySeg and budgets --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("c,tau", [(8, 0.9), (2, 0.9), (4, 0.5), (1, 0.99)])
def test_dyseg_matches_the_official_cut(seed, c, tau):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(4, 16, generator=g, dtype=torch.float64)
    glob = torch.stack([base[f // 4] + 0.3 * torch.randn(16, generator=g, dtype=torch.float64) for f in range(12)])
    sizes = dyseg(normalize_rows(glob), c, tau)
    assert sum(sizes) == 12
    if c > 1 or bool(((normalize_rows(glob)[:-1] * normalize_rows(glob)[1:]).sum(1) < tau).any()):
        assert sizes == official_segments(glob, c, tau)


def test_dyseg_known_answer_and_short_videos():
    # frames 0-2 along e0, 3-4 along e1, 5 along e2: similarities [1, 1, 0, 1, 0]
    eye = torch.eye(3, dtype=torch.float64)
    glob = eye[[0, 0, 0, 1, 1, 2]]
    assert dyseg(glob, c=1, tau=0.5) == [3, 2, 1]
    assert dyseg(glob, c=2, tau=-1.0) == [3, 3]  # the single lowest similarity (first of the two zeros)
    assert dyseg(glob, c=8, tau=-1.0) == [1, 1, 1, 1, 1, 1]  # c - 1 capped at F - 1 (the official topk would fail)
    assert dyseg(glob[:1], c=8, tau=0.9) == [1]


def test_llava_budget_and_quotas():
    assert llava_frame_budget(196, 0.10, 0.4) == (12, 7)  # R = 19: 12 salient + 7 context
    assert llava_frame_budget(196, 0.25, 0.4) == (30, 19)
    assert llava_frame_budget(169, 0.10, 0.4) == (10, 6)
    # segments [1, 8, 3], C = 7, p = 4: 8 frames -> 2 anchor frames (from the end) with 56 // 2; 3 -> 1 with 21
    assert llava_anchor_quotas([1, 8, 3], [7] * 12, 4) == [7, 0, 0, 0, 28, 0, 0, 0, 28, 0, 0, 21]
    assert llava_anchor_quotas([5], [7] * 5, 4) == [17, 0, 0, 0, 17]  # 35 // 2
    assert llava_anchor_quotas([3], [1] * 3, 2) == [1, 0, 1]  # quota == C: the official single-frame path


@pytest.mark.parametrize("seg_len", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("r", [0.05, 0.27, 0.5, 0.9])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_qwen_quotas_match_the_official_loops(seg_len, r, p):
    g = torch.Generator().manual_seed(seg_len * 10 + p)
    n = 48
    cuts = sorted(torch.randperm(max(seg_len - 1, 1), generator=g)[: max(seg_len // 2, 0)].tolist())
    subs = [1] if seg_len == 1 else [b - a for a, b in zip([-1] + cuts, cuts + [seg_len - 1])]
    sal, ctx = qwen25_segment_quotas([int(n * r)] * seg_len, [n] * seg_len, subs, 0.4, p)
    assert (sal, ctx) == official_qwen_quotas(seg_len, n, int(n * r), subs, 0.4, p)
    assert sum(sal) + sum(ctx) <= int(n * r) * seg_len or seg_len == 1


# --- the DTM merge ------------------------------------------------------------------------------------------------


def test_dtm_merge_known_answer():
    anchors = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    members = torch.tensor([[3.0, 0.1], [0.2, 1.0], [5.0, -0.1], [1.0, 0.0]])
    new, assign, counts, weight = dtm_merge(anchors, members, beta=0.6)
    assert assign.tolist() == [0, 1, 0, 0] and counts.tolist() == [3, 1]
    assert weight.tolist() == pytest.approx([0.6, 0.6])  # 1 / (count + 1) <= 0.5 < beta
    torch.testing.assert_close(new[0], 0.6 * anchors[0] + 0.4 * members[[0, 2, 3]].mean(0))
    torch.testing.assert_close(new[1], 0.6 * anchors[1] + 0.4 * members[1])
    # an anchor nobody joins keeps itself (w = 1 / (0 + 1) = 1); beta = 0 gives the plain 1 / (count + 1)
    new, _, counts, weight = dtm_merge(anchors, members[:1], beta=0.0)
    assert counts.tolist() == [1, 0] and weight.tolist() == [0.5, 1.0]
    torch.testing.assert_close(new, torch.stack([(anchors[0] + members[0]) / 2, anchors[1]]))


# --- both versions against the official structure -----------------------------------------------------------------


def _as_dict(out: VideoTokens) -> dict:
    return {int(p): e for p, e in zip(out.positions.tolist(), out.embeds)}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("c,tau,p", [(8, 0.9, 4), (2, -1.0, 4), (3, 0.5, 2), (1, -1.0, 1)])
def test_llava_version_matches_the_official_code(seed, c, tau, p):
    frames, h, w, dim = 10, 5, 6, 8
    video, attn = smooth_video(frames, h * w, dim, seed)
    glob = video.mean(dim=1)
    ref = official_llava(video, attn, glob, 0.3, c, tau, 0.4, p, 0.6) if c > 1 else None
    tokens = grid_tokens(video.reshape(-1, dim), (frames, h, w))
    idx = list(torch.arange(frames * h * w).view(frames, -1))
    plan = fastvid_plan(
        VERSIONS["llava"],
        tokens.embeds,
        idx,
        attn.flatten(),
        glob,
        0.3,
        c=c,
        tau=tau,
        d=0.4,
        p=p,
        beta=0.6,
        k=4,
        generator=torch.Generator(),
    )
    out = assemble(tokens, plan, attn.flatten(), None, h * w)
    assert out.positions.tolist() == sorted(out.positions.tolist())  # original order, original positions
    assert len(out) == plan.kept
    if ref is None:  # c = 1: the official topk(k=0) leaves only the tau cuts (none here): one segment
        assert plan.segments == [frames]
        return
    ours = _as_dict(out)
    assert sorted(ours) == sorted(ref)
    for key, value in ref.items():
        torch.testing.assert_close(ours[key], value)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "c,tau,ignore,p", [(8, 0.84, 0.95, 4), (2, -1.0, 0.95, 4), (2, -1.0, 0.0, 2), (3, 0.2, 0.5, 1)]
)
def test_qwen_version_matches_the_official_code(seed, c, tau, ignore, p):
    frames, h, w, dim = 9, 4, 6, 8
    video, attn = smooth_video(frames, h * w, dim, seed)
    glob = video.mean(dim=1)
    ref = official_qwen(video, attn, glob, 0.27, c, tau, ignore, 0.4, p, 0.6)
    tokens = grid_tokens(video.reshape(-1, dim), (frames, h, w))
    idx = list(torch.arange(frames * h * w).view(frames, -1))
    plan = fastvid_plan(
        VERSIONS["qwen2_5_vl"],
        tokens.embeds,
        idx,
        attn.flatten(),
        glob,
        0.27,
        c=c,
        tau=tau,
        ignore=ignore,
        d=0.4,
        p=p,
        beta=0.6,
        k=4,
        generator=torch.Generator(),
    )
    out = assemble(tokens, plan, attn.flatten(), None, h * w)
    ours = _as_dict(out)
    assert sorted(ours) == sorted(ref) and len(out) == plan.kept
    for key, value in ref.items():
        torch.testing.assert_close(ours[key], value)


@pytest.mark.parametrize("seg_len", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("r", [0.01, 0.1, 0.27, 0.9])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_llava_video_quotas_match_the_official_loops(seg_len, r, p):
    n = 169  # LLaVA-Video's 13 x 13 frame (newlines aside)
    sal, ctx = llava_video_segment_quotas([int(n * r)] * seg_len, 0.4, p)
    assert (sal, ctx) == official_llava_video_quotas(seg_len, int(n * r), 0.4, p)
    assert sum(sal) + sum(ctx) == int(n * r) * seg_len  # the whole budget, no caps, no floor of 1


def test_llava_video_quotas_against_the_qwen_version():
    """With every frame its own sub-segment the Qwen2.5-VL quotas equal LLaVA-Video's, except where the Qwen
    version's floor of one context token or its n // 2 cap applies (so version="qwen2_5_vl" is no substitute)."""
    n, d, p = 169, 0.4, 4
    for seg_len in (1, 2, 5, 8):
        retain = [int(n * 0.1)] * seg_len
        assert llava_video_segment_quotas(retain, d, p) == qwen25_segment_quotas(
            retain, [n] * seg_len, [1] * seg_len, d, p
        )
    # int(seg_retain d) = 0: LLaVA-Video keeps no context token, Qwen2.5-VL one
    assert llava_video_segment_quotas([2], d, p) == ([2], [0])
    assert qwen25_segment_quotas([2], [n], [1], d, p) == ([1], [1])
    # a context quota above n // 2 (high r, p d large): LLaVA-Video keeps it, Qwen2.5-VL caps it
    retain = [int(n * 0.9)] * 8
    video_sal, video_ctx = llava_video_segment_quotas(retain, d, p)
    qwen_sal, qwen_ctx = qwen25_segment_quotas(retain, [n] * 8, [1] * 8, d, p)
    assert max(video_ctx) > n // 2 and max(qwen_ctx) == n // 2 and sum(video_ctx) > sum(qwen_ctx)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("c,tau,p", [(8, 0.9, 4), (2, -1.0, 4), (3, 0.5, 2), (2, -1.0, 1)])
@pytest.mark.parametrize("r", [0.1, 0.3])
def test_llava_video_version_matches_the_official_code(seed, c, tau, p, r):
    frames, h, w, dim = 10, 5, 6, 8
    video, attn = smooth_video(frames, h * w, dim, seed)
    glob = video.mean(dim=1)
    ref = official_llava_video(video, attn, glob, r, c, tau, 0.4, p, 0.6)
    tokens = grid_tokens(video.reshape(-1, dim), (frames, h, w))
    idx = list(torch.arange(frames * h * w).view(frames, -1))
    plan = fastvid_plan(
        VERSIONS["llava_video"],
        tokens.embeds,
        idx,
        attn.flatten(),
        glob,
        r,
        c=c,
        tau=tau,
        d=0.4,
        p=p,
        beta=0.6,
        k=4,
        generator=torch.Generator(),
    )
    out = assemble(tokens, plan, attn.flatten(), None, h * w)
    ours = _as_dict(out)
    assert sorted(ours) == sorted(ref) and len(out) == plan.kept
    assert out.positions.tolist() == sorted(out.positions.tolist())
    for key, value in ref.items():
        torch.testing.assert_close(ours[key], value)
    assert plan.kept == frames * int(h * w * r)  # no caps: every segment keeps its whole budget


def test_merged_tokens_follow_the_linear_map():
    """The explicit embeds equal the linear map tokens.merge applies to side features (Qwen3-VL DeepStack)."""
    frames, h, w, dim = 6, 4, 4, 5
    video, attn = smooth_video(frames, h * w, dim, 0, scene_every=6)
    tokens = grid_tokens(video.reshape(-1, dim), (frames, h, w))
    tokens.extras["deepstack"] = tokens.embeds.clone()
    idx = list(torch.arange(frames * h * w).view(frames, -1))
    for version in VERSIONS.values():
        gen = torch.Generator()
        plan = fastvid_plan(
            version, tokens.embeds, idx, attn.flatten(), video.mean(1), 0.4, c=1, tau=-1.0, generator=gen
        )
        assert plan.segments == [frames] and plan.merges
        out = assemble(tokens, plan, attn.flatten(), None, h * w)
        torch.testing.assert_close(out.extras["deepstack"], out.embeds)


# --- plugin: retention mapping, defaults, fixed count ------------------------------------------------------------


def test_params_defaults_and_validation():
    p = FastVID()
    assert (p.dyseg_c, p.dyseg_tau, p.dyseg_ignore, p.stprune_d, p.dtm_p, p.dtm_beta, p.knn) == (
        8,
        None,
        0.95,
        0.4,
        4,
        0.6,
        4,
    )
    assert p.retention_ratio is None and p.version == "auto" and not p.fixed_count and p.head is None
    for bad in (dict(retention_ratio=0.0), dict(dyseg_c=0), dict(stprune_d=1.5), dict(dtm_p=0), dict(version="x")):
        with pytest.raises(ValueError, match="fastvid"):
            FastVID(**bad)
    assert vtc.registry()["fastvid"] is FastVID
    info = FastVID.card
    assert info.stages == ("connect",) and info.positions == "keep" and info.fixed_count
    assert not info.query_aware
    assert info.fixed_count_mode == "optional" and info.vision_stats  # reads the tower's attention
    assert not info.prepool and not info.whole_frames and not info.during_decode
    assert info.retention_reference == "llm_input" and info.retention_note


def test_retention_mapping_and_family_defaults():
    plugin = FastVID()
    assert plugin.version_for("llava_onevision").name == "llava" and plugin.ratio(VERSIONS["llava"]) == 0.10
    assert plugin.version_for("llava_next_video").name == "llava"  # every family that pools a tower patch grid
    assert plugin.vision_stats("llava_onevision") == [VisionStat("received", -1)]
    assert plugin.vision_stats("qwen2_5_vl") == [VisionStat("mean_query", -1)]
    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        assert plugin.version_for(family).name == "qwen2_5_vl"
    assert plugin.ratio(VERSIONS["qwen2_5_vl"]) == 0.27
    assert FastVID().bind(0.25).ratio(VERSIONS["qwen2_5_vl"]) == 0.25  # r = retention
    assert FastVID(retention_ratio=0.2).bind(0.25).ratio(VERSIONS["llava"]) == 0.2  # the parameter wins
    assert FastVID(version="llava").version_for("qwen2_vl").name == "llava"
    video = FastVID(version="llava_video")  # LLaVA-Video checkpoints: chosen by hand
    assert video.version_for("llava_onevision").name == "llava_video" and video.ratio(VERSIONS["llava_video"]) == 0.10
    assert FastVID(fixed_count=True, version="llava_video").retained_count(
        8 * 196, (8, 14, 14), "llava_onevision"
    ) == 8 * int(196 * 0.10)
    assert FastVID().vision_stats("llava_next_video") == [VisionStat("cls", -1)]


def test_counts_adaptive_by_default_fixed_on_request():
    adaptive = FastVID().bind(0.1)
    assert adaptive.retained_count(32 * 196, (32, 14, 14), "llava_onevision") is None
    assert FastVID().bind(1.0).retained_count(576, (4, 12, 12), "llava_next_video") == 576
    fixed = FastVID(fixed_count=True).bind(0.1)
    assert fixed.retained_count(32 * 196, (32, 14, 14), "llava_onevision") == 32 * 19
    assert fixed.retained_count(32 * 196, (32, 14, 14), "qwen2_5_vl") == 32 * 19  # retention sets r everywhere
    assert fixed.retained_count(100, (32, 14, 14), "llava_onevision") == 10  # a thinned video: int(N r)
    assert fixed_target(100, (32, 14, 14), 0.1) == 10


def test_fixed_count_is_a_pure_function_of_family_grid_and_params():
    """Serving engines ask for the count before any model runs: no side effect of `vision_stats` (which vtc calls
    at patch time) may change it, and without a retention the family picks the official default ratio."""
    n, grid = 8 * 196, (8, 14, 14)
    for retention in (0.25, None):
        plugin = FastVID(fixed_count=True).bind(retention)
        before = {f: plugin.retained_count(n, grid, f) for f in FAMILIES}
        for family in FAMILIES:
            plugin.vision_stats(family)
        assert {f: plugin.retained_count(n, grid, f) for f in FAMILIES} == before
        fresh = FastVID(fixed_count=True).bind(retention)
        assert {f: fresh.retained_count(n, grid, f) for f in FAMILIES} == before
        if retention is not None:
            assert set(before.values()) == {8 * int(196 * 0.25)}
    default = FastVID(fixed_count=True)
    llava = default.retained_count(n, grid, "llava_onevision")
    qwen = default.retained_count(n, grid, "qwen2_5_vl")
    assert llava == 8 * int(196 * 0.10) and qwen == 8 * int(196 * 0.27) and llava != qwen
    default.vision_stats("qwen2_5_vl")  # the first contract learned the family here; now it changes nothing
    assert default.retained_count(n, grid, "llava_onevision") == llava


@pytest.mark.parametrize("family", ["llava_onevision", "qwen2_5_vl"])
def test_fixed_count_is_exact_and_tops_up_by_salience(family):
    frames, h, w, dim = 8, 6, 6, 8
    video, attn = smooth_video(frames, h * w, dim, 3, scene_every=4)
    tokens = grid_tokens(video.reshape(-1, dim).float(), (frames, h, w), mrope=family.startswith("qwen"))
    stat = VisionStat("mean_query", -1) if family.startswith("qwen") else VisionStat("received", -1)
    vision = {stat: attn.float() * (h * w if stat.kind == "received" else 1)}
    geometry = default_geometry(family)
    ctx = Context(family=family, geometry=geometry, vision=vision, generator=torch.Generator().manual_seed(0))
    kw = dict(dyseg_c=1, dyseg_tau=-1.0)
    adaptive = FastVID(**kw).bind(0.3)
    out = adaptive.connect(tokens, ctx)
    (plan,) = ctx.reports["plan"]  # one plan for the one video
    assert plan.kept == len(out) and plan.segments == [frames]
    fixed = FastVID(fixed_count=True, **kw).bind(0.3)
    ctx = Context(family=family, geometry=geometry, vision=vision, generator=torch.Generator().manual_seed(0))
    out_fixed = fixed.connect(tokens, ctx)
    (fixed_plan,) = ctx.reports["plan"]
    target = frames * int(h * w * 0.3)
    assert len(out_fixed) == target and fixed_plan.kept == plan.kept  # same plan, reconciled to the target
    assert fixed.retained_count(len(tokens), tokens.grid, family) == target
    assert len(out) <= target
    kept = set(_keys(out))
    added = [k for k in _keys(out_fixed) if k not in kept]
    assert len(added) == target - len(out)
    if added:  # the top-ups are the most salient of the tokens the adaptive plan left out
        flat = attn.flatten()
        left_out = sorted((k for k in range(len(tokens)) if k not in kept), key=lambda k: -float(flat[k]))
        assert sorted(added) == sorted(left_out[: len(added)])


def _keys(out: VideoTokens) -> list[int]:
    """Grid index (frame-major) of each token."""
    _, h, w = out.grid
    return (out.frame * h * w + out.row * w + out.col).tolist()


def test_full_retention_keeps_the_tokens_object():
    tokens = grid_tokens(torch.randn(32, 4), (2, 4, 4))
    ctx = Context(
        family="llava_onevision",
        geometry=default_geometry("llava_onevision"),
        vision={VisionStat("received", -1): torch.rand(2, 16)},
    )
    plugin = FastVID().bind(1.0)
    assert plugin.connect(tokens, ctx) is tokens and len(tokens) == 32
    assert "plan" not in ctx.reports  # nothing planned: every token kept as it is
    assert plugin.retained_count(32, (2, 4, 4), "llava_onevision") == 32


def test_salience_maps_per_family():
    g = torch.Generator().manual_seed(0)
    received = torch.rand(3, 729, generator=g)
    out = salience_map({VisionStat("received", -1): received}, default_geometry("llava_onevision"), (14, 14))
    ref = F.interpolate((received / 729).reshape(3, 1, 27, 27), size=[14, 14], mode="bilinear").reshape(3, 196)
    torch.testing.assert_close(out, ref)  # get_attn_2dPool of the official code
    cls = torch.rand(3, 4, 577, generator=g)
    out = salience_map({VisionStat("cls", -1): cls}, default_geometry("llava_next_video"), (12, 12))
    ref = F.avg_pool2d(cls.mean(dim=1)[:, 1:].reshape(3, 1, 24, 24), 2).reshape(3, 144)
    torch.testing.assert_close(out, ref)
    mq = torch.rand(2, 36, generator=g)
    assert torch.equal(salience_map({VisionStat("mean_query", -1): mq}, default_geometry("qwen2_5_vl"), (6, 6)), mq)


# --- the patched models -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,version", [("llava_onevision", "auto"), ("llava_onevision", "llava_video"), ("qwen2_5_vl", "auto")]
)
def test_patched_model_sees_the_plan_on_the_models_statistics(family, version):
    """The LLM receives exactly the plan the pure function makes from the model's own statistics (the tiny
    models' flat synthetic frames tie many densities, so the tie-breaking noise comes from the same seeded
    generator vtc hands the plugin), in the original order and, on LLaVA, at the original positions."""
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    tokens, ctx = connect_inputs(model, inputs, FastVID().vision_stats(family))
    t, h, w = tokens.grid
    salience = salience_map(ctx.vision, ctx.geometry, (h, w))[tokens.frame, tokens.patch]
    idx = list(torch.arange(t * h * w).view(t, -1))
    glob = tokens.embeds.reshape(t, h * w, -1).mean(1)
    kw = dict(c=2, tau=-1.0, generator=torch.Generator().manual_seed(0))  # c = 2: a multi-frame segment
    official = "qwen2_5_vl" if family.startswith("qwen") else "llava_video" if version == "llava_video" else "llava"
    plan = fastvid_plan(VERSIONS[official], tokens.embeds, idx, salience, glob, 0.3, **kw)
    assert any(length > 1 for length in plan.segments) and plan.merges
    expected = assemble(tokens, plan, salience, None, h * w)
    full_embeds, full_positions, _ = llm_inputs(model, inputs)
    params = dict(dyseg_c=2, dyseg_tau=-1.0, version=version)
    out, positions, handle = llm_inputs(model, inputs, "fastvid", retention=0.3, **params)
    stats = handle.stats()
    (reported,) = stats.reports["fastvid"]["plan"]  # one video: one plan
    assert stats.llm_tokens_in == len(expected) == plan.kept == reported.kept
    assert reported.segments == plan.segments
    assert [(s.stage, s.plugin, s.tokens_in, s.tokens_out) for s in stats.stages] == [
        ("connect", "fastvid", t * h * w, plan.kept)
    ]
    video_mask = inputs["input_ids"][0] == vtc.api.resolve_adapter(model).video_token_id
    slots = torch.nonzero(video_mask).flatten()[: t * h * w]
    keep = torch.tensor(_keys(expected))
    text_idx = torch.nonzero(~torch.isin(torch.arange(video_mask.numel()), slots)).flatten()  # incl. newline
    order = torch.sort(torch.cat([text_idx, slots[keep]])).values
    is_video = torch.isin(order, slots)
    assert out.shape[0] == order.numel()
    torch.testing.assert_close(out[is_video], expected.embeds)
    assert torch.equal(out[~is_video], full_embeds[text_idx])
    # original positions, gathered at the kept tokens (LLaVA: gaps, as the official position_ids = keep_indexs)
    if full_positions is None:
        full_positions = torch.arange(video_mask.numel())[None]
    assert torch.equal(
        positions[..., 0, :] if positions.dim() == 3 else positions[0],
        full_positions[..., 0, order] if full_positions.dim() == 3 else full_positions[0, order],
    )


def test_reports_cover_every_video_of_the_last_forward():
    """One plan per video, in video order, for the last forward only; each connect call keeps its plan's count."""
    model, _ = model_and_processor("llava_onevision")
    with vtc.patch(model, "fastvid", retention=0.3) as handle:
        for inputs, videos in ((batch_inputs("llava_onevision"), 2), (single_inputs("llava_onevision"), 1)):
            with torch.no_grad():
                model(**inputs)
            stats = handle.stats()
            plans = stats.reports["fastvid"]["plan"]
            connect = [s for s in stats.stages if s.stage == "connect"]
            assert len(plans) == len(connect) == stats.videos == videos
            assert [p.kept for p in plans] == [s.tokens_out for s in connect]
            assert [s.tokens_in for s in connect] == [t * h * w for t, h, w in stats.grids]
            assert sum(p.kept for p in plans) == stats.llm_tokens_in == stats.visual_tokens_out


def test_exact_count_on_every_frame_grid():
    """At the defaults (c = 8 > frames: every frame its own segment) the LLaVA version keeps int(n r) per frame."""
    model, _ = model_and_processor("llava_next_video")
    with vtc.patch(model, "fastvid", retention=0.25) as handle:
        with torch.no_grad():
            model(**single_inputs("llava_next_video"))
        assert handle.stats().visual_tokens_out == 8 * math.floor(144 * 0.25)


# --- SigLIP's MAP head (head=) ------------------------------------------------------------------------------------

# the tiny LLaVA-OneVision tower (vtc.testing.tiny): SigLIP 64 wide, 4 heads, 384 / 14 -> 27 x 27 patches
TINY_SIGLIP = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)


def save_siglip(path, seed: int = 0, vision_use_head: bool = True, width: int = 64):
    """A random SigLIP checkpoint (vision + text, like google/siglip-so400m-patch14-384) saved at `path`;
    returns its vision half."""
    from transformers import SiglipConfig, SiglipModel

    torch.manual_seed(seed)
    vision = dict(TINY_SIGLIP, hidden_size=width, image_size=384, patch_size=14, vision_use_head=vision_use_head)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    model = SiglipModel(SiglipConfig(text_config=text, vision_config=vision)).eval()
    model.save_pretrained(path)
    return model.vision_model


@pytest.fixture(scope="module")
def siglip(tmp_path_factory):
    """(checkpoint path, its vision model) of a tiny random SigLIP whose width fits the tiny LLaVA-OV tower."""
    path = tmp_path_factory.mktemp("siglip") / "tiny-siglip"
    return str(path), save_siglip(path)


def hf_head(vision, features):
    """(pooled, probe attention [F, L]) of HF's own SigLIP head on features, the weights read by a forward hook on
    its `nn.MultiheadAttention` (HF's head.forward discards them)."""
    seen = {}

    def grab(module, args, out):
        seen["w"] = out[1]  # returns None: the output is left as it is

    hook = vision.head.attention.register_forward_hook(grab)
    try:
        with torch.no_grad():
            pooled = vision.head(vision.post_layernorm(features))
    finally:
        hook.remove()
    return pooled, seen["w"][:, 0]


def test_map_head_equals_hfs_head_and_its_attention(siglip):
    path, vision = siglip
    post_layernorm, head = load_map_head(path)  # a SiglipModel checkpoint: the text half is ignored
    for name, param in head.state_dict().items():
        assert torch.equal(param, vision.head.state_dict()[name]), name
    assert torch.equal(post_layernorm.weight, vision.post_layernorm.weight)
    features = torch.randn(5, 729, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        pooled, weights = map_head_outputs(post_layernorm, head, features)
    ref_pooled, ref_weights = hf_head(vision, features)
    assert torch.equal(pooled, ref_pooled) and torch.equal(weights, ref_weights)
    assert pooled.shape == (5, 64) and weights.shape == (5, 729)
    # the weights: softmax per head of the probe's query against the keys, then the mean over the 4 heads
    x = vision.post_layernorm(features)
    w_q, w_k, _ = head.attention.in_proj_weight.chunk(3)
    b_q, b_k, _ = head.attention.in_proj_bias.chunk(3)
    q = (head.probe @ w_q.T + b_q).view(1, 4, 16).transpose(0, 1)  # [heads, 1, 16]
    k = (x @ w_k.T + b_k).view(5, 729, 4, 16).permute(0, 2, 1, 3)  # [F, heads, L, 16]
    manual = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1).mean(dim=1)[:, 0]
    torch.testing.assert_close(weights, manual.detach())
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(5))


def test_map_head_runs_in_the_features_dtype(siglip):
    path, vision = siglip
    head = MAPHead(path)
    features = torch.randn(3, 729, 64, generator=torch.Generator().manual_seed(2))
    pooled, weights = head(features.bfloat16())
    assert pooled.dtype == weights.dtype == torch.bfloat16  # no upcast, as the official fp16 run
    ref_pooled, ref_weights = hf_head(vision.to(torch.bfloat16), features.bfloat16())
    vision.float()
    assert torch.equal(pooled, ref_pooled) and torch.equal(weights, ref_weights)
    assert head.head.probe.dtype == torch.float32  # the loaded copy stays; each dtype gets its own cast
    assert head(features)[0].dtype == torch.float32


def video_features(model, inputs):
    """The tower output the projector receives, per frame: hidden_states[vision_feature_layer] [F, 729, D]."""
    pixels = inputs["pixel_values_videos"]
    with torch.no_grad():
        out = model.model.vision_tower(pixels.flatten(0, 1), output_hidden_states=True)
    return out.hidden_states[model.config.vision_feature_layer]


def head_plan(vision, tokens, features, r, version="llava", **kw):
    """The plan FastVID should make with the head: salience = the probe attention 27x27 -> bilinear 14x14 (the
    official get_attn_2dPool), frame feature = the head's pooled output; and the salience per token."""
    t, h, w = tokens.grid
    pooled, weights = hf_head(vision, features)
    salience = F.interpolate(weights.reshape(t, 1, 27, 27), size=[h, w], mode="bilinear").reshape(t, h * w)
    salience = salience[tokens.frame, tokens.patch]
    idx = list(torch.arange(t * h * w).view(t, -1))
    plan = fastvid_plan(
        VERSIONS[version], tokens.embeds, idx, salience, pooled, r, generator=torch.Generator().manual_seed(0), **kw
    )
    return plan, salience


def same_plan(a, b):
    assert a.segments == b.segments and torch.equal(a.salient, b.salient) and len(a.merges) == len(b.merges)
    for x, y in zip(a.merges, b.merges):
        assert torch.equal(x.anchors, y.anchors) and torch.equal(x.members, y.members)
        torch.testing.assert_close(x.embeds, y.embeds)


@pytest.mark.parametrize("version", ["llava", "llava_video"])
def test_head_gives_fastvid_its_salience_and_frame_feature(siglip, version):
    """On the tiny LLaVA-OneVision model's own tower output, the plugin's plan is the plan made from HF's head
    by hand; without head= the same context gives the fallback plan (attention received, token means)."""
    path, vision = siglip
    model, _ = model_and_processor("llava_onevision")
    inputs = single_inputs("llava_onevision")
    tokens, ctx = connect_inputs(model, inputs, [VisionStat("received", -1)])
    features = video_features(model, inputs)
    ctx.vision[FEATURES] = features
    kw = dict(dyseg_c=2, dyseg_tau=-1.0, version=version)  # one cut: at the lowest MAP-feature similarity
    plugin = FastVID(head=path, **kw).bind(0.3)
    assert plugin.vision_stats("llava_onevision") == [FEATURES]
    ctx = ctx.replace(generator=torch.Generator().manual_seed(0))
    out = plugin.connect(tokens, ctx)
    (plan,) = ctx.reports["plan"]
    expected, salience = head_plan(vision, tokens, features, 0.3, version, c=2, tau=-1.0)
    same_plan(plan, expected)
    assert any(length > 1 for length in plan.segments) and plan.merges
    ref = assemble(tokens, expected, salience, None, tokens.grid[1] * tokens.grid[2])
    assert torch.equal(out.positions, ref.positions)
    torch.testing.assert_close(out.embeds, ref.embeds)
    # fixed count: reconciled by the head's salience
    fixed = FastVID(head=path, fixed_count=True, **kw).bind(0.3)
    ctx = ctx.replace(generator=torch.Generator().manual_seed(0), reports={})
    out_fixed = fixed.connect(tokens, ctx)
    ref_fixed = assemble(tokens, expected, salience, fixed_target(len(tokens), tokens.grid, 0.3), tokens.grid[1] ** 2)
    assert len(out_fixed) == fixed.retained_count(len(tokens), tokens.grid, "llava_onevision")
    assert torch.equal(out_fixed.positions, ref_fixed.positions)
    # the fallback ignores the features: salience from the attention received, frame feature = token mean
    ctx = ctx.replace(generator=torch.Generator().manual_seed(0), reports={})
    FastVID(**kw).bind(0.3).connect(tokens, ctx)
    (fallback,) = ctx.reports["plan"]
    t, h, w = tokens.grid
    fb_salience = salience_map(ctx.vision, ctx.geometry, (h, w))[tokens.frame, tokens.patch]
    glob = tokens.embeds.reshape(t, h * w, -1).mean(1)
    idx = list(torch.arange(t * h * w).view(t, -1))
    gen = torch.Generator().manual_seed(0)
    same_plan(
        fallback,
        fastvid_plan(VERSIONS[version], tokens.embeds, idx, fb_salience, glob, 0.3, c=2, tau=-1.0, generator=gen),
    )
    assert not torch.equal(fallback.salient, plan.salient)  # the head's salience is not the attention's


def test_head_frame_features_follow_the_frames_present(siglip):
    """After an earlier plugin dropped whole frames, DySeg compares the MAP features of the frames left."""
    path, vision = siglip
    features = torch.randn(4, 729, 64, generator=torch.Generator().manual_seed(3))
    grid = (4, 14, 14)
    full = grid_tokens(torch.randn(4 * 196, 8, generator=torch.Generator().manual_seed(4)), grid)
    tokens = full.select(torch.nonzero((full.frame != 1)).flatten())  # frame 1 gone
    ctx = Context(
        family="llava_onevision",
        geometry=default_geometry("llava_onevision"),
        vision={FEATURES: features},
        generator=torch.Generator().manual_seed(0),
    )
    FastVID(head=path, dyseg_c=2, dyseg_tau=-1.0).bind(0.3).connect(tokens, ctx)
    (plan,) = ctx.reports["plan"]
    pooled, _ = hf_head(vision, features)
    sim = (normalize_rows(pooled)[[0, 2]] * normalize_rows(pooled)[[2, 3]]).sum(dim=1)
    assert plan.segments == ([1, 2] if sim[0] < sim[1] else [2, 1])


def test_patched_model_uses_the_head_end_to_end(siglip):
    """vtc.patch(model, "fastvid", head=...) on LLaVA-OneVision: the LLM receives the plan made from HF's head on
    the tower output the projector receives."""
    path, vision = siglip
    model, _ = model_and_processor("llava_onevision")
    inputs = single_inputs("llava_onevision")
    tokens, _ = connect_inputs(model, inputs)
    expected, salience = head_plan(vision, tokens, video_features(model, inputs), 0.3, c=2, tau=-1.0)
    ref = assemble(tokens, expected, salience, None, tokens.grid[1] * tokens.grid[2])
    full, _, _ = llm_inputs(model, inputs)
    out, _, handle = llm_inputs(model, inputs, "fastvid", retention=0.3, dyseg_c=2, dyseg_tau=-1.0, head=path)
    stats = handle.stats()
    (plan,) = stats.reports["fastvid"]["plan"]
    same_plan(plan, expected)
    assert stats.llm_tokens_in == len(ref) == plan.kept
    slots = torch.nonzero(inputs["input_ids"][0] == vtc.api.resolve_adapter(model).video_token_id).flatten()
    start, dropped = int(slots[0]), len(tokens) - len(ref)
    assert out.shape[0] == full.shape[0] - dropped
    torch.testing.assert_close(out[start : start + len(ref)], ref.embeds)  # the video's kept tokens, in order
    assert torch.equal(out[:start], full[:start]) and torch.equal(out[start + len(ref) :], full[start + len(tokens) :])


def test_head_errors_name_the_checkpoint_and_the_families(siglip, tmp_path):
    path, _ = siglip
    with pytest.raises(ValueError, match="head must be"):
        FastVID(head="")
    missing = str(tmp_path / "no-such-siglip")
    with pytest.raises(ValueError, match=f"could not load the SigLIP MAP head from head='{missing}'"):
        FastVID(head=missing).vision_stats("llava_onevision")
    headless = tmp_path / "siglip-without-head"
    save_siglip(headless, vision_use_head=False)
    with pytest.raises(ValueError, match="has no SigLIP attention-pooling head"):
        FastVID(head=str(headless)).vision_stats("llava_onevision")
    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_next_video"):
        with pytest.raises(ValueError, match=f"applies to llava_onevision .*not to {family}"):
            FastVID(head=path).vision_stats(family)
    plugin = FastVID(head=path)
    assert plugin._head is None
    plugin.vision_stats("llava_onevision")  # loads once, at patch time
    loaded = plugin._head
    plugin.vision_stats("llava_onevision")
    assert plugin._head is loaded and loaded.name == path
    # at the forward: a tower of another width, a context without the features
    wide = tmp_path / "wide-siglip"
    save_siglip(wide, width=32)
    tokens = grid_tokens(torch.randn(2 * 196, 8), (2, 14, 14))
    ctx = Context(
        family="llava_onevision",
        geometry=default_geometry("llava_onevision"),
        vision={FEATURES: torch.randn(2, 729, 64)},
        generator=torch.Generator(),
    )
    with pytest.raises(ValueError, match="32 wide but the vision tower's features are 64"):
        FastVID(head=str(wide)).bind(0.3).connect(tokens, ctx)
    ctx = ctx.replace(vision={})
    with pytest.raises(RuntimeError, match="this context has none"):
        FastVID(head=path).bind(0.3).connect(tokens, ctx)
    ctx = ctx.replace(geometry=default_geometry("llava_next_video"))
    with pytest.raises(ValueError, match="not to llava_next_video"):
        FastVID(head=path).bind(0.3).connect(tokens, ctx)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_next_video"])
def test_head_on_another_family_fails_at_patch_time(siglip, family):
    path, _ = siglip
    model, _ = model_and_processor(family)
    with pytest.raises(ValueError, match=f"applies to llava_onevision .*not to {family}"):
        vtc.patch(model, "fastvid", head=path)
    assert vtc.api.resolve_adapter(model).outer._forward_pre_hooks == {}  # nothing was installed
