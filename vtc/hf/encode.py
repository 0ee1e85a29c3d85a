"""The encode stage on the HF backend: a pipeline's encode methods choose each video's surviving merge units, and the
vision tower runs on those alone.

`EncodeStage` sets one instance attribute, `get_video_features`, on the outer multimodal model (the method its
forward and `generate` call to encode videos; images keep the model's own path); `remove` deletes it. For every call
it builds each video's `VideoPatches`, runs `Pipeline.run_encode`, and, where units were dropped, calls the tower
with the survivors' rows of `pixel_values_videos` and the tower inputs transformers lets a caller precompute
(`transformers.vision_utils`): the survivors' 2-D rotary rows, one attention segment per temporal patch (their
lengths shrunk; an emptied one is left out), Qwen2.5-VL's window order and window lengths restricted to the
survivors, Qwen3-VL's position-embedding interpolation rows. The merger gets complete units. The tower's output is
scattered back onto the whole grid (dropped units are zero rows, with DeepStack features alike), so the model's own
placeholder check and scatter still hold; the text-model hook of `vtc.hf.patching` then keeps only the survivors
(`survivors(k)`), each at its original (t, h, w).

This is the official PixelPrune hook (`_vision_forward`: patch embedding, rotary and position embeddings gathered by
the kept indices, `cu_seqlens` from the kept counts), done through transformers' precomputed-input keywords instead
of a replaced forward.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F

from vtc.core.patches import VideoPatches
from vtc.core.pipeline import Pipeline
from vtc.core.tokens import Context

Tensor = torch.Tensor


@dataclasses.dataclass
class EncodedVideo:
    """What the encode stage did to one video of the last encoding call."""

    grid: tuple[int, int, int]  # LLM token grid (T, H, W)
    kept: Tensor  # cells of the LLM grid that reach the LLM, ascending
    records: list[tuple]  # (method, tokens in, tokens out, seconds, reports) per encode method
    weight: Tensor | None = None  # [len(kept)]: how many original tokens each stands for (None: one each)


def survivor_rows(kept: list[Tensor], units_per_video: list[int], unit: int) -> Tensor:
    """Rows of the concatenated `pixel_values_videos` holding the surviving units' patches."""
    rows, offset = [], 0
    for k, n in zip(kept, units_per_video):
        rows.append((offset + k[:, None]) * unit + torch.arange(unit, device=k.device))
        offset += n
    return torch.cat(rows).flatten()


def frame_seqlens(grid_thw: Tensor, kept: list[Tensor], merge: int) -> Tensor:
    """`cu_seqlens` of the survivors: one attention segment per temporal patch of every video (Qwen's per-frame
    attention), holding its surviving patches; a temporal patch with no survivor has no segment."""
    lengths = []
    unit = merge * merge
    for (t, h, w), k in zip(grid_thw.tolist(), kept):
        per_frame = (h // merge) * (w // merge)
        lengths.append(torch.bincount(k // per_frame, minlength=int(t)) * unit)
    lengths = torch.cat(lengths)
    lengths = lengths[lengths > 0]
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)).to(grid_thw.device)


def window_kwargs(grid_thw: Tensor, kept: list[Tensor], vision_config) -> dict[str, Tensor]:
    """Qwen2.5-VL's window attention restricted to the survivors: `window_index` (window order of the survivors'
    units, numbered among the survivors) and `cu_window_seqlens` (each window's surviving patches; an emptied window
    has no segment)."""
    from transformers.vision_utils import get_vision_window_index

    merge = int(vision_config.spatial_merge_size)
    index, cu_windows = get_vision_window_index(
        grid_thw, merge, int(vision_config.window_size), int(vision_config.patch_size)
    )
    index = index.to(grid_thw.device)
    units_per_video = [int(t) * (int(h) // merge) * (int(w) // merge) for t, h, w in grid_thw.tolist()]
    offsets = torch.tensor([0, *units_per_video[:-1]], device=grid_thw.device).cumsum(0)
    flat_kept = torch.cat([k.to(grid_thw.device) + o for k, o in zip(kept, offsets)])
    rank = torch.full((sum(units_per_video),), -1, dtype=torch.long, device=grid_thw.device)
    rank[flat_kept] = torch.arange(flat_kept.numel(), device=grid_thw.device)
    unit = merge * merge
    bounds = cu_windows.to(grid_thw.device).long() // unit  # window boundaries in window-order slots
    window_of_slot = torch.bucketize(torch.arange(index.numel(), device=grid_thw.device), bounds[1:], right=True)
    alive = rank[index] >= 0
    lengths = torch.bincount(window_of_slot[alive], minlength=bounds.numel() - 1) * unit
    lengths = lengths[lengths > 0]
    return {
        "window_index": rank[index][alive],
        "cu_window_seqlens": F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)),
    }


def scatter_units(values: Tensor, kept: list[Tensor], units_per_video: list[int]) -> tuple[Tensor, ...]:
    """Per video [units, D]: the survivors' rows of `values` [sum kept, D] at their units, zeros elsewhere."""
    out, start = [], 0
    for k, n in zip(kept, units_per_video):
        full = values.new_zeros(n, values.shape[-1])
        full[k.to(values.device)] = values[start : start + k.numel()]
        out.append(full)
        start += k.numel()
    return tuple(out)


def pixel_normalization(adapter, processor: Any = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) per channel with which the processor normalised the video pixels: those of the processor passed
    to `vtc.patch` (its video processor), else the defaults of the family's video processor class."""
    video_processor = getattr(processor, "video_processor", None)
    if video_processor is None:
        import transformers

        video_processor = getattr(transformers, adapter.video_processor_class)
    mean, std = video_processor.image_mean, video_processor.image_std
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


class EncodeStage:
    """Runs `pipeline`'s encode methods inside `adapter.model`'s video encoding (see the module docstring)."""

    def __init__(
        self,
        adapter,
        pipeline: Pipeline,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        seed: int = 0,
        image_pipeline: Callable[[], Pipeline | None] | None = None,
    ) -> None:
        self.adapter = adapter
        self.pipeline = pipeline
        self.image_pipeline = image_pipeline  # the pipeline of images (None: images pass whole), built on first use
        self.mean, self.std = tuple(mean), tuple(std)
        self.seed = seed
        self.enabled = True
        self.encoded: list[EncodedVideo] | None = None  # the last encoding call's videos, until the prefill takes them
        self.encoded_images: list[EncodedVideo] | None = None  # the same for images (Qwen families)
        # LLaVA images: what the tower methods did (tokens unmerged before the projector: every cell reaches the LLM)
        self.image_records: list[list[tuple]] | None = None
        self._original = None
        self._original_images = None
        self._in_video_call = False  # Qwen3-VL's get_video_features calls get_image_features: that is a video
        self._original_tower = None
        self._llava_call: dict[str, Any] | None = None  # the video call in progress (LLaVA)

    def install(self) -> None:
        outer = self.adapter.outer
        self._original = outer.get_video_features
        # instance attributes: other models (and this model's class) are untouched
        if "encode_units" in self.adapter.record.features:
            outer.get_video_features = self._get_video_features
            if self.image_pipeline is not None:  # Qwen: an image is encoded as a video of one temporal patch
                self._original_images = outer.get_image_features
                outer.get_image_features = self._get_image_features
        else:  # LLaVA: the model's own get_video_features, whose tower call vtc answers (`_tower_forward`)
            outer.get_video_features = self._get_llava_video_features
            if self.image_pipeline is not None:  # images: tower methods between the blocks, as for video frames
                original = outer.get_image_features

                @functools.wraps(original)  # generate picks the call's arguments by its signature
                def get_image_features(*args, **kwargs):
                    return self._get_llava_image_features(original, *args, **kwargs)

                self._original_images = original
                outer.get_image_features = get_image_features
            tower = self.adapter.vision_tower
            self._original_tower = tower.forward
            tower.forward = self._tower_forward

    def remove(self) -> None:
        outer = self.adapter.outer
        for name in ("get_video_features", "get_image_features"):
            if name in outer.__dict__:
                del outer.__dict__[name]
        tower = self.adapter.vision_tower
        if "forward" in tower.__dict__:
            del tower.__dict__["forward"]
        self.encoded = self.encoded_images = self.image_records = None
        self._llava_call = None

    def take(self, kind: str = "video") -> list[EncodedVideo] | None:
        """The videos (or images) of the last encoding call (once: a later prompt must encode its own)."""
        if kind == "image":
            encoded, self.encoded_images = self.encoded_images, None
            return encoded
        encoded, self.encoded = self.encoded, None
        return encoded

    # --- the wrapped calls ------------------------------------------------------------------------------------
    def _get_video_features(self, pixel_values_videos: Tensor, video_grid_thw: Tensor | None = None, **kwargs: Any):
        if not self.enabled or video_grid_thw is None:
            return self._original(pixel_values_videos, video_grid_thw, **kwargs)
        if self.encoded_images is None:  # else this prompt's images began it (a Qwen forward encodes them first)
            self.pipeline.begin_prompt()  # the prompt's processing starts here: its methods' ctx.state starts empty
        self._in_video_call = True
        try:
            output, self.encoded = self._encode_units(
                self.pipeline, self._original, pixel_values_videos, video_grid_thw, kwargs
            )
        finally:
            self._in_video_call = False
        return output

    def _get_image_features(self, pixel_values: Tensor, image_grid_thw: Tensor | None = None, **kwargs: Any):
        """Images through the image pipeline's encode methods (`Pipeline.for_images`), as videos of one temporal
        patch: PixelPrune's official setting is exactly this (Qwen images)."""
        images = self.enabled and image_grid_thw is not None and not self._in_video_call
        pipeline = self.image_pipeline() if images else None
        if pipeline is None or not pipeline.has_stage("encode"):
            return self._original_images(pixel_values, image_grid_thw, **kwargs)
        self.pipeline.begin_prompt()  # the prompt's first encoding call: its methods' ctx.state starts empty
        pipeline.share_prompt_state(self.pipeline)
        output, self.encoded_images = self._encode_units(
            pipeline, self._original_images, pixel_values, image_grid_thw, kwargs
        )
        return output

    def _encode_units(self, pipeline: Pipeline, original, pixels: Tensor, grid_thw: Tensor, kwargs: dict[str, Any]):
        """One tower call of a Qwen model's videos (or images) with `pipeline`'s encode methods -> (the call's
        output, what each item kept)."""
        adapter = self.adapter
        vision = adapter.model.config.vision_config
        merge = int(vision.spatial_merge_size)
        patch_shape = (int(vision.in_channels), int(vision.temporal_patch_size), int(vision.patch_size)) + (
            int(vision.patch_size),
        )
        sizes = grid_thw.prod(-1).tolist()
        ctx = Context(retention=pipeline.retention, family=adapter.family, geometry=adapter.geometry)
        encoded: list[EncodedVideo] = []
        for k, (rows, grid) in enumerate(zip(torch.split(pixels, sizes), grid_thw.tolist())):
            patches = VideoPatches.from_rows(rows, grid, merge, patch_shape, self.mean, self.std)
            generator = torch.Generator(device="cpu").manual_seed(self.seed)  # afresh per item, as for connect
            out, records = pipeline.run_encode(patches, ctx.replace(video_index=k, generator=generator))
            encoded.append(EncodedVideo(patches.grid, out.kept, records))
        if pipeline.tower_entries() and any(pipeline.changes_tower(e.grid) for e in encoded):
            return self._encode_in_tower(pipeline, pixels, grid_thw, encoded, ctx, kwargs), encoded
        if all(len(e.kept) == e.grid[0] * e.grid[1] * e.grid[2] for e in encoded):
            return original(pixels, grid_thw, **kwargs), encoded
        return self._encode_survivors(pixels, grid_thw, [e.kept for e in encoded], kwargs), encoded

    def _contexts(self, ctx: Context, videos: int) -> list[Context]:
        """One context per video, each with a generator seeded afresh (as the pre-tower and connect stages)."""
        return [
            ctx.replace(video_index=k, generator=torch.Generator(device="cpu").manual_seed(self.seed))
            for k in range(videos)
        ]

    def _encode_in_tower(
        self, pipeline: Pipeline, pixels: Tensor, grid_thw: Tensor, encoded: list[EncodedVideo], ctx: Context, kwargs
    ):
        """The Qwen tower block by block with the tower methods (`vtc.hf.tower.QwenTower`) on what the pre-tower
        methods left; every surviving token is one LLM token at its own cell."""
        from vtc.hf.tower import QwenTower

        return_dict = kwargs.pop("return_dict", True)
        visual, runs = self.adapter.vision_tower, []

        def forward(hidden_states, grid_thw, **_):
            contexts = self._contexts(ctx, len(encoded))
            output, run = QwenTower(self.adapter).run(
                hidden_states, grid_thw, [e.kept for e in encoded], pipeline, contexts
            )
            runs.append(run)
            return output

        visual.forward = forward  # called through the module, so its hooks (timers, the user's) see the tower run
        try:
            output = visual(pixels, grid_thw=grid_thw)
        finally:
            del visual.__dict__["forward"]
        run = runs[0]
        counts = []
        for e, tokens in zip(encoded, run.tokens):
            order = torch.argsort(tokens.cell)
            counts.append((len(e.kept), len(tokens)))
            e.kept, e.weight = tokens.cell[order], tokens.size[order]
        for e, rows in zip(encoded, run.records(counts)):
            e.records.extend(rows)
        return output if return_dict else output.to_tuple()

    # --- LLaVA: the tower answered block by block inside the model's own get_video_features ------------------
    def _get_llava_video_features(self, pixel_values_videos: Tensor, *args: Any, **kwargs: Any):
        if not self.enabled:
            return self._original(pixel_values_videos, *args, **kwargs)
        adapter = self.adapter
        layer = kwargs.get("vision_feature_layer", args[0] if args else None)
        if layer is None:
            layer = adapter.model.config.vision_feature_layer
        if not isinstance(layer, int):
            raise ValueError(
                f"vtc's tower methods read one vision_feature_layer; this call concatenates layers {layer}"
            )
        batch, frames = pixel_values_videos.shape[:2]
        ctx = Context(retention=self.pipeline.retention, family=adapter.family, geometry=adapter.geometry)
        self.pipeline.begin_prompt()
        self._llava_call = {"frames": [frames] * batch, "layer": layer, "ctx": ctx}
        try:
            return self._original(pixel_values_videos, *args, **kwargs)
        finally:
            self._llava_call = None

    def _get_llava_image_features(self, original, *args: Any, **kwargs: Any):
        """The model's own get_image_features, its tower call answered block by block with the image pipeline's
        tower methods (ToMe), every view of an image one frame of it. Tower compute only: the views are unmerged
        before the projector, so the packing and the LLM see every token."""
        pipeline = self.image_pipeline() if self.enabled else None
        if pipeline is None or not pipeline.tower_entries():
            return original(*args, **kwargs)
        adapter = self.adapter
        call = inspect.signature(original).bind(*args, **kwargs).arguments
        layer = call.get("vision_feature_layer")
        layer = adapter.model.config.vision_feature_layer if layer is None else layer
        if not isinstance(layer, int):
            raise ValueError(
                f"vtc's tower methods read one vision_feature_layer; this call concatenates layers {layer}"
            )
        sizes, counts = call["image_sizes"].tolist(), call.get("batch_num_images")
        split = [True] * len(sizes) if counts is None else [int(n) == 1 for n in counts for _ in range(int(n))]
        views = [adapter.anyres_layout(size, s).views for size, s in zip(sizes, split)]
        ctx = Context(retention=pipeline.retention, family=adapter.family, geometry=adapter.geometry)
        self.pipeline.begin_prompt()  # the prompt's first encoding call (images come before videos)
        pipeline.share_prompt_state(self.pipeline)
        self._llava_call = {"frames": views, "layer": layer, "ctx": ctx, "pipeline": pipeline, "kind": "image"}
        try:
            return original(*args, **kwargs)
        finally:
            self._llava_call = None

    def _tower_forward(self, pixel_values: Tensor, *args: Any, **kwargs: Any):
        """The vision tower's forward inside a video (or image) call: the encoder block by block up to the feature
        layer, its output unmerged onto every frame's (view's) grid, returned where the model reads it
        (`hidden_states[layer]`)."""
        call = self._llava_call
        if call is None:  # any call outside a feature call vtc answers: the tower as it is
            return self._original_tower(pixel_values, *args, **kwargs)
        from vtc.core.tower import pooled_survivors
        from vtc.hf.adapters.base import tower_feature_layer
        from vtc.hf.tower import LlavaTower

        adapter = self.adapter
        _install_output_hooks(adapter.vision_tower)
        tower = LlavaTower(adapter)
        frames, num_layers = call["frames"], len(tower.layers)
        pipeline = call.get("pipeline", self.pipeline)
        last = tower_feature_layer(call["layer"], num_layers)
        run = None
        if pipeline.changes_tower((frames[0], tower.side, tower.side)):
            contexts = self._contexts(call["ctx"], len(frames))
            features, _, run = tower.run(pixel_values, frames, last, pipeline, contexts)
        if call.get("kind") == "image":  # every patch of every view reaches the projector
            counts = [(f * tower.side * tower.side,) * 2 for f in frames]
            self.image_records = None if run is None else run.records(counts)
            return self._tower_output(run, features if run else None, last, num_layers, pixel_values, args, kwargs)
        h, w = adapter.frame_grid()
        encoded, counts = [], []
        for k, f in enumerate(frames):
            if run is None:
                kept, weight = torch.arange(f * h * w), None
            else:  # a pooled cell stands for as many frames as its frame's tokens do (shared with vLLM)
                kept, weight = pooled_survivors(run.tokens[k], h * w)
            counts.append((f * h * w, kept.numel()))
            encoded.append(EncodedVideo((f, h, w), kept, [], weight))
        if run is not None:
            for e, rows in zip(encoded, run.records(counts)):
                e.records.extend(rows)
        self.encoded = encoded
        return self._tower_output(run, features if run else None, last, num_layers, pixel_values, args, kwargs)

    def _tower_output(self, run, features, last: int, num_layers: int, pixel_values: Tensor, args, kwargs):
        """The tower's own forward when no method changed anything, else the unmerged features where the model
        reads them (`hidden_states[last + 1]`)."""
        if run is None:
            return self._original_tower(pixel_values, *args, **kwargs)
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        states: list[Tensor | None] = [None] * (num_layers + 1)
        states[last + 1] = torch.cat(features)
        return BaseModelOutputWithPooling(last_hidden_state=states[last + 1], hidden_states=tuple(states))

    def _encode_survivors(self, pixels: Tensor, grid_thw: Tensor, kept: list[Tensor], kwargs: dict[str, Any]):
        """The tower on the survivors' rows, its outputs scattered back onto every video's whole grid."""
        adapter = self.adapter
        visual = adapter.vision_tower
        merge = int(adapter.model.config.vision_config.spatial_merge_size)
        units = [int(t) * (int(h) // merge) * (int(w) // merge) for t, h, w in grid_thw.tolist()]
        rows = survivor_rows(kept, units, merge * merge).to(pixels.device)
        inputs = adapter.survivor_tower_inputs(grid_thw, kept, rows)
        return_dict = kwargs.pop("return_dict", True)  # the wrapped method's `can_return_tuple` contract
        kwargs = {**kwargs, **inputs, "return_dict": True}
        output = visual(pixels[rows].type(visual.dtype), grid_thw=grid_thw, **kwargs)
        output.pooler_output = scatter_units(output.pooler_output, kept, units)
        if getattr(output, "deepstack_features", None) is not None:
            output.deepstack_features = [scatter_units(f, kept, units) for f in output.deepstack_features]
        return output if return_dict else output.to_tuple()


def _install_output_hooks(tower) -> None:
    """The output-recording hooks transformers installs on a tower the first time it is asked for hidden states
    (`maybe_install_capturing_hooks`): vtc answers that call itself, so it installs them as the tower's own forward
    would, and the model is left as an unpatched run leaves it."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # pragma: no cover - other transformers versions install no such hooks
        return
    maybe_install_capturing_hooks(tower)
