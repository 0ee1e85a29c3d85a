"""SparseVLM: rater selection, scoring, pruning and recycling against the official tensor code transcribed below
(Gumpest/SparseVLMs `main` 26a5f488, USE_VERSION=1_0) on random tensors; hand-built inputs with known answers; the
budgets per layer; and the patched model against an independent layer-by-layer reference (prefill and decode)."""

from __future__ import annotations

import math

import pytest
import torch

import vtc
from tests.conftest import QUESTIONS, model_and_processor, single_inputs, videos
from tests.reference import CAPTURED, compressible_video_mask, start
from vtc.testing import tiny
from vtc_plugins.sparsevlm import (
    OFFICIAL_SCHEDULES,
    SparseVLM,
    cluster_count,
    kept_count,
    layer_counts,
    mean_retention,
    official_targets,
    path_targets,
    plan_stage,
    rater_scores,
    recycled_count,
    recycled_tokens,
    retention_targets,
    select_raters,
    stage_counts,
)

# --- the official tensor code, transcribed ------------------------------------------------------------------------
# llava/model/language_model/modelling_sparse_llama.py (main 26a5f488), utils.py, score.py; B = 1 as upstream.


def official_raters(hidden, v_token_start, image_shape):
    """modelling_sparse_llama.py L194-204: the text raters on the input embeddings."""
    text_token_start = v_token_start + image_shape
    v_t = hidden[:, v_token_start:text_token_start, :]
    t_t = hidden[:, text_token_start:, :]
    m_v_t = v_t @ t_t.transpose(1, 2)
    m_v_t = m_v_t.softmax(2).mean(1)
    return torch.where(m_v_t > m_v_t.mean())


def official_attn_postprocess_topk(self_attn_weights, v_token_start, v_token_num, text_token_start, t_token_idx, keep):
    """score.py L23-46, with `sparse_token_list[layer_dict[layer_idx]]` passed in as `keep`."""
    self_attn_weights = self_attn_weights.mean(1)
    t_token_idx = t_token_idx[1] + text_token_start
    relation_vis_text = self_attn_weights[:, t_token_idx, v_token_start : v_token_start + v_token_num]
    relation_vis_text = relation_vis_text.mean(1)
    relation_vis = relation_vis_text
    s_flag = True
    if v_token_num != 0:
        mask = torch.zeros_like(relation_vis, dtype=bool)
        _, indices = torch.topk(relation_vis, min(keep, v_token_num - 1), dim=1)
        mask[0][indices] = 1
    else:
        mask = torch.ones_like(relation_vis_text, dtype=bool)
        s_flag = False
    return mask, s_flag, relation_vis_text


def index_points(points, idx):
    """utils.py L159-176."""
    device = points.device
    B = points.shape[0]
    view_shape = list(idx.shape)
    view_shape[1:] = [1] * (len(view_shape) - 1)
    repeat_shape = list(idx.shape)
    repeat_shape[0] = 1
    batch_indices = torch.arange(B, dtype=torch.long).to(device).view(view_shape).repeat(repeat_shape)
    return points[batch_indices, idx, :]


def official_cluster_and_merge(x, cluster_num, noise=None):
    """utils.py L179-239 (einops' rearranges written as indexing); also returns `index_down` (the centres), which the
    LightCompress port returns too. `noise` [1, N]: the density's U(0, 1) draw given instead of drawn (tests only)."""
    B, N, C = x.shape
    x1 = x[:, :, None, :]
    x2 = x[:, None, :, :]
    distance = (x1 - x2).norm(dim=-1, p=2)
    dist_matrix = distance / (C**0.5)
    dist_nearest, index_nearest = torch.topk(dist_matrix, k=cluster_num, dim=-1, largest=False)
    density = (-(dist_nearest**2).mean(dim=-1)).exp()
    if noise is None:
        noise = torch.rand(density.shape, device=density.device, dtype=density.dtype)
    density = density + noise * 1e-6
    mask = density[:, None, :] > density[:, :, None]
    mask = mask.type(x.dtype)
    dist_max = dist_matrix.flatten(1).max(dim=-1)[0][:, None, None]
    dist, index_parent = (dist_matrix * mask + dist_max * (1 - mask)).min(dim=-1)
    score = dist * density
    _, index_down = torch.topk(score, k=cluster_num, dim=-1)
    dist_matrix = index_points(dist_matrix, index_down)
    idx_cluster = dist_matrix.argmin(dim=1)
    idx_batch = torch.arange(B, device=x.device)[:, None].expand(B, cluster_num)
    idx_tmp = torch.arange(cluster_num, device=x.device)[None, :].expand(B, cluster_num)
    idx_cluster[idx_batch.reshape(-1), index_down.reshape(-1)] = idx_tmp.reshape(-1)
    token_weight = x.new_ones(B, N, 1)
    idx_batch = torch.arange(B, device=x.device)[:, None]
    idx = idx_cluster + idx_batch * cluster_num
    all_weight = token_weight.new_zeros(B * cluster_num, 1)
    all_weight.index_add_(dim=0, index=idx.reshape(B * N), source=token_weight.reshape(B * N, 1))
    all_weight = all_weight + 1e-6
    norm_weight = token_weight / all_weight[idx]
    x_merged = x.new_zeros(B * cluster_num, C)
    source = x * norm_weight
    x_merged.index_add_(dim=0, index=idx.reshape(B * N), source=source.reshape(B * N, C).type(x.dtype))
    return x_merged.reshape(B, cluster_num, C), index_down


def batch_index_select(x, idx):
    """utils.py L20-45 (the 3-D case)."""
    B, N, C = x.size()
    N_new = idx.size(1)
    offset = torch.arange(B, dtype=torch.long, device=x.device).view(B, 1) * N
    return x.reshape(B * N, C)[(idx + offset).reshape(-1)].reshape(B, N_new, C)


def official_stage(
    layer_output, attn_logits, v_token_start, v_token_num, t_token_idx, keep, in_index_order=False, token_noise=None
):
    """modelling_sparse_llama.py L253-307 for one sparse layer (B = 1, USE_VERSION=1_0): score, keep, recycle and the
    reassembled sequence [sys | kept visual | recycled | text]. `in_index_order` clusters the recycled tokens in index
    order (vtc's order) instead of score order; `token_noise` gives each recycled token (in index order) its density
    noise wherever it sits. Returns what a test compares."""
    text_token_start = v_token_start + v_token_num
    pred_score_vis, s_flag, relation_vis_text = official_attn_postprocess_topk(
        attn_logits, v_token_start, v_token_num, text_token_start, t_token_idx, keep
    )
    policy = torch.ones(1, layer_output.shape[1], dtype=layer_output.dtype)
    policy[:, v_token_start:text_token_start] = pred_score_vis.type(dtype=layer_output.dtype)
    total_sparse_token_idx = torch.where(policy == 0)[1].unsqueeze(0)
    total_sparse_token = batch_index_select(layer_output, total_sparse_token_idx)
    merge_token_idx_stage1 = torch.where(pred_score_vis == 0)[1]
    merge_token_stage1 = relation_vis_text[0][merge_token_idx_stage1]
    merge_token_num_stage1 = int(merge_token_idx_stage1.shape[0] * 0.3) + 1
    merge_token_stage2_idx = merge_token_stage1.topk(merge_token_num_stage1)[1]
    if in_index_order:
        merge_token_stage2_idx = torch.sort(merge_token_stage2_idx).values
    merge_token_stage2 = total_sparse_token[:, merge_token_stage2_idx, :]
    cluster_num = int(merge_token_stage2.shape[1] / 10) + 1
    if cluster_num == 0:
        cluster_num = merge_token_stage2.shape[1]
    noise = None
    if token_noise is not None:
        noise = token_noise[torch.searchsorted(torch.sort(merge_token_stage2_idx).values, merge_token_stage2_idx)][None]
    merge_sparse_token, index_down = official_cluster_and_merge(merge_token_stage2, cluster_num, noise)
    select_token_idx = torch.where(policy == 1)[1].unsqueeze(0)
    select_token = batch_index_select(layer_output, select_token_idx)
    select_vis_token_num = pred_score_vis.sum()
    sequence = torch.cat(
        (
            select_token[:, : v_token_start + select_vis_token_num, :],
            merge_sparse_token,
            select_token[:, v_token_start + select_vis_token_num :, :],
        ),
        dim=1,
    )
    recycled = merge_token_idx_stage1[merge_token_stage2_idx]  # visual indices of the recycled tokens
    return {
        "scores": relation_vis_text[0],
        "kept": torch.nonzero(pred_score_vis[0]).flatten(),
        "recycled": recycled,
        "centers": recycled[index_down[0]],
        "merged": merge_sparse_token[0],
        "sequence": sequence[0],
        "v_token_num": int(select_vis_token_num) + cluster_num,
    }


def causal_probs(logits: torch.Tensor) -> torch.Tensor:
    """softmax with the causal mask, as `scaled_dot_product_attention` (utils.py L95-116) computes it."""
    n = logits.shape[-1]
    bias = torch.zeros(n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(logits + bias, dim=-1)


# --- against the official code on random tensors --------------------------------------------------------------------


def random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    sys_len = int(torch.randint(1, 6, (1,), generator=g))
    num_visual = int(torch.randint(12, 90, (1,), generator=g))
    num_text = int(torch.randint(3, 14, (1,), generator=g))
    dim = int(torch.randint(8, 24, (1,), generator=g))
    heads = int(torch.randint(1, 4, (1,), generator=g))
    n = sys_len + num_visual + num_text
    hidden = torch.randn(1, n, dim, generator=g)
    attention = causal_probs(torch.randn(1, heads, n, n, generator=g) * 3)
    keep = int(torch.randint(0, num_visual + 3, (1,), generator=g))  # beyond N too: the min(k, N - 1) cap
    return sys_len, num_visual, hidden, attention, keep


CASES = 40


def test_rating_scoring_pruning_and_recycling_match_the_official_code_on_40_random_cases():
    """Per case: the raters, the scores, the kept tokens, the recycled tokens and their clusters (official clustering
    in vtc's index order, same noise), and the reassembled sequence's content against the verbatim official block
    (score-order clustering)."""
    for seed in range(CASES):
        sys_len, num_visual, hidden, attention, keep = random_case(seed)
        text_start = sys_len + num_visual
        t_token_idx = official_raters(hidden, sys_len, num_visual)
        raters = select_raters(hidden[0, sys_len:text_start], hidden[0, text_start:])
        assert torch.nonzero(raters).flatten().tolist() == t_token_idx[1].tolist(), seed

        visual = torch.arange(sys_len, text_start)
        scores = rater_scores(attention[0, :, text_start:], torch.nonzero(raters).flatten(), visual)
        torch.manual_seed(0)
        official = official_stage(hidden, attention, sys_len, num_visual, t_token_idx, keep, in_index_order=True)
        torch.testing.assert_close(scores, official["scores"], rtol=1e-6, atol=1e-9)

        plan = plan_stage(scores, hidden[0, visual], keep, torch.Generator().manual_seed(0))
        assert plan.kept.tolist() == official["kept"].tolist(), seed
        assert plan.kept.numel() == kept_count(keep, num_visual)
        assert plan.recycled.tolist() == sorted(official["recycled"].tolist()), seed
        assert plan.recycled[plan.centers].tolist() == official["centers"].tolist(), seed
        merged = recycled_tokens(hidden[0, visual][plan.recycled], plan.centers, plan.labels)
        torch.testing.assert_close(merged, official["merged"], rtol=1e-5, atol=1e-6)  # official: / (n + 1e-6)

        # the official block as written (score-order clustering), each token with the noise it drew above: the same
        # tokens leave, the same clusters come back; vtc puts each at its centre's slot, not after the kept tokens
        token_noise = torch.rand(plan.recycled.numel(), generator=torch.Generator().manual_seed(0))
        verbatim = official_stage(hidden, attention, sys_len, num_visual, t_token_idx, keep, token_noise=token_noise)
        assert sorted(verbatim["centers"].tolist()) == sorted(official["centers"].tolist()), seed
        assert verbatim["v_token_num"] == stage_counts(num_visual, [keep])[0]
        ours = hidden[0].clone()
        ours[visual[plan.recycled[plan.centers]]] = merged
        survivors = torch.cat(
            [torch.arange(sys_len), visual[plan.survivors()], torch.arange(text_start, hidden.shape[1])]
        )
        got = ours[survivors]
        want = verbatim["sequence"]
        assert got.shape == want.shape
        torch.testing.assert_close(got[:sys_len], want[:sys_len])
        torch.testing.assert_close(got[-(hidden.shape[1] - text_start) :], want[-(hidden.shape[1] - text_start) :])
        pair = (got[sys_len:text_start, None] - want[None, sys_len:text_start]).norm(dim=-1)  # same rows, any order
        assert bool((pair.min(dim=1).values < 1e-4).all()) and bool((pair.min(dim=0).values < 1e-4).all()), seed


def test_the_official_counts_and_lists():
    # score.py: RETAIN_TOKN -> tokens kept after layers 2 / 6 / 15 of LLaVA-1.5's 576
    assert OFFICIAL_SCHEDULES == {192: (300, 200, 110), 128: (303, 110, 36), 96: (238, 48, 26), 64: (66, 30, 17)}
    assert official_targets(192, 576) == [300, 200, 110]
    assert official_targets(128, 1152) == [606, 220, 72]  # scaled with the visual tokens
    assert official_targets(64, 288) == [33, 15, round(8.5)] == [33, 15, 8]
    # recycling: int(0.3 n) + 1 tokens in int(m / 10) + 1 clusters
    assert [recycled_count(n) for n in (1, 2, 3, 4, 10, 276)] == [1, 1, 1, 2, 4, 83]
    assert [cluster_count(m) for m in (1, 9, 10, 83)] == [1, 1, 2, 9]
    # 192 on 576 tokens: 276 dropped -> 83 recycled in 9 clusters -> 309; then 204, 113
    assert stage_counts(576, [300, 200, 110]) == [309, 204, 113]
    assert stage_counts(576, [66, 30, 17]) == [82, 32, 18]
    assert stage_counts(1, [5, 5]) == [1, 1] and stage_counts(0, [5]) == [0]
    # what each of LLaVA-1.5's 32 layers sees: the name counts "2*576 4*300 10*200 16*110" (191 per layer, score.py's
    # comment); layer 2 sees all 576 and the recycled tokens are there too, so each layer sees 206.5 on average
    per_layer = layer_counts(576, (2, 6, 15), [309, 204, 113], 32)
    assert per_layer == [576] * 3 + [309] * 4 + [204] * 9 + [113] * 16
    assert (2 * 576 + 4 * 300 + 10 * 200 + 16 * 110) / 32 == 191 and sum(per_layer) / 32 == 206.5
    assert mean_retention(576, (2, 6, 15), [300, 200, 110], 32) == sum(per_layer) / (32 * 576)


def test_retention_walks_the_official_lists():
    assert path_targets(192, 576) == [300, 200, 110] and path_targets(64, 576) == [66, 30, 17]
    assert path_targets(160, 576) == [round(301.5), 155, 73] and path_targets(0, 576) == [0, 0, 0]
    assert path_targets(576, 100) == [100, 100, 100]
    # on LLaVA-1.5's shape retention 1/3 keeps a little less than the official 192 list (206.5 per layer, 0.358)
    targets, mean = retention_targets(1 / 3, 576, (2, 6, 15), 32)
    assert abs(mean - 1 / 3) < 0.5 / 576 and targets == [301, 179, 92]
    assert retention_targets(206.5 / 576, 576, (2, 6, 15), 32) == ([300, 200, 110], 206.5 / 576)
    # on a 28-layer model the same retention needs other counts, and gets its mean
    targets28, mean28 = retention_targets(1 / 3, 576, (2, 6, 15), 28)
    assert abs(mean28 - 1 / 3) < 0.5 / 576 and targets28 != targets
    # below the floor (layers 0..2 see everything): the least, above the target
    floor, least = retention_targets(0.05, 576, (2, 6, 15), 32)
    assert floor == [0, 0, 0] and least > 3 / 32


# --- known answers -------------------------------------------------------------------------------------------------


def test_raters_are_the_text_tokens_most_related_to_the_visual_tokens():
    e = torch.eye(4)
    visual = torch.stack([e[0] * 2, e[0] * 3, e[0] * 2 + e[1]])
    text = torch.stack([e[0] * 3, e[2], e[3], e[0] * 3, e[1]])  # 0 and 3 point where the visual tokens do
    assert select_raters(visual, text).tolist() == [True, False, False, True, False]
    # nothing above the mean (identical text tokens): all of them rate
    assert select_raters(visual, torch.ones(3, 4)).tolist() == [True, True, True]


def test_scores_come_from_the_raters_rows_only():
    heads, n = 2, 9
    attention = torch.zeros(heads, 3, n)  # rows: three text tokens; columns: the sequence (visual slots 2..6)
    attention[:, 0, [3, 5]] = 0.5  # a rater looks at slots 3 and 5
    attention[0, 2, 4] = 0.4  # the other rater, with one head, at slot 4
    attention[1, 2, 4] = 0.2
    attention[:, 1, [2, 6]] = 0.5  # a non-rater looks elsewhere: ignored
    visual = torch.arange(2, 7)
    scores = rater_scores(attention, torch.tensor([0, 2]), visual)
    torch.testing.assert_close(scores, torch.tensor([0.0, 0.25, 0.15, 0.25, 0.0]))
    plan = plan_stage(scores, torch.randn(5, 4), target=3)
    assert plan.kept.tolist() == [1, 2, 3]


def test_recycling_folds_each_group_of_the_best_dropped_tokens_into_its_mean():
    """50 visual tokens, 10 kept: 40 dropped, the 13 best of them recycled into 2 clusters. The 13 form two tight
    groups (7 around a, 6 around b), so the recycled tokens are the two group means, at a member's slot each."""
    g = torch.Generator().manual_seed(1)
    dim = 8
    a, b = torch.zeros(dim), torch.zeros(dim)
    a[0], b[1] = 10.0, 10.0
    hidden = torch.randn(50, dim, generator=g) * 3 + 40  # the rest: far from both groups
    scores = torch.rand(50, generator=g) * 0.1
    kept = torch.arange(0, 50, 5)
    scores[kept] = 1 + torch.rand(10, generator=g)
    group_a, group_b = torch.tensor([1, 4, 8, 13, 17, 22, 28]), torch.tensor([31, 33, 37, 41, 44, 49])
    scores[group_a] = 0.5 + torch.rand(7, generator=g) * 0.1
    scores[group_b] = 0.5 + torch.rand(6, generator=g) * 0.1
    hidden[group_a] = a + torch.randn(7, dim, generator=g) * 0.05
    hidden[group_b] = b + torch.randn(6, dim, generator=g) * 0.05
    plan = plan_stage(scores, hidden, target=10, generator=torch.Generator().manual_seed(0))
    assert plan.kept.tolist() == kept.tolist()
    assert plan.recycled.tolist() == sorted(group_a.tolist() + group_b.tolist())
    centers = plan.recycled[plan.centers]
    assert sorted(int(c in group_a) for c in centers) == [0, 1]  # one centre in each group
    merged = recycled_tokens(hidden[plan.recycled], plan.centers, plan.labels)
    for center, token in zip(centers.tolist(), merged):
        group = group_a if center in group_a.tolist() else group_b
        torch.testing.assert_close(token, hidden[group].mean(dim=0))
    dst, src = plan.merges()
    assert sorted(src.tolist() + centers.tolist()) == plan.recycled.tolist() and set(dst.tolist()) == set(
        centers.tolist()
    )
    assert plan.survivors().tolist() == sorted(kept.tolist() + centers.tolist())


# --- parameters -----------------------------------------------------------------------------------------------------


def test_defaults_are_the_official_setting():
    method = SparseVLM()
    assert method.layers == (2, 6, 15) and method.tokens is None and method.schedule is None
    assert vtc.registry()["sparsevlm"] is SparseVLM
    card = SparseVLM.card
    assert card.retention_reference == "layer_mean" and not card.fixed_count and card.acts_in_llm
    assert method.bind(None).targets(576, 32) == [300, 200, 110]  # RETAIN_TOKN=192
    assert method.bind(0.25).targets(576, 32) != [300, 200, 110]
    assert SparseVLM(tokens=64).bind(0.9).targets(576, 32) == [66, 30, 17]  # the official knob wins
    assert SparseVLM(schedule=(0.5, 0.25, 0.1)).bind(0.9).targets(100, 32) == [50, 25, 10]
    assert SparseVLM().bind(1.0).skip() and not SparseVLM(tokens=192).bind(1.0).skip()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"layers": (6, 2, 15)}, r"layers must be increasing LLM layer indices >= 0"),
        ({"layers": (2, 2, 15)}, r"layers must be increasing"),
        ({"layers": (-1, 2, 15)}, r"layers must be increasing"),
        ({"layers": ()}, r"layers must be increasing"),
        ({"layers": (2, 6)}, r"official budgets \(tokens=, retention\) have three stages.*give schedule="),
        ({"tokens": 100}, r"tokens must be one of 64, 96, 128, 192, got 100"),
        ({"schedule": (0.5, 0.2)}, r"schedule needs one fraction per layer of layers=\(2, 6, 15\)"),
        ({"schedule": (0.5, 0.2, 1.5)}, r"schedule fractions must be in \[0, 1\]"),
    ],
)
def test_bad_parameters_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparseVLM(**kwargs)


def test_a_model_with_too_few_layers_is_a_clear_error():
    model, _ = model_and_processor("qwen2_5_vl")  # 4 layers
    with vtc.patch(model, "sparsevlm"):
        with pytest.raises(
            ValueError,
            match=r"sparsevlm: layers=\(2, 6, 15\) prune the output of layer 15, so the language model needs at least "
            r"17 layers, but it has 4 \(0 to 3\); choose layers below 3 \(those of it that fit: \(2,\)\)",
        ):
            model(**single_inputs("qwen2_5_vl"))
    with vtc.patch(model, "sparsevlm", layers=(0, 1, 3), schedule=(0.5, 0.5, 0.5)):
        with pytest.raises(ValueError, match=r"needs at least 5 layers, but it has 4"):
            model(**single_inputs("qwen2_5_vl"))


def test_serving_refuses_sparsevlm_naming_the_methods_it_runs(capsys):
    from vtc.tools.cli import main
    from vtc.vllm.config import ServeConfig

    with pytest.raises(ValueError, match=r"sparsevlm acts inside the LLM \(prefill/KV\).*: aot, divprune.*vidcom2"):
        ServeConfig.from_dict({"methods": "sparsevlm", "retention": 0.25})
    assert main(["serve", "Qwen/Qwen2-VL-2B-Instruct", "--methods", "sparsevlm", "--retention", "0.25"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "sparsevlm acts inside the LLM" in out and "vidcom2" in out and "visionzip" in out


# --- on the tiny models ---------------------------------------------------------------------------------------------

LAYERS = (0, 1, 2)  # the tiny models have 4 layers


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
def test_retention_one_is_the_unpatched_model(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    with torch.no_grad():
        ref = model(**inputs).logits
    with vtc.patch(model, "sparsevlm", retention=1.0, layers=LAYERS) as handle:
        with torch.no_grad():
            assert torch.equal(model(**inputs).logits, ref)
        stats = handle.stats()
    assert stats.layer_visual_tokens == [stats.visual_tokens_in] * 4


@pytest.mark.parametrize(
    "params",
    [{"tokens": 192}, {"tokens": 128}, {"tokens": 96}, {"tokens": 64}, {"schedule": (0.6, 0.3, 0.05)}, {}],
    ids=["192", "128", "96", "64", "schedule", "retention"],
)
def test_each_layer_sees_the_promised_count(params):
    model, _ = model_and_processor("qwen2_5_vl")
    inputs = single_inputs("qwen2_5_vl")
    retention = None if params else 0.4
    with vtc.patch(model, "sparsevlm", retention=retention, layers=LAYERS, **params) as handle:
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
    n = stats.visual_tokens_in
    method = SparseVLM(layers=LAYERS, **params).bind(retention)
    targets = method.targets(n, 4)
    assert stats.layer_visual_tokens == layer_counts(n, LAYERS, stage_counts(n, targets), 4)
    assert stats.reports["sparsevlm"]["kept"] == [stats.visual_tokens_out] == [stage_counts(n, targets)[-1]]
    assert stats.reports["sparsevlm"]["targets"] == [targets]
    if "tokens" in params:
        assert targets == official_targets(params["tokens"], n)
    if not params:
        assert abs(stats.mean_layer_retention - 0.4) < 0.5 / n


def test_the_official_layers_on_a_deep_enough_model(monkeypatch):
    """layers 2 / 6 / 15 on a 17-layer model: the official schedule, scaled to the video, layer by layer."""
    monkeypatch.setitem(tiny.SIZES, "sparsevlm-17", tiny.TinySize(layers=17))
    model, processor = tiny.build("qwen2_vl", size="sparsevlm-17")
    inputs = vtc.prepare_inputs(processor, videos()[0], QUESTIONS[0], num_frames=8, fps=8)
    for tokens in (None, 64):  # None: the default, RETAIN_TOKN=192
        with vtc.patch(model, "sparsevlm", tokens=tokens) as handle:
            with torch.no_grad():
                model(**inputs)
            stats = handle.stats()
        n = stats.visual_tokens_in
        counts = stage_counts(n, official_targets(tokens or 192, n))
        assert stats.layer_visual_tokens == [n] * 3 + [counts[0]] * 4 + [counts[1]] * 9 + [counts[2]]


def test_several_videos_of_a_prompt_are_one_pool():
    from vtc.testing.fixtures import prompt_inputs

    model, processor = model_and_processor("qwen2_5_vl")
    inputs = prompt_inputs(processor, [videos()[0][:8], videos()[1][:8]])
    with vtc.patch(model, "sparsevlm", tokens=128, layers=LAYERS) as handle:
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
    n = stats.visual_tokens_in
    assert len(stats.grids) == 2 and n == sum(t * h * w for t, h, w in stats.grids)
    assert stats.layer_visual_tokens == layer_counts(n, LAYERS, stage_counts(n, official_targets(128, n)), 4)


def test_warns_below_the_floor_and_keeps_the_least():
    model, _ = model_and_processor("qwen2_5_vl")
    with vtc.patch(model, "sparsevlm", retention=0.2, layers=LAYERS) as handle:
        with pytest.warns(RuntimeWarning, match=r"sparsevlm: retention 0.2 is below what layers=\(0, 1, 2\) can reach"):
            with torch.no_grad():
                model(**single_inputs("qwen2_5_vl"))
        stats = handle.stats()
    n = stats.visual_tokens_in
    assert stats.layer_visual_tokens == layer_counts(n, LAYERS, stage_counts(n, [0, 0, 0]), 4)
    assert stats.mean_layer_retention > 0.25


# --- the patched model against a layer-by-layer reference ----------------------------------------------------------


def full_probs(query, key):
    """The official sparse layer's attention probabilities: causal softmax of q k^T / sqrt(d) in the model dtype
    (utils.py `scaled_dot_product_attention`), keys repeated for grouped-query attention."""
    k = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    return causal_probs(query @ k.transpose(-2, -1) * (1 / math.sqrt(query.shape[-1])))


def sparsevlm_reference(model, inputs, layers, tokens, new_tokens=None, decisions=None):
    """SparseVLM as the official code runs it (raters, `attn_postprocess_topk`, the recycling block, `cluster_and_merge`
    with the noise seeded 0 and the recycled tokens in index order), on the unpatched model layer by layer, with vtc's
    placement: a recycled token at its centre's slot, every token at its original position. `decisions` (from a first
    run) replays the prompt's choices when generated tokens are appended."""
    prompt_len = inputs["input_ids"].shape[1]
    ref, inputs, x, hidden, cos, sin, visual = start(model, inputs, new_tokens)
    visual = visual[:prompt_len]
    v_start = int(torch.nonzero(visual).min())
    v_num = int(visual.sum())
    assert bool(visual[v_start : v_start + v_num].all())  # one contiguous span, as upstream
    raters = official_raters(hidden[:, :prompt_len], v_start, v_num)
    slots = torch.arange(hidden.shape[1])  # original position of every current slot
    made = []
    with ref.capturing(), torch.no_grad():
        for i in range(len(ref.layers)):
            hidden = ref.mlp_block(i, ref.attention_block(i, hidden, cos, sin))
            if i not in layers:
                continue
            stage = layers.index(i)
            if decisions is None:
                query, key = CAPTURED[i]
                attn = full_probs(query[:, :, :prompt_len], key[:, :, :prompt_len])
                n_prompt = int((slots < prompt_len).sum())
                keep = official_targets(tokens, int(visual.sum()))[stage]
                torch.manual_seed(0)  # the density noise: vtc's generator, seeded 0 for every clustering
                out = official_stage(
                    hidden[:, :n_prompt], attn[:, :, :n_prompt, :n_prompt], v_start, v_num, raters, keep, True
                )
                span = slots[v_start : v_start + v_num]
                decision = (span[out["kept"]], span[out["centers"]], out["merged"])
            else:
                decision = decisions[stage]  # the prompt's hidden states are the same: causal attention
            made.append(decision)
            kept, centers, merged = decision
            new = hidden.clone()
            for c, center in enumerate(centers.tolist()):  # each recycled token at its centre's slot
                new[0, int(torch.nonzero(slots == center))] = merged[c]
            survivors = torch.cat([kept, centers])
            keep_slots = torch.isin(slots, survivors) | ~torch.isin(slots, slots[v_start : v_start + v_num])
            hidden, cos, sin, slots = new[:, keep_slots], cos[:, keep_slots], sin[:, keep_slots], slots[keep_slots]
            v_num = survivors.numel()
        return ref.logits(hidden), made, int(raters[1].numel())


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])  # M-RoPE; SigLIP without CLS
def test_matches_the_reference_layer_by_layer(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    ref_logits, decisions, raters = sparsevlm_reference(model, inputs, LAYERS, 128)
    with vtc.patch(model, "sparsevlm", tokens=128, layers=LAYERS) as handle:
        with torch.no_grad():
            out = model(**inputs).logits
        stats = handle.stats()
        gen = model.generate(
            **inputs, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    visual = int(compressible_video_mask(model, inputs["input_ids"]).sum())
    assert stats.visual_tokens_in == visual and stats.reports["sparsevlm"]["raters"] == [raters]
    assert stats.visual_tokens_out == decisions[-1][0].numel() + decisions[-1][1].numel()
    torch.testing.assert_close(out[:, -1], ref_logits[:, -1], atol=2e-5, rtol=1e-4)
    # decode: the prompt stays as prefill left it in every layer's cache, the new tokens at their original positions
    new = gen.sequences[:, inputs["input_ids"].shape[1] :]
    for step in (1, 2):
        step_logits, _, _ = sparsevlm_reference(
            model, inputs, LAYERS, 128, new_tokens=new[:, :step], decisions=decisions
        )
        torch.testing.assert_close(gen.logits[step], step_logits[:, -1], atol=2e-5, rtol=1e-4)
