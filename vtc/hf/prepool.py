"""Frame features right before a LLaVA model's 2x2 spatial pooling, for plugins that act at that grid.

AOT merges on LLaVA-OneVision's 27 x 27 projected grid and QuoTA resizes that grid per frame; both need the
features before `apply_pooling`. A method declares `MethodInfo(prepool=True)`; vtc then hooks the module where the
features pass and gives the plugin `ctx.prepool` ([F, h, w, D], one video's frames) and `ctx.pool`, the
model's own pooling (plus, on LLaVA-NeXT-Video where pooling precedes the projector, the projector), which
turns a grid of pre-pool features into LLM tokens. Qwen families have no such step (their 2x2 merger is
part of the vision tower), so there `ctx.prepool` is None.
"""

from __future__ import annotations

from typing import Callable

import torch

Tensor = torch.Tensor


class PrepoolCapture:
    def __init__(
        self,
        module: torch.nn.Module,
        side: tuple[int, int],
        pool: Callable[[Tensor], Tensor],
        capture: str,
        project: torch.nn.Module | None = None,
    ) -> None:
        self.module = module
        self.side = side
        self.model_pool = pool
        self.capture = capture  # "output" (projected features) or "input" (features entering the pooler)
        self.project = project
        self.calls: list[Tensor] = []
        self.enabled = True
        self._handle = None

    def install(self) -> None:
        if self.capture == "output":
            self._handle = self.module.register_forward_hook(lambda m, a, out: self._keep(out))
        else:
            self._handle = self.module.register_forward_pre_hook(lambda m, a: self._keep(a[0]))

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.calls.clear()

    def _keep(self, features: Tensor) -> None:
        if not self.enabled:
            return
        self.calls.append(features.detach())
        del self.calls[:-4]

    def pool(self, grid: Tensor) -> Tensor:
        """[F, h, w, D] pre-pool features -> [F, h', w', D_llm] tokens, exactly as the model computes them."""
        pooled = self.model_pool(grid)
        return self.project(pooled) if self.project is not None else pooled

    def projection(self, grid: Tensor) -> Tensor:
        """Apply only the projector still ahead of pre-pool features (identity when they are projected already)."""
        return self.project(grid) if self.project is not None else grid

    def per_video(self, frames: list[int]) -> list[Tensor]:
        """Split the latest captured call into one [F, h, w, D] grid per video."""
        total = sum(frames)
        call = next((c for c in reversed(self.calls) if c.shape[0] == total), None)
        if call is None:
            raise RuntimeError("no pre-pool features for these videos were captured")
        self.calls.clear()
        h, w = self.side
        grids, start = [], 0
        for f in frames:
            grids.append(call[start : start + f].reshape(f, h, w, -1))
            start += f
        return grids
