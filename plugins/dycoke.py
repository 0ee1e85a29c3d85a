"""DyCoke: "Dynamic Compression of Tokens for Fast Video Large Language Models" (Tao et al., CVPR 2025).
arXiv: https://arxiv.org/abs/2411.15024. Official code: KD-TAO/DyCoke (`llava/model/llava_arch.py::dycole_ttm`,
`llava/model/language_model/modeling_qwen2.py::PrunableDynamicCache`, `llava_qwen.py`, lmms-eval wrapper
`lmms_eval/models/llava_onevision.py`).

Two stages. (1) Temporal token merging (TTM), before the LLM: frames are taken in pairs, frame 2p+1 keeps only
its int((1 - k) N) tokens least similar to its partner; a second pass over groups of four frames replaces frame
i+2 by its tokens least similar to frame i. (2) Dynamic KV-cache pruning, at every decode step: the head-mean
attention of the new token at layer L-1 over the video tokens is compared (cosine) with the previous step's;
when it changed (< 0.9) layers >= L attend only to the top (1 - P) video tokens for this step.
Stages: connect (TTM) + prefill hook acting during decoding (KV pruning; prefill itself is never pruned).

Faithful to the official code at its latest commit (35cc532, "Update ttm code"; defaults of the lmms-eval
wrapper: k = 0.7, L = 3, P = 0.8): each pair ranked by its own similarity (`similarities[i // 2]`), kept tokens
of a reduced frame in ascending-similarity order (not spatial), the second pass's loop bound F - 4 (the last
group of four is left alone), an odd last frame left out, the image span one token short of the TTM output
(`image_token_length = len - 1`), the decode-time softmax in the model dtype, a full cache on steps whose
attention is stable (the pruned set is never reused). The first commit (26dc6f4) ranked pair p by pair p-1's
similarity; `shifted_pairs=True` reproduces that superseded rule. vtc differences: the previous step's
attention is reset at every prefill (the official code carries it over from the previous sample); batches (the
official code is batch 1); fewer than 2 frames, or fewer than 5, work (the official code crashes); frames an
earlier plugin thinned are aligned by spatial patch.

Retention r sets the prompt's visual tokens: TTM keeps round(r N) of a video's N tokens (within one token per
reduced frame) by choosing how many tokens each reduced frame keeps; `k` (the paper's merging ratio) overrides
it. TTM never reduces frames 0, 4, 8, ... (nor the first frame of the last group of four), so it cannot go
below their share (1/4 and more; 1/2 for a 4-frame grid): a lower retention keeps that floor, with a warning.
r = 1 turns both stages off.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn.functional as F

import vtc
from vtc_kernels import frame_cosine

Tensor = torch.Tensor

DEFAULT_K = 0.7  # lmms-eval `dycoke_k` (the builder's own default, 0.3, is always overridden by it)
DEFAULT_P = 0.8  # lmms-eval `dycoke_p` (the README example uses 0.7)
PAPER = "DyCoke: Dynamic Compression of Tokens for Fast Video Large Language Models (CVPR 2025)"
URL = "https://arxiv.org/abs/2411.15024"
ORDER_EXEMPTION = {"ordered_positions": "official order: a reduced frame's tokens by ascending similarity, not space"}


# --- temporal token merging -----------------------------------------------------------------------------------


def ttm_roles(num_frames: int, drop_unpaired_frame: bool = True) -> list[str]:
    """What TTM does to each frame of a video: "full" (kept whole), "reduced" (keeps int((1 - k) n) tokens) or
    "dropped" (an odd last frame, left out by the official pair loop)."""
    roles = ["full"] * num_frames
    if num_frames < 2:
        return roles
    for f in range(1, num_frames - num_frames % 2, 2):
        roles[f] = "reduced"
    if num_frames % 2 and drop_unpaired_frame:
        roles[-1] = "dropped"
    for i in range(0, num_frames - 4, 4):
        roles[i + 2] = "reduced"
    return roles


def merging_ratio_for(
    retention: float, num_frames: int, tokens_per_frame: int, drop_unpaired_frame: bool = True
) -> tuple[float, bool]:
    """The k that makes TTM keep round(retention * T * n) tokens of a full T x n grid, within one token per reduced
    frame, and whether that count is reachable (False: below the floor of the never-reduced frames, so k = 1,
    reduced frames emptied). k is placed half a token inside its step so int((1 - k) n) is exactly the count
    chosen."""
    roles = ttm_roles(num_frames, drop_unpaired_frame)
    full, reduced = roles.count("full"), roles.count("reduced")
    if reduced == 0:
        return 0.0, retention >= full / max(num_frames, 1)
    target = round(retention * num_frames * tokens_per_frame)
    per_frame = round((target - full * tokens_per_frame) / reduced)
    reachable = per_frame >= 0
    per_frame = max(0, min(tokens_per_frame, per_frame))
    if per_frame >= tokens_per_frame:
        return 0.0, True
    return 1.0 - (per_frame + 0.5) / tokens_per_frame, reachable


def ttm_frame_counts(num_frames: int, tokens_per_frame: int, k: float, drop_unpaired_frame: bool = True) -> list[int]:
    """Tokens TTM keeps of each frame of a full grid (F frames of N tokens), as the official loops decide."""
    n = tokens_per_frame
    if k <= 0.0 or num_frames < 2:
        return [n] * num_frames
    reduced = int((1.0 - k) * n)  # official: merging_ratio = 1 - merging_ratio; int(merging_ratio * N)
    size = {"full": n, "reduced": reduced, "dropped": 0}
    return [size[role] for role in ttm_roles(num_frames, drop_unpaired_frame)]


def _pair_similarity(a: Tensor, b: Tensor, pa: Tensor, pb: Tensor, normalize: bool) -> Tensor:
    """Cosine between two frames at each spatial patch: a, b [..., N, D] (one frame pair, or a batch of pairs),
    presence pa, pb [..., N]. The official first pass L2-normalises before `cosine_similarity`, the second does
    not (kept for bit-faithfulness). A patch only the second frame has ranks as least similar (-inf); one it
    lacks can never be kept (+inf)."""
    sim = frame_cosine(a, b, normalize="eps" if normalize else "none", formula="torch")
    sim = sim.masked_fill(pb & ~pa, float("-inf"))
    return sim.masked_fill(~pb, float("inf"))


def ttm_keep(
    x: Tensor,
    k: float,
    present: Tensor | None = None,
    shifted_pairs: bool = False,
    drop_unpaired_frame: bool = True,
) -> list[Tensor]:
    """DyCoke's TTM on one video. x [F, N, D] (frames x patches), present [F, N] bool (None: full grid).

    Returns, per frame, the kept patch indices in the order the LLM sees them: every present patch in spatial
    order for a fully kept frame; the int((1 - k) * count) least-similar patches in ascending-similarity order
    (`topk(largest=False)`) for a reduced frame; nothing for a dropped unpaired last frame.
    """
    num_frames, n, _ = x.shape
    if present is None:
        present = torch.ones(num_frames, n, dtype=torch.bool, device=x.device)
    patches = torch.arange(n, device=x.device)
    out = [patches[present[f]] for f in range(num_frames)]
    if k <= 0.0 or num_frames < 2:
        return out
    keep_ratio = 1.0 - k

    def least_similar(sim: Tensor, f: int) -> Tensor:
        sim = sim.masked_fill(~present[f], float("inf"))
        count = int(keep_ratio * int(present[f].sum()))
        return sim.topk(count, largest=False).indices

    # first pass: pairs (2p, 2p+1); frame 2p+1 keeps its least-similar tokens
    pairs = num_frames // 2
    # every pair in one call ([pairs, N]); the cosine is row-wise, so each row equals the per-pair call's
    even, odd = slice(0, 2 * pairs, 2), slice(1, 2 * pairs, 2)
    sims = _pair_similarity(x[even], x[odd], present[even], present[odd], normalize=True)
    for p in range(pairs):
        # official (latest) `similarities[i // 2]` with i = 2p: the pair's own; the first commit's `(i - 2) // 2`
        # took pair p - 1, and Python's -1 (the last pair) for p = 0
        ranking = sims[(p - 1) % pairs] if shifted_pairs else sims[p]
        out[2 * p + 1] = least_similar(ranking, 2 * p + 1)
    if num_frames % 2 and drop_unpaired_frame:
        out[-1] = patches[:0]
    # second pass: groups of four, frame i+2 keeps its tokens least similar to frame i; bound F - 4 as official
    if num_frames > 4:
        first, third = slice(0, num_frames - 4, 4), slice(2, num_frames - 2, 4)
        second = _pair_similarity(x[first], x[third], present[first], present[third], normalize=False)
        for j, i in enumerate(range(0, num_frames - 4, 4)):
            out[i + 2] = least_similar(second[j], i + 2)
    return out


def ttm_select(
    embeds: Tensor,
    frame: Tensor,
    patch: Tensor,
    tokens_per_frame: int,
    k: float,
    shifted_pairs: bool = False,
    drop_unpaired_frame: bool = True,
) -> Tensor:
    """TTM on a video's token list: embeds [n, D], frame [n], patch [n] (row * W + col). Frames are the distinct
    `frame` values in temporal order; tokens are aligned across frames by patch. Returns indices into the
    list, frame by frame, in the order `ttm_keep` gives."""
    frames = torch.unique(frame, sorted=True)
    num_frames, dim = frames.numel(), embeds.shape[-1]
    fi = torch.searchsorted(frames, frame)
    flat = fi * tokens_per_frame + patch
    if torch.unique(flat).numel() != flat.numel():
        raise ValueError("dycoke: two tokens of one frame share a spatial patch; TTM aligns frames by patch")
    dense = embeds.new_zeros(num_frames * tokens_per_frame, dim)
    dense[flat] = embeds
    present = torch.zeros(num_frames * tokens_per_frame, dtype=torch.bool, device=embeds.device)
    present[flat] = True
    lookup = torch.full((num_frames * tokens_per_frame,), -1, dtype=torch.long, device=embeds.device)
    lookup[flat] = torch.arange(flat.numel(), device=embeds.device)
    kept = ttm_keep(
        dense.view(num_frames, tokens_per_frame, dim),
        k,
        present.view(num_frames, tokens_per_frame),
        shifted_pairs,
        drop_unpaired_frame,
    )
    lookup = lookup.view(num_frames, tokens_per_frame)
    return torch.cat([lookup[f, kept[f]] for f in range(num_frames)])


# --- dynamic KV-cache pruning ---------------------------------------------------------------------------------


def kv_prune(
    attention: Tensor, previous: Tensor | None, p: float, threshold: float = 0.9
) -> tuple[Tensor | None, float]:
    """One decode step's decision for one sequence. attention [m]: head-mean attention of the new token over
    the image span at layer L-1; previous [m] or None: the last step's. Returns (kept, similarity): kept =
    indices of the int(m * (1 - p)) most attended image tokens (`topk(sorted=False)` order) when similarity <
    threshold, else None (the whole cache, the official behaviour on stable steps)."""
    if previous is None or previous.shape != attention.shape:
        similarity = 0.0  # official: no previous attention -> similarity 0 -> prune
    else:
        similarity = float(F.cosine_similarity(attention, previous, dim=0))
    if not similarity < threshold:
        return None, similarity
    count = int(attention.numel() * (1 - p))
    return torch.topk(attention, count, sorted=False).indices, similarity


def image_span(layout, exclude_last_token: bool = True) -> Tensor:
    """[B, n] slots of the official image span: the video tokens, without the last one of each video when
    `exclude_last_token` (the official `image_token_length = len(ttm_output) - 1`)."""
    span = layout.visual & layout.valid
    if not exclude_last_token or not bool(span.any()):
        return span
    span = span.clone()
    slots = torch.arange(span.shape[1], device=span.device)
    for b in range(span.shape[0]):
        for v in torch.unique(layout.video[b][span[b]]).tolist():
            last = int(slots[span[b] & (layout.video[b] == v)].max())
            span[b, last] = False
    return span


# --- the methods -------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DecodeStep:
    """One decode step, per batch row: cosine with the previous step (0 at the first) and how many image
    tokens layers >= L saw (None: the full cache)."""

    similarity: list[float]
    kept: list[int | None]


@vtc.method(
    "dycoke",
    paper=PAPER,
    url=URL,
    summary="merge tokens of paired frames by similarity; prune the video KV cache at each decode step",
    retention_note="retention sets the prompt's count; TTM never reduces frames 0, 4, 8, ..., so below "
    "their share (1/4 and more, 1/2 of a 4-frame grid) the floor is kept, with a warning",
    exempt=ORDER_EXEMPTION,
)
class DyCoke(vtc.Method):
    """TTM at connect, dynamic KV pruning at every decode step (official: KD-TAO/DyCoke llava_arch.py::dycole_ttm,
    modeling_qwen2.py::PrunableDynamicCache).

    Not a `LayerPruner`: the pruning acts only on decode steps (never on the prefill), hides keys for one step
    (`mask_keys`) instead of dropping tokens, and decides per step from the attention's change."""

    temporal = True  # TTM merges tokens of paired frames: videos only

    k: float | None = vtc.param(
        None, range="[0, 1]", doc="dycoke_k: TTM merging ratio, share of a reduced frame dropped (1 - r, else 0.7)"
    )
    layer: int = vtc.param(
        3, range="[1, inf)", doc="dycoke_l (L): decode steps prune layers >= L, ranked by layer L-1's attention"
    )
    p: float | None = vtc.param(
        None, range="[0, 1]", doc="dycoke_p (P, `dycoke_radio`): fraction of video tokens hidden at a decode step (0.8)"
    )
    threshold: float = vtc.param(
        0.9, range="[-1, 1]", doc="`config.similarity < 0.9`: prune when the step-to-step attention cosine is below it"
    )
    shifted_pairs: bool = vtc.param(
        False, doc="superseded first-commit rule `similarities[(i - 2) // 2]`: pair p ranked by pair p-1"
    )
    drop_unpaired_frame: bool = vtc.param(
        True, doc="official `range(0, F - 1, 2)`: with an odd frame count the last frame is lost"
    )
    exclude_last_token: bool = vtc.param(
        True, doc="official `image_token_length = len(ttm) - 1`: the last video token is never pruned"
    )

    positions = "compact"
    query_aware = True
    during_decode = True

    def bind(self, retention):
        bound = super().bind(retention)
        bound._warned = set()  # frame counts this pipeline already warned about (retention below TTM's floor)
        return bound

    def ttm_k(self) -> float | None:
        """k for every video: the parameter (it wins over the retention), 0.7 without a retention, 0 (TTM off) at
        retention 1; None: chosen per video from the retention (`merging_ratio`)."""
        if self.k is not None:
            return self.k
        if self.retention is None:
            return DEFAULT_K
        return 0.0 if self.retention >= 1.0 else None

    def decode_p(self) -> float:
        """P: the parameter, else 0.8 (0, pruning off, at retention 1)."""
        if self.p is not None:
            return self.p
        return 0.0 if (self.retention is not None and self.retention >= 1.0) else DEFAULT_P

    def merging_ratio(self, num_frames: int, tokens_per_frame: int) -> float:
        """k for a video of `num_frames` frames of `tokens_per_frame` tokens (the parameter, or from the retention)."""
        k = self.ttm_k()
        if k is not None:
            return k
        k, reachable = merging_ratio_for(self.retention, num_frames, tokens_per_frame, self.drop_unpaired_frame)
        warned = self.__dict__.setdefault("_warned", set())
        if not reachable and num_frames not in warned:
            warned.add(num_frames)
            floor = sum(ttm_frame_counts(num_frames, tokens_per_frame, 1.0, self.drop_unpaired_frame))
            warnings.warn(
                f"dycoke: retention {self.retention:.3g} is below what TTM can keep of a {num_frames}-frame video "
                f"(it never reduces frames 0, 4, 8, ...): keeping {floor} of {num_frames * tokens_per_frame} tokens "
                f"({floor / (num_frames * tokens_per_frame):.1%}); use more frames or another method for fewer",
                RuntimeWarning,
                stacklevel=2,
            )
        return k

    def retained_count(self, num_tokens, grid, family):
        t, h, w = (int(v) for v in grid)
        k = self.merging_ratio(t, h * w)
        if k <= 0.0:
            return num_tokens
        if num_tokens != t * h * w:
            return None  # an earlier method thinned the frames: the count depends on which tokens are left
        return sum(ttm_frame_counts(t, h * w, k, self.drop_unpaired_frame))

    def connect(self, tokens, ctx):
        n = len(tokens)
        t, h, w = tokens.grid
        k = self.merging_ratio(int(t), int(h) * int(w))
        ctx.report(merging_ratio=k)
        if k <= 0.0 or n == 0:
            return tokens
        keep = ttm_select(
            tokens.embeds,
            tokens.frame,
            tokens.patch,
            int(h) * int(w),
            k,
            shifted_pairs=self.shifted_pairs,
            drop_unpaired_frame=self.drop_unpaired_frame,
        )
        if keep.numel() == n and bool((keep == torch.arange(n, device=keep.device)).all()):
            return tokens
        return tokens.select(keep)

    def prefill(self, llm, ctx):
        if llm.phase == "prefill":
            return
        if self.decode_p() <= 0.0 or llm.point != "layer_start" or llm.hidden.shape[1] != 1:
            return  # the official pruning acts only on one-token decode steps (`position_ids.shape[1] == 1`)
        if self.layer >= llm.num_layers:
            raise ValueError(f"dycoke: layer={self.layer} but the language model has only {llm.num_layers} layers")
        if llm.layer == self.layer - 1:
            # the official SDPA/FA2 classes return softmax(q k^T / sqrt(d)) computed in the model dtype
            llm.request_attention(num_rows=1, upcast=False)
        elif llm.layer == self.layer:
            self._prune(llm, ctx, self.layer)

    def _prune(self, llm, ctx, layer: int) -> None:
        previous = ctx.state.setdefault("previous", {})  # batch row -> the last decode step's image attention
        seen = llm.prefill_layout(layer - 1)  # slots of layer L-1's cache, whose attention decides
        target = llm.prefill_layout(layer)  # slots of layer L's cache, where keys get hidden
        scores = llm.attention(layer - 1).mean(dim=1)[:, -1]  # [B, keys]: head mean, the new token's row
        span = image_span(seen, self.exclude_last_token)
        visible = target.valid.clone()
        step = DecodeStep([], [])
        pruned = False
        p = self.decode_p()
        for b in range(span.shape[0]):
            slots = torch.nonzero(span[b]).flatten()
            if slots.numel() == 0:
                step.similarity.append(0.0)
                step.kept.append(None)
                continue
            current = scores[b, slots.to(scores.device)]
            kept, similarity = kv_prune(current, previous.get(b), p, self.threshold)
            previous[b] = current
            step.similarity.append(similarity)
            step.kept.append(None if kept is None else int(kept.numel()))
            if kept is None:
                continue
            dropped = torch.ones(slots.numel(), dtype=torch.bool, device=slots.device)
            dropped[kept.to(slots.device)] = False
            hidden_tokens = seen.index[b, slots[dropped]]
            candidates = target.visual[b] & target.valid[b]
            visible[b] &= ~(candidates & torch.isin(target.index[b], hidden_tokens.to(target.index.device)))
            pruned = True
        ctx.report(decode_steps=step)
        if pruned:
            llm.mask_keys(visible)


@vtc.method(
    "dycoke-ttm",
    paper=PAPER,
    url=URL,
    summary="DyCoke's temporal token merging (TTM) only, without the decode-time KV pruning (serving)",
    retention_note="as dycoke: TTM never reduces frames 0, 4, 8, ..., so below their share the floor is "
    "kept, with a warning; layer, p and threshold are unused",
    exempt=ORDER_EXEMPTION,
)
class DyCokeTTM(DyCoke):
    """DyCoke's connect part alone (its decode-time KV pruning needs the LLM): what a vLLM server runs."""

    prefill = vtc.Method.prefill  # no prefill hook: the class acts only at connect
    query_aware = False
    during_decode = False
