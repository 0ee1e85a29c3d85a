"""The attention function vtc registers with transformers (`AttentionInterface`) for `prefill` plugins.

It does two things the stock SDPA path cannot:
  * hand a plugin the attention probabilities of a few query rows (e.g. FastV's last prompt token) by
    computing just those rows explicitly (`vtc_kernels.attention.attention_rows`), while the layer's output
    still comes from SDPA;
  * build the right mask once a layer sees a shorter (pruned/merged) sequence than the mask transformers
    prepared for the full prompt, during prefill and later decode steps (the KV cache is then ragged
    across layers).
While the sequence is untouched it calls the model's original attention function with transformers' own
mask, so outputs are bit-identical to the unpatched model.

Registration is global (a new name in two registries) but inert: only models whose text config was
switched to `vtc_sdpa` by `vtc.patch` use it, and a module vtc does not know falls back to SDPA.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

ATTENTION_NAME = "vtc_sdpa"

# attention module -> the LLMRuntime driving it (filled by LLMRuntime.install, emptied by remove)
RUNTIME_BY_MODULE: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()


def ensure_registered() -> None:
    """Register `vtc_sdpa` with transformers' attention and mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if ATTENTION_NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    AttentionInterface.register(ATTENTION_NAME, vtc_attention)


def original_attention(name: str | None, module: torch.nn.Module | None = None) -> Callable:
    """The attention function a module used before patching (`eager` lives in each modeling file)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in (None, ATTENTION_NAME):
        name = "sdpa"
    if name == "eager" and module is not None:
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def vtc_attention(module, query, key, value, attention_mask, **kwargs):
    runtime = RUNTIME_BY_MODULE.get(module)
    if runtime is None:
        return original_attention("sdpa")(module, query, key, value, attention_mask, **kwargs)
    return runtime.attention(module, query, key, value, attention_mask, **kwargs)
