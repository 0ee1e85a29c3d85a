"""Vision-tower attention statistics for `connect` plugins (HF backend), captured only at the layers plugins
ask for (`vtc.core.vision_stats.VisionStat` lists the kinds and their shapes).

Methods such as VisionZip, HoliTom, AOT and FastVID rank visual tokens by how much attention they receive
inside the vision encoder. Their official code switches the whole tower to eager attention; vtc instead
routes the tower's attention through its registered attention function (`vtc_sdpa`), and for the requested
layers only computes the statistic from that layer's query/key (in chunks of frames, so the full maps
never sit in memory; `vtc.core.vision_stats.frame_stats`, shared with the vLLM backend), then calls the original
attention. Other layers pass straight through.
"""

from __future__ import annotations

from typing import Any

import torch

from vtc.core.vision_stats import HIDDEN_KINDS, KINDS, VisionStat, frame_stats  # noqa: F401  (re-exported)
from vtc.hf.llm import attention as attn_mod

Tensor = torch.Tensor


class VisionCapture:
    """Installs the capture on one model's vision tower and hands per-video statistics to the connect stage."""

    def __init__(self, adapter, stats: set[VisionStat]) -> None:
        self.adapter = adapter
        self.stats = stats
        modules = adapter.vision_attention_modules()
        feature = adapter.vision_feature_layer()
        self.by_module: dict[torch.nn.Module, set[str]] = {}
        self.hidden_layers: dict[torch.nn.Module, int] = {}  # encoder layer -> index, for HIDDEN_KINDS
        self.layer_of: dict[VisionStat, int] = {}
        for stat in sorted(stats, key=lambda s: (s.kind, s.layer)):
            layer = stat.layer if stat.layer >= 0 else feature + 1 + stat.layer
            if not 0 <= layer < len(modules):
                raise ValueError(
                    f"vision statistic {stat.kind!r} at layer {stat.layer} resolves to encoder layer {layer}, but this "
                    f"{adapter.family} vision tower has layers 0..{len(modules) - 1} (its features come from layer "
                    f"{feature}; negative layers count back from it: -1 = {feature}, -2 = {feature - 1}, ...)"
                )
            self.layer_of[stat] = layer
            if stat.kind in HIDDEN_KINDS:
                self.hidden_layers[adapter.vision_encoder_layers()[layer]] = layer
            else:
                self.by_module.setdefault(modules[layer], set()).add(stat.kind)
        self.module_layer = {m: i for i, m in enumerate(modules)}
        self.calls: list[dict[str, Any]] = []
        self.enabled = True
        self._handles: list = []
        self._config = adapter.vision_tower.config
        self._attn_before: str | None = None
        self._original: dict[torch.nn.Module, Any] = {}

    def install(self) -> None:
        attn_mod.ensure_registered()
        self._attn_before = self._config._attn_implementation
        for module in self.module_layer:
            self._original[module] = attn_mod.original_attention(self._attn_before, module)
            attn_mod.RUNTIME_BY_MODULE[module] = self
        self._config._attn_implementation = attn_mod.ATTENTION_NAME
        self._handles.append(self.adapter.vision_tower.register_forward_pre_hook(self._start_call, with_kwargs=True))
        for module in self.hidden_layers:
            self._handles.append(module.register_forward_hook(self._layer_output))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self._original:
            attn_mod.RUNTIME_BY_MODULE.pop(module, None)
        self._original.clear()
        self._config._attn_implementation = self._attn_before
        self.calls.clear()

    def _start_call(self, module, args, kwargs) -> None:
        if not self.enabled:
            return
        pixels = args[0] if args else next(iter(kwargs.values()))
        self.calls.append({"grid_thw": kwargs.get("grid_thw"), "items": int(pixels.shape[0]), "chunks": {}})
        del self.calls[:-4]  # images and videos of one prompt; older calls are stale

    def _layer_output(self, module, args, output) -> None:
        if self.calls and self.enabled:
            hidden = output[0] if isinstance(output, tuple) else output
            chunks = self.calls[-1]["chunks"].setdefault(self.hidden_layers[module], [])
            chunks.append({"features": hidden.detach()})

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        kinds = self.by_module.get(module)
        if kinds and self.calls and self.enabled:
            scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
            layer = self.module_layer[module]
            chunks = self.calls[-1]["chunks"].setdefault(layer, [])
            chunks.append(frame_stats(query.detach(), key.detach(), scaling, kinds))
        return self._original[module](module, query, key, value, attention_mask, **kwargs)

    def media_stats(self, videos, images) -> dict[tuple[str, int], dict[VisionStat, Tensor]]:
        """Per item, by (kind, index, view): each requested statistic on its frames; consumes the captured calls."""
        out = {}
        if videos:
            per_video = self.adapter.vision_stats_per_video(self.calls, videos, self.layer_of)
            out.update({s.key: stats for s, stats in zip(videos, per_video)})
        if images:
            per_image = self.adapter.vision_stats_per_image(self.calls, images, self.layer_of)
            out.update({s.key: stats for s, stats in zip(images, per_image)})
        self.calls.clear()
        return out

    def video_stats(self, spans) -> list[dict[VisionStat, Tensor]]:
        """Per video (in `spans` order), each requested statistic on its frames; consumes the captured calls."""
        per_video = self.adapter.vision_stats_per_video(self.calls, spans, self.layer_of)
        self.calls.clear()
        return per_video
