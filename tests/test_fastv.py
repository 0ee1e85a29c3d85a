"""FastV: the pure selection rule on hand-built scores, and the whole patched model against an independent
layer-by-layer reference of the official algorithm (prefill and decode steps)."""

from __future__ import annotations

import pytest
import torch

import vtc
from tests.conftest import FAMILIES, model_and_processor, single_inputs
from tests.reference import CAPTURED, compressible_video_mask, last_rows_attention, start
from vtc_plugins.fastv import FastV, fastv_keep, kept_count


def test_keeps_the_top_attended_visual_tokens():
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.05, 0.3, 0.2, 0.7]])
    visual = torch.tensor([[False, True, True, True, True, True, False]])
    valid = torch.ones_like(visual)
    keep = fastv_keep(scores, visual, valid, ratio=0.6)  # 5 visual tokens -> keep round(5 * 0.4) = 2
    assert keep.tolist() == [[True, False, True, False, True, False, True]]


def test_padding_is_never_kept_and_rows_are_independent():
    scores = torch.tensor([[0.0, 0.2, 0.9, 0.1, 0.5], [0.3, 0.8, 0.1, 0.6, 0.2]])
    visual = torch.tensor([[False, True, True, True, False], [True, True, True, True, False]])
    valid = torch.tensor([[False, True, True, True, True], [True, True, True, True, True]])
    keep = fastv_keep(scores, visual, valid, ratio=0.5)
    # row 0: round(3 * 0.5) = 2 of its 3 visual tokens (Python rounds half to even), the padding slot never
    assert keep.tolist() == [[False, True, True, False, True], [False, True, False, True, True]]


def test_defaults_and_retention_mapping():
    assert FastV().k == 2 and vtc.registry()["fastv"] is FastV
    assert FastV().bind(None).dropped() == 0.5  # paper: R = 50%
    assert FastV().bind(0.3).dropped() == pytest.approx(0.7)
    assert FastV(ratio=0.25).bind(0.3).dropped() == 0.25  # explicit wins
    assert kept_count(576, 0.75) == 144
    # a fixed count, at the last layer: round(N (1 - R)) whatever the family and grid
    card = FastV.card
    assert card.fixed_count and card.fixed_count_mode == "always" and card.retention_reference == "last_layer"
    plugin = FastV().bind(0.3)
    assert plugin.retained_count(576, (4, 12, 12), "qwen2_vl") == 173
    assert plugin.retained_count(1568, (8, 14, 14), "llava_onevision") == round(1568 * 0.3) == 470
    assert vars(plugin) == {"k": 2, "ratio": None, "retention": 0.3}  # parameters and the bound share only


def fastv_reference(model, inputs, k: int, ratio: float, new_tokens=None, keep=None):
    """Official FastV, batch 1: layers < k on everything; at layer k keep the top round(N (1 - R)) visual
    tokens by the head-mean attention of the last prompt token at layer k - 1 (eager softmax)."""
    prompt_len = inputs["input_ids"].shape[1]
    ref, inputs, x, hidden, cos, sin, visual = start(model, inputs, new_tokens)
    with ref.capturing(), torch.no_grad():
        for i in range(len(ref.layers)):
            if i == k:
                if keep is None:
                    query, key = CAPTURED[k - 1]
                    probs = last_rows_attention(query[:, :, :prompt_len], key[:, :, :prompt_len], 1, upcast=True)
                    scores = probs.mean(dim=1)[0, -1]
                    vis = torch.nonzero(visual[:prompt_len]).flatten()
                    top = vis[torch.topk(scores[vis], round(vis.numel() * (1 - ratio))).indices]
                    rest = torch.nonzero(~visual[:prompt_len]).flatten()
                    keep = torch.sort(torch.cat([rest, top])).values
                full_keep = torch.cat([keep, torch.arange(prompt_len, hidden.shape[1])])
                hidden, cos, sin = hidden[:, full_keep], cos[:, full_keep], sin[:, full_keep]
            hidden = ref.attention_block(i, hidden, cos, sin)
            hidden = ref.mlp_block(i, hidden)
            hidden = ref.deepstack(i, hidden, x.get("visual_pos_masks", [None])[0], x.get("deepstack_visual_embeds"))
        return ref.logits(hidden), keep


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_reference_prefill_and_decode(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    ref_logits, keep = fastv_reference(model, inputs, k=2, ratio=0.7)
    with vtc.patch(model, "fastv", retention=0.3) as handle:
        with torch.no_grad():
            out = model(**inputs).logits
        stats = handle.stats()
        assert stats.visual_tokens_out == keep.numel() - int(
            (~compressible_video_mask(model, inputs["input_ids"])).sum()
        )
        # the promised last-layer count; layers < k see every visual token
        (grid,) = stats.grids
        assert stats.visual_tokens_out == handle.retained_count(grid) == round(stats.visual_tokens_in * 0.3)
        assert stats.layer_visual_tokens == [stats.visual_tokens_in] * 2 + [stats.visual_tokens_out] * 2
        assert stats.retention_at("last_layer") == stats.retention
        assert stats.reports == {}  # FastV reports nothing
        gen = model.generate(
            **inputs, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    torch.testing.assert_close(out[:, -1], ref_logits[:, -1], atol=2e-5, rtol=1e-4)
    # decode steps: the prompt stays pruned as decided at prefill, new tokens attend at every layer
    new = gen.sequences[:, inputs["input_ids"].shape[1] :]
    for step in (1, 2):
        step_logits, _ = fastv_reference(model, inputs, k=2, ratio=0.7, new_tokens=new[:, :step], keep=keep)
        torch.testing.assert_close(gen.logits[step], step_logits[:, -1], atol=2e-5, rtol=1e-4)


def test_k_beyond_the_model_is_a_clear_error():
    model, _ = model_and_processor("qwen2_vl")
    with vtc.patch(model, "fastv", k=10):
        with pytest.raises(ValueError, match=r"fastv: prune layer 10 but the language model has only 4 layers"):
            model(**single_inputs("qwen2_vl"))
