"""StreamingTOM: "Streaming Token Compression for Efficient Video Understanding" (Chen, Tao, Shao, Wang; CVPR 2026;
https://arxiv.org/abs/2510.18269). Official code: YIGE24/StreamingTOM (commit 6c66b05: `streamingtom/modules/ctr.py`,
`streamingtom/tasks/vision.py`, `streamingtom/main.py`).

This module holds StreamingTOM's CTR (causal temporal reduction), a connect plugin `streamingtom-ctr`: every frame
keeps exactly G tokens (`CTR_RETAIN_TOKENS`, 50 of LLaVA-OneVision's 196). A token is static when its cosine with
the same position of the previous frame exceeds 0.9 (the first frame of the stream: all dynamic); the budget is
split G_s = int(G * n_static / N), G_d = G - G_s (clamped to what exists, the shortfall moved to the other set);
the static tokens are clustered by DPC-kNN (G_s centres, each merged as beta * centre + (1 - beta) * mean of the
static tokens nearest to it), the dynamic ones keep their G_d most attended (SigLIP last-layer attention received,
pooled to the token grid like the features); the G tokens are put back in spatial order. The previous frame is
causal state: it persists across calls in `ctx.state`, so consecutive chunks of one streamed video chain.

Followed the official code (`CTR`) where it differs from, or is more precise than, the spec (methods-a.md §6.1):
  * DPC-kNN direction: the official `_dpc_cluster` builds `higher_density_mask = density[:, None] >
    density[None, :]`, i.e. delta_i = distance to the nearest point of LOWER density (dist.max() for the least
    dense point), the reverse of the textbook rule the spec writes (nearest DENSER point, dist.max() for the
    densest; TCFormer / HoliTom / PruneVid). vtc follows the code; `delta_to_denser=True` gives the textbook rule.
  * kNN density: k = min(CTR_K, m - 1) smallest distances of the row, itself (distance 0) included, so the
    density averages the self distance and k - 1 neighbours; m <= 1 static tokens skip the clustering.
  * distances: `torch.cdist` of the float32 features / sqrt(dim) (the centre assignment uses the same matrix,
    argmin, first centre on ties; centres in ascending index order);
  * when G_s equals the number of static tokens every static token is a centre, unmerged;
  * the merge runs in the features' dtype (`beta * x_c + (1 - beta) * mean`), the cosine in float32 after
    `F.normalize`, `> threshold` (0.9 exactly is dynamic);
  * the previous frame of frame 0 of a call is the last frame of the previous call (`ctr_state`), in vtc
    `ctx.state[("previous", video_index)]`: the original (uncompressed) features of that frame.
vtc differences: the tie-break noise (U(0, 1e-6) on the density) comes from the seeded `ctx.generator` (the
official `torch.rand_like` uses the global RNG); G is clamped to the tokens of a frame (the official code
asserts 196 tokens per frame); G follows `retention` when no `retain_tokens` is given (round(r * H * W)); the
Qwen families are vtc ports (the released code sets up LLaVA only; its Qwen branch average-pools the attention
2 x 2, which vtc's Qwen statistics already are); a merged centre's side features (Qwen3-VL DeepStack) follow
the same linear map (weights beta and (1 - beta) / members).

Positions: the official LLaVA pipeline prefills the compressed frames with contiguous positions
(`position_ids = arange(L_past, L_past + 32 * 50)`, `tasks/vision.py`), so the policy is "compact" (renumbered)
on LLaVA; Qwen families keep their original M-RoPE rows, as every vtc connect method.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

import vtc
from vtc.core.stream import AnswerPast, Retrieval, concat_kv, kv_bytes
from vtc.core.vision_stats import VisionStat
from vtc_kernels import dequantize_groups, quantize_groups

Tensor = torch.Tensor

RECEIVED = VisionStat("received", -1)  # SigLIP last kept layer: attention each key receives (official importance)
DEFAULT_RETAIN_TOKENS = 50  # CTR_RETAIN_TOKENS (= OQM_GROUP_SIZE)


# --- CTR on one frame ---------------------------------------------------------------------------------------------


def classify_static(x: Tensor, previous: Tensor | None, threshold: float = 0.9) -> Tensor:
    """[N] bool: token i is static when cos(x[i], previous[i]) > threshold (float32, `F.normalize` first, as the
    official `_classify_tokens`); all dynamic without a previous frame."""
    if previous is None:
        return torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    if previous.shape != x.shape:
        raise ValueError(
            f"streamingtom-ctr: the previous frame has shape {tuple(previous.shape)}, this one {tuple(x.shape)}; "
            "consecutive frames must share the token grid"
        )
    a = F.normalize(x.float(), p=2, dim=-1)
    b = F.normalize(previous.to(x.device).float(), p=2, dim=-1)
    return (a * b).sum(dim=-1) > threshold


def split_budget(retain: int, num_static: int, num_tokens: int) -> tuple[int, int]:
    """(G_s, G_d): G_s = int(G * n_static / N), G_d = G - G_s, each clamped to the tokens of its set with the
    shortfall moved to the other one (official `_compress_single_frame`; G <= N)."""
    static_budget = int(retain * num_static / num_tokens)
    dynamic_budget = retain - static_budget
    num_dynamic = num_tokens - num_static
    if static_budget > num_static:
        static_budget = num_static
        dynamic_budget = retain - static_budget
    if dynamic_budget > num_dynamic:
        dynamic_budget = num_dynamic
        static_budget = retain - dynamic_budget
    return static_budget, dynamic_budget


def ctr_dpc_centers(
    x: Tensor,
    num_clusters: int,
    k: int,
    generator: torch.Generator | None = None,
    delta_to_denser: bool = False,
) -> tuple[Tensor, Tensor]:
    """The official `CTR._dpc_cluster` on x [m, D]: (centres [min(num_clusters, m)] ascending, dist [m, m]).

    dist = cdist(x, x) / sqrt(D) in float32; density = exp(-mean of the k' = min(k, m - 1) smallest squared
    distances of the row, the zero self distance included) + U(0, 1e-6) (from `generator`); delta_i = the
    distance to the nearest point of lower density (dist.max() when none), as the official mask
    `density[:, None] > density[None, :]` gives, or of higher density with `delta_to_denser`; the
    `num_clusters` best density * delta are the centres. m <= 1: the rows themselves, no noise drawn."""
    m, dim = x.shape
    dist = torch.cdist(x.float(), x.float()) / (dim**0.5)
    if m <= 1:
        return torch.arange(m, device=x.device), dist
    k_neighbors = min(int(k), m - 1)
    nearest = torch.topk(dist, k_neighbors, dim=-1, largest=False).values
    density = (-(nearest**2).mean(dim=-1)).exp()
    noise = torch.rand(density.shape, generator=generator, dtype=density.dtype)
    density = density + noise.to(density.device) * 1e-6
    if delta_to_denser:
        mask = density[None, :] > density[:, None]
    else:
        mask = density[:, None] > density[None, :]
    delta = torch.where(mask, dist, dist.max()).min(dim=-1).values
    centres = torch.topk(density * delta, min(int(num_clusters), m)).indices
    return torch.sort(centres).values, dist


@dataclasses.dataclass
class FramePlan:
    """One frame's CTR output, as spatial indices of the frame's N tokens.

    keep [G] ascending; values [G, D] the output features; keep_weight [G] and (dst [E], src [E], src_weight [E]):
    the same features as a linear map, values[j] = keep_weight[j] x[keep[j]] + sum_{dst[e] = j} src_weight[e]
    x[src[e]] (dst indexes `keep`); num_static: tokens classified static; budget: (G_s, G_d)."""

    keep: Tensor
    values: Tensor
    keep_weight: Tensor
    dst: Tensor
    src: Tensor
    src_weight: Tensor
    num_static: int
    budget: tuple[int, int]


def ctr_plan(
    x: Tensor,
    static: Tensor,
    importance: Tensor,
    retain: int,
    k: int = 7,
    beta: float = 0.6,
    generator: torch.Generator | None = None,
    delta_to_denser: bool = False,
) -> FramePlan:
    """CTR on one frame x [N, D] whose static tokens are `static` [N] (bool): the G_s static DPC-kNN centres
    (beta-merged with their members) and the G_d most important dynamic tokens, in spatial order."""
    n = x.shape[0]
    retain = min(int(retain), n)
    device = x.device
    num_static = int(static.sum())
    static_budget, dynamic_budget = split_budget(retain, num_static, n)
    keep_parts, value_parts, weight_parts = [], [], []
    dst = src = torch.zeros(0, dtype=torch.long, device=device)
    src_weight = torch.zeros(0, dtype=torch.float32, device=device)
    if static_budget > 0 and num_static > 0:  # `_select_and_merge_tokens_by_dpc`
        positions = torch.nonzero(static).flatten()
        feats = x[positions]
        m = feats.shape[0]
        centres, dist = ctr_dpc_centers(feats, min(static_budget, m), k, generator, delta_to_denser)
        c = centres.numel()
        keep_parts.append(positions[centres])
        if c == m:  # every static token is a centre: nothing merged
            value_parts.append(feats[centres])
            weight_parts.append(torch.ones(c, device=device))
        else:
            is_centre = torch.zeros(m, dtype=torch.bool, device=device)
            is_centre[centres] = True
            others = torch.nonzero(~is_centre).flatten()
            labels = torch.argmin(dist[others][:, centres], dim=1)
            members = torch.bincount(labels, minlength=c)
            sums = torch.zeros(c, x.shape[1], dtype=torch.float32, device=device)
            sums.index_add_(0, labels, feats[others].float())
            mean = (sums / members.clamp(min=1)[:, None]).to(x.dtype)
            centre = feats[centres]
            has = members > 0
            value_parts.append(torch.where(has[:, None], beta * centre + (1 - beta) * mean, centre))
            weight_parts.append(
                torch.where(has, torch.full((c,), float(beta), device=device), torch.ones(c, device=device))
            )
            dst = labels  # index into this frame's static centres, which come first in `keep_parts`
            src = positions[others]
            src_weight = (1 - beta) / members[labels].float()
    if dynamic_budget > 0 and num_static < n:  # `_select_tokens_by_attention`
        positions = torch.nonzero(~static).flatten()
        top = torch.topk(importance[positions.to(importance.device)], min(dynamic_budget, positions.numel())).indices
        chosen = positions[top.to(device)]
        keep_parts.append(chosen)
        value_parts.append(x[chosen])
        weight_parts.append(torch.ones(chosen.numel(), device=device))
    keep = torch.cat(keep_parts) if keep_parts else torch.zeros(0, dtype=torch.long, device=device)
    values = torch.cat(value_parts) if value_parts else x[:0]
    keep_weight = torch.cat(weight_parts) if weight_parts else torch.zeros(0, device=device)
    order = torch.argsort(keep)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=device)
    return FramePlan(
        keep=keep[order],
        values=values[order],
        keep_weight=keep_weight[order],
        dst=rank[dst] if dst.numel() else dst,
        src=src,
        src_weight=src_weight,
        num_static=num_static,
        budget=(static_budget, dynamic_budget),
    )


def ctr_frame(
    x: Tensor,
    previous: Tensor | None,
    importance: Tensor,
    retain: int,
    threshold: float = 0.9,
    k: int = 7,
    beta: float = 0.6,
    generator: torch.Generator | None = None,
    delta_to_denser: bool = False,
) -> tuple[Tensor, Tensor]:
    """StreamingTOM's CTR on one frame (official `CTR._compress_single_frame`, methods-a.md §6.1 step 2).

    x [N, D] the frame's tokens in spatial order, previous [N, D] the previous frame (None: the first frame of the
    stream, all tokens dynamic), importance [N] (vision attention on the token grid), retain = G (clamped to N).
    Returns (keep_index [G] ascending spatial indices, values [G, D] in x's dtype)."""
    static = classify_static(x, previous, threshold)
    plan = ctr_plan(x, static, importance, retain, k, beta, generator, delta_to_denser)
    return plan.keep, plan.values


def attention_on_grid(received: Tensor, geometry, size: tuple[int, int]) -> Tensor:
    """Vision attention [F, L] -> [F, H * W] on the LLM token grid, float32: LLaVA-OneVision bilinear (the
    official `_apply_2d_pool` of the importance map), LLaVA-NeXT-Video the model's 2 x 2 pooler (CLS dropped),
    Qwen already per LLM token."""
    return geometry.to_token_grid(received.float(), size)


# --- the plugin ---------------------------------------------------------------------------------------------------


def previous_key(video_index: int) -> tuple[str, int]:
    """Where the last frame of a video's previous call lives in `ctx.state`."""
    return ("previous", int(video_index))


@vtc.method(
    "streamingtom-ctr",
    paper="StreamingTOM (CVPR 2026), CTR only",
    url="https://arxiv.org/abs/2510.18269",
    summary="per frame: static tokens (cos > 0.9 with the previous frame) DPC-kNN clustered, dynamic tokens "
    "by vision attention; G tokens per frame, causal across calls",
    retention_note="retention sets G = round(r * H * W) tokens per frame (CTR_RETAIN_TOKENS, 50 of 196 by "
    "default), so the count is per-frame rounded; retain_tokens overrides it",
)
class StreamingTOMCTR(vtc.TokenMerger):
    """CTR: G tokens per frame, static ones DPC-kNN merged, dynamic ones by vision attention
    (official: YIGE24/StreamingTOM streamingtom/modules/ctr.py::CTR)."""

    temporal = True  # static / dynamic tokens from the previous frame: videos only

    retain_tokens: int | None = vtc.param(
        None, range="[1, inf)", doc="CTR_RETAIN_TOKENS: tokens kept per frame (default round(r H W), else 50)"
    )
    similarity_threshold: float = vtc.param(
        0.9, range="[0, 1]", doc="CTR_SIMILARITY_THRESHOLD: static when cos(previous frame) > it"
    )
    k: int = vtc.param(
        7, range="[1, inf)", doc="CTR_K: DPC-kNN neighbours (capped at static tokens - 1, self included)"
    )
    beta: float = vtc.param(0.6, range="[0, 1]", doc="CTR_BETA: weight of a centre against the mean of its members")
    delta_to_denser: bool = vtc.param(
        False, doc="True: textbook DPC delta (nearest denser point); False: the official code's (nearest lower)"
    )

    positions = "compact"  # the official LLaVA pipeline prefills the compressed frames contiguously
    whole_frames = True
    streams = True  # causal: the previous frame lives in ctx.state, so vtc.stream may feed it chunk by chunk

    def tokens_per_frame(self, positions: int) -> int:
        """G for a frame of `positions` tokens: retain_tokens, else round(retention * positions), else 50; at least
        1, at most the frame."""
        if self.retain_tokens is not None:
            g = int(self.retain_tokens)
        elif self.retention is not None:
            g = round(self.retention * positions)
        else:
            g = DEFAULT_RETAIN_TOKENS
        return max(1, min(g, positions))

    @property
    def identity(self) -> bool:
        """retention 1.0 without an explicit retain_tokens: every frame keeps all its tokens."""
        return self.retain_tokens is None and self.retention is not None and self.retention >= 1.0

    def retained_count(self, num_tokens: int, grid, family: str) -> int:
        t, h, w = (int(v) for v in grid)
        return t * self.tokens_per_frame(h * w)

    def vision_stats(self, family) -> list[VisionStat]:
        return [] if self.identity else [RECEIVED]

    def plan(self, tokens, ctx) -> vtc.Merge | None:
        if len(tokens) == 0:
            return None
        frames, idx = tokens.whole_frames(self.card.name)
        _, h, w = tokens.grid
        positions = h * w
        x = tokens.embeds[idx]  # [F', N, D]
        key = previous_key(ctx.video_index)
        previous = ctx.state.get(key)
        ctx.state[key] = x[-1].detach().clone()  # the original features of this call's last frame (`ctr_state`)
        g = self.tokens_per_frame(positions)
        if self.identity or g >= positions:
            return None
        received = ctx.vision.get(RECEIVED)
        if received is None:
            raise RuntimeError(f"{self.card.name}: the vision-tower attention was not captured")
        importance = attention_on_grid(received, ctx.geometry, (h, w))[frames.to(received.device)]
        importance = importance.to(tokens.embeds.device)
        keep, values, keep_weight, dst, src, src_weight, statics = [], [], [], [], [], [], []
        count = 0
        for f in range(x.shape[0]):
            static = classify_static(x[f], previous, self.similarity_threshold)
            plan = ctr_plan(x[f], static, importance[f], g, self.k, self.beta, ctx.generator, self.delta_to_denser)
            row = idx[f]
            keep.append(row[plan.keep])
            values.append(plan.values)
            keep_weight.append(plan.keep_weight)
            dst.append(plan.dst + count)
            src.append(row[plan.src])
            src_weight.append(plan.src_weight)
            statics.append(plan.num_static)
            count += plan.keep.numel()
            previous = x[f]
        ctx.report(static=statics)
        return vtc.Merge(
            torch.cat(keep),
            torch.cat(dst),
            torch.cat(src),
            torch.cat(src_weight),
            keep_weight=torch.cat(keep_weight),
            embeds=torch.cat(values),
        )


# --- OQM (streaming memory) ---


@dataclasses.dataclass
class FloatGroups:
    """Full-precision groups along the token axis (OQM with quantization off), with the `QuantizedGroups` API."""

    values: Tensor  # [1, heads, T, d]
    group_size: int

    @property
    def num_groups(self) -> int:
        return self.values.shape[-2] // self.group_size

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()

    def _groups(self, index: Tensor) -> Tensor:
        rows = (index[:, None] * self.group_size + torch.arange(self.group_size, device=index.device)).flatten()
        return rows.to(self.values.device)

    def select(self, group_indices) -> "FloatGroups":
        index = torch.as_tensor(group_indices, dtype=torch.long)
        return FloatGroups(self.values.index_select(-2, self._groups(index)), self.group_size)

    def drop_first(self, n_groups: int) -> "FloatGroups":
        return FloatGroups(self.values[..., n_groups * self.group_size :, :], self.group_size)

    def append(self, other: "FloatGroups") -> "FloatGroups":
        return FloatGroups(torch.cat([self.values, other.values], dim=-2), self.group_size)

    def dequantize(self) -> Tensor:
        return self.values


def store_groups(x: Tensor, params: "StreamingTOM", group_size: int):
    if params.quantize:
        return quantize_groups(x, bits=params.bits, group_size=group_size)
    return FloatGroups(x, group_size)


def load_groups(groups) -> Tensor:
    return groups.dequantize() if isinstance(groups, FloatGroups) else dequantize_groups(groups)


def select_groups(query: Tensor, group_keys: Tensor, max_groups: int) -> Tensor:
    """Indices (ascending = oldest first) of the `max_groups` groups whose keys [n, C] are most cosine-similar
    to `query` [C]; all of them when there are fewer."""
    n = group_keys.shape[0]
    if n <= max_groups:
        return torch.arange(n, device=group_keys.device)
    sims = torch.nn.functional.cosine_similarity(group_keys.float(), query.float()[None], dim=-1)
    return torch.sort(torch.topk(sims, max_groups).indices).values


class StreamingTOMMemory:
    """OQM: every frame's G tokens become one group per layer, stored at 4 bits (keys and values, per head and
    channel over the group's tokens) with a group key (the mean of the group's pre-RoPE keys); a chunk is
    prefilled after the prefix and the most recent `window_tokens` stored tokens (dequantized); a question
    retrieves, in every layer independently, the ceil(retrieval_tokens / G) groups whose keys best match the
    question's mean query, and is answered from the prefix plus those groups.

    Positions: on 1-D RoPE families (the official LLaVA-OneVision setting) a chunk takes window-relative
    positions after the prefix and its keys are stored after RoPE; the question starts at the retrieved cache's
    length. On M-RoPE families (vtc's port, not in the official code) every token keeps its stream position, keys
    are stored before RoPE (so the 4-bit groups quantize unrotated channels) and are rotated to their positions
    when a window or a retrieval brings them back; the question keeps the stream's next position."""

    name = "streamingtom"

    def __init__(self, params: "StreamingTOM", config) -> None:
        self.params = params  # the (bound) method: its fields are the parameters
        self.config = config
        self.budget_tokens = config.budget_tokens
        self.chunk_frames = params.chunk_frames
        mrope = bool(config.mrope)
        self.key_storage = params.key_storage or ("pre_rope" if mrope else "post_rope")
        self.window_relative = not mrope
        self.llm = None
        self.rotation = None
        self.prefix_kv = None
        self.group_size: int | None = None
        self.keys: list = []  # per layer: stored groups of keys
        self.values: list = []
        self.group_keys: list[Tensor] = []  # per layer: [n_groups, kv_heads * d]
        self.group_positions: Tensor | None = None  # [n_groups, P, G] stream positions
        self.evicted_groups = 0

    # --- bookkeeping ---------------------------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return 0 if self.group_positions is None else int(self.group_positions.shape[0])

    @property
    def stored_tokens(self) -> int:
        return self.num_groups * (self.group_size or 0)

    @property
    def nbytes(self) -> int:
        total = kv_bytes(self.prefix_kv)
        total += sum(g.nbytes for g in self.keys) + sum(g.nbytes for g in self.values)
        total += sum(k.numel() * k.element_size() for k in self.group_keys)
        if self.group_positions is not None:
            total += self.group_positions.numel() * self.group_positions.element_size()
        return total

    def start(self, llm, prefix) -> None:
        self.llm = llm
        self.rotation = llm.key_rotation()
        self.prefix_kv = llm.forward(prefix.embeds, prefix.positions).kv
        self.prefix_length = int(prefix.embeds.shape[0])

    def _groups_kv(self, layer: int, index: Tensor | None) -> tuple[Tensor, Tensor]:
        """Dequantized keys (rotated to their positions when stored before RoPE) and values of the groups at
        `index` (None: all) of one layer."""
        keys = self.keys[layer] if index is None else self.keys[layer].select(index)
        values = self.values[layer] if index is None else self.values[layer].select(index)
        k, v = load_groups(keys), load_groups(values)
        if self.key_storage == "pre_rope":
            positions = (
                self.group_positions if index is None else self.group_positions[index.to(self.group_positions.device)]
            )
            k = self.rotation(k, positions.permute(1, 0, 2).reshape(positions.shape[1], -1))
        return k, v

    # --- storing --------------------------------------------------------------------------------------------------
    def append(self, segment) -> None:
        frames = segment.grid[0]
        visual = segment.num_visual
        if visual % frames:
            raise RuntimeError(f"streamingtom: {visual} visual tokens do not split into {frames} frames of equal size")
        size = visual // frames
        if self.group_size is None:
            self.group_size = size
            if self.budget_tokens is not None and size > self.budget_tokens:
                raise ValueError(
                    f"budget_tokens={self.budget_tokens} is smaller than one frame: each frame keeps {size} tokens "
                    f"after CTR; raise the budget to at least {size}"
                )
        elif size != self.group_size:
            raise RuntimeError(
                f"streamingtom: frames keep {size} tokens, earlier ones {self.group_size} (one group each)"
            )
        # the past: prefix + the most recent window of stored tokens (all of them with quantization off)
        window = (
            self.num_groups if not self.params.quantize else min(self.num_groups, self.params.window_tokens // size)
        )
        past = self.prefix_kv
        if window:
            index = torch.arange(self.num_groups - window, self.num_groups)
            past = concat_kv(past, [self._groups_kv(layer, index) for layer in range(len(self.keys))])
        if self.window_relative:
            start = self.prefix_length + window * size
            positions = torch.arange(start, start + len(segment))[None]
        else:
            positions = segment.positions
        out = self.llm.forward(segment.embeds, positions, past, deepstack=segment.deepstack, visual=segment.visual)
        rows = torch.nonzero(segment.visual).flatten().to(out.kv[0][0].device)
        used = positions[:, rows.cpu()]
        group_positions = segment.positions[:, rows.cpu()].reshape(segment.positions.shape[0], frames, size)
        for layer, (k, v) in enumerate(out.kv):
            k, v = k.index_select(2, rows), v.index_select(2, rows)
            unrotated = self.rotation(k, used, inverse=True)
            stored_k = unrotated if self.key_storage == "pre_rope" else k
            group_key = unrotated.permute(0, 2, 1, 3).reshape(frames, size, -1).float().mean(dim=1)  # [frames, kvh * d]
            new_k, new_v = store_groups(stored_k, self.params, size), store_groups(v, self.params, size)
            if layer < len(self.keys):
                self.keys[layer] = self.keys[layer].append(new_k)
                self.values[layer] = self.values[layer].append(new_v)
                self.group_keys[layer] = torch.cat([self.group_keys[layer], group_key])
            else:
                self.keys.append(new_k)
                self.values.append(new_v)
                self.group_keys.append(group_key)
        group_positions = group_positions.permute(1, 0, 2).contiguous()  # [frames, P, G]
        self.group_positions = (
            group_positions if self.group_positions is None else torch.cat([self.group_positions, group_positions])
        )
        self._evict()

    def _evict(self) -> None:
        """vtc extension: with a budget, the oldest groups leave (the official store grows without bound)."""
        if self.budget_tokens is None or self.stored_tokens <= self.budget_tokens:
            return
        drop = self.num_groups - self.budget_tokens // self.group_size
        self.keys = [g.drop_first(drop) for g in self.keys]
        self.values = [g.drop_first(drop) for g in self.values]
        self.group_keys = [k[drop:] for k in self.group_keys]
        self.group_positions = self.group_positions[drop:]
        self.evicted_groups += drop

    # --- answering -----------------------------------------------------------------------------------------------
    def answer_past(self, question):
        max_groups = math.ceil(self.params.retrieval_tokens / self.group_size)
        chosen = min(max_groups, self.num_groups)
        length = self.prefix_length + chosen * self.group_size
        self.last_selection: dict[int, Tensor] = {}
        queries = self.llm.capture_queries()  # removed by `release` once the question is answered

        def fill(layer: int) -> tuple[Tensor, Tensor]:
            q_mean = queries.mean(layer, self.group_keys[layer].shape[1] // queries.kv_heads)
            index = select_groups(q_mean, self.group_keys[layer], max_groups)
            self.last_selection[layer] = index
            k, v = self._groups_kv(layer, index.cpu())
            pk, pv = self.prefix_kv[layer]
            return torch.cat([pk, k.to(pk.dtype)], dim=2), torch.cat([pv, v.to(pv.dtype)], dim=2)

        next_position = length if self.window_relative else None
        return AnswerPast(
            None,
            next_position,
            retrieval=Retrieval(fill, length),  # the backend fills its cache layer by layer from `fill`
            retrieved_tokens=chosen * self.group_size,
            release=queries.remove,
        )


@vtc.method(
    "streamingtom",
    paper="StreamingTOM (CVPR 2026)",
    url="https://arxiv.org/abs/2510.18269",
    summary="streaming: CTR keeps G tokens per frame; OQM stores each frame as a 4-bit KV group and "
    "retrieves the groups matching the question in every layer",
    retention_note="retention sets CTR's G per frame; the question attends to at most retrieval_tokens "
    "stored tokens per layer (12544 by default)",
)
class StreamingTOM(StreamingTOMCTR, vtc.StreamMemoryMethod):
    """The full method: CTR in the connect stage (one group of G tokens per frame), OQM as the stream's memory
    (official: streamingtom/main.py, the OQM_* settings). CTR's parameters, then OQM's."""

    retrieval_tokens: int = vtc.param(
        12544, range="[1, inf)", doc="OQM_RETRIEVAL_MAX_TOKENS: tokens retrieved per layer, ceil(this / G) groups"
    )
    quantize: bool = vtc.param(True, doc="OQM_ENABLE_QUANTIZATION: store groups at `bits` bits (False: full precision)")
    bits: int = vtc.param(4, choices=(4, 2), doc="OQM_QUANTIZATION_BITS")
    window_tokens: int = vtc.param(
        4800, range="[1, inf)", doc="OQM_SLIDING_WINDOW_SIZE: stored tokens a new chunk attends to (quantized path)"
    )
    chunk_frames: int = vtc.param(
        32, range="[1, inf)", doc="STREAMING_ENCODER_BATCH_SIZE: frames encoded and prefilled together"
    )
    key_storage: str | None = vtc.param(
        None,
        choices=("post_rope", "pre_rope"),
        doc="post_rope (official, 1-D RoPE) / pre_rope (vtc's M-RoPE port); None: by family",
    )

    stream_only = True  # OQM is the method's memory: vtc.patch refuses it
    requires = frozenset({"streaming"})  # vtc.stream encodes chunk by chunk (`vtc.core.families`)

    def stream_memory(self, config) -> StreamingTOMMemory:
        return StreamingTOMMemory(self, config)
