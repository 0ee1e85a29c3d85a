"""Token similarity ops: cosine in the variants the official codes compute, same-patch similarity across frames.

The official codes differ in how they take a cosine, and bit-faithful ports must keep the difference:
  normalize "none" | "eps" (`F.normalize`, eps 1e-12: HoliTom, DyCoke's first pass) | "exact" (x / ||x||, no
      epsilon: FastVID);
  formula "torch" (`F.cosine_similarity`, eps 1e-8: HoliTom, DyCoke) | "ratio" (sum(a b) / (|a| |b|), no epsilon:
      FrameFusion) | "dot" (sum(a b) of already normalised inputs: FastVID).

`frame_cosine` and `adjacent_frame_similarity` are kernel ops (`vtc_kernels.dispatch`); their Triton kernel
(`vtc_kernels.triton.similarity`) computes every variant from three float32 sums per row (a.b, |a|^2, |b|^2).

Tolerance contract of both ops (Triton against the reference). The reference computes in the inputs' dtype
with one rounding per torch op (normalised vectors, products, norms); the kernel accumulates in float32 and
rounds once, to the output dtype (ties to even). Worst differences measured on random and adversarial rows
(identical, opposite, scaled, near-identical, tiny and zero vectors; D = 3 ... 4096; Triton's interpreter):
float32 4.8e-7, bfloat16 1.2e-2 (1.5 ulps of bf16 at 1), float16 9.8e-4 (1 ulp of fp16 at 1). Bounds:
    float32  rtol 1e-5, atol 1e-5
    bfloat16 rtol 1e-2, atol 1e-2
    float16  rtol 2e-3, atol 2e-3
    float64  rtol 1e-5, atol 1e-5   (the kernel still accumulates in float32)
Formula "dot" without normalisation is held to these bounds for unit rows (its callers normalise first); for
other rows the error scales with |a| |b|.
NaN: exactly where the reference gives NaN. "exact" and "ratio" have no epsilon, so a zero vector gives
0 / 0 = NaN in both; "eps" and "torch" clamp norms at their epsilon (F.normalize 1e-12, F.cosine_similarity
1e-8) taken in the inputs' dtype, so a zero vector gives 0 in float32 / bfloat16, and NaN in float16, where
both epsilons underflow to 0 (the official codes do the same). Outside the contract: float16 rows whose norm
overflows (beyond ~65504: the reference gives inf / NaN, the kernel a finite cosine) or whose elementwise
products are subnormal (below ~6e-5: the reference loses digits there, the kernel does not).
Comparisons with a threshold (`sim > tau`) can flip for values within the bound of tau: plugins whose official
code must be matched bit for bit run the reference (CPU, or `use_backend("torch")`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from vtc_kernels.dispatch import Tolerance, kernel_op

Tensor = torch.Tensor

# similarity given to the first token of every chain (it has no predecessor); FrameFusion's IGNORE_TOKEN
NO_PREDECESSOR = -2.0
NORMALIZE = ("none", "eps", "exact")
FORMULAS = ("torch", "ratio", "dot")


def cosine(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise cosine similarity, computed in the inputs' dtype as sum(a*b) / (|a| |b|) (FrameFusion's form;
    no epsilon, so zero vectors give NaN like the original)."""
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


COSINE_TOLERANCE = Tolerance.allclose(
    {
        torch.float32: (1e-5, 1e-5),
        torch.bfloat16: (1e-2, 1e-2),
        torch.float16: (2e-3, 2e-3),
        torch.float64: (1e-5, 1e-5),
    },
    note="float32 accumulation against per-op rounding in the inputs' dtype; NaN exactly where the reference "
    "gives NaN (zero vectors under 'exact' / 'ratio', and under every variant in float16)",
)


def check_variant(normalize: str, formula: str) -> None:
    """Raise ValueError unless (normalize, formula) names an official variant (see the module docstring)."""
    if normalize not in NORMALIZE or formula not in FORMULAS:
        raise ValueError(
            f"normalize must be one of {NORMALIZE} and formula one of {FORMULAS}, got {normalize!r}, {formula!r}"
        )


def _cosine_variant(a: Tensor, b: Tensor, normalize: str, formula: str) -> Tensor:
    check_variant(normalize, formula)
    if normalize == "eps":
        a, b = F.normalize(a, p=2, dim=-1), F.normalize(b, p=2, dim=-1)
    elif normalize == "exact":
        a, b = a / a.norm(dim=-1, keepdim=True), b / b.norm(dim=-1, keepdim=True)
    if formula == "torch":
        return F.cosine_similarity(a, b, dim=-1)
    if formula == "dot":
        return (a * b).sum(dim=-1)
    return cosine(a, b)


@kernel_op("frame_cosine", tolerance=COSINE_TOLERANCE, triton="vtc_kernels.triton.similarity:frame_cosine")
def frame_cosine(a: Tensor, b: Tensor, normalize: str = "none", formula: str = "ratio") -> Tensor:
    """Cosine of a and b along the last dimension (a and b broadcast against each other), in the variant an
    official code computes (see the module docstring), in the inputs' dtype."""
    return _cosine_variant(a, b, normalize, formula)


def check_step(step: int) -> int:
    """`step` as an int >= 1 (ValueError otherwise)."""
    if isinstance(step, bool) or int(step) != step or int(step) < 1:
        raise ValueError(f"adjacent_frame_similarity: step must be an integer >= 1, got {step!r}")
    return int(step)


def adjacent_pair_frames(
    frame_offsets: Tensor | Sequence[int], step: int, num_frames: int, device: torch.device | str | None = None
) -> Tensor:
    """First frame of every (t, t + step) pair inside one video, videos back to back: frame_offsets [V + 1]
    (0 = offsets[0] <= ... <= offsets[V] = num_frames) -> int64 [sum_v max(T_v - step, 0)], video by video."""
    offsets = torch.as_tensor(frame_offsets, device=device)
    if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
        raise ValueError(
            f"adjacent_frame_similarity: frame_offsets must be a 1-D integer tensor [V + 1], got "
            f"{offsets.dtype} of shape {tuple(offsets.shape)}"
        )
    offsets = offsets.to(torch.long)
    bad = (offsets[0] != 0) | (offsets[-1] != num_frames) | (offsets.diff() < 0).any()
    if bool(bad):
        raise ValueError(
            f"adjacent_frame_similarity: frame_offsets must rise from 0 to the number of frames {num_frames}, "
            f"got {offsets.tolist()}"
        )
    counts = (offsets.diff() - step).clamp(min=0)
    starts = offsets[:-1].repeat_interleave(counts)
    # rank of each pair inside its video: global rank minus the pairs of the videos before it
    before = (counts.cumsum(0) - counts).repeat_interleave(counts)
    return starts + torch.arange(starts.numel(), device=starts.device) - before


@kernel_op(
    "adjacent_frame_similarity",
    tolerance=COSINE_TOLERANCE,
    triton="vtc_kernels.triton.similarity:adjacent_frame_similarity",
)
def adjacent_frame_similarity(
    x: Tensor,
    step: int = 1,
    normalize: str = "none",
    formula: str = "ratio",
    frame_offsets: Tensor | Sequence[int] | None = None,
) -> Tensor:
    """x [T, ...] (frames first) -> [T - step, ...]: `frame_cosine` of frame t with frame t + step, at each
    position (x [T, P, D] -> [T - step, P]; frame-level features [T, D] -> [T - step]).

    Segmented: with `frame_offsets` (int [V + 1]) x holds the frames of V videos back to back (video v is
    x[offsets[v]:offsets[v + 1]]); the result concatenates each video's [max(T_v - step, 0), ...] and no pair
    crosses a video boundary (the same values as a loop over the videos)."""
    step = check_step(step)
    check_variant(normalize, formula)
    if frame_offsets is None:
        return _cosine_variant(x[:-step], x[step:], normalize, formula)
    first = adjacent_pair_frames(frame_offsets, step, x.shape[0], x.device)
    return _cosine_variant(x[first], x[first + step], normalize, formula)


def chain_order(chain_key: Tensor, candidates: Tensor) -> tuple[Tensor, Tensor]:
    """Order the slots in `candidates` (1-D indices) by (chain key, slot index).

    Returns (order, sorted_keys): order[i] is the slot at chain position i. With key = spatial patch, the
    order visits every spatial position's temporal chain in turn, earliest frame first."""
    keys = chain_key[candidates]
    # stable sort by key keeps increasing slot order inside a chain
    perm = torch.sort(keys, stable=True).indices
    return candidates[perm], keys[perm]


def chain_similarity(x: Tensor, order: Tensor, sorted_keys: Tensor) -> Tensor:
    """Cosine similarity of each chain element with its predecessor in the same chain.

    x [n, D] token features, order [m] slots in chain order, sorted_keys [m] their chain keys.
    Returns [m]; the first element of every chain gets NO_PREDECESSOR."""
    m = order.numel()
    sim = torch.full((m,), NO_PREDECESSOR, dtype=x.dtype, device=x.device)
    if m > 1:
        inner = cosine(x[order[:-1]], x[order[1:]])
        same_chain = sorted_keys[:-1] == sorted_keys[1:]
        sim[1:] = torch.where(same_chain, inner, torch.full_like(inner, NO_PREDECESSOR))
    return sim
