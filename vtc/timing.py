"""Measuring prefill: time inside the language model, peak memory, and the "limit" a method is compared
with (the same model's decoder layers running the same token counts with no compression logic at all)."""

from __future__ import annotations

import contextlib
import threading
import time

import psutil
import torch

from vtc.adapters import resolve_adapter


def synchronize(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize(device)


class LLMTimer:
    """Times every forward of the model's language model (pre-hook to post-hook). Install it *after*
    `vtc.patch` so it measures what the LLM does, compression inside it included, and not the connect
    stage (which vtc records in its stats)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.text_model = resolve_adapter(model).text_model
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
            self.text_model.register_forward_pre_hook(pre, with_kwargs=True),
            self.text_model.register_forward_hook(post, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    @property
    def first(self) -> float:
        return self.durations[0] if self.durations else float("nan")


class PeakMemory:
    """Peak memory while a block runs: CUDA allocator peak on GPU, else sampled process RSS above the level
    at entry (CPU allocators keep freed memory, so this is an upper bound on the block's own use)."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak_bytes = 0
        self._stop = threading.Event()

    def __enter__(self) -> "PeakMemory":
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return self
        self._process = psutil.Process()
        self._base = self._process.memory_info().rss
        self._max = self._base
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._max = max(self._max, self._process.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        if torch.cuda.is_available():
            self.peak_bytes = torch.cuda.max_memory_allocated() - self._base
            return
        self._stop.set()
        self._thread.join()
        self._max = max(self._max, self._process.memory_info().rss)
        self.peak_bytes = self._max - self._base

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / 2**20


def plain_prefill_seconds(model: torch.nn.Module, text_tokens: int, layer_visual: list[int], repeats: int = 1,
                          seed: int = 0) -> float:
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
                hidden = layer(hidden, attention_mask=None, position_embeddings=(cos[:, :n], sin[:, :n]),
                               position_ids=None)
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
