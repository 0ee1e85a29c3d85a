"""Model families: one `Family` record per family, the single list of what vtc supports.

Each family declares itself in one file (the built-ins: `vtc/hf/adapters/<family>.py`, next to its HF adapter) and
is found through the entry-point group `vtc.families`; vtc's own five (and InternVL) are registered there by
vtc's setup.cfg exactly as a third-party package registers its own:

    [options.entry_points]
    vtc.families =
        mymodel = my_package.family:FAMILY

Everything that used to list families (the adapters, the geometry table, the frame-sampling rules, the processor
classes, the media keyword arguments, the tiny test models, the conformance matrix) asks this registry instead:
`family_names()`, `get_family(name)`. Entry points are loaded on first use, never at `import vtc`; one that fails
to load is skipped with a RuntimeWarning naming its package. `register_family(family)` adds one in-process (tests,
notebooks).

This module is backend-neutral (no transformers, no `vtc.hf`): a family names its adapter and its tiny-model builder
as "module:attribute" strings, which the backend and the test helpers import when they need them.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import warnings
from typing import Any, Callable

from vtc.core.geometry import FamilyGeometry

ENTRY_POINT_GROUP = "vtc.families"

# uniform frame-sampling rules (`vtc.media.video.uniform_indices`)
FRAME_RULES = ("round", "floor", "middle")

# What a method may require of a family (`get_family(name).features`); a method whose requirement is missing is
# refused on that family with a message naming it.
FEATURES = {
    "mrope": "3-D (t, h, w) M-RoPE positions (Qwen); without it positions are 1-D",
    "merge_units": "the vision tower emits Qwen-style 2x2 spatial merge units (4 consecutive patches per LLM token), "
    "so tower statistics average over them onto the token grid",
    "patch_grid": "the vision tower's statistics come per patch of a finer grid (with `geometry.cls_tokens` leading "
    "tokens) that the model pools into its LLM tokens; `geometry.to_token_grid` maps them",
    "prepool": "the features before that pooling are available (`ctx.prepool`, `ctx.pool`)",
    "encode_units": "encode-stage methods can drop whole merge units before the vision tower (the HF Qwen towers: "
    "survivors keep their rotary rows, per-frame attention segments and windows; `vtc.hf.encode`)",
    "tower_blocks": "vtc can run the vision tower block by block and merge or drop tokens between its blocks (the HF "
    "Qwen towers and LLaVA's SigLIP / CLIP; `vtc.hf.tower`)",
    "cls_token": "the vision tower has a CLS token first in each frame's sequence (the 'cls' statistic)",
    "deepstack": "visual features also enter the first LLM layers (Qwen3-VL DeepStack), sliced with the tokens",
    "timestamps": "the inputs carry each frame's time (Qwen2.5-VL / Qwen3-VL)",
    "frame_text": "text separates a video's frames in the prompt (Qwen3-VL timestamps, InternVL frame labels)",
    "shared_media_token": "video frames use the same placeholder token as images (InternVL)",
    "streaming": "`vtc.stream` can encode a video chunk by chunk: the processor lays a chunk's frames out as they sit "
    "in one whole-video prompt (InternVL numbers its frame labels per processor call, so it cannot)",
}


@dataclasses.dataclass(frozen=True)
class Family:
    """What vtc knows about one model family, before any model is loaded.

    name:        the family's name (`vtc.patch` binds pipelines to it; methods list the families they support).
    geometry:    how the published checkpoints' vision tower lands on the LLM token grid (`FamilyGeometry`); the
                 HF adapter derives the loaded model's own geometry from its config.
    model_classes: the transformers `...ForConditionalGeneration` class names the adapter takes.
    processor_classes: the transformers processor class names of the family (for its frame-sampling rule).
    adapter:     "module:Class" of the HF adapter (`vtc.hf.adapters.base.Adapter` subclass).
    frame_rule:  uniform frame sampling of the family's reference pipeline (`FRAME_RULES`): "round"
                 (qwen-vl-utils, `linspace(0, T - 1, N).round()`), "floor" (LLaVA's evaluation wrappers,
                 `linspace(..., dtype=int)`) or "middle" (InternVL's `get_index`: the middle of N equal segments).
    media_kwargs: the processor outputs that the model's multimodal forward takes for videos and images (the
                 keyword arguments the backend keeps for the adapter).
    video_pixels: the one of `media_kwargs` that carries video pixels ("pixel_values_videos"; InternVL's
                 processor merges frames into "pixel_values").
    encoded_media: the key of `mm_encoder_outputs` under which transformers' generate passes pre-encoded video
                 features ("video"; "image" where frames are encoded as images).
    vision_stats: the `VisionStat` kinds the backend computes for this family (`vtc.core.vision_stats.KINDS`).
    features:    what the family offers that methods may require (`FEATURES`).
    tiny:        builder of a tiny random-weight model for tests and demos: a callable or a "module:function" path,
                 called as `builder(shape)` with a `vtc.testing.tiny.TinySize` and returning `(model, processor)`.
    summary:     one line for docs and `vtc families`.
    """

    name: str
    geometry: FamilyGeometry
    model_classes: tuple[str, ...]
    processor_classes: tuple[str, ...]
    adapter: str
    frame_rule: str = "round"
    media_kwargs: tuple[str, ...] = ("pixel_values_videos", "mm_encoder_outputs")
    video_pixels: str = "pixel_values_videos"
    encoded_media: str = "video"
    vision_stats: frozenset[str] = frozenset({"received", "keys"})
    features: frozenset[str] = frozenset()
    tiny: Callable[..., Any] | str | None = None
    summary: str = ""

    def __post_init__(self):
        def bad(message: str):
            raise ValueError(f"family {self.name!r}: {message}")

        if not self.name or not self.name.isidentifier():
            bad("the name must be a non-empty identifier (letters, digits, underscores)")
        if not isinstance(self.geometry, FamilyGeometry):
            bad(f"geometry must be a vtc FamilyGeometry, got {type(self.geometry).__name__}")
        if self.geometry.family != self.name:
            bad(f"geometry.family is {self.geometry.family!r}; it must be the family's name")
        if self.frame_rule not in FRAME_RULES:
            bad(f"frame_rule must be one of {', '.join(FRAME_RULES)}, got {self.frame_rule!r}")
        if not self.model_classes:
            bad("model_classes must name the model class(es) the adapter takes")
        if ":" not in self.adapter:
            bad(f"adapter must be a 'module:Class' path, got {self.adapter!r}")
        if self.video_pixels not in self.media_kwargs:
            bad(f"video_pixels {self.video_pixels!r} must be one of media_kwargs {self.media_kwargs}")
        from vtc.core.vision_stats import KINDS

        unknown = sorted(set(self.vision_stats) - set(KINDS))
        if unknown:
            bad(f"unknown vision statistic kind(s) {unknown}; kinds are {', '.join(KINDS)}")
        unknown = sorted(set(self.features) - set(FEATURES))
        if unknown:
            bad(f"unknown feature(s) {unknown}; features are {', '.join(FEATURES)}")
        if ("mrope" in self.features) != self.geometry.mrope:
            bad("the 'mrope' feature and geometry.mrope must agree")
        if ("patch_grid" in self.features) != self.geometry.has_prepool_grid:
            bad("the 'patch_grid' feature and geometry.patch_grid must agree")

    # --- what the backends load lazily ----------------------------------------------------------------------------
    def adapter_class(self) -> type:
        """The HF adapter class (imports the backend)."""
        return load_object(self.adapter, f"family {self.name!r}: adapter")

    def tiny_builder(self) -> Callable[..., Any]:
        if self.tiny is None:
            raise ValueError(f"family {self.name!r} declares no tiny test model (Family.tiny)")
        if callable(self.tiny):
            return self.tiny
        return load_object(self.tiny, f"family {self.name!r}: tiny builder")

    def missing(self, requires: frozenset[str] | set[str] | tuple[str, ...]) -> list[str]:
        """The features of `requires` this family lacks (sorted)."""
        return sorted(set(requires) - set(self.features))

    def check_vision_stats(self, method: str, stats) -> None:
        """Refuse a method that reads vision-tower statistics (`VisionStat`s or kind names) this family's backend
        does not compute, with a message naming what it offers."""
        kinds = {getattr(s, "kind", s) for s in stats}
        missing = sorted(kinds - set(self.vision_stats))
        if missing:
            offered = ", ".join(sorted(self.vision_stats)) or "none"
            raise ValueError(
                f"method {method!r} reads the vision-tower statistic(s) {', '.join(missing)} on {self.name}, which "
                f"this family does not offer (its statistics: {offered}); {method} cannot run on {self.name}"
            )


def load_object(path: str, what: str) -> Any:
    """Import "module:attribute" (attribute may be dotted)."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what}: expected 'module:attribute', got {path!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# --- the registry -------------------------------------------------------------------------------------------------
_LOCK = threading.RLock()
_FAMILIES: dict[str, Family] | None = None  # None until the entry points are loaded
_LOCAL: dict[str, Family] = {}  # register_family() calls, kept across reloads


def _entry_points() -> list[Any]:
    from importlib.metadata import entry_points

    return list(entry_points(group=ENTRY_POINT_GROUP))


def _load() -> dict[str, Family]:
    """Load every `vtc.families` entry point once; a broken one warns and is skipped."""
    global _FAMILIES
    with _LOCK:
        if _FAMILIES is not None:
            return _FAMILIES
        found: dict[str, Family] = {}
        for ep in sorted(_entry_points(), key=_builtin_rank):  # stable: vtc's own first, then the others
            dist = getattr(getattr(ep, "dist", None), "name", None) or "unknown distribution"
            try:
                family = ep.load()
                if callable(family) and not isinstance(family, Family):
                    family = family()
                if not isinstance(family, Family):
                    raise TypeError(f"it loads a {type(family).__name__}, not a vtc.core.families.Family")
                if family.name != ep.name:
                    raise ValueError(f"entry point {ep.name!r} declares family {family.name!r}; use the same name")
                if family.name in found and found[family.name] != family:
                    raise ValueError(f"family {family.name!r} is declared twice")
            except Exception as err:  # noqa: BLE001 - a broken third-party family must not break vtc
                warnings.warn(
                    f"vtc family {ep.name!r} (package {dist!r}, {ep.value}) failed to load and is skipped: "
                    f"{type(err).__name__}: {err}",
                    RuntimeWarning,
                    stacklevel=3,
                )
                continue
            found[family.name] = family
        found.update(_LOCAL)
        _FAMILIES = found
        return found


def _builtin_rank(ep) -> int:
    """vtc's own families first (each group in the order the metadata lists them: by name)."""
    return 0 if str(getattr(ep, "value", "")).startswith("vtc.") else 1


def family_names() -> tuple[str, ...]:
    """Every known family: vtc's own, those of installed packages, and those registered in this process."""
    return tuple(_load())


def get_family(name: str) -> Family:
    """The `Family` called `name`; a ValueError naming the known families otherwise."""
    families = _load()
    try:
        return families[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known families: {', '.join(families)}") from None


def families() -> list[Family]:
    return list(_load().values())


def register_family(family: Family, replace: bool = False) -> Family:
    """Add a family in this process (tests, notebooks); `replace=True` overrides one of the same name. Returns it."""
    if not isinstance(family, Family):
        raise TypeError(f"register_family expects a vtc.core.families.Family, got {type(family).__name__}")
    with _LOCK:
        known = _load()
        if family.name in known and known[family.name] != family and not replace:
            raise ValueError(f"family {family.name!r} is already registered (pass replace=True to override it)")
        _LOCAL[family.name] = family
        known[family.name] = family
    return family


def unregister_family(name: str) -> None:
    """Remove a family registered with `register_family` (tests)."""
    with _LOCK:
        if name not in _LOCAL:
            raise ValueError(f"family {name!r} was not registered in this process")
        del _LOCAL[name]
        reload_families()


def reload_families() -> None:
    """Forget the loaded entry points (after installing a package); the next call loads them again."""
    global _FAMILIES
    with _LOCK:
        _FAMILIES = None


def family_of_model_class(class_name: str) -> Family | None:
    """The family whose adapter takes the model class `class_name`, if any."""
    return next((f for f in _load().values() if class_name in f.model_classes), None)


def family_of_processor_class(class_name: str) -> Family | None:
    """The family a processor class belongs to, if any."""
    return next((f for f in _load().values() if class_name in f.processor_classes), None)
