"""The method contract, stated once: `Method` is the base of every compression method, and its hooks'
docstrings are the hook documentation (as pluggy's hookspecs are for pytest).

A method is one dataclass: its fields are its parameters (official defaults, declared ranges and choices that
`check_params` validates), and it subclasses the base of what it does (`vtc.core.bases`: `TokenSelector`,
`TokenMerger`, `LayerPruner`, `FrameSampler`). `@vtc.method(name, paper=..., url=...)` gives it its card.

What vtc knows about a method is derived, never declared twice:
- a method acts in a stage when its class overrides that stage's hook (`sample`, `encode`, `connect`, `prefill`);
- it has a fixed count when it overrides `retained_count` (optional when it also has a `fixed_count` field);
- it reads vision-tower statistics when it overrides `vision_stats`, and keeps a stream's memory when it
  overrides `stream_memory`.
Behaviour flags a hook cannot show (`prepool`, `during_decode`, `whole_frames`, `streams`, `owns`, ...) are
class attributes, set by the bases where the base implies them.

A pipeline binds each method to its share of the retention (`bind`, a copy: the instance a user made is never
changed), then calls the hooks. Every hook gets `ctx`, a read-only `vtc.core.tokens.Context` of the video
being processed; `ctx.state` is the method's own per-prompt state (a dict the pipeline hands it: fresh for
every prompt, shared by all its hooks of that prompt), `ctx.report(name=value)` shows a decision in
`handle.stats().reports`.

Order: a pipeline sorts its methods once, by the earliest stage each acts in (sample < encode < connect <
prefill), then by their place in the spec; every stage calls its methods in that order. So in
`"vidcom2+divprune"` VidCom² runs first, and in `"fastvid+quota"` QuoTA's connect hook runs before FastVID's,
because QuoTA already acts at the sample stage.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re
import types
import typing
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import torch

if TYPE_CHECKING:  # pragma: no cover
    from vtc.core.patches import VideoPatches
    from vtc.core.tokens import Context, TokenLayout, VideoTokens
    from vtc.core.tower import TowerTokens
    from vtc.core.vision_stats import VisionStat

Tensor = torch.Tensor
Grid = tuple[int, int, int]

STAGES = ("sample", "encode", "connect", "prefill")
# the hooks of each stage: a method acts in a stage when its class overrides one of them
STAGE_HOOKS = {
    "sample": ("sample",),
    "encode": ("encode", "encode_block"),
    "connect": ("connect",),
    "prefill": ("prefill",),
}

# which visual-token count `retention` sets, for methods that act inside the LLM
RETENTION_REFERENCES = {
    "llm_input": "the visual tokens entering the LLM",
    "last_layer": "the visual tokens alive at the last LLM layer",
    "layer_mean": "the mean number of visual tokens over the LLM layers (a FLOPs budget)",
}

# the checks of the conformance matrix (`vtc.testing.conformance`) a method may be exempt from
CONFORMANCE_CHECKS = (
    "identity_at_full_retention",  # retention 1.0 gives the unpatched model's logits
    "retention",  # at retention r the declared count is r of the visual tokens (within granularity)
    "retention_fixed",  # the same in fixed-count mode (methods with a `fixed_count` switch)
    "planned_count",  # the count matches retained_count (fixed) or what the method reported (adaptive)
    "fixed_count",  # fixed-count mode honours retained_count exactly, before the model exists
    "original_positions",  # survivors carry their original RoPE rows
    "ordered_positions",  # ... in increasing original order
    "generate",  # generate runs and decodes
    "unpatch",  # unpatch restores the model exactly
    "padded_batch",  # a left-padded batch equals its prompts run one by one
    "decode_continues",  # decoding with the cache equals re-running the whole sequence
    "bf16",  # runs in bfloat16
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
DType = Literal["float32", "float16", "bfloat16", "float64"]  # a parameter naming a torch dtype


def as_dtype(name: str | None, default: torch.dtype) -> torch.dtype:
    """The torch dtype a `DType` parameter names (`default` for None)."""
    return default if name is None else DTYPES[name]


# --- the hook arguments ---------------------------------------------------------------------------------------------


class Video(Protocol):
    """What a `sample` hook gets: a decoded-on-demand video (`vtc.media.video.VideoSource`)."""

    num_frames: int
    fps: float

    @property
    def duration(self) -> float: ...

    def read(self, indices: list[int]) -> Any: ...


class LLMState(Protocol):
    """What a `prefill` hook sees at each call (the HF backend's `vtc.hf.llm.runtime.LLMState`).

    Where: `layer`, `point` ("layer_start" before a decoder layer, "after_attention" on the residual stream
    after attention, before the MLP), `phase` ("prefill" or "decode"), `num_layers`, `family`.
    What: `hidden` [B, n, D], `layout` (`TokenLayout` of the prompt now), `prefill_layout(layer)` (what that
    layer cached), `grids`, `visual_tokens_in`.
    Attention: `request_attention(num_rows | "after_visual", upcast)` at a layer start, then `attention(layer)`
    [B, heads, rows, keys] and `attention_rows_valid(layer)`; `attention_at_start(num_rows, upcast)` computes this
    layer's rows at its start, before it runs (to drop tokens before the layer that ranks them);
    `projections(rows)` gives this layer's query rows and keys before RoPE; `attend_bidirectionally()` makes this
    layer's prompt attention non-causal.
    Changes: `keep(mask, prune_cache=False)`, `merge_mean(batch, dst, src)`, `replace_hidden(hidden)` during
    prefill; `mask_keys(visible)` during decode.
    """

    layer: int
    point: str
    phase: str
    num_layers: int
    family: str
    hidden: Tensor
    layout: TokenLayout

    def prefill_layout(self, layer: int) -> TokenLayout: ...

    def request_attention(self, num_rows: int | str = 1, upcast: bool = True) -> None: ...

    def attention(self, layer: int | None = None) -> Tensor: ...

    def attention_rows_valid(self, layer: int | None = None) -> Tensor: ...

    def attention_at_start(self, num_rows: int | str = 1, upcast: bool = True) -> Tensor: ...

    def projections(self, rows: Tensor) -> tuple[Tensor, Tensor]: ...

    def attend_bidirectionally(self) -> None: ...

    def keep(self, mask: Tensor, prune_cache: bool = False) -> None: ...

    def merge_mean(self, batch: Tensor, dst: Tensor, src: Tensor) -> None: ...

    def replace_hidden(self, hidden: Tensor) -> None: ...

    def mask_keys(self, visible: Tensor) -> None: ...


# --- the base -------------------------------------------------------------------------------------------------------


class Method:
    """Base of every method; subclasses are dataclasses whose fields are the method's parameters.

    Override the hooks of the stages the method acts in; every hook is optional. Class attributes declare what
    a hook cannot show (the bases set those they imply).
    """

    card: ClassVar[MethodCard]  # set by @vtc.method
    testing: ClassVar[TestHints]  # set by @vtc.method

    # what the method does, beyond its hooks
    reduces_tokens: ClassVar[bool] = True  # removes or merges visual tokens (a frame sampler does not)
    query_aware: ClassVar[bool] = False  # decisions depend on the question or the prompt's last tokens
    owns: ClassVar[frozenset[str]] = frozenset()  # decisions only one method of a pipeline may take
    positions: ClassVar[str] = "keep"  # 1-D RoPE families: "keep" original positions or "compact" them
    retention_reference: ClassVar[str] = "llm_input"  # which count `retention` sets (RETENTION_REFERENCES)
    prepool: ClassVar[bool] = False  # connect reads the frame features before the LLaVA pooling (`ctx.prepool`)
    during_decode: ClassVar[bool] = False  # `prefill` is also called on decode steps (`llm.phase == "decode"`)
    whole_frames: ClassVar[bool] = False  # connect needs every token of every frame: no connect method before it
    temporal: ClassVar[bool] = False  # needs time (several frames of one video): acts on videos only, never on images
    reads_lm_head: ClassVar[bool] = False  # connect calls the LLM's LM head (`ctx.model.get_output_embeddings()`)
    streams: ClassVar[bool] = False  # connect is causal: `vtc.stream` may feed it consecutive chunks of a video
    stream_only: ClassVar[bool] = False  # the method exists only as a stream memory; `vtc.patch` refuses it
    requires: ClassVar[frozenset[str]] = frozenset()  # family features it needs (`vtc.core.families`)

    # set by the pipeline on its bound copy (never a parameter): this method's share of the pipeline's retention
    retention: float | None = None

    def __post_init__(self) -> None:
        check_params(self)

    def validate(self) -> None:
        """Checks across parameters (raise a ValueError naming them); per-parameter types, ranges and choices
        are checked before, from the annotations and `param(range=..., choices=...)`."""

    def bind(self, retention: float | None) -> Method:
        """A copy of this method for one pipeline, holding `retention` (its share of the pipeline's)."""
        bound = copy.copy(self)
        bound.retention = retention
        return bound

    def __add__(self, other: Method | list) -> list:
        """`DivPrune(ratio=0.1) + FastV(k=3)`: a spec of two instances, for `vtc.patch(model, spec)`."""
        return [self, *(other if isinstance(other, list) else [other])]

    def __radd__(self, other: list) -> list:
        return [*other, self]

    def reduces_llm_tokens(self, family: str | None) -> bool:
        """Does the method change how many visual tokens the LLM sees on `family` (None: on some family)? Only those
        share the retention. Default: the class's `reduces_tokens`; a method whose effect depends on the family's
        tower says so (ToMe unmerges before LLaVA's pooling: tower compute only there)."""
        return type(self).reduces_tokens

    def llm_tokens_note(self, family: str) -> str:
        """Why the method leaves the LLM's token count alone on `family` (for the error when nothing else reduces
        it); empty when it reduces it, or is not a reducing method."""
        return ""

    # --- the hooks --------------------------------------------------------------------------------------------
    def sample(self, video: Video, ctx: Context) -> list[int]:
        """Choose which frames of a video the processor sees. Runs before the processor, in `handle.prepare`,
        `vtc.prepare_inputs` and `vtc run`.

        video: `vtc.media.video.VideoSource` (metadata + lazy frame access); ctx: `question`, `family`,
        `num_frames` (the caller's request, or None), `model` and `processor`.
        Return: a sorted, non-empty list of frame indices into the decoded video. One method of a pipeline may
        own frame selection (`FrameSampler`); with none, the pipeline samples uniformly. What the hook leaves in
        `ctx.state` reaches the later stages of this prompt as `ctx.prepared`.
        """
        raise NotImplementedError

    def encode(self, patches: VideoPatches, ctx: Context) -> VideoPatches:
        """Act before the vision tower: keep a subset of one video's merge units (`patches.select`); the tower
        runs on the survivors alone, and each reaches the LLM as the token of its original (t, h, w) cell.

        patches: `vtc.core.patches.VideoPatches` (what earlier encode methods left; `values()` de-normalises the
        pixels); ctx: family, geometry, retention, a seeded `generator`, `state`, `report` (not the question: the
        tower runs before vtc reads the prompt). Return `patches` itself to keep everything.
        vtc checks the result: at least one unit, and exactly `retained_count(...)` units when the method promises
        a count. Runs on the families offering `encode_units` (the Qwen towers).
        """
        return patches

    def encode_block(self, tokens: TowerTokens, ctx: Context) -> TowerTokens:
        """Act inside the vision tower, between its blocks: called for one video at `tokens.point ==
        "after_attention"` (the block's attention added to the residual, its MLP not run yet: where ToMe merges) and
        "after_block" of every block `tokens.layer`.

        tokens: `vtc.core.tower.TowerTokens` (hidden states, cells, frames, sizes; the block's attention keys when
        the method `needs_keys`); ctx as for `encode`. Return `tokens` itself to change nothing, or
        `tokens.merge(...)` (keep, fold and drop whole tokens). What reaches the LLM depends on the family: on the
        Qwen towers every surviving token is one LLM token at its original (t, h, w); on LLaVA's SigLIP / CLIP the
        tokens are unmerged onto the frame grid before the pooling (`tower_families` of the method's base).
        """
        return tokens

    def connect(self, tokens: VideoTokens, ctx: Context) -> VideoTokens:
        """Prune or merge the visual tokens of one video after the projector, before the LLM sees them.

        tokens: `VideoTokens` (what earlier connect methods left; `tokens.grid` is still the original grid);
        ctx: question, geometry, vision statistics, pre-pool features, `state`, `report`.
        Return: `tokens` itself to keep everything, or a new `VideoTokens` from `tokens.select`, `tokens.merge` or
        `tokens.merge_dense` (so every per-token field follows). vtc checks the result: at least one token, no
        index twice, and exactly `retained_count(...)` tokens whenever the method promises a count.
        """
        return tokens

    def prefill(self, llm: LLMState, ctx: Context) -> None:
        """Act inside the LLM: called at `llm.point == "layer_start"` (before a decoder layer) and
        "after_attention" (on the residual stream after attention, before the MLP) of every layer during
        prefill; during decoding only for methods with `during_decode`.

        Change the sequence through `llm.keep(...)` / `llm.merge_mean(...)` / `llm.replace_hidden(...)`.
        """

    def retained_count(self, num_tokens: int, grid: Grid, family: str) -> int | None:
        """Tokens kept for a video that reaches this method with `num_tokens` tokens (what earlier methods left)
        on the original token grid `grid` = (T, H, W) of a model of `family`; None when it depends on the
        content. A pure function of its arguments and the parameters: serving engines call it before any model
        runs. For a method acting in the LLM it is the count at the last layer. vtc checks the promise on every
        forward. Overriding it is what gives a method a fixed count."""
        return None

    def vision_stats(self, family: str) -> list[VisionStat]:
        """The vision-tower statistics the connect hook reads from `ctx.vision`."""
        return []

    def stream_memory(self, config: Any) -> Any:
        """The memory a `vtc.stream` session keeps (`vtc.core.stream.StreamMemory`); `config` is the
        session's `StreamConfig` (budget, family, model)."""
        raise NotImplementedError


def _overrides(cls: type, name: str) -> bool:
    return getattr(cls, name) is not getattr(Method, name)


# --- parameters -----------------------------------------------------------------------------------------------------

_RANGE = re.compile(r"^\s*([\[(])\s*([^,]*)\s*,\s*([^\])]*)\s*([\])])\s*$")


def param(
    default: Any = dataclasses.MISSING,
    *,
    range: str | None = None,
    choices: tuple | None = None,
    doc: str = "",
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A method parameter: its default, and a range such as "(0, 1]" or "[1, inf)" (bounds included with
    brackets) or a tuple of `choices` that `check_params` enforces, with `doc` for the docs and the CLI."""
    if range is not None:
        _parse_range(range)
    metadata = {"range": range, "choices": tuple(choices) if choices is not None else None, "doc": doc}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _parse_range(text: str) -> tuple[bool, float, float, bool]:
    match = _RANGE.match(text)
    if not match:
        raise ValueError(f"a parameter range reads like '(0, 1]' or '[1, inf)', got {text!r}")
    lo_closed, lo, hi, hi_closed = match.groups()
    return (
        lo_closed == "[",
        float(lo) if lo.strip() else -math.inf,
        float(hi) if hi.strip() else math.inf,
        hi_closed == "]",
    )


def _in_range(value: float, text: str) -> bool:
    lo_closed, lo, hi, hi_closed = _parse_range(text)
    return (value >= lo if lo_closed else value > lo) and (value <= hi if hi_closed else value < hi)


def _type_ok(value: Any, annotation: Any) -> bool:
    """Is `value` of the annotated type? Only plain types are checked (bool, int, float, str, Literal, tuples,
    unions of them, None); anything else is the method's own business."""
    origin = typing.get_origin(annotation)
    if annotation is Any or annotation is dataclasses.MISSING:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is Literal:
        return value in typing.get_args(annotation)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (tuple, list):
        return isinstance(value, (tuple, list))
    return True


def _describe_type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe_type(a) for a in typing.get_args(annotation))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


@functools.lru_cache(maxsize=512)
def _field_types(cls: type) -> dict[str, Any]:
    """The resolved annotations of a method class, once per class (resolving them is most of the cost of making
    an instance, and FrameFusion makes its prune step per layer)."""
    return typing.get_type_hints(cls)


def check_params(method: Method) -> None:
    """Validate every parameter against its annotation, range and choices; a ValueError names the method, the
    parameter, the value and what is allowed. Integers are accepted for float parameters (and stored as floats)."""
    cls = type(method)
    name = cls.card.name if "card" in cls.__dict__ else cls.__name__
    hints = _field_types(cls)
    for field in dataclasses.fields(method):
        value = getattr(method, field.name)
        annotation = hints.get(field.name, Any)
        if not _type_ok(value, annotation):
            raise ValueError(f"{name}: {field.name} must be {_describe_type(annotation)}, got {value!r}")
        if isinstance(value, int) and not isinstance(value, bool) and _accepts_float_only(annotation):
            object.__setattr__(method, field.name, float(value))
            value = float(value)
        choices, range_ = field.metadata.get("choices"), field.metadata.get("range")
        if value is None:
            continue
        if choices is not None and value not in choices:
            raise ValueError(f"{name}: {field.name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
        if range_ is not None and isinstance(value, (int, float)) and not _in_range(float(value), range_):
            raise ValueError(f"{name}: {field.name} must be in {range_}, got {value!r}")
    method.validate()


def _accepts_float_only(annotation: Any) -> bool:
    args = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    return float in args and int not in args


# --- the card -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MethodCard:
    """What a user reads about a method (`vtc methods`), and what vtc derived from its class."""

    name: str
    paper: str
    url: str = ""
    summary: str = ""
    retention_note: str = ""  # where the method cannot honour `retention` exactly, and what it does instead
    retention_granularity: int = 1  # the count moves in steps of this many tokens per frame
    cls: type | None = dataclasses.field(default=None, compare=False, repr=False)

    # --- derived from the class ------------------------------------------------------------------------------
    @property
    def stages(self) -> tuple[str, ...]:
        return tuple(s for s in STAGES if any(_overrides(self.cls, hook) for hook in STAGE_HOOKS[s]))

    @property
    def acts_before_tower(self) -> bool:
        """The method keeps a subset of the patches before the vision tower's first block (`encode`)."""
        return _overrides(self.cls, "encode")

    @property
    def acts_in_tower(self) -> bool:
        """The method merges or drops tokens between the vision tower's blocks (`encode_block`)."""
        return _overrides(self.cls, "encode_block")

    @property
    def acts_in_llm(self) -> bool:
        return "prefill" in self.stages

    @property
    def acts_on_images(self) -> bool:
        """Images reach the method: it does not need time (`temporal`) and is not a frame sampler (an image has no
        frames to draw). Encode methods act in the tower's image call as in its video call, on the families where
        they reduce the LLM's tokens (`Pipeline.for_images`)."""
        stages = self.stages
        return not self.cls.temporal and "sample" not in stages and bool(stages)

    @property
    def fixed_count(self) -> bool:
        return _overrides(self.cls, "retained_count")

    @property
    def fixed_count_mode(self) -> str:
        """ "always" (every run keeps `retained_count`), "optional" (with `fixed_count=True`) or "no"."""
        if not self.fixed_count:
            return "no"
        return "optional" if "fixed_count" in {f.name for f in dataclasses.fields(self.cls)} else "always"

    @property
    def vision_stats(self) -> bool:
        return _overrides(self.cls, "vision_stats")

    @property
    def stream_memory(self) -> bool:
        return _overrides(self.cls, "stream_memory")

    def __getattr__(self, name: str) -> Any:
        # the behaviour flags live on the class (reduces_tokens, owns, prepool, ...)
        if name.startswith("_") or self.cls is None or not hasattr(Method, name):
            raise AttributeError(name)
        return getattr(self.cls, name)

    @property
    def families(self) -> tuple[str, ...]:
        """The registered families that offer every feature the method `requires` and every vision-tower
        statistic its connect hook reads (with its default parameters)."""
        from vtc.core.families import family_names, get_family

        def runs_on(family) -> bool:
            if family.missing(self.cls.requires):
                return False
            if not self.vision_stats:
                return True
            try:
                family.check_vision_stats(self.name, self.cls().vision_stats(family.name))
            except ValueError:
                return False
            return True

        return tuple(f for f in family_names() if runs_on(get_family(f)))

    def parameters(self) -> dict[str, Any]:
        return {f.name: _default(f) for f in dataclasses.fields(self.cls)}

    def capabilities(self) -> dict[str, Any]:
        """What `vtc methods --json` prints for this method."""
        cls = self.cls
        return {
            "name": self.name,
            "stages": list(self.stages),
            "paper": self.paper,
            "url": self.url,
            "summary": self.summary,
            "families": list(self.families),
            "reduces_tokens": cls.reduces_tokens,
            "fixed_count": self.fixed_count_mode,
            "fixed_count_counts": ("last_layer" if self.acts_in_llm else "llm_input") if self.fixed_count else None,
            "query_aware": cls.query_aware,
            "position_policy": cls.positions,
            "owns": sorted(cls.owns),
            "acts_in_llm": self.acts_in_llm,
            "acts_during_decode": cls.during_decode,
            "needs_whole_frames": cls.whole_frames,
            "temporal": cls.temporal,
            "images": self.acts_on_images,
            "streams": cls.streams or self.stream_memory,
            "stream_memory": self.stream_memory,
            "stream_only": cls.stream_only,
            "vision_stats": self.vision_stats,
            "prepool": cls.prepool,
            "requires": sorted(cls.requires),
            "retention_reference": cls.retention_reference,
            "retention_note": self.retention_note,
            "retention_granularity": self.retention_granularity,
            "conformance_exemptions": dict(cls.testing.exemptions),
            "parameters": self.parameters(),
        }


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return None
    return list(value) if isinstance(value, tuple) else value


@dataclasses.dataclass(frozen=True)
class TestHints:
    """Test-only data, kept apart from the card: parameters that fit the tiny offline models (4 LLM layers,
    2-layer vision towers) and conformance checks (`CONFORMANCE_CHECKS`) that do not apply, with the reason."""

    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    exemptions: dict[str, str] = dataclasses.field(default_factory=dict)

    __test__ = False  # not a pytest test class


def method(
    name: str,
    *,
    paper: str,
    url: str = "",
    summary: str = "",
    retention_note: str = "",
    retention_granularity: int = 1,
    test_params: dict[str, Any] | None = None,
    exempt: dict[str, str] | None = None,
):
    """Class decorator: make a `Method` subclass a method named `name` (a dataclass if it is not one yet).

    paper / url / summary / retention_note / retention_granularity: its card (`vtc methods`).
    test_params / exempt: test-only hints (`TestHints`) for the conformance matrix.
    """

    def decorate(cls: type) -> type:
        def bad(message: str):
            raise TypeError(f"method {name!r} ({cls.__qualname__}): {message}")

        if not (isinstance(cls, type) and issubclass(cls, Method)):
            bad("a method class subclasses vtc.Method or one of its bases (vtc.TokenSelector, ...)")
        if "__dataclass_fields__" not in cls.__dict__:
            cls = dataclasses.dataclass(cls)
        if not re.fullmatch(r"[a-z][a-z0-9_-]*", name):
            bad("a method name is lower-case letters, digits, '-' and '_', starting with a letter")
        card = MethodCard(name, paper, url, summary, retention_note, retention_granularity, cls)
        hints = TestHints(dict(test_params or {}), dict(exempt or {}))
        unknown = sorted(set(hints.exemptions) - set(CONFORMANCE_CHECKS))
        if unknown:
            bad(f"unknown conformance check(s) {unknown}; checks are {', '.join(CONFORMANCE_CHECKS)}")
        cls.card, cls.testing = card, hints
        _check_class(cls, card, bad)
        return cls

    return decorate


def _check_class(cls: type, card: MethodCard, bad) -> None:
    """What a class declares must fit what it overrides."""
    stages = card.stages
    if not stages:
        bad(f"it overrides no stage hook; a method overrides at least one of {', '.join(STAGES)}")
    if cls.positions not in ("keep", "compact"):
        bad("positions must be 'keep' or 'compact'")
    if cls.retention_reference not in RETENTION_REFERENCES:
        bad(f"retention_reference must be one of {', '.join(RETENTION_REFERENCES)}")
    if cls.retention_reference != "llm_input" and "prefill" not in stages:
        bad("only methods acting in the LLM (a prefill hook) count retention past the LLM input")
    for flag in ("prepool", "whole_frames", "streams", "reads_lm_head"):
        if getattr(cls, flag) and "connect" not in stages:
            bad(f"{flag} describes a connect hook, but the class has none")
    if card.vision_stats and "connect" not in stages:
        bad("vision_stats feed a connect hook, but the class has none")
    if cls.during_decode and "prefill" not in stages:
        bad("during_decode needs a prefill hook")
    if cls.stream_only and not card.stream_memory:
        bad("stream_only methods are streaming memories: override stream_memory()")
