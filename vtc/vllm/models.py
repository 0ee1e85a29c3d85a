"""vLLM's five video-LLM classes with vtc's connect engine in `embed_multimodal`, and their processors sizing
each video's placeholders to `retained_count`.

`vtc.vllm.plugin.register` registers these classes under vLLM's architecture names (lazily, by string), so
`vllm serve` picks them for the five families. Without a vtc config they are vLLM's classes, unchanged. With
one (`additional_config={"vtc": {...}}`):

  processor (API server): each video's replacement is `retained_count(grid)` placeholders, counted with the
      request's own settings when it sends some (`mm_processor_kwargs={"vtc": {...}}`, checked here: a value
      the server does not allow is an HTTP 400), which travel to the model with the video (`vtc_settings`);
      LLaVA-OneVision keeps its newline, Qwen3-VL reserves the whole per-video span (timestamps included), as
      vLLM's own pruning lays it out. Encode-stage methods (Qwen) run here, on the processor's pixels: the kept
      merge units travel with the video too (`vtc_kept`), and the count starts from them (`vtc.vllm.encode`);
  model (each worker): the vision encoder runs as usual (statistics captured if a method asks; on the survivors'
      patches alone after an encode method; block by block with the tower methods between its blocks, on the Qwen
      towers and LLaVA's SigLIP / CLIP alike, `vtc.vllm.tower`), then `vtc.core.engine.connect_video` compresses
      each video (a tower method's connect stage, GRT's, with the state its tower run left for that video). The
      survivors go back frame by frame, in the order vtc's HF backend uses; on the Qwen families every image and
      video also carries its slots' stock M-RoPE positions (`vtc.vllm.positions`, vtc's own position computation,
      which places several videos, images and chunked prefills right).

The encoder cache therefore holds media-only results: nothing here reads the question. vLLM keys the encoder and
processor caches on the request's `mm_processor_kwargs` too, so per-request settings never share an entry (the
encode stage's kept units are part of the processed item, so they are cached with it, under the same key).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.models.llava_next_video import (
    LlavaNextVideoDummyInputsBuilder,
    LlavaNextVideoForConditionalGeneration,
    LlavaNextVideoMultiModalProcessor,
    LlavaNextVideoProcessingInfo,
)
from vllm.model_executor.models.llava_onevision import (
    LlavaOnevisionDummyInputsBuilder,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionMultiModalProcessor,
    LlavaOnevisionProcessingInfo,
)
from vllm.model_executor.models.qwen2_5_vl import (
    Qwen2_5_VLDummyInputsBuilder,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLMultiModalProcessor,
    Qwen2_5_VLProcessingInfo,
)
from vllm.model_executor.models.qwen2_vl import (
    Qwen2VLDummyInputsBuilder,
    Qwen2VLForConditionalGeneration,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
)
from vllm.model_executor.models.qwen3_vl import (
    Qwen3VLDummyInputsBuilder,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.processing import PromptReplacement

from vtc.core.engine import connect_video, grid_cells
from vtc.core.geometry import FamilyGeometry
from vtc.core.pipeline import Pipeline
from vtc.core.tokens import Context
from vtc.core.tower import TowerTokens, pooled_survivors
from vtc.hf.adapters.base import AnyresLayout, anyres_view_stat
from vtc.hf.prepool import PrepoolCapture
from vtc.vllm.config import CONFIG_ATTR, KEY, ServeConfig, request_question, without_question
from vtc.vllm.encode import KEPT_FIELD, choose_units, encode_survivors, encoded_count
from vtc.vllm.positions import (
    MediaSpan,
    append_positions,
    fill_positions,
    frame_span_extent,
    frame_span_positions,
    grid_extent,
    grid_positions,
    prompt_positions,
    split_positions,
)
from vtc.vllm.sampling import select_frames
from vtc.vllm.stages import holds_module, positions_from_previous_stage, positions_to_next_stage, with_stage_positions
from vtc.vllm.vision import EncoderStatsCapture, tp_group

Tensor = torch.Tensor
logger = init_logger("vllm.vtc")  # under vLLM's logger, so `vllm serve` shows it at INFO
LAST_KEPT: list[dict[str, Any]] = []  # the grid cells each video kept, newest last (tests and debugging)
SETTINGS_FIELD = "vtc_settings"  # per-video multimodal field: the request's own vtc settings, as JSON bytes
IMAGE_SETTINGS_FIELD = "vtc_image_settings"  # the same, per image (the families whose images vtc compresses)
IMAGE_KEPT_FIELD = "vtc_image_kept"  # per image: the merge units its encode stage kept (`KEPT_FIELD` of videos)
LAST_KEPT_IMAGES: list[dict[str, Any]] = []  # the grid cells each image kept, newest last (tests and debugging)


# --- configs: the server's, and one request's -------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _config(server_json: str, request_json: str) -> ServeConfig:
    config = ServeConfig.from_dict(json.loads(server_json))
    request = json.loads(request_json)
    return config.for_request(request) if request else config


@functools.lru_cache(maxsize=64)
def _pipeline(config_json: str, family: str) -> Pipeline:
    return ServeConfig.from_dict(json.loads(config_json)).pipeline(family)


def config_pipeline(config: ServeConfig, family: str) -> Pipeline:
    """The (cached) pipeline a config runs on `family`."""
    return _pipeline(json.dumps(config.to_dict(), sort_keys=True), family)


def server_config(hf_config) -> ServeConfig | None:
    """The config a served model was started with, or None when it runs without vtc."""
    raw = getattr(hf_config, CONFIG_ATTR, None)
    return _config(json.dumps(raw, sort_keys=True), "{}") if raw else None


def request_config(server: ServeConfig, settings: dict[str, Any]) -> ServeConfig:
    """`server` with one request's settings applied (ValueError naming what the server allows)."""
    return _config(json.dumps(server.to_dict(), sort_keys=True), json.dumps(settings, sort_keys=True))


def encode_settings(settings: dict[str, Any]) -> Tensor:
    """A request's settings as a uint8 tensor, the form a multimodal field can carry to the model."""
    return torch.tensor(list(json.dumps(settings, sort_keys=True).encode()), dtype=torch.uint8)


def decode_settings(value: Any) -> dict[str, Any]:
    data = value.tolist() if isinstance(value, torch.Tensor) else list(value)
    return json.loads(bytes(data).decode()) if data else {}


def _geometry(family: str, hf_config) -> FamilyGeometry:
    """The loaded model's geometry, computed by the HF adapter of the family from the same config."""
    from vtc.hf.adapters import config_adapter

    return config_adapter(family, hf_config).geometry


# --- model side ----------------------------------------------------------------------------------------------


class Serving:
    """One served model's compression: the configs its videos run with, the vision statistics they read, the
    connect engine call. `begin_call` takes the settings of the videos one `embed_multimodal` call encodes, and the
    merge units the prompt processor's encode stage kept of each."""

    def __init__(self, model: torch.nn.Module, family: str, config: ServeConfig) -> None:
        self.family = family
        self.model = model
        self.tower = model.visual if hasattr(model, "visual") else model.vision_tower  # Qwen / LLaVA
        # under vLLM's V2 runner with pipeline parallel, stages after the first hold no vision tower: only the
        # first stage encodes, so the others skip statistics and compression (they never see a video)
        self.encodes = holds_module(self.tower)
        self.config = config
        self.pipeline = config_pipeline(config, family)
        self.geometry = _geometry(family, model.config)
        self._captures: dict[frozenset, EncoderStatsCapture] = {}
        self._prepool_capture: PrepoolCapture | None = None
        self._configs: list[ServeConfig] = []
        # per kind ("video", "image"), per item of this call: the units its pre-tower methods kept, the (cells, sizes)
        # its tower methods left, its methods' ctx.state once its tower ran
        self._kept: dict[str, list[Tensor | None]] = {"video": [], "image": []}
        self._tower: dict[str, list[tuple[Tensor, Tensor] | None]] = {"video": [], "image": []}
        self._tower_state: dict[str, list[dict | None]] = {"video": [], "image": []}
        self._frame_tokens: list[TowerTokens | None] = []  # per video: what a SigLIP / CLIP tower's methods left
        self._vision: list[dict] = []
        self._image_configs: list[ServeConfig] = []  # per image of this call (`begin_images`)
        self._image_vision: list[dict] = []
        self._prepool: list[Tensor] | None = None
        self.served_model: ServedModel | None = None  # `ctx.model` of the connect methods that read the LM head
        if self.encodes:
            self.stats_capture(self.pipeline)  # checks the statistics the server's methods read, at start
            if any(e.card.reads_lm_head for e in self.pipeline.entries):  # GRT: the LM head, checked at start
                self.served_model = ServedModel(model)

    @classmethod
    def create(cls, model: torch.nn.Module, vllm_config, family: str) -> "Serving | None":
        raw = (
            (vllm_config.additional_config or {}).get(KEY) if isinstance(vllm_config.additional_config, dict) else None
        )
        if not raw:
            return None
        serving = cls(model, family, ServeConfig.from_dict(raw))
        _check_encoder_parallelism(vllm_config, serving)
        return serving

    @property
    def stats(self) -> EncoderStatsCapture | None:
        """The statistics capture of the server's own settings (None when its methods read none)."""
        return self.stats_capture(self.pipeline) if self.encodes else None

    def stats_capture(self, *pipelines: Pipeline) -> EncoderStatsCapture | None:
        """One capture for every vision statistic any of `pipelines` reads (None: they read none)."""
        stats = frozenset().union(*(p.vision_stats(self.family) for p in pipelines))
        if not stats:
            return None
        if stats not in self._captures:
            self._captures[stats] = EncoderStatsCapture(
                self.family, self.tower, self.model.config, set(stats), qwen=self.geometry.mrope
            )
        return self._captures[stats]

    def begin_call(self, settings: Any, kept: Any = None) -> None:
        """The settings of each video of this `embed_multimodal` call (`vtc_settings`; absent: the server's) and the
        merge units its encode stage kept (`vtc_kept`, ascending; absent: every unit, as in vLLM's profiling)."""
        rows = [] if settings is None else list(settings)
        self._configs = [request_config(self.config, decode_settings(row)) for row in rows]
        self._kept["video"] = _kept_units(kept)
        self._tower["video"], self._frame_tokens, self._tower_state["video"] = [], [], []

    def config_of(self, index: int) -> ServeConfig:
        return self._configs[index] if index < len(self._configs) else self.config

    def _context(self, pipeline: Pipeline, index: int, config: ServeConfig, **fields: Any) -> Context:
        """The connect / tower context of item `index` of this call: its pipeline's retention, the family, and a
        generator seeded with the item's own seed."""
        return Context(
            retention=pipeline.retention,
            family=self.family,
            geometry=self.geometry,
            video_index=index,
            generator=torch.Generator(device="cpu").manual_seed(config.seed),
            **fields,
        )

    # --- images (the families whose images vtc compresses) -------------------------------------------------------
    def begin_images(self, settings: Any, kept: Any = None) -> None:
        """The settings of each image of this `embed_multimodal` call (`vtc_image_settings`; absent: the server's)
        and the merge units its encode stage kept (`vtc_image_kept`; absent: every unit)."""
        rows = [] if settings is None else list(settings)
        self._image_configs = [request_config(self.config, decode_settings(row)) for row in rows]
        self._image_vision = []
        self._kept["image"] = _kept_units(kept)
        self._tower["image"], self._tower_state["image"] = [], []

    def image_config_of(self, index: int) -> ServeConfig:
        return self._image_configs[index] if index < len(self._image_configs) else self.config

    def image_pipeline_of(self, index: int) -> Pipeline | None:
        return image_pipeline(self.image_config_of(index), self.family)

    def encode_images(self, run, grids: list[tuple[int, int, int]], grid_thw: Tensor):
        """Run the vision encoder on this call's images (`run()`), capturing what their connect methods read."""
        pipelines = [p for p in (self.image_pipeline_of(k) for k in range(len(grids))) if p is not None]
        capture = self.stats_capture(*pipelines) if pipelines and self.encodes else None
        self._image_vision = [{} for _ in grids]
        if capture is None:
            return run()
        with capture.capturing(grid_thw, sum(g[0] for g in grids)):
            out = run()
        self._image_vision = capture.per_video(grids)
        return out

    def compress_image(
        self,
        embeds: Tensor,
        grid: tuple[int, int, int],
        index: int,
        extras: dict[str, Tensor] | None = None,
        *,
        view: str = "",
        vision: dict | None = None,
        geometry: FamilyGeometry | None = None,
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Image `index` of this call (or one `view` of it: LLaVA's anyres "base" / "crops", with that view's
        `vision` statistics and `geometry`) through the image pipeline's connect methods -> (embeds, grid cells,
        extras) of the survivors, in the methods' order; every cell when images pass whole."""
        pipeline = self.image_pipeline_of(index)
        if pipeline is None:
            return embeds, torch.arange(embeds.shape[0]), dict(extras or {})
        if vision is None:
            vision = self.image_vision_of(index)
        ctx = self._context(pipeline, index, self.image_config_of(index), media="image", vision=vision)
        if geometry is not None:
            ctx = ctx.replace(geometry=geometry)
        label = f"image {index}" + (f" ({view} view)" if view else "")
        embeds_out, cells, extras_out, _, _ = self._connect("image", pipeline, ctx, embeds, grid, index, label, extras)
        LAST_KEPT_IMAGES.append(
            {"family": self.family, "grid": grid, "view": view, "cells": torch.sort(cells).values.cpu()}
        )
        del LAST_KEPT_IMAGES[:-64]
        return embeds_out.to(embeds.dtype), cells, extras_out

    def image_vision_of(self, index: int) -> dict:
        """The vision statistics image `index` of this call was encoded with (per view on LLaVA: [views, ...])."""
        return self._image_vision[index] if index < len(self._image_vision) else {}

    def kept_of(self, index: int, grid: tuple[int, int, int], kind: str = "video") -> Tensor | None:
        """The units video (or image) `index` of this call keeps before the tower; None when it keeps all of them."""
        kept = self._kept[kind][index] if index < len(self._kept[kind]) else None
        return None if kept is None or kept.numel() == grid[0] * grid[1] * grid[2] else kept

    def _encode_pipelines(self, kind: str, count: int) -> list[Pipeline | None]:
        """The pipeline of each item of this call (None: an image passing whole, `"images": false`)."""
        if kind == "image":
            return [self.image_pipeline_of(k) for k in range(count)]
        return [config_pipeline(self.config_of(k), self.family) for k in range(count)]

    def encode_run(
        self, run, visual, pixels: Tensor, grid_thw: Tensor, grids: list[tuple[int, int, int]], kind: str = "video"
    ):
        """The tower call of these videos (or images): vLLM's tower block by block with the tower methods between its
        blocks when they change some item (`vtc.vllm.tower`); else `run` (vLLM's own) when every unit of every item
        survived the pre-tower methods (bit for bit stock), else vLLM's tower on the survivors' patches alone
        (`vtc.vllm.encode`)."""
        pipelines = self._encode_pipelines(kind, len(grids))
        kept = [self.kept_of(k, grid, kind) for k, grid in enumerate(grids)]
        self._tower[kind], self._tower_state[kind] = [None] * len(grids), [None] * len(grids)
        if None in pipelines:  # images pass whole (a server-wide setting: every image of the call alike)
            return run
        in_tower = any(p.tower_entries() and p.changes_tower(g) for p, g in zip(pipelines, grids))
        if not in_tower and all(k is None for k in kept):
            return run
        kept = [torch.arange(g[0] * g[1] * g[2]) if k is None else k for k, g in zip(kept, grids)]
        if not in_tower:
            return functools.partial(encode_survivors, visual, self.family, pixels, grid_thw, kept)
        if pixels is None:  # the processor refuses these requests; the worker cannot merge inside a tower it skips
            raise RuntimeError(f"vtc: {pipelines[0].spec!r} merges inside the vision tower, which needs the pixels")
        return functools.partial(self._encode_in_tower, visual, pixels, grid_thw, kept, pipelines, kind)

    def _encode_in_tower(
        self, visual, pixels: Tensor, grid_thw: Tensor, kept: list[Tensor], pipelines: list[Pipeline], kind: str
    ) -> tuple[Tensor, ...]:
        """vLLM's tower block by block on the videos' surviving units, with each video's tower methods: videos with the
        same settings in one run (a run has one pipeline). Per video, its output on the whole unit grid; what the tower
        methods left of it (cells, sizes) goes to its connect stage (`compress`)."""
        from vtc.vllm.tower import VllmQwenTower

        tower = VllmQwenTower(visual, self.family)
        rows = list(torch.split(pixels, grid_thw.prod(-1).tolist()))
        out: list[Tensor | None] = [None] * len(kept)
        for pipeline in dict.fromkeys(pipelines):  # in order of first appearance
            videos = [k for k, p in enumerate(pipelines) if p is pipeline]
            configs = [self.image_config_of(k) if kind == "image" else self.config_of(k) for k in videos]
            ctxs = [self._context(pipeline, k, c, media=kind) for k, c in zip(videos, configs)]
            pipeline.begin_prompt()
            visual.forward = functools.partial(tower.run, kept=[kept[k] for k in videos], pipeline=pipeline, ctxs=ctxs)
            try:  # through the module call, so hooks on the tower (timers, profilers) see it run
                features, run = visual(torch.cat([rows[k] for k in videos]), grid_thw[videos])
            finally:
                del visual.__dict__["forward"]
            state = pipeline.prompt_state()  # what the tower methods left for these videos' connect calls
            for k, feature, tokens in zip(videos, features, run.tokens):
                order = torch.argsort(tokens.cell)
                self._tower[kind][k] = (tokens.cell[order].cpu(), tokens.size[order].cpu())
                self._tower_state[kind][k] = state
                out[k] = feature
                logger.info(
                    "vtc %s: %s %d: the vision tower's methods kept %d of %d units",
                    pipeline.spec,
                    kind,
                    k,
                    len(tokens),
                    kept[k].numel(),
                )
        return tuple(out)

    def frame_encode_run(self, run, tower: torch.nn.Module, frames: list[int], kind: str = "video"):
        """The LLaVA tower call of these videos (`frames` each, in the order vLLM's model stacks them; images: their
        views): `run` itself (vLLM's own tower, bit for bit stock) unless a tower method changes some item, else
        `run` with the tower's forward answered block by block (`vtc.vllm.tower.VllmFrameTower`) for the items whose
        methods change it; the model's own projector (and pooling, or anyres packing) then runs on what it returns,
        as on the HF backend."""
        pipelines = self._encode_pipelines(kind, len(frames))
        if kind == "video":
            self._frame_tokens = [None] * len(frames)
        self._tower_state[kind] = [None] * len(frames)
        if None in pipelines:  # images pass whole
            return run
        side = tower.vision_model.config.image_size // tower.vision_model.config.patch_size
        changes = [bool(p.tower_entries()) and p.changes_tower((f, side, side)) for p, f in zip(pipelines, frames)]
        if not any(changes):
            return run

        def call():
            tower.forward = functools.partial(self._frame_tower_forward, tower, frames, pipelines, changes, kind)
            try:  # through the module call, so hooks on the tower (timers, profilers) see it run
                return run()
            finally:
                del tower.__dict__["forward"]

        return call

    def _frame_tower_forward(
        self,
        tower: torch.nn.Module,
        frames: list[int],
        pipelines: list[Pipeline],
        changes: list[bool],
        kind: str,
        pixel_values: Tensor,
        select_layers: list[int] | None = None,
        feature_select_strategy: Any = None,
        **kwargs: Any,
    ) -> Tensor:
        """The vision tower's forward on every frame of the call's videos (`pixel_values` [sum frames, C, H, W]): the
        videos whose tower methods change them block by block, each group of videos with the same settings in one
        run (a run has one pipeline), the others through the tower's own forward; every frame's output where the
        tower's own forward puts it. What the methods left of each video (its tokens, its methods' ctx.state) goes
        to its connect call (`compress`)."""
        from vtc.vllm.tower import VllmFrameTower

        if select_layers is not None or kwargs.get("interpolate_pos_encoding"):
            raise ValueError(
                "vtc's tower methods run the tower's last layer on its own image size; this call asks for "
                f"{'layers ' + str(select_layers) if select_layers is not None else 'interpolated positions'}"
            )
        if pixel_values.shape[0] != sum(frames):
            raise RuntimeError(f"vtc: the tower got {pixel_values.shape[0]} frames for videos of {frames} frames")
        stock = functools.partial(type(tower).forward, tower, feature_select_strategy=feature_select_strategy, **kwargs)
        frame_tower = VllmFrameTower(tower, self.family)
        pixels = list(torch.split(pixel_values, frames))
        out: list[Tensor | None] = [None] * len(frames)
        for pipeline in dict.fromkeys(pipelines):  # in order of first appearance
            for changed in (True, False):
                videos = [k for k, p in enumerate(pipelines) if p is pipeline and changes[k] == changed]
                if not videos:
                    continue
                group = torch.cat([pixels[k] for k in videos])
                if not changed:
                    features = list(torch.split(stock(group), [frames[k] for k in videos]))
                    for k, feature in zip(videos, features):
                        out[k] = feature
                    continue
                configs = [self.image_config_of(k) if kind == "image" else self.config_of(k) for k in videos]
                ctxs = [self._context(pipeline, k, c, media=kind) for k, c in zip(videos, configs)]
                pipeline.begin_prompt()
                features, _, run = frame_tower.run(
                    group, [frames[k] for k in videos], len(frame_tower.layers) - 1, pipeline, ctxs
                )
                state = pipeline.prompt_state()  # GRT's gate record: its connect hook reads it
                for k, feature, tokens in zip(videos, features, run.tokens):
                    out[k] = frame_tower.output(feature, feature_select_strategy)
                    if kind == "video":  # an image's views are unmerged whole: every cell reaches its connect call
                        self._frame_tokens[k] = tokens
                    self._tower_state[kind][k] = state
                    logger.info(
                        "vtc %s: %s %d: the vision tower's methods kept %d of %d tokens (unmerged onto every "
                        "frame's grid before the projector)",
                        pipeline.spec,
                        kind,
                        k,
                        len(tokens),
                        frames[k] * (frame_tower.side**2 + int(frame_tower.class_token)),
                    )
        return torch.cat(out)

    def survivors_of(
        self, index: int, grid: tuple[int, int, int], kind: str = "video"
    ) -> tuple[Tensor | None, Tensor | None]:
        """The cells video `index` of this call hands its connect stage and how many units each stands for: what the
        tower methods left (their sizes; on SigLIP / CLIP every cell of the frames that kept tokens of their own,
        each standing for the frames its frame holds, as on the HF backend), else what the pre-tower methods kept
        (one each); (None, None): every cell."""
        frame_tokens = self._frame_tokens[index] if kind == "video" and index < len(self._frame_tokens) else None
        if frame_tokens is not None:
            return pooled_survivors(frame_tokens, grid[1] * grid[2])
        towers = self._tower[kind]
        tower = towers[index] if index < len(towers) else None
        return tower if tower is not None else (self.kept_of(index, grid, kind), None)

    def encode(self, run, grids: list[tuple[int, int, int]], grid_thw: Tensor | None = None):
        """Run the vision encoder (`run()`), capturing what the connect methods of these videos read."""
        if not self.encodes:
            raise RuntimeError("vtc: this pipeline stage holds no vision tower, yet it was asked to encode")
        pipelines = [config_pipeline(self.config_of(k), self.family) for k in range(len(grids))]
        capture = self.stats_capture(*pipelines)
        needs_prepool = any(p.needs_prepool for p in pipelines) and self.geometry.has_prepool_grid
        prepool = self._prepool_of() if needs_prepool else None
        frames = [g[0] for g in grids]
        self._vision, self._prepool = [{} for _ in grids], None
        if capture is None and prepool is None:
            return run()
        if prepool is not None:
            prepool.install()
        try:
            if capture is not None:
                with capture.capturing(grid_thw, sum(frames)):
                    out = run()
                self._vision = capture.per_video(grids)
            else:
                out = run()
            if prepool is not None:
                self._prepool = prepool.per_video(frames)
        finally:
            if prepool is not None:
                prepool.remove()
        return out

    def _prepool_of(self) -> PrepoolCapture:
        if self._prepool_capture is None:
            self._prepool_capture = _prepool_capture(self.model, self.family)
        return self._prepool_capture

    def compress(
        self,
        embeds: Tensor,
        grid: tuple[int, int, int],
        index: int,
        extras: dict[str, Tensor] | None = None,
        timestamps: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Video `index` of this call through the connect engine -> (embeds, grid cells, extras) of the survivors:
        frames in order, each frame's tokens in the order the methods returned them (as vtc's HF backend). `embeds`
        cover the whole grid; after an encode stage the connect methods see only the units it kept."""
        config = self.config_of(index)
        pipeline = config_pipeline(config, self.family)
        ctx = self._context(pipeline, index, config, vision=self._vision[index] if index < len(self._vision) else {})
        if self._prepool is not None:
            capture = self._prepool_of()
            ctx = ctx.replace(prepool=self._prepool[index], pool=capture.pool, project=capture.projection)
        if any(e.card.reads_lm_head for e in pipeline.entries):
            ctx = ctx.replace(model=self.served_model or ServedModel(self.model))
        embeds_out, cells, extras_out, survivors, weights = self._connect(
            "video", pipeline, ctx, embeds, grid, index, f"video {index}", extras, timestamps
        )
        order = torch.sort(torch.div(cells, grid[1] * grid[2], rounding_mode="floor"), stable=True).indices
        LAST_KEPT.append(
            {
                "family": self.family,
                "grid": grid,
                "cells": torch.sort(cells).values.cpu(),
                "retention": config.retention,
                "encoded": None if survivors is None else len(survivors),  # units left by the encode stage
                "sizes": weights,  # units each of them stands for, after tower methods (None: one each)
            }
        )
        del LAST_KEPT[:-64]
        kept_extras = {name: value[order] for name, value in extras_out.items()}
        return embeds_out[order].to(embeds.dtype), cells[order], kept_extras

    def _connect(
        self,
        kind: str,
        pipeline: Pipeline,
        ctx: Context,
        embeds: Tensor,
        grid: tuple[int, int, int],
        index: int,
        label: str,
        extras: dict[str, Tensor] | None,
        timestamps: Tensor | None = None,
    ):
        """Item `index` of this call (a video or an image, `kind`) through `pipeline`'s connect methods, from what its
        encode stage left (its tower methods' state and survivors), checked against the count its prompt was sized
        for -> (embeds, grid cells, extras) of the survivors, the same on every rank, then the survivors and their
        weights the connect stage started from."""
        # the item's own state: fresh, or what its tower methods left in this call (GRT's gate record)
        states = self._tower_state[kind]
        pipeline.begin_prompt(states[index] if index < len(states) else None)
        survivors, weights = self.survivors_of(index, grid, kind)
        _, out = connect_video(
            pipeline,
            embeds,
            grid,
            ctx,
            extras=extras,
            timestamps=timestamps,
            survivors=survivors,
            survivor_weights=weights,
        )
        promised = pipeline.retained_count(grid, encoded=encoded_count(pipeline, self.kept_of(index, grid, kind), grid))
        if promised is not None and promised != len(out):
            article = "an" if kind == "image" else "a"
            raise RuntimeError(
                f"vtc: {pipeline.spec!r} promised {promised} tokens for {article} {kind} with grid {grid} but kept "
                f"{len(out)}; the prompt was sized for {promised}"
            )
        logger.info("vtc %s: %s, grid %s: kept %d of %d tokens", pipeline.spec, label, grid, len(out), len(embeds))
        return (*_same_on_every_rank(out.embeds, grid_cells(out), out.extras), survivors, weights)


def _kept_units(kept: Any) -> list[Tensor | None]:
    """Each item's kept merge units as the processor sent them (`vtc_kept` / `vtc_image_kept`), ascending longs."""
    return [] if kept is None else [torch.as_tensor(k, dtype=torch.long).flatten().cpu() for k in kept]


class ServedModel:
    """What a connect method reads of the served model through `ctx.model` on vLLM (on the HF backend `ctx.model` is
    the model itself): its LM head, `get_output_embeddings()`, as a function from hidden states [..., D] to logits
    over the vocabulary [..., V], which is how GRT's key-frame matching calls HF's `lm_head` Linear. It runs vLLM's
    own logits path (`compute_logits`: the head's own linear method, quantised or not, its logit scale or soft cap
    where the model has one, the vocabulary padding cut off), so the logits are those the served model samples from.

    It needs the whole head on the rank that encodes: tensor parallelism splits it by vocabulary (vLLM gathers the
    logits onto the first rank only), and under pipeline parallelism the first stage, which encodes, holds none
    (`PPMissingLayer`). The server refuses both at start (`check_tower_parallelism`); this checks again where the
    model is built."""

    def __init__(self, model: torch.nn.Module) -> None:
        from vllm.model_executor.models.utils import PPMissingLayer

        language_model = getattr(model, "language_model", model)
        head = getattr(language_model, "lm_head", None)
        if head is None or isinstance(head, PPMissingLayer):
            raise RuntimeError(
                "vtc: a method of this server reads the LM head while it encodes a video (GRT), but this pipeline "
                "stage holds none (pipeline parallel: the first stage encodes, the last holds the head); serve it "
                "with --pipeline-parallel-size 1"
            )
        ranks = int(getattr(head, "tp_size", 1))
        if ranks > 1:
            raise RuntimeError(
                f"vtc: a method of this server reads the LM head while it encodes a video (GRT), but the head is split "
                f"by vocabulary across {ranks} tensor-parallel ranks; serve it with --tensor-parallel-size 1"
            )
        self.model = model

    def get_output_embeddings(self):
        return self.logits

    def logits(self, hidden: Tensor) -> Tensor:
        """[..., V] logits of hidden states [..., D] (a 1-D vector: [V])."""
        out = self.model.compute_logits(hidden.reshape(-1, hidden.shape[-1]))
        return out.reshape(*hidden.shape[:-1], out.shape[-1])


def _same_on_every_rank(embeds: Tensor, cells: Tensor, extras: dict[str, Tensor]):
    """Tensor-parallel ranks must feed the LLM the same tokens, but their encoder outputs (and attention statistics)
    can differ in the last bits (all-reduce order), which can flip a near-tied choice: every rank takes the first
    rank's result. The count is fixed, so the shapes agree on every rank."""
    group = tp_group()
    if group is None:
        return embeds, cells, extras
    embeds = group.broadcast(embeds.contiguous(), src=0)
    cells = group.broadcast(cells.contiguous(), src=0)
    extras = {name: group.broadcast(value.contiguous(), src=0) for name, value in extras.items()}
    return embeds, cells, extras


def _check_encoder_parallelism(vllm_config, serving: Serving) -> None:
    mm = vllm_config.model_config.multimodal_config
    if serving.stats is not None and mm is not None and getattr(mm, "mm_encoder_tp_mode", "weights") == "data":
        raise ValueError(
            "vtc: methods that read vision-encoder attention need the whole video on one encoder; "
            "--mm-encoder-tp-mode data splits frames across ranks. Use the default (weights)"
        )


def _prepool_capture(model, family: str) -> PrepoolCapture:
    vision = model.config.vision_config
    side = vision.image_size // vision.patch_size
    if family == "llava_onevision":

        def pool(grid: Tensor) -> Tensor:  # [F, h, w, D] -> [F, ceil(h/2), ceil(w/2), D], the model's apply_pooling
            x = grid.permute(0, 3, 1, 2)
            size = [math.ceil(x.shape[2] / 2), math.ceil(x.shape[3] / 2)]
            return torch.nn.functional.interpolate(x, size=size, mode="bilinear").permute(0, 2, 3, 1)

        return PrepoolCapture(model.multi_modal_projector, (side, side), pool, capture="output")
    if family == "llava_next_video":
        resampler = model.vision_resampler

        def pool(grid: Tensor) -> Tensor:  # [F, h, w, D] -> [F, h/2, w/2, D] through the model's own pooler
            f, h, w, d = grid.shape
            out = resampler(grid.reshape(f, h * w, d))
            side_out = int(math.isqrt(out.shape[1]))
            return out.reshape(f, side_out, side_out, -1)

        return PrepoolCapture(resampler, (side, side), pool, capture="input", project=model.multi_modal_projector)
    raise ValueError(f"{family}: no pre-pool features (its merge is inside the vision tower)")


def _qwen_grid(size: list[int], merge: int) -> tuple[int, int, int]:
    t, h, w = (int(v) for v in size)
    return t, h // merge, w // merge


# --- processors (API server) -------------------------------------------------------------------------------------


class _VtcProcessor:
    """What vtc's five processors share: a request's own settings (`mm_processor_kwargs={"vtc": {...}}`) are
    checked against the server's config, kept out of the HF processor's arguments, and sent along with each video
    (`vtc_settings`); each video's replacement is sized by the pipeline of its own settings. Families say how
    (`_video_replacement`)."""

    family = ""
    _profiling = False  # building vLLM's dummy inputs (no question, and the most frames: nothing is sampled)

    # --- the sample stage (vtc.vllm.sampling) ------------------------------------------------------------------
    def apply(self, inputs, *args, **kwargs):
        server = server_config(self.info.get_hf_config())
        if server is not None and not self._profiling:
            settings = inputs.hf_processor_mm_kwargs.get(KEY)
            question = request_question(settings)
            pipeline = self._request_pipeline(server, without_question(settings))
            if pipeline.has_stage("sample"):
                inputs = select_frames(self, inputs, pipeline, question, self.family)
        return super().apply(inputs, *args, **kwargs)

    def get_dummy_mm_inputs(self, *args, **kwargs):
        self._profiling = True
        try:
            return super().get_dummy_mm_inputs(*args, **kwargs)
        finally:
            self._profiling = False

    def stock_hashes(self, inputs) -> dict[str, list[str]]:
        """vLLM's own cache identity of each media item (its bytes or uuid, and the request's processor kwargs)."""
        return dict(super()._get_mm_hashes(inputs))

    def video_token_id(self) -> int:
        from vtc.hf.adapters import config_adapter

        return config_adapter(self.family, self.info.get_hf_config()).video_token_id

    # --- the connect stage ------------------------------------------------------------------------------------
    def _get_hf_mm_inputs(self, mm_items, hf_kwargs):
        request = without_question(hf_kwargs.get(KEY))
        inputs = super()._get_hf_mm_inputs(mm_items, _without_vtc(hf_kwargs))
        server = server_config(self.info.get_hf_config())
        if server is None:
            if request is not None:
                raise ValueError('this server runs without vtc: drop mm_processor_kwargs["vtc"]')
            return inputs
        settings = self._checked_settings(server, request)
        videos = mm_items.get_count("video", strict=False)
        images = mm_items.get_count("image", strict=False) if self.compresses_images else 0
        if not videos and not images:
            return inputs
        passthrough = dict(inputs.passthrough_data)
        if videos:
            passthrough[SETTINGS_FIELD] = [encode_settings(settings)] * videos
        if images:
            passthrough[IMAGE_SETTINGS_FIELD] = [encode_settings(settings)] * images
        return inputs._replace(passthrough_data=passthrough)

    def _checked_settings(self, server: ServeConfig, request: Any) -> dict[str, Any]:
        """The request's settings, once the server allows them and they build a pipeline (else ValueError)."""
        if request is None:
            return {}
        self._request_pipeline(server, request)
        return dict(request)

    def _request_pipeline(self, server: ServeConfig, request: Any) -> Pipeline:
        """The pipeline of one request's settings (None: the server's), or a ValueError naming what is wrong."""
        if request is None:
            return config_pipeline(server, self.family)
        config = request_config(server, request)
        try:
            return config_pipeline(config, self.family)
        except ValueError as err:
            raise ValueError(f'mm_processor_kwargs["vtc"]: {err}') from None

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs):
        fields = dict(super()._get_mm_fields_config(hf_inputs, _without_vtc(hf_processor_mm_kwargs)))
        for name in (SETTINGS_FIELD, KEPT_FIELD):
            if name in hf_inputs:
                fields[name] = MultiModalFieldConfig.batched("video", keep_on_cpu=True)
        for name in (IMAGE_SETTINGS_FIELD, IMAGE_KEPT_FIELD):
            if name in hf_inputs:
                fields[name] = MultiModalFieldConfig.batched("image", keep_on_cpu=True)
        return fields

    # --- the encode stage (vtc.vllm.encode) ---------------------------------------------------------------------
    def _postprocess_hf_mm_data(self, mm_inputs, hf_processor_mm_kwargs, processed_data):
        """Run the encode methods on each video's (and each image's) pixels, once the HF processor made them: the kept
        merge units go with the item (`vtc_kept`, `vtc_image_kept`) and size its placeholders. Not while vLLM
        profiles: its dummy items then keep every unit, the worst case it measures."""
        processed_data = super()._postprocess_hf_mm_data(mm_inputs, hf_processor_mm_kwargs, processed_data)
        server = server_config(self.info.get_hf_config())
        if server is None or self._profiling:
            return processed_data
        if "pixel_values_videos" in processed_data:
            self._choose_units(processed_data, server, "video")
        if "pixel_values" in processed_data and "image_grid_thw" in processed_data and self.compresses_images:
            self._choose_units(processed_data, server, "image")
        return processed_data

    def _choose_units(self, processed_data, server: ServeConfig, kind: str) -> None:
        """The pre-tower encode methods of each video (or image) on its pixels -> its kept units, in the item's
        kept field. Nothing when no item's pipeline has a pre-tower method (tower methods run in the worker)."""
        video = kind == "video"
        served = config_pipeline(server, self.family) if video else image_pipeline(server, self.family)
        if served is None or not served.pre_tower_entries():  # a request may change settings, not methods
            return
        grid_thw = processed_data["video_grid_thw" if video else "image_grid_thw"]
        settings = processed_data.get(SETTINGS_FIELD if video else IMAGE_SETTINGS_FIELD)
        rows = [None] * len(grid_thw) if settings is None else list(settings)
        configs = [request_config(server, {} if row is None else decode_settings(row)) for row in rows]
        pipelines = [config_pipeline(c, self.family) if video else image_pipeline(c, self.family) for c in configs]
        hf_config = self.info.get_hf_config()
        hf_processor = self.info.get_hf_processor()
        kept = choose_units(
            pipelines,
            [c.seed for c in configs],
            processed_data["pixel_values_videos" if video else "pixel_values"],
            grid_thw,
            vision_config=hf_config.vision_config,
            video_processor=hf_processor.video_processor if video else hf_processor.image_processor,
            family=self.family,
            geometry=_geometry(self.family, hf_config),
        )
        merge = hf_config.vision_config.spatial_merge_size
        for k, (units, size) in enumerate(zip(kept, grid_thw.tolist())):
            grid = _qwen_grid(size, merge)
            logger.info(
                "vtc %s: %s %d, grid %s: the encode stage kept %d of %d units (prompt processor)",
                configs[k].methods,
                kind,
                k,
                grid,
                units.numel(),
                grid[0] * grid[1] * grid[2],
            )
        processed_data[KEPT_FIELD if video else IMAGE_KEPT_FIELD] = kept

    def _item_kept(self, item, field: str = KEPT_FIELD) -> Tensor | None:
        """The merge units an item's pre-tower methods kept (None: the processor ran none on it)."""
        return item[field].data if field in item else None

    def _item_count(self, pipeline: Pipeline, item, grid: tuple[int, int, int], kind: str = "video") -> int | None:
        """The item's placeholders: its count from the pre-tower methods' survivors and the grid (None: the count
        depends on the content)."""
        pixels = "pixel_values_videos" if kind == "video" else "pixel_values"
        if (pipeline.tower_entries() or pipeline.pre_tower_entries()) and pixels not in item:
            raise ValueError(
                f"{pipeline.spec!r} acts in the vision encoder, which needs the {kind}'s pixels; this server does not "
                f"take {kind} embeddings"
            )
        kept = self._item_kept(item, KEPT_FIELD if kind == "video" else IMAGE_KEPT_FIELD)
        return pipeline.retained_count(grid, encoded=encoded_count(pipeline, kept, grid))

    def _item_pipeline(self, item) -> Pipeline:
        server = server_config(self.info.get_hf_config())
        settings = decode_settings(item[SETTINGS_FIELD].data) if SETTINGS_FIELD in item else {}
        return config_pipeline(request_config(server, settings), self.family)

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        updates = super()._get_prompt_updates(mm_items, _without_vtc(hf_processor_mm_kwargs), out_mm_kwargs)
        server = server_config(self.info.get_hf_config())
        if server is None:
            return updates
        out = []
        for update in updates:
            if isinstance(update, PromptReplacement) and update.modality == "video":
                original = update.replacement

                def replacement(item_idx: int, original=original):
                    item = out_mm_kwargs["video"][item_idx]
                    return self._video_replacement(item_idx, original, self._item_pipeline(item), item, mm_items)

                update = PromptReplacement(modality="video", target=update.target, replacement=replacement)
            elif isinstance(update, PromptReplacement) and update.modality == "image" and self.compresses_images:
                original_image = update.replacement

                def image_replacement(item_idx: int, original=original_image):
                    item = out_mm_kwargs["image"][item_idx]
                    pipeline = image_pipeline(
                        request_config(server, _item_settings(item, IMAGE_SETTINGS_FIELD)), self.family
                    )
                    return (
                        original(item_idx)
                        if pipeline is None
                        else self._image_replacement(item_idx, original, pipeline, item)
                    )

                update = PromptReplacement(modality="image", target=update.target, replacement=image_replacement)
            out.append(update)
        return out

    compresses_images = False  # the family's images go through the image pipeline (else they pass whole)

    def _image_replacement(self, item_idx: int, original, pipeline: Pipeline, item):
        raise NotImplementedError

    def _video_replacement(self, item_idx: int, original, pipeline: Pipeline, item, mm_items):
        raise NotImplementedError


def _item_settings(item, field: str) -> dict[str, Any]:
    """A media item's own vtc settings (absent: the server's)."""
    return decode_settings(item[field].data) if field in item else {}


def image_pipeline(config: ServeConfig, family: str) -> Pipeline | None:
    """The pipeline an image runs with under `config` (None: images pass whole, `"images": false`); a spec that
    cannot reduce an image raises the ValueError that names why (vLLM answers it with HTTP 400)."""
    if not config.images:
        return None
    try:
        return config_pipeline(config, family).for_images()
    except ValueError as err:
        raise ValueError(f'{err} (a server: start it with "images": false in the vtc config)') from None


def _without_vtc(kwargs):
    """Processor kwargs without the request's vtc settings: they are vtc's, not the HF processor's (vLLM still
    hashes them into the request's cache keys)."""
    return {name: value for name, value in kwargs.items() if name != KEY} if KEY in kwargs else kwargs


class _QwenImages:
    """The Qwen processors' images: one run of `<|image_pad|>` of grid (1, H, W), sized by the image pipeline."""

    compresses_images = True

    def _image_replacement(self, item_idx, original, pipeline, item):
        merge = self.info.get_hf_config().vision_config.spatial_merge_size
        grid = _qwen_grid(item["image_grid_thw"].data.tolist(), merge)
        count = self._item_count(pipeline, item, grid, "image")
        if count is None:
            raise ValueError(
                f"{pipeline.spec!r} has no fixed count for an image of grid {grid}; a server sizes the prompt before "
                'the image is encoded: use a fixed-count method, or start the server with "images": false'
            )
        return [original(item_idx)[0]] * count


class _QwenProcessor(_QwenImages, _VtcProcessor):
    """Qwen2-VL and Qwen2.5-VL: `retained_count(grid)` video placeholders, and the image pipeline's count of image
    placeholders."""

    def _video_replacement(self, item_idx, original, pipeline, item, mm_items):
        merge = self.info.get_hf_config().vision_config.spatial_merge_size
        grid = _qwen_grid(item["video_grid_thw"].data.tolist(), merge)
        return [original(item_idx)[0]] * self._item_count(pipeline, item, grid)


class _Qwen3Processor(_QwenImages, _VtcProcessor):
    """Qwen3-VL: the whole per-video span (timestamps, frame markers, video tokens) is filled by the model, which
    knows how many tokens each frame kept (vLLM's own pruning layout); only its length is fixed here. The count is
    spread evenly over the frames, so at retention 1.0 the prompt's token ids are stock vLLM's. After an encode
    stage alone each frame holds its temporal patch's kept units, as the model lays it out."""

    def _video_replacement(self, item_idx, original, pipeline, item, mm_items):
        hf_config = self.info.get_hf_config()
        grid = _qwen_grid(item["video_grid_thw"].data.tolist(), hf_config.vision_config.spatial_merge_size)
        kept = self._item_kept(item)
        frames, count = grid[0], self._item_count(pipeline, item, grid)
        # the span's length is what counts (the model lays it out); exact per frame for ToMe, as many in every frame
        per_frame = [count // frames + (f < count % frames) for f in range(frames)]
        if kept is not None and not pipeline.has_stage("connect"):  # the frames' counts are known already
            per_frame = torch.bincount(kept // (grid[1] * grid[2]), minlength=frames).tolist()
        return Qwen3VLMultiModalProcessor.get_video_repl(
            tokens_per_frame=per_frame,
            timestamps=item["timestamps"].data,
            tokenizer=self.info.get_tokenizer(),
            vision_start_token_id=hf_config.vision_start_token_id,
            vision_end_token_id=hf_config.vision_end_token_id,
            video_token_id=hf_config.video_token_id,
            select_token_id=False,
        )


class _LlavaProcessor(_VtcProcessor):
    """LLaVA families: `retained_count(grid)` video placeholders, then the tokens that are not compressed
    (`trailing`: LLaVA-OneVision's newline)."""

    trailing = 0

    def _video_replacement(self, item_idx, original, pipeline, item, mm_items):
        from vllm.multimodal.parse import VideoProcessorItems

        full = original(item_idx)
        videos = mm_items.get_items("video", (VideoProcessorItems,))  # embeddings given by the client: refused
        grid = _llava_grid(len(full) - self.trailing, videos.get_num_frames(item_idx))
        return [full[0]] * (pipeline.retained_count(grid) + self.trailing)


# vLLM's LLaVA-OneVision packs an image's crops to about 9 views' tokens whatever the config's vision_aspect_ratio
VLLM_ANYRES_MAX_VIEWS = 9


def anyres_layout_of(family: str, hf_config, size) -> AnyresLayout:
    """How vLLM's LLaVA-OneVision packs an image of `size` (height, width): a base view, its crops' grid."""
    from vtc.hf.adapters import config_adapter

    return config_adapter(family, hf_config).anyres_layout(list(size), max_views=VLLM_ANYRES_MAX_VIEWS)


def anyres_image_count(pipeline: Pipeline, layout: AnyresLayout) -> int | None:
    """An anyres image's tokens after the image pipeline: each view keeps its own count (the base view's grid and
    the packed crops' grid are two items, as on the HF backend); the newlines stay (one per crop row, or one after
    an image of a single view). None: some view has no fixed count."""
    base = pipeline.retained_count((1, layout.side, layout.side))
    crops = pipeline.retained_count((1, layout.rows, layout.cols)) if layout.rows else 0
    if base is None or crops is None:
        return None
    return base + crops + (layout.rows if layout.rows else 1)


class _LlavaOnevisionImages:
    """LLaVA-OneVision's images on vLLM: the base view and the packed crop grid each through the image pipeline,
    sized here from `image_sizes` with transformers' anyres functions (checked against vLLM's own count)."""

    compresses_images = True

    def _image_replacement(self, item_idx, original, pipeline, item):
        full = original(item_idx)
        if "image_sizes" not in item:
            raise ValueError(
                "vtc compresses an image from its pixels; this request gave image embeddings: send the image, or start "
                'the server with "images": false'
            )
        layout = anyres_layout_of(self.family, self.info.get_hf_config(), item["image_sizes"].data.tolist())
        if layout.length != len(full):
            raise RuntimeError(f"vtc: the anyres layout {layout} has {layout.length} tokens, vLLM counts {len(full)}")
        count = anyres_image_count(pipeline, layout)
        if count is None:
            raise ValueError(
                f"{pipeline.spec!r} has no fixed count for an image; a server sizes the prompt before the image is "
                'encoded: use a fixed-count method, or start the server with "images": false'
            )
        return [full[0]] * count


def _llava_grid(tokens: int, frames: int) -> tuple[int, int, int]:
    per_frame = tokens // frames
    side = math.isqrt(per_frame)
    if side * side != per_frame or per_frame * frames != tokens:
        raise ValueError(f"vtc: {tokens} video tokens over {frames} frames is not a square grid per frame")
    return frames, side, side


# --- models (workers) --------------------------------------------------------------------------------------------


class _ServingModel:
    """What vtc's five model classes share: the `Serving` of a vtc config (None: vLLM's class, unchanged), and
    each `embed_multimodal` call handing it its videos' settings."""

    family = ""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vtc = Serving.create(self, vllm_config, self.family)

    def embed_multimodal(self, **kwargs: object):
        settings = kwargs.pop(SETTINGS_FIELD, None)
        kept = kwargs.pop(KEPT_FIELD, None)
        image_settings = kwargs.pop(IMAGE_SETTINGS_FIELD, None)
        image_kept = kwargs.pop(IMAGE_KEPT_FIELD, None)
        if self.vtc is not None:
            self.vtc.begin_call(settings, kept)
            self.vtc.begin_images(image_settings, image_kept)
        return super().embed_multimodal(**kwargs)


class _MRopeServing(_ServingModel):
    """The Qwen families with vtc on: vtc's own M-RoPE positions (`vtc.vllm.positions`), with vLLM's pruning switches
    on so that the runner hands every chunk of media embeddings to `recompute_mrope_positions` before the LLM
    reads it. Every image and video embedding carries its slots' relative positions in extra columns, which
    `recompute_mrope_positions` strips. Under pipeline parallel, the first stage's positions travel to the next
    stages with the hidden states (only the first stage sees the media)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if self.vtc is not None:
            self.is_multimodal_pruning_enabled = True
            self.supports_multimodal_pruning = True
            self.make_empty_intermediate_tensors = with_stage_positions(self.make_empty_intermediate_tensors)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if self.vtc is None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        positions, intermediate_tensors = positions_from_previous_stage(positions, intermediate_tensors)
        out = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        return positions_to_next_stage(out, positions)

    # positions -------------------------------------------------------------------------------------------------
    def get_mrope_input_positions(self, input_tokens, mm_features):
        """Stock positions for the text, marked slots for the media (filled once the media is encoded)."""
        if self.vtc is None:
            return super().get_mrope_input_positions(input_tokens, mm_features)
        spans = [
            MediaSpan(f.mm_position.offset, f.mm_position.length, self._media_extent(f, input_tokens))
            for f in mm_features
        ]
        return prompt_positions(len(input_tokens), spans)

    def recompute_mrope_positions(self, input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens):
        """Strip the relative positions off this chunk's media embeddings and write them into the prompt."""
        if self.vtc is None:
            return super().recompute_mrope_positions(
                input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens
            )
        parts = [split_positions(item) for item in multimodal_embeddings]
        positions, delta = fill_positions(mrope_positions, [rel for _, rel in parts], num_computed_tokens)
        return [embeds for embeds, _ in parts], positions, delta

    def _media_extent(self, feature, input_tokens) -> int:
        merge = self.config.vision_config.spatial_merge_size
        if feature.modality == "image":
            return grid_extent(_qwen_grid(feature.data["image_grid_thw"].data.tolist(), merge))
        seconds = feature.data.get("second_per_grid_ts")
        grid = _qwen_grid(feature.data["video_grid_thw"].data.tolist(), merge)
        return grid_extent(grid, self._t_factor(None if seconds is None else seconds.data.item()))

    def _t_factor(self, seconds: float | None) -> float:
        """Stock M-RoPE time step per temporal patch: seconds per patch (a float) x tokens per second."""
        rate = getattr(self.config.vision_config, "tokens_per_second", 1.0)
        return (1.0 if seconds is None else float(seconds)) * rate

    # images: through the image pipeline, with their positions (every Qwen class sets compresses_images) ----------
    compresses_images = False

    def _process_image_input(self, image_input):
        run = functools.partial(super()._process_image_input, image_input)
        if self.vtc is None:
            return run()
        merge = self.visual.spatial_merge_size
        grid_thw = image_input["image_grid_thw"]
        grids = [_qwen_grid(size, merge) for size in grid_thw.tolist()]
        if not self.compresses_images:
            return tuple(append_positions(emb, grid_positions(grid)) for emb, grid in zip(run(), grids))
        # the image's encode methods (PixelPrune's survivors, ToMe's merges) as for a video of one temporal patch
        run = self.vtc.encode_run(run, self.visual, image_input.get("pixel_values"), grid_thw, grids, "image")
        out = []
        for k, (emb, grid) in enumerate(zip(self.vtc.encode_images(run, grids, grid_thw), grids)):
            kept, cells = self._compress_image(emb, grid, k)
            out.append(append_positions(kept, grid_positions(grid)[cells.cpu()]))
        return tuple(out)

    def _compress_image(self, emb: Tensor, grid: tuple[int, int, int], index: int) -> tuple[Tensor, Tensor]:
        kept, cells, _ = self.vtc.compress_image(emb, grid, index)
        return kept, cells

    def _postprocess_image_embeds_evs(self, image_embeds_split, image_input):
        if self.vtc is None:
            return super()._postprocess_image_embeds_evs(image_embeds_split, image_input)
        return image_embeds_split  # positioned by _process_image_input already

    def get_encoder_cudagraph_config(self):
        """vLLM's encoder CUDA graphs bypass `embed_multimodal`'s post-processing: off for every modality."""
        config = super().get_encoder_cudagraph_config()
        if self.vtc is None or config is None or not hasattr(config, "modalities"):
            return config
        return dataclasses.replace(config, modalities=[])


class _QwenServing(_MRopeServing):
    """Qwen2-VL and Qwen2.5-VL: a video is one grid, an image a grid of one frame; survivors carry their cells'
    stock positions."""

    compresses_images = True

    def _process_video_input(self, video_input):
        run = functools.partial(super()._process_video_input, video_input)
        if self.vtc is None:
            return run()
        grid_thw = video_input["video_grid_thw"]
        merge = self.visual.spatial_merge_size
        grids = [_qwen_grid(size, merge) for size in grid_thw.tolist()]
        run = self.vtc.encode_run(run, self.visual, video_input.get("pixel_values_videos"), grid_thw, grids)
        split = self.vtc.encode(run, grids, grid_thw)
        seconds = video_input.get("second_per_grid_ts")
        out = []
        for k, (emb, grid) in enumerate(zip(split, grids)):
            step = None if seconds is None else float(seconds[k])  # Qwen2.5-VL; Qwen2-VL carries none
            # the seconds of each temporal patch, as the HF backend gives them
            times = None if step is None else torch.arange(grid[0], dtype=torch.float32) * step
            kept, cells, _ = self.vtc.compress(emb, grid, k, timestamps=times)
            out.append(append_positions(kept, grid_positions(grid, self._t_factor(step))[cells.cpu()]))
        return tuple(out)

    def _postprocess_video_embeds_evs(self, video_embeds_split, video_input):
        if self.vtc is None:
            return super()._postprocess_video_embeds_evs(video_embeds_split, video_input)
        return video_embeds_split  # compressed and positioned by _process_video_input already


# --- Qwen2-VL ---------------------------------------------------------------------------------------------------


class VtcQwen2VLProcessor(_QwenProcessor, Qwen2VLMultiModalProcessor):
    family = "qwen2_vl"


@MULTIMODAL_REGISTRY.register_processor(
    VtcQwen2VLProcessor, info=Qwen2VLProcessingInfo, dummy_inputs=Qwen2VLDummyInputsBuilder
)
class VtcQwen2VL(_QwenServing, Qwen2VLForConditionalGeneration):
    family = "qwen2_vl"


# --- Qwen2.5-VL -------------------------------------------------------------------------------------------------


class VtcQwen2_5_VLProcessor(_QwenProcessor, Qwen2_5_VLMultiModalProcessor):
    family = "qwen2_5_vl"


@MULTIMODAL_REGISTRY.register_processor(
    VtcQwen2_5_VLProcessor, info=Qwen2_5_VLProcessingInfo, dummy_inputs=Qwen2_5_VLDummyInputsBuilder
)
class VtcQwen2_5_VL(_QwenServing, Qwen2_5_VLForConditionalGeneration):
    family = "qwen2_5_vl"


# --- Qwen3-VL ---------------------------------------------------------------------------------------------------


class VtcQwen3VLProcessor(_Qwen3Processor, Qwen3VLMultiModalProcessor):
    family = "qwen3_vl"


@MULTIMODAL_REGISTRY.register_processor(
    VtcQwen3VLProcessor, info=Qwen3VLProcessingInfo, dummy_inputs=Qwen3VLDummyInputsBuilder
)
class VtcQwen3VL(_MRopeServing, Qwen3VLForConditionalGeneration):
    """A video's prompt span holds its frames' timestamp text and markers too; the model lays it out once it knows
    how many tokens each frame kept (vLLM's own pruning layout), in the order vtc's HF backend uses."""

    family = "qwen3_vl"
    compresses_images = True

    def _compress_image(self, emb: Tensor, grid: tuple[int, int, int], index: int) -> tuple[Tensor, Tensor]:
        """The image's DeepStack levels ride in its embeddings' last columns: the methods see the main features,
        the levels follow the survivors (as a video's do)."""
        main, deepstack = emb[:, : self.visual_dim], emb[:, self.visual_dim :]
        side = {"deepstack": deepstack} if deepstack.shape[1] else None
        kept, cells, extras = self.vtc.compress_image(main, grid, index, side)
        return (torch.cat([kept, extras["deepstack"].to(kept.dtype)], dim=1) if side else kept), cells

    def _media_extent(self, feature, input_tokens) -> int:
        if feature.modality == "image":
            return super()._media_extent(feature, input_tokens)
        merge = self.config.vision_config.spatial_merge_size
        frames, h, w = _qwen_grid(feature.data["video_grid_thw"].data.tolist(), merge)
        span = list(input_tokens[feature.mm_position.offset : feature.mm_position.offset + feature.mm_position.length])
        return frame_span_extent(len(span) - span.count(self.config.video_token_id), frames, (h, w))

    def _process_video_input(self, video_input):
        run = functools.partial(super()._process_video_input, video_input)
        if self.vtc is None:
            return run()
        merge = self.visual.spatial_merge_size
        grid_thw = video_input["video_grid_thw"]
        grids = [_qwen_grid(size, merge) for size in grid_thw.tolist()]
        run = self.vtc.encode_run(run, self.visual, video_input.get("pixel_values_videos"), grid_thw, grids)
        return self.vtc.encode(run, grids, grid_thw)

    def _postprocess_video_embeds_evs(self, video_embeds_split, video_input):
        if self.vtc is None:
            return super()._postprocess_video_embeds_evs(video_embeds_split, video_input)
        merge = self.visual.spatial_merge_size
        return tuple(
            self._video_span(emb, _qwen_grid(size, merge), video_input.timestamps[k], k)
            for k, (emb, size) in enumerate(zip(video_embeds_split, video_input["video_grid_thw"].tolist()))
        )

    def _video_span(self, emb: Tensor, grid: tuple[int, int, int], timestamps, index: int) -> Tensor:
        """One video's whole prompt span: text embeddings of its timestamps and markers, its survivors frame by
        frame, DeepStack features on the survivors' slots, and every slot's relative position."""
        config = self.config
        frames, h, w = grid
        main, deepstack = emb[:, : self.visual_dim], emb[:, self.visual_dim :]
        kept, cells, side = self.vtc.compress(
            main, grid, index, {"deepstack": deepstack} if deepstack.shape[1] else None
        )
        cells = cells.cpu()
        per_frame = torch.bincount(torch.div(cells, h * w, rounding_mode="floor"), minlength=frames).tolist()
        ids = torch.tensor(
            Qwen3VLMultiModalProcessor.get_video_repl(
                tokens_per_frame=per_frame,
                timestamps=timestamps,
                tokenizer=self._tokenizer,
                vision_start_token_id=config.vision_start_token_id,
                vision_end_token_id=config.vision_end_token_id,
                video_token_id=config.video_token_id,
                select_token_id=False,
            ).full
        )
        is_video = ids == config.video_token_id
        embeds = self.get_language_model().embed_input_ids(ids.to(emb.device)).to(kept.dtype)
        embeds[is_video.to(emb.device)] = kept
        parts = [embeds]
        if deepstack.shape[1]:
            slots = embeds.new_zeros(len(ids), deepstack.shape[1])
            slots[is_video.to(emb.device)] = side["deepstack"].to(slots.dtype)
            parts.append(slots)
        local = cells % (h * w)
        cells_hw = torch.stack([torch.div(local, w, rounding_mode="floor"), local % w], dim=1)
        relative = frame_span_positions(is_video, ids == config.vision_start_token_id, cells_hw, (h, w))
        return append_positions(torch.cat(parts, dim=1), relative)


# --- LLaVA families ---------------------------------------------------------------------------------------------


def _frames_per_video(pixels) -> list[int]:
    if isinstance(pixels, torch.Tensor):
        return [int(pixels.shape[1])] * int(pixels.shape[0])
    return [int(v.shape[0]) for v in pixels]


class _LlavaServing(_ServingModel):
    """1-D RoPE: vLLM numbers the compressed prompt's tokens in order, nothing to re-position."""

    trailing = 0

    def _process_video_pixels(self, inputs):
        run = functools.partial(super()._process_video_pixels, inputs)
        if self.vtc is None:
            return run()
        frames = _frames_per_video(inputs["pixel_values_videos"])
        # the grid is known once the tower ran; statistics are split by frames, so a provisional grid will do
        grids = [(f, 1, 1) for f in frames]
        run = self.vtc.frame_encode_run(run, self.vision_tower, frames)  # tower methods (ToMe, GRT's stage 1)
        videos = self.vtc.encode(run, grids)
        out = []
        for k, video in enumerate(videos):
            video = video.reshape(-1, video.shape[-1])
            body = video[: video.shape[0] - self.trailing]
            grid = _llava_grid(body.shape[0], frames[k])
            kept, _, _ = self.vtc.compress(body, grid, k)
            out.append(torch.cat([kept, video[body.shape[0] :]], dim=0))
        return out


class VtcLlavaOnevisionProcessor(_LlavaOnevisionImages, _LlavaProcessor, LlavaOnevisionMultiModalProcessor):
    family = "llava_onevision"
    trailing = 1


@MULTIMODAL_REGISTRY.register_processor(
    VtcLlavaOnevisionProcessor, info=LlavaOnevisionProcessingInfo, dummy_inputs=LlavaOnevisionDummyInputsBuilder
)
class VtcLlavaOnevision(_LlavaServing, LlavaOnevisionForConditionalGeneration):
    """Images: each view through the image pipeline (the base view as a frame, the crops on their packed grid, with
    the statistics packed the way their features are); the base view's survivors in the methods' order, the crops'
    at their own places with every row's newline, as vtc's HF backend lays them out."""

    family = "llava_onevision"
    trailing = 1

    def _process_image_input(self, image_input):
        if self.vtc is None or image_input.type != "pixel_values":  # embeddings were refused by the processor
            return super()._process_image_input(image_input)
        pixels = image_input["pixel_values"]
        views = _frames_per_video(pixels)
        run = functools.partial(self._process_image_pixels, image_input)
        run = self.vtc.frame_encode_run(run, self.vision_tower, views, "image")  # tower methods (ToMe), per view
        patches = self.vtc.encode_images(run, [(v, 1, 1) for v in views], None)
        sizes = image_input.get("image_sizes")
        if sizes is None:
            side = self.config.vision_config.image_size
            sizes = torch.as_tensor([[side, side]] * len(views))
        return [self._image(patch, sizes[k], k) for k, patch in enumerate(patches)]

    def _image(self, patch: Tensor, size: Tensor, index: int) -> Tensor:
        """One image's prompt span: vLLM's own packing of its views (base, then the unpadded, resized crops), each
        view compressed, the newlines put back."""
        if self.vtc.image_pipeline_of(index) is None:  # "images": false
            return self._merge_image_patch_embeddings(
                size, patch, image_newline=self.image_newline, strategy="spatial_unpad"
            )
        merged = self._merge_image_patch_embeddings(size, patch, image_newline=None, strategy="spatial_unpad")
        layout = anyres_layout_of(self.family, self.config, size.tolist())
        base_len = layout.side * layout.side
        if merged.shape[0] != base_len + (layout.rows * layout.cols if layout.rows else 1):
            raise RuntimeError(f"vtc: the anyres layout {layout} does not match vLLM's packing ({merged.shape[0]})")
        stats = self.vtc.image_vision_of(index)
        cls_tokens = self.vtc.geometry.cls_tokens

        def view_stats(view: str) -> dict:
            return {stat: anyres_view_stat(stat, v, layout, view, cls_tokens) for stat, v in stats.items()}

        base, _, _ = self.vtc.compress_image(
            merged[:base_len], (1, layout.side, layout.side), index, view="base", vision=view_stats("base")
        )
        newline = self.image_newline.to(merged.device, merged.dtype)[None]
        if not layout.rows:
            return torch.cat([base, newline])
        rows, cols = layout.rows, layout.cols
        crops, cells, _ = self.vtc.compress_image(
            merged[base_len:],
            (1, rows, cols),
            index,
            view="crops",
            vision=view_stats("crops"),
            geometry=dataclasses.replace(self.vtc.geometry, patch_grid=None),
        )
        # each kept token at its own place in the packed grid, the newline after every row (kept or emptied)
        cells = cells.to(crops.device)
        keys = torch.cat(
            [cells // cols * (cols + 1) + cells % cols, torch.arange(rows, device=crops.device) * (cols + 1) + cols]
        )
        order = torch.sort(keys).indices
        return torch.cat([base, torch.cat([crops, newline.expand(rows, -1)])[order]])


class VtcLlavaNextVideoProcessor(_LlavaProcessor, LlavaNextVideoMultiModalProcessor):
    family = "llava_next_video"


@MULTIMODAL_REGISTRY.register_processor(
    VtcLlavaNextVideoProcessor, info=LlavaNextVideoProcessingInfo, dummy_inputs=LlavaNextVideoDummyInputsBuilder
)
class VtcLlavaNextVideo(_LlavaServing, LlavaNextVideoForConditionalGeneration):
    family = "llava_next_video"
