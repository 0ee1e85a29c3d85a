"""Vision-tower statistics from vLLM's own vision encoders, for connect plugins that read them (VisionZip,
FastVID, AOT, HoliTom).

Every vision tower vLLM runs for the five families sends its attention through one layer type,
`MMEncoderAttention` (query/key after RoPE, and `cu_seqlens` marking frames or windows on Qwen towers). vtc hooks
the instances at the layers plugins ask for, only while a video is encoded, and computes the statistics with the
same code as the HF backend (`vtc.core.vision_stats.frame_stats`), so a plugin gets the same tensors from either
backend.
Under tensor parallelism each rank holds some of the heads: head means are averaged over the ranks.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from vtc.core.vision_stats import HIDDEN_KINDS, VisionStat, frame_stats
from vtc.hf.adapters.base import llava_stats_per_video, tower_feature_layer
from vtc.hf.adapters.qwen2_vl import qwen_stats_on_grid

Tensor = torch.Tensor
HEAD_MEAN_KINDS = ("received", "keys", "mean_query")  # statistics averaged over heads


def encoder_attention_layers(tower: torch.nn.Module) -> list[torch.nn.Module]:
    """The `MMEncoderAttention` of every encoder layer of a vLLM vision tower, in layer order."""
    from vllm.model_executor.layers.attention import MMEncoderAttention

    return [m for m in tower.modules() if isinstance(m, MMEncoderAttention)]


def tp_group():
    """vLLM's tensor-parallel group when there are several ranks, else None (one rank, or a model built outside an
    engine, with no distributed state)."""
    try:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
    except Exception:
        return None
    return group if group.world_size > 1 else None


class EncoderStatsCapture:
    """Captures `stats` while `capturing()` is active; `per_video(...)` turns them into one dict per video."""

    def __init__(self, family: str, tower: torch.nn.Module, config, stats: set[VisionStat], qwen: bool) -> None:
        self.family = family
        self.qwen = qwen
        self.config = config
        layers = encoder_attention_layers(tower)
        if qwen:
            feature = int(config.vision_config.depth) - 1 if hasattr(config.vision_config, "depth") else len(layers) - 1
        else:
            feature = tower_feature_layer(config.vision_feature_layer, int(config.vision_config.num_hidden_layers))
        self.layer_of: dict[VisionStat, int] = {}
        self.kinds_at: dict[int, set[str]] = {}
        for stat in stats:
            if stat.kind in HIDDEN_KINDS:
                raise ValueError(
                    f"vision statistic {stat.kind!r} (a layer's hidden states) is not available from vLLM's vision "
                    "encoders; drop the parameter that asks for it (fastvid: head=)"
                )
            layer = stat.layer if stat.layer >= 0 else feature + 1 + stat.layer
            if not 0 <= layer < len(layers):
                raise ValueError(
                    f"vision statistic {stat.kind!r} at layer {stat.layer} resolves to encoder layer {layer}, but the "
                    f"{family} vision encoder vLLM built has layers 0..{len(layers) - 1}"
                )
            self.layer_of[stat] = layer
            self.kinds_at.setdefault(layer, set()).add(stat.kind)
        self.modules = {layers[i]: i for i in self.kinds_at}
        self.calls: list[dict[str, Any]] = []
        self.group = tp_group()

    @contextlib.contextmanager
    def capturing(self, grid_thw: Tensor | None, items: int):
        """Record the statistics of one tower run (`grid_thw` for Qwen towers, `items` frames for LLaVA)."""
        self.calls = [{"grid_thw": grid_thw, "items": items, "chunks": {}}]
        handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in self.modules]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _hook(self, module, args, kwargs) -> None:
        names = ("query", "key", "value", "cu_seqlens")
        values = dict(zip(names, args))
        values.update({k: v for k, v in kwargs.items() if k in names})
        query, key, cu_seqlens = values["query"], values["key"], values.get("cu_seqlens")
        layer = self.modules[module]
        kinds = self.kinds_at[layer]
        heads = int(module.num_heads)
        if query.dim() == 3:  # [B, L, heads * d]
            query = query.unflatten(-1, (heads, -1))
            key = key.unflatten(-1, (int(module.num_kv_heads), -1))
        if key.shape[2] != query.shape[2]:  # grouped heads: repeat the keys, as the attention does
            key = key.repeat_interleave(query.shape[2] // key.shape[2], dim=2)
        q, k = query.detach().transpose(1, 2), key.detach().transpose(1, 2)  # [B, heads, L, d]
        chunks = self.calls[-1]["chunks"].setdefault(layer, [])
        if cu_seqlens is not None and q.shape[0] == 1:
            bounds = cu_seqlens.tolist()
            for start, end in zip(bounds[:-1], bounds[1:]):
                chunks.append(
                    self._reduce(frame_stats(q[..., start:end, :], k[..., start:end, :], module.scale, kinds))
                )
        else:
            chunks.append(self._reduce(frame_stats(q, k, module.scale, kinds)))

    def _reduce(self, stats: dict[str, Tensor]) -> dict[str, Tensor]:
        """Average the head means over tensor-parallel ranks (each rank saw its share of the heads)."""
        if self.group is None:
            return stats
        out = {}
        for kind, value in stats.items():
            if kind in HEAD_MEAN_KINDS:
                out[kind] = self.group.all_reduce(value.contiguous()) / self.group.world_size
            else:  # "cls" keeps its heads: [F, heads, L]
                out[kind] = self.group.all_gather(value.contiguous(), dim=1)
        return out

    def per_video(self, grids: list[tuple[int, int, int]]) -> list[dict[VisionStat, Tensor]]:
        if not self.layer_of:
            return [{} for _ in grids]
        if self.qwen:
            merge = int(self.config.vision_config.spatial_merge_size)
            return qwen_stats_on_grid(merge, self.calls, grids, self.layer_of, self._window_index())
        return llava_stats_per_video(self.calls, [g[0] for g in grids], self.layer_of)

    def _window_index(self):
        if self.family != "qwen2_5_vl":
            return None
        from transformers.vision_utils import get_vision_window_index

        vision = self.config.vision_config

        def window_index(grid_thw):
            return get_vision_window_index(grid_thw, vision.spatial_merge_size, vision.window_size, vision.patch_size)[
                0
            ]

        return window_index
