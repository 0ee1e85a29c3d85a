"""Q-Frame: "Query-aware Frame Selection and Multi-Resolution Adaptation for Video-LLMs" (Zhang et al., ICCV 2025,
arXiv 2506.22139). No official code; the spec is the paper (methods-a §11) and its abstract (from-abstracts §12).

CQR: T = 128 uniform candidates, CLIP similarity of the question to each (`I = Q F^T`, logit-scaled by default).
QFS: the Gumbel-Max trick, `p = log softmax(I / tau) + g`, `g = -log(-log u)`, rank by p. MRA: the K best-ranked
frames at full resolution, the next M at a quarter of the tokens, the next N at a sixteenth (4 + 8 + 32 on Qwen2-VL);
the frames go to the model in temporal order. Stages: sample (CQR, QFS) and connect (MRA).

Where vtc differs (vtc's reading, docs/methods/q-frame.md):
- MRA is done on the features, not the pixels: Qwen processors take one resolution per video, so every frame is
  encoded at the video's resolution and the connect stage resizes each frame's token map bilinearly to its tier's
  share (16 : 4 : 1), with QuoTA's functions (`vtc_plugins.quota`: `resize_frame`, `grid_frame_weights`,
  `anchor_cells`, `token_budgets`). The paper feeds low-resolution pixels.
- `retention` given: the LLM sees round(retention * N) visual tokens, shared 16 : 4 : 1 across the tiers.
  `retention=None`: the tiers' own count (a high frame keeps all its tokens).
- `q-frame-qfs` is the sampler alone (K frames at full resolution: the paper's VILA / GPT-4o setting).
"""

from __future__ import annotations

import math
from typing import Any

import torch

import vtc
from vtc.media.encoders import clip_encoder, frame_features, similarity_logits
from vtc.media.video import uniform_indices
from vtc_plugins.quota import grid_frame_weights, resize_frame, token_budgets, whole_frames_only
from vtc_plugins.quota import resize_frames as quota_resize_frames

__all__ = [
    "QFrame",
    "QFrameQFS",
    "candidate_frames",
    "gumbel_noise",
    "qfs_ranking",
    "resize_frames",
    "tier_counts",
    "tier_weights",
    "tiers_by_rank",
]

TIER_SHARE = {"high": 1.0, "medium": 1 / 4, "low": 1 / 16}  # r(1) = 4 r(2) = 16 r(3): tokens 16 : 4 : 1


# --- sample stage: CQR and QFS --------------------------------------------------------------------------------
def candidate_frames(total: int, count: int = 128) -> list[int]:
    """T uniform candidates, `linspace(0, total - 1, T, dtype=int)`; a clip shorter than T gives each frame once."""
    return sorted(set(uniform_indices(total, count, "floor")))


def gumbel_noise(count: int, seed: int) -> torch.Tensor:
    """g = -log(-log u), u ~ U[0, 1) from a `torch.Generator` seeded with `seed` (float64; u = 0 clamped)."""
    generator = torch.Generator().manual_seed(int(seed))
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    u = u.clamp(min=torch.finfo(torch.float64).tiny)
    return -torch.log(-torch.log(u))


def qfs_ranking(scores, tau: float, seed: int) -> tuple[list[int], list[float]]:
    """QFS: `p = log softmax(I / tau) + g`; returns (candidate positions by p, best first; p per candidate)."""
    if not tau > 0:
        raise ValueError(f"q-frame: tau must be > 0, got {tau}")
    values = torch.as_tensor(scores, dtype=torch.float64).flatten()
    if values.numel() == 0:
        raise ValueError("q-frame: no candidate frames to rank")
    p = torch.log_softmax(values / tau, dim=0) + gumbel_noise(values.numel(), seed)
    order = torch.argsort(p, descending=True, stable=True)
    return order.tolist(), p.tolist()


def tier_counts(high: int, medium: int, low: int, frames: int | None) -> tuple[int, int, int]:
    """K, M, N; with a frame request (`num_frames`) the request split in the same proportion (vtc's reading),
    at least one high frame."""
    if frames is None or frames == high + medium + low:
        return high, medium, low
    total = high + medium + low
    k = max(1, min(int(frames), round(frames * high / total)))
    m = min(int(frames) - k, round(frames * medium / total))
    return k, m, int(frames) - k - m


def tiers_by_rank(ranking: list[int], high: int, medium: int, low: int) -> dict[int, str]:
    """MRA: rank <= K high, K < rank <= K + M medium, the next N low; {candidate position: tier}."""
    out: dict[int, str] = {}
    for rank, position in enumerate(ranking[: high + medium + low]):
        out[position] = "high" if rank < high else "medium" if rank < high + medium else "low"
    return out


def tier_weights(tiers: list[str]) -> list[float]:
    """Each chosen frame's token share relative to a full frame: 1, 1/4, 1/16."""
    return [TIER_SHARE[t] for t in tiers]


COMMON: dict[str, Any] = dict(
    paper="Q-Frame (ICCV 2025)",
    url="https://arxiv.org/abs/2506.22139",
)


@vtc.method(
    "q-frame-qfs",
    summary="Q-Frame's sampler alone: Gumbel-Max ranking of CLIP question-frame similarity, the top K frames",
    test_params={"encoder": "vtc-tiny-clip", "encoder_pretrained": None},
    **COMMON,
)
class QFrameQFS(vtc.FrameSampler):
    """QFS: rank 128 uniform candidates by `log softmax(I / tau) + Gumbel noise`, keep the best K (temporal order)."""

    num_frames: int = vtc.param(8, range="[1, inf)", doc="K, frames handed to the processor (the paper: 8)")
    candidates: int = vtc.param(128, range="[1, inf)", doc="T, uniform candidates scored")
    tau: float = vtc.param(0.8, range="(0, inf)", doc="softmax temperature (the ablation's best: 0.8)")
    seed: int = vtc.param(0, doc="seed of the Gumbel noise (a torch.Generator per video)")
    logit_scale: bool = vtc.param(True, doc="I = logit_scale * cos (+ bias); False: the raw cosine")
    encoder: Any = vtc.param("ViT-L-14", doc="open_clip architecture, or an encoder object (vtc.media.encoders)")
    encoder_pretrained: str | None = vtc.param("openai", doc="open_clip weights tag or a local checkpoint file")

    query_aware = True

    def similarity(self, video, ctx) -> tuple[list[int], torch.Tensor]:
        """CQR: the candidates and I (one value per candidate)."""
        if not ctx.question:
            raise ValueError(f"{self.card.name} scores frames against the question: pass one to handle.prepare(...)")
        clip = clip_encoder(self.encoder, self.encoder_pretrained, param=f"{self.card.name}.encoder")
        candidates = candidate_frames(video.num_frames, self.candidates)
        text = clip.encode_text([ctx.question])[0]
        images = frame_features(clip, video, candidates)
        if self.logit_scale:
            scores = similarity_logits(clip, text, images)
        else:
            t = torch.nn.functional.normalize(text.reshape(1, -1).float(), dim=-1)
            scores = (torch.nn.functional.normalize(images.float(), dim=-1) @ t.T).squeeze(-1)
        return candidates, scores.float()

    def sample(self, video, ctx):
        candidates, scores = self.similarity(video, ctx)
        ranking, _ = qfs_ranking(scores, self.tau, self.seed)
        count = int(ctx.num_frames or self.num_frames)
        chosen = sorted(ranking[:count])  # temporal order
        return vtc.FrameChoice([candidates[i] for i in chosen], candidates=candidates, scores=scores.tolist())


@vtc.method(
    "q-frame",
    summary="Gumbel-Max frame ranking of CLIP question similarity; top 4 frames at full, next 8 at 1/4, "
    "next 32 at 1/16 of the tokens",
    test_params={"encoder": "vtc-tiny-clip", "encoder_pretrained": None},
    retention_note="round(retention * N) tokens shared 16 : 4 : 1 by the high, medium and low frames; "
    "retention None: the tiers' own count (a high frame keeps its whole grid)",
    exempt={
        "identity_at_full_retention": "at retention 1.0 the budget is still shared 16 : 4 : 1 across the tiers",
        "ordered_positions": "an upsampled frame repeats its grid's anchor positions",
        "original_positions": "resized frames are new features placed at their nearest grid cell (tested in "
        "tests/test_qframe.py)",
    },
    **COMMON,
)
class QFrame(QFrameQFS):
    """QFS + MRA: K + M + N frames in temporal order, each frame's feature map resized to its tier's token share."""

    high: int = vtc.param(4, range="[1, inf)", doc="K, frames at full resolution")
    medium: int = vtc.param(8, range="[0, inf)", doc="M, frames at 1/4 of the tokens")
    low: int = vtc.param(32, range="[0, inf)", doc="N, frames at 1/16 of the tokens")

    reduces_tokens = True  # it picks frames and resizes every frame to its tier
    positions = "compact"
    prepool = True  # the pre-pool feature maps are resized
    whole_frames = True

    # sample ---------------------------------------------------------------------------------------------------
    def sample(self, video, ctx):
        candidates, scores = self.similarity(video, ctx)
        ranking, _ = qfs_ranking(scores, self.tau, self.seed)
        k, m, n = tier_counts(self.high, self.medium, self.low, ctx.num_frames)
        by_position = tiers_by_rank(ranking, k, m, n)
        chosen = sorted(by_position)  # temporal order
        tiers = [by_position[i] for i in chosen]
        ctx.state.update(tiers=tiers, weights=tier_weights(tiers))
        ctx.report(tiers=tiers)
        return vtc.FrameChoice([candidates[i] for i in chosen], candidates=candidates, scores=scores.tolist())

    # connect --------------------------------------------------------------------------------------------------
    def budgets(self, shares: list[float], num_tokens: int, grid) -> list[int]:
        """Tokens per grid frame: the shares (1, 1/4, 1/16 per frame; Qwen's frame pairs averaged) of
        round(retention * N), or with retention None of the tiers' own count."""
        t = grid[0]
        merged = grid_frame_weights(shares, t)  # Qwen's frame pairs: the pair's mean share
        total = sum(merged)
        normalised = [w / total for w in merged]
        if self.retention is not None:
            budget = max(1, round(num_tokens * self.retention))
        else:
            budget = round(num_tokens * own_fraction(shares, t))
        return token_budgets(normalised, budget, exact=True)

    def retained_count(self, num_tokens: int, grid, family: str) -> int | None:
        return max(1, round(num_tokens * self.retention)) if self.retention is not None else None

    def connect(self, tokens, ctx):
        if "weights" not in ctx.prepared:
            raise ValueError(
                "q-frame sizes frames from the tiers its sample stage chose: build the inputs with "
                "handle.prepare(processor, video, question) on the patched model"
            )
        whole_frames_only(tokens, self.card.name)
        counts = self.budgets(ctx.prepared["weights"], len(tokens), tokens.grid)
        ctx.report(budgets=counts)
        return resize_frames(tokens, ctx, counts)


def resize_frames(tokens, ctx, counts: list[int], shapes: list | None = None):
    """QuoTA's per-frame resize (`vtc_plugins.quota.resize_frames`) with each frame's cells from `frame_cells`
    (`shapes[f]`: an exact (h, w) grid where given; a frame at 0 is dropped)."""
    _, h0, w0 = tokens.grid

    def resize(frame_map, count, f):
        return frame_cells(frame_map, count, h0, w0, shapes[f] if shapes is not None else None)

    return quota_resize_frames(tokens, ctx, counts, resize)


def own_fraction(shares: list[float], grid_frames: int) -> float:
    """The fraction of the grid's tokens the tiers keep: each grid frame keeps the mean share of the frames it
    holds (Qwen pairs frames; the last repeated when the count is odd, as the processor pads it)."""
    group = math.ceil(len(shares) / grid_frames)
    padded = list(shares) + [shares[-1]] * (group * grid_frames - len(shares))
    return sum(padded) / len(padded)


def frame_cells(
    frame: torch.Tensor, count: int, h0: int, w0: int, shape: tuple[int, int] | None = None
) -> tuple[torch.Tensor, tuple[int, int]]:
    """One frame's map [h, w, D] at `count` tokens: a full frame keeps the model's h0 x w0 grid (its own cells, or
    a pre-pool map resized bilinearly to it); a smaller share is QuoTA's `resize_frame` (exact count), or with
    `shape` (h, w), h * w = count, a bilinear resize to exactly that grid."""
    if shape is None or tuple(shape) == (h0, w0):
        if count != h0 * w0:
            return resize_frame(frame, count, exact=True)
        shape = (h0, w0)
    h, w = int(shape[0]), int(shape[1])
    if h * w != count:
        raise ValueError(f"frame_cells: a {h} x {w} grid has {h * w} cells, not {count}")
    if tuple(frame.shape[:2]) != (h, w):
        x = frame.permute(2, 0, 1)[None].float()
        frame = torch.nn.functional.interpolate(x, size=(h, w), mode="bilinear")[0].permute(1, 2, 0).to(frame.dtype)
    return frame.reshape(h * w, -1), (h, w)
