"""The state that flows between stages: `VideoTokens` (one video's visual tokens) and `Context`.

A `connect` plugin receives a `VideoTokens`, returns a `VideoTokens`, and never needs to know which model
produced it. Every per-token field is kept aligned by the two operations plugins use, `select` and
`merge`, so positions, frame/row/col and side features (e.g. Qwen3-VL DeepStack) always travel with the
token they belong to.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

Tensor = torch.Tensor


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

    def select(self, keep: Tensor) -> "VideoTokens":
        """Keep the tokens at indices `keep` (1-D long tensor), in that order."""
        keep = keep.to(self.embeds.device, torch.long)
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

        new = self.select(keep)
        new.embeds = mix(self.embeds) if embeds is None else embeds
        new.extras = {name: mix(t) for name, t in self.extras.items()}
        new.weight = new.weight.index_add(0, dst, self.weight[src])
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
    """What a stage knows besides the tokens: the question, the budget, the model.

    `question` is the text the user asked about this video (the prompt text after the video); the
    `sample` stage gets it from the caller, later stages from the prompt tokens. `question_ids` and the
    lazily computed `question_embeds` come from the prompt as the model tokenised it.
    `vision` holds the vision-tower attention statistics the plugin asked for (`vtc.hf.vision`), per frame;
    `prepool` / `pool` / `project` the pre-pooling frame features, the model's pooling and the projector still
    to apply to them (`vtc.hf.prepool`, LLaVA only). `extra["prepared"]` holds what the sample stage prepared
    for this prompt in `handle.prepare` (e.g. QuoTA's frame weights).
    """

    retention: float | None = None
    family: str | None = None
    video_index: int = 0  # position of this video among the videos of the current forward (0 = the first)
    question: str | None = None
    question_ids: Tensor | None = None
    embed_fn: Callable[[Tensor], Tensor] | None = None
    generator: torch.Generator | None = None
    model: Any = None
    vision: dict[Any, Tensor] = dataclasses.field(default_factory=dict)
    prepool: Tensor | None = None
    pool: Callable[[Tensor], Tensor] | None = None
    project: Callable[[Tensor], Tensor] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    _question_embeds: Tensor | None = None

    @property
    def question_embeds(self) -> Tensor | None:
        """Token embeddings of the question (the LLM's own input embeddings), computed on first use."""
        if self._question_embeds is None and self.question_ids is not None and self.embed_fn is not None:
            with torch.no_grad():
                self._question_embeds = self.embed_fn(self.question_ids)
        return self._question_embeds
