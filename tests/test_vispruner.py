"""VisPruner: the per-frame selection against a transcription of the official `encode_images` (Theia-4869/VisPruner
aefa01ad, llava/model/llava_arch.py L141-186) on identical random inputs, hand-built frames whose answer is known (a
frame whose left half is blank loses its blank tokens first), what each tower gives, counts, and the patched models
end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vtc
from tests.conftest import grid_tokens, model_and_processor, single_inputs
from tests.probes import connect_inputs, llm_inputs
from vtc.api import prepare_inputs
from vtc.core.geometry import default_geometry
from vtc.core.tokens import Context
from vtc.core.vision_stats import VisionStat
from vtc_plugins.vispruner import (
    README_FRACTION,
    VisPruner,
    attention_stat,
    remove_duplicates,
    split_budget,
    token_attention,
    vispruner_keep,
)


def official_encode_images(image_features, image_attentions, visual_token_num, important_ratio):
    """`LlavaMetaForCausalLM.encode_images` of Theia-4869/VisPruner at aefa01ad (llava/model/llava_arch.py L141-186),
    transcribed from the tower's outputs on (features (B, N, C), CLS attentions (B, H, N)) to the index masks; the
    projector call is left out. Only the names of the inputs differ."""
    B, N, C = image_features.shape
    device = image_features.device
    index_masks = torch.ones(B, N, dtype=torch.bool, device=device)

    important_token_num = int(visual_token_num * important_ratio)  # T_imp = T * r
    diverse_token_num = visual_token_num - important_token_num  # T_div = T * (1 - r)

    image_attentions = image_attentions.mean(dim=1)  # (B, N)
    token_indices = image_attentions.argsort(dim=-1, descending=True)  # (B, N)
    important_indices = token_indices[:, :important_token_num]  # (B, T_imp)
    residual_indices = token_indices[:, important_token_num:]  # (B, N - T_imp)

    image_normalized = image_features / image_features.norm(dim=-1, keepdim=True)  # (B, N, C)
    while diverse_token_num > 0:
        R = residual_indices.shape[1]
        r = min(8, R - diverse_token_num)
        if r <= 0:
            break

        residual_tokens = image_normalized[torch.arange(B).unsqueeze(-1).expand(-1, R), residual_indices]  # (B, R, C)
        a, b = residual_tokens[..., ::2, :], residual_tokens[..., 1::2, :]  # (B, R // 2, C)
        scores = a @ b.transpose(-1, -2)  # (B, R // 2, R // 2)
        scores = scores.max(dim=-1).values  # (B, R // 2)

        distinct_indices = scores.argsort(dim=-1, descending=True)[:, r:]  # (B, R // 2 - r)
        residual_indices = torch.cat(
            [
                residual_indices[..., ::2][torch.arange(B).unsqueeze(-1).expand(-1, R // 2 - r), distinct_indices],
                residual_indices[..., 1::2],
            ],
            dim=-1,
        )  # (B, R - r)

    if diverse_token_num > 0:
        selected_indices = torch.cat([important_indices, residual_indices], dim=-1)  # (B, T)
    else:
        selected_indices = important_indices  # (B, T)
    index_masks = torch.zeros(B, N, dtype=torch.bool, device=device)
    index_masks.scatter_(1, selected_indices, True)
    return index_masks


# (T, r) on CLIP's 576 tokens: the README's 128/0.5 and 64/0.75, LLaVA-NeXT's 32 per view, the defaults' 576, and
# others whose residual stays even (where the official indexing runs)
SETTINGS = [(128, 0.5), (64, 0.75), (32, 0.5), (192, 0.5), (96, 0.25), (576, 0.5), (64, 0.0), (64, 1.0)]


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("tokens,ratio", SETTINGS)
def test_selection_matches_the_official_encode_images(seed, tokens, ratio):
    """16 cases (8 settings x 2 seeds, 2 images each): the same kept set as the official code on identical random
    inputs."""
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(2, 576, 32, generator=g)
    attentions = torch.rand(2, 16, 576, generator=g)
    masks = official_encode_images(features, attentions, tokens, ratio)
    for b in range(2):
        keep = vispruner_keep(attentions[b].mean(dim=0), features[b], tokens, ratio)
        ours = torch.zeros(576, dtype=torch.bool)
        ours[keep] = True
        assert torch.equal(ours, masks[b]) and keep.numel() == min(tokens, 576) == int(masks[b].sum())


def test_odd_residuals_drop_what_they_can():
    """Where the official indexing raises (an odd residual, or more A-tokens asked for than there are), every round
    drops what it can and the count is exact."""
    g = torch.Generator().manual_seed(0)
    features, attentions = torch.randn(1, 49, 8, generator=g), torch.rand(1, 4, 49, generator=g)
    with pytest.raises(IndexError, match="shape mismatch"):
        official_encode_images(features, attentions, 24, 0.5)  # T_imp = 12, R = 37: odd
    for tokens in range(1, 49):
        keep = vispruner_keep(attentions[0].mean(dim=0), features[0], tokens, 0.5)
        assert keep.numel() == tokens and torch.unique(keep).numel() == tokens
    # 10 residual tokens, 1 to keep: the first round may drop only the 5 A-tokens
    normalized = F.normalize(torch.randn(10, 4, generator=g), dim=-1)
    assert remove_duplicates(normalized, torch.arange(10), 1).numel() == 1


def test_budget_split():
    assert split_budget(128, 0.5) == (64, 64) and split_budget(64, 0.75) == (48, 16)
    assert split_budget(49, 0.5) == (24, 25) and split_budget(10, 0.0) == (0, 10) and split_budget(10, 1.0) == (10, 0)


# --- known answers ------------------------------------------------------------------------------------------------


def blank_left_frame(seed: int, h: int = 8, w: int = 8, dim: int = 32):
    """Features of an h x w frame whose left half is one constant vector (a blank region) and right half random."""
    g = torch.Generator().manual_seed(seed)
    blank = (torch.arange(h * w) % w) < w // 2
    features = torch.randn(h * w, dim, generator=g)
    features[blank] = torch.randn(dim, generator=g)
    return features, blank, g


@pytest.mark.parametrize("seed", range(12))
def test_blank_half_goes_first_under_diversity(seed):
    """Diversity alone (r = 0): whatever the attention order (random, or raster for seed 0), the first 20 tokens
    removed from a 64-token frame are blank ones (the right half stays whole); down to 33 kept, nearly all of the
    right half survives while the blank half shrinks to a few tokens."""
    features, blank, g = blank_left_frame(seed)
    attention = torch.linspace(1, 0, 64) if seed == 0 else torch.rand(64, generator=g)
    for tokens in range(44, 64):
        keep = vispruner_keep(attention, features, tokens, 0.0)
        assert bool((~blank[keep]).sum() == 32), f"a content token was removed at T = {tokens}"
        assert int(blank[keep].sum()) == tokens - 32
    keep = vispruner_keep(attention, features, 33, 0.0)
    assert int((~blank[keep]).sum()) >= 27 and int(blank[keep].sum()) <= 6


def test_attention_picks_first_then_diversity_fills():
    """Important tokens are the top attention (here the right half's first column); of the 32 identical blank
    tokens, the diverse ones keep exactly one copy."""
    features, blank, _ = blank_left_frame(1)
    attention = torch.full((64,), 0.1)
    attention[torch.arange(4, 64, 8)] = torch.linspace(1.0, 0.5, 8)  # column 4 of every row, top to bottom
    attention[blank] = 0.0  # the CLS query ignores the blank half
    keep = vispruner_keep(attention, features, 16, 0.5)
    assert keep[:8].tolist() == list(range(4, 64, 8))  # T_imp = 8, in attention order
    assert int(blank[keep[8:]].sum()) == 1  # 8 diverse tokens out of 24 content + 32 blank ones


# --- what each tower gives ----------------------------------------------------------------------------------------


def test_attention_by_tower():
    clip, siglip, qwen = (default_geometry(f) for f in ("llava_next_video", "llava_onevision", "qwen2_vl"))
    assert attention_stat(clip) == VisionStat("cls", -1)  # official: attentions[select_layer][:, :, 0, 1:]
    assert attention_stat(siglip) == attention_stat(qwen) == VisionStat("received", -1)
    for family in ("llava_onevision", "qwen2_5_vl", "qwen3_vl", "internvl"):
        assert VisPruner().vision_stats(family) == [VisionStat("received", -1)]
    assert VisPruner(attention_layer=-2).vision_stats("llava_next_video") == [VisionStat("cls", -2)]
    g = torch.Generator().manual_seed(0)
    cls = torch.rand(2, 4, 577, generator=g)
    expected = F.avg_pool2d(cls.mean(dim=1)[:, 1:].reshape(2, 1, 24, 24), 2).reshape(2, 144)  # head mean, pooled
    torch.testing.assert_close(token_attention(cls, clip, (12, 12)), expected)
    received = torch.rand(2, 729, generator=g)
    expected = F.interpolate(received.reshape(2, 1, 27, 27), size=[14, 14], mode="bilinear").reshape(2, 196)
    torch.testing.assert_close(token_attention(received, siglip, (14, 14)), expected)
    assert torch.equal(token_attention(received[:, :144], qwen, (12, 12)), received[:, :144])


# --- the plugin ---------------------------------------------------------------------------------------------------


def test_defaults_counts_and_card():
    p = VisPruner()
    assert p.tokens_per_frame is None and p.important_ratio == 0.5 and p.attention_layer == -1
    assert p.bind(None).frame_count(576) == 128  # the README's 128 of 576
    assert p.bind(None).frame_count(196) == round(196 * README_FRACTION) == 44
    assert p.bind(0.25).frame_count(196) == 49 and p.bind(1.0).frame_count(196) == 196
    assert VisPruner(tokens_per_frame=64).bind(0.25).frame_count(196) == 64  # explicit T wins
    assert VisPruner(tokens_per_frame=500).bind(None).frame_count(196) == 196
    assert p.bind(0.25).retained_count(8 * 196, (8, 14, 14), "llava_onevision") == 8 * 49
    assert p.bind(0.25).retained_count(100, (8, 14, 14), "llava_onevision") is None  # thinned by an earlier method
    assert p.bind(0.001).retained_count(49, (1, 7, 7), "qwen3_vl") == 1  # an image: one frame, at least one token
    card = vtc.registry()["vispruner"].card
    assert card.stages == ("connect",) and card.fixed_count_mode == "always" and card.positions == "compact"
    assert card.vision_stats and card.prepool and not card.query_aware
    assert set(card.families) >= {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision", "llava_next_video"}


def test_bad_params_name_the_problem():
    with pytest.raises(ValueError, match=r"vispruner: important_ratio must be in \[0, 1\], got 1.5"):
        VisPruner(important_ratio=1.5)
    with pytest.raises(ValueError, match=r"vispruner: tokens_per_frame must be in \[1, inf\), got 0"):
        VisPruner(tokens_per_frame=0)
    with pytest.raises(ValueError, match="vispruner: attention_layer must be int"):
        VisPruner(attention_layer=None)
    with pytest.raises(ValueError, match="resolves to encoder layer"):
        vtc.patch(model_and_processor("qwen2_vl")[0], "vispruner", attention_layer=7)


def _qwen_context(grid, seed=0):
    t, h, w = grid
    attention = torch.rand(t, h * w, generator=torch.Generator().manual_seed(seed))
    vision = {VisionStat("received", -1): attention}
    return Context(family="qwen2_vl", geometry=default_geometry("qwen2_vl"), vision=vision), attention


@pytest.mark.parametrize("mrope", [False, True])
def test_connect_selects_per_frame_in_spatial_order(mrope):
    grid = (3, 4, 4)
    embeds = torch.randn(48, 8, generator=torch.Generator().manual_seed(1))
    tokens = grid_tokens(embeds, grid, mrope)
    ctx, attention = _qwen_context(grid)
    out = VisPruner(tokens_per_frame=6).bind(None).connect(tokens, ctx)
    expected = torch.cat([16 * f + vispruner_keep(attention[f], embeds[16 * f : 16 * (f + 1)], 6) for f in range(3)])
    expected = torch.sort(expected).values
    assert torch.equal(out.embeds, embeds[expected]) and len(out) == 18
    assert torch.equal(out.positions, tokens.positions[..., expected])
    assert VisPruner().bind(1.0).connect(tokens, ctx) is tokens  # retention 1.0 keeps every token untouched
    thinned = tokens.select(torch.tensor(list(range(0, 16, 4)) + list(range(16, 48))))  # frame 0 has 4 tokens
    out = VisPruner(tokens_per_frame=6).bind(None).connect(thinned, ctx)
    assert [int((out.frame == f).sum()) for f in range(3)] == [4, 6, 6]


# --- the patched models -------------------------------------------------------------------------------------------


def _video_start(model, inputs) -> int:
    video = inputs["input_ids"][0] == vtc.api.resolve_adapter(model).video_token_id
    return int(torch.nonzero(video)[0])


@pytest.mark.parametrize("family", ["llava_onevision", "llava_next_video", "qwen2_5_vl"])
def test_patched_model_receives_the_official_selection(family):
    """The LLM receives exactly the tokens the pure function picks from the model's own statistics: on
    LLaVA-NeXT-Video the similarity runs on the pooled CLIP features the projector receives (official), elsewhere on
    the LLM tokens; LLaVA positions are renumbered, Qwen's kept."""
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    plugin = VisPruner().bind(0.3)
    tokens, ctx = connect_inputs(model, inputs, plugin.vision_stats(family), prepool=True)
    t, h, w = tokens.grid
    attention = token_attention(ctx.vision[attention_stat(ctx.geometry)], ctx.geometry, (h, w))
    if family == "llava_next_video":
        features = F.avg_pool2d(ctx.prepool.permute(0, 3, 1, 2), 2).permute(0, 2, 3, 1).reshape(t * h * w, -1)
    else:
        features = tokens.embeds
    budget = round(0.3 * h * w)
    keep = torch.cat(
        [f * h * w + vispruner_keep(attention[f], features[f * h * w : (f + 1) * h * w], budget) for f in range(t)]
    )
    keep = torch.sort(keep).values
    out, positions, handle = llm_inputs(model, inputs, "vispruner", retention=0.3)
    assert handle.stats().visual_tokens_out == t * budget == keep.numel()
    start = _video_start(model, inputs)
    torch.testing.assert_close(out[start : start + keep.numel()], tokens.embeds[keep], rtol=0, atol=0)
    if family == "qwen2_5_vl":
        _, reference, _ = llm_inputs(model, inputs)
        assert torch.equal(positions[:, :, start : start + keep.numel()], reference[:, :, start + keep])
    else:
        assert torch.equal(positions.flatten(), torch.arange(out.shape[0]))  # renumbered, as LLaVA builds them
    if family == "llava_next_video":  # the LLM tokens as the similarity space: another choice
        post = VisPruner(features_before_projector=False).bind(0.3).connect(tokens, ctx)
        frames = [tokens.embeds[f * h * w : (f + 1) * h * w] for f in range(t)]
        post_keep = torch.cat([f * h * w + vispruner_keep(attention[f], frames[f], budget) for f in range(t)])
        post_keep = torch.sort(post_keep).values
        assert torch.equal(post.embeds, tokens.embeds[post_keep]) and not torch.equal(post_keep, keep)


def test_retention_one_is_the_unpatched_model():
    model, _ = model_and_processor("llava_onevision")
    inputs = single_inputs("llava_onevision")
    with torch.no_grad():
        reference = model(**inputs).logits
        with vtc.patch(model, "vispruner", retention=1.0):
            assert torch.equal(model(**inputs).logits, reference)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision", "llava_next_video"])
def test_blank_half_of_real_frames_goes_first(family):
    """A clip whose left half is one grey and right half noise, through the tiny model: the diversity part
    (important_ratio=0) at retention 0.5 keeps almost only right-half tokens."""
    model, processor = model_and_processor(family)
    clip = np.random.default_rng(0).integers(0, 256, size=(8, 224, 224, 3), dtype=np.uint8)
    clip[:, :, :112] = 128
    inputs = prepare_inputs(processor, clip, "What?", num_frames=8, fps=8)
    plugin = VisPruner(important_ratio=0.0).bind(0.5)
    tokens, ctx = connect_inputs(model, inputs, plugin.vision_stats(family), prepool=True)
    with torch.no_grad():
        out = plugin.connect(tokens, ctx)
    t, h, w = tokens.grid
    assert len(out) == t * round(0.5 * h * w)
    assert float((out.col < w // 2).float().mean()) < 0.1
