"""The LLM side of a stream: prefill rows of embeddings onto a key/value cache the memory holds, and decode.

A memory keeps the cache as plain per-layer `(keys, values)` tensors ([1, kv_heads, L, head_dim], keys after
RoPE, as the attention layers cache them); each forward wraps them in a transformers `DynamicCache`, which
concatenates instead of writing in place, so the memory's tensors are never changed by a forward. Positions
are always passed explicitly, with a 2-D mask of ones (the prompt of a stream is never padded).

`StreamLLM` is the transformers implementation of `vtc.core.stream.StreamModel` (what memories run rows
through); the cache helpers and `Forward` live in `vtc.core.stream` (re-exported here). A memory that retrieves
per layer returns a `vtc.core.stream.Retrieval`; `retrieval_cache` builds the transformers cache for it.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from transformers import DynamicCache

from vtc.core.stream import (
    KV,
    AnswerPast,
    Forward,
    Retrieval,
    cache_length,
    concat_kv,
    kv_bytes,
    select_kv,
)
from vtc.hf.adapters import Adapter

Tensor = torch.Tensor

__all__ = [
    "KV",
    "Forward",
    "KeyRotation",
    "QueryCapture",
    "RetrievalCache",
    "StreamLLM",
    "cache_length",
    "concat_kv",
    "kv_bytes",
    "past_cache",
    "retrieval_cache",
    "select_kv",
]


class RetrievalCache(DynamicCache):
    """The transformers cache of a `vtc.core.stream.Retrieval`: layer l is filled, the first time the model writes
    to it, with what `fill(l)` retrieves (e.g. prefix + this layer's selected groups), so a memory's per-layer
    retrieval runs inside the question's own forward. Until a layer is filled it reports `length` past rows."""

    def __init__(self, fill, length: int) -> None:
        super().__init__()
        self._fill = fill
        self._length = length
        self._filled: set[int] = set()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._length if layer_idx not in self._filled else super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if layer_idx not in self._filled:
            return self._length + query_length, 0
        return super().get_mask_sizes(query_length, layer_idx)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx not in self._filled:
            keys, values = self._fill(layer_idx)
            super().update(keys.to(key_states.dtype), values.to(value_states.dtype), layer_idx)
            self._filled.add(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def retrieval_cache(retrieval: Retrieval) -> RetrievalCache:
    """The transformers cache that fills itself layer by layer from a memory's `Retrieval`."""
    return RetrievalCache(retrieval.fill, retrieval.length)


def past_cache(past: AnswerPast) -> tuple[KV | None, Any]:
    """(kv, cache) for `StreamLLM.greedy` from a memory's `AnswerPast`: its tensors, or the cache object built
    from its `retrieval`."""
    if past.retrieval is not None:
        return None, retrieval_cache(past.retrieval)
    return past.kv, None


class StreamLLM:
    """Runs one model's text model on embeddings, with explicit positions and a cache given as tensors."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter
        self.model = adapter.model
        self.text_model = adapter.text_model
        self.mrope = adapter.mrope
        self.device = next(self.model.parameters()).device
        self.dtype = self.adapter.embed(torch.zeros(1, dtype=torch.long, device=self.device)).dtype

    @property
    def num_layers(self) -> int:
        return len(self.adapter.decoder_layers)

    def key_rotation(self) -> "KeyRotation":
        """Rotates keys stored before RoPE to positions (`vtc.core.stream.KeyRotation`)."""
        return KeyRotation(self.adapter)

    def capture_queries(self) -> "QueryCapture":
        """Installs a `QueryCapture` (`vtc.core.stream.QueryProbe`) on the model until it is removed."""
        return QueryCapture(self.adapter)

    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    @torch.no_grad()
    def forward(
        self,
        embeds: Tensor,
        positions: Tensor,
        past: KV | None = None,
        *,
        cache: Any = None,
        deepstack: Tensor | None = None,
        visual: Tensor | None = None,
    ) -> Forward:
        """Run rows `embeds` [L, D] at `positions` [P, L] after the cache `past` (or a ready `cache` object).
        `deepstack` [N, levels, D]: Qwen3-VL's DeepStack features of the rows marked by `visual` [L]."""
        n = embeds.shape[0]
        if cache is None:
            cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in past]) if past else DynamicCache()
        before = int(cache.get_seq_length())
        pos = positions.to(self.device)
        position_ids = pos[:, None, :] if self.mrope else pos[0][None]
        mask = torch.ones(1, before + n, dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {}
        if deepstack is not None and visual is not None and bool(visual.any()):
            kwargs["visual_pos_masks"] = visual.to(self.device)[None]
            kwargs["deepstack_visual_embeds"] = [
                deepstack[:, level].to(self.device) for level in range(deepstack.shape[1])
            ]
        out = self.text_model(
            inputs_embeds=embeds.to(self.device, self.dtype)[None],
            position_ids=position_ids,
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            **kwargs,
        )
        hidden = out.last_hidden_state[0]
        logits = self.lm_head()(hidden[-1:]).float()[0]
        whole = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        new = [(k[:, :, before:], v[:, :, before:]) for k, v in whole]
        return Forward(logits, new, hidden, whole)

    @torch.no_grad()
    def greedy(
        self,
        past: KV | None,
        embeds: Tensor,
        positions: Tensor,
        next_position: int,
        max_new_tokens: int,
        eos: set[int],
        cache: Any = None,
    ) -> tuple[list[int], Tensor, float]:
        """Prefill `embeds` after `past`, then greedy decoding. Returns (token ids, first-token logits,
        seconds to the first token). The caller's `past` is not changed."""
        start = time.perf_counter()
        if cache is None:
            cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in past]) if past else DynamicCache()
        first = self.forward(embeds, positions, cache=cache)
        ttft = time.perf_counter() - start
        logits = first.logits
        ids: list[int] = []
        position = next_position
        for _ in range(max_new_tokens):
            token = int(torch.argmax(logits))
            ids.append(token)
            if token in eos:
                break
            if len(ids) == max_new_tokens:
                break
            emb = self.adapter.embed(torch.tensor([token], device=self.device))
            rows = 3 if self.mrope else 1
            logits = self.forward(emb, torch.full((rows, 1), position), cache=cache).logits
            position += 1
        return ids, first.logits, ttft


def rope_function(adapter: Adapter):
    """(rotary embedding module, apply(keys, cos, sin)) of the model's attention, to rotate stored keys.

    Qwen2-VL / Qwen2.5-VL rotate with `apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section)`; the
    other families' rotary modules already fold the M-RoPE sections (Qwen3-VL) or are 1-D, and rotate with
    `apply_rotary_pos_emb(q, k, cos, sin)`."""
    attention = adapter.decoder_layers[0].self_attn
    module = sys.modules[type(attention).__module__]
    rotary = adapter.text_model.rotary_emb
    if hasattr(module, "apply_multimodal_rotary_pos_emb"):
        section = adapter.text_model.config.rope_parameters["mrope_section"]

        def apply(keys, cos, sin):
            return module.apply_multimodal_rotary_pos_emb(keys, keys, cos, sin, section)[1]

    else:

        def apply(keys, cos, sin):
            return module.apply_rotary_pos_emb(keys, keys, cos, sin)[1]

    return rotary, apply


class KeyRotation:
    """Rotate keys [1, heads, L, d] stored before RoPE to their positions [P, L] (or undo a rotation)."""

    def __init__(self, adapter: Adapter) -> None:
        self.mrope = adapter.mrope
        self.rotary, self.apply = rope_function(adapter)

    def __call__(self, keys: Tensor, positions: Tensor, inverse: bool = False) -> Tensor:
        pos = positions.to(keys.device)
        position_ids = pos[:, None, :] if self.mrope else pos[0][None]
        cos, sin = self.rotary(keys, position_ids)
        if inverse:
            sin = -sin
        return self.apply(keys, cos.to(keys.dtype), sin.to(keys.dtype))


class QueryCapture:
    """Every decoder layer's queries before RoPE (after Qwen3's q_norm) in the forwards run while it is installed:
    what retrieval memories compare with their stored keys. `mean(layer)` is the retrieval query of StreamingTOM
    and MemStream: the queries averaged over the tokens and over the query heads of each KV head -> [kv_heads * d]."""

    def __init__(self, adapter: Adapter) -> None:
        self.kv_heads = int(adapter.text_model.config.num_key_value_heads)
        self.queries: dict[int, Tensor] = {}
        self._hooks = []
        for layer, block in enumerate(adapter.decoder_layers):
            attention = block.self_attn
            source = getattr(attention, "q_norm", None) or attention.q_proj

            def capture(module, args, output, layer=layer):
                self.queries[layer] = output[0].detach()

            self._hooks.append(source.register_forward_hook(capture))

    def mean(self, layer: int, head_dim: int) -> Tensor:
        query = self.queries[layer].float()
        return query.reshape(query.shape[0], self.kv_heads, -1, head_dim).mean(dim=(0, 2)).reshape(-1)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def __enter__(self) -> "QueryCapture":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
