"""`vtc viz`: pictures of what a pipeline showed the model, for one video and one question.

- `timeline.png`: every frame the sampler scored (its score against time) and the frames it chose;
- `kept_tokens.png`: the chosen frames with the visual tokens the LLM receives highlighted (the rest dimmed);
- `layers.png`: visual tokens per LLM layer (prefill methods prune inside the LLM).

With no model it runs the offline demo, like `vtc run` (random weights, the generated clip; BOLT then scores with a
tiny random CLIP, so its scores are noise and the pictures show the mechanics).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import torch
from rich.console import Console

import vtc
from vtc.core.pipeline import parse_spec
from vtc.hf.loading import load_model
from vtc.media.video import VideoSource
from vtc.tools.loading import DEMO_FAMILY, build_random_model, demo_clip

DEMO_QUESTION = "Which object moves, and when?"
MAX_FRAMES_SHOWN = 8  # frames in kept_tokens.png


@vtc.method("viz-kept-tokens", paper="vtc viz", summary="records the tokens the LLM receives (not registered)")
@dataclasses.dataclass
class KeptTokens(vtc.Method):
    """Appended after the connect methods of the spec: records each video's surviving tokens, changes nothing."""

    seen: list = dataclasses.field(default_factory=list)

    reduces_tokens = False

    def connect(self, tokens, ctx):
        self.seen.append((tokens.grid, tokens.frame.tolist(), tokens.row.tolist(), tokens.col.tolist()))
        return tokens


def viz(
    video: str | None = None,
    question: str | None = None,
    methods: str = "bolt+vidcom2",
    retention: float | None = 0.25,
    num_frames: int = 16,
    model: str | None = None,
    params: dict[str, Any] | None = None,
    out: str = "vtc-viz",
    family: str = DEMO_FAMILY,
    size: str = "demo",
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the pipeline once on `video` and write the three PNGs to `out`; returns their paths and what they show."""
    console = console or Console()
    params = dict(params or {})
    if model is None:
        console.print(
            f"[bold]vtc viz demo[/bold]: a {family} model with [bold red]random weights[/bold red] on a generated "
            "clip; what the methods choose is real, what it means is noise."
        )
        if "bolt" in parse_spec(methods) and not any(k in params for k in ("encoder", "bolt.encoder")):
            # offline: the demo CLIP, no weights to download
            params.update({"bolt.encoder": "vtc-tiny-clip", "bolt.encoder_pretrained": None})
        with console.status("building the demo model"):
            net, processor = build_random_model(family, size)
        video, question = video or demo_clip(), question or DEMO_QUESTION
    else:
        if video is None or question is None:
            raise ValueError("vtc viz needs a VIDEO and --question with --model")
        with console.status(f"loading {model}"):
            net, processor = load_model(model)
    recorder = KeptTokens()
    spec = [*parse_spec(methods), recorder]
    with vtc.patch(net, spec, retention=retention, processor=processor, **params) as handle:
        with console.status("choosing frames and tokens"), torch.no_grad():
            inputs = handle.prepare(processor, video, question, num_frames=num_frames)
            net(**inputs.to(next(net.parameters()).device))
        stats = handle.stats()
    os.makedirs(out, exist_ok=True)
    selection = stats.frames[0]
    source = VideoSource.open(video)
    paths = {
        "timeline": timeline_png(selection, os.path.join(out, "timeline.png"), question),
        "kept_tokens": kept_tokens_png(selection, recorder.seen[0], source, os.path.join(out, "kept_tokens.png")),
        "layers": layers_png(stats, len(vtc.api.resolve_adapter(net).decoder_layers), os.path.join(out, "layers.png")),
    }
    console.print(f"frames shown: {selection.indices} ({selection.method})")
    console.print(f"visual tokens: {stats.visual_tokens_in} -> {stats.llm_tokens_in} enter the LLM")
    console.print("wrote " + ", ".join(paths.values()))
    return {"paths": paths, "frames": selection.indices, "tokens_in": stats.visual_tokens_in}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timeline_png(selection, path: str, question: str) -> str:
    """Candidate scores against time, the chosen frames as red lines (a frame chosen twice drawn thicker)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 3.6))
    if selection.candidates:
        times = [c / selection.fps for c in selection.candidates]
        ax.plot(times, selection.candidate_scores, marker=".", color="tab:blue", label="score of each candidate")
    counts: dict[int, int] = {}
    for i in selection.indices:
        counts[i] = counts.get(i, 0) + 1
    for n, (i, repeats) in enumerate(counts.items()):
        label = "chosen frame (thicker: chosen again)" if n == 0 else None
        ax.axvline(i / selection.fps, color="tab:red", alpha=0.7, linewidth=1.5 * repeats, label=label)
    ax.set_xlim(0, selection.total_frames / selection.fps)
    ax.set(xlabel="time in the video (s)", ylabel="score" if selection.candidates else "")
    ax.set_title(f"{selection.method}: {len(selection.indices)} frames for “{question[:70]}”", fontsize=10)
    ax.legend(loc="upper right", fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def kept_tokens_png(selection, seen, source: VideoSource, path: str) -> str:
    """The chosen frames (up to MAX_FRAMES_SHOWN distinct ones), each with the cells of the tokens the LLM
    receives at full brightness and the others dimmed. Qwen families encode frames in temporal pairs: both frames
    of a pair show the pair's tokens."""
    plt = _pyplot()
    (t, h, w), frame, row, col = seen
    kept = np.zeros((t, h, w), dtype=bool)
    kept[frame, row, col] = True
    shown = list(dict.fromkeys(selection.indices))[:MAX_FRAMES_SHOWN]
    per_token_frame = max(1, round(len(selection.indices) / t))  # 2 on the Qwen families
    cols = min(4, len(shown))
    rows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    images = source.read(shown)
    for ax in axes.flat:
        ax.axis("off")
    for ax, index, image in zip(axes.flat, shown, images):
        position = selection.indices.index(index) // per_token_frame
        mask = kept[min(position, t - 1)]
        cell = np.kron(mask, np.ones((-(-image.shape[0] // h), -(-image.shape[1] // w)), dtype=bool))
        cell = cell[: image.shape[0], : image.shape[1]]
        dimmed = (image * np.where(cell[..., None], 1.0, 0.25)).astype(np.uint8)
        ax.imshow(dimmed)
        ax.set_title(f"frame {index} ({index / selection.fps:.1f} s): {int(mask.sum())}/{h * w} kept", fontsize=9)
    fig.suptitle("tokens the LLM receives (dimmed: dropped or merged away)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def layers_png(stats, num_layers: int, path: str) -> str:
    """Visual tokens alive at each LLM layer (without a prefill method, what entered the LLM, at every layer)."""
    plt = _pyplot()
    counts = list(stats.layer_visual_tokens) or [stats.llm_tokens_in] * num_layers
    fig, ax = plt.subplots(figsize=(8, 3.4))
    ax.bar(range(len(counts)), counts, color="tab:green")
    ax.axhline(stats.visual_tokens_in, color="grey", linestyle="--", label=f"produced: {stats.visual_tokens_in}")
    ax.set(xlabel="LLM layer", ylabel="visual tokens", title="visual tokens per LLM layer")
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
