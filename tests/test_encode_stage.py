"""The encode stage on the HF backend (`vtc.hf.encode`): an encode method's survivors are what the vision tower runs
on and what the LLM receives, at their original positions, on the three Qwen families.

Independent checks: the tower on the units of some temporal patches equals the unpatched tower on those frames alone
(Qwen attends per temporal patch, windows included); the precomputed tower inputs vtc passes for a ragged subset
equal a brute-force derivation from the unpatched inputs; the LLM sees exactly the survivors, each at its original
M-RoPE (t, h, w); unpatch leaves nothing; what cannot be combined is refused with a message."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import vtc
from tests.conftest import batch_inputs, model_and_processor, single_inputs
from tests.probes import llm_inputs
from vtc.hf.adapters import resolve_adapter
from vtc.hf.encode import frame_seqlens, window_kwargs

QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@vtc.method("t_keep_temporal_patches", paper="test")
class KeepTemporalPatches(vtc.PatchSelector):
    """Keep every unit of the listed temporal patches."""

    patches: tuple[int, ...] = (0, 2)

    def retained_count(self, num_tokens, grid, family):
        return None

    def choose(self, patches, count, ctx):
        frame, _, _ = patches.frame_row_col()
        return torch.nonzero(torch.isin(frame, torch.tensor(self.patches))).flatten()


@vtc.method("t_keep_pattern", paper="test")
class KeepPattern(vtc.PatchSelector):
    """Drop every unit whose grid index is 1 mod 3, and every unit of temporal patch 1 (an emptied frame)."""

    def retained_count(self, num_tokens, grid, family):
        return None

    def choose(self, patches, count, ctx):
        frame, _, _ = patches.frame_row_col()
        return torch.nonzero((patches.kept % 3 != 1) & (frame != 1)).flatten()


def video_rows(inputs, patches: list[int], merge_unit_rows: int):
    """The rows of `pixel_values_videos` and the grid of the listed temporal patches of a one-video input."""
    t, h, w = inputs["video_grid_thw"][0].tolist()
    per = h * w
    rows = torch.cat([torch.arange(p * per, (p + 1) * per) for p in patches])
    grid = torch.tensor([[len(patches), h, w]])
    return inputs["pixel_values_videos"][rows], grid


@pytest.mark.parametrize("family", QWEN)
def test_tower_on_kept_temporal_patches_equals_the_tower_on_those_frames(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    outer = resolve_adapter(model).outer
    pixels, grid = inputs["pixel_values_videos"], inputs["video_grid_thw"]
    t, h, w = grid[0].tolist()
    assert t >= 3
    sub_pixels, sub_grid = video_rows(inputs, [0, 2], 4)
    with torch.no_grad():
        want = outer.get_video_features(sub_pixels, sub_grid)
        handle = vtc.patch(model, KeepTemporalPatches())
        try:
            got = outer.get_video_features(pixels, grid)
        finally:
            handle.unpatch()
    per = (h // 2) * (w // 2)
    kept = torch.cat([torch.arange(0, per), torch.arange(2 * per, 3 * per)])
    full = got.pooler_output[0]
    assert full.shape[0] == t * per  # the model's own placeholder check still holds
    torch.testing.assert_close(full[kept], want.pooler_output[0], rtol=1e-5, atol=1e-5)
    dropped = torch.ones(t * per, dtype=torch.bool)
    dropped[kept] = False
    assert bool((full[dropped] == 0).all())
    if family == "qwen3_vl":  # DeepStack taps follow the same survivors
        for level, ref in zip(got.deepstack_features, want.deepstack_features):
            torch.testing.assert_close(level[0][kept], ref[0], rtol=1e-5, atol=1e-5)


def brute_force_window_inputs(grid_thw, kept: list[torch.Tensor], vision_config):
    """`window_index` / `cu_window_seqlens` for the survivors by loops over the unpatched window structure."""
    from transformers.vision_utils import get_vision_window_index

    merge = vision_config.spatial_merge_size
    index, cu = get_vision_window_index(grid_thw, merge, vision_config.window_size, vision_config.patch_size)
    alive = set()
    offset = 0
    for (t, h, w), k in zip(grid_thw.tolist(), kept):
        alive.update(offset + int(u) for u in k)
        offset += t * (h // merge) * (w // merge)
    order = sorted(alive)
    rank = {u: i for i, u in enumerate(order)}
    slots = index.tolist()
    bounds = [int(b) // (merge * merge) for b in cu.tolist()]
    new_index, lengths = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        members = [rank[u] for u in slots[a:b] if u in alive]
        new_index.extend(members)
        if members:
            lengths.append(len(members) * merge * merge)
    cu_new = [0]
    for n in lengths:
        cu_new.append(cu_new[-1] + n)
    return new_index, cu_new


@pytest.mark.parametrize("family", ("qwen2_vl", "qwen2_5_vl"))
def test_tower_inputs_of_a_ragged_subset_match_a_brute_force_derivation(family):
    model, _ = model_and_processor(family)
    inputs = batch_inputs(family)  # two videos of different sizes
    adapter = resolve_adapter(model)
    vision = model.config.vision_config
    grid = inputs["video_grid_thw"]
    units = [int(t) * (int(h) // 2) * (int(w) // 2) for t, h, w in grid.tolist()]
    generator = torch.Generator().manual_seed(0)
    kept = [torch.sort(torch.randperm(n, generator=generator)[: n // 3]).values for n in units]
    # segments: one per temporal patch with survivors, by counting
    lengths = []
    for (t, h, w), k in zip(grid.tolist(), kept):
        per = (h // 2) * (w // 2)
        lengths.extend(4 * sum(1 for u in k.tolist() if u // per == f) for f in range(t))
    cu = [0]
    for n in (n for n in lengths if n):
        cu.append(cu[-1] + n)
    assert frame_seqlens(grid, kept, 2).tolist() == cu
    rows = torch.cat([(off + k[:, None]) * 4 + torch.arange(4) for k, off in zip(kept, [0, units[0]])]).flatten()
    inputs_vtc = adapter.survivor_tower_inputs(grid, kept, rows)
    from transformers.vision_utils import get_vision_position_ids

    full_positions = get_vision_position_ids(grid, 2)
    assert torch.equal(inputs_vtc["position_ids"], full_positions[rows])
    if family == "qwen2_5_vl":
        want_index, want_cu = brute_force_window_inputs(grid, kept, vision)
        got = window_kwargs(grid, kept, vision)
        assert got["window_index"].tolist() == want_index
        assert got["cu_window_seqlens"].tolist() == want_cu


@pytest.mark.parametrize("family", QWEN)
def test_llm_sees_the_survivors_at_their_original_positions(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    full_embeds, full_positions, _ = llm_inputs(model, inputs)
    embeds, positions, handle = llm_inputs(model, inputs, KeepPattern())
    stats = handle.stats()
    t, h, w = (int(v) for v in inputs["video_grid_thw"][0].tolist())
    grid = (t, h // 2, w // 2)
    n = grid[0] * grid[1] * grid[2]
    cells = torch.arange(n)
    kept = cells[(cells % 3 != 1) & (cells // (grid[1] * grid[2]) != 1)]
    assert stats.visual_tokens_in == n and stats.llm_tokens_in == kept.numel()
    assert [(r.stage, r.plugin, r.tokens_in, r.tokens_out) for r in stats.stages] == [
        ("encode", "t_keep_pattern", n, kept.numel())
    ]
    assert embeds.shape[0] == full_embeds.shape[0] - (n - kept.numel())
    # the survivors' M-RoPE rows are their original ones (video tokens of the unpatched prompt at `kept`)
    video_token = model.config.video_token_id
    ids = inputs["input_ids"][0]
    video_at = torch.nonzero(ids == video_token).flatten()
    original = full_positions[-3:, 0, video_at[kept]]
    is_video = torch.zeros(ids.numel(), dtype=torch.bool)
    is_video[video_at[kept]] = True
    keep_seq = (ids != video_token) | is_video
    got = positions[-3:, 0] if positions.dim() == 3 else positions
    assert torch.equal(got[:, torch.nonzero(is_video[keep_seq]).flatten()], original)
    # text embeddings are untouched
    torch.testing.assert_close(embeds[~is_video[keep_seq]], full_embeds[ids != video_token])


@pytest.mark.parametrize("family", ("qwen2_vl", "qwen3_vl"))
def test_generate_with_an_encode_method_and_a_connect_method(family):
    model, processor = model_and_processor(family)
    inputs = single_inputs(family)
    handle = vtc.patch(model, [KeepTemporalPatches(), vtc.registry()["random"](ratio=0.5)])
    try:
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        stats = handle.stats()
    finally:
        handle.unpatch()
    t, h, w = (int(v) for v in inputs["video_grid_thw"][0].tolist())
    per = (h // 2) * (w // 2)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3
    assert [(r.stage, r.tokens_in, r.tokens_out) for r in stats.stages] == [
        ("encode", t * per, 2 * per),
        ("connect", 2 * per, per),
    ]


def test_unpatch_removes_the_tower_hook_and_other_models_are_untouched():
    model, _ = model_and_processor("qwen2_vl")
    other, _ = model_and_processor("qwen2_vl", size="demo")
    outer = resolve_adapter(model).outer
    handle = vtc.patch(model, KeepTemporalPatches())
    assert "get_video_features" in outer.__dict__
    assert "get_video_features" not in resolve_adapter(other).outer.__dict__
    handle.unpatch()
    assert "get_video_features" not in outer.__dict__


@pytest.mark.parametrize("family", ("qwen2_vl", "qwen2_5_vl"))
def test_a_padded_batch_equals_its_prompts_one_by_one(family):
    model, _ = model_and_processor(family)
    batch = batch_inputs(family)
    embeds, _, handle = llm_inputs(model, batch, KeepPattern())
    counts = handle.stats().llm_tokens_per_video
    alone = []
    for which in (0, 1):
        _, _, h = llm_inputs(model, single_inputs(family, which), KeepPattern())
        alone.append(h.stats().llm_tokens_per_video[0])
    assert counts == alone


def test_refusals_name_the_problem():
    llava, _ = model_and_processor("llava_onevision")
    with pytest.raises(ValueError, match="encode_units"):
        vtc.patch(llava, KeepTemporalPatches())
    with pytest.raises(ValueError, match="reads the vision tower's attention"):
        vtc.core.pipeline.Pipeline([KeepTemporalPatches(), vtc.registry()["visionzip"]()], retention=0.5)
    assert vtc.registry()["holitom"].card.whole_frames
    with pytest.raises(ValueError, match="needs whole frames"):
        vtc.core.pipeline.Pipeline([KeepTemporalPatches(), vtc.registry()["holitom"]()], retention=0.5)
    from vtc.vllm.config import ServeConfig

    with pytest.raises(ValueError, match="between the vision tower's blocks, but its count depends on the content"):
        ServeConfig.from_dict({"methods": "earlytom", "retention": 0.5}).check_methods()


@vtc.method("t_random_units", paper="test")
class RandomUnits(vtc.PatchSelector):
    """A seeded random subset of the units (ctx.generator)."""

    def choose(self, patches, count, ctx):
        return torch.randperm(len(patches), generator=ctx.generator)[:count]


def test_encode_methods_get_a_generator_seeded_per_video():
    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    runs = []
    for seed in (0, 0, 1):
        embeds, _, handle = llm_inputs(model, inputs, RandomUnits(), retention=0.5, seed=seed)
        stats = handle.stats()
        assert stats.llm_tokens_in == round(0.5 * stats.visual_tokens_in)
        runs.append(embeds)
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


@vtc.method("t_state_probe", paper="test")
class StateProbe(vtc.PatchSelector):
    """Keeps everything; records the ctx.state it finds in encode and connect, and writes to it in encode."""

    seen: ClassVar[list] = []

    def retained_count(self, num_tokens, grid, family):
        return None

    def choose(self, patches, count, ctx):
        StateProbe.seen.append(("encode", dict(ctx.state)))
        ctx.state["encoded"] = ctx.state.get("encoded", 0) + 1
        return torch.arange(len(patches))

    def connect(self, tokens, ctx):
        StateProbe.seen.append(("connect", dict(ctx.state)))
        return tokens


def test_encode_state_is_fresh_per_prompt_and_reaches_connect():
    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    StateProbe.seen.clear()
    with vtc.patch(model, StateProbe()):
        for _ in range(2):
            with torch.no_grad():
                model(**inputs)
    assert StateProbe.seen == [("encode", {}), ("connect", {"encoded": 1})] * 2
