"""The hooks `vtc.patch` installs on one model instance, and what they do on each forward.

  outer model (e.g. `Qwen2VLModel`) forward pre-hook   remember input_ids and the media arguments
  text model forward pre-hook, prefill with a video     build `VideoTokens`, run `connect` plugins, rewrite
                                                        inputs_embeds / attention_mask / position_ids (and
                                                        Qwen3-VL DeepStack inputs), start the prefill runtime
  text model forward pre-hook, later forwards           map the growing 2-D attention mask (and positions
                                                        when renumbered) onto the compressed prompt
  text model forward hook                               close the stats record
Everything is undone by `remove()`; nothing touches classes or other model instances.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import torch

from vtc.core.pipeline import Pipeline
from vtc.core.stats import StatsRecorder
from vtc.core.tokens import Context, VideoTokens
from vtc.hf.adapters import Adapter, CapturedInputs, VideoSpan
from vtc.hf.llm.runtime import LLMRuntime
from vtc.hf.sequence import deepstack_per_token, identity_layout, rebuild
from vtc.hf.vision import VisionCapture

Tensor = torch.Tensor

# outer-model forward arguments that describe the media (kept for the adapters)
MEDIA_KWARGS = ("video_grid_thw", "second_per_grid_ts", "pixel_values_videos", "mm_encoder_outputs")


@dataclasses.dataclass
class PromptMapping:
    """How the prompt of the last prefill was compressed, for the forwards that continue it."""

    original_length: int  # padded prompt length the caller sees
    attention_mask: Tensor  # [B, L'] mask of the compressed prompt
    next_original_position: Tensor  # [B] first position after the prompt in the original numbering
    position_shift: Tensor | None  # [B] original - compact next position (compact policy only)
    tokens_after: int = 0  # tokens processed since the prefill


def _cache_length(kwargs: dict[str, Any]) -> int:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        return 0
    try:
        return int(cache.get_seq_length())
    except (AttributeError, TypeError):
        return 0


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
    ) -> None:
        self.adapter = adapter
        self.pipeline = pipeline
        self.recorder = recorder
        self.policy = pipeline.position_policy(positions, adapter.mrope)
        self.seed = seed
        self.tokenizer = tokenizer
        self.runtime: LLMRuntime | None = None
        self.vision: VisionCapture | None = None
        self.prepool = None
        self.mapping: PromptMapping | None = None
        # what handle.prepare produced for a prompt (question text, sampler outputs), keyed by its token ids
        self.prepared: dict[tuple[int, ...], dict[str, Any]] = {}
        self.enabled = True
        self._captured: CapturedInputs | None = None
        self._handles: list[Any] = []
        self._llm_start = 0.0
        self._prefill_ctx: Context | None = None

    # --- install / remove -------------------------------------------------------------------------------------
    def install(self) -> None:
        adapter = self.adapter
        stats = set()
        for entry in self.pipeline.stage_entries("connect"):
            stats.update(getattr(entry.plugin, "vision_stats", lambda family: [])(adapter.family))
        if stats:
            self.vision = VisionCapture(adapter, stats)
            self.vision.install()
        if any(getattr(e.plugin, "needs_prepool", False) for e in self.pipeline.stage_entries("connect")):
            self.prepool = adapter.prepool_capture()
            if self.prepool is not None:
                self.prepool.install()
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
                decode_plugins=any(
                    getattr(e.plugin, "acts_during_decode", False) for e in self.pipeline.stage_entries("prefill")
                ),
            )
            self.runtime.install()

    def remove(self) -> None:
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
        self.mapping = None
        self._captured = None

    @contextlib.contextmanager
    def suspended(self):
        """Run the model as if unpatched (samplers that score frames with the model itself use this)."""
        before = self.enabled
        self.enabled = False
        for part in (self.vision, self.prepool):
            if part is not None:
                part.enabled = False
        try:
            yield
        finally:
            self.enabled = before
            for part in (self.vision, self.prepool):
                if part is not None:
                    part.enabled = before

    # --- hooks ---------------------------------------------------------------------------------------------------
    def _outer_pre_hook(self, module, args, kwargs):
        if not self.enabled:
            return None
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        media = {k: kwargs[k] for k in MEDIA_KWARGS if kwargs.get(k) is not None}
        self._captured = CapturedInputs(input_ids, kwargs.get("attention_mask"), media)
        mapping = self.mapping
        if mapping is not None and _cache_length(kwargs) > 0 and kwargs.get("attention_mask") is None:
            # models derive decode positions from the mask; give them one of the original (uncompressed) length
            if input_ids is not None:
                total = mapping.original_length + mapping.tokens_after + input_ids.shape[1]
                kwargs["attention_mask"] = torch.ones(
                    input_ids.shape[0], total, dtype=torch.long, device=input_ids.device
                )
                return args, kwargs
        return None

    def _llm_pre_hook(self, module, args, kwargs):
        if not self.enabled:
            return None
        captured, self._captured = self._captured, None
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            return None
        if _cache_length(kwargs) > 0:
            return self._continue_prompt(args, kwargs, embeds)
        self.mapping = None
        if self.runtime is not None:
            self.runtime.reset()  # also recovers from a forward that raised half-way
        if captured is None or captured.input_ids is None or not self.adapter.has_video(captured):
            note = "" if captured is None or captured.input_ids is not None else "(called with inputs_embeds only)"
            self.recorder.begin(False, batch_size=embeds.shape[0], note=note)
            self._llm_start = time.perf_counter()
            return None
        kwargs = self._compress_prompt(kwargs, embeds, captured)
        self._llm_start = time.perf_counter()
        return args, kwargs

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
        return None

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
        spans = adapter.video_spans(captured)

        deepstack = deepstack_mask = None
        if adapter.deepstack and kwargs.get("deepstack_visual_embeds") is not None:
            deepstack_mask = kwargs["visual_pos_masks"]
            deepstack = deepstack_per_token(deepstack_mask, kwargs["deepstack_visual_embeds"], (bsz, length))

        stats = self.recorder.begin(
            True,
            batch_size=bsz,
            videos=len(spans),
            grids=[s.grid for s in spans],
            visual_tokens_in=sum(s.num_tokens for s in spans),
            sequence_in=length,
        )
        vision = self.vision.video_stats(spans) if self.vision is not None else [{} for _ in spans]
        prepool = self.prepool.per_video([s.grid[0] for s in spans]) if self.prepool is not None else None
        outputs = []
        changed = False
        for k, span in enumerate(spans):
            tokens = self._video_tokens(span, embeds, positions, deepstack)
            ctx = self._context(span, captured, mask)
            ctx.video_index = k
            ctx.vision = vision[k]
            if prepool is not None:
                ctx.prepool, ctx.pool, ctx.project = prepool[k], self.prepool.pool, self.prepool.projection
            out = self.pipeline.run_connect(tokens, ctx, self.recorder)
            changed |= out is not tokens  # plugins return their input untouched when they keep everything
            outputs.append(out)
        stats.llm_tokens_in = sum(len(o) for o in outputs)
        stats.visual_tokens_out = stats.llm_tokens_in

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
                model=adapter.model,
                extra={"attention_rows": adapter.attention_rows},
            )
        return kwargs

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

    def _video_tokens(
        self, span: VideoSpan, embeds: Tensor, positions: Tensor, deepstack: Tensor | None
    ) -> VideoTokens:
        idx = span.seq_index.to(embeds.device)
        frame, row, col = span.frame_row_col()
        pos = positions[:, span.batch, idx.to(positions.device)]
        extras = {}
        if deepstack is not None:
            extras["deepstack"] = deepstack[span.batch, idx.to(deepstack.device)]
        return VideoTokens(
            embeds=embeds[span.batch, idx],
            positions=pos if self.adapter.mrope else pos[0],
            frame=frame.to(embeds.device),
            row=row.to(embeds.device),
            col=col.to(embeds.device),
            weight=torch.ones(span.num_tokens, device=embeds.device, dtype=torch.float32),
            grid=span.grid,
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
            question=question,
            question_ids=question_ids,
            embed_fn=self.adapter.embed,
            generator=generator,
            model=self.adapter.model,
            extra={"prepared": prepared},
        )

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
        return PromptMapping(mask.shape[1], new_mask, next_original, shift)

    # --- later forwards ----------------------------------------------------------------------------------------
    def _continue_prompt(self, args, kwargs: dict[str, Any], embeds: Tensor):
        if self.runtime is not None:
            self.runtime.begin_decode()
        mapping = self.mapping
        if mapping is None:
            return None
        bsz, q_len, _ = embeds.shape
        before = mapping.tokens_after
        mapping.tokens_after += q_len
        mask = kwargs.get("attention_mask")
        prefix = mapping.attention_mask.to(embeds.device)
        if mask is None:
            tail = torch.ones(bsz, before + q_len, dtype=prefix.dtype, device=embeds.device)
        elif isinstance(mask, torch.Tensor) and mask.dim() == 2:
            if mask.shape[1] < mapping.original_length:
                raise ValueError(
                    f"attention_mask has {mask.shape[1]} columns but the compressed prompt had "
                    f"{mapping.original_length}; pass the mask of the whole sequence so far"
                )
            tail = mask[:, mapping.original_length :].to(prefix.dtype)
        else:
            raise ValueError("vtc needs a 2-D attention_mask (or none) after a compressed prefill")
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
        self.pipeline.run_prefill(state, self._prefill_ctx, self.recorder, decoding=decoding)
