"""Does vtc still work with vLLM 0.33.0, the CUDA build GPU users install? Everything a CPU-only machine can check.

Run by eval/check_vllm_033.sh in a throwaway virtual environment (vllm==0.33.0, vtc from this checkout) with
VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1. Prints one PASS / FAIL / SKIP line per check, then a summary; exits 1 when
any check fails. The models are vtc's tiny random-weight ones (`vtc.testing.tiny`), saved to a temporary folder.

a. versions: vllm is 0.33.0; torch, torchvision and transformers satisfy vLLM's pins (and vtc's for transformers).
b. plugin: vtc's `vllm.general_plugins` entry point is discovered; once vLLM loads its general plugins, its
   `ModelRegistry` holds each of the five architectures as a lazy `_LazyRegisteredModel("vtc.vllm.models", class)`
   entry that loads vtc's class; vtc's hooks are in place (config hook, the per-request settings gate, which lets
   `mm_processor_kwargs["vtc"]` through and still refuses other keys, the CPU runner fix).
c. classes: every `Vtc*` model class subclasses 0.33's class of its architecture and every `Vtc*Processor` the
   processor 0.33 registers for that class (with 0.33's own processing info and dummy-input builder). The methods
   vtc defines are read off its classes: each one 0.33's class also has must be in the list reviewed from
   vtc/vllm/models.py (`MODEL_USES`, `PROCESSOR_USES`; anything else would be vtc shadowing a vLLM method), exist on
   0.33's class, accept every call 0.33's signature accepts (`inspect.signature`: all by position, all by keyword,
   extra keywords where 0.33 takes **kwargs), and 0.33's method must take vtc's `super()` call (the processors'
   `apply` and `get_dummy_mm_inputs`, where server-side frame samplers hook in, among them). The vLLM internals vtc
   uses elsewhere (plugin.py, stages.py, vision.py, engine.py, sampling.py, testing/serving.py, tools/serve.py)
   exist and, where cheap, work (pipeline-stage positions through `IntermediateTensors`, `StageMissingLayer`, the
   `ProcessorInputs` fields sampling.py reads and replaces).
d. processor side, all five families: vLLM 0.33 builds the engine config with `additional_config={"vtc": ...}`
   (vtc's config hook runs: `hf_config.vtc_serving`, and vLLM's pruning switch on the M-RoPE families) and builds
   vtc's processor, and its `InputProcessor.process_inputs` sizes each video's placeholders to
   `retained_count(grid)`: stock config (full count), vtc at 0.25, a request's own retention 0.5
   (`mm_processor_kwargs`), a refused request value, two videos per prompt (Qwen families), and with vLLM's
   processor cache on, which must key on the request's settings. On Qwen3-VL the span also holds the timestamp
   text: its video tokens are counted, and its length must be stock's minus the removed tokens.
e. model side, all five families, built with 0.33's loader on the CPU platform (`custom_ops=["none"]`, one gloo
   rank): `embed_multimodal` returns one row per placeholder and keeps `retained_count` tokens for the server's
   method and for every serving method (vision-statistics hooks on 0.33's `MMEncoderAttention`, pre-pool
   captures); on the Qwen families `recompute_mrope_positions` strips vtc's position columns (stock width) and fills
   every media slot, and the survivors keep their stock positions; at retention 1.0 the prompt and the embeddings
   are stock's, and the positions those of 0.33's stock class; the merged embeddings go through 0.33's
   `embed_input_ids` and the LLM's `forward` (vLLM's dummy-run path, see below).

Not checkable here, and why (reported as SKIP with the exception):
* an engine (`vllm.LLM`, `vllm serve`): the CUDA wheel has no CPU kernels, so the CPU worker stops at start
  (`torch.ops._C.init_cpu_memory_env`). Generation, greedy tokens and logprobs against stock vLLM are the 0.32 CPU
  suite's tests (tests/test_vllm.py) and need a GPU for 0.33.
* attention in the LLM: 0.33's CPU attention backend calls `torch.ops._C.cpu_attention_with_kv_cache`, absent from
  the CUDA wheel. The decoder forward above runs without attention metadata (as vLLM's warm-up does): its attention
  layers return their output buffer unwritten, so the forward checks that vtc's wrapper, positions and embeddings
  go through 0.33's LLM with the right shapes, not its values.
* Qwen2-VL's and LLaVA-NeXT-Video's models as vLLM builds them on CPU: `QuickGELU` (their vision towers'
  activation) looks up `torch.ops._C.gelu_quick` in its constructor. It never calls it on x86 (`forward_cpu` runs
  `forward_native`), so after the SKIP these two are built with that lookup left out (`cpu_stand_ins`) and checked
  like the others.
* CUDA-only paths: encoder CUDA graphs (vtc turns them off; only the config value is checked), tensor / pipeline
  parallel over NCCL, the V2 model runner (needs Triton).

The configs run without vLLM's processor cache (`mm_processor_cache_gb=0`) except in the check of that cache: with
it, a video sent before reaches the model side as None, its data held by the engine's cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata as md
import inspect
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Iterator

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the check's own lines only

import torch  # noqa: E402

VLLM_VERSION = "0.33.0"
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
LLAVA = ("llava_onevision", "llava_next_video")
ALL = QWEN + LLAVA
VTC = {"methods": "vidcom2", "retention": 0.25}  # the server's config
REQUEST = {"retention": 0.5}  # a request's own settings (mm_processor_kwargs["vtc"])
FULL = {"methods": "random", "retention": 1.0}  # keeps every token in order: stock vLLM's prompt and positions
QUESTION = "What happens in this video?"
FRAMES = 8
TRAILING = {"llava_onevision": 1}  # video tokens after the compressed ones (LLaVA-OneVision's newline)
CPU_OPTIONS = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=8192,
    seed=0,
    distributed_executor_backend="uni",
    compilation_config={"custom_ops": ["none"]},  # vLLM's native ops: the CUDA wheel has no CPU kernels
    # no processor cache: a video seen before reaches the model as None (the engine's cache has it), and the model
    # side embeds the same clip under several configs; check_processor_cache checks the cache on its own
    mm_processor_cache_gb=0,
)

Tensor = torch.Tensor


# --- outcomes ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    status: str  # PASS, FAIL or SKIP
    name: str
    detail: str


OUTCOMES: list[Outcome] = []


def record(status: str, name: str, detail: str = "") -> bool:
    OUTCOMES.append(Outcome(status, name, detail))
    print(f"{status:4}  {name}" + (f": {detail}" if detail else ""), flush=True)
    return status == "PASS"


def expect(name: str, ok: bool, detail: str = "") -> bool:
    return record("PASS" if ok else "FAIL", name, detail)


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def missing_cpu_kernel(text: str) -> bool:
    """An error about the CUDA wheel's missing CPU kernels (`torch.ops._C.*`, `vllm._C`): a limit of this machine,
    not of vtc."""
    return "'_C'" in text or "vllm._C" in text or "_OpNamespace" in text


def where(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


@contextlib.contextmanager
def guarded(name: str) -> Iterator[None]:
    """A group of checks: an exception is one FAIL line (SKIP for the missing CPU kernels), and the run goes on."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - every failure is reported, none ends the run
        if missing_cpu_kernel(describe(err)):
            record("SKIP", name, f"cannot run on CPU with the CUDA wheel: {describe(err)}")
        else:
            record("FAIL", name, f"{describe(err)} (at {where(err)})")
            traceback.print_exc(file=sys.stderr)


def resolve(path: str) -> Any:
    """`module:attr.attr` -> the object (ImportError / AttributeError when 0.33 lacks it)."""
    module, _, attrs = path.partition(":")
    obj: Any = importlib.import_module(module)
    for attr in filter(None, attrs.split(".")):
        fields = getattr(obj, "__dataclass_fields__", {})
        obj = fields[attr] if attr in fields and not hasattr(obj, attr) else getattr(obj, attr)  # a config field
    return obj


# --- a. versions ------------------------------------------------------------------------------------------------


def requirement_specs(dist: str) -> dict[str, Any]:
    """{name: SpecifierSet} of a distribution's requirements that apply here (no extras)."""
    from packaging.requirements import Requirement

    out = {}
    for line in md.requires(dist) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out[req.name.lower()] = req.specifier
    return out


def check_versions() -> None:
    version = md.version("vllm")
    expect("a. vllm version", version == VLLM_VERSION, f"vllm {version} (checking {VLLM_VERSION})")
    pins, vtc_pins = requirement_specs("vllm"), requirement_specs("vtc")
    for name in ("torch", "torchvision", "transformers"):
        installed = md.version(name)
        wanted = {"vllm": pins.get(name), "vtc": vtc_pins.get(name)}
        wanted = {who: spec for who, spec in wanted.items() if spec is not None}
        ok = all(spec.contains(installed, prereleases=True) for spec in wanted.values())
        pinned = ", ".join(f"{who} wants {spec}" for who, spec in wanted.items())
        expect(f"a. {name} version", ok, f"{name} {installed} ({pinned})")
    import vtc

    record("PASS", "a. vtc", f"vtc {md.version('vtc')} from {os.path.dirname(vtc.__file__)}")


# --- b. plugin and registry ----------------------------------------------------------------------------------------


def check_plugin() -> None:
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    from vtc.vllm.config import MODEL_CLASSES

    found = [ep.value for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "vtc"]
    expect("b. entry point vllm.general_plugins:vtc", found == ["vtc.vllm.plugin:register"], f"found {found}")
    load_general_plugins()  # what every vLLM process does at start
    import vtc.vllm.models as models

    for arch, class_name in MODEL_CLASSES.items():
        entry = ModelRegistry.models.get(arch)
        lazy = (getattr(entry, "module_name", None), getattr(entry, "class_name", None))
        loaded = ModelRegistry._try_load_model_cls(arch)  # what vLLM resolves the architecture to
        ok = lazy == ("vtc.vllm.models", class_name) and loaded is getattr(models, class_name)
        shown = f"{loaded.__module__}:{loaded.__qualname__}" if loaded is not None else None
        expect(f"b. ModelRegistry {arch}", ok, f"{type(entry).__name__}{lazy} loads {shown}")
    check_hooks()


def check_hooks() -> None:
    from vllm.config import VllmConfig
    from vllm.entrypoints.generate.base import protocol
    from vllm.renderers import online_renderer

    expect("b. hook: VllmConfig.__post_init__", getattr(VllmConfig.__post_init__, "_vtc", False))
    gate = online_renderer.validate_request_mm_kwargs  # the chat / completion servers' gate
    expect(
        "b. hook: validate_request_mm_kwargs",
        getattr(protocol.validate_request_mm_kwargs, "_vtc", False) and gate is protocol.validate_request_mm_kwargs,
        "wrapped in protocol and bound in renderers.online_renderer",
    )
    with guarded("b. gate lets mm_processor_kwargs['vtc'] through, refuses the rest"):
        gate(mm_processor_kwargs={"vtc": REQUEST}, media_io_kwargs=None, trust_request_mm_kwargs=False)
        try:
            gate(mm_processor_kwargs={"vtc": REQUEST, "fps": 2}, media_io_kwargs=None, trust_request_mm_kwargs=False)
            refused = ""
        except Exception as err:  # noqa: BLE001 - VLLMValidationError
            refused = type(err).__name__
        expect(
            "b. gate lets mm_processor_kwargs['vtc'] through, refuses the rest", bool(refused), f"other key: {refused}"
        )
    from vllm.platforms import current_platform
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    expect(
        "b. hook: CPUModelRunner.load_model",
        current_platform.is_cpu() and getattr(CPUModelRunner.load_model, "_vtc", False),
        f"platform {type(current_platform).__name__}",
    )


# --- c. classes, signatures, internals -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Use:
    """A method of 0.33's class that vtc overrides (calling it through `super()`) or calls. `args` / `kwargs`: how vtc
    calls it (positional count, keyword names)."""

    name: str
    families: tuple[str, ...]
    args: int = 0
    kwargs: tuple[str, ...] = ()
    override: bool = True


# reviewed from vtc/vllm/models.py: _ServingModel, _MRopeServing, _QwenServing, VtcQwen3VL, _LlavaServing,
# VtcLlavaOnevision
MODEL_USES = (
    Use("__init__", ALL, kwargs=("vllm_config", "prefix")),
    Use("embed_multimodal", ALL, kwargs=("pixel_values_videos", "video_grid_thw")),  # **kwargs passed on
    Use("forward", QWEN, args=4, kwargs=("some_runner_kwarg",)),  # (ids, positions, tensors, embeds, **kwargs)
    Use("get_mrope_input_positions", QWEN, args=2),
    Use("recompute_mrope_positions", QWEN, args=4),
    Use("_process_image_input", QWEN + ("llava_onevision",), args=1),
    Use("_process_image_pixels", ("llava_onevision",), args=1, override=False),  # VtcLlavaOnevision images
    Use(
        "_merge_image_patch_embeddings",
        ("llava_onevision",),
        args=2,
        kwargs=("image_newline", "strategy"),
        override=False,
    ),
    Use("_postprocess_image_embeds_evs", QWEN, args=2),
    Use("get_encoder_cudagraph_config", QWEN),
    Use("_process_video_input", QWEN, args=1),
    Use("_postprocess_video_embeds_evs", QWEN, args=2),
    Use("_process_video_pixels", LLAVA, args=1),
    Use("get_language_model", ("qwen3_vl",), override=False),  # VtcQwen3VL._video_span
)
# reviewed from vtc/vllm/models.py: _VtcProcessor, _QwenProcessor, _Qwen3Processor, _LlavaProcessor
PROCESSOR_USES = (
    Use("apply", ALL, args=2),  # (inputs, timing_ctx): frames chosen before the HF processor (vtc.vllm.sampling)
    Use("get_dummy_mm_inputs", ALL, args=1, kwargs=("cache", "scheduler_config")),  # profiling inputs: not sampled
    Use("_get_mm_hashes", ALL, args=1, override=False),  # stock_hashes: vLLM's own identity of each item
    Use("_get_hf_mm_inputs", ALL, args=2),
    Use("_get_mm_fields_config", ALL, args=2),
    Use("_get_prompt_updates", ALL, args=3),
    Use("_postprocess_hf_mm_data", ALL, args=3),  # the encode stage runs on the processor's pixels (vtc.vllm.encode)
    Use(
        "get_video_repl",
        ("qwen3_vl",),
        kwargs=(
            "tokens_per_frame",
            "timestamps",
            "tokenizer",
            "vision_start_token_id",
            "vision_end_token_id",
            "video_token_id",
            "select_token_id",
        ),
        override=False,
    ),
)
# methods vLLM's Qwen2-VL does not have (no EVS there): vtc defines them for the Qwen classes it shares code with
QWEN2_VL_ABSENT = ("recompute_mrope_positions", "_postprocess_image_embeds_evs", "_postprocess_video_embeds_evs")


def family_classes(family: str) -> tuple[type, type, type, type]:
    """(vtc's model class, 0.33's model class, vtc's processor, the processor 0.33 registers for its class)."""
    import vtc.vllm.models as models
    from vtc.vllm.config import ARCHITECTURES, MODEL_CLASSES

    arch = next(a for a, f in ARCHITECTURES.items() if f == family)
    stock = getattr(importlib.import_module(f"vllm.model_executor.models.{family}"), arch)
    ours = getattr(models, MODEL_CLASSES[arch])
    return ours, stock, ours._processor_factory.processor, stock._processor_factory.processor


def vtc_defined(cls: type) -> dict[str, type]:
    """Every method vtc's own classes in `cls`'s MRO define -> the vtc class that defines it."""
    out: dict[str, type] = {}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("vtc."):
            continue
        for name, value in vars(klass).items():
            is_method = inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod))
            if is_method and (name == "__init__" or not name.startswith("__")):
                out.setdefault(name, klass)
    return out


def signature(cls: type, name: str) -> inspect.Signature:
    """A method's signature with `self` (a static method's as it is)."""
    return inspect.signature(getattr(cls, name))


def binds(sig: inspect.Signature, args: list[Any], kwargs: dict[str, Any]) -> str | None:
    try:
        sig.bind(*args, **kwargs)
        return None
    except TypeError as err:
        return str(err)


def accepts_stock_calls(ours: inspect.Signature, stock: inspect.Signature) -> str | None:
    """None when every call that fits 0.33's signature fits vtc's override: all arguments by position, all by
    keyword, and an extra keyword where 0.33 takes **kwargs."""
    params = list(stock.parameters.values())
    P = inspect.Parameter
    positional = [None for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    first = params[0].name if params and params[0].kind != P.KEYWORD_ONLY else None  # self
    keywords = {p.name: None for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    keywords.pop(first, None)
    self_arg = [None] if first is not None else []
    problems = [
        binds(ours, positional, {}) if not any(p.kind == P.KEYWORD_ONLY for p in params) else None,
        binds(ours, self_arg, keywords),
        binds(ours, self_arg, {**keywords, "extra_kwarg": None})
        if any(p.kind == P.VAR_KEYWORD for p in params)
        else None,
    ]
    return next((p for p in problems if p), None)


def check_use(family: str, use: Use, ours: type, stock: type, defined: dict[str, type]) -> None:
    label = f"c. {family}: {stock.__name__}.{use.name}"
    base = getattr(stock, use.name, None)
    if base is None:
        if family == "qwen2_vl" and use.name in QWEN2_VL_ABSENT:
            check_absent_on_qwen2_vl(label, stock, use.name)
        else:
            expect(label, False, "missing on 0.33's class")
        return
    problems = []
    if use.override:
        owner = defined.get(use.name)
        if owner is None:
            problems.append("vtc no longer overrides it (update the reviewed list)")
        else:
            issue = accepts_stock_calls(signature(ours, use.name), signature(stock, use.name))
            if issue:
                problems.append(f"vtc's {owner.__name__}.{use.name} does not take 0.33's call: {issue}")
    static = isinstance(inspect.getattr_static(stock, use.name), staticmethod)
    call = binds(signature(stock, use.name), ([] if static else [None]) + [None] * use.args, dict.fromkeys(use.kwargs))
    if call:
        problems.append(f"0.33's method does not take vtc's call: {call}")
    shown = f"{use.name}{signature(stock, use.name)}".replace("\n", " ")
    expect(label, not problems, "; ".join(problems) or ("override ok: " if use.override else "call ok: ") + shown[:160])


def check_absent_on_qwen2_vl(label: str, stock: type, name: str) -> None:
    """vtc's override calls `super()` only without a vtc config; then nothing in vLLM calls the method on Qwen2-VL:
    its model file never does, and the runner calls `recompute_mrope_positions` only for a model that supports
    pruning (stock Qwen2-VL does not; vtc's class turns it on only with a vtc config)."""
    source = inspect.getsource(sys.modules[stock.__module__])
    unreachable = name not in source and not getattr(stock, "supports_multimodal_pruning", False)
    expect(
        label,
        unreachable,
        "absent on 0.33's Qwen2-VL (no EVS) and never called there: vtc's own method, its super() branch unreachable"
        if unreachable
        else "absent on 0.33's Qwen2-VL but vLLM may call it there",
    )


def check_classes() -> None:
    for family in ALL:
        with guarded(f"c. {family}: classes"):
            ours, stock, our_proc, stock_proc = family_classes(family)
            expect(f"c. {family}: {ours.__name__} subclasses {stock.__name__}", issubclass(ours, stock))
            expect(
                f"c. {family}: {our_proc.__name__} subclasses {stock_proc.__name__}",
                issubclass(our_proc, stock_proc) and our_proc.__name__ == f"{ours.__name__}Processor",
            )
            factory, stock_factory = ours._processor_factory, stock._processor_factory
            expect(
                f"c. {family}: processing info and dummy inputs are 0.33's",
                factory.info is stock_factory.info and factory.dummy_inputs is stock_factory.dummy_inputs,
                f"{getattr(factory.info, '__name__', factory.info)}, "
                f"{getattr(factory.dummy_inputs, '__name__', factory.dummy_inputs)}",
            )
            check_overrides(family, ours, stock, MODEL_USES)
            check_overrides(family, our_proc, stock_proc, PROCESSOR_USES)


def check_overrides(family: str, ours: type, stock: type, uses: tuple[Use, ...]) -> None:
    defined = vtc_defined(ours)
    reviewed = {u.name for u in uses if family in u.families and u.override}
    overridden = {name for name in defined if hasattr(stock, name)}
    unreviewed = sorted(overridden - reviewed)
    # an unreviewed name is vtc shadowing one of 0.33's methods (or this list being out of date)
    expect(
        f"c. {family}: {ours.__name__} overrides only reviewed methods of {stock.__name__}",
        not unreviewed,
        f"unreviewed: {unreviewed}"
        if unreviewed
        else f"{len(overridden)} overrides, vtc's own: " + ", ".join(sorted(set(defined) - overridden)),
    )
    for use in uses:
        if family in use.families:
            check_use(family, use, ours, stock, defined)


def check_internals() -> None:
    """The vLLM names vtc uses outside the model classes, each with how vtc uses it."""
    from vtc.vllm.stages import STAGE_POSITIONS, holds_module, positions_from_previous_stage, positions_to_next_stage

    with guarded("c. StageMissingLayer"):
        missing = resolve("vllm.model_executor.models.utils:StageMissingLayer")("vision_tower", None)
        expect("c. StageMissingLayer", not holds_module(missing) and holds_module(torch.nn.Linear(1, 1)), "stages.py")
    with guarded("c. IntermediateTensors"):
        tensors = resolve("vllm.sequence:IntermediateTensors")({"hidden_states": torch.zeros(4, 8)})
        positions = torch.arange(12).reshape(3, 4)
        sent = positions_to_next_stage(tensors, positions)
        received, rest = positions_from_previous_stage(torch.zeros(3, 4, dtype=torch.long), sent)
        ok = torch.equal(received, positions) and STAGE_POSITIONS not in rest.tensors and type(rest) is type(tensors)
        expect("c. IntermediateTensors", ok, "positions travel between pipeline stages (stages.py)")
    with guarded("c. validate_request_mm_kwargs"):
        sig = inspect.signature(resolve("vllm.entrypoints.generate.base.protocol:validate_request_mm_kwargs"))
        expect("c. validate_request_mm_kwargs", "mm_processor_kwargs" in sig.parameters, f"{sig}")
    with guarded("c. MultiModalFieldConfig.batched"):
        field = resolve("vllm.multimodal.inputs:MultiModalFieldConfig").batched("video", keep_on_cpu=True)
        expect("c. MultiModalFieldConfig.batched", field is not None, "batched('video', keep_on_cpu=True)")
    with guarded("c. HFMultiModalInputs"):
        cls = resolve("vllm.multimodal.processing.processor:HFMultiModalInputs")
        fields = getattr(cls, "_fields", ())
        expect(
            "c. HFMultiModalInputs", "passthrough_data" in fields and hasattr(cls, "_replace"), f"NamedTuple {fields}"
        )
    with guarded("c. MMEncoderAttention"):
        check_encoder_attention()
    with guarded("c. ProcessorInputs"):
        check_processor_inputs()
    with guarded("c. Qwen vision towers (encode stage)"):
        check_tower_forwards()
    for path, how in INTERNALS:
        with guarded(f"c. {path}"):
            obj = resolve(path)
            expect(f"c. {path}", obj is not None, how)


def check_encoder_attention() -> None:
    """vtc.vllm.vision hooks `MMEncoderAttention` (imported from vllm.model_executor.layers.attention) and reads
    query, key, value, cu_seqlens from its arguments in that order."""
    cls = resolve("vllm.model_executor.layers.attention:MMEncoderAttention")
    order = ["query", "key", "value", "cu_seqlens"]
    forwards = {
        n: list(inspect.signature(getattr(cls, n)).parameters)[1:5]
        for n in ("forward_native", "forward_cpu", "forward_cuda")
    }
    init = inspect.signature(cls.__init__).parameters
    ok = all(params == order for params in forwards.values()) and {"num_heads", "num_kv_heads", "scale"} <= set(init)
    expect("c. MMEncoderAttention", ok, f"forward_* take {order}; __init__{inspect.signature(cls.__init__)}")


def check_tower_forwards() -> None:
    """vtc.vllm.encode runs the Qwen towers on the survivors of an encode method with precomputed inputs:
    `forward(x, grid_thw, encoder_metadata=...)`, the metadata keys it fills in (as the towers' own
    `prepare_encoder_metadata` does) read by `forward`."""
    towers = {
        "qwen2_vl:Qwen2VisionTransformer": ("rotary_pos_emb_cos", "cu_seqlens", "max_seqlen"),
        "qwen2_5_vl:Qwen2_5_VisionTransformer": ("window_index", "reverse_indices", "cu_window_seqlens"),
        "qwen3_vl:Qwen3_VisionTransformer": ("pos_embeds", "cu_seqlens", "max_seqlen", "sequence_lengths"),
    }
    problems = []
    for path, keys in towers.items():
        cls = resolve(f"vllm.model_executor.models.{path}")
        if "encoder_metadata" not in inspect.signature(cls.forward).parameters:
            problems.append(f"{cls.__name__}.forward takes no encoder_metadata")
        source = inspect.getsource(cls.forward)
        problems += [f"{cls.__name__}.forward does not read {k!r}" for k in keys if f'"{k}"' not in source]
    expect("c. Qwen vision towers (encode stage)", not problems, "; ".join(problems) or "encoder_metadata forwards")


def check_processor_inputs() -> None:
    """vtc.vllm.sampling reads a request's prompt, media and settings off `ProcessorInputs` and replaces its media
    and their cache identities with `dataclasses.replace`; it rebuilds the video items with their metadata."""
    cls = resolve("vllm.multimodal.processing.inputs:ProcessorInputs")
    needed = {"prompt", "mm_data_items", "mm_uuid_items", "hf_processor_mm_kwargs"}
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    items = inspect.signature(resolve("vllm.multimodal.parse:VideoProcessorItems").__init__).parameters
    ok = needed <= fields and "metadata" in items
    expect(
        "c. ProcessorInputs",
        ok,
        f"dataclass fields {sorted(fields & needed)} of {sorted(needed)}; "
        f"VideoProcessorItems({', '.join(list(items)[1:])})",
    )


# (object, where vtc uses it) - beyond the classes; plugin.py, stages.py, vision.py, engine.py, serving.py, serve.py
INTERNALS = (
    ("vllm:ModelRegistry.register_model", "plugin.register"),
    ("vllm.config:VllmConfig.__post_init__", "plugin._hook_config"),
    ("vllm.config:ModelConfig.is_submodel_config", "plugin.apply_config"),
    ("vllm.config:MultiModalConfig.is_multimodal_pruning_enabled", "plugin._fix_cpu_runner"),
    ("vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model", "plugin._fix_cpu_runner"),
    ("vllm.model_executor.models.interfaces:supports_multimodal_pruning", "plugin._fix_cpu_runner"),
    ("vllm.distributed:get_pp_group", "plugin._fix_cpu_runner"),
    ("vllm.distributed:get_tp_group", "vision.tp_group"),
    ("vllm.multimodal:MULTIMODAL_REGISTRY.register_processor", "models.py"),
    ("vllm.multimodal.processing:PromptReplacement", "models._VtcProcessor._get_prompt_updates"),
    ("vllm.multimodal.parse:MultiModalDataItems.get_count", "models._VtcProcessor (strict=False)"),
    ("vllm.multimodal.parse:VideoProcessorItems.get_num_frames", "models._LlavaProcessor"),
    ("vllm.logger:init_logger", "models.py"),
    ("vllm.model_executor.layers.attention:MMEncoderAttention.maybe_compute_seq_lens", "encode._segments"),
    ("vllm.model_executor.layers.attention:MMEncoderAttention.compute_max_seqlen", "encode._segments"),
    ("vllm.model_executor.layers.attention:MMEncoderAttention.maybe_recompute_cu_seqlens", "encode._segments"),
    (
        "vllm.model_executor.models.qwen2_vl:Qwen2VisionTransformer.prepare_encoder_metadata",
        "encode.survivor_metadata",
    ),
    ("vllm.model_executor.models.qwen2_vl:Qwen2VisionTransformer.compute_attn_mask_seqlen", "encode.survivor_metadata"),
    ("vllm.model_executor.models.qwen2_5_vl:Qwen2_5_VisionTransformer.get_rope_by_thw", "encode._windowed_metadata"),
    ("vllm.model_executor.models.qwen2_5_vl:Qwen2_5_VisionTransformer.invert_permutation", "encode._windowed_metadata"),
    (
        "vllm.model_executor.models.qwen3_vl:Qwen3_VisionTransformer.prepare_encoder_metadata",
        "encode.survivor_metadata",
    ),
    ("vllm.distributed.parallel_state:destroy_model_parallel", "engine.shutdown"),
    ("vllm.distributed.parallel_state:destroy_distributed_environment", "engine.shutdown"),
    ("vllm:LLM.apply_model", "testing.serving, lmms_eval backend"),
    ("vllm:LLM.reset_mm_cache", "testing.serving.clear_caches"),
    ("vllm.v1.engine.llm_engine:LLMEngine.reset_encoder_cache", "testing.serving.clear_caches"),
    ("vllm.entrypoints.cli.main:main", "tools.serve (vtc serve)"),
)


# --- d. processor side ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Family:
    """One tiny model on disk with vLLM 0.33's engine configs for it (stock, vtc at 0.25, vtc at 1.0), each with its
    `InputProcessor`, and the clips it is sent."""

    name: str
    path: str
    configs: dict[str, Any]  # "stock", "vtc", "full" -> VllmConfig
    processors: dict[str, Any]  # same keys -> InputProcessor
    video_token: int
    clips: list[Any]
    stand_ins: bool = False  # its model needs `cpu_stand_ins` to be built on CPU with the CUDA wheel

    def process(self, which: str, clips: list[Any], settings: dict[str, Any] | None = None):
        from vllm import SamplingParams

        from vtc.testing.serving import video_request

        processor = self.processors[which]
        request = video_request(processor.get_tokenizer(), clips[0] if len(clips) == 1 else clips, QUESTION)
        if settings is not None:
            request["mm_processor_kwargs"] = {"vtc": settings}
        return processor.process_inputs(
            f"{which}-{time.monotonic_ns()}", request, SamplingParams(max_tokens=1), ("generate",)
        )


def engine_config(path: str, vtc: dict[str, Any] | None, family: str, **options: Any):
    from vllm.engine.arg_utils import EngineArgs

    videos = 1 if family == "llava_next_video" else 2  # vLLM's LLaVA-NeXT-Video takes one video per prompt
    args = EngineArgs(
        model=path,
        additional_config={"vtc": vtc} if vtc else {},
        limit_mm_per_prompt={"video": videos, "image": 0},
        **{**CPU_OPTIONS, **options},
    )
    return args.create_engine_config()


def load_family(name: str, root: str) -> Family:
    from vllm.v1.engine.input_processor import InputProcessor

    from vtc.media.video import synthetic_video
    from vtc.testing import tiny

    path = tiny.save(name, os.path.join(root, name))
    configs = {which: engine_config(path, vtc, name) for which, vtc in (("stock", None), ("vtc", VTC), ("full", FULL))}
    processors = {which: InputProcessor(config) for which, config in configs.items()}
    hf_config = configs["stock"].model_config.hf_config
    video_token = getattr(hf_config, "video_token_id", None) or hf_config.video_token_index
    clips = [synthetic_video(FRAMES, 224, 224, seed=0), synthetic_video(12, 192, 192, seed=1)]
    return Family(name, path, configs, processors, video_token, clips)


def videos_of(request) -> list[Any]:
    return [f for f in request.mm_features if f.modality == "video"]


def span_tokens(ids: list[int], feature, token: int) -> int:
    start = feature.mm_position.offset
    return sum(1 for t in ids[start : start + feature.mm_position.length] if t == token)


def grid_of(family: Family, feature, stock_feature, frames: int) -> tuple[int, int, int]:
    """The token grid vtc compresses: (T, H/merge, W/merge) from `video_grid_thw` on Qwen, (frames, side, side)
    from the stock placeholder count on LLaVA (as vtc's processors compute it)."""
    if family.name in QWEN:
        merge = family.configs["stock"].model_config.hf_config.vision_config.spatial_merge_size
        t, h, w = (int(v) for v in feature.data["video_grid_thw"].data.tolist())
        return t, h // merge, w // merge
    per_frame = (stock_feature.mm_position.length - TRAILING.get(family.name, 0)) // frames
    side = math.isqrt(per_frame)
    return frames, side, side


def retained(config: dict[str, Any], family: str, grid: tuple[int, int, int]) -> int:
    from vtc.vllm.config import ServeConfig

    return ServeConfig.from_dict(config).pipeline(family).retained_count(grid)


def check_config(family: Family) -> None:
    hf_config = family.configs["vtc"].model_config.hf_config
    mm = family.configs["vtc"].model_config.multimodal_config
    applied = getattr(hf_config, "vtc_serving", None)
    pruning = mm.video_pruning_rate  # vtc switches vLLM's pruning path on for the M-RoPE families only
    pruning_ok = abs(pruning - (1 - VTC["retention"])) < 1e-9 if family.name in QWEN else not pruning
    ok = applied is not None and applied["methods"] == VTC["methods"] and applied["retention"] == VTC["retention"]
    ok = ok and pruning_ok
    expect(f"d. {family.name}: config hook", ok, f"hf_config.vtc_serving={applied}, video_pruning_rate={pruning}")
    stock = getattr(family.configs["stock"].model_config.hf_config, "vtc_serving", None)
    expect(f"d. {family.name}: stock config untouched", stock is None, f"vtc_serving={stock}")
    from vllm.multimodal import MULTIMODAL_REGISTRY

    processor = MULTIMODAL_REGISTRY.create_processor(family.configs["vtc"].model_config)
    expect(
        f"d. {family.name}: vLLM builds vtc's processor",
        type(processor).__name__.startswith("Vtc"),
        type(processor).__name__,
    )


def check_counts(family: Family, clips: list[Any], label: str) -> None:
    """Stock, the server's config and a request's own retention: each video's placeholders are its count."""
    stock = family.process("stock", clips)
    runs = {
        "vtc 0.25": (family.process("vtc", clips), VTC),
        "request 0.5": (family.process("vtc", clips, REQUEST), {**VTC, **REQUEST}),
    }
    trailing = TRAILING.get(family.name, 0)
    details = []
    stock_ok = True
    grids = []
    for k, (feature, clip) in enumerate(zip(videos_of(stock), clips)):
        grid = grid_of(family, feature, feature, len(clip))
        grids.append(grid)
        tokens = span_tokens(stock.prompt_token_ids, feature, family.video_token)
        stock_ok &= tokens == math.prod(grid) + trailing
        details.append(f"video {k} grid {grid}: stock {tokens}")
    expect(f"d. {family.name}: {label}: stock placeholders", stock_ok, "; ".join(details))
    for run, (request, config) in runs.items():
        details, ok = [], len(videos_of(request)) == len(clips)
        for k, (feature, stock_feature, grid) in enumerate(zip(videos_of(request), videos_of(stock), grids)):
            count = retained(config, family.name, grid)
            tokens = span_tokens(request.prompt_token_ids, feature, family.video_token)
            span = feature.mm_position.length
            want_span = stock_feature.mm_position.length - math.prod(grid) + count
            ok &= tokens == count + trailing and span == want_span and "vtc_settings" in feature.data
            details.append(
                f"video {k}: {tokens} video tokens (retained_count {count}+{trailing}), span {span} (want {want_span})"
            )
        expect(f"d. {family.name}: {label}: {run}", ok, "; ".join(details))


def check_refused(family: Family) -> None:
    try:
        family.process("vtc", family.clips[:1], {"retention": 1.5})
        expect(f"d. {family.name}: bad request settings refused", False, "retention 1.5 was accepted")
    except ValueError as err:
        expect(f"d. {family.name}: bad request settings refused", "retention" in str(err), f"ValueError: {err}")


def check_processor(family: Family) -> None:
    check_config(family)
    check_counts(family, family.clips[:1], "one video")
    check_refused(family)
    if family.name in QWEN:
        check_counts(family, family.clips, "two videos")
    if family.name == "qwen2_5_vl":
        check_processor_cache(family)
    check_server_sampling(family)


SAMPLER = {"methods": "uniform", "params": {"uniform.num_frames": 4}}  # a server-side frame sampler


def check_server_sampling(family: Family) -> None:
    """A server with a frame sampler: 0.33's prompt processor runs vtc's `apply`, which hands the HF processor only
    the chosen frames (the placeholders are stock's for 4 of the clip's 8 frames) and keys the item's cache
    identity by (video, frames)."""
    from vllm import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vtc.media.video import sampling_rule, uniform_indices
    from vtc.testing.serving import video_request
    from vtc.vllm import sampling

    clip = family.clips[0]
    picked = uniform_indices(len(clip), 4, sampling_rule(family.name))
    processor = InputProcessor(engine_config(family.path, SAMPLER, family.name))
    request = video_request(processor.get_tokenizer(), clip, QUESTION)
    sampling.LAST_FRAMES.clear()
    out = processor.process_inputs("sampled", request, SamplingParams(max_tokens=1), ("generate",))
    stock = family.process("stock", [clip[picked]])
    feature, stock_feature = videos_of(out)[0], videos_of(stock)[0]
    tokens = span_tokens(out.prompt_token_ids, feature, family.video_token)
    want = span_tokens(stock.prompt_token_ids, stock_feature, family.video_token)
    chosen = [f["selection"].indices for f in sampling.LAST_FRAMES]
    identity = "+vtc-frames:" + ",".join(map(str, picked))
    ok = chosen == [picked] and tokens == want and identity in str(feature.identifier)
    expect(
        f"d. {family.name}: a server-side sampler sends only its frames",
        ok,
        f"chose {chosen} (want [{picked}]), {tokens} video tokens (stock on those frames: {want}), "
        f"identity {str(feature.identifier)[-40:]}",
    )


def check_processor_cache(family: Family) -> None:
    """With vLLM's processor cache on (its default): the same video at the server's settings, at a request's own,
    then at the server's again. The cache keys on `mm_processor_kwargs`: the second is processed afresh (its own
    count), the third is a hit (its data stays in the engine's cache: None here) with the server's count."""
    from vllm import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vtc.testing.serving import video_request

    config = engine_config(family.path, VTC, family.name, mm_processor_cache_gb=4)
    processor = InputProcessor(config)
    base = video_request(processor.get_tokenizer(), family.clips[0], QUESTION)
    counts, fresh = [], []
    for k, settings in enumerate((None, REQUEST, None)):
        request = {**base, **({"mm_processor_kwargs": {"vtc": settings}} if settings else {})}
        out = processor.process_inputs(f"cache-{k}", request, SamplingParams(max_tokens=1), ("generate",))
        feature = videos_of(out)[0]
        counts.append(span_tokens(out.prompt_token_ids, feature, family.video_token))
        fresh.append(feature.data is not None)
    grid = (4, 12, 12)  # 8 frames of 224 x 224 on Qwen2.5-VL (checked by check_counts)
    want = [
        retained(VTC, family.name, grid),
        retained({**VTC, **REQUEST}, family.name, grid),
        retained(VTC, family.name, grid),
    ]
    expect(
        f"d. {family.name}: processor cache keys on the request's vtc settings",
        counts == want and fresh == [True, True, False],
        f"placeholders {counts} (want {want}), processed afresh {fresh} (want [True, True, False])",
    )


# --- e. model side -------------------------------------------------------------------------------------------------


def init_distributed(config) -> None:
    """vLLM's distributed state for one rank (gloo), as a CPU worker sets it up."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tempfile.mktemp(prefix='vtc-vllm-dist-')}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)


def build_model(family: Family, which: str) -> torch.nn.Module:
    """0.33's loader on one config. Where vLLM's constructor asks for a CPU kernel the CUDA wheel lacks, that is
    reported (SKIP, with the exception) once per family, and the model is built with `cpu_stand_ins`."""
    from vllm.model_executor.model_loader import get_model

    config = family.configs[which]
    if not family.stand_ins:
        try:
            return get_model(vllm_config=config).eval()
        except Exception as err:  # noqa: BLE001 - which kernel is missing is the report
            if not missing_cpu_kernel(describe(err)):
                raise
            record("SKIP", f"e. {family.name}: vLLM's own model constructor on CPU", describe(err))
            family.stand_ins = True
    with cpu_stand_ins():
        return get_model(vllm_config=config).eval()


@contextlib.contextmanager
def cpu_stand_ins() -> Iterator[None]:
    """`QuickGELU` (Qwen2-VL's vision MLP, CLIP's activation) looks up `torch.ops._C.gelu_quick` when it is built on
    the CPU platform, and the CUDA wheel has no such kernel; on x86 its `forward_cpu` never uses it (it runs
    `forward_native`). Built here without the lookup; nothing else changes."""
    from vllm.model_executor.layers import activation

    original = activation.QuickGELU.__init__

    def init(self) -> None:
        super(activation.QuickGELU, self).__init__()

    activation.QuickGELU.__init__ = init
    try:
        yield
    finally:
        activation.QuickGELU.__init__ = original


def embed(model: torch.nn.Module, feature) -> list[Tensor]:
    """`embed_multimodal` on one item, with its kwargs batched as vLLM's runner batches them."""
    from vllm.multimodal.utils import group_and_batch_mm_kwargs

    ((_, _, kwargs),) = list(group_and_batch_mm_kwargs([(feature.modality, feature.data)], device="cpu"))
    with torch.inference_mode():
        return list(model.embed_multimodal(**kwargs))


@dataclasses.dataclass
class Side:
    """One config's model, prompt and embeddings of the one-video request."""

    model: torch.nn.Module
    request: Any
    embeds: list[Tensor]
    stripped: list[Tensor] | None = None  # Qwen: the embeddings and positions recompute_mrope_positions returns
    filled: Tensor | None = None


def side(family: Family, which: str) -> Side:
    model = build_model(family, which)
    request = family.process(which, family.clips[:1])
    return Side(model, request, embed(model, videos_of(request)[0]))


def check_model(family: Family) -> None:
    from vllm.config import set_current_vllm_config

    from vtc.vllm import models

    with set_current_vllm_config(family.configs["stock"]):
        stock = side(family, "stock")
    with set_current_vllm_config(family.configs["vtc"]):
        models.LAST_KEPT.clear()
        ours = side(family, "vtc")
        feature, stock_feature = videos_of(ours.request)[0], videos_of(stock.request)[0]
        grid = grid_of(family, feature, stock_feature, FRAMES)
        count = retained(VTC, family.name, grid)
        kept = [len(k["cells"]) for k in models.LAST_KEPT]
        rows = [e.shape[0] for e in ours.embeds]
        expect(
            f"e. {family.name}: embed_multimodal rows = placeholders",
            rows == [feature.mm_position.length] and kept == [count],
            f"rows {rows}, span {feature.mm_position.length}, kept {kept}, retained_count {count}",
        )
        # each on its own: one that fails does not hide the others
        with guarded(f"e. {family.name}: model built by 0.33's loader"):
            check_model_class(family, ours.model)
        if family.name in QWEN:
            with guarded(f"e. {family.name}: recompute_mrope_positions"):
                check_positions(family, ours, stock, grid)
        with guarded(f"e. {family.name}: embed_input_ids + forward (no attention metadata)"):
            check_forward(family, ours)
        with guarded(f"e. {family.name}: every serving method keeps retained_count"):
            check_every_method(family, ours.model, feature, stock_feature, grid)
    with guarded(f"e. {family.name}: retention 1.0"), set_current_vllm_config(family.configs["full"]):
        check_full_retention(family, side(family, "full"), stock)


def check_model_class(family: Family, model: torch.nn.Module) -> None:
    from vllm.model_executor.models.interfaces import supports_multimodal_pruning

    from vtc.vllm.models import Serving
    from vtc.vllm.stages import STAGE_POSITIONS
    from vtc.vllm.vision import encoder_attention_layers

    ok = type(model).__name__.startswith("Vtc") and isinstance(model.vtc, Serving)
    detail = f"{type(model).__name__}, vtc={type(model.vtc).__name__}"
    layers = encoder_attention_layers(model.vtc.tower)
    attrs_ok = bool(layers) and all(hasattr(m, a) for m in layers for a in ("num_heads", "num_kv_heads", "scale"))
    detail += f", {len(layers)} MMEncoderAttention layers in the tower"
    if family.name in QWEN:
        pruning = bool(model.is_multimodal_pruning_enabled and supports_multimodal_pruning(model))
        empty = model.make_empty_intermediate_tensors(batch_size=4, dtype=torch.float32, device=torch.device("cpu"))
        cudagraphs = model.get_encoder_cudagraph_config()
        ok = ok and pruning and STAGE_POSITIONS in empty.tensors
        detail += f", pruning path on: {pruning}, stage positions: {STAGE_POSITIONS in empty.tensors}, "
        detail += f"encoder CUDA graphs: {getattr(cudagraphs, 'modalities', cudagraphs)}"
    if family.stand_ins:
        detail += " (built with cpu_stand_ins: QuickGELU without its CPU kernel lookup)"
    expect(f"e. {family.name}: model built by 0.33's loader", ok and attrs_ok, detail)


def check_positions(family: Family, ours: Side, stock: Side, grid: tuple[int, int, int]) -> None:
    from vtc.vllm import models

    ids = ours.request.prompt_token_ids
    positions, _ = ours.model.get_mrope_input_positions(ids, ours.request.mm_features)
    marked = int((positions[0] < 0).sum())
    embeds, filled, delta = ours.model.recompute_mrope_positions(
        input_ids=ids, multimodal_embeddings=ours.embeds, mrope_positions=positions, num_computed_tokens=0
    )
    widths, stock_widths = {e.shape[1] for e in embeds}, {e.shape[1] for e in stock.embeds}
    ok = marked == videos_of(ours.request)[0].mm_position.length and int((filled < 0).sum()) == 0
    expect(
        f"e. {family.name}: recompute_mrope_positions",
        ok and widths == stock_widths and delta == int(filled.max()) + 1 - len(ids),
        f"{marked} marked slots, {int((filled < 0).sum())} negative after; width {sorted(widths)} "
        f"(stock {sorted(stock_widths)}, appended {ours.embeds[0].shape[1] - max(widths)}); delta {delta}",
    )
    stock_positions, _ = stock_class(family).get_mrope_input_positions(
        stock.model, stock.request.prompt_token_ids, stock.request.mm_features
    )
    cells = models.LAST_KEPT[-1]["cells"]
    problem = kept_positions_problem(
        stock_positions, stock.request.prompt_token_ids, family.video_token, grid, cells, filled
    )
    expect(f"e. {family.name}: survivors keep their stock positions", problem is None, problem or f"{len(cells)} kept")
    ours.filled, ours.stripped = filled, embeds  # for check_forward


def kept_positions_problem(stock, stock_ids, video_token, grid, cells, compressed) -> str | None:
    """The compressed prompt's positions must be the stock prompt's at its text and at the kept cells (one video)."""
    video = torch.tensor(stock_ids) == video_token
    slots = torch.nonzero(video).flatten()
    if slots.numel() != math.prod(grid):
        return f"{slots.numel()} video tokens in the stock prompt, grid {grid}"
    expected = torch.cat([stock[:, ~video], stock[:, slots[cells.long()]]], dim=1)
    if sorted(map(tuple, expected.T.tolist())) != sorted(map(tuple, compressed.T.tolist())):
        return "positions differ from the stock prompt's at the kept cells"
    if int(compressed.max()) != int(stock.max()):
        return f"the prompt ends at {int(compressed.max())}, stock at {int(stock.max())}"
    return None


def stock_class(family: Family) -> type:
    return family_classes(family.name)[1]


def check_forward(family: Family, ours: Side) -> None:
    """The embeddings merged by 0.33's `embed_input_ids`, then the LLM's forward through vtc's wrapper, without
    attention metadata (vLLM's warm-up path: attention layers are not computed, see the module doc)."""
    from vllm.forward_context import set_forward_context

    ids = torch.tensor(ours.request.prompt_token_ids)
    feature = videos_of(ours.request)[0]
    is_mm = torch.zeros(len(ids), dtype=torch.bool)
    is_mm[feature.mm_position.offset : feature.mm_position.offset + feature.mm_position.length] = True
    if family.name in QWEN:
        embeds, positions = ours.stripped, ours.filled
    else:
        embeds, positions = ours.embeds, torch.arange(len(ids))
    with torch.inference_mode():
        inputs = ours.model.embed_input_ids(ids, embeds, is_multimodal=is_mm)
        with set_forward_context(None, family.configs["vtc"], num_tokens=len(ids)):
            hidden = ours.model(None, positions, inputs_embeds=inputs)
    width = family.configs["vtc"].model_config.get_hidden_size()
    # shapes only: without metadata an attention layer returns its output buffer unwritten (torch.empty), so the
    # values are whatever memory held
    ok = tuple(inputs.shape) == (len(ids), width) and tuple(hidden.shape) == (len(ids), width)
    expect(
        f"e. {family.name}: embed_input_ids + forward (no attention metadata)",
        ok,
        f"inputs {tuple(inputs.shape)}, hidden {tuple(hidden.shape)} (shapes only: attention not computed)",
    )


def check_every_method(family: Family, model, feature, stock_feature, grid) -> None:
    """Every serving method on the same model (vtc's `reconfigure` swap): `retained_count` rows, through 0.33's
    towers (vision-statistics hooks, pre-pool captures)."""
    from vtc.core.registry import registry
    from vtc.vllm import models
    from vtc.vllm.config import ServeConfig, servable_methods

    server, wrong = model.vtc, []
    try:
        for method in servable_methods():
            config = {"methods": method, "retention": 0.25, "params": registry()[method].testing.params}
            model.vtc = models.Serving(model, family.name, ServeConfig.from_dict(config))
            models.LAST_KEPT.clear()
            rows = [e.shape[0] for e in embed(model, feature)]
            count = retained(config, family.name, grid)
            want = stock_feature.mm_position.length - math.prod(grid) + count
            if rows != [want] or [len(k["cells"]) for k in models.LAST_KEPT] != [count]:
                wrong.append(f"{method}: rows {rows} (want {want}), kept {[len(k['cells']) for k in models.LAST_KEPT]}")
    finally:
        model.vtc = server
    expect(
        f"e. {family.name}: every serving method keeps retained_count",
        not wrong,
        "; ".join(wrong) or f"{len(servable_methods())} methods: {', '.join(servable_methods())}",
    )


def check_full_retention(family: Family, full: Side, stock: Side) -> None:
    """At retention 1.0: stock vLLM's prompt and embeddings, and on the Qwen families the positions of 0.33's stock
    class (`get_mrope_input_positions` of the class vtc subclasses, on the stock prompt)."""
    ids = full.request.prompt_token_ids
    same_prompt = ids == stock.request.prompt_token_ids
    expect(f"e. {family.name}: retention 1.0 prompt = stock", same_prompt, f"{len(ids)} tokens")
    embeds = full.embeds
    if family.name in QWEN:
        positions, _ = full.model.get_mrope_input_positions(ids, full.request.mm_features)
        embeds, filled, delta = full.model.recompute_mrope_positions(
            input_ids=ids, multimodal_embeddings=full.embeds, mrope_positions=positions, num_computed_tokens=0
        )
        want, want_delta = stock_class(family).get_mrope_input_positions(
            stock.model, stock.request.prompt_token_ids, stock.request.mm_features
        )
        expect(
            f"e. {family.name}: retention 1.0 positions = {stock_class(family).__name__}.get_mrope_input_positions",
            same_prompt and torch.equal(filled, want) and delta == want_delta,
            f"shape {tuple(filled.shape)}, delta {delta} (stock {want_delta})",
        )
    ours, theirs = embeds[0], stock.embeds[0]
    if ours.shape[0] != theirs.shape[0]:  # Qwen3-VL: vtc's rows cover the whole span (timestamp text too)
        feature = videos_of(full.request)[0]
        span = torch.tensor(ids[feature.mm_position.offset : feature.mm_position.offset + feature.mm_position.length])
        ours = ours[span == family.video_token]
    same = ours.shape == theirs.shape and torch.equal(ours, theirs)
    diff = (ours - theirs).abs().max().item() if ours.shape == theirs.shape else None
    expect(
        f"e. {family.name}: retention 1.0 embeddings = stock",
        same,
        f"{tuple(ours.shape)} vs stock {tuple(theirs.shape)}, max |diff| {diff}",
    )


# --- what needs the CPU kernels --------------------------------------------------------------------------------


def check_attention_kernel() -> None:
    """The real decoder attention on CPU: 0.33's CPU backend calls torch.ops._C.cpu_attention_with_kv_cache."""
    try:
        kernel = torch.ops._C.cpu_attention_with_kv_cache
    except Exception as err:  # noqa: BLE001 - the exception is the reason
        record("SKIP", "e. LLM attention with a KV cache", f"0.33's CPU attention backend needs it: {describe(err)}")
        return
    record(
        "SKIP",
        "e. LLM attention with a KV cache",
        f"{kernel} exists, but this check does not build attention metadata",
    )


def check_engine(path: str) -> None:
    """An in-process engine with vtc, in a child process (a failed start leaves vLLM's state half set up)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    try:
        run = subprocess.run(
            [sys.executable, __file__, "--engine-probe", path], env=env, capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        record("FAIL", "e. engine start (vllm.LLM)", "no answer within 300 s")
        return
    lines = [line for line in run.stdout.splitlines() if line.startswith("PROBE ")]
    outcome = lines[-1][len("PROBE ") :] if lines else f"exit {run.returncode}: {run.stderr.strip()[-300:]}"
    if outcome.startswith("ok"):
        record("PASS", "e. engine start (vllm.LLM)", outcome)
    elif missing_cpu_kernel(outcome):
        record("SKIP", "e. engine start (vllm.LLM)", f"the CUDA wheel has no CPU kernels: {outcome}")
    else:
        record("FAIL", "e. engine start (vllm.LLM)", outcome)


def engine_probe(path: str) -> None:
    """Child of `check_engine`: start an engine with vtc and generate one token."""
    from vllm import SamplingParams

    from vtc.media.video import synthetic_video
    from vtc.testing.serving import engine, video_request

    try:
        llm = engine(path, vtc=VTC, limit_mm_per_prompt={"video": 1, "image": 0})
        request = video_request(llm.get_tokenizer(), synthetic_video(FRAMES, 224, 224, seed=0), QUESTION)
        out = llm.generate([request], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        print(f"PROBE ok: prompt of {len(out[0].prompt_token_ids)} tokens, generated {out[0].outputs[0].token_ids}")
    except Exception as err:  # noqa: BLE001 - reported to the parent
        frames = traceback.extract_tb(err.__traceback__)
        at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        print(f"PROBE {describe(err)}{at}", flush=True)


# --- main -----------------------------------------------------------------------------------------------------------


def run_sections(root: str) -> None:
    with guarded("a. versions"):
        check_versions()
    with guarded("b. plugin"):
        check_plugin()
    with guarded("c. classes"):
        check_classes()
        check_internals()
    distributed = False
    for name in ALL:
        family = None
        with guarded(f"d. {name}: processor side"):
            family = load_family(name, root)
            check_processor(family)
        if family is None:
            continue  # its configs did not build: reported above
        with guarded(f"e. {name}: model side"):
            if not distributed:
                init_distributed(family.configs["stock"])
                distributed = True
            check_model(family)
    check_attention_kernel()
    check_engine(os.path.join(root, "qwen2_5_vl"))


def summary(seconds: float) -> int:
    counts = {status: sum(o.status == status for o in OUTCOMES) for status in ("PASS", "FAIL", "SKIP")}
    print(
        f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in {seconds:.0f} s", flush=True
    )
    for outcome in OUTCOMES:
        if outcome.status != "PASS":
            print(f"  {outcome.status}  {outcome.name}", flush=True)
    return 1 if counts["FAIL"] else 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--engine-probe":
        engine_probe(argv[1])
        return 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vtc-vllm-033-") as root:
        run_sections(root)
    return summary(time.perf_counter() - start)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
