"""What `vllm serve ... --additional-config '{"vtc": {...}}'` may ask for, checked before the server starts.

A served model must fix each video's placeholder count when the prompt is processed, before any pixel is
encoded, and vLLM caches encoder outputs per video, across requests and questions. So a method serves only if
it acts in the `connect` stage, its count is a pure function of the video's grid (`retained_count`), and it does
not read the question; or if it chooses each video's merge units before the vision tower (an encode-stage
`PatchSelector`, on the Qwen families), which the prompt processor runs on the pixels, so the prompt is sized from
what it kept (`vtc.vllm.encode`). `ServeConfig.pipeline(family)` builds the pipeline the server runs and refuses
anything else with a message naming the serving-capable methods. No vLLM import here: the CLI checks a config
with it before it starts vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from vtc.core.bases import PatchSelector
from vtc.core.families import get_family
from vtc.core.method import MethodCard
from vtc.core.pipeline import Pipeline, parse_spec, validate_retention
from vtc.core.registry import registry

KEY = "vtc"  # additional_config[KEY], and a request's mm_processor_kwargs[KEY]
CONFIG_ATTR = "vtc_serving"  # the checked config, on the HF config (see vtc.vllm.plugin)
FIELDS = ("methods", "retention", "params", "seed", "request_settings", "retention_range")
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

# a grid to probe whether a pipeline's count is a pure function of the grid
_PROBE_GRID = (8, 12, 12)


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
    tower (`PatchSelector`). The prompt processor runs them on the pixels, so their count may depend on the content.
    (A method acting between the tower's blocks is not one: vLLM's towers are not hooked there.)"""
    return sorted(card.name for card in registry().cards() if _chooses_patches(card))


def _chooses_patches(card: MethodCard) -> bool:
    return card.stages == ("encode",) and issubclass(card.cls, PatchSelector) and not card.stream_only


def encode_families(card: MethodCard) -> list[str]:
    """The served families an encode-stage method runs on (those whose tower offers what it requires: the Qwen
    towers' merge units)."""
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


def _has_field(params_cls: type, name: str) -> bool:
    return any(f.name == name for f in dataclasses.fields(params_cls))


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """methods: a spec such as "vidcom2" or "dycoke-ttm+divprune". retention: fraction of each video's tokens the
    LLM sees. params: method parameters (`field` or `method.field`), as for `vtc.patch`. seed: the seed of every
    random choice (the same video always gets the same tokens). request_settings: whether a request may override
    retention, params or seed for itself (`mm_processor_kwargs={"vtc": {...}}`); retention_range: the
    [low, high] a request's retention must lie in."""

    methods: str
    retention: float | None = None
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    seed: int = 0
    request_settings: bool = True
    retention_range: tuple[float, float] = (0.0, 1.0)

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
        config = cls(
            "+".join(parse_spec(methods)),
            validate_retention(raw.get("retention")),
            params,
            seed,
            allowed,
            _check_range(raw.get("retention_range", (0.0, 1.0))),
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
        params = {**self.params, **_check_params(raw.get("params"), f"{where}.params")}
        seed = _check_seed(raw.get("seed", self.seed), f"{where}.seed")
        return dataclasses.replace(self, retention=retention, params=params, seed=seed)

    def check_methods(self) -> None:
        """Every method is installed and can serve (the family-specific checks are in `pipeline`)."""
        methods = registry()
        allowed = _allowed()
        for name in parse_spec(self.methods):
            info = methods[name].card  # raises naming the installed methods
            if "encode" in info.stages and not issubclass(info.cls, PatchSelector):
                raise ValueError(
                    f"{name} acts in the encode stage but does not choose patches before the vision tower (it is no "
                    "PatchSelector: it works inside the tower, between its blocks), which vtc runs on the HF backend "
                    "only: vLLM encodes with its own tower implementations, whose blocks vtc does not hook; "
                    f"encode-stage methods the server runs: {', '.join(servable_encoders())}; methods the server "
                    f"runs: {allowed}"
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
        # an encode method's count is known once the prompt processor ran it on the pixels: probe with one
        encoded = math.prod(_PROBE_GRID) // 2 if pipeline.has_stage("encode") else None
        if pipeline.retained_count(_PROBE_GRID, encoded=encoded) is None:
            raise ValueError(
                f"{self.methods!r} does not fix its token count from the video's grid alone on {family} (with these "
                "parameters), which vLLM needs to size the prompt; methods the server runs: " + _allowed()
            )
        return pipeline

    def _check_encode_family(self, family: str) -> None:
        """Encode-stage methods drop merge units, which only the Qwen towers have: refuse them elsewhere, naming what
        a server of `family` runs."""
        for name in parse_spec(self.methods):
            card = registry()[name].card
            if "encode" not in card.stages or family in encode_families(card):
                continue
            missing = ", ".join(get_family(family).missing(card.cls.requires))
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
