"""How a family's vision tower lands on the LLM token grid, so a plugin never branches on family names or reads
a model config to map vision-tower statistics (attention maps, keys) onto its tokens.

  Qwen-VL families: statistics already come per LLM token (2x2 merge units averaged): nothing to map.
  LLaVA-OneVision / LLaVA-Video: SigLIP 27 x 27 patches per frame (no CLS), pooled bilinearly to 14 x 14.
  LLaVA-NeXT-Video: CLIP 24 x 24 patches + CLS per frame, pooled 2 x 2 (average, or max per the config) to 12 x 12.

The HF adapters build the geometry of the loaded model from its config (`Adapter.geometry`); `default_geometry`
gives the published checkpoints' geometry from the family name alone (each family declares it in its `Family`
record, `vtc.core.families`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
POOLING = ("none", "bilinear", "average", "max")


@dataclasses.dataclass(frozen=True)
class FamilyGeometry:
    """family: the adapter's family name.
    mrope: 3-D (t, h, w) M-RoPE positions (Qwen) instead of 1-D RoPE (LLaVA).
    patch_grid: (rows, cols) of vision-tower patches per frame, when the tower's grid differs from the LLM token
        grid (LLaVA); None when vision statistics are already on the token grid (Qwen).
    cls_tokens: leading non-patch tokens in the tower's per-frame sequence (CLIP: 1).
    pooling: how the model turns the patch grid into the token grid: "bilinear" (LLaVA-OneVision's
        interpolate to ceil(side / 2)), "average" / "max" (LLaVA-NeXT-Video's 2 x 2 pooler), "none" (Qwen).
    pool_before_projector: the pooling runs before the projector (LLaVA-NeXT-Video), so pre-pool features are
        vision-tower features; False when the projector runs first (LLaVA-OneVision).
    """

    family: str
    mrope: bool
    patch_grid: tuple[int, int] | None = None
    cls_tokens: int = 0
    pooling: str = "none"
    pool_before_projector: bool = False

    def __post_init__(self):
        if self.pooling not in POOLING:
            raise ValueError(f"pooling must be one of {', '.join(POOLING)}, got {self.pooling!r}")

    @property
    def has_prepool_grid(self) -> bool:
        """The model pools a finer patch grid into its tokens (LLaVA), so pre-pool features exist."""
        return self.patch_grid is not None

    def patch_map(self, values: Tensor) -> Tensor:
        """Per-frame tower values [F, L] or [F, L, C] (CLS first where the tower has one) -> the patches only,
        [F, rows, cols(, C)]."""
        if self.patch_grid is None:
            raise ValueError(f"{self.family}: vision statistics are already on the token grid (no patch grid)")
        rows, cols = self.patch_grid
        patches = values[:, self.cls_tokens :]
        if patches.shape[1] != rows * cols:
            expected = f"{self.cls_tokens} + {rows}x{cols}"
            raise ValueError(f"{self.family}: expected {expected} tower tokens per frame, got {values.shape[1]}")
        return patches.reshape(patches.shape[0], rows, cols, *patches.shape[2:])

    def to_token_grid(self, values: Tensor, size: tuple[int, int], pooling: str | None = None) -> Tensor:
        """Map per-frame tower values [F, L] or [F, L, C] onto the LLM token grid `size` = (H, W) -> [F, H*W(, C)],
        pooled the way the model pools its features (or with `pooling` when a method's official code pools
        differently). Values already on the token grid (Qwen) come back unchanged."""
        h, w = size
        if self.patch_grid is None or (values.shape[1] == h * w and self.cls_tokens == 0):
            return values
        return self.pool_grid(self.patch_map(values), size, pooling)

    def pool_grid(self, grid: Tensor, size: tuple[int, int], pooling: str | None = None) -> Tensor:
        """Pool values on the patch grid, [F, rows, cols] or [F, rows, cols, C] (no CLS), to the token grid
        `size` = (H, W) -> [F, H*W(, C)], as the model pools its features (or with `pooling`)."""
        h, w = size
        squeeze = grid.dim() == 3
        x = (grid.unsqueeze(-1) if squeeze else grid).permute(0, 3, 1, 2)  # [F, C, rows, cols]
        mode = pooling or self.pooling
        if mode == "bilinear":
            x = F.interpolate(x, size=[h, w], mode="bilinear")
        elif mode in ("average", "max"):
            kernel = (x.shape[2] // h, x.shape[3] // w)
            x = F.avg_pool2d(x, kernel) if mode == "average" else F.max_pool2d(x, kernel)
        else:
            raise ValueError(f"{self.family}: cannot pool a patch map with mode {mode!r}")
        out = x.permute(0, 2, 3, 1).reshape(x.shape[0], h * w, -1)
        return out[..., 0] if squeeze else out

    def token_grid_size(self) -> tuple[int, int] | None:
        """(H, W) of the LLM token grid of one frame, when it follows from the patch grid alone."""
        if self.patch_grid is None:
            return None
        rows, cols = self.patch_grid
        if self.pooling == "bilinear":
            return math.ceil(rows / 2), math.ceil(cols / 2)
        return rows // 2, cols // 2


def default_geometry(family: str) -> FamilyGeometry:
    """The geometry of the published checkpoints of `family` (declared by its `Family` record)."""
    from vtc.core.families import get_family  # the registry imports this module

    return get_family(family).geometry


def __getattr__(name: str):
    # `DEFAULT_GEOMETRY` (family -> geometry) is derived from the family registry on use
    if name == "DEFAULT_GEOMETRY":
        from vtc.core.families import families

        return {f.name: f.geometry for f in families()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
