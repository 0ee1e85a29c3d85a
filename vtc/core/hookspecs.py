"""The hook specifications: one per inference stage, plus method registration.

A method plugin is an object with `@hookimpl` methods named after the stages it acts in. The pipeline
calls the plugins of a stage one after another in the order of the spec string (`"a+b"` runs a's hook
before b's), passing the previous plugin's output to the next: pluggy is used for discovery, signature
checking and the stage-timing wrapper, never for ordering.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("vtc")
hookimpl = pluggy.HookimplMarker("vtc")

STAGES = ("sample", "encode", "connect", "prefill")


@hookspec
def vtc_register_methods(registry):
    """Called once at discovery. Call `registry.add(MethodInfo(...))` for every method this module provides.

    Built-in methods live in `vtc_plugins`; third-party packages expose a module implementing this hook
    through the entry-point group `vtc`.
    """


@hookspec(firstresult=True)
def vtc_sample(video, ctx):
    """Choose which frames of a video the processor sees. Runs before the processor, in user code
    (`handle.prepare`) and in `vtc run`.

    video: `vtc.media.video.VideoSource` (metadata + lazy frame access); ctx: `Context` with `question`.
    Return: a sorted list of frame indices into the decoded video. Exactly one plugin may own frame
    selection; when none is given the pipeline samples uniformly.
    """


@hookspec
def vtc_encode(vision, ctx):
    """Act inside the vision tower. `vision` exposes the tower's blocks and captured attention statistics.

    Return: None (encode plugins record what later stages need on `ctx.extra`) or replace features
    through the `vision` object.
    """


@hookspec
def vtc_connect(tokens, ctx):
    """Prune or merge the visual tokens of one video after the projector, before the LLM sees them.

    tokens: `VideoTokens`; ctx: `Context` (question ids/embeds of the prompt text after the video).
    Return: a `VideoTokens` (use `tokens.select` / `tokens.merge` so every per-token field follows).
    """


@hookspec
def vtc_prefill(state, ctx):
    """Act inside the LLM: called at `state.point` == "layer_start" (before a decoder layer) and
    "after_attention" (on the residual stream after attention, before the MLP) of every layer during
    prefill; during decoding only for plugins that set `acts_during_decode = True`.

    state: `vtc.hf.llm.runtime.LLMState` (hidden states, token bookkeeping, captured attention rows).
    Return: None; change the sequence through `state.keep(...)` / `state.merge(...)`.
    """
