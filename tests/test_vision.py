"""Vision-tower attention statistics and pre-pool features handed to connect plugins, checked against
independent computations (eager attention maps; the model's own pooling)."""

from __future__ import annotations

import pytest
import torch

import vtc
from tests.conftest import model_and_processor, single_inputs
from tests.probes import PrepoolSpy, connect_inputs, install_spy
from vtc.core.vision_stats import VisionStat
from vtc.hf.adapters.base import encoder_layers


def eager_attentions(model, inputs):
    """Vision attention maps with eager attention (what the official LLaVA code reads)."""
    tower = vtc.api.resolve_adapter(model).vision_tower
    config = tower.config
    before = config._attn_implementation
    config._attn_implementation = "eager"
    maps = []
    hooks = [
        layer.self_attn.register_forward_hook(lambda m, a, out: maps.append(out[1])) for layer in encoder_layers(tower)
    ]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        config._attn_implementation = before
        for h in hooks:
            h.remove()
    return maps


@pytest.mark.parametrize("family", ["llava_onevision", "llava_next_video"])
def test_llava_received_cls_and_keys_match_eager_maps(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    maps = eager_attentions(model, inputs)
    kinds = ["received", "keys"] + (["cls"] if family == "llava_next_video" else [])
    tokens, ctx = connect_inputs(model, inputs, [VisionStat(k, -1) for k in kinds] + [VisionStat("received", 0)])
    stats = ctx.vision
    frames = tokens.grid[0]
    feature_layer = vtc.api.resolve_adapter(model).vision_feature_layer()
    last = maps[feature_layer]  # [F, heads, L, L]
    torch.testing.assert_close(stats[VisionStat("received", -1)], last.sum(-2).mean(1), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(stats[VisionStat("received", 0)], maps[0].sum(-2).mean(1), atol=1e-5, rtol=1e-4)
    assert stats[VisionStat("received", -1)].shape == (frames, last.shape[-1])
    assert stats[VisionStat("keys", -1)].shape[:2] == (frames, last.shape[-1])
    if family == "llava_next_video":
        torch.testing.assert_close(stats[VisionStat("cls", -1)], last[:, :, 0, :], atol=1e-5, rtol=1e-4)


def test_qwen_received_matches_manual_attention():
    """Qwen2-VL: q/k rebuilt from the block's qkv projection and rotary embedding, per temporal patch."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    block = model.model.visual.blocks[-1]
    seen = {}
    h1 = block.register_forward_pre_hook(
        lambda m, a, kw: seen.update(x=a[0], pe=kw["position_embeddings"], cu=kw["cu_seqlens"]), with_kwargs=True
    )
    with torch.no_grad():
        model(**inputs)
    h1.remove()
    attn = block.attn
    with torch.no_grad():
        x = block.norm1(seen["x"])
        n = x.shape[0]
        q, k, _ = attn.qkv(x).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = apply_rotary_pos_emb_vision(q, k, *seen["pe"])
        received = []
        cu = seen["cu"].tolist()
        for s, e in zip(cu[:-1], cu[1:]):
            qs, ks = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1)
            probs = torch.softmax(qs @ ks.transpose(-1, -2) * attn.scaling, dim=-1)
            received.append(probs.sum(-2).mean(0))
        received = torch.cat(received).reshape(-1, 4).mean(1)  # merge units of 2x2 patches
    tokens, ctx = connect_inputs(model, inputs, [VisionStat("received", -1)])
    stats = ctx.vision
    prepool = ctx.prepool
    t, h, w = tokens.grid
    assert prepool is None
    torch.testing.assert_close(stats[VisionStat("received", -1)], received.reshape(t, h * w), atol=1e-5, rtol=1e-4)


def test_qwen2_5_window_permutation_is_undone():
    """The permutation vtc reverses is the one the tower applies: reversing the merger's raw (window-ordered)
    output with it gives the features the model scatters into the prompt."""
    from transformers.vision_utils import get_vision_window_index

    model, _ = model_and_processor("qwen2_5_vl")
    inputs = single_inputs("qwen2_5_vl")
    raw = {}
    hook = model.model.visual.merger.register_forward_hook(lambda m, a, out: raw.update(out=out))
    with torch.no_grad():
        features = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    hook.remove()
    vision = model.config.vision_config
    index = get_vision_window_index(
        inputs["video_grid_thw"], vision.spatial_merge_size, vision.window_size, vision.patch_size
    )[0]
    restored = torch.empty_like(raw["out"])
    restored[index] = raw["out"]
    torch.testing.assert_close(restored, torch.cat(features.pooler_output))
    assert not torch.equal(raw["out"], restored)  # the test image really is permuted

    tokens, ctx = connect_inputs(model, inputs, [VisionStat("received", -1), VisionStat("mean_query", -1)])
    stats = ctx.vision
    t, h, w = tokens.grid
    mean_query = stats[VisionStat("mean_query", -1)]
    assert mean_query.shape == (t, h * w)
    torch.testing.assert_close(mean_query.sum(-1), torch.ones(t), atol=1e-5, rtol=1e-5)  # a softmax per frame


@pytest.mark.parametrize("family", ["llava_onevision", "llava_next_video"])
def test_prepool_features_pool_back_to_the_tokens(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    tokens, ctx = connect_inputs(model, inputs, prepool=True)
    prepool = ctx.prepool
    pool = ctx.pool
    f, h, w = tokens.grid
    assert prepool.shape[:3] == (f, 27, 27) if family == "llava_onevision" else prepool.shape[:3] == (f, 24, 24)
    pooled = pool(prepool)
    assert pooled.shape[:3] == (f, h, w)
    torch.testing.assert_close(pooled.reshape(f * h * w, -1), tokens.embeds, atol=1e-5, rtol=1e-4)


def test_capture_is_removed_on_unpatch():
    model, _ = model_and_processor("llava_onevision")
    config = model.config.vision_config
    before = config._attn_implementation
    patch = install_spy(model, PrepoolSpy((VisionStat("received", -1),)))
    assert config._attn_implementation == "vtc_sdpa"
    patch.remove()
    assert config._attn_implementation == before
    with pytest.raises(ValueError, match="unknown vision statistic"):
        VisionStat("entropy")
