"""Offline vLLM engines in this process: `start` a `vllm.LLM` (with vtc's config, or none) and `shutdown` it so the
next engine in the same process starts clean. On a machine without CUDA: vLLM's CPU build, fp32, no worker
processes, a 256 MiB KV cache (what the tests, `vtc bench --backend vllm` and `--model vtc,backend=vllm` use)."""

from __future__ import annotations

import gc
import os
from typing import Any

from vtc.vllm.config import KEY

CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
CPU_OPTIONS = dict(
    distributed_executor_backend="uni", enforce_eager=True, dtype="float32", kv_cache_memory_bytes=1 << 28
)


def start(path: str, vtc: dict[str, Any] | None = None, **options: Any):
    """A `vllm.LLM` on `path` with `additional_config={"vtc": vtc}` (no vtc: the stock engine). `options` go to
    `vllm.LLM` and override the CPU defaults."""
    import torch

    cpu = not torch.cuda.is_available()
    if cpu:
        for name, value in CPU_ENV.items():
            os.environ.setdefault(name, value)
    from vllm import LLM

    merged: dict[str, Any] = dict(CPU_OPTIONS) if cpu else {}
    merged.update(options)
    merged["additional_config"] = {**(merged.get("additional_config") or {}), **({KEY: vtc} if vtc else {})}
    return LLM(path, **merged)


def shutdown(llm) -> None:
    """Stop an engine and its distributed state now, so the next engine in this process starts clean (a test that
    failed with an engine alive would otherwise keep it, through the traceback, until much later)."""
    llm.llm_engine.engine_core.shutdown()
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()
