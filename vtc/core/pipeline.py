"""Spec parsing (`"framefusion+quota"`, or method instances), parameter routing, stage ordering, validation and
stage execution.

A `Pipeline` is backend-neutral: a backend (the HF patch, vLLM) binds it to a model family, then calls
`run_sample`, `run_connect` (the connect engine: methods in order, each output checked) and `run_prefill`.
Everything a pipeline can refuse it refuses when it is built, before any model runs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Any, Iterable

from vtc.core.families import family_names, get_family
from vtc.core.method import STAGES, Method, MethodCard
from vtc.core.patches import VideoPatches
from vtc.core.registry import Registry, registry
from vtc.core.stats import StatsRecorder
from vtc.core.tokens import Context, VideoTokens
from vtc.core.tower import TowerTokens

STAGE_ORDER = {stage: i for i, stage in enumerate(STAGES)}
Spec = str | Method | Iterable[str | Method]


def parse_spec(spec: str | Iterable[str]) -> list[str]:
    """`"a+b"` or `["a", "b"]` -> `["a", "b"]` (whitespace ignored, case-insensitive)."""
    names = spec.split("+") if isinstance(spec, str) else list(spec)
    names = [n.strip().lower() for n in names]
    if not names or any(not n for n in names):
        raise ValueError(f"invalid method spec {spec!r}: expected names joined by '+', e.g. 'uniform+fastv'")
    _refuse_repeats(names, spec)
    return names


def _refuse_repeats(names: list[str], spec: Any) -> None:
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"method(s) {', '.join(duplicates)} appear twice in spec {spec!r}")


def spec_methods(spec: Spec, methods: Registry) -> list[Method]:
    """The method instances a spec names: a string `"a+b"` (each method with its default parameters), one
    instance, or a list of names and instances (`[DivPrune(ratio=0.1), "fastv"]`, `DivPrune() + FastV()`)."""
    items = [spec] if isinstance(spec, (str, Method)) else list(spec)
    out: list[Method] = []
    for item in items:
        if isinstance(item, Method):
            if "card" not in type(item).__dict__:
                raise TypeError(f"{type(item).__name__} is not decorated with @vtc.method, so vtc has no card for it")
            out.append(item)
        elif isinstance(item, str):
            out.extend(_construct(methods[name], {}) for name in parse_spec(item))
        else:
            raise TypeError(f"a spec holds method names and method instances, got {type(item).__name__}: {item!r}")
    if not out:
        raise ValueError(f"invalid method spec {spec!r}: it names no method")
    _refuse_repeats([m.card.name for m in out], spec)
    return out


def _construct(cls: type[Method], params: dict[str, Any], base: Method | None = None) -> Method:
    try:
        return dataclasses.replace(base, **params) if base is not None else cls(**params)
    except TypeError as err:
        raise ValueError(f"bad parameters for method {cls.card.name!r}: {err}") from None


def validate_retention(retention: float | None) -> float | None:
    if retention is None:
        return None
    if isinstance(retention, bool) or not isinstance(retention, (int, float)) or math.isnan(retention):
        raise ValueError(f"retention must be a number in (0, 1], got {retention!r}")
    if not 0.0 < float(retention) <= 1.0:
        raise ValueError(f"retention must be in (0, 1] (fraction of visual tokens the LLM sees), got {retention}")
    return float(retention)


def validate_grid(grid: Any) -> tuple[int, int, int]:
    """A token grid (T, H, W) of positive integers, or a ValueError naming what is wrong."""
    try:
        values = tuple(grid)
        integral = len(values) == 3 and all(not isinstance(v, (bool, str)) and int(v) == v for v in values)
    except (TypeError, ValueError):
        integral = False
    if not integral:
        raise ValueError(f"a token grid is (T, H, W): three positive integers, got {grid!r}")
    t, h, w = (int(v) for v in values)
    if min(t, h, w) < 1:
        raise ValueError(f"a token grid is (T, H, W) with every entry >= 1, got {grid!r}")
    return t, h, w


@dataclasses.dataclass
class Entry:
    """One method of a pipeline: its card, and the pipeline's bound copy of it (holding its retention share)."""

    card: MethodCard
    method: Method

    @property
    def retention(self) -> float | None:
        return self.method.retention


def _route_params(methods: list[Method], params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Send each `field=value` (or `method.field=value`) to the method that declares it."""
    routed: dict[str, dict[str, Any]] = {m.card.name: {} for m in methods}
    fields = {m.card.name: {f.name for f in dataclasses.fields(m)} for m in methods}
    for key, value in params.items():
        if "." in key:
            method, field = key.split(".", 1)
            if method not in fields:
                raise ValueError(f"parameter {key!r} names method {method!r}, which is not in this pipeline")
            if field not in fields[method]:
                allowed = ", ".join(sorted(fields[method])) or "(none)"
                raise ValueError(f"method {method!r} has no parameter {field!r}; its parameters: {allowed}")
            routed[method][field] = value
            continue
        owners = [name for name, names in fields.items() if key in names]
        if not owners:
            allowed = "; ".join(f"{n}: {', '.join(sorted(f)) or '(none)'}" for n, f in fields.items())
            raise ValueError(f"unknown parameter {key!r} for this pipeline; parameters by method -> {allowed}")
        if len(owners) > 1:
            hint = ", ".join(f"'{o}.{key}'" for o in owners)
            raise ValueError(f"parameter {key!r} belongs to several methods; name one: {hint}")
        routed[owners[0]][key] = value
    return routed


def streaming_methods(methods: Registry | None = None) -> list[str]:
    """Names of the methods `vtc.stream` can run (causal connect hooks and streaming memories)."""
    return [c.name for c in (methods or registry()).cards() if c.streams or c.stream_memory]


def check_streaming(cards: list[MethodCard], streaming: bool, methods: Registry | None = None) -> None:
    """A stream runs only causal connect hooks and one streaming memory; `vtc.patch` runs no stream-only method."""
    if not streaming:
        only = [c.name for c in cards if c.stream_only]
        if only:
            raise ValueError(
                f"{', '.join(only)} is a streaming method (its memory of the stream is the method): run it with "
                f"vtc.stream(model, processor, {'+'.join(only)!r}, ...) or `vtc stream`, not vtc.patch"
            )
        return
    bad = [c.name for c in cards if not (c.streams or c.stream_memory)]
    if bad:
        raise ValueError(
            f"{', '.join(bad)} cannot stream: a stream sees frames one chunk at a time, with no future frames, no "
            f"frame sampling (the caller feeds the frames) and no whole-prompt LLM stage. Methods that stream: "
            f"{', '.join(streaming_methods(methods))}"
        )


def _video_only_reason(entry: Entry, family: str) -> str:
    """Why a method does not reduce an image's tokens, in a few words."""
    card = entry.card
    if card.acts_on_images:
        if "encode" in card.stages:  # ToMe on LLaVA: unmerged before the pooling
            return f"on {family} it saves vision-tower compute only (the LLM sees every token)"
        return "takes images, but reduces no tokens"
    if "sample" in card.stages:
        return "samples the frames of videos"
    return "needs time (frames of a video)"


class Pipeline:
    """An ordered list of methods built from a spec, with their parameters.

    Methods are ordered by the earliest stage each acts in, then by their place in the spec (see
    `vtc.core.method`). The overall `retention` is split evenly (geometrically) over the token-reducing
    methods, so that composing two of them still leaves `retention` of the visual tokens; a method's own
    parameters override this mapping. `family` binds the pipeline to a model family: `retained_count` needs it
    (a count is a pure function of the family, the grid and the parameters), and methods whose requirements the
    family does not meet are refused.
    """

    def __init__(
        self,
        spec: Spec,
        retention: float | None = None,
        params: dict[str, Any] | None = None,
        methods: Registry | None = None,
        family: str | None = None,
        streaming: bool = False,
    ) -> None:
        methods = methods or registry()
        given = spec_methods(spec, methods)
        self.spec = "+".join(m.card.name for m in given)
        self.retention = validate_retention(retention)
        self.family: str | None = None
        cards = [m.card for m in given]
        self._check_conflicts(cards)
        check_streaming(cards, streaming, methods)
        routed = _route_params(given, params or {})
        given = [_construct(type(m), routed[m.card.name], m) if routed[m.card.name] else m for m in given]
        ranked = sorted(enumerate(given), key=lambda p: (min(STAGE_ORDER[s] for s in p[1].card.stages), p[0]))
        self.entries: list[Entry] = [Entry(m.card, m) for _, m in ranked]
        self._share_retention(family)
        self._check_order(family)
        self._stores: dict[str, dict[str, Any]] = {}
        self.begin_prompt()
        if family is not None:
            self.bind(family)

    def _encoders_inside_frames(self, family: str | None) -> list[str]:
        """The encode methods that leave frames partial for the connect stage: every pre-tower method, and tower
        methods where the tower's survivors are the LLM's tokens (the Qwen towers; on LLaVA's SigLIP / CLIP a frame
        is unmerged onto its whole grid, or leaves entirely). Unknown family: every encode method."""
        from vtc.core.bases import survivors_reach_llm

        return [
            e.card.name
            for e in self.stage_entries("encode")
            if e.card.acts_before_tower or family is None or survivors_reach_llm(family)
        ]

    def _share_retention(self, family: str | None) -> None:
        """Bind every method to its share of the retention: split evenly (geometrically) over the methods that
        reduce the LLM's visual tokens on `family` (None: on some family); the others get None."""
        given = [e.method for e in self.entries]
        reducers = [m for m in given if m.reduces_llm_tokens(family)]
        share = self.retention ** (1.0 / len(reducers)) if (self.retention is not None and reducers) else None
        self.entries = [Entry(e.card, e.method.bind(share if e.method in reducers else None)) for e in self.entries]

    @staticmethod
    def _check_conflicts(cards: list[MethodCard]) -> None:
        owners: dict[str, str] = {}
        for card in cards:
            for decision in card.owns:
                if decision in owners:
                    raise ValueError(
                        f"methods {owners[decision]!r} and {card.name!r} both decide {decision.replace('_', ' ')}; "
                        "a pipeline can have only one of them"
                    )
                owners[decision] = card.name

    def _check_order(self, family: str | None) -> None:
        """A method that needs whole frames must see them: no connect method, and no encode method that removes
        tokens inside frames, may run before it. A connect method reading the vision tower's statistics must read
        those of the tower it means: an encode method changes what the tower attends over."""
        connect = self.stage_entries("connect")
        encoders = [e.card.name for e in self.stage_entries("encode")]
        for e in connect if encoders else []:
            inside = [n for n in self._encoders_inside_frames(family) if n != e.card.name]
            if e.card.whole_frames and inside:
                raise ValueError(
                    f"{e.card.name} needs whole frames (every token of every frame it gets), but the encode-stage "
                    f"method {', '.join(inside)} removes tokens inside frames in or before the vision tower; use a "
                    "connect method that takes any subset of tokens after it, or drop one of the two"
                )
            if e.card.vision_stats:
                raise ValueError(
                    f"{e.card.name} reads the vision tower's attention, but the encode-stage method "
                    f"{', '.join(encoders)} changes what the tower attends over (a subset of the patches, or merged "
                    "tokens), so those statistics are not the ones its official code reads; use a connect method that "
                    "needs no vision statistics after it"
                )
        for i, e in enumerate(connect):
            if e.card.whole_frames and i > 0:
                before = ", ".join(x.card.name for x in connect[:i])
                raise ValueError(
                    f"{e.card.name} needs whole frames (every token of every frame it gets), but {before} would "
                    f"run before it and remove tokens inside frames; put {e.card.name} first among the connect "
                    f"methods, e.g. '{'+'.join([e.card.name] + [x.card.name for x in connect if x is not e])}'"
                )

    # --- binding ---------------------------------------------------------------------------------------------
    def bind(self, family: str) -> None:
        """Bind to a model family: it must offer what every method requires. (The vision-tower statistics a
        method reads are checked by the backend when it installs their capture: asking for them may load
        weights, e.g. FastVID's SigLIP head.)"""
        record = get_family(family)
        for e in self.entries:
            missing = record.missing(e.method.requires)
            if missing:
                raise ValueError(
                    f"method {e.card.name!r} does not support {family}: it needs {', '.join(missing)}, which "
                    f"{family} does not offer; it supports {', '.join(e.card.families) or '(no registered family)'}"
                )
        idle = [
            e for e in self.entries if e.method.reduces_llm_tokens(None) and not e.method.reduces_llm_tokens(family)
        ]
        if idle:  # e.g. ToMe on LLaVA: its share goes to the methods that do reduce the LLM's tokens here
            self._share_retention(family)
            if self.retention is not None and not any(e.method.reduces_llm_tokens(family) for e in self.entries):
                notes = "; ".join(e.method.llm_tokens_note(family) for e in idle)
                raise ValueError(
                    f"retention={self.retention} sets the fraction of visual tokens the LLM sees, but no method of "
                    f"{self.spec!r} changes that count on {family} ({notes}); add a method that does (e.g. "
                    f"'{self.spec}+vidcom2'), or drop retention"
                )
        self.family = family

    # --- images ---------------------------------------------------------------------------------------------
    def image_methods(self) -> list[str]:
        """The methods an image goes through (`MethodCard.acts_on_images`), in run order."""
        return [e.card.name for e in self.entries if e.card.acts_on_images]

    def for_images(self) -> Pipeline:
        """The pipeline an image item goes through: the methods that act on images (every stage but sampling, for
        methods that need no time; encode methods where they reduce the LLM's tokens), the whole `retention` split
        over those that reduce tokens, so that an image, like a video, reaches the LLM with `retention` of its
        tokens. Refuses a spec none of whose methods can reduce an image, naming why (a sampler, a temporal method,
        a tower-only encode method), and the way out."""
        image_pipeline = copy.copy(self)
        image_pipeline.entries = [e for e in self.entries if e.card.acts_on_images]
        reduces = any(e.method.reduces_llm_tokens(self.family) for e in image_pipeline.entries)
        # a tower-only method (ToMe on LLaVA) acts on an image, but cannot give it a retention
        if not reduces and (self.retention is not None or not image_pipeline.entries):
            why = "; ".join(f"{e.card.name}: {_video_only_reason(e, self.family)}" for e in self.entries)
            raise ValueError(
                f"this prompt has an image, but no method of {self.spec!r} can reduce an image's tokens ({why}). "
                "Add a method that acts on one image (e.g. 'visionzip', 'divprune', 'random' or 'fastv'), or pass "
                "images=False to let images reach the LLM whole (`vtc methods` lists which methods take images)"
            )
        image_pipeline._share_retention(self.family)
        return image_pipeline

    def check_images_in_llm(self) -> None:
        """A temporal method acting inside the LLM would see an image's tokens among the visual tokens it reads as
        frames of a video: refuse it (the connect stage keeps images away from temporal methods on its own)."""
        temporal = [e.card.name for e in self.stage_entries("prefill") if e.card.temporal]
        if temporal:
            raise ValueError(
                f"this prompt has an image, but {', '.join(temporal)} acts inside the LLM on every visual token as "
                "frames of a video (it needs time, which an image does not have); pass images=False to let images "
                "reach the LLM whole and uncompressed, or use a method that takes images (e.g. 'fastv')"
            )

    # --- introspection -------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return [e.card.name for e in self.entries]

    def stage_entries(self, stage: str) -> list[Entry]:
        return [e for e in self.entries if stage in e.card.stages]

    def has_stage(self, stage: str) -> bool:
        return bool(self.stage_entries(stage))

    def vision_stats(self, family: str) -> set:
        """Every vision-tower statistic the connect methods read."""
        stats: set = set()
        for e in self.stage_entries("connect"):
            stats.update(e.method.vision_stats(family))
        return stats

    @property
    def needs_prepool(self) -> bool:
        return any(e.card.prepool for e in self.stage_entries("connect"))

    @property
    def acts_during_decode(self) -> bool:
        return any(e.card.during_decode for e in self.stage_entries("prefill"))

    def stream_memory_entry(self) -> Entry | None:
        """The method that decides what a stream remembers, if any."""
        return next((e for e in self.entries if e.card.stream_memory), None)

    def position_policy(self, override: str | None, mrope: bool) -> str:
        """'keep' or 'compact' for the connect stage, from the methods (or the user's override)."""
        if override is not None:
            if override not in ("keep", "compact"):
                raise ValueError(f"positions must be 'keep' or 'compact', got {override!r}")
            if override == "compact" and mrope:
                raise ValueError(
                    "positions='compact' is only supported on 1-D RoPE families (e.g. llava_onevision, "
                    "llava_next_video); Qwen M-RoPE families keep each token's original (t, h, w) position"
                )
            return override
        if mrope:
            return "keep"
        connect = self.stage_entries("connect")
        return connect[-1].card.positions if connect else "keep"

    def _method_count(self, e: Entry, num_tokens: int, grid: tuple[int, int, int], family: str) -> int | None:
        if not e.card.fixed_count:
            return None
        count = e.method.retained_count(num_tokens, grid, family)
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise TypeError(f"method {e.card.name!r}: retained_count must return an int >= 0 or None, got {count!r}")
        return count

    def retained_count(
        self, grid: tuple[int, int, int], family: str | None = None, encoded: int | None = None
    ) -> int | None:
        """Visual tokens the LLM keeps for a video with token grid `grid` = (T, H, W): the count at the last LLM
        layer when a method acts in the LLM, else the count entering it. None when a method decides from the
        content. A pure function of (family, grid, parameters): `family` defaults to the bound one.

        `encoded`: the units the pre-tower methods (`card.acts_before_tower`: `PatchSelector`) actually kept of this
        video, when they already ran on the pixels (a serving engine runs them in its prompt processor, before it
        sizes the prompt). It replaces their counts, adaptive ones included, and the methods after them count from
        it: the tower methods (`TowerMerger`, which run on what the pre-tower methods left, whatever their place in
        the spec) with their own counts, then the connect methods; the result is then None only when a later method
        decides from the content. A method acting both before and in the tower has no count given `encoded` (None).
        """
        t, h, w = validate_grid(grid)
        family = family or self.family
        if family is None:
            raise ValueError(
                "retained_count depends on the model family: bind one with Pipeline(spec, family=...) "
                f"or pass family=...; families: {', '.join(family_names())}"
            )
        if encoded is not None and not 0 <= encoded <= t * h * w:
            raise ValueError(f"encoded must be a unit count in [0, {t * h * w}] for grid {grid}, got {encoded}")
        count: int | None = t * h * w
        in_llm = None  # a method whose count is a last-layer count: nothing may reduce after its connect stage
        for e in self._count_order():
            if not e.card.reduces_tokens:
                continue
            if in_llm is not None and "connect" in e.card.stages:
                return None  # e thins what in_llm's connect stage left, before in_llm acts in the LLM
            if encoded is not None and e.card.acts_before_tower:
                if e.card.acts_in_tower:
                    return None  # `encoded` holds its pre-tower part only
                count = encoded  # what the pre-tower methods kept, whatever each of them promised
                continue
            count = self._method_count(e, count, (t, h, w), family)
            if count is None:
                return None
            if e.card.acts_in_llm:
                in_llm = e
        return count

    def _count_order(self) -> list[Entry]:
        """The entries in the order their counts compose, the order they run in: within the encode stage every
        pre-tower method runs before the vision tower, so before the tower methods whatever their place in the
        spec (`Pipeline.run_encode`, then the tower)."""

        def rank(e: Entry) -> tuple[int, bool]:
            return min(STAGE_ORDER[s] for s in e.card.stages), e.card.acts_in_tower and not e.card.acts_before_tower

        return sorted(self.entries, key=rank)

    # --- execution -----------------------------------------------------------------------------------------
    def begin_prompt(self, state: dict[str, dict[str, Any]] | None = None) -> None:
        """Start a new prompt: every method gets a fresh `ctx.state`, or resumes the one `state` holds for it
        (`prompt_state`: a serving engine that ran a video's tower methods in one call resumes what they left for
        that video's connect call)."""
        state = state or {}
        self._stores = {e.card.name: dict(state.get(e.card.name, {})) for e in self.entries}

    def share_prompt_state(self, other: Pipeline) -> None:
        """Use `other`'s per-prompt method states (the image pipeline of `for_images` shares its parent's)."""
        self._stores = other._stores

    def prompt_state(self) -> dict[str, dict[str, Any]]:
        """Every method's `ctx.state` of the prompt in progress (shallow copies), for `begin_prompt(state)`."""
        return {name: dict(store) for name, store in self._stores.items()}

    def _call(self, e: Entry, hook: str, ctx: Context, recorder: StatsRecorder | None, arg: Any) -> Any:
        """Call one method's hook with its own view of the context (its state, its prepared data, its reports),
        then hand what it reported to the recorder."""
        name = e.card.name
        own = ctx.replace(state=self._stores.setdefault(name, {}), prepared=ctx.prepared.get(name, {}), reports={})
        out = getattr(e.method, hook)(arg, own)
        if recorder is not None:
            recorder.report(name, own.reports)
        return out

    def run_sample(self, video, ctx: Context) -> tuple[Any, dict[str, Any]] | None:
        """The sampler's frame indices (a list or a `FrameChoice`) and what it prepared for later stages (None
        without a sampler). What it reported (`ctx.report(...)`) is in `ctx.reports` of the context passed in."""
        for e in self.stage_entries("sample"):
            state: dict[str, Any] = {}
            own = ctx.replace(state=state, prepared={}, reports=ctx.reports)
            return e.method.sample(video, own), {e.card.name: state} if state else {}
        return None

    def run_encode(self, patches: VideoPatches, ctx: Context) -> tuple[VideoPatches, list[tuple]]:
        """One video's patches through every encode method, in order, each output checked. Returns the survivors
        and one (method, units in, units out, seconds, reports) record per method (the backend runs this inside
        the model's media encoding, before the prompt's statistics record exists)."""
        records = []
        for e in self.stage_entries("encode"):
            if not e.card.acts_before_tower:
                continue
            n_in = len(patches)
            start = time.perf_counter()
            own = ctx.replace(state=self._stores.setdefault(e.card.name, {}), prepared={}, reports={})
            out = e.method.encode(patches, own)
            seconds = time.perf_counter() - start
            self._check_patches(e, patches, out, ctx)
            records.append((e.card.name, n_in, len(out), seconds, own.reports))
            patches = out
        return patches, records

    def pre_tower_entries(self) -> list[Entry]:
        """The encode methods that keep a subset of the patches before the vision tower (`PatchSelector`)."""
        return [e for e in self.stage_entries("encode") if e.card.acts_before_tower]

    def tower_entries(self) -> list[Entry]:
        """The encode methods that act between the vision tower's blocks (`TowerMerger`)."""
        return [e for e in self.stage_entries("encode") if e.card.acts_in_tower]

    def changes_tower(self, grid: tuple[int, int, int]) -> bool:
        """Would a tower method change a video of this tower grid (else the tower runs untouched)?"""
        return any(e.method.changes_tower(grid) for e in self.tower_entries())

    @property
    def tower_needs_keys(self) -> bool:
        return any(getattr(e.method, "needs_keys", False) for e in self.tower_entries())

    def tower_attention_layers(self, num_layers: int) -> frozenset[int]:
        """The tower blocks at which some tower method reads the attention its tokens receive."""
        return frozenset().union(*(e.method.attention_layers(num_layers) for e in self.tower_entries()))

    @property
    def proportional_attention(self) -> bool:
        return any(e.method.proportional_attention() for e in self.tower_entries())

    def run_encode_block(self, tokens: TowerTokens, ctx: Context, tally: dict[str, list]) -> TowerTokens:
        """One video's tokens at one point of one tower block through every tower method, in order, each output
        checked. `tally[name]` = [tokens removed, seconds, reports] accumulates over the tower's blocks (the
        backend records one encode row per method from it)."""
        for e in self.tower_entries():
            n_in = len(tokens)
            start = time.perf_counter()
            own = ctx.replace(state=self._stores.setdefault(e.card.name, {}), prepared={}, reports={})
            out = e.method.encode_block(tokens, own)
            entry = tally.setdefault(e.card.name, [0, 0.0, {}])
            entry[1] += time.perf_counter() - start
            for name, values in own.reports.items():
                entry[2].setdefault(name, []).extend(values)
            if not isinstance(out, TowerTokens):
                raise TypeError(
                    f"method {e.card.name!r}: encode_block must return TowerTokens, got {type(out).__name__}"
                )
            if out is not tokens and (out.grid != tokens.grid or out.holder.numel() != tokens.holder.numel()):
                raise RuntimeError(f"method {e.card.name!r} changed the video's tower grid {tokens.grid} -> {out.grid}")
            entry[0] += n_in - len(out)
            tokens = out
        return tokens

    def _check_patches(self, e: Entry, patches: VideoPatches, out: Any, ctx: Context) -> None:
        name = e.card.name
        if not isinstance(out, VideoPatches):
            raise TypeError(f"method {name!r}: encode must return VideoPatches, got {type(out).__name__}")
        if out is patches:
            return
        if len(patches) and not len(out):
            raise RuntimeError(f"method {name!r} kept no unit of a video of {len(patches)}: keep at least one")
        if out.grid != patches.grid or out.num_units != patches.num_units:
            raise RuntimeError(f"method {name!r} changed the video's grid {patches.grid} -> {out.grid}; keep it")
        if e.card.fixed_count and ctx.family is not None:
            promised = self._method_count(e, len(patches), patches.grid, ctx.family)
            if promised is not None and promised != len(out):
                raise RuntimeError(
                    f"method {name!r} promised {promised} units (retained_count({len(patches)}, {patches.grid}, "
                    f"{ctx.family!r})) but kept {len(out)}"
                )

    def run_connect(self, tokens: VideoTokens, ctx: Context, recorder: StatsRecorder | None) -> VideoTokens:
        """The connect engine: one video's tokens through every connect method, in order, each output checked."""
        for e in self.stage_entries("connect"):
            n_in = len(tokens)
            start = time.perf_counter()
            out = self._call(e, "connect", ctx, recorder, tokens)
            seconds = time.perf_counter() - start
            self._check_output(e, tokens, out, ctx)
            if out is not tokens:
                out.log.append((e.card.name, n_in, len(out)))
            if recorder is not None:
                recorder.record("connect", e.card.name, n_in, len(out), seconds)
            tokens = out
        return tokens

    def _check_output(self, e: Entry, tokens: VideoTokens, out: Any, ctx: Context) -> None:
        name = e.card.name
        if not isinstance(out, VideoTokens):
            raise TypeError(f"method {name!r}: connect must return VideoTokens, got {type(out).__name__}")
        if out is tokens:
            return
        out.validate()
        if len(tokens) and not len(out):
            raise RuntimeError(f"method {name!r} returned no tokens for a video of {len(tokens)}: keep at least one")
        if out.grid != tokens.grid:
            raise RuntimeError(f"method {name!r} changed the video's grid {tokens.grid} -> {out.grid}; keep it")
        if e.card.reduces_tokens and e.card.fixed_count and not e.card.acts_in_llm and ctx.family is not None:
            promised = self._method_count(e, len(tokens), tokens.grid, ctx.family)
            if promised is not None and promised != len(out):
                raise RuntimeError(
                    f"method {name!r} promised {promised} tokens (retained_count({len(tokens)}, {tokens.grid}, "
                    f"{ctx.family!r})) but returned {len(out)}; note that tokens.grid is the original grid while "
                    "num_tokens is what earlier methods left"
                )

    def run_prefill(self, state, ctx: Context, recorder: StatsRecorder | None, decoding: bool = False) -> None:
        for e in self.stage_entries("prefill"):
            if decoding and not e.card.during_decode:
                continue
            start = time.perf_counter()
            self._call(e, "prefill", ctx, recorder, state)
            if recorder is not None:
                recorder.add_seconds("prefill", e.card.name, time.perf_counter() - start)
