"""StreamingAssistant / MSSAVT: "Maximum Similarity to Spatially Adjacent Video Tokens" with masked pruning
("StreamingAssistant: Efficient Visual Token Pruning for Accelerating Online Video Understanding", arXiv 2025).

No public code (the abstract: "Our full implementation will be made publicly available"); this is the reading of
`specs/from-abstracts.md` §4 (with the MSSAVT formula of `specs/methods-b.md` B3). Every choice the abstract leaves
open is marked [OPEN] here and in `docs/methods/mssavt.md`.

Per frame (in temporal order; Qwen: one temporal group on the merged-token grid), keeping k = max(1, round(rho H W)):
  1. temporal step: prune the tokens whose cosine to the same position of the previous frame exceeds tau_t, most
     similar first, at most H W - k of them (the first frame of a video has no previous frame and skips it);
  2. MSSAVT: R_i = max cosine of token i to its alive 4-neighbours on the original grid (-inf when it has none);
  3. masked pruning rounds while more than k tokens are alive: candidates = alive tokens whose R is a strict local
     maximum among their alive 4-neighbours (pairwise non-adjacent), prune the min(#candidates, alive - k) with the
     highest R, recompute R, repeat.
Survivors keep their original order and positions. Stage: connect (post-projector, post-pool features; no question,
no attention). The count is fixed (k per frame), so the method serves on vLLM.

[OPEN] choices (defaults; see the docs page for the reasons):
  * temporal rule = same-position cosine to the previous frame (DyCoke-TTM / StreamingTOM-CTR style, causal);
  * cosine = `F.normalize` (eps 1e-12) then dot, in float32 (float64 inputs stay float64): zero vectors give 0,
    never NaN; scores are not computed in bf16 (rankings would tie too often);
  * ties: among exactly equal scores the lower linear (raster) index is pruned first, in every step (the temporal
    step: an exact copy of the previous frame keeps its last k positions; the local-maximum test: the lower index
    wins an exact tie with a neighbour, so the candidates stay pairwise non-adjacent);
  * a pruned token has R = -inf (so does an alive token without an alive neighbour): R is never NaN;
  * `mask="local_max"` (default) or `"checkerboard"` (round r: the alive tokens with finite R and (row + col) % 2 ==
    r % 2, starting with the parity of the top-left token). Read literally (prune min(#candidates, alive - k) per
    round), the checkerboard degenerates: round 0 either meets the budget or prunes every even cell that has an
    alive neighbour, which leaves every odd cell isolated, so round 1 never has a candidate and the rest goes
    through the isolated fallback;
  * isolated fallback: when more than k tokens are alive but none has an alive 4-neighbour (every R = -inf, which
    the temporal step or earlier rounds can cause), the abstract's rule "a token with no alive neighbour is never
    pruned" cannot meet the fixed count k. Then one token per round is pruned: the alive token with the highest
    cosine to any other alive token of the frame (lower index on ties), recomputed after each removal, until k
    remain;
  * previous frame across calls: the last frame's original embeddings are kept in
    `ctx.state[("previous", ctx.video_index)]`; vtc gives every prompt a fresh state (so two videos of a batch, and
    two prompts, never mix), while a stream that keeps one state across consecutive chunks of a video compares each
    chunk's first frame with the previous chunk's last frame. A stored frame of another grid size is ignored.

Termination of the rounds: the candidate order (R, then lower index) is a strict total order on the alive tokens, so
the alive token with a finite R that is greatest in it beats all its alive neighbours (neighbours with R = -inf lose
to any finite R) and is a candidate. A round therefore prunes at least one token whenever some alive token has a
finite R; in checkerboard mode too, since an alive token with finite R has an alive neighbour, of the other parity,
whose R is then finite as well, so both parities hold a candidate. Otherwise every alive token is isolated and the
fallback prunes exactly one. Pruning never exceeds alive - k, so a frame ends with exactly k tokens after at most
H W - k rounds.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import vtc
from vtc_kernels import frame_cosine

Tensor = torch.Tensor

DEFAULT_RHO = 0.25  # [OPEN] the common 25 % retention comparison point
MASKS = ("local_max", "checkerboard")


def keep_per_frame(tokens_per_frame: int, rho: float) -> int:
    """k = max(1, round(rho * H W)) (round half to even), at most H W."""
    return max(1, min(int(tokens_per_frame), round(float(rho) * int(tokens_per_frame))))


# --- the algorithm, on one frame (x [N, D] in raster order of an H x W grid) -----------------------------------------


def _work(x: Tensor) -> Tensor:
    """Scores are computed in float32 (float64 inputs stay float64)."""
    return x if x.dtype == torch.float64 else x.float()


def _cos(a: Tensor, b: Tensor) -> Tensor:
    return frame_cosine(_work(a), _work(b), normalize="eps", formula="dot")


def _check_frame(x: Tensor, grid_hw: tuple[int, int]) -> tuple[int, int]:
    h, w = (int(v) for v in grid_hw)
    if x.dim() != 2 or x.shape[0] != h * w:
        raise ValueError(f"mssavt: a frame of grid {h}x{w} needs x of shape [{h * w}, D], got {tuple(x.shape)}")
    return h, w


def _descending(scores: Tensor, limit: int) -> Tensor:
    """Positions of the `limit` highest scores, highest first, the lower position first on exact ties."""
    return torch.sort(scores, descending=True, stable=True).indices[: max(0, int(limit))]


def temporal_prune(x: Tensor, previous: Tensor | None, keep: int, tau: float) -> Tensor:
    """Step 1 on one frame: alive mask [N]. Tokens whose cosine to the same position of `previous` [N, D] exceeds
    `tau` are pruned, the most similar first (lower index first on exact ties), at most N - keep of them. With
    `previous` None (the first frame) nothing is pruned."""
    n = x.shape[0]
    alive = torch.ones(n, dtype=torch.bool, device=x.device)
    if previous is None or keep >= n:
        return alive
    if previous.shape != x.shape:
        raise ValueError(f"mssavt: previous frame {tuple(previous.shape)} and frame {tuple(x.shape)} differ in shape")
    sim = _cos(x, previous.to(x.device))
    over = torch.nonzero(sim > tau).flatten()  # ascending, so ties keep index order
    over = over[_descending(sim[over], n - max(int(keep), 0))]
    alive[over] = False
    return alive


def _pair_similarity(x: Tensor, grid_hw: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Cosine of every pair of 4-adjacent tokens: (right [H, W-1]: (r, c)-(r, c+1), down [H-1, W]: (r, c)-(r+1, c)).
    Computed once per frame: pruning changes which pairs count, not their similarity."""
    h, w = _check_frame(x, grid_hw)
    g = x.reshape(h, w, -1)
    return _cos(g[:, :-1], g[:, 1:]), _cos(g[:-1], g[1:])


def _scores(right: Tensor, down: Tensor, alive: Tensor) -> Tensor:
    """R [H, W] from the pair similarities and the alive mask [H, W]: max over alive 4-neighbours, -inf for tokens
    with no alive neighbour and for pruned tokens."""
    ninf = torch.tensor(-math.inf, dtype=right.dtype, device=right.device)
    r = torch.full(alive.shape, -math.inf, dtype=right.dtype, device=right.device)
    horizontal = torch.where(alive[:, :-1] & alive[:, 1:], right, ninf)
    r[:, :-1] = torch.maximum(r[:, :-1], horizontal)
    r[:, 1:] = torch.maximum(r[:, 1:], horizontal)
    vertical = torch.where(alive[:-1] & alive[1:], down, ninf)
    r[:-1] = torch.maximum(r[:-1], vertical)
    r[1:] = torch.maximum(r[1:], vertical)
    return r


def mssavt_scores(x: Tensor, alive: Tensor, grid_hw: tuple[int, int]) -> Tensor:
    """MSSAVT redundancy R [N] of one frame: the maximum cosine of each token to its alive 4-neighbours on the
    original H x W grid (out-of-grid and pruned neighbours ignored). -inf for an alive token with no alive neighbour
    and for every pruned token (a sentinel that never wins a maximum; R is never NaN)."""
    h, w = _check_frame(x, grid_hw)
    right, down = _pair_similarity(x, (h, w))
    return _scores(right, down, alive.to(x.device).view(h, w)).flatten()


def _local_max(r: Tensor, alive: Tensor) -> Tensor:
    """Alive tokens with finite R that beat every alive 4-neighbour in the order (R, then lower linear index):
    strictly greater than the left and upper neighbours (lower indices), at least equal to the right and lower
    ones. Pruned neighbours have R = -inf and always lose."""
    pad = F.pad(r, (1, 1, 1, 1), value=-math.inf)
    up, below, left, right = pad[:-2, 1:-1], pad[2:, 1:-1], pad[1:-1, :-2], pad[1:-1, 2:]
    return alive & torch.isfinite(r) & (r > up) & (r > left) & (r >= right) & (r >= below)


def _isolated_fallback(x: Tensor, alive_flat: Tensor) -> Tensor:
    """[OPEN] The token to prune when every alive token is isolated: the highest cosine to any other alive token of
    the frame, lower index on ties. Returns a 1-element index tensor."""
    idx = torch.nonzero(alive_flat).flatten()
    xn = F.normalize(_work(x[idx]), dim=-1)
    sim = xn @ xn.T
    # a matmul need not give (i, j) and (j, i) the same last bit (it does not with AVX-512 kernels); two tokens that
    # are each other's best match must tie exactly, so the lower index wins as the rule says
    sim = torch.maximum(sim, sim.T)
    sim.fill_diagonal_(-math.inf)
    return idx[torch.argmax(sim.max(dim=1).values)].view(1)  # argmax: the first maximal value


def prune_rounds(
    x: Tensor, alive: Tensor, grid_hw: tuple[int, int], keep: int, mask: str = "local_max"
) -> list[Tensor]:
    """Step 3 on one frame, round by round: the linear indices pruned in each round (ascending), starting from the
    alive mask [N], until `keep` tokens are alive. A fallback round (every alive token isolated) prunes one."""
    if mask not in MASKS:
        raise ValueError(f"mssavt: mask must be one of {', '.join(repr(m) for m in MASKS)}, got {mask!r}")
    h, w = _check_frame(x, grid_hw)
    right, down = _pair_similarity(x, (h, w))
    alive = alive.to(x.device, torch.bool).clone().view(h, w)
    flat = alive.view(-1)
    parity = None
    if mask == "checkerboard":
        rows = torch.arange(h, device=x.device)[:, None]
        cols = torch.arange(w, device=x.device)[None, :]
        parity = (rows + cols) % 2
    rounds: list[Tensor] = []
    count = int(flat.sum())
    keep = max(1, int(keep))
    while count > keep:
        r = _scores(right, down, alive)
        if parity is None:
            candidates = _local_max(r, alive)
        else:
            candidates = alive & torch.isfinite(r) & (parity == len(rounds) % 2)
        pool = torch.nonzero(candidates.view(-1)).flatten()
        if pool.numel():
            pruned = torch.sort(pool[_descending(r.view(-1)[pool], count - keep)]).values
        else:  # every alive token is isolated (see the module docstring)
            pruned = _isolated_fallback(x, flat)
        flat[pruned] = False
        count -= pruned.numel()
        rounds.append(pruned)
    return rounds


def masked_prune(x: Tensor, alive: Tensor, grid_hw: tuple[int, int], keep: int, mask: str = "local_max") -> Tensor:
    """Steps 2-3 on one frame: the alive mask [N] after the masked pruning rounds (exactly `keep` alive when more
    were alive, else `alive` unchanged)."""
    out = alive.to(x.device, torch.bool).clone()
    for pruned in prune_rounds(x, alive, grid_hw, keep, mask):
        out[pruned] = False
    return out


def mssavt_frame(
    x: Tensor,
    previous: Tensor | None,
    grid_hw: tuple[int, int],
    keep: int,
    tau: float = 0.9,
    mask: str = "local_max",
) -> Tensor:
    """MSSAVT on one frame x [N, D] (raster order of the H x W grid `grid_hw`), `previous` [N, D] the previous
    frame's original embeddings (None: first frame): the indices of the `keep` survivors, ascending."""
    h, w = _check_frame(x, grid_hw)
    n = h * w
    if keep >= n:
        return torch.arange(n, device=x.device)
    alive = temporal_prune(x, previous, keep, tau)
    alive = masked_prune(x, alive, (h, w), keep, mask)
    return torch.nonzero(alive).flatten()


# --- the method -------------------------------------------------------------------------------------------------


@vtc.method(
    "mssavt",
    paper="StreamingAssistant (MSSAVT), arXiv 2025",
    url="",  # no arXiv id confirmed (specs/methods-b.md B3 cites 2512.12560 from a third-party page)
    summary="per frame: drop tokens like the previous frame's, then prune mutually non-adjacent tokens most "
    "similar to an alive 4-neighbour, in rounds, to k per frame",
    test_params={"tau_t": 0.9, "mask": "local_max"},
)
class MSSAVT(vtc.Method):
    """Temporal step, then MSSAVT masked pruning, k tokens per frame (no public code: specs/from-abstracts.md §4).

    Not a `TokenSelector`: it reads whole frames (and checks it gets them) and keeps the previous frame in
    `ctx.state` on every call, also when it keeps every token."""

    temporal = True  # its temporal step compares each frame with the previous one: videos only

    rho: float | None = vtc.param(
        None, range="(0, 1]", doc="fraction of each frame's tokens kept; default: the retention, else 0.25"
    )
    tau_t: float = vtc.param(
        0.9,
        range="[-1, 1]",
        doc="temporal step: prune tokens with same-position cosine > tau_t ([OPEN] StreamingTOM CTR)",
    )
    mask: str = vtc.param(
        "local_max", choices=MASKS, doc='masked pruning: "local_max" (strict local maxima of R) or "checkerboard"'
    )

    whole_frames = True
    streams = True  # causal: each frame reads only the previous one, kept in ctx.state across chunks

    def fraction(self) -> float:
        """rho: the parameter, else this method's share of the retention, else 0.25."""
        if self.rho is not None:
            return self.rho
        return self.retention if self.retention is not None else DEFAULT_RHO

    def retained_count(self, num_tokens, grid, family):
        """T k: k = max(1, round(rho H W)) tokens in each of the num_tokens / (H W) whole frames (T on a full grid)."""
        _, h, w = (int(v) for v in grid)
        return (int(num_tokens) // (h * w)) * keep_per_frame(h * w, self.fraction())

    def connect(self, tokens, ctx):
        if len(tokens) == 0:
            return tokens
        _, idx = tokens.whole_frames("mssavt")  # [F, H W]: the token at every cell of each frame, raster order
        _, h, w = tokens.grid
        k = keep_per_frame(h * w, self.fraction())
        key = ("previous", ctx.video_index)
        previous = ctx.state.get(key)
        kept, temporal = [], []
        x = None
        for cells in idx:
            x = tokens.embeds[cells]
            prev = previous.to(x.device) if previous is not None and previous.shape == x.shape else None
            if k >= h * w:
                kept.append(cells)
            else:
                alive = temporal_prune(x, prev, k, self.tau_t)
                temporal.append(int((~alive).sum()))
                alive = masked_prune(x, alive, (h, w), k, self.mask)
                kept.append(cells[alive])
            previous = x
        ctx.state[key] = x.detach().clone()  # the last frame, unpruned: the next chunk of a stream compares to it
        keep = torch.sort(torch.cat(kept)).values
        if keep.numel() == len(tokens):
            return tokens
        ctx.report(temporal_pruned=temporal)  # per frame: tokens the temporal step removed
        return tokens.select(keep)
