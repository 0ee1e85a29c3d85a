"""What an encode-stage method sees: `VideoPatches`, one video's patches as the vision tower receives them.

The tower's input is grouped in merge units: on the Qwen families, the `merge x merge` patches that the merger
folds into one LLM token (4 consecutive rows of `pixel_values_videos`, in raster order of the token grid). A method
that acts before the tower keeps whole units, so the merger still gets complete groups and every surviving unit is
exactly one LLM token at its original (t, h, w). `select` is the only change a method makes; `kept` records which
units of the original grid survive, and the backend runs the tower on those alone.
"""

from __future__ import annotations

import dataclasses

import torch

Tensor = torch.Tensor
Grid = tuple[int, int, int]


@dataclasses.dataclass
class VideoPatches:
    """One video's vision-tower input, grouped in merge units.

    pixels       [T*H*W, unit, C*tp*P*P]: the processor's normalised patches of every unit of the original grid
                 (unit = merge**2 patches, each flattened as (C, tp, P, P): channels, temporal patch, rows, cols)
    grid         (T, H, W): the token grid (units); T counts temporal patches (tp input frames each)
    patch_shape  (C, tp, P, P)
    mean, std    per-channel normalisation of the processor (pixel = (value - mean) / std, value in [0, 1])
    kept         [k] indices of the surviving units on the original grid, ascending
    """

    pixels: Tensor
    grid: Grid
    patch_shape: tuple[int, int, int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    kept: Tensor

    @classmethod
    def from_rows(
        cls,
        rows: Tensor,
        grid_thw: tuple[int, int, int],
        merge: int,
        patch_shape: tuple[int, int, int, int],
        mean: tuple[float, ...],
        std: tuple[float, ...],
    ) -> VideoPatches:
        """From one video's rows of `pixel_values_videos` [t*h*w, C*tp*P*P] and its `video_grid_thw` row (in
        patches)."""
        t, h, w = (int(v) for v in grid_thw)
        unit = merge * merge
        grid = (t, h // merge, w // merge)
        units = rows.reshape(t * (h // merge) * (w // merge), unit, rows.shape[-1])
        kept = torch.arange(units.shape[0], device=rows.device)
        return cls(units, grid, patch_shape, tuple(mean), tuple(std), kept)

    def __len__(self) -> int:
        return int(self.kept.numel())

    @property
    def num_units(self) -> int:
        """Units of the original grid."""
        return int(self.pixels.shape[0])

    @property
    def units_per_frame(self) -> int:
        return self.grid[1] * self.grid[2]

    def frame_row_col(self) -> tuple[Tensor, Tensor, Tensor]:
        """Temporal index, row and column on the token grid of every surviving unit."""
        _, h, w = self.grid
        return self.kept // (h * w), (self.kept // w) % h, self.kept % w

    def values(self, temporal_slice: int | None = 0) -> Tensor:
        """The surviving units' pixels de-normalised to [0, 1] as [k, unit, C, tp, P, P] (or one temporal slice of
        each patch, [k, unit, C, P, P]), in float32."""
        c, tp, p, q = self.patch_shape
        x = self.pixels[self.kept].float().reshape(len(self), -1, c, tp, p, q)
        mean = torch.tensor(self.mean, dtype=torch.float32, device=x.device).view(1, 1, c, 1, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32, device=x.device).view(1, 1, c, 1, 1, 1)
        x = x * std + mean
        return x if temporal_slice is None else x[:, :, :, temporal_slice]

    def select(self, keep: Tensor) -> VideoPatches:
        """Keep the surviving units at positions `keep` (indices into the current survivors; sorted here, so the
        units stay in grid order)."""
        keep = torch.as_tensor(keep, dtype=torch.long, device=self.kept.device).flatten()
        if keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= len(self)):
            raise IndexError(f"select: indices must be in [0, {len(self)}), got {keep.min()}..{keep.max()}")
        if torch.unique(keep).numel() != keep.numel():
            raise ValueError("select: an index appears twice; a unit is either kept or dropped")
        return dataclasses.replace(self, kept=self.kept[torch.sort(keep).values])

    def rows(self) -> Tensor:
        """Row indices into this video's `pixel_values_videos` of every surviving patch (unit by unit)."""
        unit = int(self.pixels.shape[1])
        return (self.kept[:, None] * unit + torch.arange(unit, device=self.kept.device)).flatten()
