"""The hooks `vtc.patch` installs on one model instance, and what they do on each forward.

  outer model (e.g. `Qwen2VLModel`) forward pre-hook   remember input_ids and the media arguments
  text model forward pre-hook, prefill with a video     build `VideoTokens`, run `connect` plugins, rewrite
                                                        inputs_embeds / attention_mask / position_ids (and
                                                        Qwen3-VL DeepStack inputs), start the prefill runtime
  text model forward pre-hook, later forwards           map the growing 2-D attention mask (and positions
                                                        when renumbered) onto the compressed prompt; a later
                                                        forward that brings a new video is refused
  text model forward hook                               check promised counts, close the stats record
Everything is undone by `remove()`; nothing touches classes or other model instances.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import time
import weakref
from typing import Any

import torch

from vtc.core.engine import connect_video
from vtc.core.pipeline import Pipeline
from vtc.core.stats import MediaItem, StatsRecorder
from vtc.core.tokens import Context
from vtc.hf.adapters import Adapter, CapturedInputs, VideoSpan
from vtc.hf.encode import EncodedVideo, EncodeStage, pixel_normalization
from vtc.hf.llm.runtime import LLMRuntime
from vtc.hf.sequence import deepstack_per_token, identity_layout, rebuild
from vtc.hf.vision import VisionCapture

Tensor = torch.Tensor

# models with vtc hooks installed now, each with the patch that installed them (weak: a patched model can be
# garbage-collected); a second patch of the same model is refused (`ModelPatch.install`), and so is vtc.stream
PATCHED_MODELS: "weakref.WeakKeyDictionary[torch.nn.Module, ModelPatch]" = weakref.WeakKeyDictionary()

# models with an open `vtc.stream` session, each with its open sessions (`StreamSession` registers itself when it
# opens and leaves in `close()`; weak both ways, so neither a model nor an abandoned session is kept alive). A
# stream runs the model's own forward chunk by chunk and reads its outputs, so a patch installed meanwhile would
# rewrite what the stream reads: `ModelPatch.install` refuses such a model
OPEN_STREAMS: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def open_streams(model: torch.nn.Module) -> list[Any]:
    """The `vtc.stream` sessions open on `model` now."""
    return [s for s in OPEN_STREAMS.get(model, ()) if not getattr(s, "closed", False)]


def media_kwargs() -> tuple[str, ...]:
    """Outer-model forward arguments that describe the media, of every registered family (each adapter keeps its
    own family's, `Family.media_kwargs`, via `Adapter.capture`)."""
    from vtc.core.families import families

    return tuple(dict.fromkeys(k for family in families() for k in family.media_kwargs))


def __getattr__(name: str):
    # `MEDIA_KWARGS`: the union of every family's media arguments, read from the family registry on use
    if name == "MEDIA_KWARGS":
        return media_kwargs()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass
class PromptMapping:
    """How the prompt of the last prefill was compressed, for the forwards that continue it."""

    original_length: int  # padded prompt length the caller sees
    attention_mask: Tensor  # [B, L'] mask of the compressed prompt
    next_original_position: Tensor  # [B] first position after the prompt in the original numbering
    position_shift: Tensor | None  # [B] original - compact next position (compact policy only)
    prompt_tokens: Tensor | None = None  # [B] real (unpadded) prompt tokens of each row
    tokens_after: int = 0  # tokens processed since the prefill


def _cache_length(kwargs: dict[str, Any]) -> int:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        return 0
    try:
        return int(cache.get_seq_length())
    except (AttributeError, TypeError):
        return 0


def _prompt_order(span: VideoSpan) -> tuple[int, int]:
    return span.batch, int(span.seq_index.min())


class ModelPatch:
    """All hooks for one (model, pipeline) pair."""

    def __init__(
        self,
        adapter: Adapter,
        pipeline: Pipeline,
        recorder: StatsRecorder,
        positions: str | None = None,
        seed: int = 0,
        tokenizer: Any = None,
        processor: Any = None,
        images: bool = True,
    ) -> None:
        self.adapter = adapter
        self.pipeline = pipeline
        self.images = images  # compress images too (else they reach the LLM whole, listed in the stats)
        self.recorder = recorder
        self.policy = pipeline.position_policy(positions, adapter.mrope)
        self.seed = seed
        self.tokenizer = tokenizer
        self.processor = processor
        self.runtime: LLMRuntime | None = None
        self.encode: EncodeStage | None = None
        self.vision: VisionCapture | None = None
        self.prepool = None
        self.mapping: PromptMapping | None = None
        # what the last handle.prepare call produced (question text, sampler outputs) for each of its prompts,
        # keyed by the prompt's token ids; replaced by the next call, so it never holds more than one request
        self.prepared: dict[tuple[int, ...], dict[str, Any]] = {}
        self.enabled = True
        self._captured: CapturedInputs | None = None
        self._image_call: dict[str, Any] | None = None  # the last get_image_features call's sizes (LLaVA, generate)
        self._handles: list[Any] = []
        self._llm_start = 0.0
        self._prefill_ctx: Context | None = None
        self._final_counts = None  # per item: visual tokens at the last layer of the current prefill
        self._counted: list[tuple] = []  # per item: (grid, the pipeline that promised its count)
        self._prefill_pipeline = pipeline  # whose prefill methods run on the current prompt
        self._images_pipeline: Pipeline | None = None

    # --- install / remove -------------------------------------------------------------------------------------
    def describe(self) -> str:
        """The handle this patch belongs to, as `PatchHandle.__repr__` shows it."""
        return f"PatchHandle({self.pipeline.spec!r}, retention={self.pipeline.retention}, active)"

    def install(self) -> None:
        adapter = self.adapter
        active = PATCHED_MODELS.get(adapter.model)
        if active is not None and active is not self:
            # two patches would both hook the model: the sequence is compressed by one of them, and unpatching
            # either leaves the other's handle reporting a state the model is not in
            spec = self.pipeline.spec
            raise ValueError(
                f"this model is already patched by {active.describe()}; vtc applies one patch per model. Compose "
                f"the methods in one spec instead, e.g. vtc.patch(model, '{active.pipeline.spec}+{spec}', "
                f"retention=...) (methods run by stage, then in the order given), or call handle.unpatch() on the "
                f"active handle first and then vtc.patch(model, {spec!r}, ...)"
            )
        streams = open_streams(adapter.model)
        if streams:
            # the stream encodes its chunks with the model's own forward: the patch's hooks would compress them
            # too, and the stream's rows would no longer match what it reads back
            raise ValueError(
                f"this model has an open vtc.stream session ({', '.join(map(repr, streams))}); vtc.patch and a "
                "stream cannot share a model: close the stream first (session.close(), or leave its `with` block), "
                f"then vtc.patch(model, {self.pipeline.spec!r}, ...), or patch another instance of the model"
            )
        PATCHED_MODELS[adapter.model] = self
        try:
            self._install()
        except BaseException:
            self.remove()  # a patch that failed half-way leaves no hook and no mark behind
            raise

    def _install(self) -> None:
        adapter = self.adapter
        record = adapter.record
        for e in self.pipeline.stage_entries("connect"):
            record.check_vision_stats(e.card.name, e.method.vision_stats(adapter.family))
        stats = self.pipeline.vision_stats(adapter.family)
        if stats:
            self.vision = VisionCapture(adapter, stats)
            self.vision.install()
        if self.pipeline.has_stage("encode"):
            units = "encode_units" in adapter.record.features  # the pixels of merge units (pre-tower methods)
            mean, std = pixel_normalization(adapter, self.processor) if units else ((), ())
            images = (lambda: self._image_pipeline()) if self.images else None  # built when the first image comes
            self.encode = EncodeStage(adapter, self.pipeline, mean, std, seed=self.seed, image_pipeline=images)
            self.encode.install()
        if self.pipeline.needs_prepool:
            self.prepool = adapter.prepool_capture()
            if self.prepool is not None:
                self.prepool.install()
        if self.images and adapter.image_call_kwargs:
            self._record_image_calls()
        self._handles.append(adapter.outer.register_forward_pre_hook(self._outer_pre_hook, with_kwargs=True))
        self._handles.append(adapter.text_model.register_forward_pre_hook(self._llm_pre_hook, with_kwargs=True))
        self._handles.append(adapter.text_model.register_forward_hook(self._llm_post_hook, with_kwargs=True))
        if self.pipeline.has_stage("prefill"):
            self.runtime = LLMRuntime(
                adapter.text_model,
                adapter.decoder_layers,
                self._call_prefill_plugins,
                adapter.family,
                deepstack=adapter.deepstack,
                decode_plugins=self.pipeline.acts_during_decode,
            )
            self.runtime.install()

    def remove(self) -> None:
        if PATCHED_MODELS.get(self.adapter.model) is self:
            del PATCHED_MODELS[self.adapter.model]
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.runtime is not None:
            self.runtime.remove()
            self.runtime = None
        if self.vision is not None:
            self.vision.remove()
            self.vision = None
        if self.prepool is not None:
            self.prepool.remove()
            self.prepool = None
        if self.encode is not None:
            self.encode.remove()
            self.encode = None
        if "get_image_features" in self.adapter.outer.__dict__ and self._image_call is not None:
            del self.adapter.outer.__dict__["get_image_features"]
        self._image_call = None
        self.mapping = None
        self._captured = None

    @contextlib.contextmanager
    def suspended(self):
        """Run the model as if unpatched (samplers that score frames with the model itself use this)."""
        before = self.enabled
        self.enabled = False
        for part in (self.vision, self.prepool, self.encode):
            if part is not None:
                part.enabled = False
        try:
            yield
        finally:
            self.enabled = before
            for part in (self.vision, self.prepool, self.encode):
                if part is not None:
                    part.enabled = before

    # --- hooks ---------------------------------------------------------------------------------------------------
    def _outer_pre_hook(self, module, args, kwargs):
        if not self.enabled:
            return None
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        self._captured = self.adapter.capture(input_ids, kwargs.get("attention_mask"), kwargs)
        encoded_images = (kwargs.get("mm_encoder_outputs") or {}).get("image")
        if self._image_call and encoded_images is not None and kwargs.get("pixel_values") is None:
            # generate encoded the images before this forward: their sizes come from that call
            for name, value in self._image_call.items():
                self._captured.kwargs.setdefault(name, value)
            self._image_call = {}
        mapping = self.mapping
        if mapping is not None and _cache_length(kwargs) > 0:
            self._check_continuation(mapping, kwargs.get("position_ids"))
        if mapping is not None and _cache_length(kwargs) > 0 and kwargs.get("attention_mask") is None:
            # models derive decode positions from the mask; give them one of the original (uncompressed) length
            if input_ids is not None:
                total = mapping.original_length + mapping.tokens_after + input_ids.shape[1]
                kwargs["attention_mask"] = torch.ones(
                    input_ids.shape[0], total, dtype=torch.long, device=input_ids.device
                )
                return args, kwargs
        return None

    def _record_image_calls(self) -> None:
        """Record what `image_layouts` needs (`adapter.image_call_kwargs`) of every call of the model's
        `get_image_features` (an instance attribute, removed by `remove`): generate calls it before the forward."""
        outer = self.adapter.outer
        original = outer.get_image_features
        signature = inspect.signature(original)
        names = self.adapter.image_call_kwargs

        @functools.wraps(original)  # generate picks the call's arguments by its signature
        def get_image_features(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            self._image_call = {name: bound[name] for name in names if bound.get(name) is not None}
            return original(*args, **kwargs)

        outer.get_image_features = get_image_features
        self._image_call = {}

    @staticmethod
    def _check_continuation(mapping: PromptMapping, position_ids) -> None:
        """A forward continuing the compressed prompt must start where the sequence stopped. generate derives
        that from the cache's length, which the compression shortened, so a second generate call on the same
        cache re-feeds tokens the model already saw; its text positions then start too early."""
        if position_ids is None or mapping.prompt_tokens is None:
            return
        # generate passes Qwen models a leading "text" row ([4, B, L]); transformers 5.19 passes only that row
        # ([1, B, L]) when it continues a cache it was handed
        text = position_ids[0] if position_ids.dim() == 3 and position_ids.shape[0] in (1, 4) else None
        if text is None and position_ids.dim() == 2:
            text = position_ids  # 1-D RoPE families: the positions are the text positions
        if text is None or text.shape[-1] == 0:
            return
        first = text[:, 0].cpu()
        expected = mapping.prompt_tokens + mapping.tokens_after
        if first.shape == expected.shape and not bool((first == expected).all()):
            raise ValueError(
                f"this forward continues a compressed prompt at position {int(first[0])}, but the sequence stopped at "
                f"{int(expected[0])}: generate(past_key_values=...) re-feeds the tokens past the compressed cache's "
                f"length ({int(first[0])}). vtc cannot continue a compressed cache across generate calls: send the "
                "whole conversation again without past_key_values (vtc compresses it anew)"
            )

    def _llm_pre_hook(self, module, args, kwargs):
        if not self.enabled:
            return None
        captured, self._captured = self._captured, None
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            return None
        if _cache_length(kwargs) > 0:
            if self._brings_video(captured):
                raise ValueError(
                    "this forward continues a cached sequence and brings a new video; vtc compresses the video of "
                    "a sequence's first forward only, and will not let this one reach the LLM uncompressed. Send the "
                    "whole conversation as one prompt (no past_key_values), or run this turn under handle.suspended()"
                )
            return self._continue_prompt(args, kwargs, embeds)
        self.mapping = None
        self._final_counts = None
        if self.runtime is not None:
            self.runtime.reset()  # also recovers from a forward that raised half-way
        if captured is None or captured.input_ids is None or not self._has_media(captured):
            note = "" if captured is None or captured.input_ids is not None else "(called with inputs_embeds only)"
            self.recorder.begin(False, batch_size=embeds.shape[0], note=note)
            self._llm_start = time.perf_counter()
            return None
        kwargs = self._compress_prompt(kwargs, embeds, captured)
        self._llm_start = time.perf_counter()
        return args, kwargs

    def _has_media(self, captured: CapturedInputs) -> bool:
        """The prompt has a video, or an image vtc compresses or lists in the stats (`_lists_images`)."""
        return self.adapter.has_video(captured) or self._lists_images() and self.adapter.has_image(captured)

    def _lists_images(self) -> bool:
        """Images are compressed (`images=True`; a family vtc cannot find the images of then refuses them), or pass
        whole but are listed in the stats (a family whose images vtc can find)."""
        return self.images or type(self.adapter).image_spans is not Adapter.image_spans

    def _brings_video(self, captured: CapturedInputs | None) -> bool:
        """The forward carries video pixels (or encoder outputs) and video placeholders: a new video, not a
        decode step (during decoding generate drops the media arguments)."""
        if captured is None or captured.input_ids is None:
            return False
        return captured.has_video_media and self.adapter.has_video(captured)

    def _llm_post_hook(self, module, args, kwargs, output):
        if not self.enabled:
            return None
        stats = self.recorder.current
        if self.runtime is not None:
            counts = self.runtime.end_forward()
            if stats is not None and stats.has_video and counts:
                stats.layer_visual_tokens = counts
                stats.visual_tokens_out = counts[-1]
        elif stats is not None and stats.has_video:
            stats.layer_visual_tokens = [stats.llm_tokens_in] * len(self.adapter.decoder_layers)
        if stats is not None:
            stats.prefill_seconds = time.perf_counter() - self._llm_start
            self.recorder.end()
            if stats.has_video and self._final_counts is not None:
                self._check_promised_counts(stats, self._final_counts())
        return None

    def _check_promised_counts(self, stats, actual: list[int]) -> None:
        """Where the pipeline promises a count (`retained_count`), every item must end the prefill with exactly
        that many visual tokens: a serving engine sizes its prompt from the promise."""
        for (grid, kind, pipeline), count in zip(self._counted, actual):
            promised = pipeline.retained_count(grid, self.adapter.family)
            if promised is not None and promised != count:
                raise RuntimeError(
                    f"{pipeline.spec!r} promised {promised} visual tokens for an item ({kind}) with grid {grid} "
                    f"(retained_count) but the last LLM layer kept {count}; a plugin breaks its retained_count"
                )

    def _image_pipeline(self) -> Pipeline:
        """The pipeline images go through (`Pipeline.for_images`), built when the first image arrives: a spec that
        cannot reduce an image is refused then, naming why."""
        if self._images_pipeline is None:
            self._images_pipeline = self.pipeline.for_images()
        return self._images_pipeline

    def _vision_stats(self, videos: list[VideoSpan], images: list[VideoSpan]) -> dict[tuple[str, int], dict]:
        """The vision-tower statistics of every compressed item, by (kind, index); empty without a capture."""
        if self.vision is None:
            return {s.key: {} for s in videos + images}
        return self.vision.media_stats(videos, images)

    # --- prefill ---------------------------------------------------------------------------------------------------
    def _compress_prompt(self, kwargs: dict[str, Any], embeds: Tensor, captured: CapturedInputs) -> dict[str, Any]:
        adapter = self.adapter
        bsz, length, _ = embeds.shape
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones(bsz, length, dtype=torch.long, device=embeds.device)
        elif not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ValueError("vtc needs a 2-D attention_mask (or none); got a prepared 4-D/dict mask")
        positions = self._original_positions(kwargs.get("position_ids"), bsz, length, embeds.device)
        captured.kwargs["llm_position_ids"] = positions
        videos = adapter.video_spans(captured) if adapter.has_video(captured) else []
        images = adapter.image_spans(captured) if self._lists_images() and adapter.has_image(captured) else []
        image_pipeline = self._image_pipeline() if self.images and images else None
        # the compressed items, in prompt order (images passing whole stay in the sequence as text does)
        spans = sorted(videos + (images if image_pipeline is not None else []), key=_prompt_order)

        deepstack = deepstack_mask = None
        if adapter.deepstack and kwargs.get("deepstack_visual_embeds") is not None:
            deepstack_mask = kwargs["visual_pos_masks"]
            deepstack = deepstack_per_token(deepstack_mask, kwargs["deepstack_visual_embeds"], (bsz, length))

        stats = self.recorder.begin(
            bool(spans),
            batch_size=bsz,
            videos=len(videos),
            images=len({s.video for s in images}),
            grids=[s.grid for s in videos],
            visual_tokens_in=sum(s.num_tokens for s in spans),
            sequence_in=length,
        )
        for b in range(bsz):  # the frames handle.prepare chose for this prompt, row by row
            row = captured.input_ids[b][mask[b].bool().to(captured.input_ids.device)]
            stats.frames.extend(self.prepared.get(tuple(row.tolist()), {}).get("frames", []))
        encoded = self._encoded_videos(videos)
        encoded_images = self._encoded_images(images) if image_pipeline is not None else None
        vision = self._vision_stats(videos, images if image_pipeline is not None else [])
        prepool = self.prepool.per_video([s.grid[0] for s in videos]) if self.prepool is not None and videos else None
        if encoded is None and encoded_images is None:  # else the prompt began in a tower call (its state carries on)
            self.pipeline.begin_prompt()  # every method's ctx.state starts empty for this prompt
        if image_pipeline is not None:
            image_pipeline.share_prompt_state(self.pipeline)  # a method's state is one per prompt, images included
        outputs = []
        changed = False
        for span in spans:
            is_video = span.kind == "video"
            ctx = self._context(span, captured, mask).replace(video_index=span.video, vision=vision[span.key])
            ctx = ctx.replace(media=span.kind)
            if span.view == "crops":  # the crops' statistics come packed on their token grid (`pack_crops`)
                ctx = ctx.replace(geometry=dataclasses.replace(ctx.geometry, patch_grid=None))
            if prepool is not None and is_video:
                ctx = ctx.replace(prepool=prepool[span.video], pool=self.prepool.pool, project=self.prepool.projection)
            inputs = self._video_inputs(span, embeds, positions, deepstack)
            item_encoded = encoded if is_video else encoded_images
            if item_encoded is not None:
                inputs["survivors"] = item_encoded[span.video].kept
                inputs["survivor_weights"] = item_encoded[span.video].weight
            pipeline = self.pipeline if is_video else image_pipeline
            tokens, out = connect_video(pipeline, ctx=ctx, recorder=self.recorder, **inputs)
            changed |= out is not tokens  # plugins return their input untouched when they keep everything
            outputs.append(out)
        out_of = {span.key: len(out) for span, out in zip(spans, outputs)}
        stats.items = [
            MediaItem(
                s.kind,
                s.video,
                s.batch,
                s.grid,
                s.num_tokens,
                out_of.get(s.key, s.num_tokens),
                s.key in out_of,
                s.view,
            )
            for s in sorted(videos + images, key=_prompt_order)
        ]
        stats.llm_tokens_per_video = [out_of[s.key] for s in videos]
        stats.llm_tokens_in = sum(out_of.values())
        stats.visual_tokens_out = stats.llm_tokens_in
        self._final_counts = (lambda: [len(o) for o in outputs]) if self.runtime is None else self._layer_counts(spans)
        self._counted = [(s.grid, s.kind, self.pipeline if s.kind == "video" else image_pipeline) for s in spans]
        self._prefill_pipeline = self.pipeline
        if not spans:  # only images, passing whole (images=False): the model runs unchanged, its images listed
            stats.note = "images pass whole (images=False)"
            return kwargs
        if image_pipeline is not None:
            if videos:
                self.pipeline.check_images_in_llm()  # the video pipeline's in-LLM methods see the images too
            else:
                self._prefill_pipeline = image_pipeline  # an image-only prompt: the image shares of the retention

        if changed:
            new = rebuild(embeds, mask, positions, spans, outputs, self.policy == "compact", deepstack, deepstack_mask)
            kwargs["inputs_embeds"] = new.embeds
            kwargs["attention_mask"] = new.attention_mask
            # 3-row (M-RoPE) or [B, L] positions; the 4th "text" row transformers uses to detect packed
            # sequences would look packed once tokens are gone, so it is dropped (an explicit mask is passed)
            kwargs["position_ids"] = new.positions if adapter.mrope else new.positions[0]
            if new.deepstack is not None:
                kwargs["visual_pos_masks"] = new.deepstack_mask
                kwargs["deepstack_visual_embeds"] = [
                    new.deepstack[:, :, level][new.deepstack_mask] for level in range(new.deepstack.shape[2])
                ]
            layout, side_ds = new.layout, new.deepstack
            self.mapping = self._mapping(mask, positions, new.attention_mask, new.positions)
            stats.sequence_out = new.embeds.shape[1]
        else:
            layout, side_ds = identity_layout(mask, spans), deepstack
            stats.sequence_out = length

        if self.runtime is not None:
            grids = [[s.grid for s in spans if s.batch == b] for b in range(bsz)]
            side = {"deepstack": side_ds} if side_ds is not None else None
            self.runtime.begin_prefill(layout, grids, side)
            self._prefill_ctx = Context(
                retention=self.pipeline.retention,
                family=adapter.family,
                geometry=adapter.geometry,
                model=adapter.model,
            )
        return kwargs

    def _encoded_videos(self, spans: list[VideoSpan]) -> list[EncodedVideo] | None:
        """What the encode stage kept of each video of this prompt (its records go into the stats now that they
        exist); None without encode methods."""
        if self.encode is None:
            return None
        encoded = self.encode.take()
        if not spans and encoded is None:  # no video in this prompt
            return None
        return self._check_encoded(encoded, spans, self.pipeline, "video", "pixel_values_videos")

    def _encoded_images(self, spans: list[VideoSpan]) -> list[EncodedVideo] | None:
        """What the encode stage kept of each image of this prompt; None when the image pipeline has no encode
        method (images then reach the connect stage whole)."""
        if self.encode is None:
            return None
        encoded = self.encode.take("image")
        pipeline = self._image_pipeline()
        records, self.encode.image_records = self.encode.image_records, None
        for rows in records or []:  # LLaVA: the tower methods' work on each image (tower compute only)
            self._record_encode(rows)
        if not pipeline.has_stage("encode") or "encode_units" not in self.adapter.record.features:
            return None  # no encode method for images, or LLaVA's: every cell reaches the connect stage
        return self._check_encoded(encoded, spans, pipeline, "image", "pixel_values")

    def _check_encoded(self, encoded, spans: list[VideoSpan], pipeline: Pipeline, kind: str, pixels: str):
        """The encode stage's items must be this prompt's (their records go into the stats now that they exist)."""
        grids = [s.grid for s in spans]
        if encoded is None or [e.grid for e in encoded] != grids:
            found = f"no {kind}" if encoded is None else f"{kind}s of grids {[e.grid for e in encoded]}"
            raise RuntimeError(
                f"the encode stage ({', '.join(e.card.name for e in pipeline.stage_entries('encode'))}) saw "
                f"{found}, but this prompt has {kind}s of grids {grids}: vtc runs encode methods inside the model's "
                f"get_{kind}_features, so pass {pixels} (not precomputed features or inputs_embeds)"
            )
        for e in encoded:
            self._record_encode(e.records)
        return encoded

    def _record_encode(self, rows: list[tuple]) -> None:
        """An item's encode-stage records, (method, tokens in, tokens out, seconds, reports) each, into the stats."""
        for name, n_in, n_out, seconds, reports in rows:
            self.recorder.record("encode", name, n_in, n_out, seconds)
            self.recorder.report(name, reports)

    def _original_positions(self, position_ids, bsz: int, length: int, device) -> Tensor:
        """Original positions as [P, B, L]: P = 3 (t, h, w) for M-RoPE, 1 for 1-D RoPE.

        transformers' generate passes Qwen models a 4th leading "text" row, used only to build masks; it is
        dropped here."""
        if position_ids is None:
            if self.adapter.mrope:
                raise ValueError("M-RoPE model forward reached the LLM without position_ids")
            return torch.arange(length, device=device)[None, None].expand(1, bsz, length)
        if self.adapter.mrope:
            if position_ids.dim() == 3 and position_ids.shape[0] == 4:
                return position_ids[1:]
            if position_ids.dim() == 2:
                return position_ids[None].expand(3, -1, -1)
            return position_ids
        return position_ids.expand(bsz, -1)[None]

    def _video_inputs(
        self, span: VideoSpan, embeds: Tensor, positions: Tensor, deepstack: Tensor | None
    ) -> dict[str, Any]:
        """What the connect engine needs of one video: its slice of the prompt embeddings (raster order on its
        grid), original positions, timestamps, DeepStack features and where each token sits in the prompt."""
        idx = span.seq_index.to(embeds.device)
        pos = positions[:, span.batch, idx.to(positions.device)]
        extras = {}
        if deepstack is not None:
            extras["deepstack"] = deepstack[span.batch, idx.to(deepstack.device)]
        return dict(
            embeds=embeds[span.batch, idx],
            grid=span.grid,
            positions=pos if self.adapter.mrope else pos[0],
            timestamps=span.timestamps,
            extras=extras,
            seq_index=idx,
        )

    def _context(self, span: VideoSpan, captured: CapturedInputs, mask: Tensor) -> Context:
        ids_row = captured.input_ids[span.batch]
        valid = mask[span.batch].bool().to(ids_row.device)
        after = int(span.seq_index.max()) + 1
        question_ids = ids_row[after:][valid[after:]]
        prepared = self.prepared.get(tuple(ids_row[valid].tolist()), {})
        question = prepared.get("question")
        if question is None and self.tokenizer is not None:
            question = self.tokenizer.decode(question_ids, skip_special_tokens=True).strip()
        generator = torch.Generator(device="cpu").manual_seed(self.seed)
        return Context(
            retention=self.pipeline.retention,
            family=self.adapter.family,
            geometry=self.adapter.geometry,
            question=question,
            question_ids=question_ids,
            embed_fn=self.adapter.embed,
            generator=generator,
            model=self.adapter.model,
            prepared=prepared.get("methods", {}),
        )

    def _layer_counts(self, spans: list[VideoSpan]):
        """A function giving each video's visual tokens at the last LLM layer, once the prefill ran."""

        def counts() -> list[int]:
            layout = self.runtime.layout
            seen: dict[int, int] = {}
            out = []
            for span in spans:
                k = seen.get(span.batch, 0)
                seen[span.batch] = k + 1
                alive = layout.visual[span.batch] & layout.valid[span.batch] & (layout.video[span.batch] == k)
                out.append(int(alive.sum()))
            return out

        return counts

    def _mapping(self, mask: Tensor, positions: Tensor, new_mask: Tensor, new_positions: Tensor) -> PromptMapping:
        valid = mask.bool().to(positions.device)
        # first position after the prompt: max over the (t, h, w) rows of valid tokens, + 1
        masked = positions.masked_fill(~valid[None], -1)
        next_original = masked.amax(dim=(0, 2)) + 1
        shift = None
        if self.policy == "compact":
            new_valid = new_mask.bool().to(new_positions.device)
            next_compact = new_positions.masked_fill(~new_valid[None], -1).amax(dim=(0, 2)) + 1
            shift = next_original - next_compact.to(next_original.device)
        return PromptMapping(mask.shape[1], new_mask, next_original, shift, prompt_tokens=mask.sum(1).cpu())

    # --- later forwards ----------------------------------------------------------------------------------------
    def _continue_prompt(self, args, kwargs: dict[str, Any], embeds: Tensor):
        if self.runtime is not None:
            self.runtime.begin_decode()
        mapping = self.mapping
        if mapping is None:
            return None
        bsz, q_len, _ = embeds.shape
        before = mapping.tokens_after
        mask = kwargs.get("attention_mask")
        prefix = mapping.attention_mask.to(embeds.device)
        if mask is None:
            tail = torch.ones(bsz, before + q_len, dtype=prefix.dtype, device=embeds.device)
        elif isinstance(mask, torch.Tensor) and mask.dim() == 2:
            expected = mapping.original_length + before + q_len
            if mask.shape[1] != expected:
                raise ValueError(
                    f"this forward continues a compressed prompt with {q_len} tokens and an attention mask of "
                    f"{mask.shape[1]} columns, but {mapping.original_length + before} tokens were processed so far "
                    f"(the compressed cache holds {prefix.shape[1] + before}), so the mask should have {expected}. "
                    "vtc cannot continue a compressed cache across generate calls: send the whole conversation "
                    "again without past_key_values (vtc compresses it anew), or pass the mask of the whole "
                    "sequence so far with only the new tokens"
                )
            tail = mask[:, mapping.original_length :].to(prefix.dtype)
        else:
            raise ValueError("vtc needs a 2-D attention_mask (or none) after a compressed prefill")
        mapping.tokens_after += q_len
        kwargs["attention_mask"] = torch.cat([prefix, tail], dim=1)

        position_ids = kwargs.get("position_ids")
        if position_ids is None and not self.adapter.mrope:
            start = mapping.next_original_position.to(embeds.device) + before
            if mapping.position_shift is not None:
                start = start - mapping.position_shift.to(embeds.device)
            kwargs["position_ids"] = start[:, None] + torch.arange(q_len, device=embeds.device)[None]
        elif position_ids is not None and mapping.position_shift is not None:
            kwargs["position_ids"] = position_ids - mapping.position_shift.to(position_ids.device)[:, None]
        return args, kwargs

    # --- prefill plugins --------------------------------------------------------------------------------------
    def _call_prefill_plugins(self, state, decoding: bool) -> None:
        self._prefill_pipeline.run_prefill(state, self._prefill_ctx, self.recorder, decoding=decoding)
