"""Attention probabilities of a few query rows: what FastV, FrameFusion and PruneVid rank tokens by (vtc's LLM
runtime computes them beside the layer's SDPA output, which never materialises probabilities).

`attention_rows` is a kernel op (`vtc_kernels.dispatch`); its Triton kernel (`vtc_kernels.triton.attention`)
fuses the q.k logits over key tiles, the mask and a two-pass softmax per (batch, head, row), reading the keys of
head h from key head h // (H / Hkv) (grouped-query attention without repeated keys).

Tolerance contract (Triton against this reference). The reference follows transformers' eager attention: the
logits q k^T are rounded to the inputs' dtype, then scaled (rounded again), the softmax runs in float32 (`upcast`)
or in the inputs' dtype (torch computes it in float32 internally there too) and the result is cast back. The
kernel accumulates q.k in float32 in another order, rounds the logits like the reference, and computes the
softmax in float32; the result is rounded to the output dtype (ties to even). Bounds, per output dtype:
    float32  rtol 1e-5, atol 1e-6
    bfloat16 rtol 3e-2, atol 2e-3
    float16  rtol 4e-3, atol 3e-4
In bfloat16 / float16 a logit whose float32 sums fall on either side of a rounding boundary of the dtype differs
by one of its ulps (2^-7 relative in bfloat16), which moves that row's probabilities by up to that fraction;
the bounds cover it for |logit| < 4, the range the tests draw. Rows with no visible key: the reference's softmax
of all -inf is NaN in every position; the kernel returns NaN there too. Invisible keys get exactly 0. Row
indices outside [0, q): the reference's gather raises, the kernel's wrapper raises ValueError (one host sync).
"""

from __future__ import annotations

import torch

from vtc_kernels.dispatch import Tolerance, kernel_op

Tensor = torch.Tensor


def check_attention_rows(query: Tensor, key: Tensor, rows: Tensor, key_visible: Tensor) -> None:
    """Raise ValueError unless the shapes fit: query [B, H, q, d], key [B, Hkv, k, d] with Hkv dividing H,
    rows [B, r] integer query indices, key_visible [B, r, k] bool."""
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(
            f"attention_rows: query must be [B, H, q, d] and key [B, Hkv, k, d], got {tuple(query.shape)} and "
            f"{tuple(key.shape)}"
        )
    batch, heads, _, dim = query.shape
    if key.shape[0] != batch or key.shape[3] != dim or key.shape[1] < 1 or heads % key.shape[1]:
        raise ValueError(
            f"attention_rows: key {tuple(key.shape)} does not fit query {tuple(query.shape)} (same B and d, and a "
            f"number of key heads that divides the {heads} query heads)"
        )
    if rows.dim() != 2 or rows.shape[0] != batch or rows.dtype.is_floating_point or rows.dtype == torch.bool:
        raise ValueError(f"attention_rows: rows must be integer [B={batch}, r], got {rows.dtype} {tuple(rows.shape)}")
    if key_visible.dtype != torch.bool or tuple(key_visible.shape) != (batch, rows.shape[1], key.shape[2]):
        raise ValueError(
            f"attention_rows: key_visible must be bool [B, r, k] = {(batch, rows.shape[1], key.shape[2])}, got "
            f"{key_visible.dtype} {tuple(key_visible.shape)}"
        )


@kernel_op(
    "attention_rows",
    tolerance=Tolerance.allclose(
        {torch.float32: (1e-5, 1e-6), torch.bfloat16: (3e-2, 2e-3), torch.float16: (4e-3, 3e-4)},
        note="float32 q.k sums rounded to the inputs' dtype like the reference's logits; NaN rows (no visible "
        "key) as the reference",
    ),
    triton="vtc_kernels.triton.attention:attention_rows",
)
def attention_rows(
    query: Tensor,
    key: Tensor,
    rows: Tensor,
    key_visible: Tensor,
    scaling: float,
    upcast: bool,
) -> Tensor:
    """Attention probabilities of selected query rows.

    query [B, H, q, d], key [B, Hkv, k, d] (grouped-query attention: query head h reads key head
    h // (H / Hkv)), rows [B, r] query indices, key_visible [B, r, k] bool: which keys each selected row may
    attend to (causal + padding). Returns [B, H, r, k] in query's dtype. `upcast` computes the softmax in
    float32 and casts back (what transformers' eager attention does); otherwise the softmax runs in the model
    dtype. A row with no visible key is NaN (softmax of all -inf).
    """
    check_attention_rows(query, key, rows, key_visible)
    batch, heads, _, dim = query.shape
    n_rep = heads // key.shape[1]
    # the keys are repeated per query head, not shared through a [B, Hkv, rep * r, d] view of the queries: that
    # view changes the matmul's shape (M = rep * r instead of r) and with it BLAS's summation order, which moves
    # float32 probabilities by an ulp (seen on the FastV / FrameFusion tests), and the reference stays bit-exact
    if n_rep > 1:
        key = key.repeat_interleave(n_rep, dim=1)
    q = torch.gather(query, 2, rows[:, None, :, None].expand(batch, heads, rows.shape[1], dim))
    logits = (q @ key.transpose(-1, -2)) * scaling
    logits = logits.masked_fill(~key_visible[:, None], float("-inf"))
    if upcast:
        return torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.softmax(logits, dim=-1)
