"""The connect engine: one video's encoder output and token grid in, the compressed tokens out.

Every backend calls `connect_video` for every video: the HF patch (from the prompt's embeddings, after the
model scattered its features into the sequence) and vLLM's `embed_multimodal` (from the vision encoder's output,
before vLLM merges it into the prompt). It builds the `VideoTokens` a connect plugin sees, runs the pipeline's
connect plugins in order (`Pipeline.run_connect` checks each output) and returns the survivors: their
embeddings, their original positions and grid cells, and the side features that travelled with them. Plugins
never see backend objects.
"""

from __future__ import annotations

import torch

from vtc.core.pipeline import Pipeline
from vtc.core.stats import StatsRecorder
from vtc.core.tokens import Context, VideoTokens

Tensor = torch.Tensor


def video_tokens(
    embeds: Tensor,
    grid: tuple[int, int, int],
    *,
    mrope: bool,
    positions: Tensor | None = None,
    timestamps: Tensor | None = None,
    extras: dict[str, Tensor] | None = None,
    seq_index: Tensor | None = None,
) -> VideoTokens:
    """The `VideoTokens` of one video whose `embeds` [T*H*W, D] are in raster order on `grid` = (T, H, W).

    `positions` are the tokens' original positions ([3, N] M-RoPE rows or [N]); by default the grid cells
    (t, h, w) with `mrope`, else the flat index. `extras` are side features that must follow the tokens
    (Qwen3-VL's DeepStack features); `seq_index` is backend bookkeeping (where each token sits in its prompt)."""
    tokens = VideoTokens.from_grid(embeds, grid, positions=positions, mrope=mrope, timestamps=timestamps)
    tokens.extras = dict(extras or {})
    tokens.seq_index = seq_index
    return tokens


def connect_video(
    pipeline: Pipeline,
    embeds: Tensor,
    grid: tuple[int, int, int],
    ctx: Context,
    recorder: StatsRecorder | None = None,
    *,
    positions: Tensor | None = None,
    timestamps: Tensor | None = None,
    extras: dict[str, Tensor] | None = None,
    seq_index: Tensor | None = None,
    survivors: Tensor | None = None,
    survivor_weights: Tensor | None = None,
) -> tuple[VideoTokens, VideoTokens]:
    """Run the connect plugins of `pipeline` on one video. Returns `(tokens_in, tokens_out)`; `tokens_out is
    tokens_in` when every plugin kept everything. `ctx.geometry.mrope` decides the default position layout.
    `survivors`: the grid cells the encode stage kept (ascending); the connect plugins see only those, each standing
    for `survivor_weights` original tokens (None: one)."""
    mrope = bool(ctx.geometry.mrope) if ctx.geometry is not None else False
    tokens = video_tokens(
        embeds, grid, mrope=mrope, positions=positions, timestamps=timestamps, extras=extras, seq_index=seq_index
    )
    start = tokens
    if survivors is not None and (survivors.numel() < len(tokens) or survivor_weights is not None):
        start = tokens.select(survivors.to(tokens.embeds.device))
        start.log.append(("encode", len(tokens), len(start)))
        if survivor_weights is not None:
            start.weight = survivor_weights.to(start.weight.device, start.weight.dtype)
    return tokens, pipeline.run_connect(start, ctx, recorder)


def grid_cells(tokens: VideoTokens) -> Tensor:
    """Flat index (t * H * W + h * W + w) of each token's cell on the original grid (a merged token: its
    anchor's cell)."""
    return tokens.frame * tokens.tokens_per_frame + tokens.patch
