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

import vtc
from vtc.core.families import get_family
from vtc_kernels import chain_anchors, chain_order, chain_similarity, topk_indices
from vtc_kernels.select import segmented_topk
from vtc_kernels.similarity import NO_PREDECESSOR

# the official code's defaults, for its two kinds of model: Qwen-VL (M-RoPE) and LLaVA (1-D RoPE). A family takes
# the values of its kind, so a new family needs no entry here (vtc's choice for families the official code lacks)
# prompt rows whose attention measures importance: 4 on Qwen-VL, 1 on LLaVA (the official interface code)
DEFAULT_ATTENTION_ROWS = {"mrope": 4, "rope": 1}
# S_th of the official examples: example_qwen2vl.py uses 0.5, README / example_llava.py 0.6
DEFAULT_SIMILARITY = {"mrope": 0.5, "rope": 0.6}


def rope_kind(family: str) -> str:
    """ "mrope" for a family with M-RoPE (the official code's Qwen-VL setting), else "rope" (its LLaVA setting)."""
    return "mrope" if "mrope" in get_family(family).features else "rope"


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


@vtc.method(
    "framefusion",
    paper="FrameFusion: Combining Similarity and Importance for Video Token Reduction (ICCV 2025)",
    url="https://arxiv.org/abs/2501.01986",
    summary="merge similar tokens across frames in shallow layers, then prune by attention",
    retention_note="adaptive: retention is the mean fraction of visual tokens over the LLM layers "
    "(FrameFusion's cost); the final count depends on how many tokens merge",
    # the cost schedule spends a layer per merge step: 4-layer test models run it over the official 28
    test_params={"num_layers": 28},
    exempt={
        "retention": "needs a model deeper than its merge steps; tests/test_framefusion.py checks the mean "
        "over layers on a 12-layer model"
    },
)
class FrameFusion(vtc.Method):
    """Merge steps while enough tokens qualify, then one prune (`FusionPrune`, a LayerPruner) at the layer where
    merging stopped (official: thu-nics/FrameFusion `framefusion/main.py`)."""

    temporal = True  # merges tokens with the same cell of the previous frame: videos only

    cost: float | None = vtc.param(
        None, range="(0, 1]", doc="mean fraction of visual tokens over the layers (default: retention, else 0.3)"
    )
    similarity_lower_bound: float | None = vtc.param(
        None, doc="S_th; None = 0.5 on Qwen-VL, 0.6 on LLaVA (official examples)"
    )
    ratio_lower_bound: float = vtc.param(
        0.1, range="[0, 1]", doc="r_min: stop merging once a step merges fewer than this fraction"
    )
    num_layers: int | None = vtc.param(
        None, range="[1, inf)", doc="L in the cost formula; None = the model's depth (official: 28, hard-coded)"
    )
    attention_rows: int | None = vtc.param(None, doc="last prompt rows for importance; None = 4 on Qwen-VL, 1 on LLaVA")

    owns = frozenset({"llm_token_schedule"})
    query_aware = True
    retention_reference = "layer_mean"

    def budget(self) -> float:
        """The cost: the parameter, else the retention, else 0.3."""
        if self.cost is not None:
            return self.cost
        return self.retention if self.retention is not None else 0.3

    def threshold(self, family: str) -> float:
        """S_th: the parameter, else the official examples' value for the family."""
        if self.similarity_lower_bound is not None:
            return self.similarity_lower_bound
        return DEFAULT_SIMILARITY[rope_kind(family)]

    def num_rows(self, family: str) -> int:
        """The last prompt rows whose attention measures importance: the parameter, else the family's."""
        return self.attention_rows or DEFAULT_ATTENTION_ROWS[rope_kind(family)]

    def depth(self, llm) -> int:
        return self.num_layers if self.num_layers is not None else llm.num_layers

    def pruning_ratio(self, row: RowState, llm) -> float:
        layers = self.depth(llm)
        cost = self.budget()
        try:
            return pruning_ratio(row.sparsity, cost, layers)
        except ValueError as err:  # the official "The cost is too small", with what to change
            raise ValueError(
                f"framefusion: {err}: the merges of layers 0..{llm.layer} already used more than the budget "
                f"cost x L = {cost:g} x {layers} allows; use a higher retention (cost), or a larger num_layers "
                "(the official code hard-codes 28) on a model this shallow"
            ) from None

    def prefill(self, llm, ctx):
        if self.budget() >= 1.0:
            return
        if llm.layer == 0 and llm.point == "layer_start":
            ctx.state["rows"] = [RowState() for _ in range(llm.layout.valid.shape[0])]
            self._merge(llm, ctx)  # merge on the input embeddings, before layer 0's attention
        elif llm.point == "after_attention":
            self._prune(llm, ctx)  # the rows whose merging finished: keep by this layer's attention
            self._merge(llm, ctx)
        if llm.point == "layer_start":
            self._prune(llm, ctx)  # the rows whose merging finished: request this layer's attention
        if llm.layer == llm.num_layers - 1 and llm.point == "after_attention":
            for row in ctx.state["rows"]:  # what each batch row decided (FrameFusion is adaptive)
                ctx.report(kept=row.final_tokens, merge_steps=list(row.merge_steps), pruned_at=row.pruned_at)

    def _prune(self, llm, ctx) -> None:
        """FrameFusion's prune step at this layer, while some row has finished merging and is not pruned yet."""
        if any(r.finish_merging and not r.finish_pruning for r in ctx.state["rows"]):
            FusionPrune(self, llm.layer, self.num_rows(llm.family)).prefill(llm, ctx)

    def _merge(self, llm, ctx) -> None:
        layout = llm.layout
        threshold = self.threshold(llm.family)
        chain_key = layout.video * (layout.patch.max() + 1) + layout.patch
        batch, dst, src = [], [], []
        for b, row in enumerate(ctx.state["rows"]):
            if row.finish_merging:
                continue
            slots = torch.nonzero(layout.visual[b] & layout.valid[b]).flatten()
            if slots.numel() == 0:
                row.finish_merging = row.finish_pruning = True
                row.final_tokens = 0
                continue
            max_ratio = self.pruning_ratio(row, llm)
            d, s, ratio, budget_hit = merge_plan(llm.hidden[b], slots, chain_key[b], threshold, max_ratio)
            if budget_hit:
                row.finish_merging = row.finish_pruning = True
                row.final_tokens = int(slots.numel() - s.numel())
            else:
                row.sparsity.append(ratio)
                if ratio < self.ratio_lower_bound:
                    row.finish_merging = True
            row.merge_steps.append((llm.layer, llm.point, int(s.numel())))
            batch.append(torch.full_like(s, b))
            dst.append(d)
            src.append(s)
        if batch:
            llm.merge_mean(torch.cat(batch), torch.cat(dst), torch.cat(src))


@dataclasses.dataclass
class FusionPrune(vtc.LayerPruner):
    """FrameFusion's prune step, at the layer `layer` where the due rows (merging finished, not pruned yet) are:
    the attention of the last `rows` prompt tokens of that layer, averaged over heads and rows, ranks each due
    row's visual tokens, and after the layer's attention (before its MLP) the row keeps round(m (1 - rho)) of
    them, rho from `fusion`'s cost schedule. Built by `FrameFusion` while rows are due (not a method itself)."""

    fusion: FrameFusion
    layer: int
    rows: int

    keep_point = "after_attention"
    upcast = False  # the official attention computes these probabilities with a softmax in the model dtype

    def prune_layer(self):
        return self.layer

    def request(self, llm, ctx):
        llm.request_attention(num_rows=self.rows, upcast=self.upcast)

    def keep_mask(self, llm, ctx):
        rows = ctx.state["rows"]
        due = [b for b, r in enumerate(rows) if r.finish_merging and not r.finish_pruning]
        layout = llm.layout
        importance = llm.attention().mean(dim=(1, 2))  # [B, keys]: mean over heads and query rows
        keep = layout.valid.clone()
        visual = layout.visual[due] & layout.valid[due]  # [D, n]: one top-k segment per due row
        keep[due] = layout.valid[due] & ~visual
        budgets = []
        for b, count in zip(due, visual.sum(dim=1).tolist()):
            row = rows[b]
            ratio = self.fusion.pruning_ratio(row, llm)
            kept = round(count * (1 - ratio))
            budgets.append(kept)
            row.finish_pruning = True
            row.pruned_at = llm.layer
            row.final_tokens = kept
        pool = torch.nonzero(visual.flatten()).flatten()
        offsets = torch.cat([pool.new_zeros(1), torch.cumsum(visual.sum(dim=1), 0)])
        scores = importance[due].flatten()[pool.to(importance.device)]
        chosen = pool[segmented_topk(scores, offsets, torch.tensor(budgets)).to(pool.device)]
        width = visual.shape[1]
        keep[torch.tensor(due, device=keep.device)[chosen // width], chosen % width] = True
        return keep
