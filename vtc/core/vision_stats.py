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

Each backend computes them its own way (the HF backend: `vtc.hf.vision`).
"""

from __future__ import annotations

import dataclasses

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
