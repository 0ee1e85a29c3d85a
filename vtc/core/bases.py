"""Bases for what methods do. Each does the wiring of one kind of method, so the method writes one method.

- `TokenSelector` (connect): keep `retained_count` of a video's tokens, the ones `choose` picks, in order.
- `TokenMerger` (connect): change tokens only through a merge plan (`Merge` / `DenseMerge`).
- `LayerPruner` (prefill): FastV's "attention at K-1, keep at K" (FastV, PruneVid's stage 2, HoliTom's inner
  pruning and FrameFusion's prune step are all this).
- `FrameSampler` (sample): choose the frames the processor sees; reduces no token.
- `PatchSelector` (encode): keep a subset of each video's merge units before the vision tower runs.
- `TowerMerger` (encode): merge or drop tokens between the vision tower's blocks.
- `StreamMemoryMethod`: decides what a `vtc.stream` session remembers (`stream_memory(config)`).

A method that does several things (HoliTom, PruneVid, QuoTA) composes them: it holds the part it shares with
another method as a field or builds it from its parameters, and calls its hook, instead of re-implementing it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vtc.core.method import Grid, LLMState, Method

if TYPE_CHECKING:  # pragma: no cover
    from vtc.core.patches import VideoPatches
    from vtc.core.tokens import Context, VideoTokens
    from vtc.core.tower import TowerTokens

Tensor = torch.Tensor


def fraction_count(num_tokens: int, fraction: float) -> int:
    """`round(fraction * n)` (Python rounds half to even), at least 1 and at most n; 0 for no tokens."""
    if num_tokens == 0:
        return 0
    return max(1, min(num_tokens, round(fraction * num_tokens)))


def retention_fraction(method: Method, default: float) -> float:
    """The fraction a selector keeps: its `ratio` field when set, else its share of the retention, else `default`."""
    ratio = getattr(method, "ratio", None)
    if ratio is not None:
        return float(ratio)
    return method.retention if method.retention is not None else default


class TokenSelector(Method):
    """Connect stage: keep a subset of each video's tokens.

    The count is `retained_count` (default: `round(fraction * n)`, at least one, where `fraction` is the
    method's `ratio` field when set, else its share of the retention, else `default_fraction`). With the whole
    video kept the tokens pass unchanged; otherwise `choose(tokens, count, ctx)` returns the kept indices, which
    the base sorts (`sort_kept`) and selects. A method whose count depends on the content returns None from
    `retained_count` and gets `count=None`.
    """

    default_fraction: ClassVar[float] = 0.5
    sort_kept: ClassVar[bool] = True  # survivors in their original order (False: the order `choose` gives)

    def fraction(self) -> float:
        return retention_fraction(self, self.default_fraction)

    def retained_count(self, num_tokens: int, grid: Grid, family: str) -> int | None:
        return fraction_count(num_tokens, self.fraction())

    def choose(self, tokens: VideoTokens, count: int | None, ctx: Context) -> Tensor:
        """The indices of the tokens to keep (`count` of them when it is not None)."""
        raise NotImplementedError

    def connect(self, tokens: VideoTokens, ctx: Context) -> VideoTokens:
        count = self.retained_count(len(tokens), tokens.grid, ctx.family)
        if count is not None and count >= len(tokens):
            return tokens
        keep = self.choose(tokens, count, ctx)
        return tokens.select(torch.sort(keep).values if self.sort_kept else keep)


@dataclasses.dataclass
class Merge:
    """A sparse merge plan (see `VideoTokens.merge`): kept anchors and source -> anchor edges with weights."""

    keep: Tensor
    dst: Tensor
    src: Tensor
    src_weight: Tensor
    keep_weight: Tensor | None = None
    embeds: Tensor | None = None
    allow_repeats: bool = False

    def apply(self, tokens: VideoTokens) -> VideoTokens:
        return tokens.merge(
            self.keep, self.dst, self.src, self.src_weight, self.keep_weight, self.embeds, self.allow_repeats
        )


@dataclasses.dataclass
class DenseMerge:
    """A dense merge plan (see `VideoTokens.merge_dense`): src_weight [K, S] (e.g. a transport plan), or its
    diagonal blocks in order (one per frame or clip)."""

    keep: Tensor
    keep_weight: Tensor
    src: Tensor
    src_weight: Tensor | list[Tensor]
    embeds: Tensor | None = None
    allow_repeats: bool = False

    def apply(self, tokens: VideoTokens) -> VideoTokens:
        return tokens.merge_dense(
            self.keep, self.keep_weight, self.src, self.src_weight, self.embeds, self.allow_repeats
        )


class TokenMerger(Method):
    """Connect stage: fold tokens into others. `plan(tokens, ctx)` returns a `Merge` or `DenseMerge` (or None to
    keep every token); the base applies it, so every per-token field follows the merge."""

    def plan(self, tokens: VideoTokens, ctx: Context) -> Merge | DenseMerge | None:
        raise NotImplementedError

    def connect(self, tokens: VideoTokens, ctx: Context) -> VideoTokens:
        plan = self.plan(tokens, ctx)
        return tokens if plan is None else plan.apply(tokens)


class LayerPruner(Method):
    """Prefill stage: the attention of LLM layer K-1 ranks the visual tokens, and from layer K on only those of
    `keep_mask` stay (FastV's schedule). The method gives `prune_layer()` (K) and `keep_mask(llm, ctx)`
    ([B, n] bool over the sequence at the keep point: True = keep); `skip()` turns it off (keep everything).

    keep_point: where the tokens go: "layer_start" of layer K, ranked by the attention of layer K-1 (FastV), or
    "after_attention" of layer K (on the residual stream before its MLP), ranked by layer K's own attention
    (FrameFusion's prune step). attention_rows: the query rows requested at the ranking layer (1: the last prompt
    token; "after_visual": the text after the video); upcast: compute them in float32, as
    `output_attentions=True` with eager attention does; prune_cache: also drop the pruned tokens from the KV
    cache of the layers before K.

    The schedule calls two steps, which a method overrides when it ranks or drops tokens another way:
    `request(llm, ctx)` at the start of the ranking layer (default: request `attention_rows`) and
    `prune(llm, ctx)` at the keep point (default: `llm.keep(keep_mask(...))`). `depth_error(num_layers)` is the
    message when the model has no layer K.
    """

    owns: ClassVar[frozenset[str]] = frozenset({"llm_token_schedule"})
    retention_reference: ClassVar[str] = "last_layer"
    query_aware: ClassVar[bool] = True
    keep_point: ClassVar[str] = "layer_start"
    attention_rows: ClassVar[int | str] = 1
    upcast: ClassVar[bool] = True
    prune_cache: ClassVar[bool] = False

    def prune_layer(self) -> int:
        raise NotImplementedError

    def keep_mask(self, llm: LLMState, ctx: Context) -> Tensor:
        raise NotImplementedError

    def skip(self) -> bool:
        return False

    def request(self, llm: LLMState, ctx: Context) -> None:
        """At the start of the ranking layer: ask for the attention rows that rank the tokens."""
        llm.request_attention(num_rows=self.attention_rows, upcast=self.upcast)

    def prune(self, llm: LLMState, ctx: Context) -> None:
        """At the keep point of layer K: keep what `keep_mask` keeps."""
        llm.keep(self.keep_mask(llm, ctx), prune_cache=self.prune_cache)

    def depth_error(self, num_layers: int) -> str:
        return (
            f"{self.card.name}: prune layer {self.prune_layer()} but the language model has only {num_layers} layers "
            f"(0 to {num_layers - 1}); choose an earlier layer"
        )

    def prefill(self, llm: LLMState, ctx: Context) -> None:
        if llm.point not in ("layer_start", self.keep_point) or self.skip():
            return
        k = self.prune_layer()
        if k >= llm.num_layers:
            raise ValueError(self.depth_error(llm.num_layers))
        ranking = k - 1 if self.keep_point == "layer_start" else k
        if llm.point == "layer_start" and llm.layer == ranking:
            self.request(llm, ctx)
        elif llm.point == self.keep_point and llm.layer == k:
            self.prune(llm, ctx)


def last_token_attention(llm: LLMState, layer: int) -> Tensor:
    """[B, n]: the head-mean attention the last prompt token paid at `layer` (what FastV ranks by)."""
    return llm.attention(layer).mean(dim=1)[:, -1]


@dataclasses.dataclass
class FrameChoice:
    """What a sampler chose, with the evidence: `sample` may return this instead of a bare index list, and
    `handle.stats().frames`, `vtc run` and the lmms-eval records show it.

    indices:    the frames the processor gets (sorted; repeats allowed where the official code keeps them)
    candidates: the frames the sampler scored (None: it scored none)
    scores:     one score per candidate (what ranked them, in the method's own units)
    sizes:      (height, width) per chosen frame, where the sampler resizes frames (None: the video's size)
    metadata:   what the processor is told about the frames instead of the truth (keys of transformers'
                `VideoMetadata`: `fps`, `frames_indices`, `total_num_frames`), where the official code tells the
                model something else (DIG: uniform 0.5 s spacing). None: the real indices and fps.
    """

    indices: list[int]
    candidates: list[int] | None = None
    scores: list[float] | None = None
    sizes: list[tuple[int, int]] | None = None
    metadata: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.indices = [int(i) for i in self.indices]
        if self.candidates is not None:
            self.candidates = [int(i) for i in self.candidates]
        if self.scores is not None:
            self.scores = [float(s) for s in self.scores]
            if self.candidates is None or len(self.scores) != len(self.candidates):
                raise ValueError("FrameChoice: give one score per candidate frame (candidates= and scores=)")
        if self.sizes is not None and len(self.sizes) != len(self.indices):
            raise ValueError(f"FrameChoice: {len(self.sizes)} sizes for {len(self.indices)} chosen frames")


class FrameSampler(Method):
    """Sample stage: `sample(video, ctx)` returns the frame indices the processor sees (a list, or a `FrameChoice`
    with the scores behind them). A pipeline has at most one (it owns frame selection); samplers take no share of
    the retention."""

    reduces_tokens: ClassVar[bool] = False
    owns: ClassVar[frozenset[str]] = frozenset({"frame_selection"})

    def host_model_use(self) -> str | None:
        """None when `sample` never calls the patched model (`ctx.model`); else how to make it not (which parameter
        names another model or fixes the answer). A vLLM server chooses frames in its prompt processor, which
        cannot call the model it serves, and refuses a sampler that would."""
        return None


class PatchSelector(Method):
    """Encode stage, before the vision tower's first block: keep a subset of each video's merge units
    (`vtc.core.patches.VideoPatches`); the tower then runs on the survivors alone and each one reaches the LLM as
    the token of its original (t, h, w) cell.

    The count is `retained_count` (default `round(fraction * n)` as `TokenSelector`'s); with every unit kept the
    patches pass unchanged, otherwise `choose(patches, count, ctx)` returns the kept indices (into the current
    survivors). A method whose count depends on the content returns None from `retained_count`. Runs on the
    families that offer `encode_units` (the Qwen towers, whose input is grouped in merge units)."""

    default_fraction: ClassVar[float] = 0.5
    requires: ClassVar[frozenset[str]] = frozenset({"encode_units"})

    def fraction(self) -> float:
        return retention_fraction(self, self.default_fraction)

    def retained_count(self, num_tokens: int, grid: Grid, family: str) -> int | None:
        return fraction_count(num_tokens, self.fraction())

    def choose(self, patches: VideoPatches, count: int | None, ctx: Context) -> Tensor:
        """The indices (into `patches`' survivors) of the units to keep (`count` of them when it is not None)."""
        raise NotImplementedError

    def encode(self, patches: VideoPatches, ctx: Context) -> VideoPatches:
        count = self.retained_count(len(patches), patches.grid, ctx.family)
        if count is not None and count >= len(patches):
            return patches
        return patches.select(self.choose(patches, count, ctx))


class TowerMerger(Method):
    """Encode stage, inside the vision tower: merge or drop one video's tokens between the tower's blocks
    (`encode_block`, called after every block's attention and after every block; `vtc.core.tower.TowerTokens`).

    The backend runs the tower block by block on the families offering `tower_blocks`. What the LLM then sees
    depends on the tower: on the Qwen towers a token is a merge unit, and every surviving token is one LLM token at
    its original (t, h, w) (`survivors_reach_llm`); SigLIP / CLIP (LLaVA) pool a square frame grid, so their tokens
    are unmerged onto it before the pooling (every cell gets the token that holds it, ToMe's source map), and only
    frames that lost all their tokens to another frame leave the LLM's input.

    needs_keys: the method reads the block's attention keys at "after_attention" (`tokens.keys`);
    `attention_layers(num_layers)`: the blocks at whose "after_attention" it reads the attention each token receives
    (`tokens.received`; computed from the block's queries and keys, frame by frame, only there).
    `proportional_attention()`: the tower's attention adds log(size) of every key to the logits (ToMe), so a merged
    token weighs as the tokens it stands for; the backend then computes the attention with that bias (SDPA) instead
    of the tower's own kernel. `changes_tower(grid)`: False when the method would leave every token of a video of
    this tower grid as it is (the backend then runs the tower untouched, bit for bit)."""

    requires: ClassVar[frozenset[str]] = frozenset({"tower_blocks"})
    needs_keys: ClassVar[bool] = False

    def proportional_attention(self) -> bool:
        return False

    def attention_layers(self, num_layers: int) -> frozenset[int]:
        return frozenset()

    def changes_tower(self, grid: Grid) -> bool:
        return True

    def encode_block(self, tokens: TowerTokens, ctx: Context) -> TowerTokens:
        raise NotImplementedError


def survivors_reach_llm(family: str) -> bool:
    """Does every token left at the end of this family's vision tower reach the LLM as one token (the Qwen merge
    units), rather than being unmerged onto a pooled frame grid (LLaVA's SigLIP / CLIP)?"""
    from vtc.core.families import get_family

    return "encode_units" in get_family(family).features


class StreamMemoryMethod(Method):
    """Decides what a `vtc.stream` session remembers: `stream_memory(config)` returns the memory
    (`vtc.core.stream.StreamMemory`) the session stores tokens in and answers from. One per pipeline."""

    owns: ClassVar[frozenset[str]] = frozenset({"stream_memory"})

    def stream_memory(self, config: Any) -> Any:
        raise NotImplementedError
