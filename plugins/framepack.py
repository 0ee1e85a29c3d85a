"""FramePack-U: training-free frame packing under a fixed token budget. Abstract only (no paper text, no code);
the implementation is vtc's reading of it (/work/shared/specs/from-abstracts.md §2, docs/methods/framepack-u.md).

Sample: F = 128 uniform candidates; relevance `r_i = cos(E_T(q), E_I(f_i))` (CLIP), min-max normalised; a greedy
maximal-marginal-relevance ranking over all F (`lambda * r_i - (1 - lambda) * max_{j in S} cos(e_i, e_j)`).
Connect: the ranking is packed into a geometric resolution ladder under a budget B: tier l has grid side
`ceil(s_0 / 2^l)` and `c_0 * 2^l` frames, `c_0 = max(1, B // (2 n_0))`; tiers stop below `s_min` = 4 or when the
next frame would exceed B; the leftover goes to further frames at the lowest tier used; the rest are dropped. The
frames reach the LLM in temporal order.

Where vtc's reading goes beyond the reading in the spec (docs/methods/framepack-u.md):
- The resize is on the features on every family (q-frame's connect stage, `vtc_plugins.qframe.resize_frames`), not
  on the pixels of separate Qwen images: the processor gets one video, the tower sees every candidate at full size.
- The ladder is laid on the model's token grid: a Qwen grid frame (two video frames in one temporal patch) is one
  packing unit, ranked by the better of its two frames; n_0 = h0 * w0 is its token count.
- `retention=None`: B = `budget_frames` (32) * n_0 and the LLM sees the ladder's own count (<= B). `retention=r`:
  B = round(r * N) (N: the tokens of all candidates at full resolution); the ladder decides the frames and their
  relative sizes, and B is shared in those proportions (largest remainder), so the LLM sees exactly B (q-frame's
  rule).
"""

from __future__ import annotations

import math
from typing import Any

import torch

import vtc
from vtc.media.encoders import clip_encoder, frame_features
from vtc_plugins.qframe import candidate_frames, resize_frames
from vtc_plugins.quota import token_budgets, whole_frames_only

__all__ = ["FramePackU", "grid_ranks", "ladder_pack", "minmax", "mmr_ranking", "tier_shape"]


# --- sample stage: relevance and the diversity-driven ranking --------------------------------------------------
def minmax(values) -> torch.Tensor:
    """(v - min) / (max - min); all equal: zeros (no frame is more relevant than another)."""
    v = torch.as_tensor(values, dtype=torch.float64).flatten()
    span = v.max() - v.min() if v.numel() else v.new_tensor(0.0)
    return torch.zeros_like(v) if span <= 0 else (v - v.min()) / span


def cosine_relevance(text: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """r_i = cos(E_T(q), E_I(f_i)), one value per image."""
    t = torch.nn.functional.normalize(text.reshape(1, -1).double(), dim=-1)
    return (torch.nn.functional.normalize(images.double(), dim=-1) @ t.T).squeeze(-1)


def mmr_ranking(relevance, embeddings, lam: float = 0.5) -> list[int]:
    """Greedy MMR over all candidates: `argmax_{i not in S} lam * minmax(r)_i - (1 - lam) * max_{j in S} cos(e_i,
    e_j)` (the max term 0 while S is empty), repeated until every candidate is placed. Ties: the earlier frame."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"framepack-u: lambda_mmr must be in [0, 1], got {lam}")
    r = minmax(relevance)
    if r.numel() == 0:
        raise ValueError("framepack-u: no candidate frames to rank")
    e = torch.nn.functional.normalize(torch.as_tensor(embeddings, dtype=torch.float64).reshape(len(r), -1), dim=-1)
    sim = e @ e.T
    redundancy = torch.zeros_like(r)
    free = torch.ones(len(r), dtype=torch.bool)
    order: list[int] = []
    for step in range(len(r)):
        gain = lam * r - (1 - lam) * (redundancy if step else torch.zeros_like(r))
        gain[~free] = -math.inf
        best = int(torch.argmax(gain))  # the first maximum: the earlier frame wins a tie
        order.append(best)
        free[best] = False
        redundancy = torch.maximum(redundancy, sim[best]) if step else sim[best].clone()
    return order


# --- connect stage: the resolution ladder -----------------------------------------------------------------------
def tier_shape(h0: int, w0: int, tier: int) -> tuple[int, int]:
    """Tier l's grid: both sides divided by 2^l, rounded up."""
    return math.ceil(h0 / 2**tier), math.ceil(w0 / 2**tier)


def ladder_pack(order: list[int], grid: tuple[int, int], budget: int, s_min: int = 4) -> dict[int, tuple[int, int]]:
    """{unit: (h, w)} for the units of `order` (best first) that fit in `budget` tokens.

    Tier l = 0, 1, ...: `tier_shape(h0, w0, l)`, `c_0 * 2^l` units, `c_0 = max(1, budget // (2 h0 w0))`. Stops
    when the next unit would exceed the budget, when a tier's smaller side is below `s_min`, or when the units run
    out; the leftover budget then takes further units at the lowest tier used. vtc's reading for budgets below one
    full frame: while nothing is packed, a tier whose unit does not fit is skipped (s_min aside)."""
    h0, w0 = int(grid[0]), int(grid[1])
    if budget < 1:
        raise ValueError(f"framepack-u: the token budget must be >= 1, got {budget}")
    n0 = h0 * w0
    c0 = max(1, budget // (2 * n0))
    packed: dict[int, tuple[int, int]] = {}
    used, pos, tier, lowest = 0, 0, 0, None
    while pos < len(order):
        shape = tier_shape(h0, w0, tier)
        cost = shape[0] * shape[1]
        if not packed:
            if cost > budget:  # a budget below one frame of this tier: try the next one down
                tier += 1
                continue
        elif min(shape) < s_min:
            break
        full = False
        for _ in range(c0 * 2**tier):
            if pos >= len(order):
                break
            if used + cost > budget:
                full = True
                break
            packed[order[pos]] = shape
            used += cost
            pos += 1
            lowest = shape
        if full:
            break
        tier += 1
    if lowest is not None:  # the leftover budget: further units at the lowest tier used
        cost = lowest[0] * lowest[1]
        while pos < len(order) and used + cost <= budget:
            packed[order[pos]] = lowest
            used += cost
            pos += 1
    return packed


def grid_ranks(ranks: list[int], grid_frames: int) -> list[int]:
    """Each grid frame's rank: the best rank of the video frames it holds (Qwen pairs frames; the last repeated
    when the count is odd, as the processor pads it)."""
    group = math.ceil(len(ranks) / grid_frames)
    padded = list(ranks) + [ranks[-1]] * (group * grid_frames - len(ranks))
    return [min(padded[g * group : (g + 1) * group]) for g in range(grid_frames)]


@vtc.method(
    "framepack-u",
    summary="FramePack-U (abstract only): CLIP relevance + MMR ranking of 128 candidates, packed into a ladder of "
    "halving grid sides and doubling frame counts under a token budget",
    paper="FramePack-U (abstract only)",
    url="",  # no paper or arXiv id known: the abstract is the only source (specs/from-abstracts.md §2)
    test_params={"encoder": "vtc-tiny-clip", "encoder_pretrained": None},
    retention_note="B = round(retention * N), shared by the packed frames in the ladder's proportions (exact); "
    "retention None: B = 32 full frames and the ladder's own count (<= B)",
    exempt={
        "identity_at_full_retention": "at retention 1.0 the budget is still shared by the ladder's tiers",
        "ordered_positions": "an upsampled frame repeats its grid's anchor positions",
        "original_positions": "resized frames are new features placed at their nearest grid cell (tested in "
        "tests/test_qframe.py and tests/test_framepack.py)",
    },
)
class FramePackU(vtc.FrameSampler):
    """Rank F candidates by relevance and diversity (MMR), pack them into a geometric resolution ladder under B."""

    candidates: int = vtc.param(128, range="[1, inf)", doc="F, uniform candidates (the abstract's frame budget)")
    lambda_mmr: float = vtc.param(0.5, range="[0, 1]", doc="MMR weight of relevance against diversity")
    budget_frames: int = vtc.param(
        32, range="[1, inf)", doc="with retention None, B = budget_frames * n_0 (n_0: tokens of a full grid frame)"
    )
    s_min: int = vtc.param(4, range="[1, inf)", doc="smallest grid side of a tier below tier 0")
    encoder: Any = vtc.param("ViT-L-14", doc="open_clip architecture, or an encoder object (vtc.media.encoders)")
    encoder_pretrained: str | None = vtc.param("openai", doc="open_clip weights tag or a local checkpoint file")

    query_aware = True
    reduces_tokens = True
    positions = "compact"
    prepool = True  # the pre-pool feature maps are resized
    whole_frames = True

    def sample(self, video, ctx):
        if not ctx.question:
            raise ValueError("framepack-u scores frames against the question: pass one to handle.prepare(...)")
        clip = clip_encoder(self.encoder, self.encoder_pretrained, param="framepack-u.encoder")
        candidates = candidate_frames(video.num_frames, int(ctx.num_frames or self.candidates))
        text = clip.encode_text([ctx.question])[0]
        images = frame_features(clip, video, candidates)
        relevance = cosine_relevance(text, images)
        order = mmr_ranking(relevance, images, self.lambda_mmr)
        ranks = [0] * len(order)
        for rank, position in enumerate(order):
            ranks[position] = rank
        ctx.state.update(ranks=ranks)
        ctx.report(ranking=[candidates[i] for i in order])
        return vtc.FrameChoice(candidates, candidates=candidates, scores=minmax(relevance).tolist())

    def budget(self, num_tokens: int, grid) -> int:
        if self.retention is not None:
            return max(1, round(num_tokens * self.retention))
        return self.budget_frames * grid[1] * grid[2]

    def retained_count(self, num_tokens: int, grid, family: str) -> int | None:
        return max(1, round(num_tokens * self.retention)) if self.retention is not None else None

    def plan(self, ranks: list[int], num_tokens: int, grid) -> tuple[list[int], list[tuple[int, int] | None]]:
        """Tokens per grid frame (0: dropped) and, with retention None, each packed frame's ladder grid."""
        t, h0, w0 = grid
        by_grid = grid_ranks(ranks, t)
        order = sorted(range(t), key=lambda g: by_grid[g])
        budget = self.budget(num_tokens, grid)
        packed = ladder_pack(order, (h0, w0), budget, self.s_min)
        shapes = [packed.get(g) for g in range(t)]
        own = [s[0] * s[1] if s else 0 for s in shapes]
        if self.retention is None:
            return own, shapes
        total = sum(own)
        return token_budgets([c / total for c in own], budget, exact=True), [None] * t

    def connect(self, tokens, ctx):
        if "ranks" not in ctx.prepared:
            raise ValueError(
                "framepack-u packs the frames its sample stage ranked: build the inputs with "
                "handle.prepare(processor, video, question) on the patched model"
            )
        whole_frames_only(tokens, "framepack-u")
        counts, shapes = self.plan(ctx.prepared["ranks"], len(tokens), tokens.grid)
        ctx.report(budgets=counts, sides=[list(s) if s else None for s in shapes])
        return resize_frames(tokens, ctx, counts, shapes)
