"""Probes shared by the per-method tests: what the language model receives, what a connect plugin is given, and a
frame encoder whose right answer is known (samplers)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

import vtc
from vtc.core.pipeline import Pipeline
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


@vtc.method("spy", paper="test probe")
class ConnectSpy(vtc.Method):
    """A connect method that asks for the vision statistics `stats`, records the tokens and context it is given,
    and keeps everything (`PrepoolSpy` also asks for the pre-pool features)."""

    stats: tuple = ()
    seen: list = dataclasses.field(default_factory=list)  # shared with the pipeline's bound copy

    reduces_tokens = False

    def vision_stats(self, family):
        return list(self.stats)

    def connect(self, tokens, ctx):
        self.seen.append((tokens, ctx))
        return tokens


@vtc.method("spy", paper="test probe")
class PrepoolSpy(ConnectSpy):
    prepool = True


def renamed(cls, name: str, **attributes):
    """`cls` again, as a test method named `name`, with class attributes overridden."""
    return vtc.method(name, paper="test")(type(f"{cls.__name__}_{name}", (cls,), attributes))


def install_spy(model, spy: ConnectSpy):
    """Install the spy as the only method of a pipeline; returns the installed `ModelPatch` (remove it with
    `.remove()`)."""
    adapter = resolve_adapter(model)
    patch = ModelPatch(adapter, Pipeline(spy, family=adapter.family), StatsRecorder())
    patch.install()
    return patch


def connect_inputs(model, inputs, stats=(), prepool: bool = False):
    """(VideoTokens, Context) a connect plugin asking for `stats` receives for the first video of `inputs`."""
    spy = (PrepoolSpy if prepool else ConnectSpy)(tuple(stats))
    patch = install_spy(model, spy)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        patch.remove()
    return spy.seen[0]


def keep_plugin_source(name: str) -> str:
    """Source of a third-party plugin module defining `name`, a connect method that keeps every token."""
    return (
        "import vtc\n"
        f"@vtc.method({name!r}, paper='x')\n"
        "class Keep(vtc.Method):\n"
        "    def connect(self, tokens, ctx):\n"
        "        return tokens\n"
    )


def fake_distribution(root, module: str, package: str, entry: str, source: str | None = None) -> None:
    """What `pip install` leaves for importlib.metadata: a dist-info folder of `package` exposing `module` in the
    `vtc` entry-point group as `entry` (and the module itself, when `source` is given), under `root`."""
    if source is not None:
        (root / f"{module}.py").write_text(source)
    dist = root / f"{module}-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[vtc]\n{entry} = {module}\n")


# --- samplers: an encoder whose right answer is known -------------------------------------------------------------
class ColourEncoder:
    """Image features = mean RGB of the frame; the text "red" is (1, 0, 0): red frames score highest."""

    key = "test:colour"
    logit_scale = 100.0
    logit_bias = 0.0

    def __init__(self):
        self.images_encoded = 0

    def encode_images(self, frames):
        self.images_encoded += len(frames)
        return torch.as_tensor(frames, dtype=torch.float32).mean(dim=(1, 2)) + 1.0

    def encode_text(self, texts):
        table = {"red": [1.0, 0.0, 0.0], "blue": [0.0, 0.0, 1.0]}
        return torch.tensor([table[next(w for w in t.split() if w in table)] for t in texts])


def coloured_clip(seconds: int = 20, fps: int = 4, red=(12, 13), blue=(3,), size: int = 32) -> np.ndarray:
    """A grey [seconds * fps, size, size, 3] clip, red during the seconds in `red` and blue during those in `blue`."""
    frames = np.full((seconds * fps, size, size, 3), 90, dtype=np.uint8)
    for s in red:
        frames[s * fps : (s + 1) * fps, :, :, 0] = 250
    for s in blue:
        frames[s * fps : (s + 1) * fps, :, :, 2] = 250
    return frames


# --- the conformance matrix, split over two files -----------------------------------------------------------------
def matrix_half(k: int) -> list:
    """The conformance cases of every other family of the registry, starting at family `k` (0 or 1)."""
    from vtc.core.families import family_names
    from vtc.testing import conformance

    families = set(family_names()[k::2])
    return [case for case in conformance.cases() if case.family in families]


def record_kept_cells(monkeypatch) -> list[torch.Tensor]:
    """The grid cells every `connect_video` call of the HF backend keeps (ascending), one entry per item, in the order
    the prefill compresses them: what a test compares with the cells a vLLM server keeps."""
    import vtc.hf.patching
    from vtc.core.engine import grid_cells

    kept: list[torch.Tensor] = []
    original = vtc.hf.patching.connect_video

    def recording(*args, **kwargs):
        tokens, out = original(*args, **kwargs)
        kept.append(grid_cells(out).sort().values.cpu())
        return tokens, out

    monkeypatch.setattr(vtc.hf.patching, "connect_video", recording)
    return kept


def record_survivors(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
    """Every `connect_video` call of the HF and the vLLM backend, recorded as (the encode stage's surviving cells,
    their weights or None, their features with Qwen3-VL's DeepStack taps appended), so a test compares what the two
    backends hand the connect stage."""
    import vtc.hf.patching
    from vtc.vllm import models as vllm_models

    recorded: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []

    def recorder(original):
        def connect_video(*args, **kwargs):
            embeds = kwargs.get("embeds", args[1] if len(args) > 1 else None)
            deepstack = (kwargs.get("extras") or {}).get("deepstack")
            if deepstack is not None:  # HF: [N, taps, D]; vLLM: [N, taps * D]
                embeds = torch.cat([embeds, deepstack.flatten(1).to(embeds.device, embeds.dtype)], dim=-1)
            survivors, weights = kwargs["survivors"], kwargs.get("survivor_weights")
            weights = None if weights is None else weights.float().cpu()
            recorded.append((survivors.cpu(), weights, embeds[survivors.to(embeds.device)].float().cpu()))
            return original(*args, **kwargs)

        return connect_video

    monkeypatch.setattr(vtc.hf.patching, "connect_video", recorder(vtc.hf.patching.connect_video))
    monkeypatch.setattr(vllm_models, "connect_video", recorder(vllm_models.connect_video))
    return recorded
