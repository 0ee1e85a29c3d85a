"""The hook specifications: one per inference stage, plus method registration.

A method plugin is an object with `@hookimpl` methods named after the stages it acts in (see
`vtc.core.contract.MethodPlugin`). pluggy is used for two things: discovering plugin modules (built-ins and the
entry-point group `vtc`) and checking that every `@hookimpl` matches a spec below (name and argument names).
Hooks are never dispatched through pluggy: the pipeline calls each plugin's hook itself, passing one plugin's
output to the next.

Order: a pipeline sorts its plugins once, by the earliest stage each acts in (sample < encode < connect <
prefill), then by their place in the spec string; every stage calls its plugins in that order. So in
`"vidcom2+divprune"` VidCom² runs first, and in `"fastvid+quota"` QuoTA's connect hook runs before FastVID's,
because QuoTA already acts at the sample stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from vtc.core.contract import LLMState, Video
    from vtc.core.registry import Registry
    from vtc.core.tokens import Context, VideoTokens

hookspec = pluggy.HookspecMarker("vtc")
hookimpl = pluggy.HookimplMarker("vtc")

STAGES = ("sample", "encode", "connect", "prefill")


@hookspec
def vtc_register_methods(registry: Registry) -> None:
    """Called once at discovery. Call `registry.add(MethodInfo(...))` for every method this module provides.

    Built-in methods live in `vtc_plugins`; third-party packages expose a module implementing this hook
    through the entry-point group `vtc`.
    """


@hookspec
def vtc_sample(video: Video, ctx: Context) -> list[int]:
    """Choose which frames of a video the processor sees. Runs before the processor, in `handle.prepare`,
    `vtc.prepare_inputs` and `vtc run`.

    video: `vtc.media.video.VideoSource` (metadata + lazy frame access); ctx: `Context` with `question`,
    `family`, `num_frames` (the caller's request, or None), `model` and `processor`.
    Return: a sorted, non-empty list of frame indices into the decoded video. Exactly one plugin of a pipeline
    may own frame selection (`owns={"frame_selection"}`); with none, the pipeline samples uniformly. What the
    hook computes for later stages of this prompt goes in `ctx.prepared[method_name]`.
    """


@hookspec
def vtc_encode(vision, ctx: Context) -> None:
    """Reserved: act inside the vision tower. No backend runs this stage yet, so `vtc.patch` refuses methods
    that declare it (vision-tower attention is offered to connect plugins through `vision_stats`)."""


@hookspec
def vtc_connect(tokens: VideoTokens, ctx: Context) -> VideoTokens:
    """Prune or merge the visual tokens of one video after the projector, before the LLM sees them.

    tokens: `VideoTokens` (what earlier connect plugins left; `tokens.grid` is still the original grid);
    ctx: `Context` (question, geometry, vision statistics, pre-pool features, `store`, `report`).
    Return: `tokens` itself to keep everything, or a new `VideoTokens` from `tokens.select`, `tokens.merge` or
    `tokens.merge_dense` (so every per-token field follows). vtc checks the result: at least one token, no
    index twice, and exactly `retained_count(...)` tokens whenever the plugin promises a count.
    """


@hookspec
def vtc_prefill(state: LLMState, ctx: Context) -> None:
    """Act inside the LLM: called at `state.point == "layer_start"` (before a decoder layer) and
    "after_attention" (on the residual stream after attention, before the MLP) of every layer during
    prefill; during decoding only for methods that declare `acts_during_decode`.

    state: `LLMState` (hidden states, token layout, attention rows, projections).
    Return: None; change the sequence through `state.keep(...)` / `state.merge_mean(...)` /
    `state.replace_hidden(...)`.
    """
