"""vLLM's five video-LLM classes with vtc's connect engine in `embed_multimodal`, and their processors sizing
each video's placeholders to `retained_count`.

`vtc.vllm.plugin.register` registers these classes under vLLM's architecture names (lazily, by string), so
`vllm serve` picks them for the five families. Without a vtc config they are vLLM's classes, unchanged. With
one (`additional_config={"vtc": {...}}`):

  processor (API server): the video replacement is `retained_count(grid)` placeholders (+ LLaVA-OneVision's
      newline; Qwen3-VL: the whole per-video span, timestamps included, as vLLM's own pruning lays it out);
  model (each worker): the vision encoder runs as usual (statistics captured if a method asks), then
      `vtc.core.engine.connect_video` compresses each video and the survivors go back frame by frame, with
      their original M-RoPE positions appended the way vLLM's pruning path expects them (the runner then
      calls `recompute_mrope_positions`, which re-positions the text after the video).

The encoder cache therefore holds media-only results: nothing here reads the question.
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
from vllm.multimodal.processing import PromptReplacement
from vllm.multimodal.video_prune.evs import compute_mrope_for_media

from vtc.core.engine import connect_video, grid_cells
from vtc.core.geometry import FamilyGeometry
from vtc.core.pipeline import Pipeline
from vtc.core.tokens import Context
from vtc.hf.prepool import PrepoolCapture
from vtc.vllm.config import CONFIG_ATTR, KEY, ServeConfig
from vtc.vllm.vision import EncoderStatsCapture, tp_group

Tensor = torch.Tensor
logger = init_logger("vllm.vtc")  # under vLLM's logger, so `vllm serve` shows it at INFO
LAST_KEPT: list[dict[str, Any]] = []  # the grid cells each video kept, newest last (tests and debugging)


@functools.lru_cache(maxsize=16)
def _pipeline(config_json: str, family: str) -> Pipeline:
    return ServeConfig.from_dict(json.loads(config_json)).pipeline(family)


def serving_pipeline(hf_config, family: str) -> Pipeline | None:
    """The pipeline of a served model, or None when the server runs without vtc."""
    config = getattr(hf_config, CONFIG_ATTR, None)
    if not config:
        return None
    return _pipeline(json.dumps(config, sort_keys=True), family)


def _geometry(family: str, hf_config) -> FamilyGeometry:
    """The loaded model's geometry, computed by the HF adapter of the family from the same config."""
    from vtc.hf.adapters import config_adapter

    return config_adapter(family, hf_config).geometry


# --- model side ----------------------------------------------------------------------------------------------


class Serving:
    """One served model's compression: the pipeline, the vision statistics it reads, the connect engine call."""

    def __init__(self, model: torch.nn.Module, family: str, config: ServeConfig) -> None:
        self.family = family
        tower = model.visual if hasattr(model, "visual") else model.vision_tower  # Qwen / LLaVA
        self.config = config
        self.pipeline = config.pipeline(family)
        hf_config = model.config
        self.geometry = _geometry(family, hf_config)
        stats = self.pipeline.vision_stats(family)
        self.stats = EncoderStatsCapture(family, tower, hf_config, stats, qwen=self.geometry.mrope) if stats else None
        # pre-pool features exist on LLaVA families only (Qwen's 2x2 merge is inside the vision tower)
        needs_prepool = self.pipeline.needs_prepool and self.geometry.has_prepool_grid
        self.prepool = _prepool_capture(model, family) if needs_prepool else None
        self._vision: list[dict] = []
        self._prepool: list[Tensor] | None = None

    @classmethod
    def create(cls, model: torch.nn.Module, vllm_config, family: str) -> "Serving | None":
        raw = (
            (vllm_config.additional_config or {}).get(KEY) if isinstance(vllm_config.additional_config, dict) else None
        )
        if not raw:
            return None
        config = ServeConfig.from_dict(raw)
        serving = cls(model, family, config)
        _check_encoder_parallelism(vllm_config, serving)
        return serving

    def encode(self, run, grids: list[tuple[int, int, int]], grid_thw: Tensor | None = None):
        """Run the vision encoder (`run()`), capturing what the connect methods read for these videos."""
        frames = [g[0] for g in grids]
        if self.stats is None and self.prepool is None:
            return run()
        if self.prepool is not None:
            self.prepool.install()
        try:
            if self.stats is not None:
                with self.stats.capturing(grid_thw, sum(frames)):
                    out = run()
                self._vision = self.stats.per_video(grids)
            else:
                out = run()
            if self.prepool is not None:
                self._prepool = self.prepool.per_video(frames)
        finally:
            if self.prepool is not None:
                self.prepool.remove()
        return out

    def compress(
        self, embeds: Tensor, grid: tuple[int, int, int], index: int, extras: dict[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """One video through the connect engine -> (embeds, grid cells, extras) of the survivors, frame by frame."""
        ctx = Context(
            retention=self.pipeline.retention,
            family=self.family,
            geometry=self.geometry,
            video_index=index,
            generator=torch.Generator(device="cpu").manual_seed(self.config.seed),
            vision=self._vision[index] if index < len(self._vision) else {},
        )
        if self._prepool is not None:
            ctx.prepool, ctx.pool, ctx.project = self._prepool[index], self.prepool.pool, self.prepool.projection
        self.pipeline.begin_prompt()
        _, out = connect_video(self.pipeline, embeds, grid, ctx, extras=extras)
        promised = self.pipeline.retained_count(grid)
        if promised is not None and promised != len(out):
            raise RuntimeError(
                f"vtc: {self.pipeline.spec!r} promised {promised} tokens for a video with grid {grid} but kept "
                f"{len(out)}; the prompt was sized for {promised}"
            )
        logger.info(
            "vtc %s: video %d, grid %s: kept %d of %d tokens", self.pipeline.spec, index, grid, len(out), len(embeds)
        )
        embeds_out, cells, extras_out = _same_on_every_rank(out.embeds, grid_cells(out), out.extras)
        # the HF backend's layout: frames in order, each frame's tokens in the order the plugin returned them
        order = torch.sort(torch.div(cells, grid[1] * grid[2], rounding_mode="floor"), stable=True).indices
        LAST_KEPT.append({"family": self.family, "grid": grid, "cells": torch.sort(cells).values.cpu()})
        del LAST_KEPT[:-64]
        kept_extras = {name: value[order] for name, value in extras_out.items()}
        return embeds_out[order].to(embeds.dtype), cells[order], kept_extras


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


def _no_encoder_cudagraphs(config):
    """vLLM's encoder CUDA graphs bypass `embed_multimodal`'s post-processing: keep them off for videos."""
    if config is not None and dataclasses.is_dataclass(config) and hasattr(config, "modalities"):
        return dataclasses.replace(config, modalities=[])
    return config


class _MRopeServing:
    """The Qwen families: with vtc on, vLLM's pruning switches are on too, so the runner re-positions the prompt
    after embed_multimodal (`recompute_mrope_positions`)."""

    family = ""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vtc = Serving.create(self, vllm_config, self.family)
        if self.vtc is not None:
            self.is_multimodal_pruning_enabled = True
            self.supports_multimodal_pruning = True


class _QwenServing(_MRopeServing):
    """What Qwen2-VL and Qwen2.5-VL share: compress each video, append its survivors' M-RoPE positions."""

    def _process_video_input(self, video_input):
        run = functools.partial(super()._process_video_input, video_input)
        return run() if self.vtc is None else self._vtc_videos(run, video_input)

    def _vtc_videos(self, run, video_input) -> tuple[Tensor, ...]:
        grid_thw = video_input["video_grid_thw"]
        merge = self.visual.spatial_merge_size
        grids = [_qwen_grid(size, merge) for size in grid_thw.tolist()]
        split = self.vtc.encode(run, grids, grid_thw)
        seconds = video_input.get("second_per_grid_ts")
        rate = float(getattr(self.config.vision_config, "tokens_per_second", 1.0) or 1.0)
        out = []
        for k, (emb, size) in enumerate(zip(split, grid_thw.tolist())):
            kept, cells, _ = self.vtc.compress(emb, grids[k], k)
            per_grid = float(seconds[k]) if seconds is not None else 1.0
            if seconds is not None:
                per_grid = int(per_grid)  # vLLM casts second_per_grid_ts to long, as transformers does
            positions = compute_mrope_for_media(torch.tensor(size), merge, rate, per_grid)[cells.cpu()]
            out.append(torch.cat([kept, positions.to(kept.device, kept.dtype)], dim=1))
        return tuple(out)


# --- Qwen2-VL ---------------------------------------------------------------------------------------------------


def _wrap_video_replacement(updates, make, mm_items):
    """Prompt updates with the video replacement rebuilt by `make(original_replacement)`."""
    _warn_uncompressed_images(mm_items.get_count("image", strict=False))
    out = []
    for update in updates:
        if isinstance(update, PromptReplacement) and update.modality == "video":
            update = PromptReplacement(modality="video", target=update.target, replacement=make(update.replacement))
        out.append(update)
    return out


@functools.lru_cache(maxsize=1)
def _warn_uncompressed_images(count: int) -> None:
    """Say once (per count) that images pass uncompressed: vtc compresses videos, and a client that sends a
    video's frames as images (lmms-eval's `vllm` model does) gets no compression at all."""
    if count:
        logger.warning(
            "vtc compresses video inputs only: this request's %d image(s) reach the LLM uncompressed. A client that "
            "sends video frames as images gets no compression (with lmms-eval use --model vllm_generate, which "
            "sends videos as videos).",
            count,
        )


class _QwenProcessorMixin:
    family = ""

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        updates = super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
        pipeline = serving_pipeline(self.info.get_hf_config(), self.family)
        if pipeline is None:
            return updates
        merge = self.info.get_hf_config().vision_config.spatial_merge_size

        def make(original):
            def replacement(item_idx: int):
                full = original(item_idx)
                grid = _qwen_grid(out_mm_kwargs["video"][item_idx]["video_grid_thw"].data.tolist(), merge)
                return [full[0]] * pipeline.retained_count(grid)

            return replacement

        return _wrap_video_replacement(updates, make, mm_items)


class VtcQwen2VLProcessor(_QwenProcessorMixin, Qwen2VLMultiModalProcessor):
    family = "qwen2_vl"


@MULTIMODAL_REGISTRY.register_processor(
    VtcQwen2VLProcessor, info=Qwen2VLProcessingInfo, dummy_inputs=Qwen2VLDummyInputsBuilder
)
class VtcQwen2VL(_QwenServing, Qwen2VLForConditionalGeneration):
    family = "qwen2_vl"

    def _process_image_input(self, image_input):
        embeds = super()._process_image_input(image_input)
        if self.vtc is None:
            return embeds
        return Qwen2_5_VLForConditionalGeneration._postprocess_image_embeds_evs(self, embeds, image_input)

    # vLLM's own position fix-up after pruning (written for Qwen2.5-VL; it only reads the config's token ids)
    recompute_mrope_positions = Qwen2_5_VLForConditionalGeneration.recompute_mrope_positions

    def get_encoder_cudagraph_config(self):
        config = super().get_encoder_cudagraph_config()
        return config if self.vtc is None else _no_encoder_cudagraphs(config)


# --- Qwen2.5-VL -------------------------------------------------------------------------------------------------


class VtcQwen2_5_VLProcessor(_QwenProcessorMixin, Qwen2_5_VLMultiModalProcessor):
    family = "qwen2_5_vl"


@MULTIMODAL_REGISTRY.register_processor(
    VtcQwen2_5_VLProcessor, info=Qwen2_5_VLProcessingInfo, dummy_inputs=Qwen2_5_VLDummyInputsBuilder
)
class VtcQwen2_5_VL(_QwenServing, Qwen2_5_VLForConditionalGeneration):
    family = "qwen2_5_vl"

    def _postprocess_video_embeds_evs(self, video_embeds_split, video_input):
        if self.vtc is None:
            return super()._postprocess_video_embeds_evs(video_embeds_split, video_input)
        return video_embeds_split  # compressed and positioned by _process_video_input already


# --- Qwen3-VL ---------------------------------------------------------------------------------------------------


class VtcQwen3VLProcessor(Qwen3VLMultiModalProcessor):
    family = "qwen3_vl"

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        updates = super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
        hf_config = self.info.get_hf_config()
        pipeline = serving_pipeline(hf_config, self.family)
        if pipeline is None:
            return updates
        merge = hf_config.vision_config.spatial_merge_size
        tokenizer = self.info.get_tokenizer()

        def make(original):
            def replacement(item_idx: int):
                item = out_mm_kwargs["video"][item_idx]
                grid = _qwen_grid(item["video_grid_thw"].data.tolist(), merge)
                # the whole per-video span (timestamps, frame markers, video tokens) is filled by the model,
                # which knows how many tokens each frame kept; only its length is fixed here (vLLM's own layout)
                return Qwen3VLMultiModalProcessor.get_video_repl(
                    tokens_per_frame=[pipeline.retained_count(grid)] + [0] * (grid[0] - 1),
                    timestamps=item["timestamps"].data,
                    tokenizer=tokenizer,
                    vision_start_token_id=hf_config.vision_start_token_id,
                    vision_end_token_id=hf_config.vision_end_token_id,
                    video_token_id=hf_config.video_token_id,
                    select_token_id=False,
                )

            return replacement

        return _wrap_video_replacement(updates, make, mm_items)


@MULTIMODAL_REGISTRY.register_processor(
    VtcQwen3VLProcessor, info=Qwen3VLProcessingInfo, dummy_inputs=Qwen3VLDummyInputsBuilder
)
class VtcQwen3VL(_MRopeServing, Qwen3VLForConditionalGeneration):
    family = "qwen3_vl"

    def recompute_mrope_positions(self, input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens):
        """vLLM's position fix-up, told where each video span starts. transformers >= 5.10 processors keep the
        prompt's outer `<|vision_start|>` before a video's first timestamp, and vLLM's helper would take that
        marker for the first frame's and misplace the span (vLLM's own EVS fails the same way on Qwen3-VL);
        hiding outer markers from it (a marker followed by timestamp text, not by video/image tokens or an end
        marker) makes it find the first frame's marker, so the span starts right after the outer one."""
        if self.vtc is None:
            return super().recompute_mrope_positions(
                input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens
            )
        config = self.config
        device = multimodal_embeddings[0].device if len(multimodal_embeddings) else mrope_positions.device
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).clone()
        following = torch.full_like(ids, -1)
        following[:-1] = ids[1:]
        inner = torch.tensor([config.video_token_id, config.vision_end_token_id, config.image_token_id], device=device)
        ids[(ids == config.vision_start_token_id) & ~torch.isin(following, inner)] = -1
        return self._recompute_mrope_positions(
            input_ids=ids,
            multimodal_embeddings=multimodal_embeddings,
            mrope_positions=mrope_positions,
            num_computed_tokens=num_computed_tokens,
            image_token_id=config.image_token_id,
            video_token_id=config.video_token_id,
            vision_start_token_id=config.vision_start_token_id,
        )

    def _process_video_input(self, video_input):
        run = functools.partial(super()._process_video_input, video_input)
        if self.vtc is None:
            return run()
        merge = self.visual.spatial_merge_size
        grids = [_qwen_grid(size, merge) for size in video_input["video_grid_thw"].tolist()]
        return self.vtc.encode(run, grids, video_input["video_grid_thw"])

    def _postprocess_video_embeds_evs(self, video_embeds_split, video_input):
        if self.vtc is None:
            return super()._postprocess_video_embeds_evs(video_embeds_split, video_input)
        merge = self.visual.spatial_merge_size
        out = []
        for k, (emb, size) in enumerate(zip(video_embeds_split, video_input["video_grid_thw"].tolist())):
            grid = _qwen_grid(size, merge)
            main, deepstack = emb[:, : self.visual_dim], emb[:, self.visual_dim :]
            extras = {"deepstack": deepstack} if deepstack.shape[1] else None
            kept, cells, side = self.vtc.compress(main, grid, k, extras)
            raster = torch.sort(cells, stable=True).indices  # vLLM's layout below takes the survivors in grid order
            kept, cells, side = kept[raster], cells[raster], {name: v[raster] for name, v in side.items()}
            if torch.unique(cells).numel() != cells.numel():
                raise RuntimeError(
                    f"vtc: {self.vtc.pipeline.spec!r} let two tokens share a grid cell, which Qwen3-VL's interleaved "
                    "layout in vLLM cannot express; use another method on Qwen3-VL"
                )
            mask = torch.zeros(grid[0] * grid[1] * grid[2], dtype=torch.bool, device=emb.device)
            mask[cells.to(emb.device)] = True
            kept_full = torch.cat([kept, side["deepstack"]], dim=1) if extras else kept
            per_frame = torch.bincount(cells // (grid[1] * grid[2]), minlength=grid[0]).tolist()
            out.append(
                self._create_final_video_embeddings(
                    video_embeddings=kept_full,
                    num_tokens_per_frame=per_frame,
                    timestamps=video_input.timestamps[k],
                    video_grid_thw=size,
                    retention_mask=mask,
                )
            )
        return tuple(out)


# --- LLaVA families ---------------------------------------------------------------------------------------------


class _LlavaProcessorMixin:
    family = ""
    trailing = 0  # placeholder tokens after the frames that are not compressed (LLaVA-OneVision's newline)

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        updates = super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
        pipeline = serving_pipeline(self.info.get_hf_config(), self.family)
        if pipeline is None:
            return updates
        from vllm.multimodal.parse import VideoProcessorItems

        def make(original):
            def replacement(item_idx: int):
                full = original(item_idx)
                videos = mm_items.get_items("video", (VideoProcessorItems,))  # embeddings given by the client: refused
                grid = _llava_grid(len(full) - self.trailing, videos.get_num_frames(item_idx))
                return [full[0]] * (pipeline.retained_count(grid) + self.trailing)

            return replacement

        return _wrap_video_replacement(updates, make, mm_items)


def _llava_grid(tokens: int, frames: int) -> tuple[int, int, int]:
    per_frame = tokens // frames
    side = math.isqrt(per_frame)
    if side * side != per_frame or per_frame * frames != tokens:
        raise ValueError(f"vtc: {tokens} video tokens over {frames} frames is not a square grid per frame")
    return frames, side, side


def _frames_per_video(pixels) -> list[int]:
    if isinstance(pixels, torch.Tensor):
        return [int(pixels.shape[1])] * int(pixels.shape[0])
    return [int(v.shape[0]) for v in pixels]


class _LlavaServing:
    family = ""
    trailing = 0

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vtc = Serving.create(self, vllm_config, self.family)

    def _process_video_pixels(self, inputs):
        run = functools.partial(super()._process_video_pixels, inputs)
        if self.vtc is None:
            return run()
        frames = _frames_per_video(inputs["pixel_values_videos"])
        # the grid is known once the tower ran; statistics are split by frames, so a provisional grid will do
        grids = [(f, 1, 1) for f in frames]
        videos = self.vtc.encode(run, grids)
        out = []
        for k, video in enumerate(videos):
            video = video.reshape(-1, video.shape[-1])
            body = video[: video.shape[0] - self.trailing]
            grid = _llava_grid(body.shape[0], frames[k])
            kept, _, _ = self.vtc.compress(body, grid, k)
            out.append(torch.cat([kept, video[body.shape[0] :]], dim=0))
        return out


class VtcLlavaOnevisionProcessor(_LlavaProcessorMixin, LlavaOnevisionMultiModalProcessor):
    family = "llava_onevision"
    trailing = 1


@MULTIMODAL_REGISTRY.register_processor(
    VtcLlavaOnevisionProcessor, info=LlavaOnevisionProcessingInfo, dummy_inputs=LlavaOnevisionDummyInputsBuilder
)
class VtcLlavaOnevision(_LlavaServing, LlavaOnevisionForConditionalGeneration):
    family = "llava_onevision"
    trailing = 1


class VtcLlavaNextVideoProcessor(_LlavaProcessorMixin, LlavaNextVideoMultiModalProcessor):
    family = "llava_next_video"


@MULTIMODAL_REGISTRY.register_processor(
    VtcLlavaNextVideoProcessor, info=LlavaNextVideoProcessingInfo, dummy_inputs=LlavaNextVideoDummyInputsBuilder
)
class VtcLlavaNextVideo(_LlavaServing, LlavaNextVideoForConditionalGeneration):
    family = "llava_next_video"
