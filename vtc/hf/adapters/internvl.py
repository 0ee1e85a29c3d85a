"""InternVL (InternVL3 / InternVL3.5 `-hf` checkpoints, transformers' `InternVLForConditionalGeneration`): an InternViT
tower (448 px, patch 14: 32 x 32 patches + CLS per tile), pixel shuffle 0.5 (each 2 x 2 block of patches becomes one
token of 4x the width: 16 x 16 = 256 tokens), an MLP projector, a Qwen2 / Qwen3 LLM with 1-D RoPE.

The model knows no videos: its processor writes each frame as a one-tile image behind a text label,

    Frame1: <img><IMG_CONTEXT> x 256</img>\\nFrame2: <img>...</img>...

and merges the frames into `pixel_values` with the images' tiles (in prompt order). An image is one run of
`256 x tiles` context tokens. So a video here is a chain of one-tile runs, each after a short `FrameK: ` label:

  * a run of more than one tile is an image: an item of kind "image" whose frames are its tiles (grid (tiles, 16, 16):
    per-frame methods prune each tile, as the LLaVA-NeXT line prunes each crop);
  * consecutive one-tile runs belong to one video when the text between them is a frame label (a few tokens, the
    same length as the chain's first label, one more past Frame9); a label that repeats the chain's first label
    (`Frame1: ` again) starts the next video;
  * a chain needs two frames: a lone one-tile run (a square picture the processor did not split, or a one-frame
    video, which look the same) is an image.

The pixel shuffle is a 2 x 2 merge unit like Qwen's merger, but the tower's patches come in raster order behind a
CLS token, so vision statistics are mapped here onto the token grid (CLS dropped, each 2 x 2 block averaged): the
geometry has no patch grid, as on the Qwen families. Kept tokens go back into their frame's run (`frame_slot`).
"""

from __future__ import annotations

import torch

from vtc.core.families import Family
from vtc.core.geometry import FamilyGeometry
from vtc.hf.adapters.base import Adapter, CapturedInputs, VideoSpan, runs, tower_feature_layer

FAMILY = Family(
    name="internvl",
    summary="InternVL3 / InternVL3.5 (-hf): InternViT + pixel shuffle (2x2 -> 1) + MLP, 1-D RoPE; frames are "
    "one-tile images behind 'FrameK: ' labels",
    geometry=FamilyGeometry("internvl", mrope=False),
    model_classes=("InternVLForConditionalGeneration",),
    processor_classes=("InternVLProcessor",),
    adapter="vtc.hf.adapters.internvl:InternVLAdapter",
    frame_rule="middle",
    media_kwargs=("pixel_values", "mm_encoder_outputs"),
    video_pixels="pixel_values",
    encoded_media="image",
    vision_stats=frozenset({"received", "keys"}),
    features=frozenset({"frame_text", "shared_media_token"}),
    tiny="vtc.testing.tiny:build_internvl",
)

# tokens between two frames of a video: `</img>`, the `\nFrameK: ` label, `<img>` (a few tokens with any tokenizer)
LABEL_TOKENS = (5, 16)


def video_chains(ids: torch.Tensor, token_id: int, tile: int) -> list[list[tuple[int, int]]]:
    """The videos of one prompt row: each a list of its frames' (start, end) runs of `token_id`, `tile` tokens each
    (see the module doc for the rule)."""
    values = ids.tolist()
    chains: list[list[tuple[int, int]]] = []
    chain: list[tuple[int, int]] = []
    label_length: int | None = None

    def close():
        if len(chain) >= 2:
            chains.append(list(chain))

    for start, end in runs(ids == token_id):
        if end - start != tile:  # an image of several tiles: it ends any chain
            close()
            chain, label_length = [], None
            continue
        if chain:
            between = start - chain[-1][1]  # `</img>`, label, `<img>`
            low, high = LABEL_TOKENS
            if label_length is not None:
                low, high = label_length, label_length + 2  # Frame10 and Frame100 take a digit more
            first = chain[0][0]
            label = values[start - between + 1 : start]
            repeats = first >= len(label) and values[first - len(label) : first] == label
            if low <= between <= high and not repeats:
                if label_length is None:
                    label_length = between
                chain.append((start, end))
                continue
            close()
        chain, label_length = [(start, end)], None
    close()
    return chains


class InternVLAdapter(Adapter):
    family = FAMILY.name
    class_names = FAMILY.model_classes

    # --- where things are ------------------------------------------------------------------------------------
    @property
    def vision_tower(self) -> torch.nn.Module:
        return self.outer.vision_tower

    @property
    def video_token_id(self) -> int:
        return int(self.model.config.image_token_id)  # frames are images to the model

    def vision_encoder_layers(self) -> list[torch.nn.Module]:
        return list(self.vision_tower.encoder.layer)

    def vision_attention_modules(self) -> list[torch.nn.Module]:
        return [layer.attention for layer in self.vision_encoder_layers()]

    def vision_feature_layer(self) -> int:
        return tower_feature_layer(self.model.config.vision_feature_layer, len(self.vision_encoder_layers()))

    # --- geometry ----------------------------------------------------------------------------------------------
    @property
    def patch_grid(self) -> tuple[int, int]:
        vision = self.model.config.vision_config
        (height, width), (ph, pw) = vision.image_size, vision.patch_size
        return height // ph, width // pw

    @property
    def unit(self) -> int:
        """Side of the pixel shuffle's merge unit (2 for `downsample_ratio` 0.5)."""
        return round(1 / float(self.model.config.downsample_ratio))

    def frame_grid(self) -> tuple[int, int]:
        rows, cols = self.patch_grid
        return rows // self.unit, cols // self.unit

    # --- layout ------------------------------------------------------------------------------------------------
    def _layout(self, input_ids: torch.Tensor) -> tuple[list[tuple[int, list[tuple[int, int]]]], list[int]]:
        """(videos as (batch row, frame runs), tiles of every media run in prompt order) of a batch."""
        h, w = self.frame_grid()
        tile = h * w
        videos, tiles = [], []
        for b in range(input_ids.shape[0]):
            row = input_ids[b]
            videos += [(b, chain) for chain in video_chains(row, self.video_token_id, tile)]
            tiles += [(end - start) // tile for start, end in runs(row == self.video_token_id)]
        return videos, tiles

    def has_video(self, captured: CapturedInputs) -> bool:
        return captured.input_ids is not None and bool(self._layout(captured.input_ids)[0])

    def _first_rows(self, input_ids: torch.Tensor, tiles: list[int]) -> dict[tuple[int, int], int]:
        """The `pixel_values` row of every media run's first tile, by (batch row, start): the processor concatenates
        each prompt's media in prompt order."""
        first_row = {}
        offset = 0
        for b in range(input_ids.shape[0]):
            for start, _ in runs(input_ids[b] == self.video_token_id):
                first_row[(b, start)] = offset
                offset += tiles[len(first_row) - 1]
        return first_row

    def _images(self, input_ids: torch.Tensor) -> list[tuple[int, int, int]]:
        """(batch row, start, end) of every media run that is not a frame of a video: the images."""
        videos, _ = self._layout(input_ids)
        frames = {(b, start) for b, chain in videos for start, _ in chain}
        return [
            (b, start, end)
            for b in range(input_ids.shape[0])
            for start, end in runs(input_ids[b] == self.video_token_id)
            if (b, start) not in frames
        ]

    def has_image(self, captured: CapturedInputs) -> bool:
        return captured.input_ids is not None and bool(self._images(captured.input_ids))

    def video_spans(self, captured: CapturedInputs) -> list[VideoSpan]:
        input_ids = captured.input_ids
        videos, tiles = self._layout(input_ids)
        h, w = self.frame_grid()
        device = input_ids.device
        first_row = self._first_rows(input_ids, tiles)
        spans = []
        for k, (b, chain) in enumerate(videos):
            seq_index = torch.cat([torch.arange(s, e, device=device) for s, e in chain])
            frame_slot = torch.tensor([s for s, _ in chain], device=device)
            span = VideoSpan(b, k, seq_index, (len(chain), h, w), frame_slot)
            span.media_rows = torch.tensor([first_row[(b, s)] for s, _ in chain])
            spans.append(span)
        return spans

    def image_spans(self, captured: CapturedInputs) -> list[VideoSpan]:
        """One item per image, its tiles as frames (the thumbnail, when the processor adds one, is its last tile)."""
        input_ids = captured.input_ids
        _, tiles = self._layout(input_ids)
        h, w = self.frame_grid()
        device = input_ids.device
        first_row = self._first_rows(input_ids, tiles)
        spans = []
        for k, (b, start, end) in enumerate(self._images(input_ids)):
            count = (end - start) // (h * w)
            frame_slot = start + torch.arange(count, device=device) * h * w
            span = VideoSpan(b, k, torch.arange(start, end, device=device), (count, h, w), frame_slot, kind="image")
            span.media_rows = first_row[(b, start)] + torch.arange(count)
            spans.append(span)
        return spans

    # --- vision tower statistics on the token grid -----------------------------------------------------------------
    def vision_stats_per_video(self, calls, spans, layer_of) -> list[dict]:
        """The tower call that encoded this prompt's media (every tile and frame), its statistics for each video's
        frames, CLS dropped and each 2 x 2 merge unit averaged: [T, H*W(, d)] as on the Qwen families."""
        rows = [span.media_rows for span in spans]
        needed = 1 + max(int(r.max()) for r in rows)
        call = next((c for c in reversed(calls) if c["items"] >= needed), None)
        if call is None:
            raise RuntimeError("no vision-tower call for these videos was captured (was the vision tower bypassed?)")
        s = self.unit
        out: list[dict] = [{} for _ in spans]
        for stat, layer in layer_of.items():
            chunks = call["chunks"].get(layer, [])
            values = torch.cat([c[stat.kind] for c in chunks if stat.kind in c])  # [items, 1 + P(, d)]
            for k, span in enumerate(spans):
                frames = values[span.media_rows.to(values.device), 1:]  # CLS dropped
                t, h, w = span.grid
                grid = frames.reshape(t, h, s, w, s, *frames.shape[2:])
                out[k][stat] = grid.mean(dim=(2, 4)).reshape(t, h * w, *frames.shape[2:])
        return out
