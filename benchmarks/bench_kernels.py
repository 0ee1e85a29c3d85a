"""`vtc bench-kernels`: vtc's shared ops against the official codes' way of computing them, and (on CUDA) each
op's Triton kernel against its torch reference.

On CPU, for every op: the official baseline (`benchmarks/kernel_baselines.py`, one function per official code) and
vtc's op on its torch reference backend run on identical inputs of video sizes; their outputs must agree (same
indices, or allclose for floats), and the ratio official time / vtc time is reported as the median with the
min and max over repeats. The two are interleaved inside every repeat (official, then vtc) and each ratio is
formed from the two times of the same repeat, so a slow drift of the machine hits both alike.

On CUDA: the official baseline, vtc's torch reference and vtc's Triton kernel (`use_backend`), timed with CUDA
events after warm-up (the first call compiles the kernel), the Triton output checked against the reference with
the op's tolerance contract; and the achieved HBM bandwidth of the Triton kernel = the bytes the op must move
(its inputs read once and its outputs written once; the formula per op is in the table and the JSON) / time, as
a fraction of the device's peak (looked up by device name; `--peak-gbps` overrides).

Sizes: "video" (default) are the shapes the methods meet on 7B video models (16 to 64 frames of 196 tokens,
hidden sizes 1024 to 3584; each op states its shapes); "small" are tiny shapes for tests.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from typing import Any, Callable, Sequence

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from vtc.tools.progress import progress_bar

from . import kernel_baselines as official

Tensor = torch.Tensor

SIZES = ("small", "video")
DEVICES = ("cpu", "cuda")
DEFAULT_REPEATS = 5
CUDA_WARMUP = 3  # the first call compiles the Triton kernel; two more settle clocks and caches

# HBM peak (GB/s, 1e9 bytes) by a substring of torch.cuda.get_device_name(); first match wins, so the more
# specific names come first. Vendor data-sheet figures.
PEAK_GBPS: tuple[tuple[str, float], ...] = (
    ("GH200", 4000.0),
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
    ("RTX 3090", 936.0),
    ("V100", 900.0),
    ("T4", 320.0),
)


@dataclasses.dataclass
class Case:
    """One op benchmarked on one set of inputs.

    official / vtc: zero-argument callables on the prepared inputs (the official baseline; vtc's op through
    its dispatcher, so `use_backend` picks torch or Triton). check(official_out, vtc_out) raises
    AssertionError when they disagree; same(reference_out, triton_out) does the same for two outputs of vtc's
    op (the op's tolerance contract). bytes: the traffic the op must do (inputs read once, outputs written
    once), with the formula in words."""

    op: str
    source: str
    shapes: str
    official: Callable[[], Any]
    vtc: Callable[[], Any]
    check: Callable[[Any, Any], None]
    same: Callable[[Any, Any], None]
    bytes: int
    bytes_formula: str
    kernels: tuple[str, ...]  # the dispatched vtc_kernels ops the vtc side calls
    note: str = ""


# --- agreement checks ----------------------------------------------------------------------------------------------


def assert_equal(a: Tensor, b: Tensor, what: str) -> None:
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {tuple(b.shape)} (vtc) != {tuple(a.shape)} (official)")
    if not torch.equal(a.cpu(), b.cpu()):
        where = (a.cpu() != b.cpu()).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: vtc differs from the official result at {where}")


def assert_close(a: Tensor, b: Tensor, what: str, rtol: float, atol: float) -> None:
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {tuple(b.shape)} (vtc) != {tuple(a.shape)} (official)")
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    excess = (a64 - b64).abs() - (atol + rtol * a64.abs())
    if bool((excess > 0).any()) or bool((a64.isnan() != b64.isnan()).any()):
        worst = int(excess.nan_to_num(float("inf")).flatten().argmax())
        raise AssertionError(
            f"{what}: beyond rtol={rtol}, atol={atol}; worst at flat index {worst}: vtc "
            f"{b64.flatten()[worst].item()} vs official {a64.flatten()[worst].item()}"
        )


def assert_same_selection(a: Tensor, b: Tensor, scores: Tensor, what: str, atol: float) -> None:
    """The same kept set of indices into `scores`, except where two candidates' scores lie within `atol` of each
    other (two exact computations of a near-tie may order it differently; anything else is a real difference)."""
    sa, sb = set(a.flatten().tolist()), set(b.flatten().tolist())
    if sa == sb:
        return
    only_a, only_b = sorted(sa - sb), sorted(sb - sa)
    s = scores.detach().double().cpu().flatten()
    swapped = s[only_a + only_b]
    # every swapped candidate must sit within atol of the others: a near-tie at the cut, ordered either way
    gap = (swapped.max() - swapped.min()).item() if only_a and only_b else float("inf")
    if len(only_a) != len(only_b) or gap > atol:
        raise AssertionError(f"{what}: vtc keeps {only_b[:5]} where the official keeps {only_a[:5]} (gap {gap:.3g})")


def contract_check(op_name: str) -> Callable[[Any, Any], None]:
    """Reference vs Triton output under the op's declared tolerance contract (`vtc_kernels.dispatch.Tolerance`)."""

    def check(reference: Any, triton: Any) -> None:
        from vtc_kernels.dispatch import OPS

        tolerance = OPS[op_name].tolerance
        expected, actual = _tensors(reference), _tensors(triton)
        if len(expected) != len(actual):
            raise AssertionError(f"{op_name}: {len(actual)} outputs from Triton, {len(expected)} from the reference")
        for i, (e, a) in enumerate(zip(expected, actual)):
            tolerance.check(a, e, f"{op_name} output {i}")

    return check


def _tensors(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    if dataclasses.is_dataclass(out):
        return [t for f in dataclasses.fields(out) for t in _tensors(getattr(out, f.name))]
    return []


# --- inputs ------------------------------------------------------------------------------------------------------


def _randn(generator: torch.Generator, *shape: int, dtype=torch.float32, device="cpu") -> Tensor:
    return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)


def _video(size: str, text: str) -> str:
    """`text` (what the shapes stand for) at video sizes; nothing at small sizes, which stand for nothing."""
    return text if size == "video" else ""


def _nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# --- the ops ------------------------------------------------------------------------------------------------------


def case_max_min_select(size: str, device: str) -> Case:
    """DivPrune's greedy Max-Min selection, segmented: several videos' distance matrices in one call."""
    from vtc_kernels.diverse import cosine_distance_matrix, max_min_select

    lengths = [32 * 196, 24 * 196] if size == "video" else [40, 25]
    dim = 1024 if size == "video" else 16
    ratio = 0.1 if size == "video" else 0.25
    counts = [max(1, round(ratio * n)) for n in lengths]
    g = torch.Generator().manual_seed(0)
    longest = max(lengths)
    padded = torch.zeros(len(lengths), longest, longest, device=device)
    dists = []
    with torch.no_grad():
        for s, n in enumerate(lengths):
            d = cosine_distance_matrix(_randn(g, n, dim, device=device))
            padded[s, :n, :n] = d
            dists.append(d.contiguous())  # the official builds one matrix per video
    lengths_t = torch.tensor(lengths, device=device)
    counts_t = torch.tensor(counts, device=device)

    def check(off: list[Tensor], ours: Tensor) -> None:
        for s, picks in enumerate(off):
            assert_equal(picks, ours[s, : counts[s]], f"max_min_select video {s} picks")

    reads = sum(n * n + c * n for n, c in zip(lengths, counts)) * 4
    return Case(
        op="max_min_select",
        source="vbdi/divprune llava_arch.py DivPrune",
        shapes=f"{len(lengths)} videos, L={'/'.join(map(str, lengths))} tokens"
        f"{_video(size, ' (32 and 24 frames x 196)')}, "
        f"fp32 dist [L, L] from D={dim} features, picks {'/'.join(map(str, counts))}",
        official=lambda: official.divprune_videos(dists, counts),
        vtc=lambda: max_min_select(padded, counts_t, lengths_t),
        check=check,
        same=contract_check("max_min_select"),
        bytes=reads + 8 * sum(counts),
        bytes_formula="sum over videos of 4 (L^2 + count L) (dist: one pass for pick 1, one row per later pick) "
        "+ 8 count",
        kernels=("max_min_select",),
    )


def case_dpc_knn(size: str, device: str) -> Case:
    """DPC-kNN density-peak scores of many segments (temporal windows / frames) of different lengths."""
    from vtc_kernels.clustering import knn_density, nearest_denser

    g = torch.Generator().manual_seed(1)
    if size == "video":
        lengths = torch.randint(98, 197, (32,), generator=g).tolist()
        dim = 3584
    else:
        lengths = [7, 12, 1, 9]
        dim = 8
    k = 7
    segments = [_randn(g, n, dim, device=device) for n in lengths]
    longest = max(lengths)
    x = torch.zeros(len(lengths), longest, dim, device=device)
    for s, seg in enumerate(segments):
        x[s, : seg.shape[0]] = seg
    lengths_t = torch.tensor(lengths, device=device)
    valid = torch.arange(longest, device=device)[None, :] < lengths_t[:, None]

    def generators() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(1000 + s) for s in range(len(lengths))]

    def ours() -> tuple[Tensor, Tensor]:
        # the segmented path a plugin takes: one batched cdist, then the two segmented passes
        dist = torch.cdist(x, x) / dim**0.5
        density = knn_density(dist, k, lengths_t)
        noise = torch.zeros(len(lengths), longest)
        for s, gen in enumerate(generators()):  # the same draws as the official per-segment calls
            noise[s, : lengths[s]] = torch.rand(lengths[s], generator=gen)
        noisy = density + noise.to(device) * 1e-6
        delta, _ = nearest_denser(dist, noisy, lengths_t)
        return (delta * noisy).masked_fill(~valid, 0.0), density

    def agree(ref: list[Tensor], score: Tensor, density: Tensor, rtol: float, tie: float, what: str) -> None:
        """Scores allclose (rtol), except on rows whose nearest denser row may legitimately differ: another row
        of the segment has a density within `tie` (relative) of theirs, so the "denser" test can flip between
        two computations of the distances (on a GPU, cdist's matmul form rounds differently per batch shape)."""
        density = density.double().cpu()
        for seg, expected in enumerate(ref):
            e, a = expected.double().cpu(), score[seg, : lengths[seg]].double().cpu()
            bad = torch.nonzero((e - a).abs() > 1e-6 + rtol * e.abs()).flatten().tolist()
            d = density[seg, : lengths[seg]]
            for row in bad:
                gap = (d - d[row]).abs()
                gap[row] = float("inf")
                if gap.min().item() > tie * d[row].item():
                    raise AssertionError(f"{what}, segment {seg} row {row}: {a[row].item()} vs {e[row].item()}")
            if len(bad) > max(1, lengths[seg] // 20):
                raise AssertionError(f"{what}, segment {seg}: {len(bad)} of {lengths[seg]} rows differ")

    def check(off: list[Tensor], mine: tuple[Tensor, Tensor]) -> None:
        agree(off, mine[0], mine[1], rtol=1e-3, tie=1e-3, what="dpc_knn score against the official")

    def same(reference: tuple[Tensor, Tensor], triton: tuple[Tensor, Tensor]) -> None:
        """knn_density under its contract, then the scores as in `agree` (same distances on both sides, so only
        the density's last bits differ)."""
        contract_check("knn_density")(reference[1], triton[1])
        per_segment = [reference[0][seg, :n] for seg, n in enumerate(lengths)]
        agree(per_segment, triton[0], reference[1], rtol=1e-4, tie=1e-5, what="dpc_knn score (Triton)")

    n2 = sum(n * n for n in lengths)
    return Case(
        op="dpc_knn_scores",
        source="PruneVid / HoliTom cluster_dpc_knn (TCFormer)",
        shapes=f"{len(lengths)} segments of {min(lengths)}-{max(lengths)} tokens, C={dim}, k={k}, fp32",
        official=lambda: official.dpc_knn_segments(segments, k, generators()),
        vtc=ours,
        check=check,
        same=same,
        bytes=4 * (sum(lengths) * dim + 2 * n2 + 2 * sum(lengths)),
        bytes_formula="4 (sum n C + 2 sum n^2 + 2 sum n): x read, dist written and read back, scores written",
        kernels=("knn_density", "nearest_denser"),
        note="vtc side: one batched cdist (plain torch) and the segmented knn_density / nearest_denser over all "
        "segments at once; the official calls cluster_dpc_knn once per segment",
    )


def case_sinkhorn(size: str, device: str) -> Case:
    """AOT's intra-frame optimal transport: every frame's non-anchor tokens onto its anchors."""
    from vtc_kernels.transport import sinkhorn

    frames, m, n, dim = (32, 603, 126, 1152) if size == "video" else (3, 12, 5, 8)
    g = torch.Generator().manual_seed(2)
    src = torch.nn.functional.normalize(_randn(g, frames, m, dim, device=device), dim=-1)
    dst = torch.nn.functional.normalize(_randn(g, frames, n, dim, device=device), dim=-1)
    pos_src, pos_dst = (
        torch.rand(frames, m, 2, generator=g).to(device),
        torch.rand(frames, n, 2, generator=g).to(device),
    )
    cost = (1.0 - src @ dst.transpose(1, 2)) + 0.5 * torch.cdist(pos_src, pos_dst)
    eps, iters, tol = 0.1, 100, 1e-2

    def check(off: Tensor, ours: Tensor) -> None:
        assert_close(off, ours, "sinkhorn plan", rtol=1e-4, atol=1e-9)

    return Case(
        op="sinkhorn",
        source="TyroneLi/AOT llava_arch.py Sinkhorn_v1",
        shapes=f"cost [{frames} frames, {m} sources, {n} anchors] fp32"
        f"{_video(size, ' (LLaVA-OV: 729 tokens, 126 anchors)')}, "
        f"eps={eps}, <= {iters} iterations, tol={tol}",
        official=lambda: official.aot_sinkhorn(cost, eps, iters, tol),
        vtc=lambda: sinkhorn(cost, epsilon=eps, max_iter=iters, tol=tol),
        check=check,
        same=contract_check("sinkhorn"),
        bytes=2 * _nbytes(cost),
        bytes_formula="2 x 4 B M N: cost read once, plan written once (each iteration's re-reads not counted)",
        kernels=("sinkhorn",),
    )


def _vidcom2_inputs(size: str, device: str):
    frames, per, dim = (64, 196, 3584) if size == "video" else (5, 9, 8)
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(frames, per, generator=g).to(device)
    # per-frame budgets around 25 % as VidCom2's frame-adaptive scales give them
    ks = (per * (0.25 + 0.1 * (torch.rand(frames, generator=g) - 0.5))).round().long().clamp(min=1).tolist()
    flat = _randn(g, frames * per, dim, device=device)
    offsets = torch.arange(frames + 1, device=device) * per
    return frames, per, dim, scores, ks, flat, offsets


def case_segmented_topk(size: str, device: str) -> Case:
    """VidCom2's per-frame top-k with per-frame budgets (indices only)."""
    from vtc_kernels.select import segmented_topk

    frames, per, dim, scores, ks, flat, offsets = _vidcom2_inputs(size, device)
    ks_t = torch.tensor(ks, device=device)
    flat_scores = scores.flatten()

    def check(off: Tensor, ours: Tensor) -> None:
        assert_equal(off, ours, "segmented_topk indices")

    total = sum(ks)
    return Case(
        op="segmented_topk",
        source="xuyang-liu16/VidCom2 vidcom2.py select_outlier_indices",
        shapes=f"scores [{frames} frames x {per}] fp32, per-frame k {min(ks)}-{max(ks)} (sum {total}), lowest kept",
        official=lambda: official.vidcom2_select(scores, ks),
        vtc=lambda: segmented_topk(flat_scores, offsets, ks_t, largest=False),
        check=check,
        same=contract_check("segmented_topk"),
        bytes=4 * frames * per + 8 * total,
        bytes_formula="4 N (scores) + 8 K (indices)",
        kernels=("segmented_topk",),
    )


def case_topk_gather(size: str, device: str) -> Case:
    """VidCom2's per-frame top-k and the gather of the kept tokens' features."""
    from vtc_kernels.select import topk_gather

    frames, per, dim, scores, ks, flat, offsets = _vidcom2_inputs(size, device)
    ks_t = torch.tensor(ks, device=device)
    flat_scores = scores.flatten()

    def check(off: tuple[Tensor, Tensor], ours: tuple[Tensor, tuple[Tensor, ...]]) -> None:
        assert_equal(off[0], ours[0], "topk_gather indices")
        assert_equal(off[1], ours[1][0], "topk_gather rows")

    total = sum(ks)
    return Case(
        op="topk_gather",
        source="xuyang-liu16/VidCom2 vidcom2.py select_outlier_indices + map_features",
        shapes=f"scores [{frames} x {per}], features [{frames * per}, {dim}] fp32, per-frame k sum {total}",
        official=lambda: official.vidcom2_select_gather(scores, ks, flat),
        vtc=lambda: topk_gather(flat_scores, offsets, ks_t, rows=(flat,), largest=False),
        check=check,
        same=contract_check("topk_gather"),
        bytes=4 * frames * per + 8 * total + 2 * 4 * total * dim,
        bytes_formula="4 N (scores) + 8 K (indices) + 2 x 4 K D (kept rows read and written)",
        kernels=("topk_gather",),
    )


def case_best_match_merge(size: str, device: str) -> Case:
    """VisionZip's contextual tokens: every non-target token's most similar target, then the merge."""
    from vtc_kernels.matching import best_match
    from vtc_kernels.merge import merge_into_anchors

    frames, n, contextual, dim = (32, 600, 64, 1152) if size == "video" else (3, 20, 4, 8)
    g = torch.Generator().manual_seed(4)
    metric = _randn(g, frames, n, dim, device=device)
    hidden = _randn(g, frames, n, dim, device=device)
    step = max(1, n // contextual)
    targets = torch.arange(0, n, step, device=device)[:contextual]
    is_target = torch.zeros(n, dtype=torch.bool, device=device)
    is_target[targets] = True
    sources = torch.nonzero(~is_target).flatten()
    m = sources.numel()
    # vtc's segmented layout: every frame's sources (and targets) back to back, one segment per frame
    src_keys, dst_keys = metric[:, sources].reshape(-1, dim), metric[:, targets].reshape(-1, dim)
    src_rows, dst_rows = hidden[:, sources].reshape(-1, dim), hidden[:, targets].reshape(-1, dim)
    src_offsets = torch.arange(frames + 1, device=device) * m
    dst_offsets = torch.arange(frames + 1, device=device) * contextual

    unit_src = src_keys / src_keys.norm(dim=-1, keepdim=True)
    unit_dst = dst_keys / dst_keys.norm(dim=-1, keepdim=True)

    def ours() -> tuple[Tensor, Tensor]:
        assign, _ = best_match(src_keys, dst_keys, "exact", "dot", src_offsets, dst_offsets)
        merged = merge_into_anchors(dst_rows, src_rows, assign, rule="add_mean")
        return assign, merged

    def compare(assign_a: Tensor, assign_b: Tensor, merged_a: Tensor, merged_b: Tensor, what: str) -> None:
        """Assignments equal except between near-equal targets (the two similarities within ASSIGNMENT_GAP);
        merged tokens allclose on every target whose sources are the same on both sides."""
        from vtc_kernels.matching import ASSIGNMENT_GAP

        a, b = assign_a.flatten().cpu(), assign_b.flatten().cpu()
        differ = torch.nonzero(a != b).flatten()
        if differ.numel():
            src_cpu, dst_cpu = unit_src.cpu(), unit_dst.cpu()
            sa = (src_cpu[differ] * dst_cpu[a[differ]]).sum(-1)
            sb = (src_cpu[differ] * dst_cpu[b[differ]]).sum(-1)
            gap = (sa - sb).abs().max().item()
            if gap > ASSIGNMENT_GAP[torch.float32]:
                raise AssertionError(f"{what}: {differ.numel()} sources matched differently (similarity gap {gap:.3g})")
        moved = torch.zeros(dst_rows.shape[0], dtype=torch.bool)
        moved[a[differ]] = True
        moved[b[differ]] = True
        kept_a, kept_b = merged_a.reshape(-1, dim).cpu()[~moved], merged_b.reshape(-1, dim).cpu()[~moved]
        assert_close(kept_a, kept_b, what, rtol=1e-4, atol=1e-5)

    def check(off: tuple[Tensor, Tensor, Tensor], mine: tuple[Tensor, Tensor]) -> None:
        # official: local target index per frame; vtc: global row of the target
        compare(off[2] + dst_offsets[:-1, None], mine[0], off[0], mine[1], "best_match+merge against VisionZip")

    def same(reference: tuple[Tensor, Tensor], triton: tuple[Tensor, Tensor]) -> None:
        compare(reference[0], triton[0], reference[1], triton[1], "best_match+merge Triton against the reference")

    return Case(
        op="best_match+merge",
        source="dvlab-research/VisionZip clip_encoder.py (contextual tokens)",
        shapes=f"{frames} frames x {n} tokens (SigLIP keys and features, D={dim}) fp32, {contextual} targets per frame",
        official=lambda: official.visionzip_contextual(metric, hidden, contextual),
        vtc=ours,
        check=check,
        same=same,
        bytes=4 * frames * (2 * m * dim + 2 * contextual * dim + 3 * m + contextual * dim),
        bytes_formula="4 F (2 m D source keys and rows + 2 c D target keys and rows read + 3 m match written "
        "+ c D merged written)",
        kernels=("best_match", "merge_into_anchors"),
        note="gathers into vtc's segmented layout happen before the timing (a plugin holds that layout already)",
    )


def case_adjacent_frame_similarity(size: str, device: str) -> Case:
    """HoliTom's same-patch cosine between consecutive frames."""
    from vtc_kernels.similarity import adjacent_frame_similarity

    frames, per, dim = (64, 196, 3584) if size == "video" else (4, 6, 8)
    x = _randn(torch.Generator().manual_seed(5), frames, per, dim, device=device)

    def check(off: Tensor, ours: Tensor) -> None:
        assert_close(off, ours, "adjacent frame similarity", rtol=1e-5, atol=1e-6)

    return Case(
        op="adjacent_frame_similarity",
        source="cokeshao/HoliTom llava_arch.py (normalize + cosine_similarity)",
        shapes=f"x [{frames} frames, {per} tokens, {dim}] fp32",
        official=lambda: official.holitom_frame_similarity(x),
        vtc=lambda: adjacent_frame_similarity(x, normalize="eps", formula="torch"),
        check=check,
        same=contract_check("adjacent_frame_similarity"),
        bytes=_nbytes(x) + 4 * (frames - 1) * per,
        bytes_formula="4 T P D (every frame read once) + 4 (T-1) P",
        kernels=("adjacent_frame_similarity",),
    )


def case_frame_cosine(size: str, device: str) -> Case:
    """DyCoke's first-pass similarity of frame pairs (0,1), (2,3), ... ."""
    from vtc_kernels.similarity import frame_cosine

    frames, per, dim = (64, 196, 3584) if size == "video" else (5, 6, 8)
    flat = _randn(torch.Generator().manual_seed(6), frames * per, dim, device=device)
    pairs = frames // 2
    x = flat.view(frames, per, dim)

    def check(off: Tensor, ours: Tensor) -> None:
        assert_close(off, ours, "frame pair cosine", rtol=1e-5, atol=1e-6)

    return Case(
        op="frame_cosine",
        source="KD-TAO/DyCoke llava_arch.py dycole_ttm (pair loop)",
        shapes=f"features [{frames} x {per}, {dim}] fp32, {pairs} pairs",
        official=lambda: official.dycoke_pair_similarity(flat, per),
        vtc=lambda: frame_cosine(x[0 : 2 * pairs : 2], x[1 : 2 * pairs : 2], normalize="eps", formula="torch"),
        check=check,
        same=contract_check("frame_cosine"),
        bytes=4 * (2 * pairs * per * dim + pairs * per),
        bytes_formula="4 (2 pairs P D read + pairs P written)",
        kernels=("frame_cosine",),
    )


def _kv(size: str, device: str) -> Tensor:
    # the keys of all 28 layers of a 7B model (4 KV heads, head_dim 128) for 64 frames of 50 tokens
    shape = (28, 4, 64 * 50, 128) if size == "video" else (2, 2, 20, 8)
    return _randn(torch.Generator().manual_seed(7), *shape, dtype=torch.bfloat16, device=device)


def case_quantize_groups(size: str, device: str) -> Case:
    """StreamingTOM's OQM store: 4-bit min-max quantisation in groups of 50 tokens (one frame)."""
    from vtc_kernels.quant import quantize_groups

    x = _kv(size, device)
    group = 50 if size == "video" else 10

    def check(off: tuple[Tensor, Tensor, Tensor], ours) -> None:
        assert_equal(off[0], ours.packed, "quantize packed codes")
        assert_equal(off[1], ours.scale, "quantize scales")
        assert_equal(off[2], ours.minimum, "quantize minima")

    groups = x.shape[2] // group
    lead = x.shape[0] * x.shape[1] * x.shape[3]
    return Case(
        op="quantize_groups",
        source="YIGE24/StreamingTOM oqm.py _quantize_tensor + _pack_Nbit",
        shapes=f"KV [{', '.join(map(str, x.shape))}] bf16"
        f"{_video(size, ' (28 layers x 4 heads, 64 frames x 50 tokens)')}, "
        f"4 bit, groups of {group}, scales in bf16 (the official's)",
        official=lambda: official.oqm_quantize(x, 4, group),
        vtc=lambda: quantize_groups(x, bits=4, group_size=group, scale_dtype=None),
        check=check,
        same=contract_check("quantize_groups"),
        bytes=_nbytes(x) + x.numel() // 2 + 2 * 2 * lead * groups,
        bytes_formula="2 numel (bf16 read) + numel / 2 (packed) + 2 x 2 groups (scale, min)",
        kernels=("quantize_groups",),
    )


def case_dequantize_groups(size: str, device: str) -> Case:
    """StreamingTOM's OQM load: unpack and rescale the stored groups."""
    from vtc_kernels.quant import dequantize_groups, quantize_groups

    x = _kv(size, device)
    group = 50 if size == "video" else 10
    q = quantize_groups(x, bits=4, group_size=group, scale_dtype=None)

    def check(off: Tensor, ours: Tensor) -> None:
        assert_equal(off, ours, "dequantized values")

    return Case(
        op="dequantize_groups",
        source="YIGE24/StreamingTOM oqm.py _dequantize_tensor + _unpack_Nbit",
        shapes=f"KV [{', '.join(map(str, x.shape))}] bf16 from 4-bit groups of {group}",
        official=lambda: official.oqm_dequantize(q.packed, q.scale, q.minimum, 4, group),
        vtc=lambda: dequantize_groups(q),
        check=check,
        same=contract_check("dequantize_groups"),
        bytes=_nbytes(q.packed, q.scale, q.minimum) + _nbytes(x),
        bytes_formula="numel / 2 (packed) + 2 x 2 groups (scale, min) + 2 numel (bf16 written)",
        kernels=("dequantize_groups",),
    )


def case_attention_rows(size: str, device: str) -> Case:
    """FastV's ranking at its pruning layer: the last prompt token's attention over the image tokens."""
    from vtc_kernels.attention import attention_rows

    heads, kv_heads, head_dim = (28, 4, 128) if size == "video" else (4, 2, 8)
    image = 16 * 196 if size == "video" else 24
    system, text = (14, 50) if size == "video" else (3, 5)
    n = system + image + text
    rank = image // 2
    # model dtype: bf16 on a GPU; fp32 on CPU, where bf16 matmuls have no native support and would time the emulation
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(8)
    query = _randn(g, 1, heads, n, head_dim, dtype=dtype, device=device)
    key = _randn(g, 1, kv_heads, n, head_dim, dtype=dtype, device=device)
    mask = official.causal_additive_mask(n, dtype, device)  # built once per forward by the model, not per layer
    rows = torch.full((1, 1), n - 1, device=device)
    visible = torch.ones(1, 1, n, dtype=torch.bool, device=device)
    scaling = head_dim**-0.5

    def ours() -> tuple[Tensor, Tensor]:
        probs = attention_rows(query, key, rows, visible, scaling, True)  # [1, H, 1, n]
        last = probs.mean(dim=1)[0, -1]
        return last[system : system + image].topk(rank).indices + system, last

    def check(off: Tensor, mine: tuple[Tensor, Tensor]) -> None:
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-6
        assert_same_selection(off, mine[0], mine[1] / mine[1].max(), "FastV kept tokens", atol=tol)

    def same(reference: tuple[Tensor, Tensor], triton: tuple[Tensor, Tensor]) -> None:
        """The head-averaged probabilities under attention_rows' contract (a mean of values within
        atol + rtol |e| stays within it: probabilities are non-negative); the kept tokens equal except between
        scores closer than twice that bound."""
        from vtc_kernels.dispatch import OPS

        tolerance = OPS["attention_rows"].tolerance
        tolerance.check(triton[1], reference[1], "attention_rows head-averaged probabilities")
        rtol, atol = tolerance.bound(reference[1].dtype)
        gap = 2 * (atol + rtol * reference[1].abs().max().item())
        assert_same_selection(reference[0], triton[0], reference[1], "FastV kept tokens (Triton)", atol=gap)

    return Case(
        op="attention_rows",
        source="pkunlp-icler/FastV modeling_llama.py (eager attention + output_attentions)",
        shapes=f"q [1, {heads}, {n}, {head_dim}], k [1, {kv_heads}, {n}, {head_dim}] {str(dtype)[6:]}"
        f"{_video(size, f' (Qwen2.5-VL-7B heads; {image} image tokens = 16 frames x 196)')}, keep {rank}",
        official=lambda: official.fastv_last_token_topk(query, key, mask, system, image, rank),
        vtc=ours,
        check=check,
        same=same,
        bytes=_nbytes(query[:, :, -1:]) + _nbytes(key) + heads * n * query.element_size(),
        bytes_formula="H d (the query row) + Hkv n d (keys) + H n (probabilities), x dtype size",
        kernels=("attention_rows",),
    )


CASES: dict[str, Callable[[str, str], Case]] = {
    "max_min_select": case_max_min_select,
    "dpc_knn_scores": case_dpc_knn,
    "sinkhorn": case_sinkhorn,
    "segmented_topk": case_segmented_topk,
    "topk_gather": case_topk_gather,
    "best_match+merge": case_best_match_merge,
    "adjacent_frame_similarity": case_adjacent_frame_similarity,
    "frame_cosine": case_frame_cosine,
    "quantize_groups": case_quantize_groups,
    "dequantize_groups": case_dequantize_groups,
    "attention_rows": case_attention_rows,
}


# --- timing ---------------------------------------------------------------------------------------------------------


def _spread(values: Sequence[float]) -> dict[str, float]:
    from vtc.tools.bench import spread

    return spread(values)


def _time_cpu(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _time_cuda(fn: Callable[[], Any]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _with_backend(backend: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    from vtc_kernels.dispatch import use_backend

    def run() -> Any:
        with use_backend(backend), torch.no_grad():
            return fn()

    return run


def triton_kernels(case: Case) -> list[str]:
    """The ops of the case that have a Triton kernel (under backend "triton" the others run their reference)."""
    from vtc_kernels.dispatch import kernel_ops

    available = set(kernel_ops())
    return [name for name in case.kernels if name in available]


def peak_gbps(device_name: str, override: float | None = None) -> float | None:
    """HBM peak of the device in GB/s: `override` when given, else by name (None when the name is unknown)."""
    if override is not None:
        if override <= 0:
            raise ValueError(f"--peak-gbps must be positive, got {override}")
        return float(override)
    for key, value in PEAK_GBPS:
        if key in device_name:
            return value
    return None


def parse_ops(text: str | None) -> list[str]:
    """Op names from a comma-separated list (None or empty: all); unknown names raise ValueError listing the allowed."""
    if not text:
        return list(CASES)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CASES]
    if unknown:
        raise ValueError(f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    return names


def bench_kernels(
    ops: Sequence[str] | None = None,
    size: str = "video",
    repeats: int = DEFAULT_REPEATS,
    device: str = "cpu",
    json_path: str | None = None,
    peak_override: float | None = None,
    console: Console | None = None,
    triton: bool | None = None,
) -> dict[str, Any]:
    """Run the benchmark (see the module docstring) and return the report; print a table, and write it as JSON
    to `json_path` when given. `triton` (default: on CUDA) also runs every op's Triton kernel; on the CPU that
    takes Triton's interpreter (TRITON_INTERPRET=1 before Triton is imported), which tests use at small sizes to
    run the GPU path's checks and report without a GPU (its times mean nothing)."""
    console = console or Console()
    names = parse_ops(",".join(ops) if ops else None)
    if size not in SIZES:
        raise ValueError(f"--sizes must be one of {', '.join(SIZES)}, got {size!r}")
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "--device cuda: CUDA is not available here (torch.cuda.is_available() is False); use --device cpu"
        )
    cuda = device == "cuda"
    triton = cuda if triton is None else triton
    device_name = torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine())
    peak = peak_gbps(device_name, peak_override) if triton else None
    timer = _time_cuda if cuda else _time_cpu

    results = []
    load_before = _load_average()
    steps_per_op = repeats + (CUDA_WARMUP if cuda else 1)
    with progress_bar(console, transient=True) as progress:
        task = progress.add_task("kernels", total=len(names) * steps_per_op)
        for name in names:
            try:
                results.append(_bench_one(name, size, device, repeats, timer, peak, triton, progress, task))
            except Exception as err:  # one op's failure is reported (table, JSON, exit code); the others still run
                results.append({"op": name, "error": f"{type(err).__name__}: {err}"})
            if cuda:
                torch.cuda.empty_cache()

    report = {
        "device": device,
        "device_name": device_name,
        "triton": triton,
        "peak_gbps": peak,
        "sizes": size,
        "repeats": repeats,
        "aggregate": "median with min and max over repeats; each ratio from the times of the same repeat",
        "environment": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            # other processes compete for the CPU: the load average around the run says how much
            "load_average_before": load_before,
            "load_average_after": _load_average(),
        },
        "results": results,
    }
    if triton:
        import triton as triton_module

        report["environment"]["triton"] = triton_module.__version__
    print_table(report, console)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(report, fh, indent=2)
        console.print(f"wrote {json_path}")
    return report


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


def _bench_one(
    name: str,
    size: str,
    device: str,
    repeats: int,
    timer: Callable,
    peak: float | None,
    triton: bool,
    progress,
    task,
) -> dict[str, Any]:
    """Build one op's case, check official and vtc agree (and Triton against the reference), time it."""
    cuda = device == "cuda"
    progress.update(task, description=f"{name}: inputs")
    case = CASES[name](size, device)
    runs = {"official": _with_backend("torch", case.official), "vtc": _with_backend("torch", case.vtc)}
    with_kernel = triton_kernels(case) if triton else []
    if with_kernel:
        runs["triton"] = _with_backend("triton", case.vtc)
    progress.update(task, description=f"{name}: warm-up and check")
    outputs: dict[str, Any] = {}
    for _ in range(CUDA_WARMUP if cuda else 1):
        outputs = {label: fn() for label, fn in runs.items()}
        progress.advance(task)
    try:
        case.check(outputs["official"], outputs["vtc"])
    except AssertionError as err:
        raise AssertionError(f"official and vtc disagree: {err}") from err
    if "triton" in runs:
        try:
            case.same(outputs["vtc"], outputs["triton"])
        except AssertionError as err:
            raise AssertionError(f"Triton breaks the reference's tolerance contract: {err}") from err
    del outputs
    times: dict[str, list[float]] = {label: [] for label in runs}
    for rep in range(repeats):
        progress.update(task, description=f"{name}: repeat {rep + 1}/{repeats}")
        for label, fn in runs.items():  # interleaved: official, vtc (, triton) inside every repeat
            times[label].append(timer(fn))
        progress.advance(task)
    result = _summarize(case, times, peak)
    result["triton_kernels"] = with_kernel
    return result


def _summarize(case: Case, times: dict[str, list[float]], peak: float | None) -> dict[str, Any]:
    per_repeat = []
    for i in range(len(times["vtc"])):
        row = {f"{label}_s": values[i] for label, values in times.items()}
        row["speedup"] = times["official"][i] / times["vtc"][i]  # official / vtc reference
        if "triton" in times:
            row["triton_speedup"] = times["vtc"][i] / times["triton"][i]  # reference / Triton
            row["official_over_triton"] = times["official"][i] / times["triton"][i]
            row["gbps"] = case.bytes / times["triton"][i] / 1e9
        per_repeat.append(row)
    keys = list(per_repeat[0])
    result: dict[str, Any] = {
        "op": case.op,
        "official_source": case.source,
        "shapes": case.shapes,
        "kernels": list(case.kernels),
        "agree": True,  # outputs that disagree make the op an error row instead
        "bytes": case.bytes,
        "bytes_formula": case.bytes_formula,
        "note": case.note,
        "spread": {key: _spread([r[key] for r in per_repeat]) for key in keys},
        "per_repeat": per_repeat,
    }
    if "gbps" in result["spread"] and peak:
        result["peak_fraction"] = {k: v / peak for k, v in result["spread"]["gbps"].items()}
    return result


# --- output ---------------------------------------------------------------------------------------------------------


def _range(spread: dict[str, float], fmt: str = ".2f", suffix: str = "x") -> str:
    return f"{spread['median']:{fmt}}{suffix} ({spread['min']:{fmt}}–{spread['max']:{fmt}})"


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _ms(spread: dict[str, float]) -> str:
    return _number(spread["median"] * 1e3)


def table_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the report's table, shared by the console and the Markdown output."""
    if not report["triton"]:
        header = ["op", "official (repo, function)", "shapes", "official ms", "vtc ms", "official / vtc"]
        rows = []
        for r in report["results"]:
            if "error" in r:
                rows.append([r["op"], "ERROR", r["error"], "-", "-", "-"])
                continue
            s = r["spread"]
            rows.append(
                [
                    r["op"],
                    r["official_source"],
                    r["shapes"],
                    _ms(s["official_s"]),
                    _ms(s["vtc_s"]),
                    _range(s["speedup"]),
                ]
            )
        return header, rows
    header = [
        "op",
        "official ms",
        "torch ms",
        "triton ms",
        "torch / triton",
        "official / triton",
        "GB/s",
        "% of peak",
        "bytes (formula)",
    ]
    rows = []
    for r in report["results"]:
        if "error" in r:
            rows.append([r["op"], "ERROR", r["error"], "-", "-", "-", "-", "-", "-"])
            continue
        s = r["spread"]
        if "triton_s" not in s:
            rows.append(
                [r["op"], _ms(s["official_s"]), _ms(s["vtc_s"]), "no kernel", "-", "-", "-", "-", r["bytes_formula"]]
            )
            continue
        frac = r.get("peak_fraction")
        rows.append(
            [
                r["op"],
                _ms(s["official_s"]),
                _ms(s["vtc_s"]),
                _ms(s["triton_s"]),
                _range(s["triton_speedup"]),
                _range(s["official_over_triton"]),
                _number(s["gbps"]["median"]),
                f"{100 * frac['median']:.1f}%" if frac else "peak unknown",
                r["bytes_formula"],
            ]
        )
    return header, rows


def print_table(report: dict[str, Any], console: Console) -> None:
    header, rows = table_rows(report)
    n = report["repeats"]
    title = (
        f"vtc kernels on {report['device_name']} ({report['device']}, {report['sizes']} sizes, "
        f"median (min–max) of {n} repeat{'s' if n != 1 else ''})"
    )
    table = Table(title=title, box=box.SIMPLE_HEAVY)
    for col in header:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if report["triton"] and not report.get("peak_gbps"):
        console.print(f"peak bandwidth of {report['device_name']!r} unknown: pass --peak-gbps for % of peak")
    env = report["environment"]
    if env.get("load_average_before") is not None:
        console.print(
            f"{env['threads']} torch threads; load average (1, 5, 15 min) {env['load_average_before']} before, "
            f"{env['load_average_after']} after"
        )
    failed = [r["op"] for r in report["results"] if "error" in r]
    if failed:
        console.print(f"[bold red]{len(failed)} op(s) failed:[/bold red] {', '.join(failed)}")


def markdown_table(report: dict[str, Any]) -> str:
    header, rows = table_rows(report)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
