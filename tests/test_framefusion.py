"""FrameFusion: the cost schedule (the spec's worked example), the merge rule on hand-built inputs, the patched
model against an independent re-derivation of the official algorithm in its own structure (thu-nics/FrameFusion
`main.py`: patch types, similarity by patch, runs merged with index_add_, one prune) with the official 28-layer
schedule and with the model's own depth, what it reports, and `retention` = the mean fraction of visual tokens
over the layers of a model deeper than its merge steps."""

from __future__ import annotations

import pytest
import torch

import vtc
from tests.conftest import model_and_processor, single_inputs
from tests.reference import CAPTURED, last_rows_attention, start
from vtc.media.video import synthetic_video
from vtc.testing import tiny
from vtc.testing.tiny import SIZES, TinySize
from vtc_plugins.framefusion import (
    DEFAULT_ATTENTION_ROWS,
    DEFAULT_SIMILARITY,
    FrameFusion,
    FusionPrune,
    merge_plan,
    pruning_ratio,
    rope_kind,
)


def test_cost_schedule_worked_example():
    """methods-a.md §3.1: c = 0.3, L = 28, merge ratios 0.5, 0.2, 0.05 then prune."""
    assert pruning_ratio([], 0.3) == pytest.approx(0.7)
    assert pruning_ratio([0.5], 0.3) == pytest.approx(1 - (8.4 - 0.5) / (27 * 0.5))  # 0.415
    assert pruning_ratio([0.5], 0.3) == pytest.approx(0.4148, abs=1e-4)
    assert pruning_ratio([0.5, 0.2], 0.3) == pytest.approx(0.279, abs=1e-3)
    rho = pruning_ratio([0.5, 0.2, 0.05], 0.3)
    assert rho == pytest.approx(1 - (8.4 - 1.28) / (25 * 0.38))  # 0.25
    assert 0.38 * (1 - rho) == pytest.approx(0.285, abs=1e-3)  # 28.5% of the tokens for the remaining layers
    # the schedule keeps the mean over the 28 layers at the cost
    kept = [1.0, 0.5, 0.4, 0.38] + [0.38 * (1 - rho)] * 24
    assert sum(kept[1:] + [kept[-1]]) / 28 == pytest.approx(0.3, abs=1e-6)
    assert pruning_ratio([0.9, 0.9], 1.0) == 0.0  # budget never binding -> no pruning
    with pytest.raises(ValueError, match="The cost is too small"):
        pruning_ratio([0.0] * 10, 0.3)
    # L is a parameter: on a 4-layer model the same budget leaves less room
    assert pruning_ratio([], 0.3, num_layers=4) == pytest.approx(0.7)
    assert pruning_ratio([0.5], 0.5, num_layers=4) == pytest.approx(1 - (2.0 - 0.5) / (3 * 0.5))  # 0.0
    assert pruning_ratio([0.5], 0.3, num_layers=4) == pytest.approx(1 - (1.2 - 0.5) / (3 * 0.5))
    kept = [0.5] + [0.5 * (1 - pruning_ratio([0.5], 0.3, num_layers=4))] * 3
    assert sum(kept) / 4 == pytest.approx(0.3)
    with pytest.raises(ValueError, match="The cost is too small"):
        pruning_ratio([0.2, 0.2], 0.3, num_layers=4)  # 0.8 + 0.64 > 4 * 0.3


def test_defaults_follow_the_official_code():
    p = FrameFusion()
    # num_layers None = the model's depth (the official code hard-codes 28; num_layers=28 reproduces it)
    assert (p.cost, p.ratio_lower_bound, p.num_layers, p.attention_rows) == (None, 0.1, None, None)
    assert DEFAULT_SIMILARITY == {"mrope": 0.5, "rope": 0.6}
    assert vtc.registry()["framefusion"]().bind(None).budget() == 0.3
    assert vtc.registry()["framefusion"]().bind(0.4).budget() == 0.4  # retention = cost
    assert FrameFusion(cost=0.2).bind(0.4).budget() == 0.2  # an explicit cost wins
    # the official interface code: the last 4 prompt rows on Qwen-VL, 1 on LLaVA (moved here from the adapters)
    assert DEFAULT_ATTENTION_ROWS == {"mrope": 4, "rope": 1}
    kinds = {f: rope_kind(f) for f in vtc.registry()["framefusion"].card.families}
    assert {f: k for f, k in kinds.items() if f in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")} == dict.fromkeys(
        ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"), "mrope"
    )
    assert kinds["llava_onevision"] == kinds["llava_next_video"] == kinds["internvl"] == "rope"
    assert (FrameFusion().threshold("qwen3_vl"), FrameFusion().num_rows("internvl")) == (0.5, 1)
    model, _ = model_and_processor("qwen2_vl")
    assert not hasattr(vtc.api.resolve_adapter(model), "attention_rows")
    cls = vtc.registry()["framefusion"]
    assert cls.card.retention_reference == "layer_mean" and not cls.card.fixed_count
    assert cls.card.stages == ("prefill",) and cls.owns == frozenset({"llm_token_schedule"}) and cls.query_aware
    assert cls.testing.params == {"num_layers": 28}
    with pytest.raises(ValueError, match=r"framefusion: num_layers must be in \[1, inf\)"):
        FrameFusion(num_layers=0)
    # the prune step is FastV's pruner, at the point after the attention of the layer where merging stopped
    assert issubclass(FusionPrune, vtc.LayerPruner) and FusionPrune.keep_point == "after_attention"
    assert not FusionPrune.upcast and FusionPrune not in vtc.registry().classes()  # a part, not a method


def test_identical_frames_merge_and_runs_fold_into_the_earliest_frame():
    torch.manual_seed(0)
    frame = torch.randn(4, 16)
    other = torch.randn(4, 16)
    # frames: A A A B  (patch chains of length 4); slot 0 is a text token
    hidden = torch.cat([torch.randn(1, 16), frame, frame, frame, other])
    slots = torch.arange(1, 17)
    key = torch.cat([torch.tensor([-1]), torch.arange(4).repeat(4)])
    dst, src, ratio, budget_hit = merge_plan(hidden, slots, key, threshold=0.9, max_ratio=0.9)
    assert not budget_hit
    assert ratio == pytest.approx(8 / 16)  # frames 2 and 3 of every chain
    # each chain's run (frames 1, 2) folds into frame 0 of the chain
    pairs = sorted(zip(src.tolist(), dst.tolist()))
    assert pairs == sorted([(1 + 4 + p, 1 + p) for p in range(4)] + [(1 + 8 + p, 1 + p) for p in range(4)])


def test_budget_branch_merges_exactly_the_budget():
    torch.manual_seed(1)
    frame = torch.randn(4, 16)
    hidden = torch.cat([frame, frame, frame + 0.01 * torch.randn(4, 16)])
    slots = torch.arange(12)
    key = torch.arange(4).repeat(3)
    dst, src, ratio, budget_hit = merge_plan(hidden, slots, key, threshold=0.5, max_ratio=0.5)
    assert budget_hit and ratio == pytest.approx(8 / 12)
    assert src.numel() == int(0.5 * 12)


class OfficialStyleFrameFusion:
    """The official FrameFusion module re-derived for batch size 1, in the official structure (`num_layers` is
    the official hard-coded 28 unless given). Also records where it merged and pruned, as vtc reports it:
    `steps` = [(layer, point, merged)], `pruned_at`."""

    TEXT = -1

    def __init__(self, cost, similarity_lower_bound, ratio_lower_bound, num_layers=28):
        self.cost, self.s_th, self.r_min = cost, similarity_lower_bound, ratio_lower_bound
        self.num_layers = num_layers

    def prepare(self, patch_type, patch_num):
        self.patch_type, self.patch_num = patch_type, patch_num
        self.finish_merging = self.finish_pruning = False
        self.sparsity_list = []
        self.steps, self.pruned_at = [], None

    def __call__(self, hidden, cos, sin, attn_weights=None, layer=0, point="after_attention"):
        if self.finish_merging and not self.finish_pruning:
            visual = torch.nonzero(self.patch_type[0] != self.TEXT).flatten()
            importance = attn_weights.mean(dim=(1, 2))[0][visual]
            ratio = pruning_ratio(self.sparsity_list, self.cost, self.num_layers)
            top = visual[importance.topk(round(visual.numel() * (1 - ratio))).indices]
            keep = torch.sort(torch.cat([torch.nonzero(self.patch_type[0] == self.TEXT).flatten(), top])).values
            hidden, cos, sin = hidden[:, keep], cos[:, keep], sin[:, keep]
            self.patch_type = self.patch_type[:, keep]
            self.finish_pruning = True
            self.pruned_at = layer
        if not self.finish_merging:
            upper = pruning_ratio(self.sparsity_list, self.cost, self.num_layers)
            patch_of, token_index = torch.where(self.patch_type == torch.arange(self.patch_num)[:, None])
            a, b = hidden[0, token_index[:-1]], hidden[0, token_index[1:]]
            sim = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
            sim[patch_of[:-1] != patch_of[1:]] = -2
            sim = torch.cat([torch.full((1,), -2.0, dtype=sim.dtype), sim])
            num_visual = int((self.patch_type != self.TEXT).sum())
            merge_pos = torch.nonzero(sim >= self.s_th).flatten()
            ratio = merge_pos.numel() / num_visual
            if ratio < upper:
                self.sparsity_list.append(ratio)
                if ratio < self.r_min:
                    self.finish_merging = True
            else:
                merge_pos = torch.sort(torch.topk(sim, int(upper * num_visual)).indices).values
                self.finish_merging = self.finish_pruning = True
            self.steps.append((layer, point, merge_pos.numel()))
            hidden, keep = self._merge(hidden, token_index, merge_pos)
            hidden, cos, sin = hidden[:, keep], cos[:, keep], sin[:, keep]
            self.patch_type = self.patch_type[:, keep]
        return hidden, cos, sin

    @staticmethod
    def _merge(hidden, token_index, merge_pos):
        """Runs of consecutive merge positions (in patch order) fold into the element before the run."""
        keep = torch.ones(hidden.shape[1], dtype=torch.bool)
        if merge_pos.numel() == 0:
            return hidden, keep
        flags = torch.zeros(token_index.numel(), dtype=torch.long)
        flags[merge_pos] = 1
        hidden = hidden.clone()
        anchors, members, run_of = [], [], []
        i = 0
        while i < flags.numel():
            if flags[i]:
                start = i
                while i < flags.numel() and flags[i]:
                    i += 1
                anchors.append(start - 1)
                run_of.append(i - start)
                members.extend(range(start, i))
            else:
                i += 1
        keep[token_index[merge_pos]] = False
        anchor_of_member = torch.repeat_interleave(torch.tensor(anchors), torch.tensor(run_of))
        hidden.index_add_(1, token_index[anchor_of_member], hidden[:, token_index[torch.tensor(members)]])
        hidden[:, token_index[torch.tensor(anchors)]] /= torch.tensor(run_of)[None, :, None] + 1
        return hidden, keep


def framefusion_reference(model, inputs, cost, new_tokens=None, num_layers=28):
    """Official layer hooks: merge before layer 0's attention; after each layer's attention first prune
    (when merging finished), else merge; attention probabilities of the last `num` prompt rows (4 on Qwen-VL,
    1 on LLaVA). `num_layers` None: the model's depth."""
    adapter = vtc.api.resolve_adapter(model)
    ref, inputs, x, hidden, cos, sin, visual = start(model, inputs, new_tokens)
    stats = vtc.patch(model, "random", retention=1.0)
    with torch.no_grad():
        model(**inputs)
    grid = stats.stats().grids[0]
    stats.unpatch()
    patch_num = grid[1] * grid[2]
    patch_type = torch.full((1, hidden.shape[1]), -1)
    patch_type[0, visual] = torch.arange(int(visual.sum())) % patch_num
    depth = len(ref.layers) if num_layers is None else num_layers
    ff = OfficialStyleFrameFusion(cost, DEFAULT_SIMILARITY[rope_kind(adapter.family)], 0.1, depth)
    ff.prepare(patch_type, patch_num)
    num = {"qwen2_vl": 4, "qwen2_5_vl": 4, "qwen3_vl": 4, "llava_onevision": 1, "llava_next_video": 1}[adapter.family]
    with ref.capturing(), torch.no_grad():
        hidden, cos, sin = ff(hidden, cos, sin, layer=0, point="layer_start")
        for i in range(len(ref.layers)):
            hidden = ref.attention_block(i, hidden, cos, sin)
            weights = None
            if ff.finish_merging and not ff.finish_pruning:
                query, key = CAPTURED[i]
                n_prompt = hidden.shape[1] - (0 if new_tokens is None else new_tokens.shape[1])
                weights = last_rows_attention(query[:, :, :n_prompt], key[:, :, :n_prompt], num, upcast=False)
            hidden, cos, sin = ff(hidden, cos, sin, weights, layer=i)
            hidden = ref.mlp_block(i, hidden)
    return ref.logits(hidden), ff


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava_onevision", "llava_next_video"])
@pytest.mark.parametrize("cost, num_layers", [(0.3, 28), (0.5, 28), (0.5, None), (0.7, None)])
def test_matches_official_structure_reference(family, cost, num_layers):
    """num_layers=28: the official hard-coded schedule; None (the default): L = the model's 4 layers."""
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    ref_logits, ff = framefusion_reference(model, inputs, cost, num_layers=num_layers)
    with vtc.patch(model, "framefusion", retention=cost, num_layers=num_layers) as handle:
        with torch.no_grad():
            out = model(**inputs).logits
        stats = handle.stats()
    reports = stats.reports["framefusion"]
    assert reports["merge_steps"] == [ff.steps]  # one entry per batch row: (layer, point, tokens merged)
    assert reports["pruned_at"] == [ff.pruned_at]
    assert reports["kept"] == [stats.visual_tokens_out] == [int((ff.patch_type != -1).sum())]
    torch.testing.assert_close(out[:, -1], ref_logits[:, -1], atol=2e-5, rtol=1e-4)
    if num_layers is None:  # the schedule's own mean over the model's layers is the cost
        assert stats.mean_layer_retention == pytest.approx(cost, abs=0.01)


def test_reports_one_entry_per_batch_row_and_hook_calls_keep_no_state():
    from tests.conftest import batch_inputs

    family = "qwen2_vl"
    model, _ = model_and_processor(family)
    with vtc.patch(model, "framefusion", retention=0.3, num_layers=28) as handle:
        method = handle.pipeline.entries[0].method
        state = dict(vars(method))
        with torch.no_grad():
            model(**batch_inputs(family))
        batch = handle.stats().reports["framefusion"]
        singles = []
        for which in (0, 1):
            with torch.no_grad():
                model(**single_inputs(family, which))
            singles.append(handle.stats().reports["framefusion"])
        assert vars(method) == state  # per-prompt state lives in ctx.state, not on the method
    for name in ("kept", "merge_steps", "pruned_at"):
        assert batch[name] == [s[name][0] for s in singles], name
        assert all(len(s[name]) == 1 for s in singles)
    assert all(k > 0 for k in batch["kept"])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_decode_after_ragged_prefill(family):
    """Decode steps read a KV cache whose length differs per layer; compare with recomputing the whole
    sequence, where the prompt is merged the same way (merges are causal) and pruned by the attention of
    the prompt's last rows, as at prefill."""
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    with vtc.patch(model, "framefusion", retention=0.3, num_layers=28) as handle:  # the official schedule
        gen = model.generate(
            **inputs, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        layers = handle.stats().layer_visual_tokens
    assert len(set(layers)) > 1, "the cache should be ragged across layers for this check"
    new = gen.sequences[:, inputs["input_ids"].shape[1] :]
    for step in (1, 2):
        ref_logits, _ = framefusion_reference(model, inputs, 0.3, new_tokens=new[:, :step])
        torch.testing.assert_close(gen.logits[step], ref_logits[:, -1], atol=2e-5, rtol=1e-4)


def test_qwen3_vl_deepstack_follows_merged_tokens():
    """Qwen3-VL injects DeepStack features after the first layers; merged tokens get the mean of their
    members' features (the same fold as the hidden states) and the model runs and decodes."""
    model, _ = model_and_processor("qwen3_vl")
    inputs = single_inputs("qwen3_vl")
    with vtc.patch(model, "framefusion", retention=0.5) as handle:
        gen = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        stats = handle.stats()
    assert gen.shape[1] == inputs["input_ids"].shape[1] + 3
    assert stats.visual_tokens_out < stats.visual_tokens_in
    assert stats.mean_layer_retention == pytest.approx(0.5, abs=0.01)


@pytest.fixture
def deep_model(monkeypatch):
    """A 12-layer Qwen2-VL (deeper than FrameFusion's merge steps) and 16 frames of a generated clip."""
    monkeypatch.setitem(SIZES, "deep12", TinySize(layers=12))
    model, processor = tiny.build("qwen2_vl", size="deep12")
    inputs = vtc.prepare_inputs(processor, synthetic_video(32, 224, 224), "What happens?", num_frames=16, fps=8)
    return model, inputs


def test_retention_is_the_mean_over_the_layers_of_a_deeper_model(deep_model):
    model, inputs = deep_model
    assert len(vtc.api.resolve_adapter(model).decoder_layers) == 12
    measured = {}
    for retention in (0.5, 0.3, 0.2):
        for num_layers in (None, 28):
            with vtc.patch(model, "framefusion", retention=retention, num_layers=num_layers) as handle:
                with torch.no_grad():
                    model(**inputs)
                stats = handle.stats()
            assert len(stats.layer_visual_tokens) == 12
            assert stats.retention_at("layer_mean") == stats.mean_layer_retention
            measured[retention, num_layers] = stats.mean_layer_retention
            assert stats.reports["framefusion"]["kept"] == [stats.visual_tokens_out]
    for retention in (0.5, 0.3, 0.2):
        assert measured[retention, None] == pytest.approx(retention, abs=0.03), measured  # FrameFusion's rounding
    # the official hard-coded L = 28 spends the budget as if the model had 28 layers: further from the target
    assert abs(measured[0.2, 28] - 0.2) > abs(measured[0.2, None] - 0.2)
