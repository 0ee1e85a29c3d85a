"""The state that flows between stages: `VideoTokens` (one video's visual tokens), `TokenLayout` (the
sequence inside the LLM) and `Context`.

A `connect` plugin receives a `VideoTokens`, returns a `VideoTokens`, and never needs to know which model
produced it. Every per-token field is kept aligned by the operations plugins use (`select`, `merge`,
`merge_dense`), so positions, frame/row/col and side features (e.g. Qwen3-VL DeepStack) always travel with the
token they belong to. Views (`frame_groups`, `grid_index`) give the frame structure without re-deriving it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from vtc.core.geometry import FamilyGeometry

if TYPE_CHECKING:  # pragma: no cover
    from vtc.core.vision_stats import VisionStat

Tensor = torch.Tensor


def frame_groups(frame: Tensor, patch: Tensor | None = None, tokens_per_frame: int = 0) -> list[Tensor]:
    """Token indices of each frame present in `frame` [N], frames ascending; within a frame in `patch` order
    (spatial, with `tokens_per_frame` = H * W), or in the tokens' current order when `patch` is None."""
    key = frame if patch is None else frame * tokens_per_frame + patch
    ordered = torch.sort(key, stable=True).indices
    counts = torch.unique_consecutive(frame[ordered], return_counts=True)[1]
    return list(torch.split(ordered, counts.tolist()))


def dense_mix(x: Tensor, keep: Tensor, keep_weight: Tensor, src: Tensor, src_weight: Tensor) -> Tensor:
    """Rows keep_weight[j] * x[keep[j]] + sum_i src_weight[j, i] * x[src[i]] of x [n, ...], computed in float32 and
    cast back to x's dtype (the linear map of a dense merge, applied to features or side features)."""
    flat = x.reshape(x.shape[0], -1).float()
    mixed = keep_weight.float()[:, None] * flat[keep] + src_weight.float() @ flat[src]
    return mixed.to(x.dtype).reshape(keep.numel(), *x.shape[1:])


@dataclasses.dataclass
class VideoTokens:
    """The visual tokens of one video, in the order the LLM will see them.

    Fields (N = current number of tokens):
      embeds     [N, D]   token features (post-projector, what the LLM embeds)
      positions  [3, N] (M-RoPE t/h/w) or [N] (1-D RoPE): the *original* positions of each token (a merged
                 token keeps its anchor's position)
      frame, row, col [N] where the token sits on the original token grid (frame = temporal index of the
                 LLM token grid; for Qwen that is one temporal patch, i.e. 2 input frames)
      weight     [N]      how many original tokens a token stands for (1 until merged)
      grid       (T, H, W) of the original token grid
      timestamps [T]      seconds of each temporal index, when known
      extras     name -> [N, ...] side features that must follow the tokens (merged like embeds)
      tags       name -> [N] integer labels a later stage needs (e.g. PruneVid's window / static flags);
                 they travel into the LLM, where `prefill` plugins read them as `state.layout.tags`
      log        what each stage did, as (plugin, tokens_in, tokens_out) tuples
    """

    embeds: Tensor
    positions: Tensor
    frame: Tensor
    row: Tensor
    col: Tensor
    weight: Tensor
    grid: tuple[int, int, int]
    timestamps: Tensor | None = None
    extras: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    tags: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    # index of each token's anchor in the adapter's original sequence; adapter-private bookkeeping
    seq_index: Tensor | None = None
    log: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def num_frames(self) -> int:
        return self.grid[0]

    @property
    def tokens_per_frame(self) -> int:
        return self.grid[1] * self.grid[2]

    @property
    def patch(self) -> Tensor:
        """Spatial index of each token within its frame (row * W + col)."""
        return self.row * self.grid[2] + self.col

    def _per_token(self) -> dict[str, Tensor]:
        fields = {
            "embeds": self.embeds,
            "frame": self.frame,
            "row": self.row,
            "col": self.col,
            "weight": self.weight,
        }
        if self.seq_index is not None:
            fields["seq_index"] = self.seq_index
        return fields

    # --- constructors and views -----------------------------------------------------------------------------
    @classmethod
    def from_grid(
        cls,
        embeds: Tensor,
        grid: tuple[int, int, int],
        positions: Tensor | None = None,
        mrope: bool = False,
        timestamps: Tensor | None = None,
    ) -> "VideoTokens":
        """One video's tokens on a full (T, H, W) grid in raster order (frame, then row, then column), as the
        backends hand them to connect plugins. `positions` default to the flat index, or (t, h, w) rows with
        `mrope`."""
        t, h, w = (int(v) for v in grid)
        if embeds.shape[0] != t * h * w:
            raise ValueError(f"grid {grid} holds {t * h * w} tokens but embeds has {embeds.shape[0]}")
        flat = torch.arange(t * h * w, device=embeds.device)
        frame, row, col = flat // (h * w), (flat // w) % h, flat % w
        if positions is None:
            positions = torch.stack([frame, row, col]) if mrope else flat.clone()
        return cls(
            embeds=embeds,
            positions=positions,
            frame=frame,
            row=row,
            col=col,
            weight=torch.ones(t * h * w, device=embeds.device),
            grid=(t, h, w),
            timestamps=timestamps,
        )

    @property
    def is_full_grid(self) -> bool:
        """Every token of the original grid is here, once, in raster order (nothing was removed or moved)."""
        t, h, w = self.grid
        n = t * h * w
        return len(self) == n and bool(
            (self.frame * h * w + self.patch == torch.arange(n, device=self.frame.device)).all()
        )

    def frames(self) -> Tensor:
        """The frames (temporal indices of the grid) that still have tokens, ascending."""
        return torch.unique(self.frame, sorted=True)

    def frame_groups(self, order: str = "patch") -> list[Tensor]:
        """Token indices of each frame that has tokens, frames ascending. Within a frame: spatial order
        (`order="patch"`, row-major on the grid) or the order the tokens have now (`order="index"`)."""
        if order not in ("patch", "index"):
            raise ValueError(f"order must be 'patch' or 'index', got {order!r}")
        return frame_groups(self.frame, self.patch if order == "patch" else None, self.tokens_per_frame)

    def grid_index(self) -> Tensor:
        """[T, H*W]: for every cell of the original grid, the index of the token sitting there (-1 where none
        is). Two tokens on one cell raise (merged outputs that repeat an anchor have no single grid index)."""
        t, h, w = self.grid
        cell = self.frame * h * w + self.patch
        if torch.unique(cell).numel() != cell.numel():
            raise ValueError("two tokens sit on the same grid cell; a grid index needs one token per cell")
        lookup = torch.full((t * h * w,), -1, dtype=torch.long, device=self.frame.device)
        lookup[cell] = torch.arange(len(self), device=self.frame.device)
        return lookup.view(t, h * w)

    def whole_frames(self, method: str) -> tuple[Tensor, Tensor]:
        """(frames [F'], idx [F', H*W]): the frames that have tokens and the token at every cell of each, for
        methods that need every token of every frame they get (frames an earlier method dropped entirely are
        fine); a frame with missing cells raises a ValueError naming `method`."""
        frames = self.frames()
        idx = self.grid_index()[frames]
        if bool((idx < 0).any()):
            raise ValueError(
                f"{method} needs whole frames (it compares every position across frames); "
                "a method before it removed tokens inside frames: put it first among the connect methods"
            )
        return frames, idx

    # --- operations ---------------------------------------------------------------------------------------
    def select(self, keep: Tensor, allow_repeats: bool = False) -> "VideoTokens":
        """Keep the tokens at indices `keep` (1-D long tensor), in that order. Each index may appear once, unless
        `allow_repeats` (one token feeding several outputs, as AOT's merged anchor frame does)."""
        keep = keep.to(self.embeds.device, torch.long)
        if keep.dim() != 1:
            raise ValueError(f"select expects a 1-D tensor of token indices, got shape {tuple(keep.shape)}")
        if keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= len(self)):
            raise IndexError(
                f"select: token indices must be in [0, {len(self)}), got [{int(keep.min())}, {int(keep.max())}]"
            )
        if not allow_repeats and torch.unique(keep).numel() != keep.numel():
            raise ValueError("select: a token index appears twice (pass allow_repeats=True if that is intended)")
        gathered = {name: t[keep] for name, t in self._per_token().items()}
        return dataclasses.replace(
            self,
            positions=self.positions[..., keep],
            extras={name: t[keep] for name, t in self.extras.items()},
            tags={name: t[keep] for name, t in self.tags.items()},
            log=list(self.log),
            **gathered,
        )

    def merge(
        self,
        keep: Tensor,
        dst: Tensor,
        src: Tensor,
        src_weight: Tensor,
        keep_weight: Tensor | None = None,
        embeds: Tensor | None = None,
        allow_repeats: bool = False,
    ) -> "VideoTokens":
        """Keep `keep` tokens and fold other tokens into them, as a weighted sum.

        For each kept token j (0-based in `keep` order): new_j = keep_weight[j] * x[keep[j]] +
        sum over e with dst[e] == j of src_weight[e] * x[src[e]]. The same linear map is applied to
        `embeds` and every entry of `extras`, so side features stay consistent with the token.
        `weight` (token counts) accumulates the plain sizes of the merged tokens, whatever the mixing
        weights. Positions, frame, row and col stay those of the kept (anchor) token.

        `embeds`, when given, replaces the computed features (for methods whose update is not linear
        in the members); extras still use the linear map.
        """
        device = self.embeds.device
        keep = keep.to(device, torch.long)
        dst = dst.to(device, torch.long)
        src = src.to(device, torch.long)
        if keep_weight is None:
            keep_weight = torch.ones(len(keep), device=device)

        def mix(x: Tensor) -> Tensor:
            kw = keep_weight.to(device=x.device, dtype=x.dtype).view(-1, *([1] * (x.dim() - 1)))
            out = x[keep] * kw
            sw = src_weight.to(device=x.device, dtype=x.dtype).view(-1, *([1] * (x.dim() - 1)))
            return out.index_add(0, dst, x[src] * sw)

        new = self.select(keep, allow_repeats=allow_repeats)
        new.embeds = mix(self.embeds) if embeds is None else embeds
        new.extras = {name: mix(t) for name, t in self.extras.items()}
        new.weight = new.weight.index_add(0, dst, self.weight[src])
        return new

    def merge_dense(
        self,
        keep: Tensor,
        keep_weight: Tensor,
        src: Tensor,
        src_weight: Tensor | Sequence[Tensor],
        embeds: Tensor | None = None,
        allow_repeats: bool = False,
    ) -> "VideoTokens":
        """Like `merge`, with the merge as a dense matrix: new_j = keep_weight[j] * x[keep[j]] + sum_i
        src_weight[j, i] * x[src[i]] (src_weight [K, S]), computed in float32 and cast back (transport-plan
        merges such as AOT's). `embeds`, when given, replaces the computed features; `extras` always follow the
        map. Each source counts (`weight`) for the output it gives the most to.

        A block-diagonal map (frames or clips merged each on their own) may be given by its diagonal blocks: a
        list of [K_b, S_b] matrices, in order, for consecutive runs of `keep` and of `src` (sum K_b = K, sum S_b =
        S). The map is then applied block by block and never built whole (the same float32 arithmetic per
        block); a block without sources (S_b = 0) only scales its tokens by `keep_weight`, in their own dtype."""
        device = self.embeds.device
        keep = keep.to(device, torch.long)
        src = src.to(device, torch.long)
        keep_weight = keep_weight.to(device, torch.float32)
        if isinstance(src_weight, (list, tuple)):
            return self._merge_blocks(keep, keep_weight, src, list(src_weight), embeds, allow_repeats)
        src_weight = src_weight.to(device, torch.float32)
        if src_weight.shape != (keep.numel(), src.numel()):
            raise ValueError(
                f"merge_dense: src_weight must be [{keep.numel()}, {src.numel()}], got {tuple(src_weight.shape)}"
            )

        new = self.select(keep, allow_repeats=allow_repeats)
        new.embeds = dense_mix(self.embeds, keep, keep_weight, src, src_weight) if embeds is None else embeds
        new.extras = {name: dense_mix(t, keep, keep_weight, src, src_weight) for name, t in self.extras.items()}
        weight = new.weight.float()
        gives = src_weight.sum(dim=0) > 0  # sources that feed some output count for the one they feed most
        if bool(gives.any()):
            weight = weight.scatter_add(0, src_weight[:, gives].argmax(dim=0), self.weight[src[gives]].float())
        new.weight = weight.to(self.weight.dtype)
        return new

    def _merge_blocks(
        self,
        keep: Tensor,
        keep_weight: Tensor,
        src: Tensor,
        blocks: list[Tensor],
        embeds: Tensor | None,
        allow_repeats: bool,
    ) -> "VideoTokens":
        """`merge_dense` with the map given by its diagonal blocks (see there)."""
        blocks = [b.to(keep.device, torch.float32) for b in blocks]
        if any(b.dim() != 2 for b in blocks):
            raise ValueError("merge_dense: each diagonal block of src_weight must be a [K_b, S_b] matrix")
        rows, cols = [b.shape[0] for b in blocks], [b.shape[1] for b in blocks]
        if sum(rows) != keep.numel() or sum(cols) != src.numel():
            raise ValueError(
                f"merge_dense: the diagonal blocks of src_weight cover [{sum(rows)}, {sum(cols)}], but there are "
                f"{keep.numel()} kept tokens and {src.numel()} sources"
            )
        parts = list(zip(keep.split(rows), keep_weight.split(rows), src.split(cols), blocks))

        def mix(x: Tensor) -> Tensor:
            if not parts:
                return x[keep]
            out = []
            for k, kw, s, b in parts:
                if s.numel():
                    out.append(dense_mix(x, k, kw, s, b))
                else:  # nothing merges into these tokens: scaled, in x's dtype (exact for unit weights)
                    out.append(x[k] * kw.to(x.dtype).view(-1, *([1] * (x.dim() - 1))))
            return torch.cat(out)

        new = self.select(keep, allow_repeats=allow_repeats)
        new.embeds = mix(self.embeds) if embeds is None else embeds
        new.extras = {name: mix(t) for name, t in self.extras.items()}
        weight = new.weight.float()
        start = 0
        for (_, _, s, b), n in zip(parts, rows):
            if s.numel():
                gives = b.sum(dim=0) > 0  # as the dense form: each source counts for the output it feeds most
                if bool(gives.any()):
                    weight = weight.scatter_add(0, start + b[:, gives].argmax(dim=0), self.weight[s[gives]].float())
            start += n
        new.weight = weight.to(self.weight.dtype)
        return new

    def validate(self) -> None:
        """Raise if per-token fields disagree in length (a plugin bug, caught before it reaches the LLM)."""
        n = len(self)
        lengths = {name: t.shape[0] for name, t in self._per_token().items()}
        lengths["positions"] = self.positions.shape[-1]
        lengths.update({f"extras[{k}]": v.shape[0] for k, v in self.extras.items()})
        lengths.update({f"tags[{k}]": v.shape[0] for k, v in self.tags.items()})
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise RuntimeError(f"VideoTokens fields disagree with embeds ({n} tokens): {bad}")


@dataclasses.dataclass
class TokenLayout:
    """Per-slot bookkeeping of the sequence inside the LLM; every field is [B, n].

    index: position of the slot's token in the sequence that entered the LLM (gathers RoPE rows, and
           relates slots to the KV cache of earlier layers)
    valid: a real token (False for padding)
    visual: a compressible visual token; frame/patch/video are -1 elsewhere
    frame: frame (temporal index of the token grid); patch: spatial index within the frame (row * W + col)
    video: which video of the batch row the token belongs to (0, 1, ...)
    tags: connect plugins' labels (`VideoTokens.tags`), -1 elsewhere
    """

    index: Tensor
    valid: Tensor
    visual: Tensor
    frame: Tensor
    patch: Tensor
    video: Tensor
    tags: dict[str, Tensor] = dataclasses.field(default_factory=dict)

    def gather(self, idx: Tensor, valid: Tensor) -> TokenLayout:
        fields = {
            f.name: torch.gather(getattr(self, f.name), 1, idx) for f in dataclasses.fields(self) if f.name != "tags"
        }
        fields["valid"] = valid
        fields["visual"] = fields["visual"] & valid
        return TokenLayout(**fields, tags={name: torch.gather(t, 1, idx) for name, t in self.tags.items()})

    @property
    def num_visual(self) -> int:
        return int((self.visual & self.valid).sum())

    def video_slots(self, row: int) -> dict[int, Tensor]:
        """Slots of each video of batch row `row`: video index -> visual slot indices, ascending."""
        visual = self.visual[row] & self.valid[row]
        return {
            int(v): torch.nonzero(visual & (self.video[row] == v)).flatten()
            for v in torch.unique(self.video[row][visual]).tolist()
        }


@dataclasses.dataclass(frozen=True)
class Context:
    """What a hook knows besides the tokens, for one video: read-only (the pipeline hands each hook its own).

    question: the text the user asked about this video (the prompt text after the video); the `sample` stage
        gets it from the caller, later stages from the prompt tokens (`question_ids`, and lazily
        `question_embeds`, the LLM's own input embeddings of them).
    family / geometry: the model family, and how its vision tower lands on the token grid (`FamilyGeometry`).
    video_index: position of this video among the videos of the current forward (0 = the first); of this image
        among the images, when `media` is "image".
    media: "video", or "image": a one-frame item (grid (1, H, W)); only methods that act on images
        (`MethodCard.acts_on_images`: no `temporal` flag) get images.
    generator: seeded afresh for every video (`vtc.patch(..., seed=0)`): same video, same random choices.
    vision: the vision-tower statistics the method declared (`vision_stats`), one tensor per frame of this video.
    prepool / pool / project: the frame features before the LLaVA pooling ([F, h, w, D]), the model's pooling
        (plus the projector on LLaVA-NeXT-Video) and the projector still to apply to them (methods with
        `prepool`; None on Qwen families, whose 2x2 merge is inside the vision tower).
    num_frames / processor: the sample stage's frame request (None: the method's default) and the processor.
    state: the method's own state for the current prompt, handed to it by the pipeline: a dict that is fresh
        for every prompt and shared by all of the method's hooks of that prompt (every video's connect call,
        every prefill and decode call); in a `vtc.stream` session it lives as long as the stream.
    prepared: what the method's own sample hook left in `ctx.state` for this video in `handle.prepare`.
    report(**values): show a decision in `handle.stats().reports[method][name]` (appended, one entry per call).
    extra: free-form, for third-party methods (vtc itself puts nothing there).
    """

    retention: float | None = None
    family: str | None = None
    geometry: FamilyGeometry | None = None
    video_index: int = 0
    media: str = "video"
    question: str | None = None
    question_ids: Tensor | None = None
    embed_fn: Callable[[Tensor], Tensor] | None = None
    generator: torch.Generator | None = None
    model: Any = None
    vision: dict[VisionStat, Tensor] = dataclasses.field(default_factory=dict)
    prepool: Tensor | None = None
    pool: Callable[[Tensor], Tensor] | None = None
    project: Callable[[Tensor], Tensor] | None = None
    prepared: dict[str, Any] = dataclasses.field(default_factory=dict)
    num_frames: int | None = None
    processor: Any = None
    state: dict[str, Any] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    reports: dict[str, list[Any]] = dataclasses.field(default_factory=dict, repr=False)
    _cache: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def replace(self, **changes: Any) -> Context:
        """A copy with some fields changed (what the backends do per video, and the pipeline per method)."""
        return dataclasses.replace(self, **changes)

    @property
    def question_embeds(self) -> Tensor | None:
        """Token embeddings of the question (the LLM's own input embeddings), computed on first use."""
        if "question_embeds" not in self._cache and self.question_ids is not None and self.embed_fn is not None:
            with torch.no_grad():
                self._cache["question_embeds"] = self.embed_fn(self.question_ids)
        return self._cache.get("question_embeds")

    def report(self, **values: Any) -> None:
        """Record decisions for `handle.stats().reports` (e.g. `ctx.report(kept=n, budgets=[...])`): each call
        appends its values under this method's name. Connect hooks report once per video, in video order."""
        for name, value in values.items():
            self.reports.setdefault(name, []).append(value)


def prepool_blocks(tokens: VideoTokens, ctx: Context) -> Tensor | None:
    """Per token, its s x s block of tower features before a pooler that precedes the projector (LLaVA-NeXT-Video's
    CLIP features, [N, s, s, D_vision]), when the tokens are the untouched pooled grid; else None (merge the LLM
    tokens instead)."""
    geometry, prepool = ctx.geometry, ctx.prepool
    if geometry is None or not geometry.pool_before_projector or prepool is None or ctx.pool is None:
        return None
    t, h, w = tokens.grid
    if len(tokens) != t * h * w or bool((tokens.weight != 1).any()):
        return None
    frames, side, _, dim = prepool.shape
    s = side // h
    if frames != t or side != s * h or prepool.shape[2] != s * w:
        return None
    blocks = prepool.reshape(t, h, s, w, s, dim).permute(0, 1, 3, 2, 4, 5).reshape(t * h * w, s, s, dim)
    return blocks.to(tokens.embeds.device)[tokens.frame * h * w + tokens.patch]
