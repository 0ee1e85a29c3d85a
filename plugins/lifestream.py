"""LifeStream: lifecycle-aware visual token selection and hierarchical memory for streaming video.

Source: one abstract (the user's Document 1, "NeurIPS 2026 paper list", ¶13). No paper text and no code are
public, so this module implements the reading of `specs/from-abstracts.md` §1 exactly; every choice the abstract
leaves open is marked [OPEN] here and listed in docs/methods/lifestream.md.

Idea: a query-agnostic, bounded memory of post-projector visual tokens built causally, one frame at a time.
Each spatial position i carries a "run" (consecutive frames whose token at i stays cosine-similar to the previous
frame's, >= tau_life) with a running mean and a length; the run length gives the token's lifecycle state
(emerging: 1, transient: 2 .. L_stable-1, stable: >= L_stable). Per frame:
  - the ceil(rho_frame N) most salient NON-stable tokens go to the archive A (fine-grained memory);
  - a stable run that ends becomes one summary token (its mean, weight = its length) in the global memory G;
  - archive overflow (|A| > B_A) demotes the oldest archive tokens to G;
  - G is compressed progressively (lowest-priority tokens merge, size-weighted, into their most similar
    non-source token) until |G| <= B_G.
At question time the LLM sees G ∪ A (stable runs still open are summarised too), sorted by first frame then
raster position, at most B_A + B_G = budget_tokens tokens. Stage: connect, online (streaming); the plugin glue
lives at the end of this file.

This part is the pure algorithm (no model): `LifeStream` (the method; its fields are the parameters),
`saliency_scores`, `LifecycleMemory` (add_frame / snapshot) and the token-set ops it is built from (`merge_round`,
`compress_global`).

Budget guarantee: after every `add_frame`, |A| <= B_A (overflow demotion) and |G| <= B_G (compression, which
terminates because every round removes r >= 1 tokens and B_G >= 1 leaves a non-source to merge into);
`snapshot` adds the open stable runs to a COPY of G and compresses that copy to B_G again, so its output holds
M <= B_A + B_G = budget_tokens tokens, whatever the number of frames seen.

Dtypes: embedding state (the previous frame, run means, archive and global embeddings) keeps the device and dtype
of the input embeddings; running means and merges are computed in float32 (float64 for float64 inputs:
`torch.promote_types(dtype, float32)`) and cast back. Metadata (run lengths, weights, frame indices, patches,
positions) is int64 and saliency sums / priorities float32, on the same device.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

import vtc
from vtc.core.stream import AnswerPast, concat_kv, kv_bytes
from vtc.core.vision_stats import VisionStat
from vtc_kernels import frame_cosine, topk_mask
from vtc_kernels.matching import best_match
from vtc_kernels.merge import merge_into_anchors

Tensor = torch.Tensor

EMERGING, TRANSIENT, STABLE = 0, 1, 2  # lifecycle states (codes used in tensors)
STATE_NAMES = ("emerging", "transient", "stable")
ARCHIVE, GLOBAL = 0, 1  # `MemoryTokens.kind`
SALIENCY_MODES = ("attention", "norm")


# --- informativeness ----------------------------------------------------------------------------------------------


def saliency_scores(attention_received: Tensor | None, x: Tensor, mode: str = "attention") -> Tensor:
    """Informativeness u of the tokens x [..., N, D] of one frame (or of frames stacked in front), min-max
    normalised over the N tokens of each frame, float32 [..., N].

    "attention": the attention each token receives (e.g. mean over heads and queries at the last vision-encoder
    layer, pooled to the token grid), shape x.shape[:-1]; required. "norm": the token's L2 norm (the fallback for
    encoders run with fused attention). A frame whose raw scores are all equal gets u = 0 everywhere [OPEN]."""
    if mode not in SALIENCY_MODES:
        raise ValueError(f"lifestream: saliency must be one of {', '.join(SALIENCY_MODES)}, got {mode!r}")
    if mode == "attention":
        if attention_received is None:
            raise ValueError(
                "lifestream: saliency='attention' needs the attention each token receives (attention_received); "
                "pass it, or use saliency='norm'"
            )
        if tuple(attention_received.shape) != tuple(x.shape[:-1]):
            raise ValueError(
                f"lifestream: attention_received must have shape {tuple(x.shape[:-1])} (one value per token), "
                f"got {tuple(attention_received.shape)}"
            )
        raw = attention_received.to(device=x.device, dtype=torch.float32)
    else:
        raw = x.float().norm(dim=-1)
    lo = raw.amin(dim=-1, keepdim=True)
    span = raw.amax(dim=-1, keepdim=True) - lo
    flat = span > 0
    return torch.where(flat, (raw - lo) / torch.where(flat, span, torch.ones_like(span)), torch.zeros_like(raw))


# --- token sets and global compression ----------------------------------------------------------------------------


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Running means and merges run in float32 (float64 stays float64), then are cast back."""
    return torch.promote_types(dtype, torch.float32)


@dataclasses.dataclass
class TokenSet:
    """A set of memory tokens (the archive or the global memory), one row per token.

    embeds [n, D] (input dtype), positions [P, n] int64 (the position ids of the earliest member), weight [n] int64
    (frame-tokens represented), first_frame / last_frame [n] int64 (time span, in the caller's t), patch [n] int64
    (raster index of the earliest member), priority [n] float32."""

    embeds: Tensor
    positions: Tensor
    weight: Tensor
    first_frame: Tensor
    last_frame: Tensor
    patch: Tensor
    priority: Tensor

    @staticmethod
    def empty(dim: int, num_axes: int, dtype: torch.dtype, device) -> TokenSet:
        def long():
            return torch.zeros(0, dtype=torch.long, device=device)

        return TokenSet(
            torch.zeros(0, dim, dtype=dtype, device=device),
            torch.zeros(num_axes, 0, dtype=torch.long, device=device),
            long(),
            long(),
            long(),
            long(),
            torch.zeros(0, dtype=torch.float32, device=device),
        )

    def __len__(self) -> int:
        return self.embeds.shape[0]

    def tensors(self) -> list[Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def take(self, index: Tensor) -> TokenSet:
        """The rows `index` (1-D indices), as new tensors."""
        return TokenSet(
            self.embeds[index],
            self.positions[:, index],
            self.weight[index],
            self.first_frame[index],
            self.last_frame[index],
            self.patch[index],
            self.priority[index],
        )

    def cat(self, other: TokenSet) -> TokenSet:
        """self's rows, then other's (new tensors)."""
        return TokenSet(
            torch.cat([self.embeds, other.embeds]),
            torch.cat([self.positions, other.positions], dim=1),
            *(torch.cat([a, b]) for a, b in zip(self.tensors()[2:], other.tensors()[2:])),
        )

    @property
    def nbytes(self) -> int:
        return sum(t.element_size() * t.nelement() for t in self.tensors())


def merge_count(num_tokens: int, budget: int) -> int:
    """Sources of one compression round: r = min(|G| - B_G, ceil(|G| / 2))."""
    return min(num_tokens - budget, math.ceil(num_tokens / 2))


def earliest_order(tokens: TokenSet) -> Tensor:
    """Row indices sorted by (first_frame, patch, row): "earliest member" order, without ties."""
    perm = torch.sort(tokens.patch, stable=True).indices
    return perm[torch.sort(tokens.first_frame[perm], stable=True).indices]


def merge_round(tokens: TokenSet, r: int) -> TokenSet:
    """One round of progressive global compression; returns a new set of len(tokens) - r rows (tokens unchanged).

    Sources: the r lowest-priority rows (ties: lower row first, a stable sort). Each source merges into the non-source
    row most cosine-similar to it (ties: the first such row, `argmax`); a destination may take several sources.
    A destination becomes the size-weighted mean of itself and its sources, (sum w x) / (sum w), computed in float32
    and cast back; weights add; priority = max; time span = union; positions and patch = those of its earliest
    member (smallest (first_frame, patch)). Untouched rows keep their values bit for bit; survivors keep their order.
    """
    n = len(tokens)
    if not 1 <= r < n:
        raise ValueError(f"lifestream: a merge round needs 1 <= r < |G|, got r={r}, |G|={n}")
    device = tokens.embeds.device
    sources = torch.sort(tokens.priority, stable=True).indices[:r]
    is_source = torch.zeros(n, dtype=torch.bool, device=device)
    is_source[sources] = True
    pool = torch.nonzero(~is_source).flatten()
    dtype = compute_dtype(tokens.embeds.dtype)
    # cosine in the compute dtype (F.normalize, eps 1e-12), ties to the first row (argmax)
    slot = best_match(tokens.embeds[sources].to(dtype), tokens.embeds[pool].to(dtype), normalize="eps")[0]
    target = pool[slot]
    embeds = tokens.embeds.clone()
    embeds[pool] = merge_into_anchors(
        tokens.embeds[pool],
        tokens.embeds[sources],
        slot,
        rule="weighted_mean",
        source_weight=tokens.weight[sources],
        anchor_weight=tokens.weight[pool],
    )

    weight = tokens.weight.clone().index_add_(0, target, tokens.weight[sources])
    priority = tokens.priority.scatter_reduce(0, target, tokens.priority[sources], "amax", include_self=True)
    last = tokens.last_frame.scatter_reduce(0, target, tokens.last_frame[sources], "amax", include_self=True)
    order = earliest_order(tokens)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n, device=device)
    member = order[rank.scatter_reduce(0, target, rank[sources], "amin", include_self=True)]

    merged = TokenSet(
        embeds,
        tokens.positions[:, member],
        weight,
        tokens.first_frame[member],
        last,
        tokens.patch[member],
        priority,
    )
    return merged.take(pool)


def compress_global(tokens: TokenSet, budget: int) -> TokenSet:
    """Progressive global compression: merge rounds of r = min(|G| - B_G, ceil(|G| / 2)) sources until
    |G| <= budget. Returns `tokens` itself when already within budget, else a new set."""
    if budget < 1:
        raise ValueError(f"lifestream: the global budget must be >= 1, got {budget}")
    while len(tokens) > budget:
        tokens = merge_round(tokens, merge_count(len(tokens), budget))
    return tokens


# --- the memory ---------------------------------------------------------------------------------------------------


def lifecycle_states(run_length: Tensor, L_stable: int) -> Tensor:
    """State code per position from the run length: EMERGING (1), TRANSIENT (2 .. L_stable-1), STABLE (>= L_stable)."""
    state = torch.full_like(run_length, TRANSIENT)
    state[run_length <= 1] = EMERGING
    state[run_length >= L_stable] = STABLE
    return state


@dataclasses.dataclass
class MemoryTokens:
    """The memory as the LLM receives it at question time: M <= budget_tokens rows sorted by (first_frame, patch,
    kind).

    embeds [M, D] (input dtype); positions [P, M] int64 (original position ids of each token's first frame /
    earliest member); weight [M] int64 (frame-tokens represented: 1 for an archive token, the run length for a
    run summary, the sum for a merged token); first_frame [M] int64 (t of the first frame represented); patch [M]
    int64 (raster index row * w + col of the earliest member); kind [M] int64 (0 archive, 1 global); last_frame
    [M] int64 (t of the last frame represented)."""

    embeds: Tensor
    positions: Tensor
    weight: Tensor
    first_frame: Tensor
    patch: Tensor
    kind: Tensor
    last_frame: Tensor

    def __len__(self) -> int:
        return self.embeds.shape[0]


class LifecycleMemory:
    """LifeStream's streaming memory for one video stream on an h x w token grid (N = h * w tokens per frame).

    `add_frame` runs steps 1-6 of the spec for one frame; `snapshot` (step 7) returns what the LLM sees without
    changing the memory. State: the archive A and the global memory G (`TokenSet`s, the tokens held), plus per
    position the open run: previous frame's token, running mean, length, first frame, first-frame positions and the
    sum of u over the run (bookkeeping, not memory tokens)."""

    def __init__(self, params: LifeStream, hw: tuple[int, int]) -> None:
        h, w = (int(v) for v in hw)
        if h < 1 or w < 1 or (h, w) != tuple(hw):
            raise ValueError(f"lifestream: hw must be two positive integers (grid height, width), got {hw}")
        self.params = params
        self.hw = (h, w)
        self.num_patches = h * w
        self.archive: TokenSet | None = None
        self.global_memory: TokenSet | None = None
        self.previous: Tensor | None = None  # [N, D] the last frame's tokens
        self.run_mean: Tensor | None = None  # [N, D] m_i
        self.run_length: Tensor | None = None  # [N] int64, l_i
        self.run_start: Tensor | None = None  # [N] int64, t of the run's first frame
        self.run_positions: Tensor | None = None  # [P, N] int64, the positions of the run's first frame
        self.run_saliency: Tensor | None = None  # [N] float32, sum of u over the run
        self.last_t: int | None = None
        self._frames = 0

    # -- bookkeeping ---------------------------------------------------------------------------------------------

    @property
    def frames_seen(self) -> int:
        return self._frames

    @property
    def num_tokens(self) -> int:
        """Tokens held now, |A| + |G| (open runs are bookkeeping; `snapshot` may add their summaries, within budget)."""
        if self._frames == 0:
            return 0
        return len(self.archive) + len(self.global_memory)

    def state_tensors(self) -> list[Tensor]:
        """Every tensor the memory holds (archive, global memory and run state)."""
        if self._frames == 0:
            return []
        run = [self.previous, self.run_mean, self.run_length, self.run_start, self.run_positions, self.run_saliency]
        return self.archive.tensors() + self.global_memory.tensors() + run

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the memory holds, run state included."""
        return sum(t.element_size() * t.nelement() for t in self.state_tensors())

    def _check(self, x: Tensor, positions: Tensor, saliency: Tensor, t) -> tuple[Tensor, Tensor, Tensor, int]:
        n = self.num_patches
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[0] != n or not x.is_floating_point():
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"lifestream: x must be a floating tensor [N, D] with N = h*w = {n}, got {shape}")
        if self._frames:
            if x.shape[1] != self.previous.shape[1]:
                raise ValueError(f"lifestream: token dim changed from {self.previous.shape[1]} to {x.shape[1]}")
            if x.dtype != self.previous.dtype or x.device != self.previous.device:
                raise ValueError(
                    f"lifestream: x must keep the memory's dtype/device ({self.previous.dtype}, "
                    f"{self.previous.device}), got ({x.dtype}, {x.device})"
                )
        if not isinstance(positions, Tensor) or positions.dim() != 2 or positions.shape[1] != n:
            shape = tuple(positions.shape) if isinstance(positions, Tensor) else type(positions).__name__
            raise ValueError(f"lifestream: positions must be [P, N] (P = 1 or 3 position axes, N = {n}), got {shape}")
        if positions.is_floating_point() or positions.is_complex():
            raise ValueError(f"lifestream: positions must be integer position ids, got {positions.dtype}")
        if self._frames and positions.shape[0] != self.run_positions.shape[0]:
            raise ValueError(
                f"lifestream: positions have {positions.shape[0]} axes, earlier frames {self.run_positions.shape[0]}"
            )
        if not isinstance(saliency, Tensor) or tuple(saliency.shape) != (n,):
            shape = tuple(saliency.shape) if isinstance(saliency, Tensor) else type(saliency).__name__
            raise ValueError(f"lifestream: saliency must be [N] = [{n}] (see saliency_scores), got {shape}")
        if isinstance(t, bool) or not isinstance(t, int):
            if not (isinstance(t, Tensor) and t.numel() == 1 and not t.is_floating_point()):
                raise ValueError(f"lifestream: t must be an integer frame index/time, got {t!r}")
        t = int(t)
        if self.last_t is not None and t <= self.last_t:
            raise ValueError(f"lifestream: frames must arrive in time order, got t={t} after t={self.last_t}")
        return x, positions.to(device=x.device, dtype=torch.long), saliency.to(x.device, torch.float32), t

    def _run_summaries(self, mask: Tensor) -> TokenSet:
        """One summary token per position in `mask` (raster order): the run's mean, weight = its length, priority =
        beta_stable * mean(u over the run), span [run start, last frame], positions of the run's first frame."""
        idx = torch.nonzero(mask).flatten()
        length = self.run_length[idx]
        return TokenSet(
            self.run_mean[idx],
            self.run_positions[:, idx],
            length,
            self.run_start[idx],
            torch.full_like(length, self.last_t),
            idx,
            float(self.params.beta_stable) * self.run_saliency[idx] / length.to(torch.float32),
        )

    # -- the algorithm -------------------------------------------------------------------------------------------

    def add_frame(self, x: Tensor, positions: Tensor, saliency: Tensor, t: int) -> None:
        """Take frame t: x [N, D] its tokens (raster order), positions [P, N] their original position ids (P = 1 for
        1-D RoPE, 3 for M-RoPE), saliency [N] its informativeness u (`saliency_scores`, used as given), t its frame
        index or time (strictly increasing). Runs steps 1-6; afterwards |A| <= B_A and |G| <= B_G."""
        x, positions, u, t = self._check(x, positions, saliency, t)
        p = self.params
        n, device = self.num_patches, x.device
        if self._frames == 0:
            self.archive = TokenSet.empty(x.shape[1], positions.shape[0], x.dtype, device)
            self.global_memory = TokenSet.empty(x.shape[1], positions.shape[0], x.dtype, device)
            self.run_length = torch.zeros(n, dtype=torch.long, device=device)
            continues = torch.zeros(n, dtype=torch.bool, device=device)  # first frame: every position is a birth
        else:
            # 1. lifecycle: s = cos(x_t,i, x_t-1,i) (computed in float32, eps 1e-8); s >= tau continues the run
            dtype = compute_dtype(x.dtype)
            s = frame_cosine(x.to(dtype), self.previous.to(dtype), normalize="none", formula="torch")
            continues = s >= float(p.tau_life)

        # 4. a stable run that ends ("death") becomes a summary token of the global memory
        summaries = self._run_summaries(~continues & (self.run_length >= p.L_stable)) if self._frames else None

        # 1. continue (l += 1, m += (x - m) / l) or start a new run (l = 1, m = x)
        length = torch.where(continues, self.run_length + 1, torch.ones_like(self.run_length))
        if self._frames:
            dtype = compute_dtype(x.dtype)
            mean = self.run_mean.to(dtype)
            mean = mean + (x.to(dtype) - mean) / length[:, None].to(dtype)
            self.run_mean = torch.where(continues[:, None], mean.to(x.dtype), x)
            self.run_saliency = torch.where(continues, self.run_saliency + u, u)
            self.run_start = torch.where(continues, self.run_start, torch.full_like(self.run_start, t))
            self.run_positions = torch.where(continues[None], self.run_positions, positions)
        else:
            self.run_mean = x.clone()
            self.run_saliency = u.clone()
            self.run_start = torch.full((n,), t, dtype=torch.long, device=device)
            self.run_positions = positions.clone()
        self.run_length = length
        self.previous = x.clone()
        self.last_t = t
        self._frames += 1

        # 2-3. archive: the k_frame most salient non-stable tokens (raster order within the frame)
        state = lifecycle_states(length, p.L_stable)
        chosen = topk_mask(u, p.frame_quota(n), candidates=state != STABLE)
        idx = torch.nonzero(chosen).flatten()
        new = TokenSet(
            x[idx],
            positions[:, idx],
            torch.ones_like(idx),
            torch.full_like(idx, t),
            torch.full_like(idx, t),
            idx,
            p.betas(device)[state[idx]] * u[idx],  # the priority it will have if demoted: beta_state * u
        )
        archive = self.archive.cat(new)

        # 5. overflow: the oldest archive tokens (earliest t, then raster) move to the global memory, weight 1
        excess = max(0, len(archive) - p.archive_budget)
        order = torch.arange(len(archive), device=device)
        demoted = archive.take(order[:excess])
        self.archive = archive.take(order[excess:])

        # 6. progressive global compression
        incoming = demoted if summaries is None else summaries.cat(demoted)
        self.global_memory = compress_global(self.global_memory.cat(incoming), p.global_budget)

    def snapshot(self) -> MemoryTokens:
        """Step 7, question time: G ∪ A as the LLM sees it, sorted by (first_frame, patch, kind), M <= budget_tokens.

        Stable runs still open (length >= L_stable) are summarised into a copy of G, which is compressed to B_G
        again; open runs shorter than L_stable are not emitted [OPEN] (they are non-stable, so their informative
        tokens are already in the archive). The memory is not changed: asking again gives the same tokens."""
        if self._frames == 0:
            empty = [torch.zeros(0, dtype=torch.long) for _ in range(5)]
            return MemoryTokens(torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.long), *empty)
        p = self.params
        open_runs = self._run_summaries(self.run_length >= p.L_stable)
        glob = compress_global(self.global_memory.cat(open_runs), p.global_budget)
        both = self.archive.cat(glob)
        device = both.embeds.device
        kind = torch.cat(
            [
                torch.full((len(self.archive),), ARCHIVE, dtype=torch.long, device=device),
                torch.full((len(glob),), GLOBAL, dtype=torch.long, device=device),
            ]
        )
        order = earliest_order(both)  # (first_frame, patch, row): archive rows come first, so kind breaks ties
        return MemoryTokens(
            both.embeds[order],
            both.positions[:, order],
            both.weight[order],
            both.first_frame[order],
            both.patch[order],
            kind[order],
            both.last_frame[order],
        )


# --- vtc.stream glue ---


class LifeStreamMemory:
    """LifeStream as a `vtc.stream` memory: each frame's tokens go through `LifecycleMemory`; a question prefills
    the snapshot (G ∪ A, at most `budget_tokens` tokens) after the prompt's prefix, so the question's TTFT is the
    prefill of a bounded memory and does not grow with the stream.

    Positions: every memory token keeps the stream position of its first frame's token (a merged token: its
    earliest member's). Qwen3-VL's DeepStack features are not kept for memory tokens (merged tokens have none in
    the model), so on Qwen3-VL the memory tokens enter the LLM without them [vtc choice]."""

    name = "lifestream"

    def __init__(self, params: LifeStream, config) -> None:
        self.params = params
        self.config = config
        self.budget_tokens = params.budget_tokens
        self.llm = None
        self.prefix_kv = None
        self.memory: LifecycleMemory | None = None

    def start(self, llm, prefix) -> None:
        self.llm = llm
        self.prefix_kv = llm.forward(prefix.embeds, prefix.positions).kv

    def append(self, segment) -> None:
        x = segment.embeds[segment.visual]
        positions = segment.positions[:, segment.visual.to(segment.positions.device)]
        frames = segment.frame[segment.visual]
        saliency = segment.extras.get("lifestream_saliency")
        if saliency is None:
            raise RuntimeError(
                "lifestream: the chunk reached the memory without its saliency (run lifestream's connect)"
            )
        for frame in torch.unique(frames).tolist():
            rows = torch.nonzero(frames == frame).flatten()
            if self.memory is None:
                self.memory = LifecycleMemory(self.params, segment.grid[1:])
            if rows.numel() != self.memory.hw[0] * self.memory.hw[1]:
                raise RuntimeError(
                    f"lifestream needs every token of each frame ({self.memory.hw[0]}x{self.memory.hw[1]}), got "
                    f"{rows.numel()}: put no token-reducing method after it"
                )
            dev = x.device
            self.memory.add_frame(x[rows.to(dev)], positions[:, rows], saliency[rows.to(saliency.device)], int(frame))

    def answer_past(self, question):
        start = time.perf_counter()
        tokens = self.memory.snapshot()
        out = self.llm.forward(tokens.embeds, tokens.positions, self.prefix_kv)
        kv = concat_kv(self.prefix_kv, out.kv)
        return AnswerPast(kv, retrieved_tokens=len(tokens), seconds=time.perf_counter() - start)

    @property
    def stored_tokens(self) -> int:
        return self.memory.num_tokens if self.memory is not None else 0

    @property
    def nbytes(self) -> int:
        return kv_bytes(self.prefix_kv) + (self.memory.nbytes if self.memory is not None else 0)


RECEIVED = VisionStat("received", -1)


@vtc.method(
    "lifestream",
    paper="LifeStream (NeurIPS 2026 submission; abstract only)",
    summary="lifecycle states per position: informative non-stable tokens in an archive, runs summarised "
    "into a compressed global memory, under a token budget (streaming)",
)
class LifeStream(vtc.StreamMemoryMethod):
    """Its connect hook scores each token's informativeness (saliency) and passes every token on; its memory
    (`stream_memory`, `LifecycleMemory`) does the selection. No official code (specs/from-abstracts.md §1)."""

    temporal = True  # a stream of frames: videos only

    tau_life: float = vtc.param(
        0.9, range="[-1, 1]", doc="a run continues while cos(x_t,i, x_t-1,i) >= tau_life [OPEN: StreamingTOM CTR]"
    )
    L_stable: int = vtc.param(3, range="[2, inf)", doc="run length (frames) from which a token is 'stable' [OPEN]")
    rho_frame: float = vtc.param(
        0.2, range="[0, 1]", doc="archive quota per frame: ceil(rho_frame * N) non-stable tokens [OPEN: '> 80%']"
    )
    budget_tokens: int = vtc.param(
        6272, range="[1, inf)", doc="memory size B = B_A + B_G [OPEN: 32 x 196, LLaVA-OV's 32-frame budget]"
    )
    global_fraction: float = vtc.param(0.25, range="(0, 1]", doc="B_G = round(global_fraction * B) [OPEN]")
    beta_emerging: float = vtc.param(
        1.0, range="[0, inf)", doc="priority factor of demoted emerging archive tokens [OPEN]"
    )
    beta_transient: float = vtc.param(
        1.0, range="[0, inf)", doc="priority factor of demoted transient archive tokens [OPEN]"
    )
    beta_stable: float = vtc.param(
        0.5, range="[0, inf)", doc="priority factor of stable-run summaries: long-lived content merges first [OPEN]"
    )
    saliency: str = vtc.param(
        "attention",
        choices=SALIENCY_MODES,
        doc="informativeness u: 'attention' (received, last encoder layer) or 'norm' [OPEN]",
    )

    whole_frames = True
    streams = True
    stream_only = True
    requires = frozenset({"streaming"})  # vtc.stream encodes chunk by chunk (`vtc.core.families`)

    def validate(self) -> None:
        if self.global_budget < 1:
            raise ValueError(
                f"lifestream: the global memory needs at least one token, but round(global_fraction * budget_tokens)"
                f" = round({self.global_fraction} * {self.budget_tokens}) = 0; raise global_fraction or budget_tokens"
            )

    @property
    def global_budget(self) -> int:
        """B_G = round(global_fraction * budget_tokens) (Python's round: halves to even)."""
        return round(float(self.global_fraction) * int(self.budget_tokens))

    @property
    def archive_budget(self) -> int:
        """B_A = budget_tokens - B_G."""
        return int(self.budget_tokens) - self.global_budget

    def frame_quota(self, num_tokens: int) -> int:
        """k_frame = ceil(rho_frame * N); the product is rounded to 9 decimals first so that float noise
        (0.1 * 30 = 3.0000000000000004) does not add a token."""
        return min(num_tokens, math.ceil(round(float(self.rho_frame) * num_tokens, 9)))

    def betas(self, device=None) -> Tensor:
        """[3] float32: beta per lifecycle state code (EMERGING, TRANSIENT, STABLE)."""
        values = [self.beta_emerging, self.beta_transient, self.beta_stable]
        return torch.tensor(values, dtype=torch.float32, device=device)

    def bind(self, retention: float | None) -> LifeStream:
        if retention is not None:
            raise ValueError(
                "lifestream is sized by budget_tokens (the memory's tokens), not by retention: "
                "vtc.stream(model, processor, 'lifestream', budget_tokens=...)"
            )
        return super().bind(retention)

    def vision_stats(self, family: str) -> list[VisionStat]:
        return [RECEIVED] if self.saliency == "attention" else []

    def connect(self, tokens, ctx):
        t, h, w = tokens.grid
        frames = tokens.frame
        attention = None
        if self.saliency == "attention":
            received = ctx.vision[RECEIVED]
            attention = ctx.geometry.to_token_grid(received.float(), (h, w)).to(tokens.embeds.device)[
                frames, tokens.patch
            ]
        scores = torch.empty(len(tokens), dtype=torch.float32, device=tokens.embeds.device)
        for f in torch.unique(frames).tolist():
            rows = frames == f
            scores[rows] = saliency_scores(
                attention[rows] if attention is not None else None, tokens.embeds[rows], self.saliency
            )
        tokens.extras["lifestream_saliency"] = scores
        return tokens

    def stream_memory(self, config) -> LifeStreamMemory:
        budget = config.budget_tokens if config.budget_tokens is not None else self.budget_tokens
        return LifeStreamMemory(dataclasses.replace(self, budget_tokens=budget), config)
