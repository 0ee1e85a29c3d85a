"""MemStream: adaptive per-frame token selection, a streaming KV store with a key per frame, and a training-free
retrieval mixture of experts (the LLM's own queries and CLIP) fused by reciprocal rank.

Source: one abstract (the user's Document 2, ¶26); no paper text, no code (`specs/from-abstracts.md` §8 is the
reading implemented here, `specs/methods-b.md` B9 the project page). Every choice the abstract leaves open is
marked [OPEN] and listed in docs/methods/memstream.md.

  connect (causal, per frame): split the token grid into 2x2 windows; a window whose every token has
      cos(x_t[i], x_{t-1}[i]) > tau becomes one token (the window mean, at its top-left token's position); other
      windows stay as they are; the first frame stays whole. [OPEN: a window at the grid's edge may be 1x2, 2x1
      or 1x1 and follows the same rule.]
  memory (ReKV-style): chunks are prefilled after the prompt's prefix (the sink) and the most recent
      `window_tokens` stored tokens; every frame's keys and values are kept in full precision, with a frame key
      per layer (the mean of the frame's keys before RoPE) and a CLIP image embedding of the frame.
  question: the internal expert scores frames by mean over layers of cos(mean question query, frame key), from
      a forward of the question after the sink; the external expert by CLIP text-image similarity; the two
      rankings are fused by reciprocal rank (k = 60). Frames are taken in fused order while they fit in
      `retrieval_tokens`, sorted by time, and the same frames serve every layer; the question is answered from
      sink + those frames.
Positions follow StreamingTOM's policy (methods-a §6.4): window-relative chunk positions and a question after the
retrieved cache on 1-D RoPE families; stream positions kept on M-RoPE families (vtc).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

import vtc
from vtc.core.stream import AnswerPast, concat_kv, kv_bytes, oldest_frames_over_budget, select_kv
from vtc.media.relevance import load_clip
from vtc_kernels import frame_cosine

Tensor = torch.Tensor
EXPERTS = ("internal+clip", "internal", "clip")


# --- adaptive selection -----------------------------------------------------------------------------------------


def redundant_windows(x: Tensor, previous: Tensor, grid_hw: tuple[int, int], tau: float, window: int) -> Tensor:
    """Window index [N] of every token, and which windows are redundant: returns `window_of` [N] (ids in raster
    order of windows) and `redundant` [num_windows] bool (every token of the window has cos > tau with the same
    token of the previous frame)."""
    h, w = grid_hw
    rows = torch.arange(h, device=x.device).repeat_interleave(w)
    cols = torch.arange(w, device=x.device).repeat(h)
    per_row = math.ceil(w / window)
    window_of = (rows // window) * per_row + cols // window
    similar = frame_cosine(x, previous, normalize="eps", formula="dot") > tau
    count = per_row * math.ceil(h / window)
    dissimilar = torch.zeros(count, dtype=torch.long, device=x.device).index_add_(0, window_of, (~similar).long())
    return window_of, dissimilar == 0


def select_frame(x: Tensor, previous: Tensor | None, grid_hw: tuple[int, int], tau: float, window: int):
    """One frame's plan: (kept token indices, merge destinations, merge sources) in the frame's raster order. A
    redundant window keeps its first (top-left) token as the anchor and merges the others into it (mean)."""
    n = x.shape[0]
    everything = torch.arange(n, device=x.device)
    empty = everything[:0]
    if previous is None or previous.shape != x.shape:
        return everything, empty, empty
    window_of, redundant = redundant_windows(x, previous, grid_hw, tau, window)
    merged = redundant[window_of]
    first = torch.full((redundant.numel(),), n, dtype=torch.long, device=x.device).scatter_reduce(
        0, window_of, everything, reduce="amin"
    )
    anchor = first[window_of]
    is_anchor = everything == anchor
    keep = everything[~merged | is_anchor]
    sources = everything[merged & ~is_anchor]
    # destination of each source: its anchor's slot among the kept tokens
    slot = torch.searchsorted(keep, anchor[sources])
    return keep, slot, sources


@vtc.method(
    "memstream",
    paper="MemStream (2025; abstract and project page only)",
    summary="streaming: redundant 2x2 windows merged per frame, KV kept per frame, question-time retrieval "
    "of frames by the LLM's queries and CLIP fused by reciprocal rank",
    test_params={"clip_model": "vtc-tiny-clip", "clip_pretrained": None},
)
class MemStream(vtc.StreamMemoryMethod):
    """Adaptive selection in the connect stage, the retrieval memory as the stream's memory (no official code)."""

    temporal = True  # a stream of frames: videos only

    tau: float = vtc.param(0.9, range="[-1, 1]", doc="window redundancy threshold, a cosine [OPEN: StreamingTOM's 0.9]")
    window: int = vtc.param(2, range="[1, inf)", doc="side of the square token window merged as one [OPEN: 2 x 2]")
    window_tokens: int = vtc.param(
        4800, range="[1, inf)", doc="stored tokens a new chunk attends to [OPEN: StreamingTOM]"
    )
    retrieval_tokens: int = vtc.param(
        12544, range="[1, inf)", doc="tokens of the frames retrieved for a question [OPEN: StreamingTOM]"
    )
    chunk_frames: int = vtc.param(
        32, range="[1, inf)", doc="frames encoded and prefilled together [OPEN: StreamingTOM's encoder batch]"
    )
    experts: str = vtc.param("internal+clip", choices=EXPERTS, doc="which retrieval experts vote")
    clip_model: str = vtc.param("ViT-L-14", doc="open_clip architecture of the external expert [OPEN: CLIP ViT-L/14]")
    clip_pretrained: str | None = vtc.param("openai", doc="open_clip weights tag (None: random weights, tests)")
    k_rrf: int = vtc.param(60, range="[1, inf)", doc="reciprocal-rank fusion constant [OPEN: the usual 60]")
    drift_correction: bool = vtc.param(False, doc="subtract the internal scores' linear trend over time [OPEN: off]")

    query_aware = True
    whole_frames = True
    streams = True
    stream_only = True
    requires = frozenset({"streaming"})  # vtc.stream encodes chunk by chunk (`vtc.core.families`)

    def bind(self, retention: float | None) -> MemStream:
        if retention is not None:
            raise ValueError(
                "memstream keeps what its windows' redundancy decides (tau), and retrieves retrieval_tokens per "
                "question; it has no retention: vtc.stream(model, processor, 'memstream', tau=0.9)"
            )
        return super().bind(retention)

    def connect(self, tokens, ctx):
        frames, idx = tokens.whole_frames("memstream")
        _, h, w = tokens.grid
        x = tokens.embeds[idx]
        key = ("previous", ctx.video_index)
        previous = ctx.state.get(key)
        ctx.state[key] = x[-1].detach().clone()
        keep, dst, src, src_weight = [], [], [], []
        count = 0
        for f in range(x.shape[0]):
            plan_keep, plan_dst, plan_src = select_frame(x[f], previous, (h, w), self.tau, self.window)
            row = idx[f]
            keep.append(row[plan_keep])
            dst.append(plan_dst + count)
            src.append(row[plan_src])
            src_weight.append(torch.ones(plan_src.numel(), device=x.device))
            count += plan_keep.numel()
            previous = x[f]
        keep_t, src_t = torch.cat(keep), torch.cat(src)
        if src_t.numel() == 0:
            return tokens
        ctx.report(merged=int(src_t.numel()))
        return tokens.merge(keep_t, torch.cat(dst), src_t, torch.cat(src_weight))

    def stream_memory(self, config) -> MemStreamMemory:
        return MemStreamMemory(self, config)


# --- the memory -------------------------------------------------------------------------------------------------


def reciprocal_rank_fusion(scores: list[Tensor], k: int) -> Tensor:
    """S_t = sum over experts of 1 / (k + rank_e(t)), rank 1 = the expert's best frame."""
    fused = torch.zeros_like(scores[0], dtype=torch.float64)
    for s in scores:
        order = torch.argsort(s.double(), descending=True, stable=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(1, len(order) + 1, device=order.device)
        fused += 1.0 / (k + rank.double())
    return fused


def take_frames(fused: Tensor, tokens_per_frame: Tensor, budget: int) -> Tensor:
    """Frames in fused order while they fit in `budget` tokens (the best frame always), sorted by time."""
    chosen, total = [], 0
    for frame in torch.argsort(fused, descending=True, stable=True).tolist():
        n = int(tokens_per_frame[frame])
        if chosen and total + n > budget:
            break
        chosen.append(frame)
        total += n
    return torch.tensor(sorted(chosen), dtype=torch.long)


def drift_corrected(scores: Tensor) -> Tensor:
    """Subtract the least-squares linear trend over time (the later-frames bias the abstract describes)."""
    t = torch.arange(len(scores), dtype=torch.float64)
    if len(scores) < 2:
        return scores.double()
    slope = torch.cov(torch.stack([t, scores.double()]))[0, 1] / t.var()
    return scores.double() - slope * t


class MemStreamMemory:
    name = "memstream"

    def __init__(self, params: MemStream, config) -> None:
        self.params = params
        self.config = config
        self.budget_tokens = config.budget_tokens
        self.chunk_frames = params.chunk_frames
        self.window_relative = not config.mrope
        self.llm = None
        self.rotation = None
        self.prefix_kv = None
        self.kv = None  # stored frames' keys (after RoPE, as encoded) and values, per layer
        self.row_frame = torch.empty(0, dtype=torch.long)  # frame of each stored row
        self.frame_ids = torch.empty(0, dtype=torch.long)  # stored frames, in time order
        self.frame_keys = None  # [frames, layers, C] mean pre-RoPE keys
        self.frame_images = None  # [frames, E] CLIP image embeddings
        self.last_selection: Tensor | None = None
        self.last_scores: dict[str, Tensor] = {}

    @property
    def experts(self) -> list[str]:
        return self.params.experts.split("+")

    def start(self, llm, prefix) -> None:
        self.llm = llm
        self.rotation = llm.key_rotation()
        self.prefix_kv = llm.forward(prefix.embeds, prefix.positions).kv
        self.prefix_length = int(prefix.embeds.shape[0])

    @property
    def stored_tokens(self) -> int:
        return int(self.row_frame.numel())

    @property
    def nbytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for t in (self.frame_keys, self.frame_images) if t is not None)
        return kv_bytes(self.prefix_kv) + kv_bytes(self.kv) + extra

    def _clip(self):
        return load_clip(self.params.clip_model, self.params.clip_pretrained)

    @torch.no_grad()
    def _image_embeddings(self, pixels, frames: int) -> Tensor:
        """One CLIP embedding per stored frame (a Qwen temporal patch: the mean of its frames' embeddings)."""
        from PIL import Image

        model, preprocess, _ = self._clip()
        images = torch.stack([preprocess(Image.fromarray(p)) for p in pixels])
        emb = F.normalize(model.encode_image(images).float(), dim=-1)
        return F.normalize(emb.reshape(frames, -1, emb.shape[-1]).mean(dim=1), dim=-1)

    def append(self, segment) -> None:
        visual = segment.visual
        frames_of_rows = segment.frame[visual]
        stored_frames = torch.unique(frames_of_rows)
        if self.budget_tokens is not None:
            largest = int(torch.bincount(frames_of_rows - frames_of_rows.min()).max())
            if largest > self.budget_tokens:
                raise ValueError(
                    f"budget_tokens={self.budget_tokens} is smaller than one frame ({largest} tokens after the "
                    f"selection); raise it to at least {largest}"
                )
        # the past: sink + the most recent whole frames within window_tokens
        past = self.prefix_kv
        window = 0
        if self.stored_tokens:
            counts = torch.bincount(self.row_frame - self.row_frame.min())
            counts = counts[counts > 0].flip(0).cumsum(0)
            frames_in = int((counts <= self.params.window_tokens).sum())
            window = int(counts[frames_in - 1]) if frames_in else 0
            if window:
                index = torch.arange(self.stored_tokens - window, self.stored_tokens)
                past = concat_kv(past, select_kv(self.kv, index))
        if self.window_relative:
            start = self.prefix_length + window
            positions = torch.arange(start, start + len(segment))[None]
        else:
            positions = segment.positions
        out = self.llm.forward(segment.embeds, positions, past, deepstack=segment.deepstack, visual=visual)
        rows = torch.nonzero(visual).flatten()
        new = select_kv(out.kv, rows)
        used = positions[:, rows]
        keys = []
        for k, _ in new:
            pre = self.rotation(k, used, inverse=True)[0]  # [kvh, n, d]
            flat = pre.permute(1, 0, 2).reshape(rows.numel(), -1).float()
            sums = torch.zeros(len(stored_frames), flat.shape[1]).index_add_(
                0, torch.searchsorted(stored_frames, frames_of_rows), flat.cpu()
            )
            keys.append(sums / torch.bincount(torch.searchsorted(stored_frames, frames_of_rows))[:, None])
        frame_keys = torch.stack(keys, dim=1)  # [frames, layers, C]
        self.kv = concat_kv(self.kv, new)
        self.row_frame = torch.cat([self.row_frame, frames_of_rows.cpu()])
        self.frame_ids = torch.cat([self.frame_ids, stored_frames.cpu()])
        self.frame_keys = frame_keys if self.frame_keys is None else torch.cat([self.frame_keys, frame_keys])
        if "clip" in self.experts:
            images = self._image_embeddings(segment.pixels, len(stored_frames))
            self.frame_images = images if self.frame_images is None else torch.cat([self.frame_images, images])
        self._evict()

    def _evict(self) -> None:
        """vtc extension: with a budget, the oldest frames leave (ReKV keeps every frame, offloaded to CPU)."""
        if self.budget_tokens is None or self.stored_tokens <= self.budget_tokens:
            return
        dropped = oldest_frames_over_budget(self.row_frame, self.budget_tokens)
        drop = int(dropped.numel())
        keep_rows = torch.nonzero(~torch.isin(self.row_frame, dropped)).flatten()
        self.kv = select_kv(self.kv, keep_rows)
        self.row_frame = self.row_frame[keep_rows]
        self.frame_ids = self.frame_ids[drop:]
        self.frame_keys = self.frame_keys[drop:]
        if self.frame_images is not None:
            self.frame_images = self.frame_images[drop:]

    @torch.no_grad()
    def _internal_scores(self, question) -> Tensor:
        """mean over layers of cos(mean pre-RoPE question query, frame key), from the question after the sink."""
        with self.llm.capture_queries() as queries:
            positions = torch.arange(self.prefix_length, self.prefix_length + len(question))
            self.llm.forward(question.embeds, positions[None].expand(question.positions.shape[0], -1), self.prefix_kv)
        scores = []
        head_dim = self.frame_keys.shape[2] // queries.kv_heads
        for layer in range(self.frame_keys.shape[1]):
            q_mean = queries.mean(layer, head_dim).cpu()
            scores.append(F.cosine_similarity(self.frame_keys[:, layer], q_mean[None], dim=-1))
        return torch.stack(scores).mean(dim=0)

    @torch.no_grad()
    def _clip_scores(self, text: str) -> Tensor:
        model, _, tokenizer = self._clip()
        emb = F.normalize(model.encode_text(tokenizer([text])).float(), dim=-1)[0]
        return self.frame_images @ emb

    def answer_past(self, question) -> AnswerPast:
        start = time.perf_counter()
        scores = []
        self.last_scores = {}
        if "internal" in self.experts:
            internal = self._internal_scores(question)
            if self.params.drift_correction:
                internal = drift_corrected(internal)
            self.last_scores["internal"] = internal
            scores.append(internal)
        if "clip" in self.experts:
            if not question.text:
                raise ValueError("memstream's CLIP expert needs the question's text")
            self.last_scores["clip"] = self._clip_scores(question.text)
            scores.append(self.last_scores["clip"])
        fused = reciprocal_rank_fusion(scores, self.params.k_rrf)
        counts = torch.bincount(torch.searchsorted(self.frame_ids, self.row_frame), minlength=len(self.frame_ids))
        chosen = take_frames(fused, counts, self.params.retrieval_tokens)
        self.last_selection = self.frame_ids[chosen]
        rows = torch.nonzero(torch.isin(self.row_frame, self.last_selection)).flatten()
        kv = concat_kv(self.prefix_kv, select_kv(self.kv, rows))
        next_position = self.prefix_length + rows.numel() if self.window_relative else None
        return AnswerPast(kv, next_position, retrieved_tokens=int(rows.numel()), seconds=time.perf_counter() - start)
