"""Models loaded the way users load them (from_pretrained, offline), and dispatched with accelerate
(`device_map` with layers offloaded: accelerate's hooks wrap forward and move weights in and out)."""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

import vtc
from tests.conftest import FAMILIES, model_and_processor, single_inputs, videos


@functools.lru_cache(maxsize=None)
def saved(family: str) -> str:
    model, processor = model_and_processor(family)
    path = tempfile.mkdtemp(prefix=f"vtc-{family}-")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def offload_map(model) -> dict[str, str]:
    """Every second decoder layer on 'disk' (accelerate offload), everything else on the CPU."""
    adapter = vtc.api.resolve_adapter(model)
    prefix = "model.language_model"
    device_map = {name: "cpu" for name, _ in model.named_children() if name != "model"}
    for name, _ in adapter.outer.named_children():
        if name != "language_model":
            device_map[f"model.{name}"] = "cpu"
    for name, _ in adapter.outer.named_parameters(recurse=False):  # e.g. LLaVA-OneVision's image_newline
        device_map[f"model.{name}"] = "cpu"
    for name, _ in adapter.text_model.named_children():
        if name != "layers":
            device_map[f"{prefix}.{name}"] = "cpu"
    for i in range(len(adapter.decoder_layers)):
        device_map[f"{prefix}.layers.{i}"] = "disk" if i % 2 else "cpu"
    return device_map


@pytest.mark.parametrize("family", FAMILIES)
def test_from_pretrained_then_patch_and_generate(family):
    path = saved(family)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    with vtc.patch(model, "uniform+fastv", retention=0.3, processor=processor) as handle:
        inputs = handle.prepare(processor, videos()[0], "What happens?", num_frames=8, fps=8)
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert handle.stats().visual_tokens_out < handle.stats().visual_tokens_in
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
@pytest.mark.parametrize("method", ["random", "fastv", "framefusion"])
def test_accelerate_offloaded_model_matches(family, method):
    path = saved(family)
    plain = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    dispatched = AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, device_map=offload_map(plain), offload_folder=tempfile.mkdtemp()
    ).eval()
    assert hasattr(dispatched.model.language_model.layers[1], "_hf_hook")
    inputs = single_inputs(family)
    # parameters that fit the 4-layer test models (FrameFusion: the official 28-layer cost schedule, since at
    # retention 0.3 its merge steps alone spend more than a 4-layer budget)
    params = vtc.registry()[method].testing.params
    with vtc.patch(plain, method, retention=0.3, **params), torch.no_grad():
        expected = plain(**inputs).logits
    with vtc.patch(dispatched, method, retention=0.3, **params) as handle:
        with torch.no_grad():
            got = dispatched(**inputs).logits
        dispatched.generate(**inputs, max_new_tokens=2, do_sample=False)
        assert handle.stats().visual_tokens_out < handle.stats().visual_tokens_in
    torch.testing.assert_close(got, expected)
    with torch.no_grad():
        torch.testing.assert_close(dispatched(**inputs).logits, plain(**inputs).logits)
