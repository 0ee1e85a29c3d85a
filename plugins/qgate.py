"""Q-Gate: query-modulated gating of three keyframe-retrieval experts (abstract only: no paper body, no code; this is
vtc's reading of the abstract, `from-abstracts.md` §7, not a port).

The host LLM reads the question (text only, greedy) and gives each expert a weight; weights under `tau_mute` are
muted. The experts score 1-fps candidate frames with CLIP, each min-max normalised over the candidates:
- Visual Grounding: the best match of an entity the gate named (else the question) with the frame or one of its
  3 x 3 crops (local details);
- Global Matching: the question against the whole frame (scene semantics);
- Contextual Alignment: the question against the subtitles within +-1 s of the frame (narrative); 0 without them.
The fused score `S_t = sum_e g_e s_e,t` picks K frames by BOLT's inverse transform sampling (alpha = 3). A muted
expert is not computed. Stage: sample.

Subtitles are the `subtitles` parameter: a path to an .srt (or WebVTT) file, a list of (start_s, end_s, text), or a
callable that takes the `VideoSource` and returns either (or None), for a loop over many videos.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Sequence

import numpy as np
import torch

import vtc
from vtc.media.encoders import FEATURE_CACHE, clip_encoder, frame_features, video_key
from vtc.media.frame_selection import fps_candidates, inverse_transform_sampling
from vtc.media.host_llm import ask_text

EXPERTS = ("visual_grounding", "global_matching", "contextual_alignment")

# vtc's gating prompt (from-abstracts.md §7: written for the reading, not the authors')
GATE_PROMPT = """You route keyframe retrieval for a video question. Experts:
(A) visual_grounding: small objects, local details, text on objects;
(B) global_matching: overall scene, setting, activity;
(C) contextual_alignment: what is said (subtitles), plot, narrative, reasons.
Subtitles available: {subtitles}.
Question: {question}
Return JSON: {{"reasoning": "...", "weights": {{"visual_grounding": a, "global_matching": b, "contextual_alignment": c}}, "entities": ["..."]}} with a+b+c = 1."""  # noqa: E501

Subtitle = tuple[float, float, str]


# --- subtitles ---------------------------------------------------------------------------------------------------
_TIME = r"(?:(\d+):)?(\d{1,2}):(\d{2})(?:[,.](\d{1,3}))?"
_CUE = re.compile(rf"{_TIME}\s*-->\s*{_TIME}")


def _seconds(h, m, s, ms) -> float:
    return int(h or 0) * 3600 + int(m) * 60 + int(s) + (int(ms.ljust(3, "0")) / 1000 if ms else 0.0)


def parse_srt(text: str) -> list[Subtitle]:
    """(start_s, end_s, text) of every cue of an SRT (or WebVTT) document: the timing line `00:01:02,500 -->
    00:01:04,000`, then the text lines up to a blank line, joined by spaces, markup tags (`<i>`, `{\\an8}`) removed."""
    cues: list[Subtitle] = []
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n").replace("\r", "\n")):
        lines = block.strip().split("\n")
        for i, line in enumerate(lines):
            match = _CUE.search(line)
            if match:
                start, end = _seconds(*match.groups()[:4]), _seconds(*match.groups()[4:])
                body = " ".join(x.strip() for x in lines[i + 1 :] if x.strip())
                body = re.sub(r"<[^>]*>|\{[^}]*\}", "", body).strip()
                if body:
                    cues.append((start, end, body))
                break
    return cues


def load_subtitles(spec: Any, video=None, param: str = "q-gate.subtitles") -> list[Subtitle]:
    """Subtitles from what the `subtitles` parameter holds: None (none), a path to an .srt / .vtt file, a list of
    (start_s, end_s, text), or a callable of the video returning one of these."""
    if callable(spec) and not isinstance(spec, (str, os.PathLike)):
        spec = spec(video)
    if spec is None:
        return []
    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"`{param}`: no subtitle file at {path}")
        with open(path, encoding="utf-8-sig", errors="replace") as f:
            return parse_srt(f.read())
    cues: list[Subtitle] = []
    for item in spec:
        try:
            start, end, text = item
            start, end = float(start), float(end)
        except (TypeError, ValueError) as err:
            raise ValueError(f"`{param}` items are (start_s, end_s, text), got {item!r}") from err
        if not end >= start:
            raise ValueError(f"`{param}`: a subtitle ends before it starts: {item!r}")
        cues.append((start, end, str(text)))
    return cues


# --- gating ------------------------------------------------------------------------------------------------------
def gate_prompt(question: str, has_subtitles: bool) -> str:
    return GATE_PROMPT.format(subtitles="yes" if has_subtitles else "no", question=question)


def _json_object(answer: str) -> dict | None:
    """The first JSON object in the answer that parses (models wrap JSON in prose or code fences)."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", answer):
        try:
            value, _ = decoder.raw_decode(answer[match.start() :])
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and "weights" in value:
            return value
    return None


def _renormalised(weights: dict[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    return {k: w / total for k, w in weights.items()}


def gate_weights(
    answer: str | None, has_subtitles: bool, tau_mute: float = 0.1
) -> tuple[dict[str, float], list[str], bool]:
    """(weights, entities, parsed) from the gate's answer: the JSON's three weights (missing ones 0; negative,
    non-numeric or all-zero weights are a parse failure), contextual alignment set to 0 without subtitles, the rest
    renormalised, then weights below `tau_mute` muted (0) and the rest renormalised again (the largest always
    survives). A parse failure (or `answer=None`) gives equal weights over the available experts and no entities."""
    available = [e for e in EXPERTS if has_subtitles or e != "contextual_alignment"]
    data = _json_object(answer) if answer else None
    raw: dict[str, float] | None = None
    if data is not None and isinstance(data.get("weights"), dict):
        try:
            raw = {e: float(data["weights"].get(e, 0.0)) for e in EXPERTS}
        except (TypeError, ValueError):
            raw = None
        if raw is not None and (any(not math.isfinite(w) or w < 0 for w in raw.values()) or not any(raw.values())):
            raw = None
    if raw is not None:
        raw = {e: (raw[e] if e in available else 0.0) for e in EXPERTS}
        if not any(raw.values()):
            raw = None
    parsed = raw is not None
    if raw is None:
        raw = {e: (1.0 if e in available else 0.0) for e in EXPERTS}
    weights = _renormalised(raw)
    top = max(weights.values())
    weights = _renormalised({e: (w if w >= tau_mute or w == top else 0.0) for e, w in weights.items()})
    entities: list[str] = []
    if parsed and isinstance(data.get("entities"), list):
        entities = [str(x).strip() for x in data["entities"] if isinstance(x, (str, int, float)) and str(x).strip()]
    return weights, entities, parsed


def fixed_weights(weights: Sequence[float], has_subtitles: bool) -> dict[str, float]:
    """A fixed gate (`weights=(vg, gm, ca)`): contextual alignment 0 without subtitles, renormalised."""
    values = [float(w) for w in weights]
    if len(values) != 3 or any(not math.isfinite(w) or w < 0 for w in values):
        raise ValueError(f"q-gate.weights is three non-negative numbers (vg, gm, ca), got {tuple(weights)!r}")
    raw = dict(zip(EXPERTS, values))
    if not has_subtitles:
        raw["contextual_alignment"] = 0.0
    if not any(raw.values()):
        raise ValueError("q-gate.weights: every expert available has weight 0 (without subtitles: vg and gm)")
    return _renormalised(raw)


# --- experts -----------------------------------------------------------------------------------------------------
def minmax(scores) -> np.ndarray:
    """Scores scaled to [0, 1] over the candidates; all equal -> all 0 (the expert then says nothing)."""
    s = np.asarray(scores, dtype=np.float64)
    span = s.max() - s.min() if len(s) else 0.0
    return (s - s.min()) / span if span > 0 else np.zeros_like(s)


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[n, m] cosine similarities of the rows of a and b."""
    a = torch.nn.functional.normalize(a.float().reshape(len(a), -1), dim=-1)
    b = torch.nn.functional.normalize(b.float().reshape(len(b), -1), dim=-1)
    return a @ b.T


def grid_crops(frames: np.ndarray, grid: int) -> np.ndarray:
    """[n * grid^2, H // grid, W // grid, 3]: each frame's grid x grid tiles, row-major (the last pixels of a side
    not divisible by `grid` are left out)."""
    n, h, w = frames.shape[:3]
    ch, cw = h // grid, w // grid
    tiles = frames[:, : ch * grid, : cw * grid].reshape(n, grid, ch, grid, cw, -1).transpose(0, 1, 3, 2, 4, 5)
    return np.ascontiguousarray(tiles.reshape(n * grid * grid, ch, cw, -1))


def crop_features(encoder, video, indices: Sequence[int], grid: int) -> torch.Tensor:
    """[n, grid^2, D] image features of each frame's crops, in the shared feature cache."""
    key = (video_key(video), encoder.key, "crops", grid, tuple(int(i) for i in indices))
    cached = FEATURE_CACHE.get(key)
    if cached is not None:
        return cached
    tiles = grid_crops(video.read(list(indices)), grid)
    feats = encoder.encode_images(tiles).reshape(len(indices), grid * grid, -1)
    FEATURE_CACHE.put(key, feats)
    return feats


def global_matching(question_feature: torch.Tensor, frame_feats: torch.Tensor) -> np.ndarray:
    """cos(E_T(q), E_I(f_t)) per candidate."""
    return _cos(frame_feats, question_feature.reshape(1, -1))[:, 0].numpy()


def visual_grounding(entity_feats: torch.Tensor, frame_feats: torch.Tensor, crop_feats: torch.Tensor | None):
    """max over entities and views (the frame and its crops) of cos(E_T(entity), E_I(view)) per candidate."""
    views = frame_feats[:, None] if crop_feats is None else torch.cat([frame_feats[:, None], crop_feats], dim=1)
    n, v = views.shape[:2]
    sims = _cos(views.reshape(n * v, -1), entity_feats).reshape(n, v * len(entity_feats))
    return sims.max(dim=1).values.numpy()


def contextual_alignment(
    question_feature: torch.Tensor,
    subtitle_feats: torch.Tensor,
    subtitles: Sequence[Subtitle],
    times: Sequence[float],
    delta: float,
) -> np.ndarray:
    """max of cos(E_T(q), E_T(text_j)) over the subtitles overlapping [t - delta, t + delta]; 0 where none does."""
    sims = _cos(subtitle_feats, question_feature.reshape(1, -1))[:, 0].numpy()
    out = np.zeros(len(times))
    for k, t in enumerate(times):
        near = [sims[j] for j, (start, end, _) in enumerate(subtitles) if start <= t + delta and end >= t - delta]
        if near:
            out[k] = max(near)
    return out


def fuse(expert_scores: dict[str, np.ndarray], weights: dict[str, float]) -> np.ndarray:
    """S_t = sum_e g_e * minmax(s_e)_t over the experts with a weight."""
    n = len(next(iter(expert_scores.values())))
    total = np.zeros(n)
    for name, score in expert_scores.items():
        if weights.get(name, 0.0) > 0:
            total += weights[name] * minmax(score)
    return total


@vtc.method(
    "q-gate",
    paper="Q-Gate (abstract only)",
    summary="LLM-gated fusion of CLIP visual-grounding, global-matching and subtitle experts, then inverse "
    "transform sampling",
    test_params={"encoder": "vtc-tiny-clip", "encoder_pretrained": None, "gate_max_new_tokens": 8},
)
class QGate(vtc.FrameSampler):
    """K frames by inverse transform sampling of a query-gated fusion of three CLIP experts (vtc's reading)."""

    num_frames: int = vtc.param(32, range="[1, inf)", doc="K, frames handed to the processor")
    fps: float = vtc.param(1.0, range="(0, inf)", doc="rate of the scored candidate frames (BOLT's)")
    alpha: float = vtc.param(3.0, doc="power of the inverse transform sampling (BOLT's VideoMME / MLVU value)")
    tau_mute: float = vtc.param(0.1, range="[0, 1]", doc="gate weights below this are muted (0)")
    crops: int = vtc.param(
        3, range="[0, inf)", doc="visual grounding views: the frame + a crops x crops grid (0: frame only)"
    )
    delta: float = vtc.param(1.0, range="[0, inf)", doc="subtitle window: cues within +-delta s of a frame")
    subtitles: Any = vtc.param(
        None, doc="an .srt / .vtt path, a list of (start_s, end_s, text), or a callable of the video; None = none"
    )
    weights: tuple[float, float, float] | None = vtc.param(
        None, doc="a fixed gate (vg, gm, ca) instead of asking the LLM (vtc's, for ablations); None = the LLM"
    )
    gate_max_new_tokens: int = vtc.param(256, range="[1, inf)", doc="length of the gate's answer (greedy)")
    encoder: Any = vtc.param("ViT-L-14", doc="open_clip architecture, or an encoder object (vtc.media.encoders)")
    encoder_pretrained: str | None = vtc.param("openai", doc="open_clip weights tag or a local checkpoint file")

    query_aware = True

    def validate(self):
        if self.weights is not None:
            fixed_weights(self.weights, has_subtitles=True)

    def host_model_use(self) -> str | None:
        if self.weights is not None:
            return None
        return "give fixed gate weights, q-gate.weights=(vg, gm, ca)"

    def gate(self, ctx, has_subtitles: bool) -> tuple[dict[str, float], list[str], bool]:
        """The gate's weights and entities for this question: fixed ones, or the host LLM's answer parsed."""
        if self.weights is not None:
            return fixed_weights(self.weights, has_subtitles), [], True
        if ctx.model is None or ctx.processor is None:
            raise ValueError(
                "q-gate asks the patched model to weigh its experts: use handle.prepare(processor, video, question), "
                "or give fixed weights (q-gate.weights=(vg, gm, ca))"
            )
        answer = ask_text(ctx.model, ctx.processor, gate_prompt(ctx.question, has_subtitles), self.gate_max_new_tokens)
        return gate_weights(answer, has_subtitles, self.tau_mute)

    def sample(self, video, ctx):
        if not ctx.question:
            raise ValueError("q-gate scores frames against the question: pass one to handle.prepare(...)")
        count = int(ctx.num_frames or self.num_frames)
        subtitles = load_subtitles(self.subtitles, video)
        weights, entities, _ = self.gate(ctx, bool(subtitles))
        clip = clip_encoder(self.encoder, self.encoder_pretrained, param="q-gate.encoder")
        candidates = fps_candidates(video.num_frames, video.fps, self.fps)
        question = clip.encode_text([ctx.question])[0]
        scores: dict[str, np.ndarray] = {}  # a muted expert is not computed
        if weights["global_matching"] > 0 or weights["visual_grounding"] > 0:
            frames = frame_features(clip, video, candidates)
        if weights["global_matching"] > 0:
            scores["global_matching"] = global_matching(question, frames)
        if weights["visual_grounding"] > 0:
            texts = clip.encode_text(entities) if entities else question[None]
            tiles = crop_features(clip, video, candidates, self.crops) if self.crops > 0 else None
            scores["visual_grounding"] = visual_grounding(texts, frames, tiles)
        if weights["contextual_alignment"] > 0:
            times = [i / video.fps for i in candidates]
            texts = clip.encode_text([text for _, _, text in subtitles])
            scores["contextual_alignment"] = contextual_alignment(question, texts, subtitles, times, self.delta)
        fused = fuse(scores, weights)
        positions = inverse_transform_sampling(fused, count, self.alpha)
        return vtc.FrameChoice(sorted(candidates[p] for p in positions), candidates=candidates, scores=fused.tolist())
