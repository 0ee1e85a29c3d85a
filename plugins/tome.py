"""ToMe: "Token Merging: Your ViT but Faster" (Bolya et al., ICLR 2023 oral). arXiv: https://arxiv.org/abs/2210.09461.
Official code: facebookresearch/ToMe (read at af95e4b1befa172dadccd8c81e223b10090f9579): `tome/merge.py`
(`bipartite_soft_matching`, `merge_wavg`, `merge_source`), `tome/utils.py::parse_r`, `tome/patch/timm.py`
(`ToMeBlock`, `ToMeAttention`: the step between attention and MLP, proportional attention), `tome/vis.py` (how a
source map is read: `source.argmax(dim=1)` is each patch's group).

Inside every transformer block, between attention and MLP, merge `r` pairs of similar tokens. The tokens are split
alternately into A (even indices) and B (odd indices); each A token finds its most cosine-similar B token on the
block's attention keys averaged over heads; the `r` A tokens with the highest best similarity are folded into their
B partner by a size-weighted average. Sizes (patches per token) travel with the tokens, and proportional
attention adds `log(size)` to the attention logits so a merged token weighs as the patches it stands for.
Stage: the vision tower (every block). This module holds the algorithm as pure tensor functions only.

Faithful to the official code, bit for bit (same torch ops on the same operands: `x / ||x||` without epsilon,
the batched `a @ b^T`, `max`, `argsort(descending=True)`, `gather`, `scatter_reduce` with `include_self`): the
matching, `r = min(r, (N - protected) // 2)`, the protected class / distillation tokens (scores -inf), the output
order `[unmerged A ; B]`, the weighted average (sum of `x * size` over sum of sizes), the source map (`amax` of
one-hot rows, float32 identity to start), `parse_r`, and "r <= 0 changes nothing" (the official `do_nothing`: no
reordering either). The order of the unmerged A tokens is the descending order of their best score, not their
original order; only with a class token are they sorted back into index order (the official code sorts so the
class token comes first). The merged sequence therefore does not keep the spatial order.

vtc differences: the matching returns an explicit `MergePlan` (indices) whose `merge` / `unmerge` equal the
official closures; `unmerge` inverts the distillation-token layout (the official closure reads `[unmerged A ; B]`
even then, so it is equal to the official one only without a distillation token); `parse_r` with one layer gives
the schedule's first value instead of dividing by zero; `unmerge_by_source` (not in the official code) spreads
merged tokens back onto the original token grid by the source map, for towers followed by a grid pooling (LLaVA).
`vtc_kernels.matching.best_match` / `vtc_kernels.merge.merge_into_anchors` are not used: the first matches one
2-D segment at a time with `argmax` (not the batched product and `max` of ToMe, and no -inf protection), the
second sums with `index_add_`, not ToMe's `scatter_reduce`, so neither is bit-identical to the official code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

import vtc
from vtc.core.bases import survivors_reach_llm

Tensor = torch.Tensor


def _rows(index: Tensor, batch: int, width: int) -> Tensor:
    """Token indices [b, k] as gather / scatter indices [batch, k, width] (a plan of batch 1 serves any batch)."""
    return index[..., None].expand(batch, index.shape[1], width)


@dataclass(frozen=True)
class MergePlan:
    """One ToMe matching over N tokens: A = tokens 0, 2, 4, ... (index i in A is token 2i), B = tokens 1, 3, ...

    unmerged [batch, |A| - r]: the A indices that stay, in output order (descending best score; index order with a
        class token).
    merged [batch, r]: the A indices folded into B, highest best score first.
    destination [batch, r]: the B index (token 2j + 1) each merged A token is folded into.
    With r == 0 the three are empty and `merge` / `unmerge` return their input as is."""

    unmerged: Tensor
    merged: Tensor
    destination: Tensor
    num_tokens: int
    distill_token: bool = False

    @property
    def r(self) -> int:
        """Tokens removed (after clipping)."""
        return self.merged.shape[1]

    def merge(self, x: Tensor, mode: str = "mean") -> Tensor:
        """x [batch, N, C] -> [batch, N - r, C]: `[unmerged A ; B]`, each B row reduced (`scatter_reduce` mode
        "mean" / "sum" / "amax", itself included) with the A rows folded into it. With a distillation token the
        order is `[A_0, B_0, rest of unmerged A, rest of B]` (class and distillation tokens first)."""
        if self.r == 0:
            return x
        batch, _, width = x.shape
        a, b = x[:, ::2, :], x[:, 1::2, :]
        kept = a.gather(1, _rows(self.unmerged, batch, width))
        moving = a.gather(1, _rows(self.merged, batch, width))
        b = b.scatter_reduce(1, _rows(self.destination, batch, width), moving, reduce=mode)
        if self.distill_token:
            return torch.cat([kept[:, :1], b[:, :1], kept[:, 1:], b[:, 1:]], dim=1)
        return torch.cat([kept, b], dim=1)

    def unmerge(self, x: Tensor) -> Tensor:
        """Merged x [batch, N - r, C] -> [batch, N, C]: every token gets the row of the merged token it went into
        (an A token folded into B gets its B partner's row)."""
        if self.r == 0:
            return x
        batch, _, width = x.shape
        count = self.unmerged.shape[1]
        if self.distill_token:  # undo merge's [A_0, B_0, A_1.., B_1..] layout
            kept, b = torch.cat([x[:, :1], x[:, 2 : count + 1]], 1), torch.cat([x[:, 1:2], x[:, count + 1 :]], 1)
        else:
            kept, b = x[:, :count], x[:, count:]

        out = torch.zeros(batch, self.num_tokens, width, device=x.device, dtype=x.dtype)
        out[:, 1::2, :] = b
        out.scatter_(1, _rows(2 * self.unmerged, batch, width), kept)
        out.scatter_(1, _rows(2 * self.merged, batch, width), b.gather(1, _rows(self.destination, batch, width)))
        return out


def bipartite_soft_matching(
    metric: Tensor, r: int, class_token: bool = False, distill_token: bool = False
) -> MergePlan:
    """ToMe's balanced bipartite matching on metric [batch, N, C] (the keys averaged over heads): remove up to r
    tokens, r clipped to (N - protected) // 2 (protected: the class token, token 0, and the distillation token,
    token 1, which never merge). Similarity is the cosine (`x / ||x||`, no epsilon) in metric's dtype."""
    if metric.dim() != 3:
        raise ValueError(
            f"bipartite_soft_matching: metric must be [batch, tokens, channels], got {tuple(metric.shape)}"
        )
    batch, count = metric.shape[0], metric.shape[1]
    r = min(r, (count - int(class_token) - int(distill_token)) // 2)
    if r <= 0:
        empty = torch.zeros(batch, 0, dtype=torch.long, device=metric.device)
        return MergePlan(empty, empty, empty, count, distill_token)
    with torch.no_grad():
        unit = metric / metric.norm(dim=-1, keepdim=True)
        scores = unit[..., ::2, :] @ unit[..., 1::2, :].transpose(-1, -2)  # [batch, |A|, |B|]
        if class_token:  # A_0 is the class token: never a source
            scores[..., 0, :] = -math.inf
        if distill_token:  # B_0 is the distillation token: never a destination
            scores[..., :, 0] = -math.inf
        best, partner = scores.max(dim=-1)
        order = best.argsort(dim=-1, descending=True)
        merged, unmerged = order[:, :r], order[:, r:]
        destination = partner.gather(1, merged)
        if class_token:  # back to index order, so the class token leads the output
            unmerged = unmerged.sort(dim=1).values
    return MergePlan(unmerged, merged, destination, count, distill_token)


def merge_wavg(plan: MergePlan, x: Tensor, size: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Size-weighted average merge of x [batch, N, C] with sizes [batch, N, 1] (None: ones, in x's dtype): returns
    (sum of x * size / sum of size per merged token [batch, N - r, C], summed sizes [batch, N - r, 1])."""
    if size is None:
        size = torch.ones_like(x[..., 0, None])
    total = plan.merge(x * size, mode="sum")
    size = plan.merge(size, mode="sum")
    return total / size, size


def merge_source(plan: MergePlan, x: Tensor, source: Tensor | None = None) -> Tensor:
    """Source map [batch, N_now, N_original]: row t marks (1.0) the original tokens merged token t holds. None
    starts from the identity [batch, N, N] (float32 default dtype, as the official code; x gives N and batch)."""
    if source is None:
        batch, count, _ = x.shape
        source = torch.eye(count, device=x.device)[None, ...].expand(batch, count, count)
    return plan.merge(source, mode="amax")


def unmerge_by_source(x: Tensor, source: Tensor) -> Tensor:
    """Merged tokens x [batch, T, C] back onto the original grid [batch, N, C] by the source map [batch, T, N]:
    original token n gets the row of the merged token holding it (`source.argmax(dim=1)`, as ToMe's `vis.py`
    reads it), so a size-weighted merge gives every token its group's average. Exact copies (a gather). A class
    token is one more original column: drop its row and column first if the grid has no place for it."""
    if x.dim() != 3 or source.dim() != 3 or source.shape[:2] != x.shape[:2]:
        raise ValueError(
            f"unmerge_by_source: x [batch, T, C] and source [batch, T, N] must share batch and T, got "
            f"{tuple(x.shape)} and {tuple(source.shape)}"
        )
    holder = source.argmax(dim=1)  # [batch, N]
    return x.gather(1, holder[..., None].expand(-1, -1, x.shape[2]))


def proportional_attention_bias(size: Tensor | None, dtype: torch.dtype | None = None) -> Tensor | None:
    """Proportional attention as an additive attention mask: sizes [batch, N, 1] -> log(size) [batch, 1, 1, N]
    (the official `attn + size.log()[:, None, None, :, 0]` on the scaled logits [batch, heads, N, N]; SDPA adds
    `attn_mask` there too). A token of size s then receives the attention of s copies of it. None -> None."""
    if size is None:
        return None
    bias = size.log()[:, None, None, :, 0]
    return bias if dtype is None else bias.to(dtype)


def parse_r(num_layers: int, r: int | list[int] | tuple[int, float]) -> list[int]:
    """Tokens removed per layer. int: the same r in every layer. (r, inflect): linear from int(r (1 - inflect)) to
    2r minus that (inflect -1 is the paper's decreasing schedule, 0 constant), truncated to int per layer. list: as
    given, padded with zeros to num_layers (a longer list is returned whole; the blocks use the first
    num_layers)."""
    if isinstance(r, list):
        return list(r) + [0] * max(num_layers - len(r), 0)
    inflect = 0.0
    if isinstance(r, tuple):
        r, inflect = r
    low = int(r * (1.0 - inflect))
    high = 2 * r - low
    step = (high - low) / (num_layers - 1) if num_layers > 1 else 0.0  # the official divides by zero for 1 layer
    return [int(low + step * i) for i in range(num_layers)]


def tome_layer_step(
    x: Tensor,
    size: Tensor | None,
    source: Tensor | None,
    keys: Tensor,
    r: int,
    class_token: bool = False,
    trace_source: bool = False,
    distill_token: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One block's merge as `ToMeBlock.forward` does it after the attention residual: hidden states x
    [batch, N, C], sizes [batch, N, 1] or None, source map or None, the attention keys [batch, heads, N, head_dim]
    (metric: their mean over heads, `ToMeAttention`'s `k.mean(1)`). r <= 0: everything comes back as is (the
    official block skips the step); otherwise sizes are materialised even if r clips to 0. Returns (x, size,
    source); source is only updated with trace_source."""
    if r <= 0:
        return x, size, source
    if keys.dim() != 4 or keys.shape[0] != x.shape[0] or keys.shape[2] != x.shape[1]:
        raise ValueError(
            f"tome_layer_step: keys must be [batch, heads, N, head_dim] for x [batch, N, C], got {tuple(keys.shape)} "
            f"and {tuple(x.shape)}"
        )
    plan = bipartite_soft_matching(keys.mean(1), r, class_token, distill_token)
    if trace_source:
        source = merge_source(plan, x, source)
    x, size = merge_wavg(plan, x, size)
    return x, size, source


# --- the method ---------------------------------------------------------------------------------------------------


def clipped_schedule(schedule: list[int], tokens: int, protected: int = 0) -> list[int]:
    """The tokens each block really removes from one image of `tokens` tokens: ToMe clips a block's r to
    (N - protected) // 2 of what is left."""
    out = []
    for r in schedule:
        r = max(0, min(r, (tokens - protected) // 2))
        out.append(r)
        tokens -= r
    return out


def schedule_for_count(tokens: int, keep: int, num_layers: int) -> list[int]:
    """vtc's schedule reaching `keep` of `tokens` per image over `num_layers` blocks: the removal split evenly over
    the blocks (earlier blocks take the remainder), except that a block takes more when the blocks after it could not
    finish (each merges at most half of what is left: ToMe's clip), and never more than that clip itself. With too
    few blocks it stops short: fewer removed than asked."""
    schedule, left = [], tokens
    for layer in range(num_layers):
        after = num_layers - layer - 1
        even = -(-(left - keep) // (after + 1))
        r = min(left // 2, max(even, left - keep * 2**after)) if left > keep else 0
        schedule.append(r)
        left -= r
    return schedule


@vtc.method(
    "tome",
    paper="Token Merging: Your ViT but Faster (ICLR 2023)",
    url="https://arxiv.org/abs/2210.09461",
    summary="inside the vision tower, between attention and MLP of every block: bipartite soft matching merges r "
    "pairs of similar tokens per frame (size-weighted average, proportional attention)",
    retention_note=(
        "Qwen: each frame keeps round(r * n) merge units when the tower's blocks allow it (a block merges at most "
        "half of what is left); LLaVA: the LLM's count is unchanged (tokens are unmerged before the pooling), so "
        "tome takes no share of the retention there"
    ),
    exempt={
        "fixed_count": "the check's retention 0.15 is out of reach of the 2-block tiny Qwen2-VL tower (ToMe merges "
        "at most half of a frame per block: a quarter is left at best); tests/test_tower.py checks the promised "
        "count at 0.25, alone and composed"
    },
)
class ToMe(vtc.TowerMerger):
    """ToMe (official: facebookresearch/ToMe) between attention and MLP of every vision-tower block, one frame
    (temporal patch) at a time as one image. On the Qwen towers a token is a merge unit (the matching metric is the
    unit's head-averaged keys, its patches side by side; a merge averages each patch slot): the survivors reach the
    LLM at their own (t, h, w). On SigLIP / CLIP (LLaVA) a token is a patch (CLIP's class token protected) and every
    frame is unmerged onto its grid before the pooling (the source map), as ToMe's `merge_source`: tower compute
    only, the LLM's count is unchanged."""

    r: int | list | None = vtc.param(
        None,
        doc="tokens merged per block per frame: an int (every block, with `inflect`), or one int per block "
        "(model.r); None: from the retention on the Qwen towers, the official 0 (nothing) on LLaVA",
    )
    inflect: float = vtc.param(0.0, doc="with an int r: the official (r, inflect) schedule (0 constant, -1 decreasing)")
    prop_attn: bool = vtc.param(True, doc="proportional attention: log(size) added to the attention logits (official)")
    depth: int | None = vtc.param(
        None,
        range="[1, inf)",
        doc="blocks of the vision tower, for a count known before the model exists with an int r (a server sets "
        "it from the model's config); None: the model's own",
    )

    needs_keys: ClassVar[bool] = True

    def validate(self) -> None:
        if isinstance(self.r, list) and any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in self.r):
            raise ValueError(f"tome: r must be an int >= 0 or a list of them (one per block), got {self.r!r}")
        if isinstance(self.r, int) and self.r < 0:
            raise ValueError(f"tome: r must be >= 0, got {self.r}")

    def reduces_llm_tokens(self, family):
        return family is None or survivors_reach_llm(family)

    def llm_tokens_note(self, family):
        if survivors_reach_llm(family):
            return ""
        return (
            f"tome unmerges its tokens onto the frame grid before {family}'s pooling, as ToMe's source map, so it "
            "saves tower compute and keeps every LLM token; set tome.r for the tower"
        )

    def proportional_attention(self) -> bool:
        return self.prop_attn and self._acts()

    def _acts(self) -> bool:
        return self.r is None or bool(self.r if isinstance(self.r, int) else any(self.r))

    def schedule(self, num_layers: int, tokens_per_frame: int) -> list[int]:
        """Tokens merged per frame in each of the tower's `num_layers` blocks (before ToMe's clip)."""
        if self.r is not None:
            return parse_r(num_layers, self.r if isinstance(self.r, list) else (self.r, self.inflect))[:num_layers]
        if self.retention is None:
            return [0] * num_layers
        keep = max(1, round(self.retention * tokens_per_frame))
        schedule = schedule_for_count(tokens_per_frame, keep, num_layers)
        if tokens_per_frame - sum(schedule) > keep:
            raise ValueError(
                f"tome: its share of the retention ({self.retention:.3g}) asks each frame to keep {keep} of "
                f"{tokens_per_frame} tokens, but this {num_layers}-block tower merges at most half of what is left "
                f"per block, so a frame keeps at least {tokens_per_frame - sum(schedule)}; use a higher retention or "
                "compose tome with another reducing method"
            )
        return schedule

    def changes_tower(self, grid):
        if self.r is None:  # from the retention: a frame of H * W tokens keeps round(r * H * W)
            return self.retention is not None and round(self.retention * grid[1] * grid[2]) < grid[1] * grid[2]
        return self._acts()

    def retained_count(self, num_tokens, grid, family):
        if not survivors_reach_llm(family):
            return num_tokens
        t, h, w = grid
        if num_tokens != t * h * w:  # after a pre-tower method: per-frame counts depend on the content
            return None
        if self.r is None:
            return t * max(1, round(self.retention * h * w)) if self.retention is not None else num_tokens
        depth = self.depth if self.depth is not None else (len(self.r) if isinstance(self.r, list) else None)
        if depth is None:  # an int r: the count depends on the tower's depth
            return None
        return t * (h * w - sum(clipped_schedule(self.schedule(depth, h * w), h * w)))

    def frame_r(self, start: Tensor, tokens: int, num_layers: int, layer: int, protected: int) -> Tensor:
        """Tokens each frame merges at `layer` [T] (before ToMe's clip): an explicit `r` is the same for every frame
        (refused where it exceeds what a whole frame of `tokens` has left at that block); from the retention, each
        frame's own schedule from the tokens it had when the tower started (`start` [T]: fewer after a pre-tower
        method)."""
        if self.r is not None:
            schedule = self.schedule(num_layers, tokens)
            left = tokens + protected - sum(clipped_schedule(schedule, tokens + protected, protected)[:layer])
            if schedule[layer] > left:
                raise ValueError(
                    f"tome: r={schedule[layer]} at block {layer} is larger than the {left} tokens a frame has there; "
                    "ToMe merges at most half of a frame's tokens per block (it clips r to that), so give r <= "
                    f"{left} per block"
                )
            return torch.full_like(start, schedule[layer])
        out = torch.zeros_like(start)
        for n in torch.unique(start[start > 0]).tolist():
            out[start == n] = self.schedule(num_layers, n)[layer]
        return out

    def encode_block(self, tokens, ctx):
        if tokens.point == "embedded":  # each frame's tokens as the tower starts (fewer after a pre-tower method)
            ctx.state[ctx.video_index] = tokens.frame_lengths()
            return tokens
        if tokens.point != "after_attention":
            return tokens
        class_token = tokens.has_class_token
        cells = int(tokens.grid[1] * tokens.grid[2])
        start = ctx.state[ctx.video_index] - int(class_token)
        r_of_frame = self.frame_r(start, cells, tokens.num_layers, tokens.layer, int(class_token))
        if not bool((r_of_frame > 0).any()):
            return tokens
        keep, src, dst, hidden, size = {}, [], [], {}, {}
        for frames, index in tokens.frame_batches():
            for r in torch.unique(r_of_frame[frames]).tolist():
                rows = r_of_frame[frames] == r
                self._merge_frames(tokens, frames[rows], index[rows], r, class_token, keep, src, dst, hidden, size)
        if not src:
            return tokens
        frames = sorted(keep)
        return tokens.merge(
            torch.cat([keep[f] for f in frames]),
            torch.cat(src),
            torch.cat(dst),
            hidden=torch.cat([hidden[f] for f in frames]),
            size=torch.cat([size[f] for f in frames]),
        )

    @staticmethod
    def _merge_frames(tokens, frames, index, r, class_token, keep, src, dst, hidden, size) -> None:
        """ToMe's step on frames of equal length (`index` [f, n]): their new tokens in ToMe's order into `keep` /
        `hidden` / `size` by frame, the folded pairs appended to `src` / `dst`."""
        x = tokens.hidden[index]  # [f, n, unit, D]
        f, n = index.shape
        metric = tokens.keys[index].mean(dim=-2).reshape(f, n, -1)  # heads averaged, a unit's patches side by side
        plan = bipartite_soft_matching(metric, r, class_token=class_token)
        if plan.r == 0:
            for i, frame in enumerate(frames.tolist()):
                keep[frame], hidden[frame], size[frame] = index[i], x[i], tokens.size[index[i]]
            return
        merged, sizes = merge_wavg(plan, x.reshape(f, n, -1), tokens.size[index][..., None].to(x.dtype))
        b = torch.arange(1, n, 2, device=index.device).expand(f, -1)
        order = torch.cat([2 * plan.unmerged, b], dim=1)  # ToMe's output order: [unmerged A ; B]
        for i, frame in enumerate(frames.tolist()):
            keep[frame] = index[i, order[i]]
            hidden[frame] = merged[i].view(-1, *x.shape[2:])
            size[frame] = sizes[i, :, 0].to(tokens.size.dtype)
        src.append(index.gather(1, 2 * plan.merged).flatten())
        dst.append(index.gather(1, 2 * plan.destination + 1).flatten())
