"""PyramidDrop: the official ranking (`pdrop_rank_drop`, transcribed) against vtc's on 200 random rows, the official
stage counts on every N up to 5000, the retention -> lambda mapping (mean over layers), the runtime's
`attention_at_start` against the rows the layer itself computes, the patched model against an independent
layer-by-layer run of the official algorithm on all six families (prefill and decode steps) and on a 28-layer model
with the official defaults, identity at lambda = 1 / retention 1.0, the per-stage counts, and the errors."""

from __future__ import annotations

import dataclasses
import math
import random
import warnings

import pytest
import torch
from torch import nn

import vtc
from tests.conftest import FAMILIES, batch_inputs, model_and_processor, single_inputs
from tests.reference import CAPTURED, last_rows_attention, start
from vtc.media.video import synthetic_video
from vtc.testing import tiny
from vtc.testing.tiny import SIZES, TinySize
from vtc_kernels.attention import attention_rows
from vtc_plugins.pyramiddrop import (
    LAYER_LIST,
    RATIO,
    PyramidDrop,
    layer_mean,
    parse_layers,
    rank_and_drop,
    ratio_for_retention,
    stage_counts,
    stage_ratios,
)

TEST_LAYERS = (1, 2, 3)  # the tiny models have 4 layers


# --- the official code, transcribed --------------------------------------------------------------------------------
def official_rank_drop(
    query_states, key_states, attention_mask, image_token_posi, prompt_len, image_tokens_in, ratio_list, cur_num
):
    """Cooperx521/PyramidDrop@6444f304 `llava/model/modeling_llama_pdrop.py::pdrop_rank_drop`, inference branch
    (`self.training` False), right padding, transcribed from the attention mask on: query/key states [B, H, S, d]
    after RoPE, `attention_mask` [B, S] (1 = token), `image_token_posi` / `prompt_len` / `image_tokens_in` as
    `prepare_inputs_labels_for_multimodal_pdrop` records them (first image slot, text tokens, image tokens entering
    the LLM), `ratio_list` with the leading 1.0 `model_vqa_loader.py` inserts. Returns the kept slots of each row
    (into the row's unpadded tokens), in order."""
    batch_size, num_heads, q_len, head_dim = query_states.shape
    image_tokens = [int(cur_image_token * ratio_list[cur_num]) for cur_image_token in image_tokens_in]
    keep_length = [int(cur_image_token * ratio_list[cur_num + 1]) for cur_image_token in image_tokens_in]
    # _prepare_4d_causal_attention_mask(attention_mask, (batch_size, q_len), hidden_states, 0) of transformers 4.37
    min_value = torch.finfo(query_states.dtype).min
    causal = torch.full((q_len, q_len), min_value, dtype=query_states.dtype).triu(1)
    eager_attention_mask = causal[None, None].repeat(batch_size, 1, 1, 1)
    eager_attention_mask = eager_attention_mask.masked_fill(~attention_mask.bool()[:, None, None, :], min_value)
    kept = []
    for i in range(batch_size):
        image_index = image_token_posi[i]
        cur_key_states = key_states[i]
        cur_query_states = query_states[i]
        cur_eager_attention_mask = eager_attention_mask[i]
        prompt_total_len = prompt_len[i] + image_tokens[i]
        text_query_states = cur_query_states[:, prompt_total_len - 1, :].unsqueeze(1)
        text_eager_attention_mask = cur_eager_attention_mask[:, prompt_total_len - 1, :].unsqueeze(1)
        attn_weights = torch.matmul(text_query_states, cur_key_states.transpose(1, 2)) / math.sqrt(head_dim)
        attn_weights = attn_weights + text_eager_attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attention_avg_head = torch.mean(attn_weights, dim=0)  # ave across heads
        attention_avg_head = attention_avg_head[:, image_index : image_index + image_tokens[i]]
        attention_avg_text = torch.mean(attention_avg_head, dim=0)
        top_rank_index = attention_avg_text.topk(keep_length[i]).indices
        top_rank_index = top_rank_index + image_index
        top_rank_index = top_rank_index.sort().values
        start_index = image_index + image_tokens[i]
        row_len = int(attention_mask[i].sum())
        kept.append(torch.cat([torch.arange(image_index), top_rank_index, torch.arange(start_index, row_len)]))
    return kept


def vtc_rank_drop(query, key, valid, visual, budgets):
    """The same step as vtc's runtime and plugin take it: `attention_rows` (the runtime's kernel op) of the last real
    slot, causal and padding masked, heads averaged, then `rank_and_drop`."""
    bsz, _, n, dim = query.shape
    slot = torch.arange(n)[None].expand(bsz, -1)
    rows = torch.where(valid, slot, -1).max(dim=1).values[:, None]
    visible = (torch.arange(n)[None, None, :] <= rows[:, :, None]) & valid[:, None, :]
    probs = attention_rows(query, key, rows, visible, dim**-0.5, True)
    return rank_and_drop(probs.mean(dim=1)[:, -1], visual, valid, budgets)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_ranking_matches_official_pdrop_rank_drop_on_200_random_rows(kv_heads):
    """200 rows (40 batches of 5, right-padded), random N, stage, text around the image; with grouped-query keys
    (kv_heads=2) the official product is given the keys repeated per query head, what it evidently means."""
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    ratio_list = [1.0] + stage_ratios(RATIO, 3)
    heads, dim = 4, 16
    for _ in range(40):
        rows = []
        for _ in range(5):
            n_in = rng.randint(2, 60)
            cur = rng.randrange(3)
            rows.append((rng.randint(0, 6), int(n_in * ratio_list[cur]), rng.randint(1, 6), n_in, cur))
        cur = rows[0][4]  # one stage per batch, as in the official forward
        rows = [(a, int(n_in * ratio_list[cur]), b, n_in, cur) for a, _, b, n_in, _ in rows]
        lengths = [a + m + b for a, m, b, _, _ in rows]
        seq = max(lengths)
        query = torch.randn(5, heads, seq, dim, generator=gen)
        key = torch.randn(5, kv_heads, seq, dim, generator=gen)
        valid = torch.arange(seq)[None] < torch.tensor(lengths)[:, None]
        visual = torch.zeros(5, seq, dtype=torch.bool)
        for r, (a, m, _, _, _) in enumerate(rows):
            visual[r, a : a + m] = True
        expected = official_rank_drop(
            query,
            key.repeat_interleave(heads // kv_heads, dim=1),
            valid.long(),
            [a for a, _, _, _, _ in rows],
            [a + b for a, _, b, _, _ in rows],
            [n_in for _, _, _, n_in, _ in rows],
            ratio_list,
            cur,
        )
        budgets = [int(n_in * ratio_list[cur + 1]) for _, _, _, n_in, _ in rows]
        keep = vtc_rank_drop(query, key, valid, visual, budgets)
        for r in range(5):
            assert torch.nonzero(keep[r]).flatten().tolist() == expected[r].tolist()


def test_stage_counts_are_the_official_int_of_the_literal_ratio_list():
    official = [1.0, 0.5, 0.25, 0.125]  # model_vqa_loader.py: eval("[0.5,0.25,0.125]") with 1.0 inserted first
    assert stage_ratios(RATIO, 3) == official[1:]
    for n in range(5001):
        assert stage_counts(n, stage_ratios(RATIO, 3)) == [int(n * r) for r in official[1:]]
    assert stage_counts(576, stage_ratios(0.5, 3)) == [288, 144, 72]  # LLaVA-1.5's 576 image tokens
    assert stage_counts(5, stage_ratios(0.5, 3)) == [2, 1, 0]  # int() floors


def test_defaults_and_retention_mapping():
    p = PyramidDrop()
    assert (p.layer_list, p.ratio) == ((8, 16, 24), None) and LAYER_LIST == (8, 16, 24) and RATIO == 0.5
    card = PyramidDrop.card
    assert card.retention_reference == "layer_mean" and not card.fixed_count and card.acts_in_llm
    assert vtc.registry()["pyramiddrop"] is PyramidDrop
    assert p.bind(None).lam(32) == 0.5  # no retention: the official lambda
    assert PyramidDrop(ratio=0.3).bind(0.9).lam(32) == 0.3  # an explicit lambda wins over the retention
    # the official setting averages (8 + 8/2 + 8/4 + 8/8) / 32 = 15/32 of the tokens over LLaVA-1.5's 32 layers ...
    assert layer_mean(0.5, LAYER_LIST, 32) == 15 / 32
    assert p.bind(15 / 32).lam(32) == 0.5
    # ... and 14.5 / 28 over a 28-layer Qwen2-7B
    assert layer_mean(0.5, LAYER_LIST, 28) == 14.5 / 28 and p.bind(14.5 / 28).lam(28) == 0.5
    for retention in (0.3, 0.4, 0.5, 0.75, 0.99):
        lam = ratio_for_retention(retention, LAYER_LIST, 28)
        assert 0 < lam < 1 and layer_mean(lam, LAYER_LIST, 28) == pytest.approx(retention, abs=1e-9)
    assert ratio_for_retention(1.0, LAYER_LIST, 28) == 1.0
    assert ratio_for_retention(8 / 28, LAYER_LIST, 28) == 0.0  # the floor: layers 0..7 see everything
    with pytest.warns(RuntimeWarning, match=r"retention 0.2 is below what layer_list \(8, 16, 24\) reaches"):
        assert p.bind(0.2).lam(28) == 0.0
    assert vars(p.bind(0.3)) == {"layer_list": (8, 16, 24), "ratio": None, "retention": 0.3}


def test_layer_list_from_text_and_bad_parameters():
    assert PyramidDrop(layer_list="8,16,24").layer_list == (8, 16, 24)
    assert PyramidDrop(layer_list="2|8|16|24").layer_list == (2, 8, 16, 24)  # lmms-eval model args split on commas
    assert PyramidDrop(layer_list="[4, 12]").layer_list == (4, 12) == parse_layers("4 12")
    assert PyramidDrop(layer_list=[3, 6]).layer_list == (3, 6)
    for bad in ((), (0, 8), (8, 8), (16, 8), (8.0, 16), (True, 2)):
        with pytest.raises(ValueError, match="pyramiddrop: layer_list must be strictly increasing layer indices >= 1"):
            PyramidDrop(layer_list=bad)
    with pytest.raises(ValueError, match="pyramiddrop: layer_list must list layer indices"):
        PyramidDrop(layer_list="eight,16")
    for bad in (0, 1.5, -0.5):
        with pytest.raises(ValueError, match=r"pyramiddrop: ratio must be in \(0, 1\]"):
            PyramidDrop(ratio=bad)


def test_rank_and_drop_keeps_the_most_attended_visual_tokens_per_row():
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.05, 0.3, 0.2, 0.7], [0.0, 0.4, 0.1, 0.3, 0.2, 0.9, 0.0]])
    visual = torch.tensor([[False, True, True, True, True, True, False], [False, True, True, True, True, True, True]])
    valid = torch.tensor([[True] * 7, [False, True, True, True, True, True, True]])
    keep = rank_and_drop(scores, visual, valid, [2, 3])
    # row 0: the two best visual tokens (0.5, 0.3), text kept; row 1: padding never kept, the best three (0.9, 0.4, 0.3)
    assert keep.tolist() == [
        [True, False, True, False, True, False, True],
        [False, True, False, True, False, True, False],
    ]


def test_serving_refuses_pyramiddrop_naming_the_methods_that_serve():
    from vtc.vllm.config import ServeConfig

    with pytest.raises(ValueError, match="pyramiddrop acts inside the LLM.*vidcom2"):
        ServeConfig.from_dict({"methods": "pyramiddrop", "retention": 0.25})


# --- the runtime: attention rows before the layer runs ---------------------------------------------------------------
@vtc.method("attention-at-start-probe", paper="test probe")
class StartProbe(vtc.Method):
    """At layers 1 and 2: this layer's rows from `attention_at_start` and those the layer computes itself
    (`request_attention`); before layer 2, every other visual token is dropped, so its rows are on a shorter
    sequence with gathered RoPE rows."""

    seen: dict = dataclasses.field(default_factory=dict)

    def prefill(self, llm, ctx):
        if llm.point == "layer_start" and llm.layer == 2:
            visual = llm.layout.visual & llm.layout.valid
            order = torch.cumsum(visual.long(), dim=1)
            llm.keep(llm.layout.valid & ~(visual & (order % 2 == 0)))
        if llm.point == "layer_start" and llm.layer in (1, 2):
            self.seen[("start", llm.layer)] = llm.attention_at_start(num_rows=3, upcast=True)
            llm.request_attention(num_rows=3, upcast=True)
        elif llm.point == "after_attention" and llm.layer in (1, 2):
            self.seen[("layer", llm.layer)] = llm.attention(llm.layer)


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_at_start_equals_the_rows_the_layer_computes(family):
    model, _ = model_and_processor(family)
    cases = [single_inputs(family)]
    if family in ("qwen2_5_vl", "llava_onevision"):  # a left-padded batch, on M-RoPE and on 1-D RoPE
        cases.append(batch_inputs(family))
    for inputs in cases:
        probe = StartProbe()
        with vtc.patch(model, probe) as handle:
            with torch.no_grad():
                model(**inputs)
            counts = handle.stats().layer_visual_tokens
        assert counts[2] < counts[1]  # layer 2's rows are on the shortened sequence
        for layer in (1, 2):
            early, own = probe.seen[("start", layer)], probe.seen[("layer", layer)]
            assert early.shape == own.shape and early.shape[2] == 3
            torch.testing.assert_close(early, own, atol=1e-6, rtol=1e-5)
    with vtc.patch(model, MisplacedProbe()), pytest.raises(RuntimeError, match="attention_at_start is available at"):
        with torch.no_grad():
            model(**single_inputs(family))


@vtc.method("attention-at-start-misplaced", paper="test probe")
class MisplacedProbe(vtc.Method):
    """Asks for `attention_at_start` after a layer's attention, where the layer has already run."""

    def prefill(self, llm, ctx):
        if llm.point == "after_attention":
            llm.attention_at_start()


# --- the whole model against the official algorithm, layer by layer ------------------------------------------------
def pdrop_reference(model, inputs, layer_list, ratio, new_tokens=None, stage_keeps=None):
    """The official algorithm on an unpatched model, batch 1, vtc's position rule (survivors keep their RoPE rows):
    before stage layer l_s, run layer l_s's attention on the stream entering it (its own q/k after RoPE, captured),
    rank the alive visual tokens by the last prompt token's head-averaged attention (float32 softmax), keep the top
    int(N * lambda^s) (`official_rank_drop`'s rule), then run the layer on the survivors. `stage_keeps`: the prompt
    slots each stage kept at prefill (decode steps append `new_tokens`, never pruned)."""
    prompt_len = inputs["input_ids"].shape[1]
    ref, inputs, x, hidden, cos, sin, visual = start(model, inputs, new_tokens)
    total = hidden.shape[1]
    n_visual = int(visual[:prompt_len].sum())
    ratio_list = [1.0] + stage_ratios(ratio, len(layer_list))
    ds_mask, ds_embeds = x.get("visual_pos_masks"), x.get("deepstack_visual_embeds")
    alive = torch.arange(total)
    kept_by_stage = []
    with ref.capturing(), torch.no_grad():
        for i in range(len(ref.layers)):
            if i in layer_list:
                stage = layer_list.index(i)
                if stage_keeps is None:
                    ref.attention_block(i, hidden, cos[:, alive], sin[:, alive])  # only to capture its q, k
                    query, key = CAPTURED[i]
                    vis_now = visual[alive]
                    image = torch.nonzero(vis_now).flatten()
                    assert image.numel() == int(n_visual * ratio_list[stage])
                    attn = last_rows_attention(query, key, 1, upcast=True)[0]  # [H, 1, S]
                    score = attn.mean(dim=0)[:, image].mean(dim=0)
                    top = image[score.topk(int(n_visual * ratio_list[stage + 1])).indices]
                    local = torch.sort(torch.cat([torch.nonzero(~vis_now).flatten(), top])).values
                    kept_by_stage.append(alive[local])
                else:
                    wanted = torch.cat([stage_keeps[stage], torch.arange(prompt_len, total)])
                    local = torch.searchsorted(alive, wanted)
                alive, hidden = alive[local], hidden[:, local]
            hidden = ref.attention_block(i, hidden, cos[:, alive], sin[:, alive])
            hidden = ref.mlp_block(i, hidden)
            if ds_embeds is not None and i < len(ds_embeds):  # Qwen3-VL DeepStack: the survivors' own rows
                mask = ds_mask[0]
                row = torch.cumsum(mask.long(), 0) - 1
                sel = mask[alive]
                hidden = hidden.clone()
                hidden[0, sel] = hidden[0, sel] + ds_embeds[i][row[alive][sel]].to(hidden.dtype)
        return ref.logits(hidden), kept_by_stage


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_reference_prefill_and_decode(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    ref_logits, keeps = pdrop_reference(model, inputs, TEST_LAYERS, 0.5)
    with vtc.patch(model, "pyramiddrop", layer_list=TEST_LAYERS, ratio=0.5) as handle:
        with torch.no_grad():
            out = model(**inputs).logits
        stats = handle.stats()
        n = stats.visual_tokens_in
        # layer 0 sees every visual token, each stage int(N / 2^s) of them
        assert stats.layer_visual_tokens == [n, n // 2, n // 4, n // 8]
        assert stats.reports["pyramiddrop"] == {"ratio": [0.5], "kept": [n // 8]}
        assert stats.retention_at("layer_mean") == pytest.approx((n + n // 2 + n // 4 + n // 8) / (4 * n))
        text = inputs["input_ids"].shape[1] - n
        assert [k.numel() - text for k in keeps] == [n // 2, n // 4, n // 8]
        gen = model.generate(
            **inputs, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    torch.testing.assert_close(out[:, -1], ref_logits[:, -1], atol=2e-5, rtol=1e-4)
    # decode steps: the prompt stays as the stages left it, the new tokens attend at every layer
    new = gen.sequences[:, inputs["input_ids"].shape[1] :]
    for step in (1, 2):
        step_logits, _ = pdrop_reference(model, inputs, TEST_LAYERS, 0.5, new[:, :step], keeps)
        torch.testing.assert_close(gen.logits[step], step_logits[:, -1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_identity_at_lambda_one_and_full_retention(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    with torch.no_grad():
        ref = model(**inputs).logits
    for params in ({"ratio": 1.0}, {"retention": 1.0}):
        with vtc.patch(model, "pyramiddrop", layer_list=TEST_LAYERS, **params) as handle:
            with torch.no_grad():
                assert torch.equal(model(**inputs).logits, ref)
            stats = handle.stats()
            assert stats.layer_visual_tokens == [stats.visual_tokens_in] * 4
            assert stats.reports["pyramiddrop"]["ratio"] == [1.0]


def test_retention_is_the_mean_over_layers_with_a_warned_floor():
    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    for retention in (0.5, 0.3):
        with vtc.patch(model, "pyramiddrop", layer_list=TEST_LAYERS, retention=retention) as handle:
            with torch.no_grad():
                model(**inputs)
            stats = handle.stats()
        n, lam = stats.visual_tokens_in, ratio_for_retention(retention, TEST_LAYERS, 4)
        assert stats.reports["pyramiddrop"]["ratio"] == [lam]
        assert stats.layer_visual_tokens == [n] + stage_counts(n, stage_ratios(lam, 3))
        # int() floors at most one token per stage below the exact mean
        assert retention - 3 / (4 * n) <= stats.mean_layer_retention <= retention
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with vtc.patch(model, "pyramiddrop", layer_list=TEST_LAYERS, retention=0.2) as handle:
            with torch.no_grad():
                model(**inputs)
            stats = handle.stats()
    assert any(issubclass(w.category, RuntimeWarning) and "below what layer_list" in str(w.message) for w in caught)
    assert stats.mean_layer_retention == 0.25 and stats.visual_tokens_out == 0  # the floor: only layer 0 sees them


def test_a_stage_beyond_the_model_is_a_clear_error():
    model, _ = model_and_processor("qwen2_vl")
    with vtc.patch(model, "pyramiddrop"):  # the official (8, 16, 24) on a 4-layer model
        with pytest.raises(
            ValueError,
            match=r"pyramiddrop: layer_list \(8, 16, 24\) needs a language model with more than 24 layers, "
            r"this one has 4 \(0 to 3\)",
        ):
            model(**single_inputs("qwen2_vl"))
    with vtc.patch(model, "pyramiddrop", layer_list=(2, 4)):
        with pytest.raises(ValueError, match=r"more than 4 layers, this one has 4"):
            model(**single_inputs("qwen2_vl"))


@pytest.fixture(scope="module")
def deep28(request):
    """A tiny Qwen2-VL with a Qwen2-7B-deep (28-layer) LLM, for the official (8, 16, 24) stages."""
    SIZES["deep28"] = TinySize(layers=28)
    request.addfinalizer(lambda: SIZES.pop("deep28", None))
    model, processor = tiny.build("qwen2_vl", size="deep28")
    inputs = vtc.prepare_inputs(processor, synthetic_video(16, 224, 224), "What happens?", num_frames=8, fps=8)
    return model, inputs


def test_official_defaults_on_a_28_layer_model(deep28):
    model, inputs = deep28
    ref_logits, _ = pdrop_reference(model, inputs, LAYER_LIST, RATIO)
    with vtc.patch(model, "pyramiddrop") as handle:  # layer_list (8, 16, 24), lambda 0.5
        with torch.no_grad():
            out = model(**inputs).logits
        stats = handle.stats()
    n = stats.visual_tokens_in
    assert stats.layer_visual_tokens == [n] * 8 + [n // 2] * 8 + [n // 4] * 8 + [n // 8] * 4
    torch.testing.assert_close(out[:, -1], ref_logits[:, -1], atol=2e-5, rtol=1e-4)
    with vtc.patch(model, "pyramiddrop", retention=14.5 / 28) as handle:  # the same schedule, asked by its mean
        with torch.no_grad():
            assert torch.equal(model(**inputs).logits, out)
        assert handle.stats().reports["pyramiddrop"]["ratio"] == [0.5]
