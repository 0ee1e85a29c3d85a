"""vtc_kernels.attention.attention_rows: the reference against a per-(batch, head, row) loop, its properties, the
Triton kernel against the reference, and the LLM runtime calling the shared op."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernel_checks import DEVICE, assert_kernel_matches, needs_triton
from vtc_kernels.attention import attention_rows
from vtc_kernels.dispatch import triton_available, use_backend

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN rows, by contract


def random_case(batch, heads, kv_heads, queries, keys, dim, rows, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, queries, dim, generator=g).to(dtype)
    key = torch.randn(batch, kv_heads, keys, dim, generator=g).to(dtype)
    row_idx = torch.randint(0, queries, (batch, rows), generator=g)
    visible = torch.rand(batch, rows, keys, generator=g) > 0.3
    return query, key, row_idx, visible


def loop_attention(query, key, rows, visible, scaling):
    batch, heads, _, dim = query.shape
    rep = heads // key.shape[1]
    out = torch.full((batch, heads, rows.shape[1], key.shape[2]), float("nan"), dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for r, qi in enumerate(rows[b].tolist()):
                keys = [j for j in range(key.shape[2]) if visible[b, r, j]]
                logits = {j: scaling * float(query[b, h, qi] @ key[b, h // rep, j]) for j in keys}
                if not logits:
                    continue  # no visible key: NaN row
                top = max(logits.values())
                total = sum(math.exp(v - top) for v in logits.values())
                out[b, h, r] = 0.0
                for j, v in logits.items():
                    out[b, h, r, j] = math.exp(v - top) / total
    return out


def test_reference_matches_the_loop_with_grouped_heads():
    query, key, rows, visible = random_case(2, 6, 2, 5, 9, 8, 3, seed=0, dtype=torch.float64)
    visible[1, 2] = False  # a row with no visible key
    got = attention_rows(query, key, rows, visible, 0.3, upcast=False)  # float64 softmax
    expected = loop_attention(query, key, rows, visible, 0.3)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, equal_nan=True)
    upcast = attention_rows(query, key, rows, visible, 0.3, upcast=True)  # the softmax in float32, then back
    torch.testing.assert_close(upcast, expected, rtol=1e-6, atol=1e-7, equal_nan=True)
    assert bool(torch.isnan(got[1, :, 2]).all()) and not bool(torch.isnan(got[:, :, :2]).any())


@settings(max_examples=25, deadline=None)
@given(
    kv_heads=st.sampled_from([1, 2, 4]),
    keys=st.integers(1, 8),
    rows=st.integers(1, 3),
    upcast=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_reference_properties(kv_heads, keys, rows, upcast, seed):
    """Rows with a visible key sum to 1 with exactly 0 on invisible keys; rows without one are NaN; GQA equals the
    same keys repeated per query head; permuting the keys (and the mask) permutes the columns."""
    query, key, row_idx, visible = random_case(1, 4, kv_heads, 4, keys, 8, rows, seed)
    probs = attention_rows(query, key, row_idx, visible, 0.5, upcast)
    seen = visible.any(-1)[:, None, :].expand(-1, 4, -1)
    assert bool(torch.isnan(probs[~seen]).all())
    assert torch.allclose(probs[seen].sum(-1), torch.ones(()), atol=1e-5)
    hidden = ~visible[:, None].expand_as(probs)
    assert bool((probs[seen] >= 0).all()) and bool((probs.nan_to_num(0)[hidden] == 0).all())
    repeated = attention_rows(query, key.repeat_interleave(4 // kv_heads, dim=1), row_idx, visible, 0.5, upcast)
    assert torch.equal(repeated.nan_to_num(7), probs.nan_to_num(7))
    perm = torch.randperm(keys, generator=torch.Generator().manual_seed(seed))
    permuted = attention_rows(query, key[:, :, perm], row_idx, visible[:, :, perm], 0.5, upcast)
    torch.testing.assert_close(permuted, probs[..., perm], rtol=1e-5, atol=1e-6, equal_nan=True)


def test_bad_shapes_are_named():
    query, key, rows, visible = random_case(1, 4, 3, 4, 5, 8, 2, seed=1)
    with pytest.raises(ValueError, match="number of key heads that divides"):
        attention_rows(query, key, rows, visible, 1.0, True)
    query, key, rows, visible = random_case(1, 4, 2, 4, 5, 8, 2, seed=1)
    with pytest.raises(ValueError, match="key_visible must be bool"):
        attention_rows(query, key, rows, visible[:, :, :3], 1.0, True)
    with pytest.raises(ValueError, match="rows must be integer"):
        attention_rows(query, key, rows.float(), visible, 1.0, True)
    if triton_available():
        with use_backend("triton"), pytest.raises(ValueError, match=r"rows must be query indices in \[0, 4\)"):
            attention_rows(query, key, rows + 4, visible, 1.0, True)


# --- Triton against the reference (tiny: the CPU runs Triton's interpreter) --------------------------------------


@needs_triton
@pytest.mark.parametrize(
    ("dtype", "upcast"), [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, True)]
)
def test_triton_attention_rows_matches_the_reference(dtype, upcast):
    """GQA (4 query heads on 2 key heads), keys as transformers hands them (a transposed view), a row with no
    visible key (NaN, as the reference), a row seeing every key through an expanded mask."""
    query, key, rows, visible = random_case(1, 4, 2, 6, 11, 16, 2, seed=2, dtype=dtype)
    key = key.transpose(1, 2).contiguous().transpose(1, 2)  # [B, Hkv, k, d] view of a [B, k, Hkv, d] buffer
    visible[0, 0] = False
    expected, actual = assert_kernel_matches(
        attention_rows, query.to(DEVICE), key.to(DEVICE), rows.to(DEVICE), visible.to(DEVICE), 16**-0.5, upcast
    )
    assert bool(torch.isnan(actual[0, :, 0]).all()) and not bool(torch.isnan(actual[0, :, 1]).any())
    if dtype == torch.float32:
        everything = torch.ones(1, 1, 11, dtype=torch.bool, device=DEVICE).expand(1, 2, 11)  # stride-0 rows
        assert_kernel_matches(attention_rows, query.to(DEVICE), key.to(DEVICE), rows.to(DEVICE), everything, 0.5, True)


@needs_triton
def test_triton_attention_rows_over_several_key_tiles():
    """More keys than one tile (head dim 256 leaves 16 keys a tile), batch 2 with multi-query attention."""
    query, key, rows, visible = random_case(2, 2, 1, 3, 40, 256, 1, seed=3)
    visible[:, :, :20] = False  # the first tiles of the row are all masked: the running max starts at -inf
    args = (query.to(DEVICE), key.to(DEVICE), rows.to(DEVICE), visible.to(DEVICE))
    assert_kernel_matches(attention_rows, *args, 0.1, True)


def test_the_runtime_calls_the_shared_op():
    import vtc.hf.llm.attention as attention_module
    from vtc.hf.llm import runtime

    assert runtime.attention_rows is attention_rows
    assert not hasattr(attention_module, "attention_rows")  # no second copy
