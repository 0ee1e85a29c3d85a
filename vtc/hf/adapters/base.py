"""What every model-family adapter provides, and the helpers they share.

An adapter is small and declarative: where the modules are (`outer`, `text_model`, `decoder_layers`,
`vision_tower`), which token id marks video features and how the video tokens of a prompt are laid out
(`video_spans`). The generic
machinery that rewrites the sequence lives in `vtc.hf.patching`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from vtc.core.families import Family, get_family
from vtc.core.geometry import FamilyGeometry

Tensor = torch.Tensor


@dataclasses.dataclass
class CapturedInputs:
    """The keyword arguments of the outer multimodal model's forward that describe the media (the family's
    `Family.media_kwargs`; build it with `Adapter.capture`). `video_pixels` / `encoded_media`: where the family's
    video pixels and generate's pre-encoded video features travel (`Family.video_pixels`, `Family.encoded_media`)."""

    input_ids: Tensor | None
    attention_mask: Tensor | None
    kwargs: dict[str, Any]
    video_pixels: str = "pixel_values_videos"
    encoded_media: str = "video"

    @property
    def encoded_videos(self) -> Any:
        """The video encoder outputs generate computed beforehand (`mm_encoder_outputs["video"]`), if any."""
        return (self.kwargs.get("mm_encoder_outputs") or {}).get(self.encoded_media)

    @property
    def has_video_media(self) -> bool:
        """The forward carries video pixels or pre-encoded video features."""
        return self.kwargs.get(self.video_pixels) is not None or self.encoded_videos is not None


@dataclasses.dataclass
class VideoSpan:
    """Where one video's (or image's) compressible tokens sit in one batch row.

    seq_index:  [N] sequence indices of the tokens, in grid order (frame-major, then row, then column)
    grid:       (T, H, W) token grid
    frame_slot: [T] sequence index of the first token of each frame's segment; kept tokens are written
                back into their frame's segment (matters when text separates frames, as in Qwen3-VL)
    timestamps: [T] seconds, when the inputs carry them
    media_rows: [T] the vision tower's batch item of each frame, where the tower encodes a prompt's frames among
                other media (InternVL: frames and image tiles share `pixel_values`); None elsewhere
    kind:       "video", or "image" (`Adapter.image_spans`); `video` then counts the images
    view:       which part of an image of several parts the span is (LLaVA's anyres: "base" or "crops"); "" else
    in_place:   kept tokens go back to their own sequence index, not to their frame's first slot (a grid with
                newline tokens between its rows: each row keeps its newline)
    """

    batch: int
    video: int
    seq_index: Tensor
    grid: tuple[int, int, int]
    frame_slot: Tensor
    timestamps: Tensor | None = None
    media_rows: Tensor | None = None
    kind: str = "video"
    view: str = ""
    in_place: bool = False
    anyres: AnyresLayout | None = None  # LLaVA's image packing, on the spans of an anyres image

    @property
    def num_tokens(self) -> int:
        return int(self.seq_index.numel())

    @property
    def key(self) -> tuple[str, int, str]:
        """(kind, index, view): which item of the prompt the span is."""
        return self.kind, self.video, self.view

    def frame_row_col(self) -> tuple[Tensor, Tensor, Tensor]:
        t, h, w = self.grid
        flat = torch.arange(t * h * w, device=self.seq_index.device)
        return flat // (h * w), (flat // w) % h, flat % w


def runs(mask: Tensor) -> list[tuple[int, int]]:
    """(start, end) of the maximal runs of True in a 1-D bool tensor."""
    if mask.numel() == 0 or not bool(mask.any()):
        return []
    m = mask.to(torch.int8)
    diff = torch.diff(m, prepend=m.new_zeros(1), append=m.new_zeros(1))
    starts = torch.nonzero(diff == 1).flatten().tolist()
    ends = torch.nonzero(diff == -1).flatten().tolist()
    return list(zip(starts, ends))


def frames_per_video(captured: CapturedInputs, tokens_per_frame: int, trailing_specials: int = 0) -> list[int]:
    """Frames of each video of a LLaVA-style model: from `pixel_values_videos` [videos, frames, C, H, W], or,
    when generate pre-encoded the media, from the length of each video's features in `mm_encoder_outputs`."""
    pixels = captured.kwargs.get("pixel_values_videos")
    if pixels is not None:
        return [int(pixels.shape[1])] * int(pixels.shape[0])
    encoded = captured.encoded_videos
    if encoded is None:
        raise ValueError("the prompt has video tokens but the model got no pixel_values_videos or mm_encoder_outputs")
    # per video: [frames, tokens, D] (LLaVA-NeXT-Video in transformers < 5.2x) or [tokens, D]
    return [
        int(x.shape[0]) if x.dim() == 3 else (int(x.shape[0]) - trailing_specials) // tokens_per_frame
        for x in encoded.pooler_output
    ]


def encoder_layers(tower: torch.nn.Module) -> list[torch.nn.Module]:
    """Encoder layers of a SigLIP/CLIP vision tower (with or without the `vision_model` wrapper)."""
    inner = getattr(tower, "vision_model", tower)
    return list(inner.encoder.layers)


def tower_feature_layer(vision_feature_layer, num_layers: int) -> int:
    """The encoder layer behind `hidden_states[vision_feature_layer]` (index 0 of hidden_states is the embedding
    output, so hidden_states[-1] is the last layer, hidden_states[k] the output of layer k - 1)."""
    layer = vision_feature_layer if isinstance(vision_feature_layer, int) else vision_feature_layer[-1]
    return num_layers + layer if layer < 0 else layer - 1


def llava_vision_stats(adapter, calls, spans, layer_of) -> list[dict]:
    """LLaVA towers see every frame as one batch item: split each statistic by frames per video."""
    return llava_stats_per_video(calls, [span.grid[0] for span in spans], layer_of)


def llava_stats_per_video(calls, frames: list[int], layer_of) -> list[dict]:
    """Split the statistics of the tower call that encoded `sum(frames)` frames into one dict per video (shared by
    the HF and vLLM backends; `calls`: [{"items": frames encoded, "chunks": {layer: [stats of each chunk]}}])."""
    call = next((c for c in reversed(calls) if c["items"] == sum(frames)), None)
    if call is None:
        raise RuntimeError("no vision-tower call for these videos was captured (was the vision tower bypassed?)")
    stacked = {}
    for stat, layer in layer_of.items():
        chunks = call["chunks"].get(layer, [])
        stacked[stat] = torch.cat([c[stat.kind] for c in chunks if stat.kind in c])
    out = []
    start = 0
    for f in frames:
        out.append({stat: t[start : start + f] for stat, t in stacked.items()})
        start += f
    return out


def contiguous_spans(
    input_ids: Tensor,
    video_token_id: int,
    tokens_per_video: list[int],
    grids: list[tuple[int, int, int]],
    family: str,
    trailing_specials: int = 0,
    kind: str = "video",
) -> list[VideoSpan]:
    """Spans for families whose video (or image: `kind`) is one contiguous run of placeholder tokens.

    `trailing_specials` placeholder tokens at the end of each run are not compressible (LLaVA-OneVision's
    newline token) and stay in place as if they were text.
    """
    spans: list[VideoSpan] = []
    video = 0
    for b in range(input_ids.shape[0]):
        for start, end in runs(input_ids[b] == video_token_id):
            pos = start
            while pos < end:
                if video >= len(tokens_per_video):
                    raise ValueError(
                        f"{family}: the prompt has more {kind} placeholder tokens than the {kind}s passed produce"
                    )
                length = tokens_per_video[video]
                if pos + length > end:
                    raise ValueError(
                        f"{family}: {kind} {video} needs {length} placeholder tokens but its run has {end - pos}"
                    )
                t, h, w = grids[video]
                n = t * h * w
                if n + trailing_specials != length:
                    raise ValueError(f"{family}: {kind} {video} grid {grids[video]} does not match {length} tokens")
                seq_index = torch.arange(pos, pos + n, device=input_ids.device)
                frame_slot = torch.full((t,), pos, device=input_ids.device, dtype=torch.long)
                spans.append(VideoSpan(b, video, seq_index, (t, h, w), frame_slot, kind=kind))
                pos += length
                video += 1
    if video != len(tokens_per_video):
        raise ValueError(f"{family}: {len(tokens_per_video)} {kind}s were passed but {video} were found in the prompt")
    return spans


@dataclasses.dataclass(frozen=True)
class AnyresLayout:
    """How a LLaVA model packs one image's features (transformers' `pack_image_features`): a base view of
    side x side tokens, then, when the image was split into views, the crops' nh x nw grid of views, unpadded to
    rows x cols (from `unpadded` when LLaVA-OneVision's anyres_max shrank it bilinearly), a newline after each row;
    an image of one view ends with one newline."""

    side: int
    views: int  # views the tower encoded: 1 (base only) or 1 + nh * nw
    nh: int
    nw: int
    rows: int  # the packed crop grid (0: no crops)
    cols: int
    unpadded: tuple[int, int] | None  # (rows, cols) before the resize, when there was one

    @property
    def length(self) -> int:
        """Tokens of the image in the prompt."""
        return self.side * self.side + (self.rows * (self.cols + 1) if self.rows else 1)


def pack_crops(values: Tensor, layout: AnyresLayout, cls_tokens: int, token_axis: int = 1) -> Tensor:
    """Per-view tower values of an image's crops, [nh * nw, L, ...] (or [nh * nw, ..., L] with `token_axis=-1`; CLS
    first where the tower has one), packed the way the model packs the crops' features: CLS dropped, the views
    tiled into an (nh * side) x (nw * side) grid, unpadded, resized bilinearly where the model resizes -> one frame,
    [1, rows * cols, ...] (or [1, ..., rows * cols])."""
    x = values.movedim(token_axis, 1)[:, cls_tokens:].float()
    rest = x.shape[2:]
    side = layout.side
    x = x.reshape(layout.nh, layout.nw, side, side, -1).permute(4, 0, 2, 1, 3)
    x = x.reshape(x.shape[0], layout.nh * side, layout.nw * side)
    rows, cols = layout.unpadded or (layout.rows, layout.cols)
    height, width = x.shape[1:]
    top = (height - rows) // 2 if rows < height else 0  # transformers' unpad_image removes the padding evenly
    left = (width - cols) // 2 if cols < width else 0
    x = x[:, top : top + rows, left : left + cols]
    if layout.unpadded is not None:
        x = torch.nn.functional.interpolate(x[None], [layout.rows, layout.cols], mode="bilinear")[0]
    x = x.reshape(x.shape[0], -1).transpose(0, 1).reshape(1, layout.rows * layout.cols, *rest)
    return x.movedim(1, token_axis).to(values.dtype)


def anyres_view_stat(stat, values: Tensor, layout: AnyresLayout, view: str, cls_tokens: int) -> Tensor:
    """One vision statistic of one view of an anyres image, from the image's per-view values [views, ...] (shared by
    the HF and vLLM backends): the base view's as a frame's; the crops' packed as the model packs their features
    (`pack_crops`: CLS dropped, tiled, unpadded, resized), on the token grid."""
    if view == "base":
        return values[:1]
    return pack_crops(values[1 : layout.views], layout, cls_tokens, -1 if stat.kind == "cls" else 1)


class Adapter:
    """Base class; one subclass per model family, in the file that declares the family's `Family` record
    (`vtc/hf/adapters/<family>.py`; see docs/add-a-family.md).

    What an adapter answers: where the modules are (`outer`, `text_model`, `decoder_layers`, `vision_tower`,
    `vision_attention_modules`, `vision_encoder_layers`), which token marks video features (`video_token_id`), which
    forward arguments describe the media (`capture`), where each video's tokens sit in a prompt (`video_spans`:
    sequence indices in grid order, token grid, `frame_slot`), the vision-tower statistics of each video
    (`vision_stats_per_video`: on the patch grid where `geometry.patch_grid` is set, else on the token grid) and,
    where the model pools a finer grid, the features before that pooling (`prepool_capture`)."""

    family: str = ""
    class_names: tuple[str, ...] = ()
    mrope: bool = False  # 3-D M-RoPE positions (Qwen) vs 1-D RoPE (LLaVA)
    image_call_kwargs: tuple[str, ...] = ()  # arguments of `outer.get_image_features` the image spans need
    deepstack: bool = False  # Qwen3-VL feeds extra visual features into the first LLM layers

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @classmethod
    def matches(cls, model: torch.nn.Module) -> bool:
        return type(model).__name__ in cls.class_names

    @property
    def record(self) -> Family:
        """The family's `Family` record (`vtc.core.families`)."""
        return get_family(self.family)

    def capture(
        self, input_ids: Tensor | None, attention_mask: Tensor | None, kwargs: dict[str, Any]
    ) -> CapturedInputs:
        """The media arguments of one outer-model forward (the family's `media_kwargs`), for `video_spans`."""
        record = self.record
        media = {k: kwargs[k] for k in record.media_kwargs if kwargs.get(k) is not None}
        return CapturedInputs(input_ids, attention_mask, media, record.video_pixels, record.encoded_media)

    @property
    def geometry(self) -> FamilyGeometry:
        """How this model's vision tower lands on its LLM token grid (Qwen: statistics already on the grid)."""
        return FamilyGeometry(self.family, mrope=self.mrope)

    # --- where things are ------------------------------------------------------------------------------------
    @property
    def outer(self) -> torch.nn.Module:
        """The multimodal base model whose forward receives input_ids and the media tensors."""
        return self.model.model

    @property
    def text_model(self) -> torch.nn.Module:
        return self.outer.language_model

    @property
    def decoder_layers(self) -> list[torch.nn.Module]:
        return list(self.text_model.layers)

    @property
    def vision_tower(self) -> torch.nn.Module:
        raise NotImplementedError

    @property
    def video_token_id(self) -> int:
        config = self.model.config
        return int(getattr(config, "video_token_id", None) or config.video_token_index)

    def embed(self, ids: Tensor) -> Tensor:
        return self.text_model.get_input_embeddings()(ids)

    # --- layout ------------------------------------------------------------------------------------------------
    def video_spans(self, captured: CapturedInputs) -> list[VideoSpan]:
        """Every video's compressible tokens in the prompt, in order of appearance."""
        raise NotImplementedError

    @property
    def image_token_id(self) -> int | None:
        """The token that marks image features (None: the family takes no images)."""
        config = self.model.config
        value = getattr(config, "image_token_id", None)
        if value is None:
            value = getattr(config, "image_token_index", None)
        return None if value is None else int(value)

    def image_spans(self, captured: CapturedInputs) -> list[VideoSpan]:
        """Every image's compressible tokens in the prompt, in order of appearance, as one-frame spans (`kind` =
        "image"; an image of several views, e.g. anyres crops, may give several spans)."""
        raise ValueError(
            f"{self.family}: vtc cannot compress this family's images yet; pass images=False to let them reach the "
            "LLM whole"
        )

    def has_image(self, captured: CapturedInputs) -> bool:
        token = self.image_token_id
        return token is not None and captured.input_ids is not None and bool((captured.input_ids == token).any())

    def vision_stats_per_image(self, calls, spans, layer_of) -> list[dict]:
        """As `vision_stats_per_video`, for image spans (the tower call that encoded the prompt's images)."""
        return self.vision_stats_per_video(calls, spans, layer_of)

    # --- vision tower (for plugins that read its attention) ----------------------------------------------------
    def vision_attention_modules(self) -> list[torch.nn.Module]:
        """The attention module of every encoder layer of the vision tower, in order."""
        raise NotImplementedError

    def vision_feature_layer(self) -> int:
        """Index of the encoder layer whose output the model takes as visual features."""
        raise NotImplementedError

    def vision_encoder_layers(self) -> list[torch.nn.Module]:
        """The encoder layers of the vision tower, in order (for statistics read from a layer's output)."""
        raise ValueError(f"{self.family}: vision statistics read from a layer's output are LLaVA-only")

    def vision_stats_per_video(self, calls, spans, layer_of) -> list[dict]:
        """Turn captured per-call attention statistics into one dict per video (see `vtc.hf.vision`)."""
        raise NotImplementedError

    # --- pre-pool features (LLaVA families pool 2x2 after the projector) -----------------------------------------
    def prepool_capture(self):
        """A `PrepoolCapture` for families that pool frame features before the LLM, else None."""
        return None

    def has_video(self, captured: CapturedInputs) -> bool:
        return captured.input_ids is not None and bool((captured.input_ids == self.video_token_id).any())


class LlavaAdapter(Adapter):
    """What the two LLaVA families share: a SigLIP/CLIP tower at `outer.vision_tower` that sees every frame as one
    batch item, and `config.vision_feature_layer` naming the layer whose features the projector receives."""

    @property
    def vision_tower(self) -> torch.nn.Module:
        return self.outer.vision_tower

    def vision_attention_modules(self) -> list[torch.nn.Module]:
        return [layer.self_attn for layer in encoder_layers(self.vision_tower)]

    def vision_encoder_layers(self) -> list[torch.nn.Module]:
        return encoder_layers(self.vision_tower)

    def vision_feature_layer(self) -> int:
        return tower_feature_layer(self.model.config.vision_feature_layer, len(self.vision_attention_modules()))

    def vision_stats_per_video(self, calls, spans, layer_of) -> list[dict]:
        return llava_vision_stats(self, calls, spans, layer_of)

    @property
    def patch_side(self) -> int:
        vision = self.model.config.vision_config
        return int(vision.image_size // vision.patch_size)

    # --- images: anyres (a base view, then the crops packed into one unpadded grid with a newline per row) ---------
    max_views: int | None = None  # LLaVA-OneVision's anyres_max_N: the packed grid is shrunk to about N views
    # what `image_layouts` reads of the image encoding call: generate (transformers >= 5.18) encodes the images
    # before the prefill and passes the forward only `mm_encoder_outputs`, so vtc records these from that call
    image_call_kwargs: tuple[str, ...] = ("image_sizes", "batch_num_images")

    def _hf_module(self):
        """The model's transformers module (its anyres functions); a config-only adapter (vLLM's) has no module: the
        family's own modeling module then."""
        import importlib

        if not isinstance(self.model, torch.nn.Module):
            return importlib.import_module(f"transformers.models.{self.family}.modeling_{self.family}")
        return importlib.import_module(type(self.outer).__module__)

    def anyres_layout(self, size: list[int], split: bool = True, max_views: int | None = None) -> AnyresLayout:
        """How the model packs the features of one image of `size` (height, width), with transformers' own anyres
        functions: a base view and, unless the image is one view (or is not `split`), its crops' packed grid,
        resized to about `max_views` views (default: the model's `vision_aspect_ratio`; vLLM hard-codes 9)."""
        config, hf = self.model.config, self._hf_module()
        side = self.patch_side
        size = [int(v) for v in size]
        views = hf.image_size_to_num_patches(size, config.image_grid_pinpoints, config.vision_config.image_size)
        if not split or views == 1:
            return AnyresLayout(side, 1, 0, 0, 0, 0, None)
        nh, nw = hf.get_anyres_image_grid_shape(size, config.image_grid_pinpoints, config.vision_config.image_size)
        _, rows, cols = hf.unpad_image(torch.empty(0, nh * side, nw * side), size).shape
        resized = None
        max_views = self.max_views if max_views is None else max_views
        if max_views is not None:
            ratio = math.sqrt(rows * cols / (max_views * side**2))
            if ratio > 1.1:
                resized = (int(rows // ratio), int(cols // ratio))
        out_rows, out_cols = resized or (rows, cols)
        return AnyresLayout(side, views, nh, nw, out_rows, out_cols, (rows, cols) if resized else None)

    def image_layouts(self, captured: CapturedInputs) -> list[AnyresLayout]:
        """How the model packs each image's features (`pack_image_features`), from `image_sizes` and the config."""
        sizes = captured.kwargs.get("image_sizes")
        if sizes is None:
            raise ValueError(f"{self.family}: the prompt has image tokens but the forward got no image_sizes")
        counts = captured.kwargs.get("batch_num_images")  # LLaVA-OneVision: several images of a prompt are not split
        patched = [True] * len(sizes) if counts is None else [int(n) == 1 for n in counts for _ in range(int(n))]
        return [self.anyres_layout(size, split) for size, split in zip(sizes.tolist(), patched)]

    def image_spans(self, captured: CapturedInputs) -> list[VideoSpan]:
        """Each image as its base view (grid (1, side, side)) and, when the processor split it, its packed crop grid
        (grid (1, rows, cols), the newline after each row staying in place): two items of one image."""
        layouts = self.image_layouts(captured)
        token = self.image_token_id
        device = captured.input_ids.device
        spans: list[VideoSpan] = []
        image = 0
        for b in range(captured.input_ids.shape[0]):
            for start, end in runs(captured.input_ids[b] == token):
                pos = start
                while pos < end:
                    if image >= len(layouts):
                        raise ValueError(
                            f"{self.family}: the prompt has more image tokens than the images passed produce"
                        )
                    layout = layouts[image]
                    if pos + layout.length > end:
                        raise ValueError(
                            f"{self.family}: image {image} needs {layout.length} tokens but its run has {end - pos}"
                        )
                    base = layout.side * layout.side
                    spans.append(
                        VideoSpan(
                            b,
                            image,
                            torch.arange(pos, pos + base, device=device),
                            (1, layout.side, layout.side),
                            torch.tensor([pos], device=device),
                            kind="image",
                            view="base",
                            anyres=layout,
                        )
                    )
                    if layout.rows:
                        cells = torch.arange(layout.rows * layout.cols, device=device)
                        seq = pos + base + cells // layout.cols * (layout.cols + 1) + cells % layout.cols
                        spans.append(
                            VideoSpan(
                                b,
                                image,
                                seq,
                                (1, layout.rows, layout.cols),
                                seq[:1].clone(),
                                kind="image",
                                view="crops",
                                in_place=True,
                                anyres=layout,
                            )
                        )
                    pos += layout.length
                    image += 1
        if image != len(layouts):
            raise ValueError(f"{self.family}: {len(layouts)} images were passed but {image} were found in the prompt")
        return spans

    def vision_stats_per_image(self, calls, spans, layer_of) -> list[dict]:
        """The tower call that encoded the prompt's image views: the base view's statistics as a frame's, the crops'
        packed as the model packs their features (unpadded, resized), already on the token grid (CLS dropped)."""
        layouts = {span.video: span.anyres for span in spans}
        views = [layouts[k].views for k in range(len(layouts))]
        call = next((c for c in reversed(calls) if c["items"] == sum(views)), None)
        if call is None:
            raise RuntimeError("no vision-tower call for these images was captured (was the vision tower bypassed?)")
        first = [sum(views[:k]) for k in range(len(views))]
        out: list[dict] = [{} for _ in spans]
        for stat, layer in layer_of.items():
            values = torch.cat([c[stat.kind] for c in call["chunks"].get(layer, []) if stat.kind in c])
            for k, span in enumerate(spans):
                layout = layouts[span.video]
                image = values[first[span.video] : first[span.video] + layout.views]
                out[k][stat] = anyres_view_stat(stat, image, layout, span.view, self.geometry.cls_tokens)
        return out
