"""STTM: "Multi-Granular Spatio-Temporal Token Merging for Training-Free Acceleration of Video LLMs" (Hyun et al.,
ICCV 2025). arXiv: https://arxiv.org/abs/2507.07990. Official code: HYUNJS/STTM at 00736c79 (2025-07-26):
`token_merging_utils/quadtree_builder.py` (`quadtree_build_video`, `quadtree_build_iteration_video`),
`token_merging_utils/quadtree_spatial_merger.py` (`avgpool_to_even_side_feature`, `pool_to_even_side_index_video`),
`token_merging_utils/quadtree_temporal_merger.py` (`cross_frame_node_merging_fast`: `get_cross_frame_node_pairs_fast`,
`filter_cross_frame_node_pairs`, `get_merge_dst_idx_safe`, `agg_feature_and_metadata`), the merge before decoder
layer `sa_start_layer_idx` in `token_merging_monkey_patch/quadtree_attn_monkey_patch.py` (LLaVA-Video / OneVision)
and `token_merging_qwen2vl_monkey_patch/quadtree_attn_monkey_patch.py` (Qwen2-VL), thresholds in
`scripts/eval/run_vidqa.sh`.

The idea: (1) per frame, a quadtree over the token grid, searched coarse to fine: a node stays one token (its
children's average) when every child's cosine with it reaches tau_S, otherwise it splits; (2) across consecutive
frames, nodes whose boxes contain one another and whose cosine reaches tau_T are joined, and every connected
chain becomes one token (the mean of its nodes) at its earliest, top-left node. The count follows the content;
nothing reads the question, so the compressed KV cache of a video serves every question about it.

Stages: `sttm` (this module's `STTM`) merges where the official code does, on the hidden states entering LLM layer
`layer` = 2 (layers 0 and 1 see and cache every token); `sttm-connect` (`STTMConnect`) runs the same algorithm on
the embeddings before the LLM, which is the official code at `sa_start_layer_idx 0` (its LLaVA-Video-72B
configuration) and what a server can run.

Where vtc differs from the official code (docs/methods/sttm.md has the list):
- the stop test of a node compares it with its valid children only; the official code also compares the nodes of
  the 1-wide top row / left column of an odd-sided level with the level's child (0, 0) (its unused child slots
  keep the zero coordinates they were allocated with);
- temporal chains are the connected components of the kept pairs; the official vectorised union-find stops as
  soon as its label map is idempotent, which can leave a node paired with an already relabelled node on its own
  (two small nodes contained in one node of the next frame: the second one stays apart, unless another chain of
  the video needed more iterations);
- positions: a merged token keeps the original position of its top-left cell, as the official Qwen2-VL patch
  does (the official LLaVA patch renumbers the tokens from the merge layer on);
- the mean of a temporal chain is accumulated in float32 (the official `index_add_` sums in the model dtype);
- grids the official code cannot build (a 1 x 1 grid never ends its pyramid loop; a side of 2, or a root level
  beyond the pyramid, is an index error) merge what the pyramid allows; batches, several videos per prompt and
  images (one frame: the quadtree alone) are handled item by item (the official code takes one video, batch 1);
- on Qwen3-VL, `sttm` gives a merged token its anchor's DeepStack feature (the LLM state has no weighted merge of
  side features); `sttm-connect` merges them with the tokens' weights;
- `retention`: the official code reaches a budget by tuning (tau_S, tau_T) per dataset; with a retention and no
  explicit threshold, vtc shifts both official thresholds by one offset, searched per video, to keep the count
  nearest round(r * N) (`thresholds_for_count`); `sttm-connect` with `fixed_count=True` then adds vtc's
  exact-count step (`exact_count_plan`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
import torch.nn.functional as F

import vtc
from vtc.core.bases import fraction_count
from vtc.core.families import get_family

Tensor = torch.Tensor

# run_vidqa.sh, Video-MME at the 50 % budget (`--sa_tree_thresh`, `--sa_tree_temporal_thresh`): tau_S = 0.85 for
# every 7B model at layer 2; tau_T 0.60 for Qwen2-VL-7B (M-RoPE families take it) and 0.55 for LLaVA-Video-7B (the
# paper's main model; 1-D RoPE families take it; LLaVA-OneVision-7B's row is 0.65)
DEFAULT_TAU_S = 0.85
DEFAULT_TAU_T = {"mrope": 0.60, "rope": 0.55}
# the only configuration merging at layer 0 (LLaVA-Video-72B, Video-MME, 50 %): what `sttm-connect` defaults to
INPUT_TAU_S, INPUT_TAU_T = 0.94, 0.82
DEFAULT_BUDGET = 0.5  # the paper's main budget; `sttm-connect` keeps it with fixed_count and no retention
SEARCH_STEPS = 24  # bisection steps of the threshold offset (over [-2, 2]: 2.4e-7 apart at the end)


# --- the quadtree ----------------------------------------------------------------------------------------------------
def pyramid_sizes(height: int, width: int) -> list[tuple[int, int]]:
    """The official level sizes, coarse to fine: from the grid by repeated ceil(/2) until a side is 2 (14 x 14 ->
    [2 x 2, 4 x 4, 7 x 7, 14 x 14]). A 1 x 1 grid, where the official loop never ends, is its own only level."""
    sizes = [(height, width)]
    while height != 2 and width != 2 and (height, width) != (1, 1):
        height, width = math.ceil(height / 2), math.ceil(width / 2)
        sizes.insert(0, (height, width))
    return sizes


def pool_to_even_side(x: Tensor) -> Tensor:
    """The official `avgpool_to_even_side_feature` on [T, C, h, w] -> [T, C, ceil(h/2), ceil(w/2)]: 2 x 2 average
    pooling, where an odd side pools its first row (column) as a 1-wide strip and the corner (0, 0) alone. Written
    with the official operations (so equal to the bit); sides of 1 are allowed."""
    t, c, h, w = x.shape
    if h % 2 == 0 and w % 2 == 0:
        return F.avg_pool2d(x, 2)
    out = x.new_empty(t, c, math.ceil(h / 2), math.ceil(w / 2))
    top, left = h % 2, w % 2  # the 1-wide strips: row 0 (odd h), column 0 (odd w)
    if top and left:
        out[:, :, 0, 0] = x[:, :, 0, 0]
    if top and w > left:
        out[:, :, 0, left:] = x[:, :, 0, left:].reshape(t, c, -1, 2).mean(dim=-1)
    if left and h > top:
        out[:, :, top:, 0] = x[:, :, top:, 0].reshape(t, c, -1, 2).mean(dim=-1)
    if h > top and w > left:
        out[:, :, top:, left:] = F.avg_pool2d(x[:, :, top:, left:], 2)
    return out


def children_of(size: int, device=None) -> tuple[Tensor, Tensor]:
    """For a side of `size` cells pooled to ceil(size/2): the first and second child of each coarse cell (the
    second equals the first where a coarse cell has one child: cell 0 of an odd side)."""
    coarse = torch.arange(math.ceil(size / 2), device=device)
    if size % 2 == 0:
        return 2 * coarse, 2 * coarse + 1
    return (2 * coarse - 1).clamp(min=0), 2 * coarse


def parent_of(size: int, device=None) -> Tensor:
    """The coarse cell holding each of `size` cells (even side: c // 2; odd side: (c + 1) // 2)."""
    cells = torch.arange(size, device=device)
    return cells // 2 if size % 2 == 0 else (cells + 1) // 2


@dataclasses.dataclass
class Pyramid:
    """What the quadtree search of one video needs, for any tau_S.

    features: per level (coarse to fine) [T, h_l, w_l, C], the official average-pooled features (input dtype);
    split_score: per level but the finest, [T, h_l, w_l] float32: the smallest cosine between a node and its valid
        children (the node stays one token when it reaches tau_S);
    rows / cols: per level, [H] / [W]: the level's row (column) holding each row (column) of the grid;
    children: per level but the finest, [h_l, w_l]: how many children a node has (1, 2 or 4).
    """

    features: list[Tensor]
    split_score: list[Tensor]
    rows: list[Tensor]
    cols: list[Tensor]
    children: list[Tensor]

    @property
    def grid(self) -> tuple[int, int, int]:
        t, h, w, _ = self.features[-1].shape
        return t, h, w


def build_pyramid(x: Tensor, root_level: int = 1, valid_children_only: bool = True) -> Pyramid:
    """The levels of the official quadtree on x [T, H, W, C] (one video's tokens, raster order), from the level
    `root_level` of `pyramid_sizes` (clamped to the finest) down to the grid.

    `valid_children_only=False` reproduces the official stop test, which also compares a node of a 1-wide strip of an
    odd-sided level with the child (0, 0) of its frame (see the module docstring); vtc uses True."""
    t, h, w, c = x.shape
    device = x.device
    sizes = pyramid_sizes(h, w)
    steps = max(len(sizes) - 1 - root_level, 0)
    features = [x.permute(0, 3, 1, 2)]
    for _ in range(steps):
        features.insert(0, pool_to_even_side(features[0]))
    features = [f.permute(0, 2, 3, 1) for f in features]
    rows = [torch.arange(h, device=device)]
    cols = [torch.arange(w, device=device)]
    split_score, children = [], []
    for level in range(steps - 1, -1, -1):  # from the finest transition up
        parent, child = features[level], features[level + 1]
        ch, cw = child.shape[1:3]
        r1, r2 = children_of(ch, device)
        c1, c2 = children_of(cw, device)
        rows.insert(0, parent_of(ch, device)[rows[0]])
        cols.insert(0, parent_of(cw, device)[cols[0]])
        if valid_children_only:
            slots = [child[:, r][:, :, q] for r in (r1, r2) for q in (c1, c2)]
        else:  # the official slots: an unused slot of a strip node holds the zero coordinates -> child (0, 0)
            slots = _official_slots(child, ch, cw)
        pf = parent.float()
        cos = torch.stack([F.cosine_similarity(pf, s.float(), dim=-1) for s in slots])
        split_score.insert(0, cos.amin(dim=0))
        children.insert(0, ((r2 != r1).long() + 1)[:, None] * ((c2 != c1).long() + 1)[None, :])
    return Pyramid(features, split_score, rows, cols, children)


def _official_slots(child: Tensor, ch: int, cw: int) -> list[Tensor]:
    """The four child slots of every node as `pool_to_even_side_index_video` fills them: slot (dy, dx) of a node
    whose row (column) has one child points at row (column) 0 of the level, not at the node's own child."""
    device = child.device
    r1, r2 = children_of(ch, device)
    c1, c2 = children_of(cw, device)
    one_row, one_col = r1 == r2, c1 == c2
    slots = []
    for dy, rr in ((0, r1), (1, r2)):
        for dx, cc in ((0, c1), (1, c2)):
            # a slot is filled when the node has that child in both directions; the others stay (0, 0)
            filled = (~one_row[:, None] if dy else torch.ones_like(one_row)[:, None]) & (
                ~one_col[None, :] if dx else torch.ones_like(one_col)[None, :]
            )
            feat = child[:, rr][:, :, cc]
            slots.append(torch.where(filled[None, :, :, None], feat, child[:, :1, :1]))
    return slots


@dataclasses.dataclass
class Plan:
    """STTM's result on one video of N = T * H * W tokens (cells, raster order), K output tokens.

    anchors [K]: the cell whose place (and position) each output token takes: the top-left cell of its earliest node,
        ascending (the official output order);
    group [N]: the output token each cell went into;
    weight [N] float32: the cell's share of its output token (node average pooling, then the mean of the chain's
        nodes): output = sum of weight * cell over the group, for side features that follow the tokens;
    features [K, C]: the merged features, computed as the official code does (pooled nodes, then the chain mean);
    nodes: tokens after the spatial quadtree, before temporal merging.
    """

    anchors: Tensor
    group: Tensor
    weight: Tensor
    features: Tensor
    nodes: int

    def __len__(self) -> int:
        return int(self.anchors.numel())


@dataclasses.dataclass
class Nodes:
    """The quadtree leaves of one video at one tau_S, sorted as the official code sorts them (by the raster index of
    their top-left cell): `features` [M, C], `anchor` [M] (top-left cell), `of_cell` [T, H * W] (the leaf holding
    each cell), `level_of_cell` [T, H, W]."""

    features: Tensor
    anchor: Tensor
    of_cell: Tensor
    level_of_cell: Tensor

    def __len__(self) -> int:
        return int(self.anchor.numel())


def quadtree_nodes(pyramid: Pyramid, tau_s: float) -> Nodes:
    """The leaves of the coarse-to-fine search at tau_S: a node is a leaf when it is reached (no ancestor is a leaf)
    and its split score reaches tau_S; a reached node of the finest level is always a leaf."""
    t, h, w = pyramid.grid
    levels = len(pyramid.features)
    device = pyramid.features[-1].device
    level_of_cell = torch.full((t, h, w), levels - 1, dtype=torch.long, device=device)
    key = torch.empty(t, h, w, dtype=torch.long, device=device)
    decided = torch.zeros(t, h, w, dtype=torch.bool, device=device)
    tt = torch.arange(t, device=device)[:, None, None]
    offsets = []
    offset = 0
    for level in range(levels):
        lh, lw = pyramid.features[level].shape[1:3]
        r, c = pyramid.rows[level][None, :, None], pyramid.cols[level][None, None, :]
        if level < levels - 1:
            stop = (pyramid.split_score[level] >= tau_s)[tt, r, c]
        else:
            stop = torch.ones(t, h, w, dtype=torch.bool, device=device)
        new = stop & ~decided
        level_of_cell = torch.where(new, level, level_of_cell)
        key = torch.where(new, offset + (tt * lh + r) * lw + c, key)
        decided |= stop
        offsets.append(offset)
        offset += t * lh * lw
    unique, inverse = torch.unique(key.flatten(), return_inverse=True)
    anchor = torch.full((unique.numel(),), t * h * w, dtype=torch.long, device=device)
    anchor = anchor.scatter_reduce(0, inverse, torch.arange(t * h * w, device=device), reduce="amin")
    order = torch.argsort(anchor)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=device)
    keys = unique[order]
    # each leaf's feature: its pooled feature at its level (keys are offset + flat index within the level)
    bounds = torch.tensor(offsets[1:], device=device)
    node_level = torch.bucketize(keys, bounds, right=True)
    c = pyramid.features[-1].shape[-1]
    features = pyramid.features[-1].new_empty(keys.numel(), c)
    for level in range(levels):
        sel = node_level == level
        if bool(sel.any()):
            features[sel] = pyramid.features[level].reshape(-1, c)[keys[sel] - offsets[level]]
    return Nodes(features, anchor[order], rank[inverse].view(t, h * w), level_of_cell)


def temporal_pairs(of_cell: Tensor) -> Tensor:
    """[L, 2] (node of frame t, node of frame t + 1) whose boxes contain one another: quadtree cells of one pyramid
    are nested or disjoint, so these are the node pairs sharing a cell (the official containment test over all
    pairs of consecutive frames gives the same set)."""
    if of_cell.shape[0] < 2:
        return of_cell.new_zeros(0, 2)
    cur, nxt = of_cell[:-1].flatten(), of_cell[1:].flatten()
    m = int(of_cell.max()) + 1
    keys = torch.unique(cur * m + nxt)
    return torch.stack([keys // m, keys % m], dim=1)


def spatial_pairs(of_cell: Tensor, grid: tuple[int, int, int]) -> Tensor:
    """[L, 2] distinct nodes of one frame holding horizontally or vertically adjacent cells (smaller index first)."""
    t, h, w = grid
    cells = of_cell.view(t, h, w)
    a = torch.cat([cells[:, :, :-1].flatten(), cells[:, :-1, :].flatten()])
    b = torch.cat([cells[:, :, 1:].flatten(), cells[:, 1:, :].flatten()])
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    distinct = lo != hi
    m = int(of_cell.max()) + 1
    keys = torch.unique(lo[distinct] * m + hi[distinct])
    return torch.stack([keys // m, keys % m], dim=1)


def pair_similarity(features: Tensor, pairs: Tensor) -> Tensor:
    """The official `filter_cross_frame_node_pairs` cosine: float32, x / (|x| + 1e-8), dot product."""
    x = features.float()
    unit = x / (x.norm(dim=-1, keepdim=True) + 1e-8)
    return (unit[pairs[:, 0]] * unit[pairs[:, 1]]).sum(dim=-1)


def union_min(pairs: Tensor, n: int) -> Tensor:
    """[n] the smallest node index of each node's connected component under `pairs` [L, 2]: the official scatter-min
    and pointer-jumping union-find, iterated until every pair agrees (the official loop stops once the labels are
    idempotent, see the module docstring)."""
    rep = torch.arange(n, device=pairs.device)
    if pairs.numel() == 0:
        return rep
    a, b = pairs[:, 0], pairs[:, 1]
    while True:
        low = torch.minimum(rep[a], rep[b])
        rep = rep.scatter_reduce(0, a, low, reduce="amin").scatter_reduce(0, b, low, reduce="amin")
        rep = rep[rep]
        if torch.equal(rep[a], rep[b]) and torch.equal(rep, rep[rep]):
            return rep


def components(pyramid: Pyramid, tau_s: float, tau_t: float | None) -> tuple[Nodes, Tensor]:
    """The quadtree leaves at tau_S and each leaf's representative (the smallest leaf of its temporal chain at tau_T;
    itself when tau_T is None)."""
    nodes = quadtree_nodes(pyramid, tau_s)
    if tau_t is None:
        return nodes, torch.arange(len(nodes), device=nodes.anchor.device)
    pairs = temporal_pairs(nodes.of_cell)
    if pairs.numel():
        pairs = pairs[pair_similarity(nodes.features, pairs) >= tau_t]
    return nodes, union_min(pairs, len(nodes))


def merge_plan(pyramid: Pyramid, tau_s: float, tau_t: float | None) -> Plan:
    """STTM on one video at (tau_S, tau_T); tau_T None: spatial merging only (the official tau_T <= 0)."""
    return make_plan(pyramid, *components(pyramid, tau_s, tau_t))


def make_plan(pyramid: Pyramid, nodes: Nodes, rep: Tensor) -> Plan:
    """The plan of `nodes` joined into the components `rep` [M] (each node's representative node): the official
    `agg_feature_and_metadata` (the mean of a component's node features, the representative's place)."""
    t, h, w = pyramid.grid
    reps, group_of_node, sizes = torch.unique(rep, return_inverse=True, return_counts=True)
    x = nodes.features
    total = torch.zeros(reps.numel(), x.shape[-1], dtype=torch.float32, device=x.device)
    total.index_add_(0, group_of_node, x.float())
    features = (total / sizes[:, None]).to(x.dtype)
    group = group_of_node[nodes.of_cell.flatten()]
    # a cell's share: 1 / children at every level from its leaf's level to the finest, then 1 / nodes of its chain
    weight = torch.ones(t, h, w, dtype=torch.float32, device=x.device)
    for level, count in enumerate(pyramid.children):
        share = count[pyramid.rows[level][:, None], pyramid.cols[level][None, :]].float()
        weight = torch.where(nodes.level_of_cell <= level, weight / share, weight)
    weight = weight.flatten() / sizes[group].float()
    return Plan(nodes.anchor[reps], group, weight, features, len(nodes))


# --- counts ----------------------------------------------------------------------------------------------------------
def merged_count(pyramid: Pyramid, tau_s: float, tau_t: float | None) -> int:
    """Tokens STTM leaves at (tau_S, tau_T)."""
    _, rep = components(pyramid, tau_s, tau_t)
    return int(torch.unique(rep).numel())


def bracket_offset(
    pyramid: Pyramid, target: int, tau_s: float, tau_t: float, steps: int = SEARCH_STEPS
) -> tuple[float, int, float, int]:
    """(d_lo, n_lo, d_hi, n_hi): offsets of both thresholds with n_lo < target <= n_hi tokens, by bisection over
    [-2, 2] (the count grows with the offset: at +2 nothing merges, at -2 every node of the root level merges across
    the whole video); d_lo = d_hi = -2 when even that keeps `target` or more."""
    lo, hi = -2.0, 2.0
    n_lo = merged_count(pyramid, tau_s + lo, tau_t + lo)
    if n_lo >= target:
        return lo, n_lo, lo, n_lo
    n_hi = merged_count(pyramid, tau_s + hi, tau_t + hi)
    for _ in range(steps):
        if n_hi == target:
            break
        mid = (lo + hi) / 2
        n_mid = merged_count(pyramid, tau_s + mid, tau_t + mid)
        if n_mid >= target:
            hi, n_hi = mid, n_mid
        else:
            lo, n_lo = mid, n_mid
    return lo, n_lo, hi, n_hi


def thresholds_for_count(pyramid: Pyramid, target: int, tau_s: float, tau_t: float) -> tuple[float, float, bool]:
    """(tau_S + d, tau_T + d, reachable): the common offset d whose STTM count is nearest `target` (on a tie the
    larger count); `reachable` is False when every offset keeps more than `target`."""
    lo, n_lo, hi, n_hi = bracket_offset(pyramid, target, tau_s, tau_t)
    if lo == hi:
        return tau_s + lo, tau_t + lo, n_lo == target
    d = lo if target - n_lo < n_hi - target else hi
    return tau_s + d, tau_t + d, True


def exact_count_plan(pyramid: Pyramid, target: int, tau_s: float, tau_t: float) -> tuple[Plan, float, float]:
    """vtc's fixed-count form (not the paper's): STTM at the offset thresholds with the fewest tokens still >= `target`
    (`bracket_offset`'s upper end), then more joins until exactly `target` tokens remain: first the temporal pairs
    below tau_T, then the nodes of a frame holding adjacent cells, each kind in decreasing cosine of the two nodes
    (Kruskal: a join of two chains removes exactly one token), so any target >= 1 is met exactly. Returns the plan
    and the offset thresholds it started from."""
    _, _, d, _ = bracket_offset(pyramid, target, tau_s, tau_t)
    nodes = quadtree_nodes(pyramid, tau_s + d)
    pairs = temporal_pairs(nodes.of_cell)
    sim = pair_similarity(nodes.features, pairs)
    joined = sim >= tau_t + d
    rep = union_min(pairs[joined], len(nodes))
    if int(torch.unique(rep).numel()) > target:
        spatial = spatial_pairs(nodes.of_cell, pyramid.grid)
        more = [(pairs[~joined], sim[~joined]), (spatial, pair_similarity(nodes.features, spatial))]
        rep = join_until(rep, more, target)
    return make_plan(pyramid, nodes, rep), tau_s + d, tau_t + d


def join_until(rep: Tensor, candidates: list[tuple[Tensor, Tensor]], target: int) -> Tensor:
    """Join components along candidate pairs (each list taken in decreasing similarity, ties in list order) until
    `target` components remain; a component keeps its smallest node as representative."""
    parent = rep.tolist()

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    count = len({find(i) for i in range(len(parent))})
    for pairs, sim in candidates:
        order = torch.sort(sim, descending=True, stable=True).indices
        for a, b in pairs[order].tolist():
            if count <= target:
                break
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
                count -= 1
    return torch.tensor([find(i) for i in range(len(parent))], device=rep.device)


def rope_kind(family: str | None) -> str:
    """ "mrope" for a family with M-RoPE (the official Qwen2-VL setting), else "rope" (its LLaVA setting)."""
    return "mrope" if family is not None and "mrope" in get_family(family).features else "rope"


def check_whole_video(frame: Tensor, patch: Tensor, grid: tuple[int, int, int], where: str) -> None:
    """Refuse a video that does not arrive whole, in raster order: the quadtree is built on whole frames."""
    t, h, w = grid
    cells = frame * h * w + patch
    if cells.numel() != t * h * w or not torch.equal(cells.cpu(), torch.arange(t * h * w)):
        raise RuntimeError(
            f"{where}: a video of grid {grid} arrives with {cells.numel()} of its {t * h * w} tokens (or out of raster "
            "order); STTM builds its quadtree on whole frames, so no method may drop its tokens before it"
        )


# --- the methods -----------------------------------------------------------------------------------------------------
class _Thresholds:
    """What `sttm` and `sttm-connect` share: the parameters tau_s, tau_t, root_level, and the choice of thresholds."""

    def defaults(self, family: str | None) -> tuple[float, float]:
        """The official (tau_S, tau_T) of the method's stage for `family`."""
        return DEFAULT_TAU_S, DEFAULT_TAU_T[rope_kind(family)]

    def thresholds(self, family: str | None) -> tuple[float, float]:
        """(tau_S, tau_T): the parameters, else the defaults."""
        base_s, base_t = self.defaults(family)
        return (base_s if self.tau_s is None else self.tau_s), (base_t if self.tau_t is None else self.tau_t)

    def budget(self) -> float | None:
        """The fraction the thresholds are searched for: the retention when no threshold is given, else None (the
        thresholds rule)."""
        if self.tau_s is not None or self.tau_t is not None:
            return None
        return self.retention

    def skip(self) -> bool:
        """At retention 1 (and no threshold given) nothing merges: the model runs unchanged."""
        budget = self.budget()
        return budget is not None and budget >= 1.0

    def video_plan(self, x: Tensor, family: str | None, target: int | None = None) -> tuple[Plan, float, float | None]:
        """STTM on one video x [T, H, W, C] -> (plan, tau_S, tau_T it used). `target`: exactly that many tokens
        (`exact_count_plan`); else the retention's search, or the thresholds as they are."""
        tau_s, tau_t = self.thresholds(family)
        pyramid = build_pyramid(x, self.root_level)
        if target is not None:
            return exact_count_plan(pyramid, target, tau_s, tau_t)
        budget = self.budget()
        if budget is not None:
            n = x.shape[0] * x.shape[1] * x.shape[2]
            tau_s, tau_t, reachable = thresholds_for_count(pyramid, fraction_count(n, budget), tau_s, tau_t)
            if not reachable:
                warnings.warn(
                    f"{type(self).card.name}: retention {budget:.3g} is below what STTM can merge a video of grid "
                    f"{tuple(x.shape[:3])} to (its root level, joined across all frames); it keeps that floor",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return merge_plan(pyramid, tau_s, tau_t), tau_s, tau_t
        temporal = tau_t if tau_t > 0 else None  # the official switch: tau_T <= 0 turns temporal merging off
        return merge_plan(pyramid, tau_s, temporal), tau_s, temporal


THRESHOLD_DOC = "; with a retention and neither threshold given, both are shifted by one offset per video"


@vtc.method(
    "sttm",
    paper="Multi-Granular Spatio-Temporal Token Merging for Training-Free Acceleration of Video LLMs (ICCV 2025)",
    url="https://arxiv.org/abs/2507.07990",
    summary="at LLM layer 2: per-frame quadtree merging (coarse-to-fine, cosine tau_S), then chains of nested nodes "
    "across frames (cosine tau_T) merged; query-agnostic",
    retention_note="adaptive: the thresholds decide the count; with a retention (and no threshold given) vtc searches "
    "one offset of both thresholds per video for the count nearest r * N (steps of a quadtree node)",
    retention_granularity=3,  # a node joining its 4 children removes 3 tokens at once
)
class STTM(_Thresholds, vtc.Method):
    """STTM where the official code runs it: on the hidden states entering decoder layer `layer` (official:
    HYUNJS/STTM `quadtree_attn_monkey_patch.py`, `quadtree_builder.py`, `quadtree_temporal_merger.py`)."""

    tau_s: float | None = vtc.param(
        None,
        range="[-1, 1]",
        doc="tau_S (--sa_tree_thresh): None = 0.85 (run_vidqa.sh, Video-MME 50 %)" + THRESHOLD_DOC,
    )
    tau_t: float | None = vtc.param(
        None,
        range="[-1, 1]",
        doc="tau_T (--sa_tree_temporal_thresh), <= 0 turns temporal merging off: None = 0.60 on Qwen (M-RoPE), "
        "0.55 on LLaVA (Video-MME 50 % rows)" + THRESHOLD_DOC,
    )
    root_level: int = vtc.param(1, range="[0, inf)", doc="--sa_tree_root_level: the search starts at this level")
    layer: int = vtc.param(2, range="[0, inf)", doc="--sa_start_layer_idx: merge before this decoder layer")

    retention_reference = "last_layer"  # every layer from `layer` on keeps the merged tokens (the paper's budget)

    def prefill(self, llm, ctx):
        if llm.point != "layer_start":
            return
        if llm.layer == 0 and self.layer >= llm.num_layers:
            raise ValueError(
                f"sttm: merge before layer {self.layer} but the language model has only {llm.num_layers} layers"
            )
        if llm.layer != self.layer:
            return
        layout = llm.layout
        if self.skip():
            for b in range(layout.valid.shape[0]):
                ctx.report(kept=int((layout.visual[b] & layout.valid[b]).sum()))
            return
        hidden = llm.hidden.clone()
        keep = layout.valid & ~layout.visual
        for b in range(hidden.shape[0]):
            kept, used = 0, []
            for v, slots in layout.video_slots(b).items():
                grid = llm.grids[b][v]
                check_whole_video(layout.frame[b, slots], layout.patch[b, slots], grid, f"sttm at layer {self.layer}")
                x = hidden[b, slots.to(hidden.device)].view(*grid, -1)
                plan, tau_s, tau_t = self.video_plan(x, llm.family)
                anchors = slots[plan.anchors.to(slots.device)]
                hidden[b, anchors.to(hidden.device)] = plan.features
                keep[b, anchors.to(keep.device)] = True
                kept += len(plan)
                used.append((tau_s, tau_t))
            ctx.report(kept=kept, thresholds=used)
        llm.replace_hidden(hidden)
        llm.keep(keep)


@vtc.method(
    "sttm-connect",
    paper="STTM variant (vtc): the official merge at layer 0, on the embeddings before the LLM",
    url="https://arxiv.org/abs/2507.07990",
    summary="STTM on the embeddings before the LLM (the official layer-0 setting): quadtree per frame, then "
    "nested-node chains across frames; what a server runs",
    retention_note="adaptive as sttm (thresholds searched per video for r * N); fixed_count=True keeps exactly "
    "round(r * N) (vtc's extra joins after the searched thresholds)",
    retention_granularity=3,
    exempt={"retention": "adaptive count (steps of a quadtree node); fixed_count=True is checked instead"},
)
class STTMConnect(_Thresholds, vtc.TokenMerger):
    """STTM on the LLM's input embeddings (official `sa_start_layer_idx 0`, run_vidqa.sh's LLaVA-Video-72B rows)."""

    tau_s: float | None = vtc.param(
        None, range="[-1, 1]", doc="tau_S: None = 0.94 (run_vidqa.sh, layer 0, Video-MME 50 %)" + THRESHOLD_DOC
    )
    tau_t: float | None = vtc.param(
        None, range="[-1, 1]", doc="tau_T, <= 0 turns temporal merging off: None = 0.82 (layer 0)" + THRESHOLD_DOC
    )
    root_level: int = vtc.param(1, range="[0, inf)", doc="--sa_tree_root_level: the search starts at this level")
    fixed_count: bool = vtc.param(
        False, doc="keep exactly round(r * N) (r: the retention, else 0.5): vtc's exact-count form (serving)"
    )

    whole_frames = True
    positions = "compact"  # the official LLaVA code at layer 0 renumbers (Qwen families always keep positions)

    def defaults(self, family):
        return INPUT_TAU_S, INPUT_TAU_T

    def retained_count(self, num_tokens, grid, family):
        if not self.fixed_count:
            return None
        return fraction_count(num_tokens, self.retention if self.retention is not None else DEFAULT_BUDGET)

    def skip(self) -> bool:
        if self.fixed_count:
            return self.retention is not None and self.retention >= 1.0
        return super().skip()

    def plan(self, tokens, ctx):
        if self.skip():
            return None
        grid = tokens.grid
        check_whole_video(tokens.frame, tokens.patch, grid, "sttm-connect")
        target = self.retained_count(len(tokens), grid, ctx.family)
        plan, tau_s, tau_t = self.video_plan(tokens.embeds.reshape(*grid, -1), ctx.family, target)
        ctx.report(kept=len(plan), thresholds=(tau_s, tau_t))
        members = torch.arange(len(tokens), device=plan.group.device)
        is_anchor = torch.zeros(len(tokens), dtype=torch.bool, device=members.device)
        is_anchor[plan.anchors] = True
        src = members[~is_anchor]
        return vtc.Merge(
            keep=plan.anchors,
            dst=plan.group[src],
            src=src,
            src_weight=plan.weight[src],
            keep_weight=plan.weight[plan.anchors],
            embeds=plan.features,
        )
