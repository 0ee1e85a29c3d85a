"""AOT: anchors per window on hand-built attention maps, the intra-frame OT update (plan marginals, the 0.1/0.9
blend), the pooled-mask rule, the time cost, the inter-frame clip order and counts, the retention mapping and
fixed-count mode; the pure functions and the whole connect hook against a loop re-derivation of the official
`encode_images_siglip_OTA` -> `get_2dPool` / `get_2dPool_index` -> `temporal_ota_merge` path; the patched
models end to end."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vtc
from tests.conftest import batch_inputs, grid_tokens, model_and_processor, single_inputs
from vtc.core.geometry import default_geometry
from vtc.core.tokens import Context
from vtc.core.vision_stats import VisionStat
from vtc_plugins.aot import (
    AOT,
    SIGLIP_TOKENS,
    Block,
    anchor_budget,
    anchors_on_grid,
    block_plan,
    clip_segments,
    fixed_total,
    frame_count_for,
    grid_coords,
    intra_ot_merge,
    ota_merge_time,
    residual_count,
    select_anchors,
    temporal_merge,
    time_cost,
    visual_token_num_for,
    window_bounds,
)

SHALLOW, DEEP = VisionStat("received", 5), VisionStat("received", -2)
# the tiny test towers have 2 layers: AOT's official shallow layer 5 does not exist there
TINY = vtc.registry()["aot"].testing.params
TINY_SHALLOW = VisionStat("received", TINY["shallow_layer"])


# --- a loop re-derivation of the official code (llava_arch.py) ------------------------------------------------------


def ref_sinkhorn(kernel, u, v, max_iter=100, thresh=1e-2):
    """`Sinkhorn_v1` on a batch [B, M, N]."""
    r, c = torch.ones_like(u), torch.ones_like(v)
    for _ in range(max_iter):
        r0 = r
        r = u / torch.matmul(kernel, c.unsqueeze(-1)).squeeze(-1)
        c = v / torch.matmul(kernel.permute(0, 2, 1), r.unsqueeze(-1)).squeeze(-1)
        if (r - r0).abs().mean().item() < thresh:
            break
    return torch.matmul(r.unsqueeze(-1), c.unsqueeze(-2)) * kernel


def ref_window_selection(attn, total, side=27, window=9):
    """`window_cls_selection_siglip`: top `total // windows` per window, as global indices."""
    per = total // ((side // window) ** 2)
    out = []
    for b in range(attn.shape[0]):
        grid = attn[b].view(side, side)
        picks = []
        for i in range(side // window):
            for j in range(side // window):
                flat = grid[i * window : (i + 1) * window, j * window : (j + 1) * window].reshape(-1)
                for idx in torch.topk(flat, per).indices.tolist():
                    dy, dx = divmod(idx, window)
                    picks.append((i * window + dy) * side + j * window + dx)
        out.append(picks)
    return torch.tensor(out, dtype=torch.long).view(attn.shape[0], -1)


def ref_index_mask(shallow, deep, v, global_ratio=0.5):
    """The anchor mask of `encode_images_siglip_OTA`."""
    local = ref_window_selection(shallow, int(v * (1 - global_ratio)))
    deep = deep.clone()
    for b in range(deep.shape[0]):
        deep[b, local[b]] = 0
    glob = torch.topk(deep, k=v - int(v * (1 - global_ratio)), dim=1)[1]
    mask = torch.zeros(shallow.shape, dtype=torch.bool)
    mask.scatter_(1, torch.cat((local, glob), dim=1), True)
    return mask


def ref_token_merging_ota(x, mask, side=27):
    """`token_merging_siglip_with_OTA` (scale 1.0), nearest-neighbour part token by token."""
    x = x.clone()
    b_, _, d = x.shape
    yy, xx = torch.meshgrid(
        torch.linspace(0, 1, side, dtype=x.dtype), torch.linspace(0, 1, side, dtype=x.dtype), indexing="ij"
    )
    pos = torch.stack([xx, yy], dim=-1).view(-1, 2)
    kept = torch.stack([x[b][mask[b]] for b in range(b_)])
    rest = torch.stack([x[b][~mask[b]] for b in range(b_)])
    spat = torch.cdist(
        torch.stack([pos[~mask[b]] for b in range(b_)]), torch.stack([pos[mask[b]] for b in range(b_)]), p=2
    )
    cos = F.cosine_similarity(rest.unsqueeze(2), kept.unsqueeze(1), dim=3)
    m, n = rest.shape[1], kept.shape[1]
    u, v = torch.full((1, m), 1 / m, dtype=cos.dtype), torch.full((1, n), 1 / n, dtype=cos.dtype)
    plan = ref_sinkhorn(torch.exp(-((1.0 - cos) + 0.5 * spat) / 0.1), u, v)
    plan = plan.to(x.dtype)
    agg = torch.einsum("bmn,bmd->bnd", plan, rest)
    load = plan.sum(dim=1).unsqueeze(-1).clamp_min(1e-9)
    ota = (kept + agg) / (1.0 + load)
    nn = kept.clone()
    count = torch.zeros(b_, n)
    for b in range(b_):
        for i in range(m):
            j = int(cos[b, i].argmax())
            nn[b, j] += rest[b, i]
            count[b, j] += 1
    nn = nn / (1.0 + count.unsqueeze(-1)).to(x.dtype)
    merged = nn * 0.1 + ota * 0.9
    for b in range(b_):
        x[b, mask[b]] = merged[b]
    return x, plan


def ref_pool(x, side=27):
    """`get_2dPool` (bilinear): [B, side*side, D] -> [B, ceil(side/2)^2, D]."""
    b_, _, d = x.shape
    g = x.view(b_, side, side, d).permute(0, 3, 1, 2)
    out = F.interpolate(g, size=[math.ceil(side / 2)] * 2, mode="bilinear")
    return out.permute(0, 2, 3, 1).reshape(b_, -1, d)


def ref_ota_time(anchors, sources, dt, keep_ratio, sigma_t=1.5, scale=1.0):
    """`ota_merge_N_to_M_time` with B = 1."""
    xn, yn = F.normalize(sources, dim=-1), F.normalize(anchors, dim=-1)
    cos = torch.bmm(xn, yn.transpose(1, 2)).clamp(-1 + 1e-6, 1 - 1e-6)
    c_sim = 1.0 - cos
    c_sim = c_sim - c_sim.amin(dim=(1, 2), keepdim=True)
    a_ts = torch.zeros(1, anchors.shape[1], dtype=anchors.dtype)
    s_ts = torch.ones(1, sources.shape[1], dtype=anchors.dtype) * dt
    gap = (s_ts.unsqueeze(-1) - a_ts.unsqueeze(1)).abs()
    c_time = 1.0 - torch.exp(-(gap * gap) / (2.0 * sigma_t**2 + 1e-9))
    kernel = torch.exp(-(c_sim * c_time) / 0.1)
    n, m = sources.shape[1], anchors.shape[1]
    plan = ref_sinkhorn(
        kernel, torch.full((1, n), 1.0 / n, dtype=kernel.dtype), torch.full((1, m), 1.0 / m, dtype=kernel.dtype)
    )
    p_row = plan / plan.sum(dim=2, keepdim=True).clamp_min(1e-9)
    pmax = p_row.max(dim=2).values
    keep = pmax < torch.quantile(pmax.double(), keep_ratio, dim=1, keepdim=True)
    sel = p_row * (~keep).unsqueeze(-1)
    new = (anchors + scale * torch.bmm(sel.transpose(1, 2), sources)) / (1.0 + scale * sel.sum(dim=1).unsqueeze(-1))
    return new, keep


def ref_temporal(pooled, pooled_mask, interval, keep_ratio):
    """`temporal_ota_merge` over the frames of one video (fixed clips)."""
    tokens = []
    for a in range(0, pooled.shape[0], interval):
        orig = pooled[a][pooled_mask[a]].unsqueeze(0).clone()
        cur = orig.clone()
        tokens.append(orig[0])
        if interval == 1:
            continue
        for inner in range(1, interval):
            x = pooled[a + inner][pooled_mask[a + inner]].unsqueeze(0).clone()
            cur, keep = ref_ota_time(cur, x, inner, keep_ratio)
            tokens.append(x[0][keep[0]])
        tokens.append(cur[0])
    return torch.cat(tokens)


def ref_aot_onevision(grid, shallow, deep, v=126, keep_ratio=0.3, interval=4):
    """The whole official LLaVA-OV video path: grid [F, 27, 27, D] projected features -> LLM tokens."""
    frames, side, _, d = grid.shape
    x = grid.reshape(frames, side * side, d)
    mask = ref_index_mask(shallow, deep, v)
    merged, _ = ref_token_merging_ota(x, mask)
    pooled = ref_pool(merged)
    pooled_mask = (ref_pool(mask.float().unsqueeze(-1)) >= 0.5).squeeze(-1)
    return ref_temporal(pooled, pooled_mask, interval, keep_ratio), pooled_mask


# --- helpers --------------------------------------------------------------------------------------------------------


def bilinear_pool(grid):
    x = grid.permute(0, 3, 1, 2)
    size = [math.ceil(x.shape[2] / 2), math.ceil(x.shape[3] / 2)]
    return F.interpolate(x, size=size, mode="bilinear").permute(0, 2, 3, 1)


def onevision_video(frames=32, dim=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1, 27, 27, dim, generator=g, dtype=dtype)
    drift = torch.randn(frames, 27, 27, dim, generator=g, dtype=dtype)
    grid = base + 0.5 * drift  # correlated frames, as a video
    shallow = torch.rand(frames, 729, generator=g, dtype=dtype) + 0.5
    deep = torch.rand(frames, 729, generator=g, dtype=dtype) + 0.5
    return grid, shallow, deep


def onevision_context(grid, shallow, deep):
    return Context(
        family="llava_onevision",
        geometry=default_geometry("llava_onevision"),
        prepool=grid,
        pool=bilinear_pool,
        vision={SHALLOW: shallow, DEEP: deep},
    )


# --- defaults and budgets -------------------------------------------------------------------------------------------


def test_defaults_match_the_official_scripts():
    p = AOT()
    assert (p.global_ratio, p.inter_scale, p.intra_scale) == (0.5, 1.0, 1.0)
    assert (p.epsilon, p.max_iter, p.tol, p.spatial_weight, p.nn_weight, p.sigma_t) == (0.1, 100, 1e-2, 0.5, 0.1, 1.5)
    assert (p.shallow_layer, p.deep_layer, p.windows) == (5, -2, 3)
    assert not p.fixed_count and p.compute_dtype is None
    plugin = p
    # eval_ov-7b.sh, MVBench / EgoSchema: 32 frames -> clips of 4, 64 -> clips of 8
    assert plugin.budget((32, 14, 14), "llava_onevision") == (126, 0.3, 4, True)
    assert plugin.budget((64, 14, 14), "llava_onevision") == (126, 0.3, 8, True)
    assert AOT(setting="videomme").budget((32, 14, 14), "llava_onevision") == (108, 0.1, 4, True)
    # eval_vid-7b.sh: inter off, 180 (the pooling-before-projector family runs without the inter-frame step)
    assert plugin.budget((64, 12, 12), "llava_next_video") == (180, 0.3, 8, False)
    assert plugin.vision_stats("qwen2_vl") == [SHALLOW, DEEP]
    for bad in ({"visual_token_num": 0}, {"keep_ratio": 1.5}, {"setting": "x"}, {"clip_frames": 0}, {"epsilon": 0}):
        with pytest.raises(ValueError, match="aot"):
            AOT(**bad)


def test_method_card_declares_the_capabilities():
    cls = vtc.registry()["aot"]
    info = cls.card
    assert cls is AOT and info.stages == ("connect",) and info.reduces_tokens
    assert info.fixed_count and info.fixed_count_mode == "optional"
    assert info.vision_stats and info.prepool  # attention maps + LLaVA's pre-pool 27 x 27 grid
    assert not info.whole_frames and not info.during_decode and not info.query_aware
    assert info.positions == "compact" and info.retention_reference == "llm_input"
    assert info.retention_granularity == 9 and "window" in info.retention_note
    assert set(cls.testing.exemptions) == {"retention", "ordered_positions"}
    assert cls.testing.params == {"shallow_layer": 1}
    # the method object offers exactly the declared capabilities, and no legacy attributes
    plugin = AOT().bind(0.2)
    assert callable(plugin.retained_count) and callable(plugin.vision_stats)
    assert not hasattr(plugin, "needs_prepool") and not hasattr(plugin, "last_kept")


def test_anchor_budgets():
    assert anchor_budget(126, 0.5) == (7, 63)  # 63 local = 7 per window, 63 global
    assert anchor_budget(108, 0.5) == (6, 54)
    assert anchor_budget(180, 0.5) == (10, 90)
    assert anchor_budget(100, 0.5) == (5, 50)  # int(50) // 9 = 5: 45 local + 50 global = 95 anchors
    assert anchors_on_grid(126, 0.5, 27, 27) == 126 and anchors_on_grid(100, 0.5, 27, 27) == 95
    assert window_bounds(27) == [(0, 9), (9, 18), (18, 27)]
    assert window_bounds(24) == [(0, 8), (8, 16), (16, 24)]
    assert window_bounds(7) == [(0, 2), (2, 4), (4, 7)]
    assert anchors_on_grid(60, 0.5, 3, 3) == 9  # windows of one cell give what they have


def test_frame_count_for():
    # LLaVA (pre-pool 27 x 27 grid): the anchors' share of the 729 patches, on the token grid
    assert frame_count_for(126, 14, 14, True) == round(126 / 729 * 196) == 34
    assert frame_count_for(100, 14, 14, True) == round(95 / 729 * 196)
    assert frame_count_for(729, 14, 14, True) == 196 and frame_count_for(1, 14, 14, True) == 1
    # Qwen (no pre-pool grid): the anchors picked on the token grid itself, V scaled to its size
    vg = round(243 * 6 * 9 / 729)
    assert frame_count_for(243, 6, 9, False) == anchors_on_grid(vg, 0.5, 6, 9)
    assert frame_count_for(729, 6, 9, False) == 54
    # monotone in V (the retention rule searches a monotone sequence)
    for prepool, (h, w) in ((True, (14, 14)), (True, (12, 12)), (False, (6, 9)), (False, (14, 14))):
        counts = [frame_count_for(v, h, w, prepool) for v in range(1, SIGLIP_TOKENS + 1)]
        assert counts == sorted(counts) and counts[-1] == h * w


RULE_CASES = [
    # (grid, keep_ratio, clip, inter, prepool_grid)
    ((32, 14, 14), 0.3, 4, True, True),  # LLaVA-OV, eval_ov-7b.sh MVBench setting
    ((32, 14, 14), 0.1, 4, True, True),  # ... Video-MME setting
    ((16, 12, 12), 0.3, 2, False, True),  # LLaVA-NeXT-Video, no inter-frame step
    ((8, 6, 9), 0.3, 1, True, False),  # Qwen token grid, one-frame clips
    ((8, 14, 14), 0.5, 2, True, False),
    ((10, 7, 7), 0.3, 4, True, False),  # a short last clip
]


def _rule_total(v, grid, keep, clip, inter, prepool):
    t, h, w = grid
    return fixed_total(frame_count_for(v, h, w, prepool), t, clip, keep, inter)


@pytest.mark.parametrize("grid,keep,clip,inter,prepool", RULE_CASES)
def test_retention_rule_minimises_the_miss(grid, keep, clip, inter, prepool):
    """visual_token_num_for returns the V whose fixed-count total is closest to round(r N), smaller V on ties
    (brute force over every V), and that total is within one 3 x 3-window step per frame of r N."""
    t, h, w = grid
    n = t * h * w
    totals = {v: _rule_total(v, grid, keep, clip, inter, prepool) for v in range(1, SIGLIP_TOKENS + 1)}
    steps = [totals[v + 1] - totals[v] for v in range(1, SIGLIP_TOKENS)]
    assert min(steps) >= 0  # the totals are monotone in V
    granularity = vtc.registry()["aot"].card.retention_granularity
    for r in (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.5):
        v = visual_token_num_for(r, grid, keep, clip, inter, prepool)
        target = round(r * n)
        miss = abs(totals[v] - target)
        best = min(abs(x - target) for x in totals.values())
        assert miss == best
        assert v == min(u for u, x in totals.items() if abs(x - target) == best)  # ties: the smaller V
        if totals[1] <= target <= totals[SIGLIP_TOKENS]:  # reachable: the nearest step of a monotone sequence
            assert miss <= max(steps) / 2
            assert miss <= granularity * t  # one window step per frame
    # retention 1.0 without the inter-frame step: every token of every frame
    full = visual_token_num_for(1.0, grid, keep, clip, False, prepool)
    assert frame_count_for(full, h, w, prepool) == h * w and _rule_total(full, grid, keep, clip, False, prepool) == n


def test_retention_mapping_feeds_the_budget_and_the_fixed_count():
    v = visual_token_num_for(0.2, (32, 14, 14), 0.3, 4, True, True)
    assert AOT().bind(0.2).budget((32, 14, 14), "llava_onevision") == (v, 0.3, 4, True)
    # the same retention on a Qwen grid searches the token-grid anchor counts instead
    vq = visual_token_num_for(0.2, (8, 6, 9), 0.3, 1, True, False)
    assert AOT().bind(0.2).budget((8, 6, 9), "qwen2_vl") == (vq, 0.3, 1, True)
    # the inter-frame step keeps more per frame than without it at the same retention
    assert v > visual_token_num_for(0.2, (32, 14, 14), 0.3, 4, False, True)
    # explicit parameters win over the retention; without a retention the script settings apply
    explicit = AOT(visual_token_num=90, keep_ratio=0.2).bind(0.2)
    assert explicit.budget((32, 6, 9), "qwen2_vl") == (90, 0.2, 4, True)
    no_inter = AOT(clip_frames=2, inter_compress=False)
    assert no_inter.budget((32, 6, 9), "qwen2_vl") == (180, 0.3, 2, False)
    assert AOT(clip_frames=1).budget((32, 6, 9), "qwen2_vl") == (180, 0.3, 1, True)  # no inter step
    # fixed-count mode: retained_count is the rule's total, within one window step per frame of r N
    cases = (("llava_onevision", (32, 14, 14)), ("llava_next_video", (16, 12, 12)), ("qwen2_vl", (8, 6, 9)))
    for family, grid in cases:
        t, h, w = grid
        prepool = default_geometry(family).has_prepool_grid
        for r in (0.1, 0.25, 0.5):
            plugin = AOT(fixed_count=True).bind(r)
            vr, keep, clip, inter = plugin.budget(grid, family)
            count = plugin.retained_count(t * h * w, grid, family)
            assert count == _rule_total(vr, grid, keep, clip, inter, prepool)
            assert abs(count - r * t * h * w) <= 9 * t
            # an input an earlier method thinned: the count depends on what is left, no promise
            assert plugin.retained_count(t * h * w - 1, grid, family) is None


def test_retention_one_returns_the_input_tokens():
    grid, shallow, deep = onevision_video(frames=8, dim=8)
    tokens = grid_tokens(bilinear_pool(grid).reshape(-1, 8), (8, 14, 14))
    plugin = AOT().bind(1.0)
    ctx = onevision_context(grid, shallow, deep)
    assert plugin.connect(tokens, ctx) is tokens
    assert ctx.reports == {}  # nothing decided: no budget reported
    assert plugin.retained_count(1568, (8, 14, 14), "llava_onevision") == 1568
    assert plugin.retained_count(1000, (8, 14, 14), "llava_onevision") == 1000  # keeps whatever it gets
    assert AOT().bind(0.3).retained_count(1568, (8, 14, 14), "llava_onevision") is None  # adaptive by default


# --- intra-frame --------------------------------------------------------------------------------------------------


def test_anchor_selection_per_window_on_a_synthetic_map():
    shallow = torch.zeros(1, 729)
    deep = torch.zeros(1, 729)
    # window (1, 2) (rows 9-17, cols 18-26): the two cells with the highest shallow attention
    shallow[0, 10 * 27 + 20] = 5.0
    shallow[0, 16 * 27 + 25] = 4.0
    shallow[0, 12 * 27 + 19] = 3.0
    # the deep map prefers a local pick (must be skipped) and then two other cells
    deep[0, 10 * 27 + 20] = 9.0
    deep[0, 0] = 8.0
    deep[0, 26 * 27 + 26] = 7.0
    deep[0, 5] = 1.0
    # distinct small noise elsewhere, none on the cells the deep map should reach, so no window picks them locally
    noise = torch.rand(1, 729, generator=torch.Generator().manual_seed(0)) * 1e-3 + 1e-4
    noise[0, [0, 5, 26 * 27 + 26]] = 0.0
    mask = select_anchors(shallow + noise, deep, 27, 27, per_window=2, num_global=2)
    picked = set(torch.nonzero(mask[0]).flatten().tolist())
    assert {10 * 27 + 20, 16 * 27 + 25} <= picked and 12 * 27 + 19 not in picked
    assert {0, 26 * 27 + 26} <= picked and 5 not in picked
    assert len(picked) == 9 * 2 + 2
    for r0, r1 in window_bounds(27):  # exactly two anchors in every window besides the global ones
        for c0, c1 in window_bounds(27):
            window = mask[0].view(27, 27)[r0:r1, c0:c1]
            assert int(window.sum()) - int(r0 == 0 and c0 == 0) - int(r1 == 27 and c1 == 27) == 2


@pytest.mark.parametrize("seed,v", [(0, 126), (1, 108), (2, 180), (3, 100)])
def test_anchor_mask_matches_the_official_selection(seed, v):
    g = torch.Generator().manual_seed(seed)
    shallow, deep = torch.rand(4, 729, generator=g), torch.rand(4, 729, generator=g)
    per_window, num_global = anchor_budget(v, 0.5)
    mask = select_anchors(shallow, deep, 27, 27, per_window, num_global)
    assert torch.equal(mask, ref_index_mask(shallow, deep, v))
    assert (mask.sum(1) == anchors_on_grid(v, 0.5, 27, 27)).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_intra_ot_merge_matches_the_official_merge(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 729, 12, generator=g, dtype=torch.float64)
    shallow, deep = torch.rand(3, 729, generator=g), torch.rand(3, 729, generator=g)
    mask = select_anchors(shallow, deep, 27, 27, *anchor_budget(126, 0.5))
    merge = intra_ot_merge(x, mask, grid_coords(27, 27))
    ref, ref_plan = ref_token_merging_ota(x, mask)
    torch.testing.assert_close(merge.features, ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(merge.plan, ref_plan, rtol=1e-5, atol=1e-12)
    # `Sinkhorn_v1` updates c last: every anchor receives exactly 1/N (so the OT load is 1/N); the rows carry
    # the source mass 1/M once the iteration has converged (the official stop, mean |dr| < 1e-2, is looser)
    m, n = 729 - 126, 126
    assert merge.plan.shape == (3, m, n)
    torch.testing.assert_close(merge.plan.sum(1), torch.full((3, n), 1 / n, dtype=torch.float64))
    torch.testing.assert_close(merge.load, torch.full((3, n), 1 / n, dtype=torch.float64))
    converged = intra_ot_merge(x[:1], mask[:1], grid_coords(27, 27), tol=1e-9, max_iter=5000)
    torch.testing.assert_close(converged.plan.sum(-1), torch.full((1, m), 1 / m, dtype=torch.float64))
    torch.testing.assert_close(converged.plan.sum((1, 2)), torch.ones(1, dtype=torch.float64))
    # non-anchors stay as they were; anchors = a * x_n + W x_others (the linear form of the update)
    assert torch.equal(merge.features[~mask], x[~mask])
    a, w = merge.coefficients()
    anchors = torch.gather(x, 1, merge.anchors[..., None].expand(-1, -1, 12))
    others = torch.gather(x, 1, merge.others[..., None].expand(-1, -1, 12))
    rebuilt = a[..., None].double() * anchors + w.double() @ others
    torch.testing.assert_close(rebuilt, torch.gather(merge.features, 1, merge.anchors[..., None].expand(-1, -1, 12)))


def test_intra_update_by_hand():
    """Two anchors, two other tokens on a 2x2 grid: the OT + nearest-neighbour blend computed by hand."""
    x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.2], [0.1, 1.0]]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False, False]])
    merge = intra_ot_merge(x, mask, grid_coords(2, 2, dtype=torch.float64))
    plan = merge.plan[0]
    torch.testing.assert_close(plan.sum(0), torch.full((2,), 0.5, dtype=torch.float64))
    torch.testing.assert_close(plan.sum(1), torch.full((2,), 0.5, dtype=torch.float64), rtol=1e-3, atol=1e-3)
    assert merge.nearest[0].tolist() == [0, 1] and merge.count[0].tolist() == [1, 1]
    y, src = x[0, :2], x[0, 2:]
    ota = (y + plan.T @ src) / (1 + plan.sum(0))[:, None]
    nn = (y + src) / 2
    torch.testing.assert_close(merge.features[0, :2], 0.1 * nn + 0.9 * ota)


def test_pooled_mask_rule():
    # bilinear 27 -> 14 (the official `get_2dPool_index`), against the interpolation written out by hand
    onevision = default_geometry("llava_onevision")
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 27, 27, generator=g) < 0.3
    flat = onevision.pool_grid(mask.float(), (14, 14))
    assert flat.shape == (2, 196)
    value = flat.view(2, 14, 14)
    # the same as the model's pooling of features (a 1-channel feature map), and as F.interpolate itself
    torch.testing.assert_close(value, bilinear_pool(mask.float()[..., None])[..., 0], rtol=0, atol=0)
    scale = 27 / 14
    for f in range(2):
        for i in range(14):
            for j in range(14):
                sy, sx = max((i + 0.5) * scale - 0.5, 0.0), max((j + 0.5) * scale - 0.5, 0.0)
                y0, x0 = int(sy), int(sx)
                y1, x1 = min(y0 + 1, 26), min(x0 + 1, 26)
                wy, wx = sy - y0, sx - x0
                m = mask[f].float()
                expect = (
                    (1 - wy) * (1 - wx) * m[y0, x0]
                    + (1 - wy) * wx * m[y0, x1]
                    + wy * (1 - wx) * m[y1, x0]
                    + wy * wx * m[y1, x1]
                )
                assert abs(float(value[f, i, j]) - float(expect)) < 1e-5
    assert bool((onevision.pool_grid(torch.ones(1, 27, 27), (14, 14)) >= 0.5).all())
    # the tower-value path (to_token_grid) pools the same way: [F, 729] -> [F, 196]
    torch.testing.assert_close(onevision.to_token_grid(mask.float().reshape(2, 729), (14, 14)), flat, rtol=0, atol=0)
    # average pooling (LLaVA-NeXT-Video): a 2x2 cell needs two anchors
    nextvideo = default_geometry("llava_next_video")
    assert nextvideo.pooling == "average"
    m = torch.zeros(1, 4, 4, dtype=torch.bool)
    m[0, 0, 0] = True  # cell (0, 0): one anchor -> 0.25
    m[0, 0, 2] = m[0, 1, 3] = True  # cell (0, 1): two -> 0.5
    m[0, 2:, 2:] = True  # cell (1, 1): four -> 1
    avg = nextvideo.pool_grid(m.float(), (2, 2))
    assert avg.tolist() == [[0.25, 0.5, 0.0, 1.0]]
    assert (avg.view(1, 2, 2) >= 0.5).tolist() == [[[False, True], [False, True]]]
    # max pooling (spatial_pool_mode="max"): one anchor in a cell is enough
    assert (nextvideo.pool_grid(m.float(), (2, 2), "max") >= 0.5).tolist() == [[True, True, False, True]]
    torch.testing.assert_close(
        nextvideo.pool_grid(m.float(), (2, 2)), F.avg_pool2d(m.float()[:, None], 2).reshape(1, 4), rtol=0, atol=0
    )


# --- inter-frame --------------------------------------------------------------------------------------------------


def test_time_cost_values():
    assert [round(float(time_cost(float(dt))), 3) for dt in (1, 2, 3)] == [0.199, 0.589, 0.865]
    assert float(time_cost(0.0)) == 0.0


@pytest.mark.parametrize("seed,dt,keep", [(0, 1, 0.3), (1, 2, 0.1), (2, 3, 0.5)])
def test_ota_merge_time_matches_the_official_step(seed, dt, keep):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.randn(20, 8, generator=g, dtype=torch.float64)
    sources = anchors[torch.randint(0, 20, (25,), generator=g)] + 0.3 * torch.randn(
        25, 8, generator=g, dtype=torch.float64
    )
    step = ota_merge_time(anchors, sources, dt, keep)
    ref_new, ref_keep = ref_ota_time(anchors[None], sources[None], dt, keep)
    assert torch.equal(step.keep, ref_keep[0])
    torch.testing.assert_close(step.anchors, ref_new[0], rtol=1e-9, atol=1e-9)
    assert int(step.keep.sum()) == residual_count(25, keep)  # distinct pmax: ceil(keep * (n - 1))
    torch.testing.assert_close(step.p_row.sum(1), torch.ones(25, dtype=torch.float64))
    exact = ota_merge_time(anchors, sources, dt, keep, residuals=4)
    assert int(exact.keep.sum()) == 4
    assert bool((exact.pmax[exact.keep].max() <= exact.pmax[~exact.keep].min()))  # the least matched stay


def test_block_plans_are_the_block_diagonal_dense_merge():
    """AOT's merges go through `merge_dense` with the map given by its diagonal blocks (frames, clips): the same
    tokens, features and counts as the whole block-diagonal matrix; blocks without sources copy their tokens."""
    g = torch.Generator().manual_seed(0)
    tokens = grid_tokens(torch.randn(12, 4, generator=g, dtype=torch.float64), (3, 2, 2))
    tokens.extras["deepstack"] = torch.randn(12, 3, generator=g)
    tokens.extras["deepstack"][1] = -0.0
    w0 = torch.rand(2, 2, generator=g)
    w1 = torch.rand(1, 3, generator=g)
    blocks = [
        Block(torch.tensor([0, 1]), tokens.embeds[[0, 1]]),  # kept as they are
        Block(torch.tensor([4, 5]), tokens.embeds[[4, 5]] * 2, torch.tensor([0.5, 0.25]), torch.tensor([6, 7]), w0),
        Block(torch.tensor([8]), tokens.embeds[[8]], torch.tensor([0.3]), torch.tensor([9, 10, 11]), w1),
    ]
    out = block_plan(blocks, tokens.embeds.device).apply(tokens)
    dense = torch.zeros(5, 5)
    dense[2:4, :2], dense[4:, 2:] = w0, w1
    keep, src = torch.tensor([0, 1, 4, 5, 8]), torch.tensor([6, 7, 9, 10, 11])
    ref = tokens.merge_dense(keep, torch.tensor([1.0, 1.0, 0.5, 0.25, 0.3]), src, dense, embeds=out.embeds)
    assert torch.equal(out.positions, ref.positions) and torch.equal(out.weight, ref.weight)
    assert out.weight.tolist() == [1, 1, 3, 1, 4]  # tokens 2 and 3 are in no block: dropped
    torch.testing.assert_close(out.extras["deepstack"], ref.extras["deepstack"])
    assert torch.equal(out.extras["deepstack"][:2], tokens.extras["deepstack"][:2])  # copied, -0.0 included
    assert torch.signbit(out.extras["deepstack"][1]).all()


def test_clip_output_order_and_counts():
    """8 frames of 5 tokens in clips of 4: [f0 ; residuals f1..f3 ; merged f0] twice."""
    g = torch.Generator().manual_seed(0)
    grid = (8, 1, 5)
    embeds = torch.randn(1, 5, 6, generator=g, dtype=torch.float64) + 0.2 * torch.randn(
        8, 5, 6, generator=g, dtype=torch.float64
    )
    tokens = grid_tokens(embeds.reshape(40, 6), grid)
    tokens.extras["deepstack"] = tokens.embeds.clone().float()
    plugin = AOT(keep_ratio=0.5, clip_frames=4)
    out = plugin._inter_step(tokens, 4, 0.5, fixed=False)
    residual = residual_count(5, 0.5)  # 2 of 5 tokens per later frame
    assert residual == 2 and len(out) == 2 * (5 + 3 * residual + 5)
    frames = out.frame.tolist()
    assert frames == [0] * 5 + [1] * 2 + [2] * 2 + [3] * 2 + [0] * 5 + [4] * 5 + [5] * 2 + [6] * 2 + [7] * 2 + [4] * 5
    # both copies of the anchor frame sit at the anchor tokens' positions; the first copy is the original
    assert torch.equal(out.positions[:5], out.positions[11:16]) and torch.equal(out.embeds[:5], embeds[0])
    clips = temporal_merge([embeds[f] for f in range(8)], 4, 0.5)
    assert [c.anchor_frame for c in clips] == [0, 4]
    torch.testing.assert_close(out.embeds[11:16], clips[0].merged)
    ref = ref_temporal(embeds, torch.ones(8, 5, dtype=torch.bool), 4, 0.5)
    torch.testing.assert_close(out.embeds, ref, rtol=1e-9, atol=1e-9)
    # side features follow the same (linear) cumulative update
    torch.testing.assert_close(out.extras["deepstack"].double(), out.embeds, rtol=1e-5, atol=1e-5)
    # merged copies count the tokens folded into them
    assert float(out.weight.sum()) == pytest.approx(40 + 10)  # every token once, the anchor frames twice
    # one-frame clips emit each frame once (no merged copy)
    assert temporal_merge([embeds[f] for f in range(3)], 1, 0.5)[0].merged is None
    assert clip_segments(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert fixed_total(5, 8, 4, 0.5, True) == len(out) and fixed_total(5, 8, 1, 0.5, True) == 40


# --- the whole connect hook against the official path ---------------------------------------------------------------


@pytest.mark.parametrize("seed,setting", [(0, "mvbench"), (1, "videomme")])
def test_onevision_connect_matches_the_official_pipeline(seed, setting):
    grid, shallow, deep = onevision_video(seed=seed)
    tokens = grid_tokens(bilinear_pool(grid).reshape(-1, 16), (32, 14, 14))
    plugin = AOT(setting=setting)
    ctx = onevision_context(grid, shallow, deep)
    out = plugin.connect(tokens, ctx)
    v, keep = {"mvbench": (126, 0.3), "videomme": (108, 0.1)}[setting]
    ref, pooled_mask = ref_aot_onevision(grid, shallow, deep, v, keep, 4)
    assert out.embeds.shape == ref.shape
    torch.testing.assert_close(out.embeds, ref, rtol=1e-9, atol=1e-9)
    assert ctx.reports == {"budget": [(v, keep, 4, True)]}  # one report for the one video
    # per clip of 4: the anchor frame's kept cells twice, the quantile's residuals of each of the 3 others
    kept = pooled_mask.sum(1).tolist()
    per_frame = out.frame.bincount(minlength=32).tolist()
    assert per_frame == [2 * n if f % 4 == 0 else residual_count(n, keep) for f, n in enumerate(kept)]
    # per clip: the anchor frame's kept cells twice, around the residuals of the next three frames
    first = out.frame[: kept[0]]
    assert bool((first == 0).all()) and out.frame[kept[0]].item() in (1, 2, 3)
    assert torch.equal(out.patch[: kept[0]], torch.nonzero(pooled_mask[0]).flatten())


def test_onevision_fixed_count_is_exact_and_content_independent():
    counts = set()
    for seed in (0, 1):
        grid, shallow, deep = onevision_video(seed=seed, frames=16)
        tokens = grid_tokens(bilinear_pool(grid).reshape(-1, 16), (16, 14, 14))
        plugin = AOT(fixed_count=True).bind(0.15)
        ctx = onevision_context(grid, shallow, deep)
        out = plugin.connect(tokens, ctx)
        target = plugin.retained_count(len(tokens), tokens.grid, "llava_onevision")
        assert len(out) == target
        counts.add(target)
        ((v, keep, clip, inter),) = ctx.reports["budget"]
        assert (v, keep, clip, inter) == plugin.budget(tokens.grid, "llava_onevision")
        k = round(anchors_on_grid(v, 0.5, 27, 27) / 729 * 196)
        assert clip == 2 and inter and target == fixed_total(k, 16, 2, keep, True)
        # every frame keeps exactly k cells before the inter-frame step: anchor frames appear 2k times
        assert out.frame.bincount(minlength=16)[::2].tolist() == [2 * k] * 8
    assert len(counts) == 1
    assert abs(counts.pop() - 0.15 * 16 * 196) <= 9 * 16  # the retention, within one window step per frame


def test_token_grid_path_keeps_anchors_and_mixes_side_features():
    """Qwen families: anchors on the token grid, merged; DeepStack-like extras get the same linear update."""
    g = torch.Generator().manual_seed(0)
    t, h, w = 4, 6, 9
    embeds = torch.randn(t * h * w, 8, generator=g, dtype=torch.float64)
    tokens = grid_tokens(embeds, (t, h, w))
    tokens.extras["deepstack"] = embeds.clone().float()
    shallow, deep = torch.rand(t, h * w, generator=g), torch.rand(t, h * w, generator=g)
    ctx = Context(family="qwen2_vl", geometry=default_geometry("qwen2_vl"), vision={SHALLOW: shallow, DEEP: deep})
    plugin = AOT(visual_token_num=243, inter_compress=False)  # a third of the tokens
    out = plugin.connect(tokens, ctx)
    assert ctx.reports == {"budget": [(243, 0.3, 1, False)]}
    vg = round(243 * h * w / 729)
    per_window, num_global = anchor_budget(vg, 0.5)
    mask = select_anchors(shallow, deep, h, w, per_window, num_global)
    merge = intra_ot_merge(embeds.view(t, h * w, 8), mask, grid_coords(h, w))
    assert len(out) == t * anchors_on_grid(vg, 0.5, h, w) == int(mask.sum())
    assert torch.equal(out.frame * h * w + out.patch, torch.nonzero(mask.flatten()).flatten())
    torch.testing.assert_close(out.embeds, merge.features[mask])
    torch.testing.assert_close(out.extras["deepstack"].double(), out.embeds, rtol=1e-5, atol=1e-5)
    assert float(out.weight.sum()) == t * h * w  # every token counted once
    # a thinned input (every other token of frame 0 gone) still works, frame by frame
    keep = torch.ones(t * h * w, dtype=torch.bool)
    keep[: h * w : 2] = False
    thinned = tokens.select(torch.nonzero(keep).flatten())
    part = plugin.connect(thinned, ctx)
    assert 0 < len(part) <= len(out) and set(part.frame.tolist()) == set(range(t))
    # the complete frames pick the same anchors as before
    later = out.frame > 0
    assert torch.equal(part.frame[part.frame > 0], out.frame[later])
    assert torch.equal(part.patch[part.frame > 0], out.patch[later])
    # frame 0 picks its anchors among the tokens present only
    assert set(part.patch[part.frame == 0].tolist()) <= set(range(1, h * w, 2))
    # fixed-count mode promises a count for the full grid only (a thinned frame may hold fewer than its quota)
    fixed = AOT(visual_token_num=243, inter_compress=False, fixed_count=True)
    assert fixed.retained_count(len(tokens), tokens.grid, "qwen2_vl") == len(out)
    assert fixed.retained_count(len(thinned), thinned.grid, "qwen2_vl") is None


# --- the patched models ------------------------------------------------------------------------------------------


def _spy(plugin):
    """Record what the method's connect hook gets and returns."""
    calls = []
    original = plugin.connect

    def wrapped(tokens, ctx):
        out = original(tokens, ctx)
        calls.append((tokens, ctx, out))
        return out

    plugin.connect = wrapped
    return calls


def test_patched_onevision_sends_the_official_tokens_to_the_llm():
    model, _ = model_and_processor("llava_onevision")
    inputs = single_inputs("llava_onevision")
    seen = {}

    def grab(module, args, kwargs):
        seen.setdefault("embeds", kwargs["inputs_embeds"])

    with vtc.patch(model, "aot", retention=0.2, clip_frames=4, **TINY) as handle:
        # registered after vtc's own hook: sees what the LLM really gets
        probe = vtc.api.resolve_adapter(model).text_model.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            plugin = handle.pipeline.entries[0].method
            calls = _spy(plugin)
            with torch.no_grad():
                model(**inputs)
            stats = handle.stats()
        finally:
            probe.remove()
    ((tokens, ctx, out),) = calls
    assert ctx.prepool.shape[:3] == (8, 27, 27)
    torch.testing.assert_close(ctx.pool(ctx.prepool).reshape(-1, ctx.prepool.shape[-1]), tokens.embeds)
    assert ctx.family == "llava_onevision"
    assert ctx.geometry.pooling == "bilinear" and ctx.geometry.patch_grid == (27, 27)
    ((v, keep, clip, inter),) = stats.reports["aot"]["budget"]
    assert (clip, inter, keep) == (4, True, 0.3)
    assert v == visual_token_num_for(0.2, tokens.grid, 0.3, 4, True, True)
    ref, _ = ref_aot_onevision(ctx.prepool, ctx.vision[TINY_SHALLOW], ctx.vision[DEEP], v, keep, 4)
    # the same merges in another order of float operations: 2e-5 apart on AVX-512 machines, 1e-5 on AVX2 ones
    torch.testing.assert_close(out.embeds, ref, rtol=1e-4, atol=5e-5)
    assert stats.visual_tokens_out == stats.llm_tokens_in == len(ref) == len(out) < stats.visual_tokens_in
    (record,) = [r for r in stats.stages if r.stage == "connect" and r.plugin == "aot"]
    assert (record.tokens_in, record.tokens_out) == (len(tokens), len(ref))
    video = inputs["input_ids"][0] == vtc.api.resolve_adapter(model).video_token_id
    start = int(torch.nonzero(video).flatten()[0])
    torch.testing.assert_close(
        seen["embeds"][0, start : start + len(ref)], ref.to(seen["embeds"].dtype), rtol=1e-4, atol=5e-5
    )


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_next_video"])
def test_patched_fixed_count_matches_the_plan(family):
    model, _ = model_and_processor(family)
    params = dict(fixed_count=True, clip_frames=2, inter_compress=True, **TINY)
    with vtc.patch(model, "aot", retention=0.25, **params) as handle:
        for inputs in (single_inputs(family), batch_inputs(family)):
            with torch.no_grad():
                model(**inputs)
            stats = handle.stats()
            planned = [handle.retained_count(grid) for grid in stats.grids]
            assert stats.visual_tokens_out == sum(planned) < stats.visual_tokens_in
            # per video (connect records, in video order) and the budget each video was given
            records = [r for r in stats.stages if r.stage == "connect" and r.plugin == "aot"]
            assert [r.tokens_out for r in records] == planned
            plugin = AOT(**params).bind(0.25)
            assert stats.reports["aot"]["budget"] == [plugin.budget(grid, family) for grid in stats.grids]
            for grid, count in zip(stats.grids, planned):
                t, h, w = grid
                assert count == plugin.retained_count(t * h * w, grid, family)


def test_reports_cover_every_video_of_the_last_forward():
    model, _ = model_and_processor("llava_next_video")
    with vtc.patch(model, "aot", retention=0.3, **TINY) as handle:
        plugin = handle.pipeline.entries[0].method
        for inputs, videos in ((batch_inputs("llava_next_video"), 2), (single_inputs("llava_next_video"), 1)):
            with torch.no_grad():
                model(**inputs)
            stats = handle.stats()
            assert len(stats.grids) == stats.videos == videos
            # one budget per video, in video order, for this forward only (no leftovers from the previous one)
            assert stats.reports["aot"]["budget"] == [plugin.budget(grid, "llava_next_video") for grid in stats.grids]
            records = [r for r in stats.stages if r.stage == "connect" and r.plugin == "aot"]
            assert len(records) == videos
            assert [r.tokens_in for r in records] == [t * h * w for t, h, w in stats.grids]
            assert sum(r.tokens_out for r in records) == stats.llm_tokens_in == stats.visual_tokens_out
            assert all(0 < r.tokens_out < r.tokens_in for r in records)


def test_vision_statistics_outside_the_tower_are_refused():
    """The official shallow layer 5 does not exist in the 2-layer tiny tower: refused at patch time, no clamp."""
    model, _ = model_and_processor("llava_onevision")
    adapter = vtc.api.resolve_adapter(model)
    hooks = (len(adapter.outer._forward_pre_hooks), len(adapter.text_model._forward_pre_hooks))
    with pytest.raises(ValueError, match="at layer 5 resolves to encoder layer 5"):
        vtc.patch(model, "aot", retention=0.3)
    # the model is left unpatched (no hook installed) and usable
    assert (len(adapter.outer._forward_pre_hooks), len(adapter.text_model._forward_pre_hooks)) == hooks
    with vtc.patch(model, "aot", retention=0.3, **TINY) as handle, torch.no_grad():
        model(**single_inputs("llava_onevision"))
        assert handle.stats().reports["aot"]["budget"]
