"""ToMe's tensor functions: exact equality with a literal transcription of the official code (facebookresearch/ToMe
at af95e4b: `tome/merge.py`, `tome/utils.py::parse_r`, the merge step of `tome/patch/timm.py::ToMeBlock`),
known answers (an identical pair merges to its weighted mean, r = 0 changes nothing, source rows sum to the sizes,
unmerging by source gives every token its group's average) and proportional attention against duplicated tokens."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from vtc_plugins.tome import (
    MergePlan,
    bipartite_soft_matching,
    merge_source,
    merge_wavg,
    parse_r,
    proportional_attention_bias,
    tome_layer_step,
    unmerge_by_source,
)

# --- the official functions, transcribed as literally as possible (closures and all) ------------------------------


def do_nothing(x, mode=None):
    return x


def official_bipartite_soft_matching(metric, r, class_token=False, distill_token=False):
    protected = 0
    if class_token:
        protected += 1
    if distill_token:
        protected += 1

    t = metric.shape[1]
    r = min(r, (t - protected) // 2)

    if r <= 0:
        return do_nothing, do_nothing

    with torch.no_grad():
        metric = metric / metric.norm(dim=-1, keepdim=True)
        a, b = metric[..., ::2, :], metric[..., 1::2, :]
        scores = a @ b.transpose(-1, -2)

        if class_token:
            scores[..., 0, :] = -math.inf
        if distill_token:
            scores[..., :, 0] = -math.inf

        node_max, node_idx = scores.max(dim=-1)
        edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]

        unm_idx = edge_idx[..., r:, :]
        src_idx = edge_idx[..., :r, :]
        dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)

        if class_token:
            unm_idx = unm_idx.sort(dim=1)[0]

    def merge(x, mode="mean"):
        src, dst = x[..., ::2, :], x[..., 1::2, :]
        n, t1, c = src.shape
        unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
        src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
        dst = dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce=mode)

        if distill_token:
            return torch.cat([unm[:, :1], dst[:, :1], unm[:, 1:], dst[:, 1:]], dim=1)
        else:
            return torch.cat([unm, dst], dim=1)

    def unmerge(x):
        unm_len = unm_idx.shape[1]
        unm, dst = x[..., :unm_len, :], x[..., unm_len:, :]
        n, _, c = unm.shape

        src = dst.gather(dim=-2, index=dst_idx.expand(n, r, c))

        out = torch.zeros(n, metric.shape[1], c, device=x.device, dtype=x.dtype)

        out[..., 1::2, :] = dst
        out.scatter_(dim=-2, index=(2 * unm_idx).expand(n, unm_len, c), src=unm)
        out.scatter_(dim=-2, index=(2 * src_idx).expand(n, r, c), src=src)

        return out

    return merge, unmerge


def official_merge_wavg(merge, x, size=None):
    if size is None:
        size = torch.ones_like(x[..., 0, None])

    x = merge(x * size, mode="sum")
    size = merge(size, mode="sum")

    x = x / size
    return x, size


def official_merge_source(merge, x, source=None):
    if source is None:
        n, t, _ = x.shape
        source = torch.eye(t, device=x.device)[None, ...].expand(n, t, t)

    source = merge(source, mode="amax")
    return source


def official_parse_r(num_layers, r):
    inflect = 0
    if isinstance(r, list):
        if len(r) < num_layers:
            r = r + [0] * (num_layers - len(r))
        return list(r)
    elif isinstance(r, tuple):
        r, inflect = r

    min_val = int(r * (1.0 - inflect))
    max_val = 2 * r - min_val
    step = (max_val - min_val) / (num_layers - 1)

    return [int(min_val + step * i) for i in range(num_layers)]


def official_block_step(info, x, metric):
    """The merge part of `ToMeBlock.forward` (metric = `ToMeAttention`'s `k.mean(1)`)."""
    r = info["r"].pop(0)
    if r > 0:
        merge, _ = official_bipartite_soft_matching(metric, r, info["class_token"], info["distill_token"])
        if info["trace_source"]:
            info["source"] = official_merge_source(merge, x, info["source"])
        x, info["size"] = official_merge_wavg(merge, x, info["size"])
    return x


# --- equality with the official code -------------------------------------------------------------------------------

SHAPES = [(1, 1), (2, 2), (3, 7), (2, 16), (3, 17)]


def cases(n: int) -> list[int]:
    return sorted({0, 1, n // 2, n // 2 + 3, 10 * n})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("class_token,distill_token", [(False, False), (True, False), (True, True)])
def test_matching_merge_and_unmerge_equal_the_official_code(dtype, class_token, distill_token):
    g = torch.Generator().manual_seed(0)
    for batch, n in SHAPES:
        for r in cases(n):
            metric = torch.randn(batch, n, 8, generator=g, dtype=dtype)
            x = torch.randn(batch, n, 5, generator=g, dtype=dtype)
            merge, unmerge = official_bipartite_soft_matching(metric, r, class_token, distill_token)
            plan = bipartite_soft_matching(metric, r, class_token, distill_token)
            clipped = max(min(r, (n - class_token - distill_token) // 2), 0)
            assert isinstance(plan, MergePlan) and plan.r == clipped and plan.num_tokens == n
            for mode in ("mean", "sum", "amax"):
                out = plan.merge(x, mode)
                assert out.shape == (batch, n - clipped, 5)
                assert torch.equal(out, merge(x, mode)), (batch, n, r, mode)
            if not distill_token:  # the official unmerge reads [unmerged A ; B] even with a distillation token
                assert torch.equal(plan.unmerge(plan.merge(x)), unmerge(merge(x)))
            if clipped == 0:
                assert plan.merge(x) is x and plan.unmerge(x) is x  # the official do_nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("class_token", [False, True])
def test_wavg_and_source_equal_the_official_code_over_layers(dtype, class_token):
    g = torch.Generator().manual_seed(1)
    for batch, n in SHAPES:
        for r in cases(n):
            x = torch.randn(batch, n, 6, generator=g, dtype=dtype)
            ours_x, ours_size, ours_source = x, None, None
            ref_x, ref_size, ref_source = x, None, None
            for _ in range(3):  # later layers start from sizes and sources that are not None
                metric = torch.randn(batch, ours_x.shape[1], 4, generator=g, dtype=dtype)
                merge, _ = official_bipartite_soft_matching(metric, r, class_token)
                plan = bipartite_soft_matching(metric, r, class_token)
                ref_source = official_merge_source(merge, ref_x, ref_source)
                ref_x, ref_size = official_merge_wavg(merge, ref_x, ref_size)
                ours_source = merge_source(plan, ours_x, ours_source)
                ours_x, ours_size = merge_wavg(plan, ours_x, ours_size)
                assert torch.equal(ours_x, ref_x) and torch.equal(ours_size, ref_size)
                assert torch.equal(ours_source, ref_source) and ours_source.dtype == torch.float32
                assert ours_size.dtype == dtype


@pytest.mark.parametrize("class_token", [False, True])
def test_layer_step_equals_the_official_block(class_token):
    g = torch.Generator().manual_seed(2)
    batch, n, heads = 2, 33, 3
    schedule = [4, 0, 9, 30, 1, 5]  # 30: clipped to half the tokens
    x = torch.randn(batch, n, 8, generator=g)
    info = {"r": list(schedule), "size": None, "source": None, "trace_source": True}
    info.update(class_token=class_token, distill_token=False)
    ref, ours, size, source, all_keys = x, x, None, None, []
    for r in schedule:
        keys = torch.randn(batch, heads, ours.shape[1], 4, generator=g)
        ref = official_block_step(info, ref, keys.mean(1))
        ours, size, source = tome_layer_step(ours, size, source, keys, r, class_token, True)
        assert torch.equal(ours, ref) and torch.equal(size, info["size"]) and torch.equal(source, info["source"])
        all_keys.append(keys)
    left = n
    for r in schedule:  # each r clipped to half the unprotected tokens of its block (30 at 20 tokens, 5 at 9-10)
        left -= min(r, (left - class_token) // 2)
    assert ours.shape[1] == left == (5 if not class_token else 6)
    # without trace_source the source map is never built; the rest is the same
    untraced, untraced_size = x, None
    for r, keys in zip(schedule, all_keys):
        untraced, untraced_size, no_source = tome_layer_step(untraced, untraced_size, None, keys, r, class_token)
        assert no_source is None
    assert torch.equal(untraced, ours) and torch.equal(untraced_size, size)


def test_parse_r_equals_the_official_code():
    for layers in (2, 3, 12, 24):
        for r in (0, 1, 8, 13, 16, (8, 0.0), (8, -1.0), (8, 1.0), (13, 0.5), (16, -0.3), [3, 2, 1], [1] * 30):
            assert parse_r(layers, r) == official_parse_r(layers, r), (layers, r)
    assert parse_r(12, 8) == [8] * 12
    assert parse_r(4, (8, -1.0)) == [16, 10, 5, 0]  # the paper's decreasing schedule: from 2r down to 0
    assert parse_r(4, (8, 1.0)) == [0, 5, 10, 16]
    assert parse_r(4, [3, 2]) == [3, 2, 0, 0]
    assert parse_r(1, 8) == [8] and parse_r(1, (8, -1.0)) == [16]  # the official code divides by zero here
    assert parse_r(0, 8) == []


# --- known answers -------------------------------------------------------------------------------------------------


def test_identical_pair_merges_into_its_weighted_mean():
    # metric: one-hot directions, tokens 2 (A_1) and 3 (B_1) share one, so they are the only similar pair
    metric = torch.eye(6, dtype=torch.float64)[[0, 1, 2, 2, 4, 5]][None]
    x = torch.arange(6 * 3, dtype=torch.float64).reshape(1, 6, 3) ** 1.5
    plan = bipartite_soft_matching(metric, 1, class_token=True)
    assert plan.merged.tolist() == [[1]] and plan.destination.tolist() == [[1]] and plan.unmerged.tolist() == [[0, 2]]
    out, size = merge_wavg(plan, x)
    expected = torch.stack([x[0, 0], x[0, 4], x[0, 1], (x[0, 2] + x[0, 3]) / 2, x[0, 5]])[None]
    assert torch.allclose(out, expected, rtol=0, atol=1e-12)  # [unmerged A in order ; B]
    assert size.flatten().tolist() == [1, 1, 1, 2, 1]
    weighted, size = merge_wavg(
        plan, x, torch.tensor([1.0, 1.0, 3.0, 1.0, 1.0, 1.0], dtype=torch.float64)[None, :, None]
    )
    assert torch.allclose(weighted[0, 3], (3 * x[0, 2] + x[0, 3]) / 4, rtol=0, atol=1e-12)
    assert size.flatten().tolist() == [1, 1, 1, 4, 1]
    # without a class token the pair merges the same; the unmerged A tokens come in score order (here all tied)
    plan = bipartite_soft_matching(metric, 1)
    out, size = merge_wavg(plan, x)
    assert plan.merged.tolist() == [[1]] and sorted(plan.unmerged.flatten().tolist()) == [0, 2]
    assert torch.allclose(out[0, 2:], expected[0, 2:], rtol=0, atol=1e-12)
    assert size.flatten().tolist() == [1, 1, 1, 2, 1]


def test_r_zero_and_clipping():
    g = torch.Generator().manual_seed(3)
    x, keys = torch.randn(2, 9, 4, generator=g), torch.randn(2, 2, 9, 3, generator=g)
    size, source = torch.ones(2, 9, 1), torch.eye(9).expand(2, 9, 9)
    out = tome_layer_step(x, None, None, keys, 0)
    assert out[0] is x and out[1] is None and out[2] is None
    out = tome_layer_step(x, size, source, keys, -2, trace_source=True)
    assert out[0] is x and out[1] is size and out[2] is source
    plan = bipartite_soft_matching(keys.mean(1), 0)
    merged, merged_size = merge_wavg(plan, x)
    assert torch.equal(merged, x) and torch.equal(merged_size, torch.ones(2, 9, 1))
    assert torch.equal(merge_source(plan, x), torch.eye(9).expand(2, 9, 9))
    assert bipartite_soft_matching(keys.mean(1), 100).r == 4 and bipartite_soft_matching(x, 100, True).r == 4
    assert bipartite_soft_matching(x[:, :8], 100).r == 4 and bipartite_soft_matching(x[:, :8], 100, True).r == 3
    # r > 0 clipped to 0 (one token): the official block still materialises size and source
    one, one_size, one_source = tome_layer_step(x[:, :1], None, None, keys[:, :, :1], 5, trace_source=True)
    assert torch.equal(one, x[:, :1]) and torch.equal(one_size, torch.ones(2, 1, 1))
    assert torch.equal(one_source, torch.ones(2, 1, 1))
    with pytest.raises(ValueError, match="keys must be"):
        tome_layer_step(x, None, None, keys.mean(1), 2)
    with pytest.raises(ValueError, match="metric must be"):
        bipartite_soft_matching(keys, 2)


def merged_over_layers(x, schedule, class_token=False, seed=4):
    """Several layers of plain ToMe steps on random keys; returns (x, size, source, the plans)."""
    g = torch.Generator().manual_seed(seed)
    size, source, plans = None, None, []
    for r in schedule:
        plan = bipartite_soft_matching(
            torch.randn(x.shape[0], x.shape[1], 4, generator=g, dtype=x.dtype), r, class_token
        )
        source = merge_source(plan, x, source)
        x, size = merge_wavg(plan, x, size)
        plans.append(plan)
    return x, size, source, plans


def test_source_rows_sum_to_the_sizes_and_partition_the_tokens():
    x = torch.randn(3, 40, 5, generator=torch.Generator().manual_seed(5))
    out, size, source, _ = merged_over_layers(x, [6, 8, 3, 9, 2])
    assert source.shape == (3, 40 - 28, 40) and size.shape == (3, 12, 1)
    assert set(source.unique().tolist()) == {0.0, 1.0}
    assert torch.equal(source.sum(-1), size[..., 0])
    assert torch.equal(source.sum(1), torch.ones(3, 40))  # every original token is in exactly one merged token
    assert int(size.max()) > 2


@pytest.mark.parametrize("class_token", [False, True])
def test_unmerge_by_source_gives_each_token_its_group_average(class_token):
    x = torch.randn(2, 36, 4, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    out, size, source, plans = merged_over_layers(x, [5, 7, 4, 6], class_token)
    grid = unmerge_by_source(out, source)
    assert grid.shape == x.shape
    members = source.to(x.dtype)
    group_mean = (members @ x) / members.sum(-1, keepdim=True)  # weighted averages of averages = plain means
    assert torch.allclose(out, group_mean, rtol=0, atol=1e-12)
    holder = source.argmax(dim=1)
    for b in range(2):
        for n in range(36):
            assert torch.equal(grid[b, n], out[b, holder[b, n]])
            assert torch.allclose(grid[b, n], x[b, source[b, holder[b, n]].bool()].mean(0), rtol=0, atol=1e-12)
    # the official way back, one unmerge per layer in reverse, gives the same copies
    back = out
    for plan in reversed(plans):
        back = plan.unmerge(back)
    assert torch.equal(back, grid)
    if class_token:
        assert torch.equal(grid[:, 0], x[:, 0])  # the class token is never merged


def test_distillation_layout_unmerges_like_the_plain_one():
    g = torch.Generator().manual_seed(7)
    metric, x = torch.randn(2, 15, 4, generator=g), torch.randn(2, 15, 3, generator=g)
    plan = bipartite_soft_matching(metric, 5, class_token=True, distill_token=True)
    plain = dataclasses.replace(plan, distill_token=False)
    merged = plan.merge(x)
    assert torch.equal(merged[:, :2], x[:, :2])  # class and distillation tokens lead, unmerged
    assert torch.equal(plan.unmerge(merged), plain.unmerge(plain.merge(x)))
    with pytest.raises(ValueError, match="must share batch and T"):
        unmerge_by_source(merged, torch.ones(2, 9, 15))


# --- proportional attention ----------------------------------------------------------------------------------------


def test_proportional_attention_equals_attention_over_duplicated_tokens():
    g = torch.Generator().manual_seed(8)
    batch, heads, n, dim = 2, 3, 5, 4
    sizes = torch.tensor([[1, 3, 2, 1, 4], [2, 1, 1, 5, 1]])
    q, k, v = (torch.randn(batch, heads, n, dim, generator=g, dtype=torch.float64) for _ in range(3))
    size = sizes[..., None].to(torch.float64)
    bias = proportional_attention_bias(size)
    assert bias.shape == (batch, 1, 1, n) and proportional_attention_bias(None) is None
    assert proportional_attention_bias(size, torch.float32).dtype == torch.float32
    merged = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    # the official expression on the scaled logits
    logits = (q @ k.transpose(-2, -1)) * dim**-0.5 + size.log()[:, None, None, :, 0]
    assert torch.allclose(merged, logits.softmax(-1) @ v, rtol=0, atol=1e-12)
    plain = F.scaled_dot_product_attention(q, k, v)
    for b in range(batch):
        copies = torch.repeat_interleave(torch.arange(n), sizes[b])
        dq, dk, dv = q[b : b + 1, :, copies], k[b : b + 1, :, copies], v[b : b + 1, :, copies]
        duplicated = F.scaled_dot_product_attention(dq, dk, dv)  # every copy attends and is attended to
        first = torch.cumsum(sizes[b], 0) - sizes[b]
        assert torch.allclose(duplicated[0, :, first], merged[b], rtol=0, atol=1e-12)
        assert not torch.allclose(duplicated[0, :, first], plain[b], rtol=0, atol=1e-3)  # the bias matters
