"""What `vllm serve ... --additional-config '{"vtc": {...}}'` may ask for, checked before the server starts.

A served model must fix each video's placeholder count when the prompt is processed, before any pixel is
encoded, and vLLM caches encoder outputs per video, across requests and questions. So a method serves only if
it acts in the `connect` stage, its count is a pure function of the video's grid (`retained_count`), and it does
not read the question; or if it chooses each video's merge units before the vision tower (an encode-stage
`PatchSelector`, on the Qwen families), which the prompt processor runs on the pixels, so the prompt is sized from
what it kept (`vtc.vllm.encode`); or if it acts between the vision tower's blocks with a count fixed by the grid
(a `TowerMerger` such as ToMe on every family, or GRT on LLaVA, whose connect stage then runs after the tower), which
the worker runs inside vLLM's own tower (`vtc.vllm.tower`). `ServeConfig.pipeline(family)` builds the pipeline the
server runs and refuses anything else with a message naming the serving-capable methods. No vLLM import here: the CLI
checks a config with it before it starts vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from vtc.core.bases import PatchSelector
from vtc.core.families import get_family
from vtc.core.geometry import default_geometry
from vtc.core.method import MethodCard
from vtc.core.pipeline import Pipeline, parse_spec, validate_retention
from vtc.core.registry import registry

KEY = "vtc"  # additional_config[KEY], and a request's mm_processor_kwargs[KEY]
CONFIG_ATTR = "vtc_serving"  # the checked config, on the HF config (see vtc.vllm.plugin)
FIELDS = ("methods", "retention", "params", "seed", "request_settings", "retention_range", "images")
REQUEST_FIELDS = ("retention", "params", "seed")  # what one request may set (mm_processor_kwargs["vtc"])
QUESTION = "question"  # a request may also name the question a sampler reads (any server, with any settings)

# vLLM architecture name -> vtc family
ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "LlavaOnevisionForConditionalGeneration": "llava_onevision",
    "LlavaNextVideoForConditionalGeneration": "llava_next_video",
}

# vLLM architecture name -> vtc's class registered in its place (in vtc.vllm.models)
MODEL_CLASSES = {
    "Qwen2VLForConditionalGeneration": "VtcQwen2VL",
    "Qwen2_5_VLForConditionalGeneration": "VtcQwen2_5_VL",
    "Qwen3VLForConditionalGeneration": "VtcQwen3VL",
    "LlavaOnevisionForConditionalGeneration": "VtcLlavaOnevision",
    "LlavaNextVideoForConditionalGeneration": "VtcLlavaNextVideo",
}

# a grid to probe whether a pipeline's count is a pure function of the grid (on a family whose tower pools a fixed
# patch grid, LLaVA's, its own token grid: a method may promise a count for the published tower's grid only, GRT)
_PROBE_GRID = (8, 12, 12)


def _probe_grid(family: str) -> tuple[int, int, int]:
    cells = default_geometry(family).token_grid_size()
    return _PROBE_GRID if cells is None else (_PROBE_GRID[0], *cells)


def family_of(architectures: list[str] | tuple[str, ...] | None) -> str:
    """The vtc family of a model from its `architectures`, or a ValueError naming the supported ones."""
    for arch in architectures or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(
        f"vtc cannot compress the video tokens of architecture {', '.join(architectures or ['(none)'])}; vtc serves "
        f"{', '.join(ARCHITECTURES)}"
    )


def servable_methods() -> list[str]:
    """Installed token-reducing methods a server can run: connect stage only, a fixed count, no question."""
    out = []
    for card in registry().cards():
        if set(card.stages) == {"connect"} and card.fixed_count and not card.query_aware and not card.stream_only:
            out.append(card.name)
    return sorted(out)


def servable_samplers() -> list[str]:
    """Installed frame samplers a server can run: the sample stage only (no per-frame token budgets after it)."""
    return sorted(
        card.name
        for card in registry().cards()
        if card.stages == ("sample",) and not card.reduces_tokens and not card.stream_only
    )


def servable_encoders() -> list[str]:
    """Installed encode-stage methods a server can run: those that choose each video's merge units before the vision
    tower (`PatchSelector`: the prompt processor runs them on the pixels, so their count may depend on the content),
    and those that act between the tower's blocks with a count fixed by the grid (`TowerMerger`: the worker runs them
    inside vLLM's tower, block by block; GRT also in the connect stage after it)."""
    return sorted(card.name for card in registry().cards() if _chooses_patches(card) or _merges_in_tower(card))


def servable_tower_methods() -> list[str]:
    """The servable encode-stage methods that act between the vision tower's blocks (ToMe, GRT)."""
    return sorted(card.name for card in registry().cards() if _merges_in_tower(card))


def _chooses_patches(card: MethodCard) -> bool:
    return card.stages == ("encode",) and issubclass(card.cls, PatchSelector) and not card.stream_only


def _merges_in_tower(card: MethodCard) -> bool:
    """Acts between the tower's blocks alone, or there and in a connect stage that can serve (GRT), with a count fixed
    by the grid."""
    return (
        "encode" in card.stages
        and set(card.stages) <= {"encode", "connect"}
        and card.acts_in_tower
        and not card.acts_before_tower
        and card.fixed_count
        and not card.query_aware
        and not card.stream_only
    )


def encode_families(card: MethodCard) -> list[str]:
    """The served families an encode-stage method runs on: those whose tower offers what it requires (the Qwen
    towers' merge units for a pre-tower method; a tower method runs block by block inside vLLM's Qwen towers and
    LLaVA's SigLIP / CLIP alike, and GRT needs LLaVA's pre-pool grid)."""
    return [f for f in dict.fromkeys(ARCHITECTURES.values()) if not get_family(f).missing(card.cls.requires)]


def _allowed(family: str | None = None) -> str:
    """The methods and samplers a server runs (on `family`; None: on some family), for error messages."""
    out = f"{', '.join(servable_methods())}; frame samplers (before one of them): {', '.join(servable_samplers())}"
    cards = [registry()[name].card for name in servable_encoders()]
    encoders = [c for c in cards if family is None or family in encode_families(c)]
    if encoders:
        where = ", ".join(encode_families(encoders[0])) if family is None else family
        names = ", ".join(c.name for c in encoders)
        out += f"; encode-stage methods (alone or before one of the methods above, on {where}): {names}"
    return out


def _check_tower_method(card: MethodCard, allowed: str) -> None:
    """A method acting between the vision tower's blocks serves when its count is fixed by the grid and it acts
    nowhere else but in a connect stage after the tower (the worker runs it inside vLLM's tower, after the prompt was
    sized, then its connect hook on what the tower gave); else a ValueError saying why not."""
    name = card.name
    tower = ", ".join(servable_tower_methods())
    if not card.fixed_count:
        raise ValueError(
            f"{name} merges tokens between the vision tower's blocks, but its count depends on the content "
            f"({card.retention_note or 'it has no retained_count'}), and vLLM sizes each prompt before the tower runs; "
            f"tower methods with a count fixed by the grid serve: {tower}; methods the server runs: {allowed}"
        )
    if card.acts_before_tower or not set(card.stages) <= {"encode", "connect"} or card.query_aware:
        raise ValueError(
            f"{name} acts between the vision tower's blocks and in another place too (stages "
            f"{', '.join(card.stages)}{', before the tower' if card.acts_before_tower else ''}"
            f"{', reading the question' if card.query_aware else ''}); a server runs tower methods that act in the "
            f"tower alone or before a connect stage that reads no question: {tower}; methods the server runs: "
            f"{allowed}"
        )


def tower_depth_params(methods: str, params: dict[str, Any], vision_config: Any) -> dict[str, Any]:
    """`params` with `method.depth` set to the served model's vision-tower depth for every method of `methods` that
    has a `depth` parameter (ToMe: with an int `r` its count depends on the depth, which the prompt processor must
    know before the model runs). A depth the user gave must be the model's."""
    depth = vision_config.get("depth") if isinstance(vision_config, dict) else getattr(vision_config, "depth", None)
    if depth is None:
        return params
    out = dict(params)
    for name in parse_spec(methods):
        if not (registry()[name].card.acts_in_tower and _has_field(registry()[name], "depth")):
            continue
        given = out.get(f"{name}.depth", out.get("depth"))
        if given is not None and given != depth:
            raise ValueError(
                f"{name}.depth={given!r}, but the served model's vision tower has {depth} blocks; drop depth (the "
                "server sets it from the model's config)"
            )
        out.pop("depth", None)
        out[f"{name}.depth"] = int(depth)
    return out


# families whose vLLM model takes `--mm-encoder-tp-mode data` (`supports_encoder_tp_data`); vLLM runs the others'
# towers split by weights under tensor parallelism, whatever the flag says
ENCODER_DATA_PARALLEL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def check_tower_parallelism(
    pipeline: Pipeline,
    tensor_parallel_size: int,
    encoder_tp_mode: str | None,
    family: str | None = None,
    pipeline_parallel_size: int = 1,
) -> None:
    """Refuse tower methods under tensor parallelism of the vision tower. Each block's projections are then split by
    heads across the ranks and summed by an all-reduce, row by row: every rank must merge the same tokens, in the
    same order, in every block, or the sums mix different tokens (or the collectives hang on different counts). A
    merge decided from keys and hidden states that can differ across ranks in the last bits gives no such guarantee
    without broadcasting them every block; `--mm-encoder-tp-mode data` runs the whole (small) tower on every rank
    instead, with no collective inside it, and the first rank's result feeds every rank's LLM. vLLM's LLaVA models
    do not take that mode (vLLM falls back to splitting the tower), so there tower methods need one rank.

    Also refuse a method that reads the LM head (`reads_lm_head`: GRT's key-frame matching) where the rank that
    encodes does not hold it whole: tensor parallelism splits it by vocabulary, and under pipeline parallelism the
    first stage, which encodes, holds no LM head at all."""
    tower = [e.card.name for e in pipeline.tower_entries()]
    head = [e.card.name for e in pipeline.entries if e.card.reads_lm_head]
    if head and (tensor_parallel_size > 1 or pipeline_parallel_size > 1):
        split = (
            f"--tensor-parallel-size {tensor_parallel_size} splits it by vocabulary across the ranks"
            if tensor_parallel_size > 1
            else f"with --pipeline-parallel-size {pipeline_parallel_size} the first stage, which encodes the video, "
            "holds no LM head"
        )
        raise ValueError(
            f"{'+'.join(head)} compares key frames by the LLM's LM head over the whole vocabulary while it encodes a "
            f"video, and {split}; serve {'+'.join(head)} on one rank (--tensor-parallel-size 1 "
            "--pipeline-parallel-size 1)"
        )
    if not tower or tensor_parallel_size <= 1:
        return
    if family is not None and family not in ENCODER_DATA_PARALLEL:
        raise ValueError(
            f"{'+'.join(tower)} acts between the vision tower's blocks, which vtc does not run on a tower split "
            f"across {tensor_parallel_size} tensor-parallel ranks (each rank holds a share of every block's heads, so "
            f"every rank would have to merge the same tokens in every block); vLLM's {family} model splits its tower "
            "whenever the LLM is tensor-parallel (it does not take --mm-encoder-tp-mode data), so serve "
            f"{'+'.join(tower)} with --tensor-parallel-size 1"
        )
    if encoder_tp_mode == "data":
        return
    raise ValueError(
        f"{'+'.join(tower)} merges tokens between the vision tower's blocks, which vtc does not run on a tower split "
        f"across {tensor_parallel_size} tensor-parallel ranks (each rank holds a share of every block's heads, so "
        "every rank would have to merge the same tokens in every block); start the server with "
        "--mm-encoder-tp-mode data (each rank runs the whole vision tower, the LLM stays tensor-parallel), or "
        "--tensor-parallel-size 1"
    )


def _has_field(params_cls: type, name: str) -> bool:
    return any(f.name == name for f in dataclasses.fields(params_cls))


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """methods: a spec such as "vidcom2" or "dycoke-ttm+divprune". retention: fraction of each video's tokens the
    LLM sees. params: method parameters (`field` or `method.field`), as for `vtc.patch`. seed: the seed of every
    random choice (the same video always gets the same tokens). request_settings: whether a request may override
    retention, params or seed for itself (`mm_processor_kwargs={"vtc": {...}}`); retention_range: the
    [low, high] a request's retention must lie in. images: compress images too (default: each image, each
    view of a LLaVA-OneVision image, through the methods that take one image, `Pipeline.for_images`), or let them
    reach the LLM whole (false)."""

    methods: str
    retention: float | None = None
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    seed: int = 0
    request_settings: bool = True
    retention_range: tuple[float, float] = (0.0, 1.0)
    images: bool = True

    @classmethod
    def from_dict(cls, raw: Any) -> "ServeConfig":
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as err:
                raise ValueError(f"the vtc config is not valid JSON ({err}): {raw!r}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"the vtc config must be an object with keys {', '.join(FIELDS)}; got {raw!r}")
        unknown = sorted(set(raw) - set(FIELDS))
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)} in the vtc config; allowed: {', '.join(FIELDS)}")
        if not raw.get("methods"):
            raise ValueError('the vtc config needs "methods", e.g. {"methods": "vidcom2", "retention": 0.25}')
        methods = raw["methods"]
        if not isinstance(methods, str):
            if not isinstance(methods, (list, tuple)) or not all(isinstance(m, str) for m in methods):
                raise ValueError(f'"methods" must be a string such as "vidcom2+divprune" or a list; got {methods!r}')
            methods = "+".join(methods)
        params = _check_params(raw.get("params"), '"params"')
        seed = _check_seed(raw.get("seed", 0), '"seed"')
        allowed = raw.get("request_settings", True)
        if not isinstance(allowed, bool):
            raise ValueError(f'"request_settings" must be true or false; got {allowed!r}')
        images = raw.get("images", True)
        if not isinstance(images, bool):
            raise ValueError(
                f'"images" must be true (compress images) or false (let them reach the LLM whole); got {images!r}'
            )
        config = cls(
            "+".join(parse_spec(methods)),
            validate_retention(raw.get("retention")),
            params,
            seed,
            allowed,
            _check_range(raw.get("retention_range", (0.0, 1.0))),
            images,
        )
        config.check_methods()
        return config

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"methods": self.methods, "retention": self.retention, "seed": self.seed}
        if self.params:
            out["params"] = dict(self.params)
        if not self.request_settings:
            out["request_settings"] = False
        if tuple(self.retention_range) != (0.0, 1.0):
            out["retention_range"] = list(self.retention_range)
        if not self.images:
            out["images"] = False
        return out

    def for_request(self, raw: Any) -> "ServeConfig":
        """The config one request runs with: this one with the request's `mm_processor_kwargs["vtc"]` applied
        (retention, params: merged over the server's, seed). Raises ValueError naming what the server allows; vLLM
        answers it with HTTP 400."""
        where = 'mm_processor_kwargs["vtc"]'
        if not self.request_settings:
            raise ValueError(
                f"this server does not take per-request vtc settings ({where}); it runs {self.methods!r} at retention "
                f"{self.retention} for every request (started with request_settings=false)"
            )
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be an object with keys {', '.join(REQUEST_FIELDS)}; got {raw!r}")
        unknown = sorted(set(raw) - set(REQUEST_FIELDS))
        if unknown:
            hint = (
                f"; this server runs {self.methods!r} (start another to serve other methods)"
                if "methods" in raw
                else ""
            )
            allowed = ", ".join(REQUEST_FIELDS + (QUESTION,))
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; a request may set {allowed}{hint}")
        retention = self.retention
        if "retention" in raw:
            try:
                retention = validate_retention(raw["retention"])
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
            low, high = self.retention_range
            if retention is None or not low <= retention <= high:
                raise ValueError(
                    f"{where}: retention must be in [{low}, {high}] on this server (its retention_range), got "
                    f"{raw['retention']!r}"
                )
        own = _check_params(raw.get("params"), f"{where}.params")
        depth = [key for key in own if key == "depth" or key.endswith(".depth")]
        if depth:
            raise ValueError(
                f"{where}.params: {', '.join(depth)} is the served model's vision-tower depth, which the server sets; "
                "drop it"
            )
        params = {**self.params, **own}
        seed = _check_seed(raw.get("seed", self.seed), f"{where}.seed")
        return dataclasses.replace(self, retention=retention, params=params, seed=seed)

    def for_model(self, vision_config: Any) -> "ServeConfig":
        """This config on a model with `vision_config` (an HF config or its dict): the tower methods' `depth` set
        from it (`tower_depth_params`), so a count that depends on the tower's depth is fixed before the model runs.
        The server applies it once it knows the model (`vtc.vllm.plugin.apply_config`)."""
        params = tower_depth_params(self.methods, self.params, vision_config)
        return self if params == self.params else dataclasses.replace(self, params=params)

    def check_methods(self) -> None:
        """Every method is installed and can serve (the family-specific checks are in `pipeline`)."""
        methods = registry()
        allowed = _allowed()
        for name in parse_spec(self.methods):
            info = methods[name].card  # raises naming the installed methods
            if "encode" in info.stages and info.acts_in_tower:
                _check_tower_method(info, allowed)
            elif "encode" in info.stages and not issubclass(info.cls, PatchSelector):
                raise ValueError(
                    f"{name} acts in the encode stage but does not choose patches before the vision tower (it is no "
                    "PatchSelector) nor merge tokens between its blocks (it is no TowerMerger), the two ways vtc "
                    f"hooks vLLM's towers; encode-stage methods the server runs: {', '.join(servable_encoders())}; "
                    f"methods the server runs: {allowed}"
                )
            if info.stages == ("encode",):
                continue  # the family is checked in `pipeline`: only the Qwen towers have merge units
            if "sample" in info.stages and name not in servable_samplers():
                part = SAMPLER_PARTS.get(name)
                hint = f"serve its frame choice alone as {part!r}, or" if part else "or"
                raise ValueError(
                    f"{name} chooses frames and then sizes each frame's tokens from that choice (sample and connect "
                    "stages), but vLLM sizes a prompt from the video's grid alone; "
                    f"{hint} choose frames on the client (vtc.prepare_inputs, or QuoTA's scorer in vtc.vllm.client."
                    "select_frames) and send only those; methods the server runs: " + allowed
                )
            if "sample" in info.stages:
                continue
            if "prefill" in info.stages or info.acts_in_llm:
                part = CONNECT_PARTS.get(name)
                hint = f"serve its connect part as {part!r}, or use" if part else "use"
                raise ValueError(
                    f"{name} acts inside the LLM (prefill/KV), which vLLM's paged KV cache does not allow; {hint} a "
                    f"method that acts before the LLM: {allowed}"
                )
            if info.query_aware:
                raise ValueError(
                    f"{name} reads the question in its connect stage, but vLLM caches encoder outputs per video "
                    f"across questions; methods the server runs: {allowed}"
                )
            if not info.fixed_count:
                raise ValueError(
                    f"{name} keeps a content-dependent number of tokens, but vLLM sizes a prompt before encoding "
                    f"the video; methods with a fixed count: {allowed}"
                )

    def serving_params(self) -> dict[str, Any]:
        """The method parameters a server runs with: the user's, plus `method.fixed_count=True` for every method
        that has that parameter (a content-dependent count cannot size a prompt before encoding)."""
        params = dict(self.params)
        methods = registry()
        for name in parse_spec(self.methods):
            if _has_field(methods[name], "fixed_count"):
                given = params.get(f"{name}.fixed_count", params.get("fixed_count"))
                if given is False:
                    raise ValueError(
                        f"{name}: fixed_count=False gives a content-dependent count, but vLLM sizes each prompt "
                        "before it encodes the video; drop fixed_count (the server turns it on)"
                    )
                params.pop("fixed_count", None)
                params[f"{name}.fixed_count"] = True
        return params

    def pipeline(self, family: str) -> Pipeline:
        """The pipeline a server of `family` runs (`serving_params`), bound to the family; refuses what cannot
        serve."""
        params = self.serving_params()
        self._check_encode_family(family)
        pipeline = Pipeline(self.methods, self.retention, params, family=family)
        for entry in pipeline.stage_entries("sample"):
            fix = entry.method.host_model_use()
            if fix is not None:
                raise ValueError(
                    f"{entry.card.name} asks the served model itself with these parameters, which vLLM's prompt "
                    f"processor (where the server chooses frames) cannot call; {fix}"
                )
        # a pre-tower method's count is known once the prompt processor ran it on the pixels: probe with one
        probe = _probe_grid(family)
        encoded = math.prod(probe) // 2 if pipeline.pre_tower_entries() else None
        if pipeline.retained_count(probe, encoded=encoded) is None:
            tower = [e.card.name for e in pipeline.tower_entries()]
            before = [e.card.name for e in pipeline.pre_tower_entries()]
            if tower and before:
                raise ValueError(
                    f"{'+'.join(tower)} after {'+'.join(before)} has no fixed count: {'+'.join(before)} leaves each "
                    f"temporal patch a number of units that depends on its content, and {'+'.join(tower)} plans its "
                    "merges per frame of the whole grid (ToMe merges a fixed number of units per frame in every "
                    "block), so what it keeps would depend on the content too, and vLLM sizes the prompt before the "
                    f"tower runs; serve {'+'.join(tower)} or {'+'.join(before)} alone (or before connect methods); "
                    "methods the server runs: " + _allowed()
                )
            depth = [e.card.name for e in pipeline.tower_entries() if getattr(e.method, "depth", 0) is None]
            hint = (
                f" ({', '.join(depth)}: with an int r the count depends on the vision tower's depth, which the server "
                "sets from the served model's config, ServeConfig.for_model)"
                if depth
                else ""
            )
            raise ValueError(
                f"{self.methods!r} does not fix its token count from the video's grid alone on {family} (with these "
                f"parameters){hint}, which vLLM needs to size the prompt; methods the server runs: " + _allowed()
            )
        return pipeline

    def _check_encode_family(self, family: str) -> None:
        """Encode-stage methods need what they require of the family's tower (pre-tower methods drop merge units,
        which only the Qwen towers have; GRT needs LLaVA's pre-pool grid): refuse them elsewhere,
        naming what a server of `family` runs."""
        for name in parse_spec(self.methods):
            card = registry()[name].card
            if "encode" not in card.stages or family in encode_families(card):
                continue
            missing = ", ".join(get_family(family).missing(card.cls.requires))
            if card.acts_in_tower:
                raise ValueError(
                    f"{name} acts between the vision tower's blocks and needs what {family}'s model lacks ({missing}); "
                    f"{name} serves on {', '.join(encode_families(card))}; methods a {family} server runs: "
                    f"{_allowed(family)}"
                )
            raise ValueError(
                f"{name} drops merge units (each 2x2 block of patches that becomes one LLM token) before the vision "
                f"tower, but {family}'s tower has none (it lacks {missing}); {name} serves on "
                f"{', '.join(encode_families(card))}; methods a {family} server runs: {_allowed(family)}"
            )


def request_question(settings: Any) -> str | None:
    """The question a request names for the server's sampler (`mm_processor_kwargs={"vtc": {"question": ...}}`),
    None when it names none (the sampler then reads the prompt's text after each video)."""
    if not isinstance(settings, dict) or QUESTION not in settings:
        return None
    question = settings[QUESTION]
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f'mm_processor_kwargs["vtc"]["question"] must be a non-empty string, got {question!r}')
    return question


def without_question(settings: Any) -> Any:
    """A request's vtc settings without its question (which only the sampler reads)."""
    if isinstance(settings, dict) and QUESTION in settings:
        rest = {k: v for k, v in settings.items() if k != QUESTION}
        return rest or None
    return settings


def _check_params(params: Any, where: str) -> dict[str, Any]:
    params = params or {}
    if not isinstance(params, dict):
        raise ValueError(f"{where} must be an object of method parameters; got {params!r}")
    return dict(params)


def _check_seed(seed: Any, where: str) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{where} must be an integer; got {seed!r}")
    return seed


def _check_range(value: Any) -> tuple[float, float]:
    message = f'"retention_range" must be [low, high] with 0 <= low <= high <= 1; got {value!r}'
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(message)
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
        raise ValueError(message)
    low, high = float(value[0]), float(value[1])
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(message)
    return low, high


# methods that act inside the LLM, and the name of the part of them a server runs
CONNECT_PARTS = {"dycoke": "dycoke-ttm", "holitom": "holitom-outer"}
# samplers that also size each frame's tokens, and the name of their frame choice alone
SAMPLER_PARTS = {"ktv": "ktv-keyframes", "q-frame": "q-frame-qfs"}
