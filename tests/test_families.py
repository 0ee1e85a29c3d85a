"""The family registry is the one list of model families: built-ins and third-party families come through the
entry-point group `vtc.families`, loaded on first use; every former family list (adapters, geometry, frame rules,
processor classes, media arguments, tiny models, the conformance matrix) is derived from it, so a family registered
in-process is everywhere at once, and a broken entry point warns and is skipped."""

from __future__ import annotations

import dataclasses
import types
from importlib.metadata import EntryPoint

import pytest
import torch

import vtc
from vtc.core import families
from vtc.core.families import Family, family_names, get_family, register_family, unregister_family
from vtc.core.geometry import FamilyGeometry, default_geometry
from vtc.core.pipeline import Pipeline
from vtc.hf import adapters
from vtc.hf.adapters import ADAPTERS, SUPPORTED_FAMILIES, config_adapter, resolve_adapter
from vtc.hf.adapters.llava_next_video import LlavaNextVideoAdapter
from vtc.hf.patching import media_kwargs
from vtc.media.inputs import processor_family
from vtc.media.video import sampling_rule
from vtc.testing import conformance, fixtures, tiny

BUILTIN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision", "llava_next_video", "internvl")


class FakeModelForConditionalGeneration(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.generation_config = types.SimpleNamespace()


class FakeProcessor:
    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=1)


class FakeAdapter(LlavaNextVideoAdapter):
    family = "fake_vl"
    class_names = ("FakeModelForConditionalGeneration",)


def fake_builder(shape):
    return FakeModelForConditionalGeneration(), FakeProcessor()


FAKE = Family(
    name="fake_vl",
    geometry=FamilyGeometry("fake_vl", mrope=False),
    model_classes=("FakeModelForConditionalGeneration",),
    processor_classes=("FakeProcessor",),
    adapter="tests.test_families:FakeAdapter",
    frame_rule="middle",
    media_kwargs=("pixel_values_fake", "mm_encoder_outputs"),
    video_pixels="pixel_values_fake",
    vision_stats=frozenset({"received"}),
    features=frozenset({"frame_text"}),
    tiny=fake_builder,
)


@pytest.fixture
def fake_family():
    register_family(FAKE)
    try:
        yield FAKE
    finally:
        unregister_family(FAKE.name)


def test_builtin_families_come_from_the_entry_points():
    assert set(family_names()) == set(BUILTIN)
    assert {ep.name for ep in families._entry_points() if ep.value.startswith("vtc.")} == set(BUILTIN)
    assert set(SUPPORTED_FAMILIES) == set(BUILTIN) == {a.family for a in ADAPTERS}
    assert set(fixtures.FAMILIES) == set(tiny.FAMILIES) == set(BUILTIN)
    for name in BUILTIN:
        family = get_family(name)
        assert family.geometry.family == name and default_geometry(name) is family.geometry
        assert family.adapter_class().family == name
        assert family.adapter_class().class_names == family.model_classes
    # the methods' family lists come from the same registry
    assert set(vtc.registry()["random"].card.families) == set(BUILTIN)


def test_unknown_family_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model family 'nope'; known families: .*internvl"):
        get_family("nope")
    with pytest.raises(ValueError, match="unknown model family 'nope'"):
        tiny.build("nope")
    with pytest.raises(ValueError, match="unknown model family 'nope'"):
        Pipeline("random", family="nope")


def test_a_family_registered_in_process_is_everywhere(fake_family):
    assert "fake_vl" in family_names() and "fake_vl" in fixtures.FAMILIES and "fake_vl" in adapters.SUPPORTED_FAMILIES
    assert default_geometry("fake_vl") is FAKE.geometry
    assert sampling_rule("fake_vl") == "middle"
    assert processor_family(FakeProcessor()) == "fake_vl"
    assert "pixel_values_fake" in media_kwargs()
    model, processor = tiny.build("fake_vl")
    assert isinstance(model, FakeModelForConditionalGeneration) and isinstance(processor, FakeProcessor)
    adapter = resolve_adapter(model)
    assert isinstance(adapter, FakeAdapter)
    assert isinstance(config_adapter("fake_vl", object()), FakeAdapter)
    captured = adapter.capture(torch.zeros(1, 3, dtype=torch.long), None, {"pixel_values_fake": torch.zeros(1)})
    assert captured.has_video_media and list(captured.kwargs) == ["pixel_values_fake"]
    # pipelines bind to it; the conformance matrix covers it for every method whose requirements it meets
    assert Pipeline("random", family="fake_vl").family == "fake_vl"
    assert "fake_vl" in vtc.registry()["random"].card.families
    assert "fake_vl" in conformance.supported_families("random")
    assert FAKE.missing({"mrope", "frame_text"}) == ["mrope"]
    # a method that reads a statistic the family does not compute is refused, naming it and what is offered
    with pytest.raises(
        ValueError, match=r"statistic\(s\) keys on fake_vl, which this family does not offer .*received"
    ):
        FAKE.check_vision_stats("visionzip", ["received", "keys"])
    with pytest.raises(ValueError, match="already registered"):
        register_family(dataclasses.replace(FAKE, summary="another"))
    unregister_family("fake_vl")
    assert "fake_vl" not in family_names()
    register_family(FAKE)  # the fixture unregisters it


def test_family_records_are_checked():
    geometry = FamilyGeometry("x", mrope=False)
    base = dict(name="x", geometry=geometry, model_classes=("X",), processor_classes=(), adapter="m:C")
    Family(**base)
    for change, message in (
        (dict(frame_rule="ceil"), "frame_rule must be one of round, floor, middle"),
        (dict(features=frozenset({"wings"})), r"unknown feature\(s\) \['wings'\]"),
        (dict(vision_stats=frozenset({"gaze"})), r"unknown vision statistic kind\(s\) \['gaze'\]"),
        (dict(features=frozenset({"mrope"})), "'mrope' feature and geometry.mrope must agree"),
        (dict(geometry=FamilyGeometry("y", mrope=False)), "geometry.family is 'y'"),
        (dict(adapter="no_colon"), "'module:Class' path"),
        (dict(video_pixels="pixels"), "video_pixels 'pixels' must be one of media_kwargs"),
        (dict(name="two words"), "identifier"),
    ):
        with pytest.raises(ValueError, match=message):
            Family(**{**base, **change})
    with pytest.raises(TypeError, match="expects a vtc.core.families.Family"):
        register_family("qwen2_vl")


def test_a_broken_entry_point_warns_naming_it_and_is_skipped(monkeypatch):
    real = families._entry_points()
    broken = [
        EntryPoint("gone", "vtc_no_such_package.family:FAMILY", families.ENTRY_POINT_GROUP),
        EntryPoint("notafamily", "vtc.core.families:FEATURES", families.ENTRY_POINT_GROUP),
        EntryPoint("renamed", "vtc.hf.adapters.qwen2_vl:FAMILY", families.ENTRY_POINT_GROUP),
    ]
    monkeypatch.setattr(families, "_entry_points", lambda: real + broken)
    families.reload_families()
    try:
        with pytest.warns(RuntimeWarning) as record:
            names = family_names()
        messages = [str(w.message) for w in record]
        assert set(names) == set(BUILTIN)
        assert any(
            "vtc family 'gone'" in m and "vtc_no_such_package" in m and "ModuleNotFoundError" in m for m in messages
        )
        assert any("'notafamily'" in m and "not a vtc.core.families.Family" in m for m in messages)
        assert any("'renamed'" in m and "declares family 'qwen2_vl'" in m for m in messages)
    finally:
        monkeypatch.undo()
        families.reload_families()
    assert set(family_names()) == set(BUILTIN)
