"""Argument checks shared by the segmented ops over square matrices (one [L, L] matrix, or a batch [S, L, L]
padded to the longest segment with per-segment `lengths` [S])."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def square_segments(dist: Tensor, lengths: Tensor | None, op: str) -> tuple[Tensor, Tensor, bool]:
    """(dist as [S, L, L], lengths [S] int64 on dist's device, whether dist came as one [L, L] matrix).

    Raises ValueError naming `op` when dist is not [L, L] / [S, L, L], when lengths is given for a single
    matrix, or when lengths is not [S] integers in [0, L]."""
    if dist.dim() not in (2, 3) or dist.shape[-1] != dist.shape[-2]:
        raise ValueError(f"{op}: dist must be [L, L] or [S, L, L] (square), got shape {tuple(dist.shape)}")
    single = dist.dim() == 2
    if single:
        if lengths is not None:
            raise ValueError(f"{op}: lengths is for a batch dist [S, L, L]; got a single matrix [L, L]")
        dist = dist.unsqueeze(0)
    segments, size = dist.shape[0], dist.shape[-1]
    if lengths is None:
        return dist, torch.full((segments,), size, dtype=torch.long, device=dist.device), single
    if not isinstance(lengths, Tensor) or lengths.shape != (segments,) or lengths.is_floating_point():
        got = tuple(lengths.shape) if isinstance(lengths, Tensor) else type(lengths).__name__
        raise ValueError(f"{op}: lengths must be an integer tensor [S] = [{segments}], got {got}")
    lengths = lengths.to(device=dist.device, dtype=torch.long)
    if segments and bool(((lengths < 0) | (lengths > size)).any()):
        raise ValueError(f"{op}: lengths must lie in [0, {size}] (the padded size), got {lengths.tolist()}")
    return dist, lengths, single
