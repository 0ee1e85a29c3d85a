"""The state that flows between stages: `VideoTokens` (one video's visual tokens) and `Context`.

A `connect` plugin receives a `VideoTokens`, returns a `VideoTokens`, and never needs to know which model
produced it. Every per-token field is kept aligned by the operations plugins use (`select`, `merge`,
`merge_dense`), so positions, frame/row/col and side features (e.g. Qwen3-VL DeepStack) always travel with the
token they belong to. Views (`frame_groups`, `grid_index`) give the frame structure without re-deriving it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

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
        src_weight: Tensor,
        embeds: Tensor | None = None,
        allow_repeats: bool = False,
    ) -> "VideoTokens":
        """Like `merge`, with the merge as a dense matrix: new_j = keep_weight[j] * x[keep[j]] + sum_i
        src_weight[j, i] * x[src[i]] (src_weight [K, S]), computed in float32 and cast back (transport-plan
        merges such as AOT's). `embeds`, when given, replaces the computed features; `extras` always follow the
        map. Each source counts (`weight`) for the output it gives the most to."""
        device = self.embeds.device
        keep = keep.to(device, torch.long)
        src = src.to(device, torch.long)
        keep_weight = keep_weight.to(device, torch.float32)
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
class Context:
    """What a stage knows besides the tokens: the question, the budget, the model's geometry, the plugin's state.

    question: the text the user asked about this video (the prompt text after the video); the `sample` stage
        gets it from the caller, later stages from the prompt tokens (`question_ids`, and lazily
        `question_embeds`, the LLM's own input embeddings of them).
    family / geometry: the model family, and how its vision tower lands on the token grid (`FamilyGeometry`).
    video_index: position of this video among the videos of the current forward (0 = the first).
    generator: seeded afresh for every video (`vtc.patch(..., seed=0)`): same video, same random choices.
    vision: the vision-tower statistics the plugin declared (`vision_stats`), one tensor per frame of this video.
    prepool / pool / project: the frame features before the LLaVA pooling ([F, h, w, D]), the model's pooling
        (plus the projector on LLaVA-NeXT-Video) and the projector still to apply to them (plugins declaring
        `prepool`; None on Qwen families, whose 2x2 merge is inside the vision tower).
    prepared: what the sample stage prepared for this prompt in `handle.prepare`, by method name.
    num_frames / processor: the sample stage's frame request (None: the method's default) and the processor.
    store: this plugin's own state for the current prompt: a dict that is fresh for every prompt and shared by
        all of the plugin's hooks of that prompt (every video's connect call, every prefill and decode call).
    report(**values): show a decision in `handle.stats().reports[method][name]` (appended, one entry per call);
        `reports` holds what the current hook call reported.
    extra: free-form, for third-party plugins (vtc itself puts nothing there).
    """

    retention: float | None = None
    family: str | None = None
    geometry: FamilyGeometry | None = None
    video_index: int = 0
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
    store: dict[str, Any] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    reports: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    _question_embeds: Tensor | None = dataclasses.field(default=None, repr=False)

    @property
    def question_embeds(self) -> Tensor | None:
        """Token embeddings of the question (the LLM's own input embeddings), computed on first use."""
        if self._question_embeds is None and self.question_ids is not None and self.embed_fn is not None:
            with torch.no_grad():
                self._question_embeds = self.embed_fn(self.question_ids)
        return self._question_embeds

    def report(self, **values: Any) -> None:
        """Record decisions for `handle.stats().reports` (e.g. `ctx.report(kept=n, budgets=[...])`): each call
        appends its values under this method's name. Connect hooks report once per video, in video order."""
        for name, value in values.items():
            self.reports.setdefault(name, []).append(value)
