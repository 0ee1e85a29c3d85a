"""Frames in, the LLM's input embeddings of those frames out: the model's own processor, vision tower,
projector and pooling, run on one chunk of a stream.

The chunk goes through the model's multimodal forward (so every family's feature path is the real one,
including LLaVA-OneVision's trailing newline and Qwen3-VL's per-frame timestamps and DeepStack features); a
hook stops that forward where the LLM would start and keeps what the LLM would have received.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from vtc.hf.adapters import Adapter, VideoSpan

Tensor = torch.Tensor


class _ReachedLLM(Exception):
    """Raised by the hook on the text model: the chunk's LLM inputs are captured, the LLM must not run."""


@dataclasses.dataclass
class EncodedChunk:
    """One chunk of frames as the LLM would receive it.

    embeds: [L, D] the chunk's rows of the prompt (video tokens; on Qwen3-VL also each frame's timestamp text)
    span: where the video tokens sit in those rows (`seq_index`, in grid order) and the chunk's grid (T, H, W)
    model_positions: [3, L] the model's own positions of the chunk's rows (M-RoPE families)
    deepstack: [N, levels, D] Qwen3-VL's DeepStack features of the video tokens, in grid order
    tail: [k, D] rows that close the whole video rather than this chunk (LLaVA-OneVision's newline)
    vision: the vision-tower statistics the connect plugins asked for, on this chunk's frames
    processor_outputs: what the processor returned (Qwen2.5-VL's seconds per temporal patch)
    """

    embeds: Tensor
    span: VideoSpan
    model_positions: Tensor | None
    deepstack: Tensor | None
    tail: Tensor | None
    vision: dict
    processor_outputs: dict[str, Any]

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.span.grid


class ChunkEncoder:
    """Encodes chunks of frames with one model and its processor."""

    def __init__(self, adapter: Adapter, processor, vision_capture=None, processor_kwargs: dict | None = None) -> None:
        if "streaming" not in adapter.record.features:
            raise ValueError(
                f"vtc.stream does not support {adapter.family}: its processor does not lay a chunk of frames out as "
                "they sit in one whole-video prompt (family feature 'streaming'); use vtc.patch on whole prompts"
            )
        self.adapter = adapter
        self.processor = processor
        self.vision = vision_capture
        self.processor_kwargs = dict(processor_kwargs or {})

    def _processor_inputs(self, frames: np.ndarray, indices: list[int], fps: float):
        kwargs: dict[str, Any] = {}
        if self.adapter.mrope:
            metadata = {"fps": fps, "total_num_frames": int(indices[-1]) + 1, "frames_indices": list(indices)}
            kwargs = {"video_metadata": [metadata], "do_sample_frames": False}
            if hasattr(type(self.processor.video_processor), "cap_pixels_per_frame"):
                kwargs["cap_pixels_per_frame"] = True
        return self.processor(
            text=[self.processor.video_token],
            videos=[frames],
            return_tensors="pt",
            **kwargs,
            **self.processor_kwargs,
        )

    @torch.no_grad()
    def encode(self, frames: np.ndarray, indices: list[int], fps: float) -> EncodedChunk:
        """`frames` [n, H, W, 3] uint8 with stream indices `indices` (timestamps = index / fps)."""
        adapter = self.adapter
        inputs = self._processor_inputs(frames, indices, fps)
        device = next(adapter.model.parameters()).device
        model_inputs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in inputs.items()}
        captured: dict[str, Any] = {}

        def stop(module, args, kwargs):
            captured.update(kwargs)
            raise _ReachedLLM

        hook = adapter.text_model.register_forward_pre_hook(stop, with_kwargs=True)
        try:
            adapter.outer(**model_inputs, use_cache=False)
        except _ReachedLLM:
            pass
        finally:
            hook.remove()
        if "inputs_embeds" not in captured:
            raise RuntimeError(f"{adapter.family}: the chunk's forward never reached the LLM")

        ids = model_inputs["input_ids"]
        span = adapter.video_spans(adapter.capture(ids, model_inputs.get("attention_mask"), dict(model_inputs)))[0]
        embeds = captured["inputs_embeds"][0]
        placeholders = torch.nonzero(ids[0] == adapter.video_token_id).flatten()
        extra_rows = placeholders[~torch.isin(placeholders, span.seq_index)]
        tail = embeds[extra_rows] if extra_rows.numel() else None
        keep_rows = torch.ones(embeds.shape[0], dtype=torch.bool, device=embeds.device)
        keep_rows[extra_rows] = False
        if bool((~keep_rows).any()):  # the closing rows leave the chunk: re-index the video tokens
            remap = torch.cumsum(keep_rows.long(), 0) - 1
            span = dataclasses.replace(span, seq_index=remap[span.seq_index], frame_slot=remap[span.frame_slot])
            embeds = embeds[keep_rows]

        positions = captured.get("position_ids")
        if positions is not None and adapter.mrope:
            positions = positions[-3:, 0][:, keep_rows.to(positions.device)]
        deepstack = None
        if captured.get("deepstack_visual_embeds") is not None:
            deepstack = torch.stack(list(captured["deepstack_visual_embeds"]), dim=1)  # [N, levels, D]
        vision = self.vision.video_stats([span])[0] if self.vision is not None else {}
        return EncodedChunk(embeds, span, positions if adapter.mrope else None, deepstack, tail, vision, dict(inputs))
