"""SparseVLM: "Visual Token Sparsification for Efficient Vision-Language Model Inference" (Zhang et al., ICML 2025;
arXiv 2410.04417). Official code: Gumpest/SparseVLMs at `main` 26a5f488 with `USE_VERSION=1_0`, the runnable form of
the v1.5 algorithm the README points to (`llava/model/language_model/modelling_sparse_llama.py` L186-321 and its SDPA
attention L618-714, `score.py` L1-46, `utils.py` `scaled_dot_product_attention` L95-116 and `cluster_and_merge`
L179-239). The `v1.5` branch (b9619e61) holds the same lists and rules but calls a flash-attention module its decoder
layer never builds. Hooking reference for towers without a CLS token and M-RoPE models: ModelTC/LightCompress
`llmc/compression/token_reduction/sparsevlm.py` @ 9701d035 (Qwen2.5-VL support from PR #441, c9098968).

The idea: the question tells which visual tokens matter. Once, on the LLM's input embeddings, the text tokens after
the visual span whose softmax relevance to the visual tokens is above average become "raters". At LLM layers 2, 6
and 15 the raters' attention to the visual tokens (mean over heads and raters) scores them; the layer's output keeps
the top k visual tokens, and of the dropped ones the top 30 % (+1) by score are "recycled": clustered by DPC-kNN into
a tenth of their number (+1) and each cluster folded into one token, its plain mean. Later layers see (and cache)
only the survivors; the pruning layer itself still caches every token. Stage: prefill.

Budgets. The official lists (`score.py`, `RETAIN_TOKN`) give the visual tokens kept after layers 2 / 6 / 15 for
LLaVA-1.5's 576 tokens: 192 -> 300, 200, 110; 128 -> 303, 110, 36; 96 -> 238, 48, 26; 64 -> 66, 30, 17. The name is
meant as the mean over LLaVA-1.5's 32 layers; score.py's comment counts it as "2*576 4*300 10*200 16*110" (= 191),
which has layer 2 see the pruned count and leaves the recycled tokens out: by what each layer sees (layers 0..2 all
576, recycled tokens included) the 192 list is 206.5 tokens per layer. vtc scales a list to the video's N visual
tokens (k = round(count * N / 576)), as `tokens=`. `retention` r is that mean made exact for the model at hand: the
mean fraction of visual tokens over its layers, recycled tokens included. vtc walks the path
through the official lists (linear between them in RETAIN_TOKN, from nothing kept at 0 to everything at 576) and
takes the point whose mean over this model's depth is r; below the least the layers up to the first pruning layer
allow it keeps that least and warns. `schedule=` gives the fractions directly (the README's "modify score.py").

Where vtc differs (each also in docs/methods/sparsevlm.md):
* positions: survivors keep their original (M-)RoPE positions and a recycled token takes its DPC centre's, as in
  LightCompress's port (`position_ids = keep_indexs`); the official LLaVA code renumbers the shortened sequence
  contiguously (`position_ids[:, :new_len]`) and gives a decode token, per layer, the position of that layer's KV
  length. Decoding continues from the original prompt length;
* a recycled token sits at its centre's slot, among the kept tokens in original order; the official code (and the
  port) inserts the recycled tokens after the last kept visual token, so there they see every kept visual token;
* the cluster mean is exact; the official code divides by (n + 1e-6);
* DPC-kNN distances in float32 (`vtc_kernels`), the official ones in the model dtype; the recycled tokens are
  clustered in index order, not score order, and the density's random tie-break (U(0, 1e-6)) comes from a generator
  seeded 0 for each clustering (official: the unseeded global RNG): the noise then follows the tokens, so a padded
  batch row decides exactly as the row alone;
* batches row by row (the official code assumes batch size 1); several videos of a row form one pool, rated by the
  text after the last visual token (the official code has one contiguous image span);
* no rater above the mean (all text tokens equally related) makes every text token a rater (the official scores
  would be NaN);
* the official `min(k, N - 1)` is kept: every stage drops at least one token, which at k >= N is recycled alone,
  as itself, in its own slot: the sequence is unchanged.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Sequence

import torch

import vtc
from vtc_kernels import assign_to_centers, dpc_knn_centers, mean_into_anchors

Tensor = torch.Tensor

OFFICIAL_LAYERS = (2, 6, 15)  # `pruning_loc`, modelling_sparse_llama.py L70
OFFICIAL_TOKENS = 576  # `image_shape`: LLaVA-1.5's visual tokens, for which the lists are written
# score.py L11-14 (USE_VERSION=1_0): visual tokens kept after each pruning layer, per RETAIN_TOKN
OFFICIAL_SCHEDULES = {192: (300, 200, 110), 128: (303, 110, 36), 96: (238, 48, 26), 64: (66, 30, 17)}
DEFAULT_TOKENS = 192  # RETAIN_TOKN default (score.py L7)
RECYCLE_FRACTION = 0.3  # "Top 30%" of the dropped tokens are recycled (L282)
CLUSTER_DIVISOR = 10  # one cluster per ten recycled tokens, plus one (L286)
# the path `retention` walks: RETAIN_TOKN -> counts kept after each stage, for 576 tokens
RETENTION_PATH = (
    (0, (0, 0, 0)),
    *sorted(OFFICIAL_SCHEDULES.items()),
    (OFFICIAL_TOKENS, (OFFICIAL_TOKENS,) * 3),
)


# --- the algorithm ----------------------------------------------------------------------------------------------


def select_raters(visual: Tensor, text: Tensor) -> Tensor:
    """[T] bool: the text raters (modelling_sparse_llama.py L199-204). visual [V, D] and text [T, D] are the LLM's input
    embeddings of the visual tokens and of the tokens after them; relation = softmax over the text of visual @ text^T
    (raw dot products, model dtype), averaged over the visual tokens; a rater is above the mean relation. When none is
    (all equal) every text token rates."""
    relation = (visual @ text.T).softmax(dim=1).mean(dim=0)
    raters = relation > relation.mean()
    return raters if bool(raters.any()) else torch.ones_like(raters)


def rater_scores(attention: Tensor, rater_rows: Tensor, visual: Tensor) -> Tensor:
    """[V] score of each visual token (`attn_postprocess_topk`, score.py L27-32): the attention probabilities
    [H, R, n] of one batch row averaged over heads, the rows of the raters, the columns of the visual slots, averaged
    over the raters. Model dtype, as the official SDPA path computes them."""
    return attention.mean(dim=0)[rater_rows][:, visual].mean(dim=0)


def kept_count(target: int, num_visual: int) -> int:
    """Visual tokens the top-k keeps: min(target, N - 1) (score.py L41), so at least one is always dropped."""
    return max(0, min(int(target), num_visual - 1))


def recycled_count(num_dropped: int) -> int:
    """Dropped tokens that are recycled: int(0.3 n) + 1 (L282)."""
    return int(num_dropped * RECYCLE_FRACTION) + 1


def cluster_count(num_recycled: int) -> int:
    """Clusters the recycled tokens fold into: int(n / 10) + 1 (L286)."""
    return int(num_recycled / CLUSTER_DIVISOR) + 1


def stage_counts(num_visual: int, targets: Sequence[int]) -> list[int]:
    """Visual tokens after each stage: the kept ones plus the recycled clusters (a row without visual tokens stays
    empty)."""
    counts, current = [], num_visual
    for target in targets:
        if current > 0:
            kept = kept_count(target, current)
            current = kept + cluster_count(recycled_count(current - kept))
        counts.append(current)
    return counts


def layer_counts(num_visual: int, layers: Sequence[int], counts: Sequence[int], num_layers: int) -> list[int]:
    """Visual tokens each LLM layer sees: every one up to the first pruning layer (which prunes its own output), then
    each stage's count from the layer after it."""
    out, current, stage = [], num_visual, 0
    for layer in range(num_layers):
        out.append(current)
        if stage < len(layers) and layer == layers[stage]:
            current = counts[stage]
            stage += 1
    return out


def official_targets(tokens: int, num_visual: int) -> list[int]:
    """The official list of RETAIN_TOKN `tokens`, scaled from 576 to `num_visual` tokens."""
    return [round(count * num_visual / OFFICIAL_TOKENS) for count in OFFICIAL_SCHEDULES[tokens]]


def path_targets(nominal: float, num_visual: int) -> list[int]:
    """Targets at a point of the retention path: the official lists interpolated linearly in RETAIN_TOKN (0 keeps
    nothing, 576 everything), scaled to `num_visual` tokens."""
    for (lo, low), (hi, high) in zip(RETENTION_PATH, RETENTION_PATH[1:]):
        if nominal <= hi:
            w = (nominal - lo) / (hi - lo)
            return [round(((1 - w) * a + w * b) * num_visual / OFFICIAL_TOKENS) for a, b in zip(low, high)]
    return [num_visual] * 3


def mean_retention(num_visual: int, layers: Sequence[int], targets: Sequence[int], num_layers: int) -> float:
    """Mean fraction of visual tokens over the layers, recycled tokens included."""
    counts = layer_counts(num_visual, layers, stage_counts(num_visual, targets), num_layers)
    return sum(counts) / (num_layers * num_visual)


def retention_targets(
    retention: float, num_visual: int, layers: Sequence[int], num_layers: int
) -> tuple[list[int], float]:
    """(targets, mean): the point of the retention path whose mean fraction over `num_layers` layers is closest to
    `retention` (bisection on RETAIN_TOKN); the mean is above `retention` when even keeping nothing after each stage
    is (the layers up to the first pruning layer see every token)."""
    candidates = []

    def evaluate(nominal: float) -> float:
        targets = path_targets(nominal, num_visual)
        mean = mean_retention(num_visual, layers, targets, num_layers)
        candidates.append((abs(mean - retention), nominal, targets, mean))
        return mean

    lo, hi = 0.0, float(OFFICIAL_TOKENS)
    if evaluate(lo) < retention < evaluate(hi):
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if evaluate(mid) < retention else (lo, mid)
    _, _, targets, mean = min(candidates, key=lambda c: c[:2])  # the closest; on a tie the fewer tokens
    return targets, mean


@dataclasses.dataclass
class StagePlan:
    """One stage on one row, as indices into its visual tokens: `kept` (top-k, ascending), `recycled` (the recycled
    dropped tokens, ascending), `centers` (indices into `recycled`, DPC score order) and `labels` (the
    cluster of every recycled token, an index into `centers`)."""

    kept: Tensor
    recycled: Tensor
    centers: Tensor
    labels: Tensor

    def merges(self) -> tuple[Tensor, Tensor]:
        """(dst, src) indices into the visual tokens: every recycled token that is not a centre folds into its
        centre."""
        member = torch.ones(self.recycled.numel(), dtype=torch.bool, device=self.recycled.device)
        member[self.centers] = False
        return self.recycled[self.centers[self.labels[member]]], self.recycled[member]

    def survivors(self) -> Tensor:
        """Visual tokens left after the stage (kept ones and centres, which carry their cluster), ascending."""
        return torch.sort(torch.cat([self.kept, self.recycled[self.centers]])).values


def plan_stage(scores: Tensor, hidden: Tensor, target: int, generator: torch.Generator | None = None) -> StagePlan:
    """One pruning stage on one row (modelling_sparse_llama.py L259-307): keep the top min(target, N - 1) by `scores`
    [N]; of the dropped, recycle the top int(0.3 n) + 1 by score; cluster their rows of `hidden` [N, D] (in index
    order) by DPC-kNN into int(m / 10) + 1 clusters with k = the number of clusters (`cluster_and_merge`); each
    token joins its nearest centre, a centre its own."""
    num_visual = scores.numel()
    mask = torch.zeros(num_visual, dtype=torch.bool, device=scores.device)
    mask[torch.topk(scores, kept_count(target, num_visual)).indices] = True
    dropped = torch.nonzero(~mask).flatten()
    # the official code clusters them in score order; in index order the random tie-break of the densities follows
    # the tokens, not float-level differences of their scores (a padded batch row decides as the row alone)
    recycled = torch.sort(dropped[torch.topk(scores[dropped], recycled_count(dropped.numel())).indices]).values
    clusters = cluster_count(recycled.numel())
    centers, dist = dpc_knn_centers(hidden[recycled.to(hidden.device)], clusters, k=clusters, generator=generator)
    labels = assign_to_centers(dist, centers)
    return StagePlan(torch.nonzero(mask).flatten(), recycled, centers.to(recycled.device), labels.to(recycled.device))


def recycled_tokens(x: Tensor, centers: Tensor, labels: Tensor) -> Tensor:
    """[c, D] the recycled tokens of `x` [m, D] (the recycled hidden states), one per centre in centre order: the plain
    mean of its cluster (what `llm.merge_mean` computes in the LLM: vtc_kernels' `mean_into_anchors`)."""
    member = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    member[centers] = False
    src = torch.nonzero(member).flatten()
    return mean_into_anchors(x, centers[labels[src]], src)[centers]


# --- the method -------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RowState:
    """What one batch row decided on the input embeddings: its raters (positions in the prompt) and the visual tokens
    kept after each stage (targets before the min(k, N - 1) cap)."""

    raters: Tensor
    targets: list[int]
    visual: int


@vtc.method(
    "sparsevlm",
    paper="SparseVLM: Visual Token Sparsification for Efficient Vision-Language Model Inference (ICML 2025)",
    url="https://arxiv.org/abs/2410.04417",
    summary="question tokens rate the visual tokens at layers 2/6/15; prune progressively, recycle the dropped ones "
    "as cluster means",
    retention_note="retention is the mean fraction of visual tokens over the LLM layers (what SparseVLM's '192 tokens' "
    "counts on LLaVA-1.5), recycled tokens included: vtc picks that point on the path through the official budget "
    "lists; the layers up to the first pruning layer see every token, so below that floor it keeps the least and "
    "warns; tokens= gives the official lists",
    # the tiny test models have 4 layers: prune after layers 0, 1 and 2
    test_params={"layers": (0, 1, 2)},
)
class SparseVLM(vtc.Method):
    """Text raters chosen on the input embeddings score the visual tokens at `layers`; each such layer's output keeps
    the top tokens, and the best of the dropped ones come back as DPC-kNN cluster means."""

    layers: tuple[int, ...] = vtc.param(
        OFFICIAL_LAYERS,
        doc="pruning_loc: LLM layers whose raters' attention scores the visual tokens; each prunes its own output",
    )
    tokens: int | None = vtc.param(
        None,
        choices=tuple(sorted(OFFICIAL_SCHEDULES)),
        doc="RETAIN_TOKN: the official schedule for this many tokens of LLaVA-1.5's 576, scaled to the video; "
        "default: from retention, else 192",
    )
    schedule: tuple[float, ...] | None = vtc.param(
        None,
        doc="visual tokens kept after each layer of `layers`, as fractions of those entering the LLM (score.py's lists "
        "/ 576); overrides tokens and retention",
    )

    owns = frozenset({"llm_token_schedule"})
    query_aware = True
    retention_reference = "layer_mean"

    def validate(self) -> None:
        layers = self.layers
        if (
            not layers
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in layers)
            or list(layers) != sorted(set(layers))
        ):
            raise ValueError(f"sparsevlm: layers must be increasing LLM layer indices >= 0, got {layers!r}")
        if self.schedule is not None:
            if len(self.schedule) != len(layers):
                raise ValueError(
                    f"sparsevlm: schedule needs one fraction per layer of layers={tuple(layers)}, got {self.schedule!r}"
                )
            if any(isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1 for f in self.schedule):
                raise ValueError(f"sparsevlm: schedule fractions must be in [0, 1], got {self.schedule!r}")
        elif len(layers) != 3:
            raise ValueError(
                f"sparsevlm: the official budgets (tokens=, retention) have three stages, but layers={tuple(layers)} "
                f"has {len(layers)}; give schedule= with one fraction per layer"
            )

    def skip(self) -> bool:
        """Retention 1.0 without explicit budgets keeps every token: nothing runs."""
        return self.schedule is None and self.tokens is None and self.retention is not None and self.retention >= 1

    def targets(self, num_visual: int, num_layers: int) -> list[int]:
        """Visual tokens to keep after each stage for a row of `num_visual` (before the min(k, N - 1) cap)."""
        if self.schedule is not None:
            return [round(f * num_visual) for f in self.schedule]
        if self.tokens is not None or self.retention is None:
            return official_targets(self.tokens or DEFAULT_TOKENS, num_visual)
        targets, mean = retention_targets(self.retention, num_visual, self.layers, num_layers)
        if mean - self.retention > 0.5 / num_visual:
            warnings.warn(
                f"sparsevlm: retention {self.retention:.3g} is below what layers={tuple(self.layers)} can reach on "
                f"this {num_layers}-layer model (layers 0..{self.layers[0]} see every visual token): keeping the "
                f"least, {mean:.1%} of the visual tokens over the layers; use earlier layers or a higher retention",
                RuntimeWarning,
                stacklevel=3,
            )
        return targets

    def depth_error(self, num_layers: int) -> str | None:
        if self.layers[-1] < num_layers - 1:
            return None
        below = tuple(x for x in self.layers if x < num_layers - 1)
        return (
            f"sparsevlm: layers={tuple(self.layers)} prune the output of layer {self.layers[-1]}, so the language "
            f"model needs at least {self.layers[-1] + 2} layers, but it has {num_layers} (0 to {num_layers - 1}); "
            f"choose layers below {num_layers - 1}" + (f" (those of it that fit: {below})" if below else "")
        )

    def prefill(self, llm, ctx):
        if llm.point != "layer_start" or llm.phase != "prefill" or self.skip():
            return
        if llm.layer == 0:
            error = self.depth_error(llm.num_layers)
            if error:
                raise ValueError(error)
            ctx.state["rows"] = self._rate(llm)
        if llm.layer - 1 in self.layers:
            self._prune(llm, ctx, self.layers.index(llm.layer - 1))
        if llm.layer in self.layers:
            llm.request_attention(num_rows="after_visual", upcast=False)
        if llm.layer == llm.num_layers - 1:
            layout = llm.layout
            for b, row in enumerate(ctx.state["rows"]):
                kept = int((layout.visual[b] & layout.valid[b]).sum())
                ctx.report(kept=kept, targets=list(row.targets), raters=int(row.raters.numel()))

    def _rate(self, llm) -> list[RowState]:
        """On the input embeddings: each row's raters (their positions in the prompt) and its budgets."""
        layout, hidden = llm.layout, llm.hidden
        rows = []
        for b in range(hidden.shape[0]):
            visual = torch.nonzero(layout.visual[b] & layout.valid[b]).flatten()
            if visual.numel() == 0:
                rows.append(RowState(layout.index[b, :0], [], 0))
                continue
            slots = torch.arange(layout.valid.shape[1], device=visual.device)
            text = torch.nonzero((slots > visual.max()) & layout.valid[b]).flatten()
            if text.numel() == 0:
                raise ValueError(
                    "sparsevlm rates the visual tokens by the text after them (the question and the chat template), "
                    "but this prompt ends with its video"
                )
            h = hidden[b]
            raters = select_raters(h[visual.to(h.device)], h[text.to(h.device)])
            rows.append(
                RowState(
                    layout.index[b, text[raters.to(text.device)]],
                    self.targets(visual.numel(), llm.num_layers),
                    visual.numel(),
                )
            )
        return rows

    def _prune(self, llm, ctx, stage: int) -> None:
        """At the start of the layer after the pruning layer of `stage`: score by that layer's raters' attention,
        keep, recycle."""
        layout = llm.layout
        attention = llm.attention(self.layers[stage])
        keep = layout.valid & ~layout.visual
        batch, dst, src = [], [], []
        for b, row in enumerate(ctx.state["rows"]):
            visual = torch.nonzero(layout.visual[b] & layout.valid[b]).flatten()
            if visual.numel() == 0:
                continue
            raters = torch.nonzero(torch.isin(layout.index[b], row.raters) & layout.valid[b]).flatten()
            scores = rater_scores(
                attention[b], (raters - visual.max() - 1).to(attention.device), visual.to(attention.device)
            )
            generator = torch.Generator(device="cpu").manual_seed(0)
            plan = plan_stage(scores, llm.hidden[b, visual.to(llm.hidden.device)], row.targets[stage], generator)
            keep[b, visual[plan.survivors().to(visual.device)]] = True
            d, s = (visual[t.to(visual.device)] for t in plan.merges())
            batch.append(torch.full_like(s, b))
            dst.append(d)
            src.append(s)
        survivors = [layout.index[b][keep[b]] for b in range(keep.shape[0])]  # by their position in the prompt
        if batch:
            llm.merge_mean(torch.cat(batch), torch.cat(dst), torch.cat(src))  # drops the folded tokens
        index = llm.layout.index
        llm.keep(torch.stack([torch.isin(index[b], survivors[b]) for b in range(index.shape[0])]) & llm.layout.valid)
