"""VisPruner: "Beyond Text-Visual Attention: Exploiting Visual Cues for Effective Token Pruning in VLMs" (Zhang et
al., ICCV 2025). arXiv: https://arxiv.org/abs/2412.01818. Official code: Theia-4869/VisPruner at aefa01ad
(`llava/model/llava_arch.py::encode_images`, `llava/model/multimodal_encoder/clip_encoder.py::feature_select`,
`llava/model/multimodal_encoder/siglip_encoder.py::feature_select`); the Qwen2.5-VL port: ModelTC/LightCompress at
9701d035 (`llmc/compression/token_reduction/vispruner.py`, from PR #441).

Per image (here: per frame), keep `T` tokens: the `T_imp = int(T r)` tokens the vision tower's own attention ranks
highest ("important"), and `T_div = T - T_imp` "diverse" tokens from the rest, found by repeatedly removing
duplicates: the remaining tokens (in attention order) are split into even / odd positions A / B, each A-token
scores its highest cosine similarity to a B-token, and the (at most 8) highest-scoring A-tokens are dropped, until
`T_div` remain. Survivors keep their spatial order. Stage: connect (the official code masks the tokens after the
projector, from attention and features read before it).

What it reads, by tower (docs/methods/vispruner.md): CLIP (LLaVA-NeXT-Video) the CLS query's attention at the
feature layer, head mean (official `attentions[-2][:, :, 0, 1:].mean(1)`), and the CLIP features the projector
receives; SigLIP (LLaVA-OneVision) the mean attention each patch receives at the last layer (the official SigLIP
tower: `attentions[-1].mean(-2)`, head mean); Qwen towers the last block's received attention on the merge units
(LightCompress) and the LLM tokens; InternVL the same reading as Qwen. Tower maps are pooled onto the token grid the
way the model pools its features, and the selection runs on that grid.

Where vtc differs: the budget is per frame, `T = round(retention * n)` (the official `visual_token_num` is per
image; LightCompress rounds `N (1 - prune_ratio)` the same way); with no retention the README's first setting, 128
of 576 tokens. A removal round on an odd number of remaining tokens, or one asked to drop more A-tokens than there
are, drops what it can (the official indexing raises there; LightCompress bumps `T_imp` by one instead).
"""

from __future__ import annotations

import torch

import vtc
from vtc.core.bases import fraction_count
from vtc.core.geometry import FamilyGeometry, default_geometry
from vtc.core.vision_stats import VisionStat

Tensor = torch.Tensor

IMPORTANT_RATIO = 0.5  # --important_ratio default (model_vqa*.py) and both README examples' first
README_FRACTION = 128 / 576  # README: `vqav2.sh 128 0.5` (LightCompress: prune_ratio 0.7778)
MAX_DROP_PER_ROUND = 8  # `r = min(8, R - diverse_token_num)`


# --- the algorithm, on one frame ----------------------------------------------------------------------------------


def split_budget(tokens: int, important_ratio: float) -> tuple[int, int]:
    """(T_imp, T_div) = (int(T r), T - T_imp), as `encode_images` computes them."""
    important = int(tokens * important_ratio)
    return important, tokens - important


def remove_duplicates(normalized: Tensor, residual: Tensor, diverse: int) -> Tensor:
    """The official duplicate-removal loop: `residual` (token indices, attention order) shrinks to `diverse` tokens.

    Each round splits the residual into A = even positions and B = odd positions, scores every A-token by its largest
    cosine similarity to a B-token (`normalized` rows are unit vectors), drops the `min(8, R - diverse)` highest
    scores, and continues with [the other A-tokens, by decreasing score (`argsort(descending)[r:]`); B]."""
    while diverse > 0:
        count = residual.numel()
        step = min(MAX_DROP_PER_ROUND, count - diverse)
        if step <= 0:
            break
        tokens = normalized[residual]
        a, b = tokens[::2], tokens[1::2]
        scores = (a @ b.transpose(-1, -2)).max(dim=-1).values
        distinct = scores.argsort(dim=-1, descending=True)[step:]
        residual = torch.cat([residual[::2][distinct], residual[1::2]])
    return residual


def vispruner_keep(
    attention: Tensor, features: Tensor, tokens: int, important_ratio: float = IMPORTANT_RATIO
) -> Tensor:
    """VisPruner on one frame: attention [n] (higher = more important), features [n, D] -> the `tokens` kept indices
    in selection order (important ones first, by attention; then the diverse ones)."""
    important, diverse = split_budget(tokens, important_ratio)
    order = attention.argsort(dim=-1, descending=True)
    kept, residual = order[:important], order[important:]
    if diverse <= 0:
        return kept
    normalized = features / features.norm(dim=-1, keepdim=True)
    return torch.cat([kept, remove_duplicates(normalized, residual, diverse)])


# --- what each tower gives ----------------------------------------------------------------------------------------


def attention_stat(geometry: FamilyGeometry, layer: int = -1) -> VisionStat:
    """CLIP (a CLS token): the CLS query's row; SigLIP, Qwen and InternViT towers: the attention each token receives."""
    return VisionStat("cls" if geometry.cls_tokens else "received", layer)


def token_attention(values: Tensor, geometry: FamilyGeometry, size: tuple[int, int]) -> Tensor:
    """[F, H*W] ranking map on the token grid from the captured statistic: the CLS row averaged over heads ([F, heads,
    L], as `image_attentions.mean(dim=1)`), or the received attention ([F, L]), pooled like the features."""
    values = values.float()
    if values.dim() == 3:
        values = values.mean(dim=1)
    return geometry.to_token_grid(values, size)


def projector_inputs(tokens, ctx) -> Tensor | None:
    """[N, D_vision]: per token, the vision features its projector receives, where the model pools before the
    projector (LLaVA-NeXT-Video: the CLIP grid pooled 2 x 2) and the tokens are the model's own (no earlier merge);
    None elsewhere (the LLM tokens are what the projector emitted for each token, or no such input exists)."""
    geometry, prepool = ctx.geometry, ctx.prepool
    if geometry is None or not geometry.pool_before_projector or prepool is None:
        return None
    if bool((tokens.weight != 1).any()) or prepool.shape[0] != tokens.grid[0]:
        return None
    t, h, w = tokens.grid
    pooled = geometry.pool_grid(prepool, (h, w))  # [T, H*W, D], as the model's pooler
    return pooled.to(tokens.embeds.device)[tokens.frame, tokens.patch]


# --- the method ---------------------------------------------------------------------------------------------------


@vtc.method(
    "vispruner",
    paper="Beyond Text-Visual Attention: Exploiting Visual Cues for Effective Token Pruning in VLMs (ICCV 2025)",
    url="https://arxiv.org/abs/2412.01818",
    summary="per frame: tokens the vision tower attends to most, plus diverse ones by iterative duplicate removal",
    retention_note="per frame: T = round(retention * n); at most half a token per frame off",
)
class VisPruner(vtc.TokenSelector):
    """Important tokens by vision attention + diverse tokens by similarity-based duplicate removal, per frame
    (official: Theia-4869/VisPruner llava/model/llava_arch.py::encode_images)."""

    tokens_per_frame: int | None = vtc.param(
        None, range="[1, inf)", doc="T (--visual_token_num), kept per frame; default round(retention * n)"
    )
    important_ratio: float = vtc.param(
        IMPORTANT_RATIO, range="[0, 1]", doc="r (--important_ratio): T_imp = int(T r) important, the rest diverse"
    )
    attention_layer: int = vtc.param(
        -1, doc="vision layer of the attention (-1: the feature layer, the official select layer; last on SigLIP/Qwen)"
    )
    features_before_projector: bool = vtc.param(
        True, doc="LLaVA-NeXT-Video: compare the CLIP features the projector receives (official); False: LLM tokens"
    )

    default_fraction = README_FRACTION
    positions = "compact"  # the official code drops the masked tokens before building inputs_embeds
    prepool = True  # LLaVA-NeXT-Video: the pooled CLIP features are the official similarity space

    def vision_stats(self, family):
        return [attention_stat(default_geometry(family), self.attention_layer)]

    def frame_count(self, num_patches: int) -> int:
        """T for a frame of `num_patches` tokens."""
        if self.tokens_per_frame is not None:
            return min(self.tokens_per_frame, num_patches)
        return fraction_count(num_patches, self.fraction())

    def retained_count(self, num_tokens, grid, family):
        t, h, w = grid
        if num_tokens != t * h * w:
            return None  # an earlier method thinned the frames: per-frame budgets make it content-dependent
        return t * self.frame_count(h * w)

    def connect(self, tokens, ctx):
        t, h, w = tokens.grid
        if len(tokens) == 0 or self.frame_count(h * w) >= h * w:
            return tokens
        return tokens.select(torch.sort(self.choose(tokens, None, ctx)).values)

    def choose(self, tokens, count, ctx):
        t, h, w = tokens.grid
        budget = self.frame_count(h * w)
        stat = attention_stat(ctx.geometry, self.attention_layer)
        if stat not in ctx.vision:
            raise RuntimeError(f"vispruner: the vision-tower statistic {stat} was not captured on {ctx.family}")
        device = tokens.embeds.device
        attention = token_attention(ctx.vision[stat], ctx.geometry, (h, w)).to(device)
        features = projector_inputs(tokens, ctx) if self.features_before_projector else None
        if features is None:
            features = tokens.embeds
        patch = tokens.patch
        keep = []
        for idx in tokens.frame_groups("patch"):
            if idx.numel() <= budget:  # a frame an earlier method thinned below T: kept whole
                keep.append(idx)
                continue
            f = int(tokens.frame[idx[0]])
            keep.append(idx[vispruner_keep(attention[f, patch[idx]], features[idx], budget, self.important_ratio)])
        return torch.cat(keep)
