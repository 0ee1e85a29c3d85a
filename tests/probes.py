"""Probes shared by the per-method tests: what the language model receives, and what a connect plugin is given."""

from __future__ import annotations

import torch

import vtc
from vtc.hookspecs import hookimpl


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


class ConnectSpy:
    """A connect plugin that asks for the vision statistics `wants` asks for, records the tokens and context it
    gets, and keeps everything."""

    def __init__(self, wants, family: str):
        self.stats = wants.vision_stats(family)
        self.needs_prepool = getattr(wants, "needs_prepool", False)
        self.seen = []

    def vision_stats(self, family):
        return self.stats

    @hookimpl
    def vtc_connect(self, tokens, ctx):
        self.seen.append((tokens, ctx))
        return tokens


def connect_inputs(model, inputs, wants, family: str):
    """(VideoTokens, Context) a connect plugin like `wants` receives for the first video of `inputs`."""
    pipeline = vtc.api.Pipeline("random", retention=1.0)
    spy = ConnectSpy(wants, family)
    pipeline.entries[0].plugin = spy
    patch = vtc.api.ModelPatch(vtc.api.resolve_adapter(model), pipeline, vtc.api.StatsRecorder())
    patch.install()
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        patch.remove()
    return spy.seen[0]
