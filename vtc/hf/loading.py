"""Loading a real checkpoint the way users do: `AutoModelForImageTextToText` + `AutoProcessor`."""

from __future__ import annotations

from typing import Any

import torch

from vtc.core.loading import register_loader

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str):
    """ "auto" (the checkpoint's dtype) or a torch dtype by name."""
    if name == "auto":
        return "auto"
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(name_or_path: str, dtype: str = "auto", device: str = "auto", **from_pretrained: Any):
    """(model, processor) for a checkpoint id or path. `device="auto"` spreads the model over the GPUs
    (`device_map="auto"`) when there are any and stays on the CPU otherwise; any other value is the device_map.
    `from_pretrained` goes to the model's `from_pretrained` (e.g. `attn_implementation="flash_attention_2"`)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    kwargs: dict[str, Any] = {"dtype": resolve_dtype(dtype), **from_pretrained}
    if device == "auto":
        if torch.cuda.is_available():
            kwargs["device_map"] = "auto"
    else:
        kwargs["device_map"] = device
    model = AutoModelForImageTextToText.from_pretrained(name_or_path, **kwargs).eval()
    processor = AutoProcessor.from_pretrained(name_or_path)
    return model, processor


def load_siglip_vision(name_or_path: str, dtype: torch.dtype = torch.float32):
    """(SigLIP vision model, loading info) of a SigLIP checkpoint (a SiglipModel checkpoint loads too: its text
    weights are reported as unexpected)."""
    from transformers import SiglipVisionModel

    return SiglipVisionModel.from_pretrained(name_or_path, dtype=dtype, output_loading_info=True)


register_loader("vlm", load_model)
register_loader("siglip_vision", load_siglip_vision)
