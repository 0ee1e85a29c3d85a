"""Probes shared by the per-method tests: what the language model receives, and what a connect plugin is given."""

from __future__ import annotations

import torch

import vtc
from vtc.core.hookspecs import hookimpl


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
    """A connect plugin that asks for the vision statistics `stats` (and the pre-pool features with
    `needs_prepool`), records the tokens and context it is given, and keeps everything."""

    def __init__(self, stats=(), needs_prepool: bool = False):
        self.stats = list(stats)
        self.needs_prepool = needs_prepool
        self.seen = []

    def vision_stats(self, family):
        return self.stats

    @hookimpl
    def vtc_connect(self, tokens, ctx):
        self.seen.append((tokens, ctx))
        return tokens


def install_spy(model, spy: ConnectSpy):
    """Patch with `random` at retention 1 and swap its plugin object for the spy before the hooks install;
    returns the installed `ModelPatch` (remove it with `.remove()`)."""
    pipeline = vtc.api.Pipeline("random", retention=1.0)
    pipeline.entries[0].plugin = spy
    patch = vtc.api.ModelPatch(vtc.api.resolve_adapter(model), pipeline, vtc.api.StatsRecorder())
    patch.install()
    return patch


def connect_inputs(model, inputs, stats=(), needs_prepool: bool = False):
    """(VideoTokens, Context) a connect plugin asking for `stats` receives for the first video of `inputs`."""
    spy = ConnectSpy(stats, needs_prepool)
    patch = install_spy(model, spy)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        patch.remove()
    return spy.seen[0]
