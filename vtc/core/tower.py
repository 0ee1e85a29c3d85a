"""What an encode-stage method sees inside the vision tower: `TowerTokens`, one video's tokens between two blocks.

A tower method (`vtc.core.bases.TowerMerger`) is called at fixed points of every block: after the block's attention
(before its MLP, where ToMe merges) and after the whole block (where EarlyTom mixes frames). It changes the tokens
only through `merge`, which keeps, folds and drops whole tokens, so the backend knows for every token where it came
from (`origin`) and which original cells it stands for (`holder`), and can carry its own per-token state (rotary
rows, windows, attention segments) along.

A token is what one LLM token is made of at the end of the tower: on the Qwen towers a merge unit (the merge x merge
patches the merger folds into one LLM token), so a merge keeps complete units and the merger still gets complete
groups; on SigLIP / CLIP (LLaVA) one patch, and a CLIP class token, which has no cell.

Tokens are grouped by frame (temporal patch), frames in ascending order and contiguous, a class token first in its
frame; within a frame the order is the method's (ToMe's `[unmerged A ; B]` order is not the spatial one). Attention
never depends on that order: every token carries its own position.

The block loops live here too, shared by the HF and vLLM backends, which subclass them with their modules' calls:
`MergeUnitTower` (the Qwen towers) and `FrameTower` (SigLIP / CLIP, with `pooled_survivors`: what a LLaVA video hands
its connect stage).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # pragma: no cover
    from vtc.core.pipeline import Pipeline
    from vtc.core.tokens import Context

Tensor = torch.Tensor
Grid = tuple[int, int, int]

# where a tower method is called: once after the patch embedding (layer -1, before the first block), then after every
# block's attention and after every block
POINTS = ("embedded", "after_attention", "after_block")


@dataclasses.dataclass
class TowerTokens:
    """One video's tokens inside the vision tower, at one point of one block.

    hidden   [N, unit, D]: hidden states (unit = patches per token: merge**2 on the Qwen towers, 1 on SigLIP / CLIP)
    cell     [N] long: the original tower cell each token sits at, t * H * W + h * W + w on `grid` (its position, which
             it keeps through merges); -1 for a class token
    frame    [N] long: the frame (temporal patch) of each token, ascending
    size     [N] float: how many original tokens each stands for (ToMe's `size`; 1 before any merge)
    holder   [C] long: for every original cell of `grid` (C = T * H * W), the token now holding it (-1: dropped
             before or inside the tower)
    grid     (T, H, W): the tower's token grid (merge units on the Qwen towers, patches on SigLIP / CLIP)
    layer    the block (0-based) of `num_layers` (the blocks that run: on LLaVA up to the layer whose output the
             projector reads); -1 at "embedded"
    point    "embedded" (the patch embedding with the tower's absolute position embedding, before the first block),
             "after_attention" (the block's attention residual added, its MLP not run yet) or "after_block"
    keys     [N, unit, heads, head_dim]: the block's attention keys before any rotary embedding, at "after_attention"
             for methods with `needs_keys`; else None
    received [N]: the attention each token receives within its frame (mean over heads and over the frame's queries),
             at "after_attention" of the blocks a method lists in `attention_layers`; else None
    pixels   [N, unit, P]: the patches as the patch embedding received them (the processor's normalised values, each
             patch flattened in the embedding's weight order), at "embedded"; a class token has zeros; else None
    origin   [N] long: each token's index among the tokens this hook call received (the backend's bookkeeping)
    """

    hidden: Tensor
    cell: Tensor
    frame: Tensor
    size: Tensor
    holder: Tensor
    grid: Grid
    layer: int
    num_layers: int
    point: str
    keys: Tensor | None = None
    received: Tensor | None = None
    pixels: Tensor | None = None
    origin: Tensor | None = None

    def __post_init__(self) -> None:
        if self.origin is None:
            self.origin = torch.arange(len(self), device=self.hidden.device)

    def __len__(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def num_frames(self) -> int:
        return self.grid[0]

    @property
    def has_class_token(self) -> bool:
        return bool((self.cell < 0).any())

    def frame_lengths(self) -> Tensor:
        """[T] tokens per frame (a frame folded into another has 0)."""
        return torch.bincount(self.frame, minlength=self.num_frames)

    def frame_batches(self) -> list[tuple[Tensor, Tensor]]:
        """The frames that still have tokens, grouped by their token count: (frames [f], index [f, n]) per group,
        row i of `index` holding the tokens of frames[i] in their order. A method that works per frame (ToMe matches
        within one image) batches each group."""
        lengths = self.frame_lengths()
        starts = torch.cumsum(lengths, 0) - lengths
        out = []
        for n in torch.unique(lengths[lengths > 0]).tolist():
            frames = torch.nonzero(lengths == n).flatten()
            index = starts[frames][:, None] + torch.arange(n, device=frames.device)
            out.append((frames, index.to(self.hidden.device)))
        return out

    def merge(
        self,
        keep: Tensor,
        src: Tensor | None = None,
        dst: Tensor | None = None,
        hidden: Tensor | None = None,
        size: Tensor | None = None,
    ) -> TowerTokens:
        """The tokens after a merge: `keep` [K] (indices of the tokens that remain, in their new order: frames stay
        ascending and contiguous), `src` -> `dst` [M] (tokens folded into remaining ones; `dst` indexes the current
        tokens and must be kept); tokens neither kept nor folded are dropped.

        hidden [K, unit, D]: the remaining tokens' new hidden states (a method that computes them itself, e.g. ToMe's
        official weighted average); None: each remaining token's size-weighted average with what folds into it.
        size [K]: their new sizes; None: their size plus the sizes folded into them."""
        device = self.hidden.device
        keep = torch.as_tensor(keep, dtype=torch.long, device=device).flatten()
        src = torch.zeros(0, dtype=torch.long, device=device) if src is None else torch.as_tensor(src, device=device)
        dst = torch.zeros(0, dtype=torch.long, device=device) if dst is None else torch.as_tensor(dst, device=device)
        src, dst = src.long().flatten(), dst.long().flatten()
        n = len(self)
        if not keep.numel():
            raise ValueError("merge: keep at least one token of the video")
        slot = torch.full((n,), -1, dtype=torch.long, device=device)  # old token -> new index
        slot[keep] = torch.arange(keep.numel(), device=device)
        if torch.unique(keep).numel() != keep.numel() or int(keep.min()) < 0 or int(keep.max()) >= n:
            raise ValueError(f"merge: keep must index distinct tokens in [0, {n}), got {keep.tolist()}")
        if src.numel() != dst.numel():
            raise ValueError(
                f"merge: src and dst must pair up, got {src.numel()} sources and {dst.numel()} destinations"
            )
        if src.numel():
            if bool((slot[dst] < 0).any()):
                raise ValueError("merge: every destination must be a kept token")
            if bool((slot[src] >= 0).any()) or torch.unique(src).numel() != src.numel():
                raise ValueError("merge: a folded token cannot be kept or folded twice")
        new_frame = self.frame[keep]
        if bool((new_frame[1:] < new_frame[:-1]).any()):
            raise ValueError("merge: keep the frames in ascending order, each frame's tokens together")
        target = slot.clone()
        target[src] = slot[dst]  # where each old token's content goes (-1: dropped)
        folded_size = torch.zeros(keep.numel(), dtype=self.size.dtype, device=device)
        folded_size.index_add_(0, target[src], self.size[src])
        new_size = self.size[keep] + folded_size if size is None else torch.as_tensor(size, device=device)
        if hidden is None:
            weighted = self.hidden.float() * self.size.float()[:, None, None]
            total = weighted[keep].clone()
            total.index_add_(0, target[src], weighted[src])
            hidden = (total / new_size.float()[:, None, None]).to(self.hidden.dtype)
        elif hidden.shape[0] != keep.numel() or hidden.shape[1:] != self.hidden.shape[1:]:
            raise ValueError(
                f"merge: hidden must be [{keep.numel()}, {', '.join(map(str, self.hidden.shape[1:]))}], "
                f"got {tuple(hidden.shape)}"
            )
        held = self.holder >= 0
        holder = self.holder.clone()
        holder[held] = target[self.holder[held]]
        return dataclasses.replace(
            self,
            hidden=hidden,
            cell=self.cell[keep],
            frame=new_frame,
            size=new_size,
            holder=holder,
            keys=None if self.keys is None else self.keys[keep],
            received=None if self.received is None else self.received[keep],
            pixels=None if self.pixels is None else self.pixels[keep],
            origin=self.origin[keep],
        )

    def with_hidden(self, hidden: Tensor) -> TowerTokens:
        """The same tokens with new hidden states [N, unit, D] (a method that changes values, not tokens)."""
        if hidden.shape != self.hidden.shape:
            raise ValueError(f"with_hidden: expected {tuple(self.hidden.shape)}, got {tuple(hidden.shape)}")
        return dataclasses.replace(self, hidden=hidden)

    def survivors(self) -> Tensor:
        """The cells whose own token still exists (a kept token sits at its own cell), ascending: what reaches the LLM
        where every token is one LLM token (the Qwen towers)."""
        cells = self.cell[self.cell >= 0]
        return torch.sort(cells).values


def initial_tokens(hidden: Tensor, cells: Tensor, frame: Tensor, grid: Grid, num_layers: int) -> TowerTokens:
    """The tokens of one video as the tower's first block receives them: `hidden` [N, unit, D] at `cells` [N] (-1 for
    a class token, which leads its frame) in frames `frame` [N] (ascending)."""
    device = hidden.device
    cells, frame = cells.to(device).long(), frame.to(device).long()
    holder = torch.full((grid[0] * grid[1] * grid[2],), -1, dtype=torch.long, device=device)
    own = cells >= 0
    holder[cells[own]] = torch.nonzero(own).flatten()
    size = torch.ones(cells.numel(), device=device)
    return TowerTokens(hidden, cells, frame, size, holder, grid, -1, num_layers, "embedded")


# --- what every backend's block-by-block tower shares ------------------------------------------------------------


def segment_attention(q: Tensor, k: Tensor, v: Tensor, lengths: list[int], scale: float, bias: Tensor | None) -> Tensor:
    """Attention within consecutive segments of packed q, k, v [n, heads, head_dim] (`lengths` sum to n), with an
    additive per-key `bias` [n] (None: none), by SDPA; segments of equal length run as one batch. Returns
    [n, heads, head_dim]."""
    out = torch.empty_like(q)
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    by_length: dict[int, list[int]] = {}
    for start, length in zip(starts, lengths):
        by_length.setdefault(length, []).append(start)
    for length, group in by_length.items():
        index = (torch.tensor(group, device=q.device)[:, None] + torch.arange(length, device=q.device)).flatten()
        shape = (len(group), length, q.shape[1], q.shape[2])
        qs, ks, vs = (x[index].view(shape).transpose(1, 2) for x in (q, k, v))
        mask = None if bias is None else bias[index].view(len(group), 1, 1, length).to(qs.dtype)
        attended = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[index] = attended.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])
    return out


class TowerRun:
    """Bookkeeping of one tower call over several videos: each video's `TowerTokens` (whose `hidden` is filled in at
    hook time from the packed tower state), the pipeline, one context per video, and what the methods did."""

    def __init__(self, pipeline: Pipeline, ctxs: list[Context], tokens: list[TowerTokens]) -> None:
        self.pipeline = pipeline
        self.ctxs = ctxs
        self.tokens = tokens
        self.tally: list[dict[str, list]] = [{} for _ in tokens]
        self.start_counts = [len(t) for t in tokens]

    @property
    def counts(self) -> list[int]:
        return [len(t) for t in self.tokens]

    def hook(self, hidden: Tensor, layer: int, point: str, **extra: Tensor | None) -> Tensor | None:
        """Hand every video's tokens (packed `hidden` [N, unit, D], videos in order; `extra`: packed `keys`,
        `received`, `pixels` where this point offers them) to the tower methods. Returns the gather index [N'] of the
        new packed order into the old one (the new hidden states in `new_hidden`), or None when nothing changed."""
        changed = False
        new_hidden, gather, offset = [], [], 0
        for v, tokens in enumerate(self.tokens):
            n = len(tokens)
            tokens.hidden = hidden[offset : offset + n]
            for name in ("keys", "received", "pixels"):
                value = extra.get(name)
                setattr(tokens, name, None if value is None else value[offset : offset + n])
            tokens.layer, tokens.point = layer, point
            tokens.origin = torch.arange(n, device=hidden.device)
            out = self.pipeline.run_encode_block(tokens, self.ctxs[v], self.tally[v])
            changed |= out is not tokens
            out.keys = out.received = out.pixels = None
            self.tokens[v] = out
            new_hidden.append(out.hidden)
            gather.append(out.origin + offset)
            offset += n
        if not changed:
            return None
        self.new_hidden = torch.cat(new_hidden)
        return torch.cat(gather)

    def records(self, name_counts: list[tuple[int, int]]) -> list[list[tuple]]:
        """Per video, one (method, tokens in, tokens out, seconds, reports) record per tower method; `name_counts`
        gives each video's (in, out) count at the level the LLM sees (units, or pooled cells on LLaVA)."""
        out = []
        for v, (n_in, n_out) in enumerate(name_counts):
            rows = []
            for e in self.pipeline.tower_entries():
                removed, seconds, reports = self.tally[v].get(e.card.name, [0, 0.0, {}])
                tower = {
                    "tower_tokens_in": [self.start_counts[v]],
                    "tower_tokens_out": [self.start_counts[v] - removed],
                }
                reports = {**reports, **tower}
                rows.append((e.card.name, n_in, n_out, seconds, reports))
            out.append(rows)
        return out


# --- the Qwen towers block by block, whatever the backend -------------------------------------------------------


def unit_tokens(hidden: Tensor, kept: list[Tensor], grids: list[Grid], num_layers: int) -> list[TowerTokens]:
    """Every video's `TowerTokens` as a Qwen tower's first block receives them: `hidden` [sum kept, unit, D] holds the
    surviving units `kept[k]` (ascending cells of `grids[k]`) of every video in order."""
    tokens, start = [], 0
    for k, grid in zip(kept, grids):
        k = k.to(hidden.device)
        frame = torch.div(k, grid[1] * grid[2], rounding_mode="floor")
        tokens.append(initial_tokens(hidden[start : start + k.numel()], k, frame, grid, num_layers))
        start += k.numel()
    return tokens


def attention_segments(tokens: list[TowerTokens], window: int | None) -> tuple[Tensor | None, list[int]]:
    """The order that makes every attention segment of the packed `tokens` (videos in order) contiguous (None: the
    packed order already is) and the segments' lengths in tokens: one per temporal patch of every video (Qwen's
    per-frame attention), or, with `window` (units per window side: Qwen2.5-VL's windowed blocks), one per window of
    it, windows numbered row-major over the frame as the tower's own window index numbers them."""
    keys, frames_before = [], 0
    for t in tokens:
        key = t.frame + frames_before
        frames_before += t.grid[0]
        if window is not None:
            _, h, w = t.grid
            row, col = (t.cell // w) % h, t.cell % w
            per_row = -(-w // window)
            key = key * (-(-h // window) * per_row) + (row // window) * per_row + col // window
        keys.append(key)
    key = torch.cat(keys)
    order = None
    if bool((key[1:] < key[:-1]).any()):
        order = torch.sort(key, stable=True).indices
        key = key[order]
    return order, torch.unique_consecutive(key, return_counts=True)[1].tolist()


def scatter_by_cell(values: Tensor, tokens: list[TowerTokens], units: list[int]) -> tuple[Tensor, ...]:
    """Per video [units, D]: the rows of `values` (videos' tokens packed in order) at their tokens' cells, zeros
    elsewhere."""
    out, start = [], 0
    for t, n in zip(tokens, units):
        full = values.new_zeros(n, values.shape[-1])
        full[t.cell] = values[start : start + len(t)]
        out.append(full)
        start += len(t)
    return tuple(out)


class MergeUnitTower:
    """The block loop of a tower whose tokens are merge units (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), shared by the HF and
    vLLM backends, which differ in how a block's modules are called, not in what runs when.

    The loop hands the tokens to the tower methods after the embedding, after every block's attention and after every
    block (`TowerRun.hook`), carries every token's rotary rows through their merges, builds each block's attention
    segments from what is left (per temporal patch; per window on Qwen2.5-VL's windowed blocks) and taps DeepStack
    features on the tokens alive at that block. A backend subclass gives the modules' calls: `attend` (one block's
    attention over contiguous segments, its own module or SDPA with a per-key bias), `mlp` (the block's MLP branch)
    and `tap` (a DeepStack merger)."""

    def __init__(
        self,
        family: str,
        blocks: list,
        merge: int,
        window: int | None = None,
        full_blocks: tuple[int, ...] | list[int] = (),
        deepstack: tuple[int, ...] | list[int] = (),
    ) -> None:
        self.family = family
        self.blocks = list(blocks)
        self.merge = int(merge)
        self.unit = self.merge * self.merge
        self.window = window  # units per window side on the windowed blocks (None: none)
        self.full_blocks = frozenset(full_blocks)
        self.deepstack = list(deepstack)

    # --- what a backend gives ------------------------------------------------------------------------------------
    def attend(
        self,
        block,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        lengths: list[int],
        bias: Tensor | None,
        keys_wanted: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """The block's attention branch (its norm and attention) on the residual stream `x` [n, D] (patches, each
        segment contiguous; `lengths` in patches), with rotary rows `cos`, `sin` [n, R]. `bias` [n]: SDPA with that
        per-key bias instead of the block's own attention (proportional attention). Returns the branch's output
        [n, D] and, when `keys_wanted`, the keys before the rotary embedding [n, heads, head_dim]."""
        raise NotImplementedError

    def mlp(self, block, x: Tensor) -> Tensor:
        """The block's MLP branch (its norm and MLP) on the residual stream `x` [n, D]."""
        raise NotImplementedError

    def tap(self, index: int, x: Tensor) -> Tensor:
        """DeepStack merger `index` on `x` [n, D] (complete units, consecutive)."""
        raise NotImplementedError

    # --- the loop ------------------------------------------------------------------------------------------------
    def run_blocks(
        self, run: TowerRun, x: Tensor, cos: Tensor, sin: Tensor, pixels: Tensor | None = None
    ) -> tuple[Tensor, list[tuple[Tensor, list[TowerTokens]]]]:
        """Every block on the embedded tokens `x` [N, unit, D] (rotary rows `cos`, `sin` [N, unit, R]; `pixels`
        [N, unit, P] for the "embedded" point), the tower methods of `run` between them. Returns the last block's
        output [N', unit, D] and the DeepStack taps (features [n, D'] of the tokens then alive, those tokens)."""
        pipeline = run.pipeline
        if pipeline.tower_attention_layers(len(self.blocks)):
            raise ValueError(
                f"{', '.join(e.card.name for e in pipeline.tower_entries())}: the attention tokens receive inside a "
                f"block is offered on LLaVA's SigLIP / CLIP towers, not yet inside the {self.family} tower"
            )
        keys_wanted, proportional = pipeline.tower_needs_keys, pipeline.proportional_attention
        x, cos, sin = self._hook(run, x, cos, sin, -1, "embedded", pixels=pixels)
        taps: list[tuple[Tensor, list[TowerTokens]]] = []
        for layer, block in enumerate(self.blocks):
            windows = self.window is not None and layer not in self.full_blocks
            bias = torch.cat([t.size for t in run.tokens]).log().repeat_interleave(self.unit) if proportional else None
            attended, keys = self._attention(block, x, cos, sin, run, windows, bias, keys_wanted)
            x = x + attended
            x, cos, sin = self._hook(run, x, cos, sin, layer, "after_attention", keys=keys)
            x = x + self.mlp(block, x.flatten(0, 1)).view_as(x)
            x, cos, sin = self._hook(run, x, cos, sin, layer, "after_block")
            if layer in self.deepstack:
                taps.append((self.tap(self.deepstack.index(layer), x.flatten(0, 1)), list(run.tokens)))
        return x, taps

    @staticmethod
    def _hook(run: TowerRun, x: Tensor, cos: Tensor, sin: Tensor, layer: int, point: str, **extra):
        gather = run.hook(x, layer, point, **extra)
        if gather is None:
            return x, cos, sin
        return run.new_hidden, cos[gather], sin[gather]

    def _attention(self, block, x: Tensor, cos, sin, run: TowerRun, windows: bool, bias, keys_wanted: bool):
        """`attend` with every attention segment made contiguous (and the result put back in the packed order);
        the keys [N, unit, heads, head_dim] when asked."""
        order, lengths = attention_segments(run.tokens, self.window if windows else None)
        n, unit, dim = x.shape
        if order is not None:
            x, cos, sin = x[order], cos[order], sin[order]
            bias = None if bias is None else bias.view(n, unit)[order].flatten()
        out, keys = self.attend(
            block, x.flatten(0, 1), cos.flatten(0, 1), sin.flatten(0, 1), [k * unit for k in lengths], bias, keys_wanted
        )
        out = out.view(n, unit, dim)
        keys = None if (keys is None or not keys_wanted) else keys.reshape(n, unit, *keys.shape[1:])
        if order is not None:
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=order.device)
            out = out[inverse]
            keys = None if keys is None else keys[inverse]
        return out, keys


# --- LLaVA's SigLIP / CLIP towers block by block, whatever the backend -------------------------------------------


def pooled_survivors(tokens: TowerTokens, cells_per_frame: int) -> tuple[Tensor, Tensor]:
    """What one video of a SigLIP / CLIP tower hands the connect stage once every frame was unmerged onto its grid and
    pooled to `cells_per_frame` LLM cells: the cells of the frames that kept tokens of their own (ascending), and how
    many original frames each such cell stands for (a frame EarlyTom folded others into counts them; a ToMe frame
    counts 1). A frame's tokens (its class token included) hold its whole share of the sizes, so the frames held are
    their sizes over the tokens a frame starts with."""
    frames = tokens.grid[0]
    per_frame = tokens.grid[1] * tokens.grid[2] + int(tokens.has_class_token)
    alive = torch.unique(tokens.frame).cpu()
    kept = (alive[:, None] * cells_per_frame + torch.arange(cells_per_frame)).flatten()
    held = torch.zeros(frames, device=tokens.size.device).index_add_(0, tokens.frame, tokens.size.float())
    weight = (held.cpu()[alive] / per_frame).repeat_interleave(cells_per_frame)
    return kept, weight


class FrameTower:
    """The block loop of LLaVA's SigLIP / CLIP towers, shared by the HF and vLLM backends (`vtc.hf.tower.LlavaTower`,
    `vtc.vllm.tower.VllmFrameTower`), whose modules have the same names and order (`embeddings`, CLIP's
    `pre_layrnorm`, every layer's `layer_norm1`, `self_attn`, `layer_norm2`, `mlp`) and differ in how an attention
    module is called, not in what runs when.

    Every frame is one batch item of `side x side` patches (plus a CLIP class token, first); tokens stay dense (every
    frame of a call keeps the same count: ToMe merges as many in every frame). The tower methods get every video's
    tokens after the embedding (with the patches' pixels), after every layer's attention (with the keys, and the
    attention each token receives where asked) and after every layer (`TowerRun.hook`); at the end every frame is
    unmerged onto its patch grid (each patch gets the token holding it, ToMe's source map), so the model's own
    projector and pooling see a whole grid. A backend subclass gives the attention module's calls: `projections`,
    `project_out` and `own_attention`."""

    def __init__(self, model, side: int, class_token: bool) -> None:
        self.model = model  # the vision transformer: embeddings, pre_layrnorm (CLIP), encoder.layers
        self.layers = list(model.encoder.layers)
        self.side = int(side)
        self.class_token = bool(class_token)

    # --- what a backend gives ------------------------------------------------------------------------------------
    def projections(self, attn, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The attention module's query, key and value projections of normed `h` [frames, n, D], each
        [frames, n, heads, head_dim]."""
        raise NotImplementedError

    def project_out(self, attn, x: Tensor) -> Tensor:
        """The attention module's output projection of `x` [frames, n, heads * head_dim]."""
        raise NotImplementedError

    def own_attention(self, attn, h: Tensor, keys_wanted: bool) -> tuple[Tensor, Tensor | None]:
        """The attention module itself on normed `h` [frames, n, D] (its own attention implementation) -> its output
        [frames, n, D] and, when `keys_wanted`, the key projection [frames, n, heads, head_dim]."""
        raise NotImplementedError

    # --- the loop ------------------------------------------------------------------------------------------------
    def embed(self, pixels: Tensor) -> Tensor:
        """[frames, (1 +) side^2, D]: the tower's own embeddings (patches and absolute positions; CLIP's class token
        and pre-layernorm)."""
        x = self.model.embeddings(pixels.type(self.model.embeddings.patch_embedding.weight.dtype))
        if hasattr(self.model, "pre_layrnorm"):  # CLIP
            x = self.model.pre_layrnorm(x)
        return x

    def run(
        self, pixels: Tensor, frames: list[int], last_layer: int, pipeline: Pipeline, ctxs: list[Context]
    ) -> tuple[list[Tensor], list[Tensor], TowerRun]:
        """The encoder on `pixels` [sum frames, C, H, W] up to encoder layer `last_layer` (0-based) with the pipeline's
        tower methods between blocks. Returns per video the output of `last_layer` unmerged onto every frame's
        tokens [frames, (1 +) side * side, D] (a frame folded into another: zeros), the frames that kept tokens of
        their own, and the run."""
        side, cls = self.side, int(self.class_token)
        per_frame = side * side + cls
        x = self.embed(pixels)
        dim = x.shape[-1]
        x = x.reshape(-1, 1, dim)
        tokens, start = [], 0
        patch = torch.arange(side * side, device=x.device)
        for f in frames:
            frame = torch.arange(f, device=x.device).repeat_interleave(per_frame)
            cells = torch.cat([torch.cat([patch.new_full((cls,), -1), i * side * side + patch]) for i in range(f)])
            tokens.append(
                initial_tokens(x[start : start + f * per_frame], cells, frame, (f, side, side), last_layer + 1)
            )
            start += f * per_frame
        run = TowerRun(pipeline, ctxs, tokens)
        keys_wanted, proportional = pipeline.tower_needs_keys, pipeline.proportional_attention
        attention_layers = pipeline.tower_attention_layers(last_layer + 1)
        x = self._hook(run, x, -1, "embedded", pixels=self._patches(pixels, x.dtype))
        for layer in range(last_layer + 1):
            block = self.layers[layer]
            dense = self._dense(run, x, dim)
            bias = torch.cat([t.size for t in run.tokens]).log().view(dense.shape[:2]) if proportional else None
            normed = block.layer_norm1(dense)
            attended, keys = self._attention(block.self_attn, normed, bias, keys_wanted)
            received = self._received(block.self_attn, normed) if layer in attention_layers else None
            x = (dense + attended).reshape(-1, 1, dim)
            x = self._hook(run, x, layer, "after_attention", keys=keys, received=received)
            dense = self._dense(run, x, dim)
            x = (dense + block.mlp(block.layer_norm2(dense))).reshape(-1, 1, dim)
            x = self._hook(run, x, layer, "after_block")
        features, alive, offset = [], [], 0
        for t, f in zip(run.tokens, frames):
            hidden = x[offset : offset + len(t), 0]
            offset += len(t)
            features.append(self.unmerge(t, hidden, f))
            alive.append(torch.unique(t.frame))
        return features, alive, run

    def _dense(self, run: TowerRun, x: Tensor, dim: int) -> Tensor:
        """x as [frames, tokens per frame, D]; refuses a call whose frames were left with different counts."""
        lengths = torch.cat([t.frame_lengths() for t in run.tokens])
        lengths = lengths[lengths > 0]
        if bool((lengths != lengths[0]).any()):
            raise RuntimeError(
                f"the tower methods {', '.join(e.card.name for e in run.pipeline.tower_entries())} left the frames of "
                f"one SigLIP/CLIP call with different token counts ({sorted(set(lengths.tolist()))}); this tower runs "
                "every frame as one batch item, so every frame must keep the same number of tokens"
            )
        return x.view(-1, int(lengths[0]), dim)

    @staticmethod
    def _hook(run: TowerRun, x: Tensor, layer: int, point: str, **extra) -> Tensor:
        gather = run.hook(x, layer, point, **extra)
        return x if gather is None else run.new_hidden

    def _patches(self, pixels: Tensor, dtype: torch.dtype) -> Tensor:
        """[frames * tokens, 1, C * P * P]: every frame's patches in the patch embedding's weight order (a class
        token: zeros)."""
        patch = self.model.embeddings.patch_embedding.kernel_size[0]
        patches = F.unfold(pixels.to(dtype), kernel_size=patch, stride=patch).transpose(1, 2)  # [F, S, C*P*P]
        if self.class_token:
            patches = F.pad(patches, (0, 0, 1, 0))
        return patches.reshape(-1, 1, patches.shape[-1])

    def _received(self, attn, normed: Tensor) -> Tensor:
        """[frames * n]: the attention each token receives in its frame, mean over heads and queries."""
        from vtc.core.vision_stats import frame_stats

        n = normed.shape[1]
        q, k, _ = self.projections(attn, normed)
        return (frame_stats(q.transpose(1, 2), k.transpose(1, 2), attn.scale, {"received"})["received"] / n).flatten()

    def _attention(self, attn, h: Tensor, bias: Tensor | None, keys_wanted: bool) -> tuple[Tensor, Tensor | None]:
        """The layer's attention on normed `h` [frames, n, D]: its own module, or SDPA with the per-key `bias`
        [frames, n] from its own projections (proportional attention); and the keys [frames * n, 1, heads,
        head_dim] when asked."""
        frames, n, _ = h.shape
        if bias is None:
            out, keys = self.own_attention(attn, h, keys_wanted)
        else:
            q, keys, v = self.projections(attn, h)
            q, k, v = (x.transpose(1, 2) for x in (q, keys, v))  # [frames, heads, n, head_dim]
            mask = bias[:, None, None, :].to(q.dtype)
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale)
            out = self.project_out(attn, context.transpose(1, 2).reshape(frames, n, -1))
        if not keys_wanted or keys is None:
            return out, None
        return out, keys.reshape(frames * n, 1, *keys.shape[2:])

    def unmerge(self, tokens: TowerTokens, hidden: Tensor, frames: int) -> Tensor:
        """[frames, (1 +) side^2, D]: every cell of a frame that kept tokens of its own gets the token holding it
        (the class token its own), other frames zeros."""
        side2 = self.side * self.side
        cls = int(self.class_token)
        out = hidden.new_zeros(frames, side2 + cls, hidden.shape[-1])
        alive = torch.unique(tokens.frame)
        cells = (alive[:, None] * side2 + torch.arange(side2, device=alive.device)).flatten()
        holder = tokens.holder[cells]
        if bool((holder < 0).any()):
            raise RuntimeError("a tower method dropped patches of a frame whose grid LLaVA's pooling needs whole")
        out[alive, cls:] = hidden[holder].view(alive.numel(), side2, -1)
        if cls:
            first = torch.nonzero(tokens.cell < 0).flatten()
            out[tokens.frame[first], 0] = hidden[first]
        return out
