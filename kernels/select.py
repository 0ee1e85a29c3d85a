"""Selection ops: top-k keep (with deterministic order) and exact-count reconciliation, per segment in one call
(`segmented_topk`, `topk_gather`: the values of S segments laid end to end, segment s = offsets[s]:offsets[s+1])."""

from __future__ import annotations

import operator
from typing import Sequence

import torch

from vtc_kernels.dispatch import Tolerance, kernel_op

Tensor = torch.Tensor


def topk_indices(scores: Tensor, k: int, largest: bool = True, sort_indices: bool = True) -> Tensor:
    """Indices of the k best scores; ascending index order when `sort_indices` (original token order),
    else score order (as `torch.topk` returns them)."""
    k = max(0, min(int(k), scores.numel()))
    idx = torch.topk(scores, k, largest=largest).indices
    return torch.sort(idx).values if sort_indices else idx


def topk_mask(scores: Tensor, k: int, candidates: Tensor | None = None, largest: bool = True) -> Tensor:
    """Bool mask of the k best entries of `scores`, among `candidates` (bool mask) when given."""
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if candidates is None:
        mask[topk_indices(scores, k, largest)] = True
        return mask
    pool = torch.nonzero(candidates).flatten()
    mask[pool[topk_indices(scores[pool], k, largest)]] = True
    return mask


def reconcile_count(keep: Tensor, scores: Tensor, target: int) -> Tensor:
    """Make a keep mask hold exactly `target` entries: drop the lowest-scored kept entries, or add the
    highest-scored dropped ones. This is how every fixed-count mode turns an adaptive selection into the
    count promised by `retained_count` (the serving contract)."""
    keep = keep.clone()
    count = int(keep.sum())
    target = max(0, min(int(target), keep.numel()))
    if count > target:
        kept = torch.nonzero(keep).flatten()
        drop = kept[torch.topk(scores[kept].float(), count - target, largest=False).indices]
        keep[drop] = False
    elif count < target:
        dropped = torch.nonzero(~keep).flatten()
        add = dropped[torch.topk(scores[dropped].float(), target - count).indices]
        keep[add] = True
    return keep


# --- segmented top-k ---------------------------------------------------------------------------------------------


def check_offsets(offsets: Tensor, total: int, op: str, device: torch.device | None = None) -> Tensor:
    """`offsets` [S + 1] as int64 on `device`, after checking it splits `total` values into S segments: 1-D
    integers, offsets[0] = 0, offsets[-1] = total, never decreasing. Raises ValueError naming `op` otherwise."""
    if not isinstance(offsets, Tensor) or offsets.dim() != 1 or offsets.numel() == 0:
        got = tuple(offsets.shape) if isinstance(offsets, Tensor) else type(offsets).__name__
        raise ValueError(
            f"{op}: offsets must be a 1-D integer tensor [S + 1] (segment s = offsets[s]:offsets[s+1]), got {got}"
        )
    if offsets.is_floating_point() or offsets.is_complex() or offsets.dtype == torch.bool:
        raise ValueError(f"{op}: offsets must hold integers, got {offsets.dtype}")
    offsets = offsets.to(device=device if device is not None else offsets.device, dtype=torch.long)
    if bool((offsets[0] != 0) | (offsets[-1] != total) | (offsets.diff() < 0).any()):
        shown = offsets.tolist()[:8]
        raise ValueError(
            f"{op}: offsets must start at 0, never decrease and end at {total} (the number of values), got {shown}"
            + ("..." if offsets.numel() > 8 else "")
        )
    return offsets


def segment_budgets(k: int | Tensor, lengths: Tensor, op: str) -> Tensor:
    """Per-segment kept counts [S] int64: `k` (an int for every segment, or an integer tensor [S]) clamped to
    [0, segment length], as `topk_indices` clamps its k."""
    if isinstance(k, Tensor):
        if k.shape != lengths.shape or k.is_floating_point() or k.is_complex() or k.dtype == torch.bool:
            raise ValueError(
                f"{op}: k must be an int or an integer tensor [S] = [{lengths.numel()}], got {k.dtype} {tuple(k.shape)}"
            )
        k = k.to(device=lengths.device, dtype=torch.long)
    else:
        try:
            k = torch.full_like(lengths, operator.index(k))
        except TypeError:
            raise ValueError(f"{op}: k must be an int or an integer tensor [S], got {k!r}") from None
    return torch.minimum(k.clamp(min=0), lengths)


def check_topk_args(
    scores: Tensor, offsets: Tensor, k: int | Tensor, rows: Sequence[Tensor], op: str
) -> tuple[Tensor, Tensor]:
    """(offsets [S + 1] int64, kept counts [S] int64) on scores' device, after checking every argument of
    `segmented_topk` / `topk_gather`; raises ValueError naming the problem."""
    if not isinstance(scores, Tensor) or scores.dim() != 1:
        got = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(f"{op}: scores must be a 1-D tensor of the segments' values laid end to end, got {got}")
    if scores.dtype == torch.bool or scores.is_complex():
        raise ValueError(f"{op}: scores must be real numbers, got {scores.dtype}")
    for i, row in enumerate(rows):
        if not isinstance(row, Tensor) or row.dim() == 0 or row.shape[0] != scores.shape[0]:
            got = tuple(row.shape) if isinstance(row, Tensor) else type(row).__name__
            raise ValueError(
                f"{op}: rows[{i}] must be a tensor [N, ...] with N = {scores.shape[0]} (one row per score), got {got}"
            )
    offsets = check_offsets(offsets, scores.numel(), op, scores.device)
    return offsets, segment_budgets(k, offsets.diff(), op)


def _padded(scores: Tensor, lengths: Tensor, largest: bool) -> Tensor:
    """[S, longest] with segment s in row s, padded with the value that ranks last (-inf when `largest`)."""
    size = int(lengths.max())
    if scores.is_floating_point():
        fill = float("-inf") if largest else float("inf")
    else:
        info = torch.iinfo(scores.dtype)
        fill = info.min if largest else info.max
    if bool((lengths == size).all()):  # equal segments (frames of one grid): a view, no copy
        return scores.view(lengths.numel(), size)
    # a gather, not a boolean-mask assignment: the latter costs ~30x more on CPU
    column = torch.arange(size, device=scores.device)
    starts = torch.cumsum(lengths, 0) - lengths
    source = (starts[:, None] + column).clamp(max=max(scores.numel() - 1, 0))
    inside = column < lengths[:, None]
    return torch.where(inside, scores[source], torch.full((), fill, dtype=scores.dtype, device=scores.device))


def _segmented_topk(scores: Tensor, offsets: Tensor, kept: Tensor, largest: bool, sort_indices: bool) -> Tensor:
    """The reference on checked arguments (offsets [S + 1], kept [S] already clamped)."""
    most = int(kept.max()) if kept.numel() else 0
    if most == 0:
        return torch.zeros(0, dtype=torch.long, device=scores.device)
    lengths = offsets.diff()
    padded = _padded(scores, lengths, largest)
    # one place past the largest budget shows, per segment, whether a tie straddles its cut
    width = min(most + 1, padded.shape[1])
    values, local = torch.topk(padded, width, dim=1, largest=largest)
    place = torch.arange(width, device=scores.device)
    chosen = place < kept[:, None]
    # torch.topk breaks ties by its internal algorithm, which depends on the row length: padding can change which
    # of several equal scores it keeps. So a segment is settled here only when its kept set (and, in score
    # order, their order) is the same for every tie-break; the others are recomputed alone below, exactly as
    # the per-segment call `topk_indices` makes them.
    tied = (values[:, 1:] == values[:, :-1]) | (values[:, 1:].isnan() & values[:, :-1].isnan())
    pair = place[:-1]
    matters = (pair + 1 < lengths[:, None]) & (pair < kept[:, None])
    if sort_indices:
        matters &= pair == kept[:, None] - 1
    unsettled = (tied & matters).any(dim=1) | (chosen & (local >= lengths[:, None])).any(dim=1)
    if sort_indices:
        local = torch.sort(torch.where(chosen, local, padded.shape[1]), dim=1).values
    # chosen is a prefix of each row: gather it by (row, place) instead of a boolean-mask select
    rows = torch.repeat_interleave(torch.arange(kept.numel(), device=scores.device), kept)
    places = torch.arange(rows.numel(), device=scores.device) - (torch.cumsum(kept, 0) - kept)[rows]
    out = local[rows, places] + offsets[rows]
    redo = torch.nonzero(unsettled).flatten()
    if redo.numel():
        out_start = torch.cumsum(kept, 0) - kept
        starts, ends = offsets[redo].tolist(), offsets[redo + 1].tolist()
        for start, end, count, at in zip(starts, ends, kept[redo].tolist(), out_start[redo].tolist()):
            out[at : at + count] = start + topk_indices(scores[start:end], count, largest, sort_indices)
    return out


TOPK_TOLERANCE = Tolerance.exact(
    note="indices exact when the scores of a segment are distinct (and always for the reference against the "
    "per-segment torch.topk loop). Under ties the Triton kernel keeps the lower index; the contract is then "
    "that the multiset of kept scores per segment is equal. NaN ranks above every number, as in torch.topk; "
    "-0.0 and 0.0 tie."
)


@kernel_op("segmented_topk", tolerance=TOPK_TOLERANCE, triton="vtc_kernels.triton.select:segmented_topk")
def segmented_topk(
    scores: Tensor, offsets: Tensor, k: int | Tensor, largest: bool = True, sort_indices: bool = True
) -> Tensor:
    """The k best scores of every segment in one call: scores [N] holds S segments end to end, segment s is
    scores[offsets[s]:offsets[s+1]] (offsets [S + 1], from 0 to N); k is an int or an integer tensor [S], clamped
    to [0, segment size]. Returns the kept GLOBAL indices (into scores) [sum k_s] int64, segment after segment;
    within a segment in ascending index order when `sort_indices`, else in score order (best first).

    Equal, index for index, to `topk_indices(scores[segment], k_s, largest, sort_indices)` per segment (the
    torch.topk call plugins make), also under ties: segments whose kept set a tie makes ambiguous are recomputed
    alone. Tolerance (Triton): exact indices when a segment's scores are distinct; under ties the kernel keeps
    the lower index, and the contract is an equal multiset of kept scores per segment."""
    offsets, kept = check_topk_args(scores, offsets, k, (), "segmented_topk")
    return _segmented_topk(scores, offsets, kept, largest, sort_indices)


@kernel_op("topk_gather", tolerance=TOPK_TOLERANCE, triton="vtc_kernels.triton.select:topk_gather")
def topk_gather(
    scores: Tensor,
    offsets: Tensor,
    k: int | Tensor,
    rows: Sequence[Tensor] = (),
    largest: bool = True,
    sort_indices: bool = True,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """`segmented_topk`, then the kept rows of every tensor in `rows` (each [N, ...]: embeddings, positions,
    masks, side features; gathered along dim 0). Returns (index [K], (rows[0][index], rows[1][index], ...)).

    Tolerance: the index as `segmented_topk` (exact for distinct scores; under ties the Triton kernel keeps the
    lower index, the multiset of kept scores is equal); gathered rows exact (they are copies of the input rows)."""
    rows = tuple(rows)
    offsets, kept = check_topk_args(scores, offsets, k, rows, "topk_gather")
    index = _segmented_topk(scores, offsets, kept, largest, sort_indices)
    return index, tuple(row.index_select(0, index.to(row.device)) for row in rows)
