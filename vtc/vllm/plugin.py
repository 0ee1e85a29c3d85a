"""vtc's vLLM general plugin (entry point `vllm.general_plugins: vtc = vtc.vllm.plugin:register`).

vLLM calls `register()` in every process it starts (API server, engine core, workers), once per process, unless
`VLLM_PLUGINS` names other plugins only. It

1. registers vtc's subclasses of the five families' model classes under vLLM's architecture names (lazily, by
   "module:Class" string, the documented way to add behaviour to a served model). Without a vtc config these
   classes are vLLM's own, unchanged.
2. checks the vtc config when vLLM builds its `VllmConfig` (so a bad config stops `vllm serve` at start, with a
   message naming the allowed values; tower methods' `depth` is set from the model's vision config, and they are
   refused on a tensor-parallel tower, as is a method reading the LM head under tensor or pipeline parallelism),
   and shares it with the processor: `additional_config` reaches the model but not the prompt processor, which
   must size each video's placeholders. The checked config goes on the HF config (`hf_config.vtc_serving`), which
   both sides read and which travels to worker processes with the rest of the config.
3. switches on vLLM's pruning path for M-RoPE families (`video_pruning_rate` set to 1 - retention): with it
   the runner encodes videos one at a time and calls the model's `recompute_mrope_positions`, which places
   the text after a compressed video right. vLLM's own pruning methods are not used: vtc's model classes
   replace the step that would call them.
4. lets a request's own vtc settings (`mm_processor_kwargs={"vtc": {...}}`) through vLLM's gate on per-request
   processor kwargs. vLLM refuses all of them unless the server trusts its clients (`--trust-request-mm-kwargs`),
   as they can change what preprocessing costs; vtc checks its own key against the server's config
   (`request_settings`, `retention_range`) in its processor, so the gate keeps applying to every other key.
5. on vLLM's CPU build, makes the CPU runner do what the GPU runner does: honour the pruning switch (the CPU
   runner's `load_model` never sets `is_multimodal_pruning_enabled`), and, for a model served with vtc, allocate
   the buffers a pipeline stage after the first receives its inputs into (it never does, so pipeline parallel
   fails on CPU without vtc as well).
"""

from __future__ import annotations

import functools
import sys

from vtc.vllm.config import CONFIG_ATTR, KEY, MODEL_CLASSES, ServeConfig, check_tower_parallelism, family_of

MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def register() -> None:
    """The entry point. Idempotent: vLLM may call it several times in one process."""
    from vllm import ModelRegistry

    for arch, class_name in MODEL_CLASSES.items():
        ModelRegistry.register_model(arch, f"vtc.vllm.models:{class_name}")
    _hook_config()
    _let_vtc_settings_through()
    _fix_cpu_runner()


def apply_config(vllm_config) -> None:
    """Check `additional_config["vtc"]` against the model and hand it to the processor (see the module doc)."""
    extra = vllm_config.additional_config
    raw = extra.get(KEY) if isinstance(extra, dict) else None
    model_config = vllm_config.model_config
    if not raw or model_config is None or getattr(model_config, "is_submodel_config", False):
        return  # no vtc config, or the copy vLLM makes for a multimodal model's inner LLM
    hf_config = model_config.hf_config
    config = ServeConfig.from_dict(raw).for_model(getattr(hf_config, "vision_config", None))
    family = family_of(getattr(model_config, "architectures", None))
    pipeline = config.pipeline(family)
    mm = model_config.multimodal_config
    parallel = getattr(vllm_config, "parallel_config", None)
    check_tower_parallelism(
        pipeline,
        getattr(parallel, "tensor_parallel_size", 1),
        getattr(mm, "mm_encoder_tp_mode", None) if mm is not None else None,
        family,
        getattr(parallel, "pipeline_parallel_size", 1),
    )
    if getattr(hf_config, CONFIG_ATTR, None) == config.to_dict():
        return  # this config was applied already (VllmConfig built again from the same model config)
    if mm is not None and mm.video_pruning_rate:
        raise ValueError(
            f"vLLM's own video pruning (--video-pruning-rate {mm.video_pruning_rate}) and vtc both prune video "
            "tokens; use one of them"
        )
    if mm is not None and family in MROPE_FAMILIES:
        retention = pipeline.retention if pipeline.retention is not None else 0.5
        mm.video_pruning_rate = min(max(1.0 - retention, 1e-3), 0.999)
    extra[KEY] = config.to_dict()  # normalised, so every process reads the same thing
    setattr(hf_config, CONFIG_ATTR, config.to_dict())


def _hook_config() -> None:
    from vllm.config import VllmConfig

    original = VllmConfig.__post_init__
    if getattr(original, "_vtc", False):
        return

    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        apply_config(self)

    post_init._vtc = True
    VllmConfig.__post_init__ = post_init


def _let_vtc_settings_through() -> None:
    try:
        from vllm.entrypoints.generate.base import protocol
    except ImportError:  # a vLLM without the gate
        return
    original = getattr(protocol, "validate_request_mm_kwargs", None)
    if original is None or getattr(original, "_vtc", False):
        return

    @functools.wraps(original)
    def validate(*args, mm_processor_kwargs=None, **kwargs):
        if isinstance(mm_processor_kwargs, dict) and KEY in mm_processor_kwargs:
            mm_processor_kwargs = {name: value for name, value in mm_processor_kwargs.items() if name != KEY}
        return original(*args, mm_processor_kwargs=mm_processor_kwargs, **kwargs)

    validate._vtc = True
    # modules imported from here on bind the wrapper; those imported already bound the original by name
    protocol.validate_request_mm_kwargs = validate
    for module in list(sys.modules.values()):
        if getattr(module, "validate_request_mm_kwargs", None) is original:
            module.validate_request_mm_kwargs = validate


def _fix_cpu_runner() -> None:
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except Exception:  # not the CPU build
        return
    original = CPUModelRunner.load_model
    if getattr(original, "_vtc", False):
        return

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        from vllm.distributed import get_pp_group
        from vllm.model_executor.models.interfaces import supports_multimodal_pruning

        model = self.get_model()
        mm = self.model_config.multimodal_config
        self.is_multimodal_pruning_enabled = bool(
            supports_multimodal_pruning(model) and mm is not None and mm.is_multimodal_pruning_enabled()
        )
        if getattr(model, "vtc", None) is None:
            return out
        if not get_pp_group().is_first_rank and getattr(self, "intermediate_tensors", None) is None:
            self.intermediate_tensors = model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device
            )
        return out

    load_model._vtc = True
    CPUModelRunner.load_model = load_model
