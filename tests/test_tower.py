"""The vision tower run block by block (`vtc.hf.tower`) and ToMe inside it, on all five families.

Independent checks: with a tower method that changes nothing the block-by-block tower equals the model's own tower
(Qwen windows and DeepStack, a ragged pre-tower subset, SigLIP and CLIP); dropping one frame between blocks leaves
the other frames' outputs as the unpatched tower gives them (frames never attend to each other); ToMe in SigLIP /
CLIP equals the official ToMe blocks (`tome/patch/timm.py`, transcribed below) on the tiny towers' own weights,
unmerged by the official source map; on the Qwen towers ToMe keeps the count it promises, every survivor at its
own cell, and the sizes add up to the units; what cannot run is refused with a message."""

from __future__ import annotations

import copy
from typing import ClassVar

import pytest
import torch

import vtc
from tests.test_encode_stage import KeepPattern
from tests.test_tome import official_bipartite_soft_matching, official_merge_source, official_merge_wavg
from vtc.core.pipeline import Pipeline
from vtc.hf.adapters import resolve_adapter
from vtc.hf.tower import LlavaTower, QwenTower
from vtc.testing.fixtures import model_and_processor, single_inputs
from vtc_plugins.tome import ToMe, parse_r

QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
LLAVA = ("llava_onevision", "llava_next_video")


@vtc.method("t_tower_noop", paper="test")
class TowerNoop(vtc.TowerMerger):
    """Runs the tower block by block and changes nothing."""

    def encode_block(self, tokens, ctx):
        return tokens


@vtc.method("t_drop_frame", paper="test")
class DropFrame(vtc.TowerMerger):
    """After block 0, drops every token of frame `frame` (its cells leave the LLM's input)."""

    frame: int = 1
    calls: ClassVar[list] = []

    def retained_count(self, num_tokens, grid, family):
        return None

    def encode_block(self, tokens, ctx):
        DropFrame.calls.append((tokens.layer, tokens.point))
        if (tokens.layer, tokens.point) != (0, "after_block"):
            return tokens
        return tokens.merge(torch.nonzero(tokens.frame != self.frame).flatten())


def video_features(model, inputs, method=None):
    """The model's get_video_features output (pooler_output, deepstack) under `method` (None: unpatched)."""
    outer = resolve_adapter(model).outer
    args = (inputs["pixel_values_videos"],) + ((inputs["video_grid_thw"],) if "video_grid_thw" in inputs else ())
    handle = vtc.patch(model, method) if method is not None else None
    try:
        with torch.no_grad():
            out = outer.get_video_features(*args)
    finally:
        if handle is not None:
            handle.unpatch()
    return out


def pooled(out) -> torch.Tensor:
    pooler = out.pooler_output
    return torch.cat(list(pooler)) if isinstance(pooler, (tuple, list)) else pooler.flatten(0, -2)


@pytest.mark.parametrize("family", QWEN + LLAVA)
def test_the_tower_block_by_block_equals_the_tower_itself(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    want = video_features(model, inputs)
    got = video_features(model, inputs, TowerNoop())
    torch.testing.assert_close(pooled(got), pooled(want), rtol=1e-5, atol=1e-5)
    if family == "qwen3_vl":
        for level, ref in zip(got.deepstack_features, want.deepstack_features):
            torch.testing.assert_close(torch.cat(list(level)), torch.cat(list(ref)), rtol=1e-5, atol=1e-5)
    if family in QWEN:  # after a ragged pre-tower subset: as the tower run on that subset directly
        torch.testing.assert_close(
            pooled(video_features(model, inputs, [KeepPattern(), TowerNoop()])),
            pooled(video_features(model, inputs, KeepPattern())),
            rtol=1e-5,
            atol=1e-5,
        )


@pytest.mark.parametrize("family", ("qwen2_5_vl", "qwen3_vl", "llava_onevision"))
def test_a_frame_dropped_between_blocks_leaves_the_other_frames_as_they_were(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    want = pooled(video_features(model, inputs))
    DropFrame.calls.clear()
    handle = vtc.patch(model, DropFrame())
    try:
        with torch.no_grad():
            got = pooled(resolve_adapter(model).outer.get_video_features(*_media(inputs)))
            model(**inputs)  # the LLM sees the other frames only
        stats = handle.stats()
    finally:
        handle.unpatch()
    (t, h, w) = stats.grids[0]
    frame = torch.arange(want.shape[0]) // (want.shape[0] // t)
    torch.testing.assert_close(got[frame != 1], want[frame != 1], rtol=1e-5, atol=1e-5)
    assert bool((got[frame == 1] == 0).all())
    assert stats.llm_tokens_in == (t - 1) * h * w
    assert DropFrame.calls[:3] == [(-1, "embedded"), (0, "after_attention"), (0, "after_block")]


def _media(inputs):
    return (inputs["pixel_values_videos"],) + ((inputs["video_grid_thw"],) if "video_grid_thw" in inputs else ())


# --- ToMe against the official blocks -------------------------------------------------------------------------


def official_tome_attention(attn, x, size):
    """`ToMeAttention.forward` (tome/patch/timm.py) on SigLIP / CLIP's separate q, k, v projections."""
    batch, tokens, channels = x.shape
    heads = attn.num_heads
    q, k, v = (p(x).reshape(batch, tokens, heads, channels // heads).permute(0, 2, 1, 3) for p in attn_projs(attn))
    scores = (q @ k.transpose(-2, -1)) * attn.scale
    if size is not None:
        scores = scores + size.log()[:, None, None, :, 0]
    scores = scores.softmax(dim=-1)
    x = (scores @ v).transpose(1, 2).reshape(batch, tokens, channels)
    return attn.out_proj(x), k.mean(1)


def attn_projs(attn):
    return attn.q_proj, attn.k_proj, attn.v_proj


def official_tome_encoder(layers, x, r, class_token):
    """`ToMeBlock.forward` over the layers (prop_attn and trace_source on), then every patch given its group's token
    (`source.argmax(dim=1)`, as tome/vis.py reads the source map)."""
    info = {"r": parse_r(len(layers), r), "size": None, "source": None}
    for layer in layers:
        attended, metric = official_tome_attention(layer.self_attn, layer.layer_norm1(x), info["size"])
        x = x + attended
        step = info["r"].pop(0)
        if step > 0:
            merge, _ = official_bipartite_soft_matching(metric, step, class_token)
            info["source"] = official_merge_source(merge, x, info["source"])
            x, info["size"] = official_merge_wavg(merge, x, info["size"])
        x = x + layer.mlp(layer.layer_norm2(x))
    if info["source"] is None:
        return x
    return x.gather(1, info["source"].argmax(dim=1)[..., None].expand(-1, -1, x.shape[-1]))


@pytest.mark.parametrize(
    "family, r", [("llava_onevision", 40), ("llava_onevision", [300, 0]), ("llava_next_video", 25)]
)
def test_tome_in_siglip_and_clip_equals_the_official_blocks(family, r):
    """3 cases: SigLIP with a constant r and with a per-block list (half the frame merged in block 0), CLIP with its
    class token protected. In float64: float32 rounding (SDPA against the official softmax) can flip a near-tie of
    the random-weight towers' matching scores."""
    model = copy.deepcopy(model_and_processor(family)[0]).double()
    adapter = resolve_adapter(model)
    pixels = single_inputs(family)["pixel_values_videos"][0][:3].double()  # three frames
    tower = LlavaTower(adapter)
    last = adapter.vision_feature_layer()
    with torch.no_grad():
        x = tower.model.embeddings(pixels)
        if hasattr(tower.model, "pre_layrnorm"):
            x = tower.model.pre_layrnorm(x)
        want = official_tome_encoder(tower.layers[: last + 1], x, r, tower.class_token)
        pipeline = Pipeline(ToMe(r=r), family=family)
        ctx = vtc.Context(family=family)
        features, alive, run = tower.run(pixels, [3], last, pipeline, [ctx])
    torch.testing.assert_close(features[0], want, rtol=1e-7, atol=1e-7)
    assert alive[0].tolist() == [0, 1, 2]
    per_frame = tower.side**2 + tower.class_token
    schedule = parse_r(len(tower.layers), r)[: last + 1]
    assert len(run.tokens[0]) == 3 * (per_frame - sum(schedule))
    assert float(run.tokens[0].size.sum()) == 3 * per_frame


@pytest.mark.parametrize("family", QWEN)
def test_tome_on_qwen_keeps_its_count_with_every_survivor_at_its_own_cell(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    adapter = resolve_adapter(model)
    merge = 2
    grid_thw = inputs["video_grid_thw"]
    t, h, w = (int(v) for v in grid_thw[0].tolist())
    grid = (t, h // merge, w // merge)
    n = grid[0] * grid[1] * grid[2]
    pipeline = Pipeline(ToMe(), retention=0.25, family=family)
    promised = pipeline.retained_count(grid)
    assert promised == t * round(0.25 * grid[1] * grid[2])
    with torch.no_grad():
        output, run = QwenTower(adapter).run(
            inputs["pixel_values_videos"], grid_thw, [torch.arange(n)], pipeline, [vtc.Context(family=family)]
        )
    tokens = run.tokens[0]
    assert len(tokens) == promised
    assert float(tokens.size.sum()) == n  # every unit is in exactly one survivor
    assert bool((tokens.holder >= 0).all()) and bool((tokens.holder[tokens.cell] == torch.arange(len(tokens))).all())
    full = output.pooler_output[0]
    alive = torch.zeros(n, dtype=torch.bool)
    alive[tokens.cell] = True
    assert bool((full[~alive] == 0).all()) and bool((full[alive].abs().sum(-1) > 0).all())
    for spec in ("tome", "random+tome", "tome+random"):  # the count promised before the model ran, alone and composed
        promise = Pipeline(spec, 0.25, family=family).retained_count(grid)
        with vtc.patch(model, spec, retention=0.25) as handle, torch.no_grad():
            model(**inputs)
            assert handle.stats().visual_tokens_out == promise < n, spec


def test_tome_on_llava_saves_tower_blocks_and_keeps_every_llm_token():
    model, _ = model_and_processor("llava_onevision")
    inputs = single_inputs("llava_onevision")
    with torch.no_grad():
        want = model(**inputs).logits[:, -1]
        with vtc.patch(model, "tome", r=0) as handle:  # the official default: nothing merged, the tower untouched
            assert torch.equal(model(**inputs).logits[:, -1], want)
        with vtc.patch(model, "tome", r=100) as handle:
            got = model(**inputs).logits[:, -1]
            stats = handle.stats()
    assert stats.llm_tokens_in == stats.visual_tokens_in
    reports = stats.reports["tome"]
    frames = stats.grids[0][0]
    assert (reports["tower_tokens_in"], reports["tower_tokens_out"]) == ([frames * 729], [frames * (729 - 200)])
    assert not torch.equal(got, want)


def test_bad_tome_inputs_name_the_problem():
    model, _ = model_and_processor("llava_onevision")
    with pytest.raises(ValueError, match="no method of 'tome' changes that count on llava_onevision.*tome.r"):
        vtc.patch(model, "tome", retention=0.25)
    with pytest.raises(ValueError, match="r must be >= 0"):
        ToMe(r=-1)
    with pytest.raises(ValueError, match="one per block"):
        ToMe(r=[2, -1])
    with pytest.raises(ValueError, match="reads the vision tower's attention"):
        Pipeline([ToMe(), vtc.registry()["visionzip"]()], retention=0.5)
    qwen, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    with pytest.raises(ValueError, match="merges at most half of what is left per block"), torch.no_grad():
        with vtc.patch(qwen, "tome", retention=0.05):
            qwen(**inputs)
    with pytest.raises(ValueError, match="r=.*larger than the .* tokens"), torch.no_grad():
        with vtc.patch(qwen, "tome", r=[10_000]):
            qwen(**inputs)
