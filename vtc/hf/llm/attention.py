"""How vtc reaches the attention of a patched model, without taking the model's attention implementation away.

`prefill` plugins need two things the model's own attention function cannot give: the attention probabilities of a
few query rows (FastV's last prompt token), and the right mask once a layer sees a shorter (pruned/merged) sequence
than the mask transformers prepared for the whole prompt, during prefill and later decode steps (the KV cache is
then ragged across layers). vtc gets them without replacing the model's implementation:

  * every decoder attention module keeps the implementation the model was loaded with (`sdpa`, `eager`,
    `flash_attention_2`, any function registered with transformers' `AttentionInterface`), read per module from
    its config at patch time;
  * for the length of one attention forward, the module sees a `DispatchConfig` (its own config, except that
    `_attn_implementation` names vtc's dispatcher `vtc`), so its forward hands query/key/value to
    `vtc_attention`; the dispatcher puts the real config back at once and calls the runtime, which calls the
    module's own function (with a mask in that implementation's own format, see `mask_format`) and computes
    requested attention rows separately (`vtc_kernels.attention.attention_rows`);
  * the text model's config is never touched, so transformers builds its masks for the real implementation.

Which implementation each layer runs is documented in `vtc.hf.llm.runtime` and docs/concepts.md ("Attention
implementations").

The vision tower (`vtc.hf.vision`) uses the older route: its config is switched to `vtc_sdpa` (this dispatcher
with SDPA's mask function) while vision statistics are captured. Registration is global (names in transformers'
registries) but inert: only modules in `RUNTIME_BY_MODULE` are routed, anything else falls back to SDPA.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable

import torch

ATTENTION_NAME = "vtc_sdpa"  # the name a config switched by vtc carries (vision capture)
DISPATCH_NAME = "vtc"  # the name a patched decoder attention module sees during its forward

# attention module -> the LLMRuntime (or VisionCapture) driving it (filled by install, emptied by remove)
RUNTIME_BY_MODULE: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()


def ensure_registered() -> None:
    """Register vtc's dispatcher with transformers' attention (and mask) registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if ATTENTION_NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    AttentionInterface.register(ATTENTION_NAME, vtc_attention)
    AttentionInterface.register(DISPATCH_NAME, vtc_attention)


def original_attention(name: str | None, module: torch.nn.Module | None = None) -> Callable:
    """The attention function `name` stands for, as the module's own forward looks it up (`eager` lives in each
    modeling file unless someone registered one)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in (None, ATTENTION_NAME, DISPATCH_NAME):
        name = "sdpa"
    eager = None
    if module is not None:
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)
    if fn is None:
        raise RuntimeError(f"{type(module).__name__} has no eager attention function of its own to run {name!r}")
    return fn


def mask_format(name: str) -> str:
    """The mask an attention implementation takes, from the mask function transformers registered for it:
    "sdpa" (4-D boolean, or None for plain causal), "eager" (4-D additive float, always given), "flash" (2-D
    key padding mask, or None; causality is the function's `is_causal`), "custom" (another mask function, called
    as transformers calls it), or "none" (no mask function: transformers hands it no mask at all, e.g. kernels
    that take packed sequences)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, flash_attention_mask, sdpa_mask

    fn = ALL_MASK_ATTENTION_FUNCTIONS.get(name)
    if fn is None:
        return "none"
    if fn is sdpa_mask:
        return "sdpa"
    if fn is eager_mask:
        return "eager"
    if fn is flash_attention_mask:
        return "flash"
    return "custom"


def mask_function(name: str) -> Callable | None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS.get(name)


class DispatchConfig:
    """What a patched attention module sees as `self.config` while its forward looks up its attention function:
    the module's config in every respect, except `_attn_implementation`, which names vtc's dispatcher. Reads and
    writes go through to the real config."""

    def __init__(self, config: Any) -> None:
        object.__setattr__(self, "_vtc_config", config)

    def __getattr__(self, name: str) -> Any:
        if name == "_vtc_config":  # while being copied or unpickled
            raise AttributeError(name)
        return getattr(self._vtc_config, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._vtc_config, name, value)

    @property
    def _attn_implementation(self) -> str:
        return DISPATCH_NAME

    def __repr__(self) -> str:
        return f"DispatchConfig({self._vtc_config.__class__.__name__}, dispatch={DISPATCH_NAME!r})"


def vtc_attention(module, query, key, value, attention_mask, **kwargs):
    runtime = RUNTIME_BY_MODULE.get(module)
    if runtime is None:
        config = module.__dict__.get("config")
        if isinstance(config, DispatchConfig):  # a module left behind by a runtime that is gone
            module.config = config._vtc_config
            return original_attention(config._vtc_config._attn_implementation, module)(
                module, query, key, value, attention_mask, **kwargs
            )
        return original_attention("sdpa")(module, query, key, value, attention_mask, **kwargs)
    return runtime.attention(module, query, key, value, attention_mask, **kwargs)
