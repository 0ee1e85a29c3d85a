"""Probes shared by the per-method tests: what the language model receives, and what a connect plugin is given."""

from __future__ import annotations

import dataclasses

import torch

import vtc
from vtc.core.hookspecs import hookimpl
from vtc.core.pipeline import Pipeline
from vtc.core.registry import MethodInfo, Registry
from vtc.core.stats import StatsRecorder
from vtc.hf.adapters import resolve_adapter
from vtc.hf.patching import ModelPatch


def llm_inputs(model, inputs, method: str | None = None, **kwargs):
    """(inputs_embeds of row 0, position_ids, handle) the language model receives, with `method` patched in for
    this one forward when given (handle None otherwise; after the call it is unpatched but keeps its stats and
    plugins)."""
    seen = {}

    def grab(module, args, kw):
        seen.setdefault("embeds", kw["inputs_embeds"])
        seen.setdefault("positions", kw.get("position_ids"))

    text = vtc.api.resolve_adapter(model).text_model
    handle = vtc.patch(model, method, **kwargs) if method else None
    probe = text.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        probe.remove()
        if handle is not None:
            handle.unpatch()
    return seen["embeds"][0], seen["positions"], handle


@dataclasses.dataclass
class SpyParams:
    pass


class ConnectSpy:
    """A connect plugin that asks for the vision statistics `stats` (and the pre-pool features with `prepool`),
    records the tokens and context it is given, and keeps everything."""

    def __init__(self, stats=(), prepool: bool = False):
        self.stats = list(stats)
        self.prepool = prepool
        self.seen = []

    def vision_stats(self, family):
        return self.stats

    @hookimpl
    def vtc_connect(self, tokens, ctx):
        self.seen.append((tokens, ctx))
        return tokens


def install_spy(model, spy: ConnectSpy):
    """Install the spy as the only method of a pipeline (declared like any plugin, through its own registry);
    returns the installed `ModelPatch` (remove it with `.remove()`)."""
    info = MethodInfo(
        name="spy",
        factory=lambda params, retention: spy,
        params=SpyParams,
        stages=("connect",),
        paper="test probe",
        reduces_tokens=False,
        vision_stats=True,
        prepool=spy.prepool,
    )
    methods = Registry()
    methods.add(info)
    adapter = resolve_adapter(model)
    pipeline = Pipeline("spy", methods=methods, family=adapter.family)
    patch = ModelPatch(adapter, pipeline, StatsRecorder())
    patch.install()
    return patch


def connect_inputs(model, inputs, stats=(), prepool: bool = False):
    """(VideoTokens, Context) a connect plugin asking for `stats` receives for the first video of `inputs`."""
    spy = ConnectSpy(stats, prepool)
    patch = install_spy(model, spy)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        patch.remove()
    return spy.seen[0]
