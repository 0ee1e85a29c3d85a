"""What a `connect` plugin can ask the vision tower for: `VisionStat(kind, layer)`.

A plugin asks with `vision_stats(self, family) -> list[VisionStat]`; in `vtc_connect` it reads
`ctx.vision[stat]`, one tensor per frame of its video:

  LLaVA families (per input frame, on the encoder's patch grid, CLS first where the tower has one):
    "received"   [F, L]          attention each key receives: sum over queries, mean over heads
    "cls"        [F, heads, L]   the CLS query's attention row (CLIP towers only)
    "keys"       [F, L, d]       keys averaged over heads (VisionZip's similarity metric)
    "features"   [F, L, D]       the layer's output hidden states, in the tower's dtype: at layer -1 the tensor
                                 the projector receives (`hidden_states[vision_feature_layer]`, before the
                                 tower's post_layernorm; FastVID's SigLIP MAP head reads it). LLaVA only.
  Qwen families (per temporal patch, on the LLM token grid: patch values averaged over each 2x2 merge unit,
  window permutation of Qwen2.5-VL undone):
    "received"   [T, H*W]        as above
    "keys"       [T, H*W, d]
    "mean_query" [T, H*W]        FastVID's Qwen2.5-VL score: softmax over merge units of the mean query
                                 against the units' mean keys, averaged over heads
`layer` counts from the start (>= 0) or from the layer whose output the model uses as features (-1 = that
layer, -2 = the one before, as `attentions[-2]` in the official LLaVA code).

Each backend captures query/key its own way (the HF backend: `vtc.hf.vision`; vLLM: `vtc.vllm.vision`) and
computes the statistics with the one function here, `frame_stats`, so a plugin gets the same tensors from either.
"""

from __future__ import annotations

import dataclasses

import torch

Tensor = torch.Tensor
FRAME_CHUNK = 4  # frames whose attention maps are materialised at once

KINDS = ("received", "cls", "keys", "mean_query", "features")
# kinds read from a layer's output rather than computed from its attention
HIDDEN_KINDS = ("features",)


@dataclasses.dataclass(frozen=True)
class VisionStat:
    kind: str
    layer: int = -1

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown vision statistic {self.kind!r}; choose one of {', '.join(KINDS)}")


def frame_stats(query: Tensor, key: Tensor, scaling: float, kinds: set[str]) -> dict[str, Tensor]:
    """Statistics of full attention within each item of a batch: query/key [n, heads, L, d] (in chunks of
    `FRAME_CHUNK` items, so the full attention maps never sit in memory). `kinds` from `KINDS` other than the
    hidden-state ones."""
    out: dict[str, list[Tensor]] = {k: [] for k in kinds}
    for start in range(0, query.shape[0], FRAME_CHUNK):
        q = query[start : start + FRAME_CHUNK].float()
        k = key[start : start + FRAME_CHUNK].float()
        if "received" in kinds or "cls" in kinds:
            probs = torch.softmax((q @ k.transpose(-1, -2)) * scaling, dim=-1)  # [c, heads, L, L]
            if "received" in kinds:
                out["received"].append(probs.sum(dim=-2).mean(dim=1))
            if "cls" in kinds:
                out["cls"].append(probs[:, :, 0, :])
        if "keys" in kinds:
            out["keys"].append(k.mean(dim=1))
        if "mean_query" in kinds:
            # mean query against keys averaged over merge units of 4 consecutive patches (Qwen2.5-VL order)
            mean_q = q.mean(dim=-2, keepdim=True)  # [c, heads, 1, d]
            units = k.reshape(*k.shape[:2], k.shape[2] // 4, 4, k.shape[3]).mean(dim=3)
            probs = torch.softmax((mean_q @ units.transpose(-1, -2)) * scaling, dim=-1)[:, :, 0]
            out["mean_query"].append(probs.mean(dim=1).repeat_interleave(4, dim=-1))  # back to patch level
    return {name: torch.cat(parts) for name, parts in out.items()}
