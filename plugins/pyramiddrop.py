"""PyramidDrop: "Accelerating Your Large Vision-Language Models via Pyramid Visual Redundancy Reduction" (Xing et al.,
CVPR 2025; arXiv 2410.17247). Official code: Cooperx521/PyramidDrop, read at its latest commit 6444f304
(`llava/model/modeling_llama_pdrop.py`: `pdrop_forward`, `pdrop_rank_drop`; `llava/model/llava_arch.py`:
`prepare_inputs_labels_for_multimodal_pdrop`; `llava/eval/model_vqa_loader.py`; `scripts/v1_5/pdrop_eval/*.sh`).
Also read: ModelTC/LightCompress 9701d035 `llmc/compression/token_reduction/pyramiddrop.py`, the same algorithm as
decoder-layer pre-hooks (its code handles the LLaVA models only).

Visual redundancy grows with depth, so the LLM is cut into stages at `layer_list` (8, 16, 24) and each stage keeps
lambda (0.5) of the visual tokens the stage before it kept. At the start of a stage layer l, layer l's own attention
(its input norm, q/k projections and RoPE, on the stream entering it) of the last instruction token, softmax in
float32 over every key, averaged over heads, ranks the surviving visual tokens; the top int(N * lambda^s) stay, in
their original order, and layer l runs on them. Layers 0 .. l_1 - 1 see every token (the official ratio list
starts with 1.0). Stage: prefill.

Where vtc differs from the official code, and why:
* Positions: survivors keep their original RoPE positions (vtc's rule inside the LLM, and the only one on M-RoPE
  families, where a position is a (t, h, w) cell). The official code renumbers the sequence 0..n-1 after every stage
  and shifts decode positions down by the tokens each stage dropped.
* Grouped-query attention: the official `q @ k^T` has one key head per query head (Vicuna); vtc reads key head
  h // (H / H_kv) for query head h, as the model's attention does (the official product fails to broadcast there).
* Several videos in one prompt are ranked together as one pool of visual tokens with one budget per batch row
  (int(N_row * lambda^s), N_row = the row's visual tokens entering the LLM); the official code has one image
  per sample. Batch rows are ranked independently (the official code pads and re-batches them the same way).
* `retention` sets the mean fraction of visual tokens over the LLM layers (below): the official code takes the
  ratio list directly; `ratio=` does that here.
"""

from __future__ import annotations

import re
import warnings

import torch

import vtc
from vtc_kernels.select import segmented_topk

LAYER_LIST = (8, 16, 24)  # --layer_list '[8,16,24]' in every official eval script
RATIO = 0.5  # lambda: --image_token_ratio_list "[0.5,0.25,0.125]" = lambda^1, lambda^2, lambda^3


def stage_ratios(ratio: float, num_stages: int) -> list[float]:
    """The fraction of the original visual tokens each stage keeps: lambda^1 .. lambda^S (the official
    `image_token_ratio_list` after the 1.0 that `model_vqa_loader.py` inserts for the layers before stage 1)."""
    return [ratio**s for s in range(1, num_stages + 1)]


def kept_count(num_visual: int, ratio: float) -> int:
    """Visual tokens alive from a stage on: int(N * ratio_s), as `pdrop_rank_drop` computes `keep_length` (N: the
    visual tokens entering the LLM)."""
    return int(num_visual * ratio)


def stage_counts(num_visual: int, ratios: list[float]) -> list[int]:
    """The visual tokens alive from each stage on."""
    return [kept_count(num_visual, r) for r in ratios]


def layer_mean(ratio: float, layer_list: tuple[int, ...], num_layers: int) -> float:
    """Mean fraction of visual tokens over `num_layers` layers when layers [l_s, l_{s+1}) keep lambda^s of them
    (layers before l_1 keep all; rounding to whole tokens ignored)."""
    bounds = list(layer_list) + [num_layers]
    total = layer_list[0] + sum((bounds[s + 1] - bounds[s]) * ratio ** (s + 1) for s in range(len(layer_list)))
    return total / num_layers


def ratio_for_retention(retention: float, layer_list: tuple[int, ...], num_layers: int) -> float:
    """lambda whose `layer_mean` is `retention` (bisection: the mean grows with lambda); 0 when the retention is at or
    below the floor layer_list[0] / num_layers (the layers before the first stage see every token)."""
    if retention >= 1.0:
        return 1.0
    if retention <= layer_list[0] / num_layers:
        return 0.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if layer_mean(mid, layer_list, num_layers) < retention:
            low = mid
        else:
            high = mid
    # rounded so that a retention a "round" lambda reaches gives that lambda (0.46875 on (8, 16, 24) of 32 layers:
    # 0.5, whose int(N * 0.25) is not one token short as int(N * 0.24999999999999997) would be)
    return round(high, 12)


def rank_and_drop(scores: torch.Tensor, visual: torch.Tensor, valid: torch.Tensor, budgets: list[int]) -> torch.Tensor:
    """Keep mask [B, n]: every real non-visual slot, plus the top `budgets[b]` visual slots of row b by `scores`
    [B, n] (the head-averaged attention of the last instruction token), as the official `topk(keep_length)`."""
    keep = valid & ~visual
    candidates = visual & valid
    pool = torch.nonzero(candidates.flatten()).flatten()  # row after row: one segment per batch row
    per_row = candidates.sum(dim=1)
    offsets = torch.cat([per_row.new_zeros(1), torch.cumsum(per_row, 0)])
    kept = segmented_topk(scores.flatten()[pool.to(scores.device)], offsets, torch.tensor(budgets))
    keep.view(-1)[pool[kept.to(pool.device)]] = True
    return keep


def parse_layers(text: str) -> tuple[int, ...]:
    """ "8,16,24", "8|16|24" (a separator lmms-eval's comma-split model args leave alone) or "[8, 16, 24]"."""
    parts = [p for p in re.split(r"[\s,|;]+", text.strip().strip("[]()")) if p]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"pyramiddrop: layer_list must list layer indices, e.g. 8,16,24 or 8|16|24; got {text!r}"
        ) from None


@vtc.method(
    "pyramiddrop",
    paper="PyramidDrop: Accelerating Your Large Vision-Language Models via Pyramid Visual Redundancy Reduction "
    "(CVPR 2025)",
    url="https://arxiv.org/abs/2410.17247",
    summary="in stages (layers 8, 16, 24) keep lambda = 1/2 of the visual tokens, ranked by the last instruction "
    "token's attention",
    retention_note="retention is the mean fraction of visual tokens over the LLM layers (a FLOPs budget), solved "
    "for lambda on the model's depth; the layers before the first stage see every token, so below "
    "layer_list[0] / depth it warns and keeps that floor (every visual token dropped at the first stage)",
    test_params={"layer_list": (1, 2, 3)},  # the tiny test models have 4 layers
)
class PyramidDrop(vtc.Method):
    """Stages at `layer_list`; at the start of each, that layer's attention of the last prompt token keeps the top
    lambda of the visual tokens the previous stage left."""

    layer_list: tuple[int, ...] = vtc.param(
        LAYER_LIST,
        doc="stage layers l_s: before layer l_s runs, its attention ranks and drops (strictly increasing, >= 1)",
    )
    ratio: float | None = vtc.param(
        None,
        range="(0, 1]",
        doc="lambda: each stage keeps this fraction of the previous stage's visual tokens; "
        "default: solved from retention (mean over layers), else 0.5",
    )

    owns = frozenset({"llm_token_schedule"})
    query_aware = True
    retention_reference = "layer_mean"

    def __post_init__(self) -> None:
        if isinstance(self.layer_list, str):  # from the command line or lmms-eval model args
            self.layer_list = parse_layers(self.layer_list)
        elif isinstance(self.layer_list, list):
            self.layer_list = tuple(self.layer_list)
        super().__post_init__()

    def validate(self) -> None:
        layers = self.layer_list
        if (
            not layers
            or any(isinstance(x, bool) or not isinstance(x, int) for x in layers)
            or layers[0] < 1
            or any(b <= a for a, b in zip(layers, layers[1:]))
        ):
            raise ValueError(
                "pyramiddrop: layer_list must be strictly increasing layer indices >= 1 (layer l_s drops before it "
                f"runs; layers before the first stage see every token), e.g. (8, 16, 24); got {layers!r}"
            )

    def lam(self, num_layers: int) -> float:
        """lambda: the parameter, else solved from the retention on this depth, else the official 0.5."""
        if self.ratio is not None:
            return self.ratio
        if self.retention is None:
            return RATIO
        floor = self.layer_list[0] / num_layers
        if self.retention < floor:
            warnings.warn(
                f"pyramiddrop: retention {self.retention:g} is below what layer_list {self.layer_list} reaches on "
                f"this {num_layers}-layer model ({floor:.3f}: layers 0..{self.layer_list[0] - 1} see every visual "
                "token); it keeps that floor and drops every visual token at the first stage. Give an earlier "
                "first stage (layer_list=...) for a lower retention",
                RuntimeWarning,
                stacklevel=2,
            )
        return ratio_for_retention(self.retention, self.layer_list, num_layers)

    def prefill(self, llm, ctx):
        if llm.point != "layer_start":
            return
        if llm.layer == 0:
            if self.layer_list[-1] >= llm.num_layers:
                raise ValueError(
                    f"pyramiddrop: layer_list {self.layer_list} needs a language model with more than "
                    f"{self.layer_list[-1]} layers, this one has {llm.num_layers} (0 to {llm.num_layers - 1}); "
                    f"choose stage layers below {llm.num_layers}"
                )
            lam = self.lam(llm.num_layers)
            ctx.state["ratios"] = stage_ratios(lam, len(self.layer_list))
            ctx.report(ratio=lam)
        if llm.layer in self.layer_list:
            self._drop(llm, ctx.state["ratios"][self.layer_list.index(llm.layer)])
        if llm.layer == llm.num_layers - 1:
            alive = (llm.layout.visual & llm.layout.valid).sum(dim=1)
            for count in alive.tolist():  # the count at the last layer, per batch row
                ctx.report(kept=count)

    def _drop(self, llm, ratio: float) -> None:
        layout = llm.layout
        budgets = [kept_count(n, ratio) for n in llm.visual_tokens_in.tolist()]
        alive = (layout.visual & layout.valid).sum(dim=1).tolist()
        if all(b >= a for a, b in zip(alive, budgets)):
            return  # nothing to drop (lambda = 1): no ranking, the model runs as unpatched
        scores = llm.attention_at_start(num_rows=1, upcast=True).mean(dim=1)[:, -1]  # heads averaged, last token
        llm.keep(rank_and_drop(scores, layout.visual, layout.valid, budgets))
