"""FrameFusion: "Combining Similarity and Importance for Video Token Reduction on Large Vision Language
Models" (Fu et al., ICCV 2025). Official code: thu-nics/FrameFusion (`framefusion/main.py`).

Inside the LLM during prefill: merge each visual token into its predecessor at the same spatial position
(previous surviving frame) when their cosine similarity reaches S_th — at layer 0 before attention and
after the attention of each following shallow layer, while enough tokens qualify — then prune once by the
attention of the last prompt tokens, so that the mean fraction of visual tokens over the L layers equals
the budget `cost`. Positions are never renumbered: a merged token keeps its anchor's (earliest frame's)
position. Stage: prefill.

Faithful to the official code: the cost schedule, unweighted cascaded means, similarity in the model dtype,
4 query rows on Qwen-VL families and 1 on LLaVA families, the prune on the post-attention residual stream
before the MLP. vtc differences: L is the model's number of decoder layers (the official code hard-codes 28,
the depth of every 7B model it was run on; `num_layers=28` reproduces it on other depths), so `retention`
is the mean fraction of visual tokens over the layers; batches are handled row by row (the official code
asserts batch size 1); chains never cross videos; when the budget asks to merge more tokens than have a
predecessor (only possible with very few frames) the chain heads are not merged (the official code would fold
them into an unrelated token).
"""

from __future__ import annotations

import dataclasses

import torch

from vtc.core.hookspecs import hookimpl
from vtc.core.registry import MethodInfo
from vtc_kernels import chain_anchors, chain_order, chain_similarity, topk_indices
from vtc_kernels.select import segmented_topk
from vtc_kernels.similarity import NO_PREDECESSOR

# prompt rows whose attention measures importance: 4 on Qwen-VL, 1 on LLaVA (the official interface code)
DEFAULT_ATTENTION_ROWS = {
    "qwen2_vl": 4,
    "qwen2_5_vl": 4,
    "qwen3_vl": 4,
    "llava_onevision": 1,
    "llava_next_video": 1,
}
# S_th of the official examples: example_qwen2vl.py uses 0.5, README / example_llava.py 0.6
DEFAULT_SIMILARITY = {
    "qwen2_vl": 0.5,
    "qwen2_5_vl": 0.5,
    "qwen3_vl": 0.5,
    "llava_onevision": 0.6,
    "llava_next_video": 0.6,
}


@dataclasses.dataclass
class FrameFusionParams:
    cost: float | None = None  # mean fraction of visual tokens over the layers (default: retention, else 0.3)
    similarity_lower_bound: float | None = None  # S_th; None = 0.5 on Qwen-VL, 0.6 on LLaVA (official examples)
    ratio_lower_bound: float = 0.1  # r_min: stop merging once a step merges fewer than this fraction
    num_layers: int | None = None  # L in the cost formula; None = the model's depth (official: 28, hard-coded)
    attention_rows: int | None = None  # last prompt rows for importance; None = 4 on Qwen-VL, 1 on LLaVA

    def __post_init__(self):
        if self.cost is not None and not 0.0 < float(self.cost) <= 1.0:
            raise ValueError(f"framefusion: cost must be in (0, 1], got {self.cost}")
        if not 0.0 <= float(self.ratio_lower_bound) <= 1.0:
            raise ValueError(f"framefusion: ratio_lower_bound must be in [0, 1], got {self.ratio_lower_bound}")
        if self.num_layers is not None and int(self.num_layers) < 1:
            raise ValueError(
                f"framefusion: num_layers must be >= 1 (or None: the model's depth), got {self.num_layers}"
            )


def pruning_ratio(sparsity: list[float], cost: float, num_layers: int = 28) -> float:
    """rho(s): fraction of the *current* visual tokens to remove at the next step so that the mean kept
    fraction over `num_layers` layers equals `cost`, given the merge ratios `sparsity` already applied."""
    kept, used = 1.0, 0.0
    for s in sparsity:
        kept *= 1.0 - s
        used += kept
    remain = num_layers * cost - used
    if remain < 0:
        raise ValueError("The cost is too small")
    per_layer = remain / ((num_layers - len(sparsity)) * kept)
    return 0.0 if per_layer > 1 else 1.0 - per_layer


@dataclasses.dataclass
class RowState:
    """FrameFusion's per-prompt state (the official `prepare(...)` fields)."""

    sparsity: list[float] = dataclasses.field(default_factory=list)
    finish_merging: bool = False
    finish_pruning: bool = False
    merge_steps: list[tuple[int, str, int]] = dataclasses.field(default_factory=list)  # (layer, point, merged)
    pruned_at: int | None = None
    final_tokens: int | None = None  # visual tokens left by the last step (prune, or a budget-capped merge)


def merge_plan(
    hidden: torch.Tensor, slots: torch.Tensor, chain_key: torch.Tensor, threshold: float, max_ratio: float
) -> tuple[torch.Tensor, torch.Tensor, float, bool]:
    """One merge step on one row.

    hidden [n, D]; slots [m] the visual slots; chain_key [n] (video, patch) key per slot.
    Returns (dst, src, ratio, budget_hit): merge src slots into dst slots; `ratio` is the fraction of visual
    tokens above the threshold; `budget_hit` means that fraction reached `max_ratio`, in which case exactly
    int(max_ratio * m) most similar tokens are merged instead (and FrameFusion stops both merging and pruning).
    """
    order, keys = chain_order(chain_key, slots)
    sim = chain_similarity(hidden, order, keys)
    m = slots.numel()
    candidates = sim >= threshold
    ratio = int(candidates.sum()) / m
    budget_hit = ratio >= max_ratio
    if budget_hit:
        mergeable = int((sim > NO_PREDECESSOR).sum())  # chain heads have no predecessor to merge into
        chosen = topk_indices(sim, min(int(max_ratio * m), mergeable))
        candidates = torch.zeros_like(candidates)
        candidates[chosen] = True
    if not bool(candidates.any()):
        return slots[:0], slots[:0], ratio, budget_hit
    anchors = chain_anchors(candidates)
    return order[anchors], order[candidates], ratio, budget_hit


class FrameFusion:
    def __init__(self, params: FrameFusionParams, retention: float | None = None) -> None:
        self.params = params
        self.cost = float(params.cost) if params.cost is not None else (retention if retention is not None else 0.3)

    def _threshold(self, family: str) -> float:
        if self.params.similarity_lower_bound is not None:
            return float(self.params.similarity_lower_bound)
        return DEFAULT_SIMILARITY[family]

    def _num_layers(self, state) -> int:
        return int(self.params.num_layers) if self.params.num_layers is not None else state.num_layers

    def _pruning_ratio(self, row: RowState, state) -> float:
        layers = self._num_layers(state)
        try:
            return pruning_ratio(row.sparsity, self.cost, layers)
        except ValueError as err:  # the official "The cost is too small", with what to change
            raise ValueError(
                f"framefusion: {err}: the merges of layers 0..{state.layer} already used more than the budget "
                f"cost x L = {self.cost:g} x {layers} allows; use a higher retention (cost), or a larger num_layers "
                "(the official code hard-codes 28) on a model this shallow"
            ) from None

    @hookimpl
    def vtc_prefill(self, state, ctx):
        if self.cost >= 1.0:
            return
        layout = state.layout
        if state.layer == 0 and state.point == "layer_start":
            ctx.store["rows"] = [RowState() for _ in range(layout.valid.shape[0])]
            self._merge(state, ctx)  # merge on the input embeddings, before layer 0's attention
        elif state.point == "after_attention":
            self._prune(state, ctx)
            self._merge(state, ctx)
        rows = ctx.store["rows"]
        if state.point == "layer_start" and any(r.finish_merging and not r.finish_pruning for r in rows):
            count = self.params.attention_rows or DEFAULT_ATTENTION_ROWS[state.family]
            # the official attention computes these probabilities with a softmax in the model dtype
            state.request_attention(num_rows=int(count), upcast=False)
        if state.layer == state.num_layers - 1 and state.point == "after_attention":
            for row in rows:  # what each batch row decided (FrameFusion is adaptive)
                ctx.report(kept=row.final_tokens, merge_steps=list(row.merge_steps), pruned_at=row.pruned_at)

    def _merge(self, state, ctx) -> None:
        layout = state.layout
        threshold = self._threshold(state.family)
        chain_key = layout.video * (layout.patch.max() + 1) + layout.patch
        batch, dst, src = [], [], []
        for b, row in enumerate(ctx.store["rows"]):
            if row.finish_merging:
                continue
            slots = torch.nonzero(layout.visual[b] & layout.valid[b]).flatten()
            if slots.numel() == 0:
                row.finish_merging = row.finish_pruning = True
                row.final_tokens = 0
                continue
            max_ratio = self._pruning_ratio(row, state)
            d, s, ratio, budget_hit = merge_plan(state.hidden[b], slots, chain_key[b], threshold, max_ratio)
            if budget_hit:
                row.finish_merging = row.finish_pruning = True
                row.final_tokens = int(slots.numel() - s.numel())
            else:
                row.sparsity.append(ratio)
                if ratio < self.params.ratio_lower_bound:
                    row.finish_merging = True
            row.merge_steps.append((state.layer, state.point, int(s.numel())))
            batch.append(torch.full_like(s, b))
            dst.append(d)
            src.append(s)
        if batch:
            state.merge_mean(torch.cat(batch), torch.cat(dst), torch.cat(src))

    def _prune(self, state, ctx) -> None:
        rows = ctx.store["rows"]
        due = [b for b, r in enumerate(rows) if r.finish_merging and not r.finish_pruning]
        if not due:
            return
        layout = state.layout
        importance = state.attention().mean(dim=(1, 2))  # [B, keys]: mean over heads and query rows
        keep = layout.valid.clone()
        visual = layout.visual[due] & layout.valid[due]  # [D, n]: one top-k segment per due row
        keep[due] = layout.valid[due] & ~visual
        budgets = []
        for b, count in zip(due, visual.sum(dim=1).tolist()):
            row = rows[b]
            ratio = self._pruning_ratio(row, state)
            kept = round(count * (1 - ratio))
            budgets.append(kept)
            row.finish_pruning = True
            row.pruned_at = state.layer
            row.final_tokens = kept
        pool = torch.nonzero(visual.flatten()).flatten()
        offsets = torch.cat([pool.new_zeros(1), torch.cumsum(visual.sum(dim=1), 0)])
        scores = importance[due].flatten()[pool.to(importance.device)]
        chosen = pool[segmented_topk(scores, offsets, torch.tensor(budgets)).to(pool.device)]
        width = visual.shape[1]
        keep[torch.tensor(due, device=keep.device)[chosen // width], chosen % width] = True
        state.keep(keep)


@hookimpl
def vtc_register_methods(registry):
    registry.add(
        MethodInfo(
            name="framefusion",
            factory=FrameFusion,
            params=FrameFusionParams,
            stages=("prefill",),
            paper="FrameFusion: Combining Similarity and Importance for Video Token Reduction (ICCV 2025)",
            url="https://arxiv.org/abs/2501.01986",
            summary="merge similar tokens across frames in shallow layers, then prune by attention",
            retention_reference="layer_mean",
            retention_note="adaptive: retention is the mean fraction of visual tokens over the LLM layers "
            "(FrameFusion's cost); the final count depends on how many tokens merge",
            # the cost schedule spends a layer per merge step: 4-layer test models run it over the official 28
            test_params={"num_layers": 28},
            conformance_exemptions={
                "retention": "needs a model deeper than its merge steps; tests/test_framefusion.py checks the mean "
                "over layers on a 12-layer model"
            },
            owns=frozenset({"llm_token_schedule"}),
            query_aware=True,
        )
    )
