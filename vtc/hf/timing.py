"""Measuring prefill: time inside the language model, peak memory, and the "limit" a method is compared
with (the same model's decoder layers running the same token counts with no compression logic at all)."""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from vtc.hf.adapters import resolve_adapter


def synchronize(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize(device)


class ModuleTimer:
    """Times every forward of one module (pre-hook to post-hook): `durations`, `first`, `total`."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.durations: list[float] = []
        self._start = 0.0
        self._handles: list = []

    def __enter__(self) -> "LLMTimer":
        def pre(module, args, kwargs):
            synchronize()
            self._start = time.perf_counter()

        def post(module, args, kwargs, output):
            synchronize()
            self.durations.append(time.perf_counter() - self._start)

        # registered after vtc's hooks: vtc's pre-hook (the connect stage) runs before the clock starts
        self._handles = [
            self.module.register_forward_pre_hook(pre, with_kwargs=True),
            self.module.register_forward_hook(post, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    @property
    def first(self) -> float:
        return self.durations[0] if self.durations else float("nan")

    @property
    def total(self) -> float:
        return sum(self.durations)


class LLMTimer(ModuleTimer):
    """Times every forward of the model's language model. Install it *after* `vtc.patch` so it measures what the
    LLM does, compression inside it included, and not the connect stage (which vtc records in its stats)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(resolve_adapter(model).text_model)


class VisionTimer(ModuleTimer):
    """Times every forward of the model's vision tower (the merger / projector of the Qwen families included)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(resolve_adapter(model).vision_tower)


def peak_memory_mb(fn: Callable[[], object]) -> float:
    """Peak tensor memory (MB above the level at entry) while `fn()` runs.

    On CUDA: the caching allocator's peak. On CPU: the allocation/free stream recorded by the PyTorch
    profiler (`profile_memory=True`), summed in time order; process RSS would hide most of it because the
    CPU allocator keeps freed pages. The profiler slows the run, so call this in a separate, untimed pass.
    """
    if torch.cuda.is_available():
        synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    current = peak = 0
    for event in events:
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak / 2**20


@contextlib.contextmanager
def _quiet_stderr():
    """Silence the profiler's C++ log lines (they go straight to file descriptor 2)."""
    import os
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def plain_prefill_seconds(
    model: torch.nn.Module, text_tokens: int, layer_visual: list[int], repeats: int = 1, seed: int = 0
) -> float:
    """Best-of-`repeats` time for the model's decoder layers to prefill `text_tokens + layer_visual[i]` tokens
    at layer i, with no compression logic: random hidden states, plain causal SDPA, the sequence simply
    shorter from the layer where the count drops. This is the speed a method with that token schedule could
    reach if its own work were free."""
    adapter = resolve_adapter(model)
    text = adapter.text_model
    layers = adapter.decoder_layers
    if len(layer_visual) != len(layers):
        raise ValueError(f"need one token count per layer ({len(layers)}), got {len(layer_visual)}")
    param = next(text.parameters())
    generator = torch.Generator().manual_seed(seed)
    longest = text_tokens + max(layer_visual)
    hidden0 = torch.randn(1, longest, text.config.hidden_size, generator=generator).to(param.device, param.dtype)
    positions = torch.arange(longest, device=param.device)[None]
    if adapter.mrope:
        positions = positions[None].expand(3, 1, -1)
    cos, sin = text.rotary_emb(hidden0, positions)
    best = float("inf")
    with torch.no_grad():
        for _ in range(max(1, repeats)):
            synchronize()
            start = time.perf_counter()
            hidden = hidden0[:, : text_tokens + layer_visual[0]]
            for i, layer in enumerate(layers):
                n = text_tokens + layer_visual[i]
                hidden = hidden[:, :n]
                hidden = layer(
                    hidden, attention_mask=None, position_embeddings=(cos[:, :n], sin[:, :n]), position_ids=None
                )
            text.norm(hidden)
            synchronize()
            best = min(best, time.perf_counter() - start)
    return best


@contextlib.contextmanager
def torch_threads(num: int | None):
    """Temporarily set torch's intra-op threads (benchmarks pin them for repeatable numbers)."""
    if num is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(before)
