"""vtc_kernels.similarity ops: `frame_cosine` and `adjacent_frame_similarity` (segmented form included) against
plain loops, their properties, the Triton kernel against the reference, and the plugins that call them."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernel_checks import DEVICE, assert_kernel_matches, both_backends, needs_triton
from vtc_kernels.dispatch import trace
from vtc_kernels.similarity import FORMULAS, NORMALIZE, adjacent_frame_similarity, frame_cosine

VARIANTS = list(itertools.product(NORMALIZE, FORMULAS))
# the interpreter's numpy warns where the epsilon-free variants divide 0 by 0, which is the contract (NaN)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def loop_variant(a: list[float], b: list[float], normalize: str, formula: str) -> float:
    """One cosine in plain Python floats, the variant spelled out (epsilons as torch's defaults)."""

    def norm(v):
        return math.sqrt(sum(x * x for x in v))

    if normalize == "eps":
        a, b = [x / max(norm(a), 1e-12) for x in a], [y / max(norm(b), 1e-12) for y in b]
    elif normalize == "exact":
        a, b = [x / norm(a) for x in a], [y / norm(b) for y in b]
    dot = sum(x * y for x, y in zip(a, b))
    if formula == "torch":
        return dot / (max(norm(a), 1e-8) * max(norm(b), 1e-8))
    if formula == "ratio":
        return dot / (norm(a) * norm(b))
    return dot


def adversarial_pairs(n: int, d: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows: identical, opposite, same direction at 1000x the norm, a zero row, a tiny row, near-identical."""
    a = torch.randn(n, d, generator=generator)
    b = torch.randn(n, d, generator=generator)
    b[0] = a[0]
    b[1] = -a[1]
    b[2] = a[2] * 1e3
    a[3] = 0.0
    a[4] *= 1e-6
    b[5] = a[5] + 1e-3 * torch.randn(d, generator=generator)
    return a, b


@pytest.mark.parametrize(("normalize", "formula"), VARIANTS)
def test_frame_cosine_reference_matches_the_loop(normalize, formula):
    g = torch.Generator().manual_seed(0)
    a, b = adversarial_pairs(7, 12, g)
    a, b = a.double(), b.double()
    if normalize == "none" and formula == "dot":  # the plain dot is meant for unit rows
        a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
    got = frame_cosine(a, b, normalize, formula)
    for i in range(7):
        if (normalize == "exact" or formula == "ratio") and i == 3:
            assert math.isnan(got[i].item())  # no epsilon: 0 / 0
        else:
            assert got[i].item() == pytest.approx(loop_variant(a[i].tolist(), b[i].tolist(), normalize, formula), 1e-9)


def loop_segments(x, offsets, step, normalize, formula):
    parts = [adjacent_frame_similarity(x[s:e], step, normalize, formula) for s, e in zip(offsets[:-1], offsets[1:])]
    return torch.cat([p for p in parts if p.numel()] or [x.new_zeros(0, *x.shape[1:-1])])


@pytest.mark.parametrize("step", [1, 2])
def test_segmented_adjacent_similarity_is_the_per_video_loop(step):
    """Empty videos, one-frame videos and videos shorter than the step add no pair; no pair crosses a video."""
    g = torch.Generator().manual_seed(1)
    offsets = [0, 3, 3, 4, 9, 11]
    x = torch.randn(11, 5, 8, generator=g)
    got = adjacent_frame_similarity(x, step, "eps", "torch", frame_offsets=torch.tensor(offsets))
    assert got.shape == (sum(max(e - s - step, 0) for s, e in zip(offsets[:-1], offsets[1:])), 5)
    assert torch.equal(got, loop_segments(x, offsets, step, "eps", "torch"))
    # one segment is today's unsegmented op, bit for bit; a list of offsets works too
    assert torch.equal(adjacent_frame_similarity(x, step, frame_offsets=[0, 11]), adjacent_frame_similarity(x, step))


def test_bad_arguments_are_named():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="step must be an integer >= 1"):
        adjacent_frame_similarity(x, step=0)
    with pytest.raises(ValueError, match="normalize must be one of"):
        frame_cosine(x, x, normalize="l1")
    with pytest.raises(ValueError, match="formula one of"):
        adjacent_frame_similarity(x, formula="cos")
    for bad in ([1, 4], [0, 3], [0, 3, 2, 4]):
        with pytest.raises(ValueError, match="frame_offsets must rise from 0"):
            adjacent_frame_similarity(x, frame_offsets=torch.tensor(bad))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        adjacent_frame_similarity(x, frame_offsets=torch.tensor([0.0, 4.0]))


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    step=st.integers(1, 3),
    variant=st.sampled_from(VARIANTS),
    seed=st.integers(0, 2**16),
)
def test_segmented_counts_and_loop_property(lengths, step, variant, seed):
    g = torch.Generator().manual_seed(seed)
    offsets = [0, *itertools.accumulate(lengths)]
    x = torch.randn(offsets[-1], 2, 4, generator=g)
    got = adjacent_frame_similarity(x, step, *variant, frame_offsets=offsets)
    assert got.shape == (sum(max(n - step, 0) for n in lengths), 2)
    assert torch.equal(got.nan_to_num(9.0), loop_segments(x, offsets, step, *variant).nan_to_num(9.0))


@settings(max_examples=25, deadline=None)
@given(variant=st.sampled_from(VARIANTS), seed=st.integers(0, 2**16), rows=st.integers(1, 6))
def test_cosine_is_symmetric_and_follows_row_permutations(variant, seed, rows):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(rows, 6, generator=g), torch.randn(rows, 6, generator=g)
    perm = torch.randperm(rows, generator=g)
    sim = frame_cosine(a, b, *variant)
    assert torch.equal(frame_cosine(b, a, *variant), sim)  # products and norms commute exactly
    assert torch.equal(frame_cosine(a[perm], b[perm], *variant), sim[perm])
    # a cosine is bounded (up to rounding) wherever the rows are normalised by the variant
    if variant != ("none", "dot"):
        assert bool((sim.abs() <= 1 + 1e-6).all())


# --- Triton against the reference (tiny sizes: the CPU runs Triton's interpreter) --------------------------------


@needs_triton
@pytest.mark.parametrize(("normalize", "formula"), VARIANTS)
def test_triton_frame_cosine_float32_adversarial(normalize, formula):
    a, b = adversarial_pairs(8, 24, torch.Generator().manual_seed(2))
    expected, actual = assert_kernel_matches(frame_cosine, a.to(DEVICE), b.to(DEVICE), normalize, formula)
    # NaN exactly where the reference has it: the zero row under the epsilon-free variants only
    nan_rows = torch.isnan(expected).nonzero().flatten().tolist()
    assert nan_rows == ([3] if normalize == "exact" or formula == "ratio" else [])
    assert torch.equal(torch.isnan(actual), torch.isnan(expected))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_frame_cosine_low_precision(dtype):
    a, b = adversarial_pairs(8, 40, torch.Generator().manual_seed(3))
    b[2] = a[2] * 10  # x1000 overflows float16's norm (outside the contract)
    a[4] *= 1e4  # 1e-6 makes float16 products subnormal, where the reference loses digits (outside the contract)
    a, b = a.to(dtype).to(DEVICE), b.to(dtype).to(DEVICE)
    for normalize, formula in (("eps", "torch"), ("none", "ratio"), ("exact", "dot")):
        expected, _ = assert_kernel_matches(frame_cosine, a, b, normalize, formula)
        # float16 rounds both epsilons to 0: the zero row is NaN under every variant, as the official codes
        assert bool(torch.isnan(expected[3])) == (dtype == torch.float16 or normalize == "exact" or formula == "ratio")


@needs_triton
def test_triton_frame_cosine_broadcasts():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 16, generator=g).to(DEVICE)
    expected, _ = assert_kernel_matches(frame_cosine, x[:, None], x[None, :], "eps", "dot")  # all frame pairs
    assert expected.shape == (3, 3, 5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_adjacent_similarity_plain_and_segmented(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 3, 20, generator=g)
    x[4, 1] = x[3, 1]  # identical tokens across a step
    x[6, 0] = 0.0  # a zero token
    x = x.to(dtype).to(DEVICE)
    assert_kernel_matches(adjacent_frame_similarity, x, 1, "eps", "torch")
    assert_kernel_matches(adjacent_frame_similarity, x[:, 0], 2, "exact", "dot")  # frame-level features [T, D]
    offsets = torch.tensor([0, 4, 4, 5, 9], device=DEVICE)  # an empty and a one-frame video
    expected, _ = assert_kernel_matches(adjacent_frame_similarity, x, 1, "none", "ratio", frame_offsets=offsets)
    assert expected.shape == (6, 3)


@needs_triton
def test_triton_adjacent_similarity_without_pairs():
    x = torch.randn(2, 3, 4).to(DEVICE)
    for kwargs in ({"step": 2}, {"frame_offsets": torch.tensor([0, 1, 2])}):
        expected, actual = both_backends(adjacent_frame_similarity, x, **kwargs)
        assert expected.shape == actual.shape == (0, 3)


# --- the plugins call the shared ops ------------------------------------------------------------------------------


def test_plugins_call_the_shared_cosine_ops():
    from vtc_plugins.dycoke import ttm_keep
    from vtc_plugins.fastvid import dyseg
    from vtc_plugins.holitom import frame_similarity

    x = torch.randn(5, 4, 8)
    with trace() as calls:
        frame_similarity(x)
        dyseg(F.normalize(x[:, 0], dim=-1), 2, 0.5)
        ttm_keep(x.repeat(2, 1, 1), 0.5)
    names = [name for name, _ in calls]
    assert names.count("adjacent_frame_similarity") == 2 and names.count("frame_cosine") == 2
