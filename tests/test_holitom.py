"""HoliTom: the DP segmentation, static/dynamic split, DPC-kNN beta merge and sequential inner merge against loop
re-derivations of the official code (cokeshao/HoliTom `holitom/llava_arch.py`, `holitom/modeling_qwen2.py`),
and the patched model against a layer-by-layer reference of the inner merge."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import vtc
from tests.conftest import FAMILIES, batch_inputs, grid_tokens, model_and_processor, single_inputs
from tests.reference import CAPTURED, ManualLLM, compressible_video_mask, last_rows_attention, start
from vtc.core.geometry import FamilyGeometry, default_geometry
from vtc.core.tokens import Context
from vtc_plugins.holitom import (
    RECEIVED,
    HoliTom,
    HoliTomOuter,
    adjusted_ratio,
    attention_on_grid,
    dpc_knn_merge,
    dynamic_budget,
    frame_similarity,
    inner_kept_count,
    inner_merge,
    outer_merge,
    reconcile_plan,
    segment_windows,
    static_window_counts,
)

# --- loop re-derivations of the official functions ---------------------------------------------------------------


def official_windows(sim: torch.Tensor, tau: float, max_window_size: int) -> tuple[list[tuple[int, int]], float]:
    """`select_static_windows`, written with plain loops."""
    frames, positions = sim.shape[0] + 1, sim.shape[1]
    count = [[0.0] * frames for _ in range(frames)]
    for s in range(frames):
        for e in range(s + 1, frames):
            static = sum(all(sim[t, p] > tau for t in range(s, e)) for p in range(positions))
            count[s][e] = float(static * (e - s))
    dp, prev = [0.0] * frames, [0] * frames
    for i in range(frames):
        best, best_j = (dp[i - 1] if i > 0 else 0.0), i
        for size in range(2, min(i + 1, max_window_size) + 1):
            j = i - size
            value = (dp[j] if j >= 0 else 0.0) + count[j + 1][i]
            if value > best:
                best, best_j = value, j + 1
        dp[i], prev[i] = best, best_j
    out, i = [], frames - 1
    while i >= 0:
        out.append((prev[i], i))
        i = prev[i] - 1
    return out[::-1], dp[-1]


def brute_force_saved(sim: torch.Tensor, tau: float) -> float:
    """Best total saving over every segmentation of the frames into consecutive windows."""
    frames, positions = sim.shape[0] + 1, sim.shape[1]
    best = 0.0
    for cuts in itertools.product([0, 1], repeat=frames - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [frames]
        total = 0.0
        for s, e in zip(bounds[:-1], bounds[1:]):
            e -= 1
            static = sum(all(sim[t, p] > tau for t in range(s, e)) for p in range(positions)) if e > s else 0
            total += static * (e - s)
        best = max(best, total)
    return best


def official_dpc(x: torch.Tensor, cluster_num: int, k: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`cluster_dpc_knn` on one item (its noise drawn from `generator`)."""
    n, dim = x.shape
    dist = torch.cdist(x.float()[None], x.float()[None])[0] / dim**0.5
    nearest = torch.topk(dist, k, dim=-1, largest=False).values
    density = (-(nearest**2).mean(dim=-1)).exp()
    density = density + torch.rand(density.shape, generator=generator, dtype=density.dtype) * 1e-6
    mask = (density[None, :] > density[:, None]).float()
    dist_max = dist.max()
    delta = (dist * mask + dist_max * (1 - mask)).min(dim=-1).values
    return torch.topk(delta * density, cluster_num).indices, dist


def official_clustering(x, centers, dist, beta, use_beta=True) -> torch.Tensor:
    """`merge_tokens_by_clustering` on one item: non-centres join their nearest centre (argmin), then the beta rule."""
    others = [i for i in range(x.shape[0]) if i not in set(centers.tolist())]
    nearest = torch.argmin(dist[others][:, centers], dim=-1)
    out = []
    for c in range(centers.numel()):
        members = [others[j] for j in range(len(others)) if nearest[j] == c]
        centre = x[centers[c]]
        if not members:
            out.append(centre)
        elif use_beta:
            out.append(beta * centre + (1 - beta) * x[members].mean(dim=0))
        else:
            out.append(torch.cat([centre[None], x[members]]).mean(dim=0))
    return torch.stack(out)


def official_outer(x, attn, retain_ratio, tau, beta=0.6, d=0.0, knn=7, max_window_size=1024, generator=None):
    """`prepare_inputs_labels_for_multimodal` + `get_static_dynamic_features` + `holitom` on one video (one_token):
    returns the output features and, per output, (frame, position) of its anchor."""
    frames, positions, _ = x.shape
    normed = F.normalize(x, p=2, dim=-1)
    sim = F.cosine_similarity(normed[:-1], normed[1:], dim=-1)
    windows, saved = official_windows(sim, tau, max_window_size)
    total = frames * positions
    ratio = min(retain_ratio / ((total - saved) / total), 1)
    feats, anchors = [], []

    def dynamic(f, pos):
        m = len(pos)
        keep = math.ceil(m * ratio)
        dominant = round(keep * (1 - d))
        contextual = keep - dominant
        chosen = set(torch.topk(attn[f, pos], dominant).indices.tolist()) if dominant > 0 else set()
        for j in range(m):  # masked_select: original order
            if j in chosen:
                feats.append(x[f, pos[j]])
                anchors.append((f, pos[j]))
        if contextual > 0:
            rest = [j for j in range(m) if j not in chosen]
            sub = x[f, [pos[j] for j in rest]]
            centers, dist = official_dpc(sub, contextual, min(knn, contextual), generator)
            centers = torch.sort(centers).values
            for c, feat in zip(centers.tolist(), official_clustering(sub, centers, dist, beta)):
                feats.append(feat)
                anchors.append((f, pos[rest[c]]))

    for s, e in windows:
        if s == e:
            dynamic(s, list(range(positions)))
            continue
        static = [p for p in range(positions) if all(sim[t, p] > tau for t in range(s, e))]
        dyn = [p for p in range(positions) if p not in static]
        before = len(feats)
        for f in range(s, e + 1):
            dynamic(f, dyn)
        dyn_feats, dyn_anchors = feats[before:], anchors[before:]
        del feats[before:], anchors[before:]
        num = round(len(static) * ratio)
        if num > 0:
            mean = x[s : e + 1, static].mean(dim=0)
            centers, dist = official_dpc(mean, num, min(knn, num), generator)
            centers = torch.sort(centers).values
            for c, feat in zip(centers.tolist(), official_clustering(mean, centers, dist, beta)):
                feats.append(feat)
                anchors.append((s, static[c]))
        feats += dyn_feats
        anchors += dyn_anchors
    return torch.stack(feats), anchors, windows, ratio


def official_inner(hidden, scores, slots, r):
    """The layer-k block of `Qwen2Model_holitom.forward` on one row (literal loop, in-place update). The official
    code takes a contiguous image span [start, start + length); `slots` generalises it to Qwen3-VL's interleaved
    timestamps."""
    hidden = hidden.clone()[None]
    length = slots.numel()
    top = slots[scores[slots].topk(round(length * (1 - r))).indices]
    non_topk = slots[~torch.isin(slots, top)]
    a, b = hidden[:, non_topk, :], hidden[:, top, :]
    norms = torch.norm(a, dim=-1, keepdim=True) * torch.norm(b, dim=-1, keepdim=True).transpose(1, 2)
    sim = torch.bmm(a, b.transpose(1, 2)) / norms
    _, best = torch.max(sim, dim=-1)
    for i in range(len(non_topk)):
        t = top[best[0, i]]
        hidden[0, t, :] = (hidden[0, t, :] + hidden[0, non_topk[i], :]) / 2
    others = torch.ones(hidden.shape[1], dtype=torch.bool)
    others[slots] = False
    keep = torch.sort(torch.cat([torch.nonzero(others).flatten(), top])).values
    return hidden[0], keep


# --- segmentation --------------------------------------------------------------------------------------------------


def hand_built_similarity() -> torch.Tensor:
    """6 frames x 4 positions: frames 0-2 identical everywhere, a cut, frames 3-5 identical at positions 0 and 1."""
    sim = torch.full((5, 4), 0.1)
    sim[0:2] = 0.9
    sim[3:5, :2] = 0.9
    return sim


def test_dp_segmentation_on_a_known_optimum():
    sim = hand_built_similarity()
    counts = static_window_counts(sim, 0.8)
    assert counts[0, 2] == 4 * 2 and counts[3, 5] == 2 * 2 and counts[2, 3] == 0 and counts[1, 0] == 0
    windows, saved = segment_windows(counts)
    assert windows == [(0, 2), (3, 5)]
    assert saved == 12.0
    assert adjusted_ratio(0.25, 24, saved) == pytest.approx(0.5)
    # windows of at most 2 frames: the best is 6 saved; ties go to the first (smallest) window that wins
    windows2, saved2 = segment_windows(counts, max_window_size=2)
    assert saved2 == 6.0 and all(e - s <= 1 for s, e in windows2)
    assert (windows2, saved2) == official_windows(sim, 0.8, 2)
    # nothing above the threshold: every frame is its own window
    assert segment_windows(static_window_counts(torch.zeros(5, 4), 0.8))[0] == [(i, i) for i in range(6)]


@pytest.mark.parametrize("seed", range(6))
def test_dp_segmentation_matches_loops_and_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    frames, positions = 7, 5
    sim = torch.rand(frames - 1, positions, generator=g) * 0.4 + 0.6  # many steps above tau = 0.8
    counts = static_window_counts(sim, 0.8)
    windows, saved = segment_windows(counts)
    assert (windows, saved) == official_windows(sim, 0.8, 1024)
    assert saved == brute_force_saved(sim, 0.8)
    assert [w[0] for w in windows][0] == 0 and windows[-1][1] == frames - 1
    assert all(b[0] == a[1] + 1 for a, b in zip(windows[:-1], windows[1:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_frame_similarity_is_the_official_normalised_cosine(dtype):
    """Bit-identical to the official `F.normalize` then `F.cosine_similarity`, in the features' dtype: the DP
    segmentation compares it with tau by `>`, so one ulp can move a window boundary."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, 8, generator=g)
    x[1, 2] = x[0, 2]  # identical tokens (cosine 1 up to rounding)
    x[3, 4] = -x[2, 4]  # opposite tokens
    x[2, 0] = 0.0  # a zero token: the eps of F.normalize / cosine_similarity decides
    x[4, 1] = x[3, 1] * 1e4  # same direction, very different norms
    x[0, 5] = x[0, 5] * 1e-3
    x = x.to(dtype)
    normed = F.normalize(x, p=2, dim=-1)
    expected = torch.stack([F.cosine_similarity(normed[t], normed[t + 1], dim=-1) for t in range(4)])
    got = frame_similarity(x)
    assert got.dtype == dtype and got.shape == (4, 6)
    # bit-identical, not just close (NaN where the official code gives NaN: float16's eps underflows to 0)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert bool(torch.isnan(got).any()) == (dtype == torch.float16)
    if dtype != torch.float16:
        assert float(got[2, 0]) == 0.0 and float(got[1, 0]) == 0.0  # the zero token: 0, not NaN
    # the whole segmentation sees exactly the official similarities
    if dtype == torch.float16:
        return
    counts = static_window_counts(got.float(), 0.8)
    assert segment_windows(counts) == official_windows(expected.float(), 0.8, 1024)


# --- clustering, budgets, the whole outer merge ------------------------------------------------------------------


def test_beta_merge_of_two_obvious_clusters():
    x = torch.tensor([[0.0, 0.0], [0.1, 0.0], [0.0, 0.1], [5.0, 5.0], [5.2, 5.0]])
    cl = dpc_knn_merge(x, 2, knn=7, beta=0.6, use_beta=True, generator=torch.Generator().manual_seed(0))
    assert cl.labels[:3].unique().numel() == 1 and cl.labels[3:].unique().numel() == 1
    for c, centre in enumerate(cl.centers.tolist()):
        members = [i for i in range(5) if cl.labels[i] == c and i != centre]
        expected = 0.6 * x[centre] + 0.4 * x[members].mean(dim=0)
        torch.testing.assert_close(cl.embeds[c], expected)
        # the linear form gives the same features
        linear = cl.keep_weight[c] * x[centre] + (cl.member_weight[members][:, None] * x[members]).sum(0)
        torch.testing.assert_close(linear, expected)
    plain = dpc_knn_merge(x, 2, knn=7, beta=0.6, use_beta=False, generator=torch.Generator().manual_seed(0))
    first = plain.centers[0].item()
    group = [i for i in range(5) if plain.labels[i] == 0]
    torch.testing.assert_close(plain.embeds[0], x[group].mean(dim=0))
    assert first in group


@pytest.mark.parametrize("seed", range(3))
def test_dpc_knn_merge_matches_the_official_functions(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(20, 6, generator=g)
    for clusters in (1, 3, 9):
        cl = dpc_knn_merge(x, clusters, knn=7, beta=0.6, use_beta=True, generator=torch.Generator().manual_seed(1))
        centers, dist = official_dpc(x, clusters, min(7, clusters), torch.Generator().manual_seed(1))
        centers = torch.sort(centers).values
        assert cl.centers.tolist() == centers.tolist()
        torch.testing.assert_close(cl.embeds, official_clustering(x, centers, dist, 0.6))


def test_dynamic_budget_uses_ceil_then_round():
    assert dynamic_budget(196, 0.1, 0.0) == (20, 0)  # ceil(19.6)
    assert dynamic_budget(10, 0.25, 0.5) == (2, 1)  # keep ceil(2.5) = 3, dominant round(1.5) = 2
    assert dynamic_budget(0, 0.3, 0.0) == (0, 0)


def static_video(seed: int, frames=6, positions=9, dim=8) -> tuple[torch.Tensor, torch.Tensor]:
    """A video whose first 3 frames share 5 positions, a cut, then 3 frames sharing 3 positions."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(frames, positions, dim, generator=g, dtype=torch.float64)
    x[1:3, :5] = x[0, :5] + 0.01 * torch.randn(2, 5, dim, generator=g, dtype=torch.float64)
    x[4:6, :3] = x[3, :3] + 0.01 * torch.randn(2, 3, dim, generator=g, dtype=torch.float64)
    attn = torch.rand(frames, positions, generator=g, dtype=torch.float64)
    return x, attn


def apply_linear(plan, x):
    flat = x.reshape(-1, x.shape[-1])
    out = flat[plan.anchors] * plan.keep_weight[:, None].to(x.dtype)
    return out.index_add(0, plan.dst, flat[plan.src] * plan.src_weight[:, None].to(x.dtype))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("d", [0.0, 0.5])
def test_outer_merge_matches_the_official_pipeline(seed, d):
    x, attn = static_video(seed)
    plan = outer_merge(x, attn, 0.3, 0.8, d=d, generator=torch.Generator().manual_seed(0))
    feats, anchors, windows, ratio = official_outer(x, attn, 0.3, 0.8, d=d, generator=torch.Generator().manual_seed(0))
    assert plan.windows == windows and plan.ratio == ratio
    assert [(a // 9, a % 9) for a in plan.anchors.tolist()] == anchors
    torch.testing.assert_close(plan.embeds, feats)
    torch.testing.assert_close(apply_linear(plan, x), feats)  # what tokens.merge applies to side features


def test_outer_order_static_first_then_each_frame():
    x, attn = static_video(0)
    plan = outer_merge(x, attn, 0.5, 0.8, generator=torch.Generator().manual_seed(0))
    assert plan.windows == [(0, 2), (3, 5)]
    frames = (plan.anchors // 9).tolist()
    pos = (plan.anchors % 9).tolist()
    static_first = round(5 * plan.ratio)
    # window 0: static clusters anchored on frame 0 at static positions (< 5), then dynamic frames 0, 1, 2
    assert frames[:static_first] == [0] * static_first and all(p < 5 for p in pos[:static_first])
    dyn = frames[static_first : static_first + 3 * math.ceil(4 * plan.ratio)]
    assert dyn == sorted(dyn) and set(dyn) == {0, 1, 2}
    assert all(p >= 5 for p in pos[static_first : static_first + len(dyn)])


def test_fixed_count_reconciles_both_ways():
    x, attn = static_video(1)
    plan = outer_merge(x, attn, 0.3, 0.8, generator=torch.Generator().manual_seed(0))
    for target in (len(plan) - 3, len(plan) + 4):
        fixed = reconcile_plan(plan, target, x, attn, plan.windows)
        assert len(fixed) == target
        assert fixed.anchors.unique().numel() == target
        torch.testing.assert_close(apply_linear(fixed, x), fixed.embeds)
        assert torch.equal(fixed.key, torch.sort(fixed.key).values)
    # a fully static video caps r' at 1 and keeps fewer tokens than R N: tokens are added
    still = x[:1].expand(6, -1, -1).clone()
    plan = outer_merge(still, attn, 0.5, 0.8, generator=torch.Generator().manual_seed(0))
    assert plan.windows == [(0, 5)] and plan.ratio == 1 and len(plan) == 9
    assert len(reconcile_plan(plan, 27, still, attn, plan.windows)) == 27


def test_attention_pooled_to_the_token_grid():
    # LLaVA-OneVision: SigLIP 27 x 27, bilinear to 14 x 14 (the official `get_2dPool` of the attention)
    received = torch.rand(3, 27 * 27)
    pooled = attention_on_grid(received, default_geometry("llava_onevision"), (14, 14))
    expected = F.interpolate(received.reshape(3, 1, 27, 27), size=(14, 14), mode="bilinear").reshape(3, 196)
    torch.testing.assert_close(pooled, expected, rtol=0, atol=0)
    # LLaVA-NeXT-Video: CLIP CLS + 24 x 24, the CLS dropped, the model's 2 x 2 pooler (average, or max per config)
    clip = torch.rand(2, 1 + 24 * 24)
    nextvideo = default_geometry("llava_next_video")
    pooled = attention_on_grid(clip, nextvideo, (12, 12))
    expected = F.avg_pool2d(clip[:, 1:].reshape(2, 1, 24, 24), 2).reshape(2, 144)
    torch.testing.assert_close(pooled, expected, rtol=0, atol=0)
    maxpool = FamilyGeometry("llava_next_video", mrope=False, patch_grid=(24, 24), cls_tokens=1, pooling="max")
    expected = F.max_pool2d(clip[:, 1:].reshape(2, 1, 24, 24), 2).reshape(2, 144)
    assert torch.equal(attention_on_grid(clip, maxpool, (12, 12)), expected)
    with pytest.raises(ValueError, match="tower tokens per frame"):  # a map that does not fit the patch grid
        attention_on_grid(torch.rand(2, 24 * 24), nextvideo, (12, 12))
    # Qwen: statistics already per LLM token, unchanged (float32)
    qwen = torch.rand(4, 12 * 12)
    assert torch.equal(attention_on_grid(qwen, default_geometry("qwen2_vl"), (12, 12)), qwen)
    assert attention_on_grid(qwen.half(), default_geometry("qwen2_vl"), (12, 12)).dtype == torch.float32


# --- inner merge -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequential_inner_merge_matches_the_official_loop(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=g).to(dtype)
    hidden[10:30:3] = hidden[12]  # several sources share a target: the sequential order matters
    scores = torch.rand(40, generator=g)
    slots = torch.arange(5, 35)
    new, top, dropped = inner_merge(hidden, scores, slots, 15)
    ref, keep = official_inner(hidden, scores, slots, 0.5)
    assert torch.equal(new, ref)  # bit-identical, rounding of every step included
    assert sorted(set(range(40)) - set(dropped.tolist())) == keep.tolist()
    # closed form of the sequential rule: later sources weigh more
    t = top[0]
    a, b = hidden[dropped].float(), hidden[top].float()
    sim = (a @ b.T) / (a.norm(dim=-1)[:, None] * b.norm(dim=-1)[None])
    sources = [s for s, j in zip(dropped.tolist(), sim.argmax(-1).tolist()) if top[j] == t]
    m = len(sources)
    closed = hidden[t].float() / 2**m + sum(hidden[s].float() / 2 ** (m - i) for i, s in enumerate(sources))
    if dtype == torch.float32:
        torch.testing.assert_close(new[t], closed)


def test_inner_kept_count():
    assert inner_kept_count(397, 0.5) == 198  # round(198.5) = 198 (Python rounds halves to even)
    assert inner_kept_count(1, 0.5) == 1 and inner_kept_count(0, 0.5) == 0


def prompt_bidirectional_mask(prompt_len: int, length: int) -> torch.Tensor:
    """[L, L] (True = may attend): the prompt's rows see every prompt token, later ones included; generated tokens
    (rows past the prompt) stay causal. What the official run under SDPA does at layer k - 1 (its forward skips
    the causal mask, `output_attentions=True` sends that layer to eager attention with no mask; decode steps
    have one query row, which sees everything either way)."""
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    mask[:prompt_len, :prompt_len] = True
    return mask


def holitom_inner_reference(model, inputs, k, r, new_tokens=None, decision=None, bidirectional=False):
    """The official inner merge, batch 1, on the model's full visual tokens: layers < k unchanged; at layer k keep
    the top round(N (1 - r)) by the head-mean last-token attention of layer k - 1, fold the others in sequentially,
    drop them (positions kept). `bidirectional`: layer k - 1 runs without the causal mask over the prompt."""
    prompt_len = inputs["input_ids"].shape[1]
    ref, inputs, x, hidden, cos, sin, visual = start(model, inputs, new_tokens)
    with ref.capturing(), torch.no_grad():
        for i in range(len(ref.layers)):
            if i == k:
                if decision is None:
                    query, key = CAPTURED[k - 1]
                    probs = last_rows_attention(query[:, :, :prompt_len], key[:, :, :prompt_len], 1, upcast=True)
                    decision = probs.mean(dim=1)[0, -1]
                vis = torch.nonzero(visual[:prompt_len]).flatten()
                merged, keep = official_inner(hidden[0], decision, vis, r)
                keep = keep[keep < prompt_len]
                full_keep = torch.cat([keep, torch.arange(prompt_len, hidden.shape[1])])
                hidden, cos, sin = merged[None][:, full_keep], cos[:, full_keep], sin[:, full_keep]
            mask = None
            if bidirectional and i == k - 1:
                mask = prompt_bidirectional_mask(prompt_len, hidden.shape[1])
            hidden = ref.attention_block(i, hidden, cos, sin, mask)
            hidden = ref.mlp_block(i, hidden)
            hidden = ref.deepstack(i, hidden, x.get("visual_pos_masks", [None])[0], x.get("deepstack_visual_embeds"))
        return ref.logits(hidden), decision


@pytest.mark.parametrize("family", FAMILIES)
def test_inner_merge_matches_reference_prefill_and_decode(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    ref_logits, decision = holitom_inner_reference(model, inputs, k=2, r=0.5)
    n_visual = int(compressible_video_mask(model, inputs["input_ids"]).sum())
    with vtc.patch(model, "holitom", retain_ratio=1.0, r=0.5, k=2) as handle:  # inner merge only
        with torch.no_grad():
            out = model(**inputs).logits
        stats = handle.stats()
        assert stats.llm_tokens_in == n_visual
        assert stats.layer_visual_tokens == [n_visual] * 2 + [round(n_visual * 0.5)] * 2
        assert handle.retained_count(stats.grids[0]) == stats.visual_tokens_out
        gen = model.generate(
            **inputs, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    torch.testing.assert_close(out[:, -1], ref_logits[:, -1], atol=2e-5, rtol=1e-4)
    new = gen.sequences[:, inputs["input_ids"].shape[1] :]
    for step in (1, 2):
        step_logits, _ = holitom_inner_reference(model, inputs, 2, 0.5, new_tokens=new[:, :step], decision=decision)
        torch.testing.assert_close(gen.logits[step], step_logits[:, -1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_bidirectional_layer_matches_the_non_causal_reference(family):
    """bidirectional_layer=True: layer k - 1 (whose attention HoliTom reads) attends without the causal mask, as
    the official SDPA run; the default stays causal; the two differ."""
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    causal_ref, decision = holitom_inner_reference(model, inputs, k=2, r=0.5)
    bidir_ref, bidir_decision = holitom_inner_reference(model, inputs, k=2, r=0.5, bidirectional=True)
    # the last prompt row sees every key either way: the same tokens are kept, only the hidden states change
    assert torch.equal(decision, bidir_decision)
    logits = {}
    for flag in (False, True):
        with vtc.patch(model, "holitom", retain_ratio=1.0, r=0.5, k=2, bidirectional_layer=flag) as handle:
            with torch.no_grad():
                logits[flag] = model(**inputs).logits
            stats = handle.stats()
            n_visual = stats.llm_tokens_in
            assert stats.reports["holitom"]["kept"] == [round(n_visual * 0.5)] == [stats.visual_tokens_out]
            gen = model.generate(
                **inputs, max_new_tokens=2, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
        if flag:
            torch.testing.assert_close(logits[flag], bidir_ref, atol=2e-5, rtol=1e-4)  # every prompt row
            # decoding continues the non-causal prefill's cache: the reference re-runs it with the new token
            new = gen.sequences[:, inputs["input_ids"].shape[1] :]
            step_logits, _ = holitom_inner_reference(
                model, inputs, 2, 0.5, new_tokens=new[:, :1], decision=decision, bidirectional=True
            )
            torch.testing.assert_close(gen.logits[1], step_logits[:, -1], atol=2e-5, rtol=1e-4)
        else:
            torch.testing.assert_close(logits[flag], causal_ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(gen.logits[0], logits[flag][:, -1], atol=2e-5, rtol=1e-4)
    # the flag does something: the references differ well beyond the tolerance, and so do the patched runs
    assert float((bidir_ref - causal_ref).abs().max()) > 1e-2
    assert float((logits[True] - logits[False]).abs().max()) > 1e-2
    # the unpatched model is causal: without the flag nothing changes outside vtc
    assert HoliTom().bidirectional_layer is False


def layer0_inputs(model, inputs, **params):
    """(hidden, cos, sin) entering decoder layer 0 of the patched model (the outer merge's output), and the
    forward's stats."""
    seen = {}

    def probe(module, args, kwargs):
        seen.setdefault("x", (args[0] if args else kwargs["hidden_states"], kwargs["position_embeddings"]))

    layer0 = vtc.api.resolve_adapter(model).decoder_layers[0]
    with vtc.patch(model, "holitom", **params) as handle:
        hook = layer0.register_forward_pre_hook(probe, with_kwargs=True)
        try:
            with torch.no_grad():
                model(**inputs)
        finally:
            hook.remove()
        stats = handle.stats()
    hidden, (cos, sin) = seen["x"]
    return hidden, cos, sin, stats


@pytest.mark.parametrize("family", ["llava_onevision", "qwen2_vl"])
def test_outer_then_inner_matches_reference(family):
    """Both stages: the outer merge's output (captured with the inner merge off, same seed) run through the
    reference layers with the inner merge at layer k."""
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    hidden, cos, sin, outer = layer0_inputs(model, inputs, retention=0.25, r=0.0, k=2)
    ((plan,),) = [outer.reports["holitom"]["plan"]]  # one OuterPlan for the one video
    kept_outer = len(plan)
    assert outer.llm_tokens_in == outer.visual_tokens_out == kept_outer < outer.visual_tokens_in
    assert "kept" not in outer.reports["holitom"]  # r = 0: no inner merge, nothing reported in the LLM
    ref = ManualLLM(model)
    adapter = vtc.api.resolve_adapter(model)
    video_id = adapter.video_token_id
    # visual slots of the compressed prompt: the first `kept_outer` video placeholders (the newline is text)
    first = int(torch.nonzero(inputs["input_ids"][0] == video_id)[0])
    with ref.capturing(), torch.no_grad():
        for i in range(len(ref.layers)):
            if i == 2:
                query, key = CAPTURED[1]
                scores = last_rows_attention(query, key, 1, upcast=True).mean(dim=1)[0, -1]
                slots = torch.arange(first, first + kept_outer)
                merged, keep = official_inner(hidden[0], scores, slots, 0.5)
                hidden, cos, sin = merged[None][:, keep], cos[:, keep], sin[:, keep]
            hidden = ref.attention_block(i, hidden, cos, sin)
            hidden = ref.mlp_block(i, hidden)
        ref_logits = ref.logits(hidden)
    with vtc.patch(model, "holitom", retention=0.25, k=2) as handle:
        with torch.no_grad():
            out = model(**inputs).logits
        stats = handle.stats()
    assert stats.llm_tokens_in == kept_outer
    assert stats.layer_visual_tokens == [kept_outer] * 2 + [round(kept_outer * 0.5)] * 2
    assert stats.reports["holitom"]["kept"] == [stats.visual_tokens_out]  # one batch row
    # the same (seeded) outer plan as the r = 0 run
    ((again,),) = [stats.reports["holitom"]["plan"]]
    assert torch.equal(again.anchors, plan.anchors) and again.windows == plan.windows
    torch.testing.assert_close(out[:, -1], ref_logits[:, -1], atol=2e-5, rtol=1e-4)


# --- parameters, retention, counts ---------------------------------------------------------------------------------


def test_defaults_and_retention_mapping():
    p = HoliTom()
    assert (p.k, p.beta, p.d, p.knn, p.max_window_size, p.use_beta, p.fixed_count) == (
        18,
        0.6,
        0.0,
        7,
        1024,
        True,
        False,
    )
    default = p.bind(None)
    assert (default.retain(), default.static_tau(), default.inner_ratio()) == (0.15, 0.80, 0.5)
    assert (p.bind(0.10).retain(), p.bind(0.10).static_tau()) == (0.10, 0.65)  # the scripts' 10% run
    for retention in (0.15, 0.20, 0.25):
        assert (p.bind(retention).retain(), p.bind(retention).static_tau()) == (retention, 0.80)
    explicit = HoliTom(retain_ratio=0.2, tau=0.7, r=0.25).bind(0.1)
    assert (explicit.retain(), explicit.static_tau(), explicit.inner_ratio()) == (0.2, 0.7, 0.25)
    identity = p.bind(1.0)
    assert identity.inner_ratio() == 0.0 and not identity.outer_active() and identity.vision_stats("qwen2_vl") == []
    assert identity.retained_count(1568, (8, 14, 14), "llava_onevision") == 1568
    assert identity.retained_count(700, (8, 14, 14), "qwen2_vl") == 700  # keeps whatever reaches it
    assert not p.bidirectional_layer  # causal by default (the eager / official-attention reading)
    with pytest.raises(ValueError, match="retain_ratio"):
        HoliTom(retain_ratio=0.0)
    with pytest.raises(ValueError, match=r"holitom: r must be in \[0, 1\)"):
        HoliTom(r=1.0)
    with pytest.raises(ValueError, match=r"holitom: k must be in \[1, inf\)"):
        HoliTom(k=0)


def test_fixed_count_depends_only_on_the_grid():
    plugin = HoliTom(fixed_count=True).bind(0.25)
    for family in ("llava_onevision", "qwen2_vl"):  # the count does not depend on the family either
        assert plugin.retained_count(1568, (8, 14, 14), family) == inner_kept_count(392, 0.5) == 196
    assert HoliTom().bind(0.25).retained_count(1568, (8, 14, 14), "qwen2_vl") is None  # adaptive default
    assert HoliTom(fixed_count=True, r=0.0).bind(0.25).retained_count(1568, (8, 14, 14), "qwen2_vl") == 392
    for family in ("llava_onevision", "qwen2_5_vl"):
        model, _ = model_and_processor(family)
        with vtc.patch(model, "holitom", retention=0.25, k=2, fixed_count=True) as handle:
            for which in (0, 1):
                with torch.no_grad():
                    model(**single_inputs(family, which))
                stats = handle.stats()
                t, h, w = stats.grids[0]
                assert stats.llm_tokens_in == round(t * h * w * 0.25)
                assert stats.visual_tokens_out == handle.retained_count(stats.grids[0])
                # the reported plan (reconciled) and inner-merge count of this forward only
                (plan,) = stats.reports["holitom"]["plan"]
                assert len(plan) == stats.llm_tokens_in and plan.anchors.unique().numel() == len(plan)
                assert stats.reports["holitom"]["kept"] == [inner_kept_count(len(plan), 0.5)]


def test_connect_returns_the_input_at_full_retention():
    from vtc.core.tokens import VideoTokens

    plugin = HoliTom().bind(1.0)
    ones = torch.ones(4, dtype=torch.long)
    tokens = VideoTokens(torch.randn(4, 2), torch.arange(4), ones * 0, ones * 0, torch.arange(4), ones, (1, 1, 4))
    ctx = Context()
    assert plugin.connect(tokens, ctx) is tokens
    assert ctx.reports == {}  # no outer merge: no plan


def test_k_beyond_the_model_is_a_clear_error():
    model, _ = model_and_processor("qwen2_vl")
    with vtc.patch(model, "holitom", retention=0.25, k=4):
        with pytest.raises(ValueError, match=r"holitom: k=4 but the language model has only 4 layers"):
            model(**single_inputs("qwen2_vl"))


def test_end_to_end_stats():
    model, _ = model_and_processor("llava_onevision")
    with vtc.patch(model, "holitom", retention=0.25, k=2) as handle:
        with torch.no_grad():
            model(**single_inputs("llava_onevision"))
        stats = handle.stats()
    (plan,) = stats.reports["holitom"]["plan"]
    assert stats.visual_tokens_in == 8 * 14 * 14
    assert stats.llm_tokens_in == len(plan) < stats.visual_tokens_in
    assert stats.visual_tokens_out == round(len(plan) * 0.5) == sum(stats.reports["holitom"]["kept"])
    assert len(stats.reports["holitom"]["kept"]) == 1  # one batch row
    assert plan.windows[0][0] == 0 and plan.windows[-1][1] == 7
    (record,) = [r for r in stats.stages if r.stage == "connect" and r.plugin == "holitom"]
    assert (record.tokens_in, record.tokens_out) == (stats.visual_tokens_in, len(plan))


def test_reports_one_plan_per_video_and_one_count_per_row():
    model, _ = model_and_processor("qwen2_vl")
    with vtc.patch(model, "holitom", retention=0.25, k=2) as handle:
        with torch.no_grad():
            model(**batch_inputs("qwen2_vl"))
        stats = handle.stats()
    plans = stats.reports["holitom"]["plan"]
    assert len(plans) == stats.videos == 2
    records = [r for r in stats.stages if r.stage == "connect" and r.plugin == "holitom"]
    assert [r.tokens_out for r in records] == [len(p) for p in plans]
    assert [r.tokens_in for r in records] == [t * h * w for t, h, w in stats.grids]
    # each plan covers its own video's frames
    for plan, (t, h, w) in zip(plans, stats.grids):
        assert plan.windows[0][0] == 0 and plan.windows[-1][1] == t - 1 and int(plan.anchors.max()) < t * h * w
    kept = stats.reports["holitom"]["kept"]
    assert kept == [inner_kept_count(len(p), 0.5) for p in plans]  # one row per video here
    assert sum(kept) == stats.visual_tokens_out


def test_method_info():
    cls = vtc.registry()["holitom"]
    info = cls.card
    assert info.stages == ("connect", "prefill") and info.acts_in_llm
    assert info.fixed_count and info.fixed_count_mode == "optional"
    assert info.vision_stats and info.whole_frames and info.query_aware
    assert not info.prepool and not info.during_decode
    assert info.owns == frozenset({"llm_token_schedule"}) and info.positions == "compact"
    assert info.retention_reference == "llm_input" and "RETAIN_RATIO" in info.retention_note
    assert set(cls.testing.exemptions) == {"ordered_positions", "retention"}
    assert cls.testing.params == {"k": 2}
    assert HoliTom().bind(0.25).vision_stats("llava_onevision") == [RECEIVED]
    # holitom-outer: the connect part alone (r = 0, the paper's 'w/o M'), what a server runs
    outer = vtc.registry()["holitom-outer"]
    assert outer is HoliTomOuter and issubclass(HoliTom, HoliTomOuter) and issubclass(HoliTom, vtc.LayerPruner)
    assert outer.card.stages == ("connect",) and outer.card.fixed_count_mode == "optional"
    assert outer.card.vision_stats and outer.card.whole_frames and not outer.card.query_aware and not outer.owns
    assert set(outer.testing.exemptions) == {"ordered_positions", "retention"} and outer.testing.params == {}
    assert outer(k=4, r=0.3).bind(0.25).inner_ratio() == 0.0  # a holitom configuration serves unchanged
    assert outer(fixed_count=True).bind(0.25).retained_count(1568, (8, 14, 14), "qwen2_vl") == 392


def test_needs_whole_frames():
    """A method thinning frames before HoliTom is refused when the pipeline is built; HoliTom first is fine."""
    model, _ = model_and_processor("qwen2_vl")
    with pytest.raises(ValueError, match="holitom needs whole frames") as err:
        vtc.patch(model, "random+holitom", retention=0.25, k=2)
    assert "'holitom+random'" in str(err.value)  # the message says how to fix the spec
    with vtc.patch(model, "holitom+random", retention=0.25, k=2) as handle, torch.no_grad():
        model(**single_inputs("qwen2_vl"))
        assert handle.stats().llm_tokens_in < len(handle.stats().reports["holitom"]["plan"][0])
    # called directly, the hook checks what it gets: frames dropped whole are fine, holes inside a frame are not
    g = torch.Generator().manual_seed(0)
    t, h, w = 4, 3, 4
    embeds = torch.randn(t * h * w, 8, generator=g, dtype=torch.float64)
    embeds[h * w : 2 * h * w] = embeds[: h * w] + 1e-3 * torch.randn(h * w, 8, generator=g, dtype=torch.float64)
    attn = torch.rand(t, h * w, generator=g)
    tokens = grid_tokens(embeds, (t, h, w), mrope=True)
    plugin = HoliTom().bind(0.5)

    def context():
        return Context(
            family="qwen2_vl",
            geometry=default_geometry("qwen2_vl"),
            vision={RECEIVED: attn},
            generator=torch.Generator().manual_seed(0),
        )

    ctx = context()
    out = plugin.connect(tokens, ctx)
    (plan,) = ctx.reports["plan"]
    ref = outer_merge(
        embeds.view(t, h * w, 8), attn, 0.5, plugin.static_tau(), generator=torch.Generator().manual_seed(0)
    )
    assert len(out) == len(plan) == len(ref) and torch.equal(plan.anchors, ref.anchors)
    torch.testing.assert_close(out.embeds, ref.embeds)
    assert torch.equal(out.frame * h * w + out.patch, ref.anchors)
    # frame 2 dropped entirely by an earlier method: the plan runs on frames 0, 1, 3
    present = torch.ones(t * h * w, dtype=torch.bool)
    present[2 * h * w : 3 * h * w] = False
    ctx = context()
    part = plugin.connect(tokens.select(torch.nonzero(present).flatten()), ctx)
    (plan,) = ctx.reports["plan"]
    frames = torch.tensor([0, 1, 3])
    x = embeds.view(t, h * w, 8)[frames]
    ref = outer_merge(x, attn[frames], 0.5, plugin.static_tau(), generator=torch.Generator().manual_seed(0))
    assert torch.equal(plan.anchors, ref.anchors) and 2 not in part.frame.tolist()
    torch.testing.assert_close(part.embeds, ref.embeds)
    assert torch.equal(part.frame, frames[ref.anchors // (h * w)]) and torch.equal(part.patch, ref.anchors % (h * w))
    # one token missing inside frame 1: refused with a message naming the method
    present[h * w + 5] = False
    with pytest.raises(ValueError, match="holitom needs whole frames"):
        plugin.connect(tokens.select(torch.nonzero(present).flatten()), context())
