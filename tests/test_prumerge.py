"""PruMerge / PruMerge+ (`prumerge-plus`): the selection and merge against a transcription of the official
`token_prune_merge_advanced_plus` / `token_prune_merge_advanced` (42Shawn/LLaVA-PruMerge 097c0411,
llava/model/multimodal_encoder/clip_encoder.py) on identical random inputs, the single-head CLS attention recovered
from per-head rows, hand-built frames whose answer is known (a frame whose left half is blank loses its blank tokens
first; the IQR count; the merge sums), counts, and the patched models end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vtc
from tests.conftest import grid_tokens, model_and_processor, single_inputs
from tests.probes import connect_inputs, llm_inputs
from vtc.core.geometry import default_geometry
from vtc.core.tokens import Context
from vtc.core.vision_stats import VisionStat
from vtc_plugins.prumerge import (
    CLIP_LAST_LAYER,
    MergePlan,
    PruMergePlus,
    merge_plan,
    merged_features,
    outlier_ratio,
    select_tokens,
    single_head_cls,
    spatial_grid,
    token_attention,
    vision_stats_for,
)

# --- the official code, transcribed -------------------------------------------------------------------------------
# 42Shawn/LLaVA-PruMerge at 097c0411, llava/model/multimodal_encoder/clip_encoder.py: `complement_idx` (L12),
# `outlier_dectection` (L34), and the bodies of `token_prune_merge_advanced` (L85) / `token_prune_merge_advanced_plus`
# (L174) from the attention on: the hooks and the tower forward are replaced by their outputs (`desired_layer_q/k`,
# `image_features`); `self.device` is the inputs' device; the kept indices `idx` are returned too (for the test).


def complement_idx(idx, dim):
    a = torch.arange(dim, device=idx.device)
    ndim = idx.ndim
    dims = idx.shape
    n_idx = dims[-1]
    dims = dims[:-1] + (-1,)
    for i in range(1, ndim):  # noqa: B007 (official code)
        a = a.unsqueeze(0)
    a = a.expand(*dims)
    masked = torch.scatter(a, -1, idx, 0)
    compl, _ = torch.sort(masked, dim=-1, descending=False)
    compl = compl.permute(-1, *tuple(range(ndim - 1)))
    compl = compl[n_idx:].permute(*(tuple(range(1, ndim)) + (0,)))
    return compl


def outlier_dectection(attn):
    attn_np = attn.to(dtype=torch.float32).cpu().numpy().flatten()

    Q1 = np.percentile(attn_np, 25)
    Q3 = np.percentile(attn_np, 75)
    IQR = Q3 - Q1

    # lower_bound = Q1 - 1.5 * IQR
    upper_bound = Q3 + 1.5 * IQR

    outlier_indices = np.where((attn_np > upper_bound))[0]

    ratio = len(outlier_indices) / len(attn_np)
    return ratio


def official_prune_merge(
    desired_layer_q, desired_layer_k, image_features, plus=True, if_adaptive=True, reduction_ratio=1 / 8
):
    B, N, C = image_features.shape
    device = image_features.device
    attn = (desired_layer_q @ desired_layer_k.transpose(-2, -1)) * C**-0.5
    attn = F.softmax(attn, dim=-1)

    cls_attn = attn[:, 0, 1:]

    if if_adaptive:
        reduction_ratio = outlier_dectection(cls_attn)  # *3.5
    _, idx = torch.topk(cls_attn, int(N * reduction_ratio), dim=1, largest=True)  # [B, left_tokens] , sorted=True

    if plus and if_adaptive:  # token_prune_merge_advanced_plus (the inference branch)
        step_length = int(1 / reduction_ratio)
        arithmetic_sequence = torch.arange(0, 575, int(step_length / 3)).to(device=device)
        original_tensor_1d = idx.flatten().to(device=device)
        filtered_sequence = torch.tensor([x for x in arithmetic_sequence if x not in original_tensor_1d]).to(
            device=device
        )
        concatenated_tensor = torch.cat((idx, filtered_sequence.unsqueeze(0)), dim=1)
        idx = concatenated_tensor

    index = idx.unsqueeze(-1).expand(-1, -1, C)  # [B, left_tokens, C]

    Key_wo_cls = desired_layer_k[:, 1:]  # [B, N-1, C]

    x_others = torch.gather(image_features, dim=1, index=index)  # [B, left_tokens, C]
    x_others_attn = torch.gather(cls_attn, dim=1, index=idx)
    Key_others = torch.gather(Key_wo_cls, dim=1, index=index)  # [B, left_tokens, C]
    compl = complement_idx(idx, N)  # [B, N-1-left_tokens]
    non_topk = torch.gather(
        image_features, dim=1, index=compl.unsqueeze(-1).expand(-1, -1, C)
    )  # [B, N-1-left_tokens, C]
    non_topk_Key = torch.gather(Key_wo_cls, dim=1, index=compl.unsqueeze(-1).expand(-1, -1, C))
    non_topk_attn = torch.gather(cls_attn, dim=1, index=compl)  # [B, N-1-left_tokens]

    Key_others_norm = F.normalize(Key_others, p=2, dim=-1)
    non_topk_Key_norm = F.normalize(non_topk_Key, p=2, dim=-1)

    B, left_tokens, C = x_others.size()
    updated_x_others = torch.zeros_like(x_others)

    for b in range(B):
        for i in range(left_tokens):
            key_others_norm = Key_others_norm[b, i, :].unsqueeze(0).unsqueeze(0)

            before_i_Key = Key_others_norm[b, :i, :].unsqueeze(0)
            after_i_Key = Key_others_norm[b, i + 1 :, :].unsqueeze(0)

            before_i_x_others = x_others[b, :i, :].unsqueeze(0)
            after_i_x_others = x_others[b, i + 1 :, :].unsqueeze(0)
            rest_x_others = torch.cat([before_i_x_others, after_i_x_others, non_topk[b, :, :].unsqueeze(0)], dim=1)
            before_i_x_others_attn = x_others_attn[b, :i].unsqueeze(0)
            after_i_x_others_attn = x_others_attn[b, i + 1 :].unsqueeze(0)
            rest_x_others_attn = torch.cat(
                [before_i_x_others_attn, after_i_x_others_attn, non_topk_attn[b, :].unsqueeze(0)], dim=1
            )

            rest_Keys = torch.cat([before_i_Key, after_i_Key, non_topk_Key_norm[b, :, :].unsqueeze(0)], dim=1)
            cos_sim_matrix = torch.bmm(key_others_norm, rest_Keys.transpose(1, 2))

            _, cluster_indices = torch.topk(cos_sim_matrix, k=int(32), dim=2, largest=True)

            cluster_tokens = rest_x_others[:, cluster_indices.squeeze(), :]
            weights = rest_x_others_attn[:, cluster_indices.squeeze()].unsqueeze(-1)

            # update cluster centers
            weighted_avg = torch.sum(cluster_tokens * weights, dim=1)  # / torch.sum(weights)
            updated_center = x_others[b, i, :] + weighted_avg
            updated_x_others[b, i, :] = updated_center

    extra_one_token = torch.sum(non_topk * non_topk_attn.unsqueeze(-1), dim=1, keepdim=True)  # [B, 1, C]
    updated_x_others = torch.cat([updated_x_others, extra_one_token], dim=1)
    image_features = updated_x_others
    return image_features, idx, cls_attn


def random_layer(seed: int, scale: float, heads: int = 16, width: int = 64):
    """q, k of one CLIP-like layer [1, 577, width] (the logits' spread set by `scale`) and features [1, 576, width]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 577, width, generator=g) * scale
    k = torch.randn(1, 577, width, generator=g)
    return q, k, torch.randn(1, 576, width, generator=g)


# --- against the official code ------------------------------------------------------------------------------------


CASES = [(seed, scale, plus) for seed in range(3) for scale in (1.0, 2.5) for plus in (True, False)]


@pytest.mark.parametrize("seed,scale,plus", CASES)
def test_selection_and_merge_match_the_official_code(seed, scale, plus):
    """12 cases (3 seeds x 2 attention spreads x PruMerge+ / PruMerge): the same kept tokens in the same order and
    the same output features, on identical random q, k and features (576 patches, 32 neighbours, IQR ratio)."""
    q, k, x = random_layer(seed, scale)
    expected, idx, cls_attn = official_prune_merge(q, k, x, plus=plus)
    attention = cls_attn[0]
    kept, important, ratio = select_tokens(attention, None, plus=plus)
    assert ratio == outlier_dectection(cls_attn) and 0 < ratio < 0.5
    assert important == int(576 * ratio) and torch.equal(kept, idx[0])
    plan = merge_plan(attention, k[0, 1:], kept)
    assert plan.remainder and plan.keep.numel() == expected.shape[1]
    torch.testing.assert_close(merged_features(x[0], plan), expected[0])


def test_fixed_ratio_matches_the_official_prumerge():
    """PruMerge with if_adaptive=False (reduction_ratio 1/8: 72 tokens) = `adaptive=False, plus=False`."""
    q, k, x = random_layer(5, 1.5)
    expected, idx, cls_attn = official_prune_merge(q, k, x, plus=False, if_adaptive=False)
    kept, important, _ = select_tokens(cls_attn[0], None, plus=False, ratio=1 / 8)
    assert important == 72 and torch.equal(kept, idx[0])
    torch.testing.assert_close(merged_features(x[0], merge_plan(cls_attn[0], k[0, 1:], kept)), expected[0])


@pytest.mark.parametrize("heads", [1, 4, 16])
def test_single_head_attention_is_recovered_from_per_head_rows(heads):
    """The official single-head, full-width CLS row softmax(q k^T C^-0.5)[0] from the per-head rows vtc captures
    (softmax(q_h k_h^T d^-0.5)[0], what `VisionStat("cls")` holds)."""
    q, k, _ = random_layer(0, 2.0)
    width = q.shape[-1]
    official = torch.softmax((q @ k.transpose(-2, -1)) * width**-0.5, dim=-1)[:, 0]
    d = width // heads
    qh, kh = q.view(1, 577, heads, d).transpose(1, 2), k.view(1, 577, heads, d).transpose(1, 2)
    per_head = torch.softmax((qh @ kh.transpose(-2, -1)) * d**-0.5, dim=-1)[:, :, 0]  # [1, heads, 577]
    torch.testing.assert_close(single_head_cls(per_head), official, rtol=1e-5, atol=1e-7)


def test_outlier_ratio_is_the_official_one():
    for seed in range(5):
        values = torch.rand(576, generator=torch.Generator().manual_seed(seed)) ** 6
        assert outlier_ratio(values) == outlier_dectection(values[None])
    values = torch.tensor([1.0] * 90 + [10.0] * 10)  # Q1 = Q3 = 1, IQR = 0: the ten 10s are the outliers
    assert outlier_ratio(values) == 0.1 and outlier_ratio(values, fence=100.0) == 0.1
    assert outlier_ratio(torch.linspace(0, 1, 100)) == 0.0  # a uniform spread has no outliers


# --- known answers ------------------------------------------------------------------------------------------------


def test_spatial_grid_follows_the_official_stride():
    important = torch.tensor([8, 3, 575])
    grid = spatial_grid(important, 576, 1 / 24)  # step int(24) -> stride int(24 / 3) = 8, up to 574
    assert grid.tolist() == [i for i in range(0, 575, 8) if i != 8]
    assert spatial_grid(important, 576, 0.9).tolist() == [i for i in range(575) if i not in (8, 3)]  # stride >= 1


def test_spikes_are_kept_first_and_the_grid_fills_in():
    attention = torch.full((64,), 0.01)
    attention[[9, 30, 51]] = torch.tensor([0.5, 0.3, 0.2])  # three outliers: ratio 3/64
    kept, important, ratio = select_tokens(attention, None)
    assert ratio == 3 / 64 and important == 3 and kept[:3].tolist() == [9, 30, 51]
    stride = int(int(64 / 3) / 3)  # int(1 / ratio) = 21 -> 7
    assert kept[3:].tolist() == [i for i in range(0, 63, stride) if i not in (9, 30, 51)]
    kept, important, _ = select_tokens(attention, None, plus=False)
    assert kept.tolist() == [9, 30, 51]
    flat = torch.full((16,), 1 / 16)  # no outlier: the official code divides by zero; vtc keeps the top token
    kept, important, ratio = select_tokens(flat, None, plus=False)
    assert ratio == 0.0 and important == 1 and kept.numel() == 1


def test_budget_mode_counts():
    attention = torch.full((64,), 0.01)
    attention[[9, 30, 51]] = torch.tensor([0.5, 0.3, 0.2])
    kept, important, _ = select_tokens(attention, 16)  # 15 slots + the remainder token
    assert kept.numel() == 15 and important == 3 and kept[:3].tolist() == [9, 30, 51]
    rest = [i for i in range(64) if i not in (9, 30, 51)]
    assert kept[3:].tolist() == [rest[(j * 61) // 12] for j in range(12)]  # spread evenly over the others
    assert select_tokens(attention, 2)[0].tolist() == [9]  # one slot + the remainder
    assert select_tokens(attention, 1)[0].tolist() == [9]  # no room for the remainder
    assert select_tokens(attention, 16, remainder=False)[0].numel() == 16
    kept, important, _ = select_tokens(attention, 16, plus=False)  # PruMerge: the budget goes to attention
    assert important == 15 and kept[:3].tolist() == [9, 30, 51]


def test_merge_sums_are_the_official_ones():
    """6 one-hot tokens, keys in two groups: each kept token adds a_j x_j of its 2 nearest keys; the remainder token
    is sum over the pruned tokens of a_j x_j, sitting at the pruned token of highest attention."""
    x = torch.eye(6)
    keys = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.8, 0.2], [0.0, 1.0], [0.1, 0.9], [0.2, 0.8]])
    a = torch.tensor([0.3, 0.05, 0.1, 0.25, 0.2, 0.1])
    plan = merge_plan(a, keys, torch.tensor([0, 3]), neighbors=2)
    assert plan.keep.tolist() == [0, 3, 4] and plan.remainder  # 4: the pruned token of highest attention
    out = merged_features(x, plan)
    torch.testing.assert_close(out[0], torch.tensor([1.0, 0.05, 0.1, 0, 0, 0]))  # x0 + a1 x1 + a2 x2
    torch.testing.assert_close(out[1], torch.tensor([0, 0, 0, 1.0, 0.2, 0.1]))  # x3 + a4 x4 + a5 x5
    torch.testing.assert_close(out[2], torch.tensor([0, 0.05, 0.1, 0, 0.2, 0.1]))  # sum over pruned 1, 2, 4, 5
    assert merge_plan(a, keys, torch.tensor([0, 3]), neighbors=2, remainder=False).keep.tolist() == [0, 3]
    small = merge_plan(a[:3], keys[:3], torch.tensor([0]))  # fewer tokens than neighbours: all the others
    torch.testing.assert_close(merged_features(x[:3, :3], small)[0], torch.tensor([1.0, 0.05, 0.1]))


def test_blank_half_loses_its_tokens_first():
    """An 8 x 8 frame whose left half is blank: the CLS query attends to the content (right half), and the blank
    tokens share one key, orthogonal to the content keys. PruMerge (attention only) keeps right-half tokens only, at
    any budget and with the adaptive count; the kept tokens absorb content neighbours, and the blank half goes whole
    into the remainder token."""
    blank = (torch.arange(64) % 8) < 4
    g = torch.Generator().manual_seed(0)
    attention = torch.where(blank, torch.full((64,), 1e-4), torch.rand(64, generator=g) ** 4 + 0.01)
    attention = attention / attention.sum()
    keys = torch.zeros(64, 16)
    keys[~blank, :8] = torch.rand(32, 8, generator=g) + 0.1  # content keys: positive, pairwise similar
    keys[blank, 15] = 1.0  # one blank key, orthogonal to them
    for budget in (8, 16, 33):
        kept, _, _ = select_tokens(attention, budget, plus=False)
        assert not bool(blank[kept].any()) and kept.numel() == budget - 1
    kept, _, _ = select_tokens(attention, None, plus=False)  # adaptive: the outliers are content tokens
    assert not bool(blank[kept].any()) and 0 < kept.numel() < 32
    kept, _, _ = select_tokens(attention, 16, plus=False)
    plan = merge_plan(attention, keys, kept, neighbors=4)
    assert not bool(blank[plan.keep].any())  # the remainder's anchor is a content token too
    assert not bool((plan.weights[:-1, blank] > 0).any())  # kept rows draw on content tokens only
    assert bool((plan.weights[-1, blank] > 0).all())  # every blank token feeds the remainder token


# --- what each tower gives ----------------------------------------------------------------------------------------


def test_attention_by_tower():
    clip, siglip, qwen = (default_geometry(f) for f in ("llava_next_video", "llava_onevision", "qwen2_vl"))
    assert vision_stats_for(clip) == [VisionStat("cls", CLIP_LAST_LAYER), VisionStat("keys", CLIP_LAST_LAYER)]
    assert vision_stats_for(siglip) == vision_stats_for(qwen) == [VisionStat("received", -1), VisionStat("keys", -1)]
    assert vision_stats_for(clip, -1) == [VisionStat("cls", -1), VisionStat("keys", -1)]
    g = torch.Generator().manual_seed(0)
    rows = torch.softmax(torch.randn(2, 4, 577, generator=g), dim=-1)
    joint = single_head_cls(rows)
    blocks = joint[:, 1:].reshape(2, 12, 2, 12, 2).sum(dim=(2, 4)).reshape(2, 144)  # each 2 x 2 block's sum
    torch.testing.assert_close(token_attention(rows, clip, (12, 12)), blocks)
    received = torch.rand(2, 729, generator=g) * 729
    out = token_attention(received, siglip, (14, 14))
    torch.testing.assert_close(out.sum(dim=-1), torch.ones(2))  # a distribution over the frame's tokens
    pooled = F.interpolate(received.reshape(2, 1, 27, 27), size=[14, 14], mode="bilinear").reshape(2, 196)
    torch.testing.assert_close(out, pooled / pooled.sum(dim=-1, keepdim=True))
    torch.testing.assert_close(
        token_attention(received[:, :144], qwen, (12, 12)), received[:, :144] / received[:, :144].sum(-1, keepdim=True)
    )


# --- the plugin ---------------------------------------------------------------------------------------------------


def test_defaults_counts_and_card():
    p = PruMergePlus()
    assert p.plus and p.adaptive and p.reduction_ratio == 1 / 8 and p.iqr_fence == 1.5 and p.stride_divisor == 3
    assert p.neighbors == 32 and p.remainder_token and p.attention_layer is None and p.tokens_per_frame is None
    assert p.bind(None).retained_count(8 * 196, (8, 14, 14), "llava_onevision") is None  # the official IQR count
    assert p.bind(0.25).retained_count(8 * 196, (8, 14, 14), "llava_onevision") == 8 * 49
    assert p.bind(0.25).retained_count(100, (8, 14, 14), "llava_onevision") is None  # thinned by an earlier method
    assert PruMergePlus(tokens_per_frame=32).bind(None).retained_count(4 * 144, (4, 12, 12), "qwen2_vl") == 128
    assert p.bind(1.0).retained_count(4 * 144, (4, 12, 12), "qwen2_vl") == 4 * 144
    card = vtc.registry()["prumerge-plus"].card
    assert card.stages == ("connect",) and card.positions == "compact" and card.vision_stats and card.prepool
    assert set(card.families) >= {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision", "llava_next_video"}
    assert set(PruMergePlus.testing.exemptions) == {"ordered_positions"}


def test_bad_params_name_the_problem():
    with pytest.raises(ValueError, match=r"prumerge-plus: reduction_ratio must be in \(0, 1\], got 0"):
        PruMergePlus(reduction_ratio=0)
    with pytest.raises(ValueError, match=r"prumerge-plus: neighbors must be in \[1, inf\), got 0"):
        PruMergePlus(neighbors=0)
    with pytest.raises(ValueError, match=r"prumerge-plus: stride_divisor must be in \[1, inf\)"):
        PruMergePlus(stride_divisor=0)
    with pytest.raises(ValueError, match="prumerge-plus: plus must be bool"):
        PruMergePlus(plus=1)
    with pytest.raises(ValueError, match="resolves to encoder layer 23"):  # the tiny CLIP tower has 2 layers
        vtc.patch(model_and_processor("llava_next_video")[0], "prumerge-plus", retention=0.25)


def _context(grid, seed=0):
    t, h, w = grid
    g = torch.Generator().manual_seed(seed)
    vision = {
        VisionStat("received", -1): torch.rand(t, h * w, generator=g) ** 4,
        VisionStat("keys", -1): torch.randn(t, h * w, 4, generator=g),
    }
    return Context(family="qwen2_vl", geometry=default_geometry("qwen2_vl"), vision=vision), vision


@pytest.mark.parametrize("mrope", [False, True])
def test_connect_per_frame_order_features_and_weights(mrope):
    grid = (3, 6, 6)
    embeds = torch.randn(108, 8, generator=torch.Generator().manual_seed(1))
    tokens = grid_tokens(embeds, grid, mrope)
    ctx, vision = _context(grid)
    out = PruMergePlus(neighbors=4).bind(0.25).connect(tokens, ctx)
    assert len(out) == 3 * 9 and float(out.weight.sum()) == 108  # every token counted once
    expected, kept = [], []
    for f in range(3):
        a = vision[VisionStat("received", -1)][f]
        a = a / a.sum()
        sel, _, _ = select_tokens(a, 9)
        plan = merge_plan(a, vision[VisionStat("keys", -1)][f], sel, neighbors=4)
        if mrope:
            order = torch.argsort(plan.keep)
            plan = MergePlan(plan.keep[order], plan.keep_weight[order], plan.weights[order], plan.remainder)
        expected.append(merged_features(embeds[36 * f : 36 * (f + 1)], plan))
        kept.append(36 * f + plan.keep)
    kept = torch.cat(kept)
    torch.testing.assert_close(out.embeds, torch.cat(expected))
    assert torch.equal(out.positions, tokens.positions[..., kept])
    if mrope:  # Qwen: original order, the remainder at its anchor's cell
        assert bool((kept[1:] > kept[:-1]).all())
    assert PruMergePlus().bind(1.0).connect(tokens, ctx) is tokens
    adaptive = PruMergePlus(neighbors=4).bind(None)
    out = adaptive.connect(tokens, ctx)
    counts = [select_tokens(vision[VisionStat("received", -1)][f], None)[0].numel() + 1 for f in range(3)]
    assert len(out) == sum(counts)  # the official, content-dependent count (+ the remainder per frame)


# --- the patched models -------------------------------------------------------------------------------------------


def _video_start(model, inputs) -> int:
    video = inputs["input_ids"][0] == vtc.api.resolve_adapter(model).video_token_id
    return int(torch.nonzero(video)[0])


def test_patched_llava_next_video_merges_clip_features_before_the_projector():
    """LLaVA-NeXT-Video: the LLM receives projector(pool(B_i + sum_j a_j B_j)) for the official selection on the
    model's own CLS attention (single-head, recovered from its per-head rows) and keys, in the official order."""
    family = "llava_next_video"
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    plugin = PruMergePlus(attention_layer=-1).bind(0.25)
    tokens, ctx = connect_inputs(model, inputs, plugin.vision_stats(family), prepool=True)
    t, h, w = tokens.grid
    cls, keys = ctx.vision[VisionStat("cls", -1)], ctx.vision[VisionStat("keys", -1)]
    attention = token_attention(cls, ctx.geometry, (h, w))
    keys = ctx.geometry.to_token_grid(keys.float(), (h, w))
    blocks = ctx.prepool.reshape(t, h, 2, w, 2, -1).permute(0, 1, 3, 2, 4, 5).reshape(t, h * w, 2, 2, -1)
    budget = round(0.25 * h * w)
    expected = []
    for f in range(t):
        kept, _, _ = select_tokens(attention[f], budget)
        plan = merge_plan(attention[f], keys[f], kept)
        with torch.no_grad():
            expected.append(ctx.pool(merged_features(blocks[f], plan)).reshape(budget, -1))
    expected = torch.cat(expected)
    out, positions, handle = llm_inputs(model, inputs, "prumerge-plus", retention=0.25, attention_layer=-1)
    start = _video_start(model, inputs)
    assert handle.stats().visual_tokens_out == t * budget
    torch.testing.assert_close(out[start : start + t * budget], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(positions.flatten(), torch.arange(out.shape[0]))  # renumbered, as LLaVA builds them


def test_patched_qwen2_5_vl_adaptive_count_positions_and_order():
    """Without a retention: the official IQR count per frame (reported), M-RoPE positions of the anchors, in order."""
    family = "qwen2_5_vl"
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    plugin = PruMergePlus().bind(None)
    tokens, ctx = connect_inputs(model, inputs, plugin.vision_stats(family))
    t, h, w = tokens.grid
    attention = token_attention(ctx.vision[VisionStat("received", -1)], ctx.geometry, (h, w))
    counts = [select_tokens(attention[f], None)[0].numel() + 1 for f in range(t)]
    _, reference, _ = llm_inputs(model, inputs)
    out, positions, handle = llm_inputs(model, inputs, "prumerge-plus")
    stats = handle.stats()
    assert stats.reports["prumerge-plus"]["frame_counts"] == [counts]
    assert stats.visual_tokens_out == sum(counts) < t * h * w
    start = _video_start(model, inputs)
    kept = positions[:, :, start : start + sum(counts)]
    original = reference[:, :, start : start + t * h * w]
    cells = [int(torch.nonzero((original[0] == kept[0, :, j : j + 1]).all(0))[0]) for j in range(sum(counts))]
    assert cells == sorted(cells)  # original positions, in their original order
    assert handle.retained_count((t, h, w)) is None


def test_retention_one_is_the_unpatched_model():
    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    with torch.no_grad():
        reference = model(**inputs).logits
        with vtc.patch(model, "prumerge-plus", retention=1.0):
            assert torch.equal(model(**inputs).logits, reference)
