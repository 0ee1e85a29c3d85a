"""QuoTA: "Query-oriented Token Assignment via CoT Query Decouple for Long Video Comprehension" (Luo et al.,
arXiv 2503.08689, AAAI 2026). Official code: MAC-AutoML/QuoTA (`quota_pipeline.py`, `tools/qwen2vl_batch.py`,
`core/llava_arch.py`).

Sample more frames than the model can afford (96 + 64 per hour of video), ask the LLM which objects the
question is about (chain-of-thought query decoupling), let a VLM answer "does this frame contain ...? A. yes
B. no" for every frame, and give each frame a share w_i = (100 p_yes)^2 / sum of a fixed token budget by
resizing its feature map bilinearly to about `B * w_i` tokens. Stages: sample (frames, decoupling, scoring)
and connect (per-frame resize).

`quota-clip` is vtc's cheaper variant (not in the paper): CLIP (open_clip) scores the frames instead of a VLM
(`vtc.media.relevance`, shared with `vtc.vllm.client.select_frames`).

The sample stage leaves the frame weights in `ctx.state` (objects, scores, weights); the connect stage of the same
prompt reads them as `ctx.prepared`.
"""

from __future__ import annotations

import ast
import math
import re
from typing import Any, ClassVar

import torch

import vtc
from vtc.core.loading import load_pretrained
from vtc.media.host_llm import ask_text
from vtc.media.relevance import clip_yes_probabilities, frame_weights, load_clip
from vtc.media.video import uniform_indices

__all__ = [  # the CLIP scoring and the weights live in vtc.media.relevance; re-exported for QuoTA's users
    "Quota",
    "QuotaClip",
    "anchor_cells",
    "clip_yes_probabilities",
    "frame_shape",
    "frame_weights",
    "grid_frame_weights",
    "load_clip",
    "parse_objects",
    "relevance_prompt",
    "resize_frame",
    "resize_frames",
    "token_budgets",
    "whole_frames_only",
    "vlm_yes_probabilities",
]

# The decoupling prompt of quota_pipeline.py (the method is defined by it; reproduced verbatim in substance)
DECOUPLE_PROMPT = """
To answer this question, please follow the following step to give an object list for object detection.
    Step 1: Do you think it is necessary to detect specific physical entities in the video? Please only answer "yes" or "no" in this step.
    Step 2: If 'yes' in previous step, then what object in the video do you think needs to be detected to answer this question? Please only output the name of all the objects need to detect in the form of a Python list without other information.
    Step 3: Filter the object list provided in step 2, make sure they are physical entities, not abstract concepts. Please only output the name of the filtered object in the form of a Python list without other information. If all the words being filtered, please only output null.
    # Example 1:
    Question: How many blue balloons are over the long table in the middle of the room at the end of this video? A. 1. B. 2. C. 3. D. 4.
    Your output should be:
    Step 1: yes
    Step 2: ["blue ballons", "long table", "video", "blue"]
    Step 3: ["blue ballons", "long table"]
    # Example 2:
    Question: In the lower left corner of the video, what color is the woman wearing on the right side of the man in black clothes? A. Blue. B. White. C. Red. D. Yellow.
    Your output should be:
    Step 1: yes
    Step 2: ["the man in black", "woman", "lower left corner"]
    Step 3: ["the man in black", "woman"]
    # Example 3:
    Question: In which country is the comedy featured in the video recognized worldwide? A. China. B. UK. C. Germany. D. United States.
    Your output should be:
    Step 1: no"""  # noqa: E501


# --- sample stage: decoupling and scoring -----------------------------------------------------------------------
def parse_objects(answer: str) -> list[str]:
    """Objects from the decoupling answer: `step 1: yes` and `step 3: [...]` (the official regexes)."""
    lowered = answer.lower()
    step1 = re.search(r"step 1: (yes|no)", lowered)
    if not step1 or step1.group(1) != "yes":
        return []
    step3 = re.search(r"step 3: (\[[^\]]*\])", lowered)
    if not step3:
        return []
    try:
        objects = ast.literal_eval(step3.group(1))  # the official code uses eval(); literal_eval is its safe subset
    except (ValueError, SyntaxError):
        return []
    return [str(o) for o in objects] if isinstance(objects, (list, tuple)) else []


def relevance_prompt(question: str, objects: list[str]) -> str:
    """The yes/no question the scorer answers for every frame (official wording)."""
    if objects:
        return (
            "Does the image contain any object of " + ", ".join(objects) + "? A. yes, B. no\n"
            "Answer with the option's letter directly."
        )
    return (
        f"{question}\nDoes the image contain sufficient information to answer the given question? A. yes, B. no\n"
        "Answer with the option's letter directly."
    )


def decouple_objects(model, processor, question: str, max_new_tokens: int) -> list[str]:
    """The patched model's own decoupling answer (text only, greedy), parsed."""
    return parse_objects(ask_text(model, processor, question + DECOUPLE_PROMPT, max_new_tokens))


def vlm_yes_probabilities(model, processor, frames, prompt: str, batch_size: int, max_pixels: int) -> list[float]:
    """P("A") at the answer position for every frame, one conversation per frame (tools/qwen2vl_batch.py)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    answer_id = tokenizer.encode("A", add_special_tokens=False)[0]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    extra: dict[str, Any] = {}
    image_processor = getattr(processor, "image_processor", None)
    if type(image_processor).__name__.startswith("Qwen"):  # the official scorer's max_pixels
        size = image_processor.size
        extra["images_kwargs"] = {"size": {"shortest_edge": size["shortest_edge"], "longest_edge": max_pixels}}
    param = next(model.parameters())
    probs: list[float] = []
    for start in range(0, len(frames), batch_size):
        batch = list(frames[start : start + batch_size])
        inputs = processor(text=[text] * len(batch), images=batch, return_tensors="pt", padding=True, **extra)
        inputs = {
            k: v.to(param.device, param.dtype) if v.is_floating_point() else v.to(param.device)
            for k, v in inputs.items()
            if torch.is_tensor(v)
        }
        with torch.no_grad():
            logits = model(**inputs).logits[:, -1].float()
        probs.extend(torch.softmax(logits, dim=-1)[:, answer_id].tolist())
    return probs


# --- connect stage: budgets and resizing --------------------------------------------------------------------------
def frame_shape(count: int) -> tuple[int, int]:
    """h x w for a frame with a budget of `count` tokens (token_compress v1): h = w = int(sqrt(n)); one more row when
    it still fits."""
    h = w = int(math.sqrt(count))
    if h * w < count and (h + 1) * w <= count:
        h += 1
    return h, w


def token_budgets(weights: list[float], budget: int, exact: bool) -> list[int]:
    """Per-frame token counts: int(B * w_i) (official; frames at 0 are dropped), or with `exact` the largest-remainder
    shares that sum to B."""
    raw = [budget * w for w in weights]
    counts = [int(r) for r in raw]
    if exact:
        order = sorted(range(len(raw)), key=lambda i: raw[i] - counts[i], reverse=True)
        for i in order[: budget - sum(counts)]:
            counts[i] += 1
    return counts


def resize_frame(grid: torch.Tensor, count: int, exact: bool) -> tuple[torch.Tensor, tuple[int, int]]:
    """Bilinearly resize one frame's feature map grid [h0, w0, D] to the frame's budget.

    Official: h x w from `frame_shape` (h*w <= count). `exact`: the smallest w = ceil(sqrt(n)), h = ceil(n / w) grid
    with h*w >= n, cut to the first n cells in raster order. Returns ([cells, D], (h, w))."""
    if exact:
        w = math.ceil(math.sqrt(count))
        h = math.ceil(count / w)
    else:
        h, w = frame_shape(count)
    x = grid.permute(2, 0, 1)[None].float()
    out = torch.nn.functional.interpolate(x, size=(h, w), mode="bilinear")[0].permute(1, 2, 0)
    cells = out.reshape(h * w, -1).to(grid.dtype)
    return (cells[:count] if exact else cells), (h, w)


def anchor_cells(h: int, w: int, grid_h: int, grid_w: int) -> torch.Tensor:
    """For each cell of an h x w resize, the nearest cell of the grid_h x grid_w token grid (row-major index):
    where a resized token takes its position from."""
    rows = torch.clamp(((torch.arange(h) + 0.5) * grid_h / h).long(), max=grid_h - 1)
    cols = torch.clamp(((torch.arange(w) + 0.5) * grid_w / w).long(), max=grid_w - 1)
    return (rows[:, None] * grid_w + cols[None, :]).flatten()


COMMON = dict(
    url="https://arxiv.org/abs/2503.08689",
    retention_note="the budget B = round(retention * N) is shared by relevance; each frame keeps an h x w grid "
    "of at most int(B w_f) cells (official), so up to a row per frame below; fixed_count=True keeps exactly B",
    exempt={
        "identity_at_full_retention": "at retention 1.0 the full budget is redistributed across frames",
        "retention": "adaptive count: each frame's budget becomes an h x w grid <= it (a row lost at most); "
        "fixed_count=True (checked instead) keeps exactly round(r N)",
        "ordered_positions": "an upsampled frame repeats its grid's anchor positions",
        "original_positions": "resized frames are new features placed at their nearest grid cell (tested in "
        "tests/test_quota.py)",
    },
)


@vtc.method(
    "quota",
    paper="QuoTA: Query-oriented Token Assignment via CoT Query Decouple (AAAI 2026)",
    summary="score frames against the question with a VLM, give relevant frames more tokens",
    test_params={"decouple_max_new_tokens": 4},
    **COMMON,
)
class Quota(vtc.FrameSampler):
    """Frame relevance -> per-frame token budgets, each frame resized bilinearly to its budget
    (official: MAC-AutoML/QuoTA quota_pipeline.py, core/llava_arch.py)."""

    max_frames_num: int = vtc.param(96, range="[1, inf)", doc="base frames sampled (uniformly, force_sample)")
    additional_frames: int = vtc.param(64, range="[0, inf)", doc="extra frames per hour of video")
    enhance_tokens: int | None = vtc.param(
        None, range="[1, inf)", doc="tokens per frame-equivalent of budget; None = the model's (196 on LLaVA-OV)"
    )
    enhance_total: int = vtc.param(64, range="[1, inf)", doc="frame-equivalents in the budget: B = tokens * total")
    weight_scale: tuple[float, float] = vtc.param((100.0, 2.0), doc="(scale, power): w = (scale * p) ** power")
    scorer: str | None = vtc.param(
        None, doc="HF model answering yes/no per frame (official: Qwen2-VL-2B); None = the patched model"
    )
    scorer_max_pixels: int = vtc.param(1280 * 28 * 28, doc="official scorer setting (Qwen processors)")
    score_batch_size: int = vtc.param(64, range="[1, inf)", doc="frames scored per forward")
    decouple: bool = vtc.param(True, doc="CoT query decoupling with the patched model (text only)")
    decouple_max_new_tokens: int = vtc.param(4096, range="[1, inf)", doc="decoupling answer length")
    clip_model: str = vtc.param("ViT-B-32", doc="quota-clip only: open_clip architecture")
    clip_pretrained: str | None = vtc.param("openai", doc="quota-clip only: open_clip weights tag (None = random)")
    fixed_count: bool = vtc.param(False, doc="exactly the budget B (largest-remainder shares), for serving")

    reduces_tokens = True  # a sampler that also resizes every frame to its budget (FrameSampler's default: False)
    positions = "compact"
    query_aware = True
    prepool = True  # the pre-pool feature maps are resized
    whole_frames = True
    scorer_kind: ClassVar[str] = "vlm"  # "clip": quota-clip

    def validate(self):
        if len(tuple(self.weight_scale)) != 2:
            raise ValueError(f"{self.card.name}: weight_scale is (scale, power), e.g. (100, 2)")

    # sample ---------------------------------------------------------------------------------------------------
    def sample(self, video, ctx):
        count = ctx.num_frames or self.max_frames_num + int(video.duration / 3600 * self.additional_frames)
        # quota_pipeline.py: np.linspace(0, T - 1, max_frames_num, dtype=int) (truncated, duplicates kept)
        indices = uniform_indices(video.num_frames, int(count), "floor")
        if ctx.question is None:
            raise ValueError("quota scores frames against the question: pass it to handle.prepare(...)")
        model, processor = ctx.model, ctx.processor
        objects: list[str] = []
        if self.decouple:
            if model is None or processor is None:
                raise ValueError("quota's query decoupling runs the model: use handle.prepare(processor, video, q)")
            objects = decouple_objects(model, processor, ctx.question, self.decouple_max_new_tokens)
        frames = video.read(indices)
        if self.scorer_kind == "clip":
            clip, preprocess, tokenizer = load_clip(self.clip_model, self.clip_pretrained)
            scores = clip_yes_probabilities(clip, preprocess, tokenizer, frames, ctx.question, objects)
        else:
            scorer, scorer_processor = self._vlm_scorer(model, processor)
            prompt = relevance_prompt(ctx.question, objects)
            scores = vlm_yes_probabilities(
                scorer, scorer_processor, frames, prompt, self.score_batch_size, self.scorer_max_pixels
            )
        ctx.state.update(objects=objects, scores=scores, weights=frame_weights(scores, *self.weight_scale))
        return indices

    def _vlm_scorer(self, model, processor):
        if self.scorer is None:
            if model is None or processor is None:
                raise ValueError("quota scores frames with the patched model: use handle.prepare(processor, video, q)")
            return model, processor
        if getattr(self, "_scorer_model", None) is None:  # loaded once per pipeline (a cache, not a parameter)
            self._scorer_model = load_pretrained("vlm", self.scorer)
        return self._scorer_model

    # connect --------------------------------------------------------------------------------------------------
    def budget(self, num_tokens: int, grid) -> int:
        if self.retention is not None:
            return max(1, round(num_tokens * self.retention))
        per_frame = self.enhance_tokens or grid[1] * grid[2]
        return per_frame * self.enhance_total

    def retained_count(self, num_tokens: int, grid, family: str) -> int | None:
        return self.budget(num_tokens, grid) if self.fixed_count else None

    def connect(self, tokens, ctx):
        info = ctx.prepared
        if "weights" not in info:
            raise ValueError(
                "quota assigns tokens from frame scores computed in its sample stage: build the inputs with "
                "handle.prepare(processor, video, question) on the patched model"
            )
        whole_frames_only(tokens, "quota")
        weights = grid_frame_weights(info["weights"], tokens.grid[0])
        exact = self.fixed_count
        counts = token_budgets(weights, self.budget(len(tokens), tokens.grid), exact)
        out = resize_frames(tokens, ctx, counts, lambda frame_map, count, f: resize_frame(frame_map, count, exact))
        ctx.report(budgets=counts)
        return out


def whole_frames_only(tokens, name: str) -> None:
    """Methods that resize whole frames (quota, q-frame, framepack-u) refuse tokens an earlier method dropped."""
    if not tokens.is_full_grid:
        raise ValueError(f"{name} resizes whole frames: put it before other connect methods that drop tokens")


def resize_frames(tokens, ctx, counts: list[int], resize):
    """Each grid frame's map (the pre-pool map where there is one) at its count of tokens, `resize(frame_map, count,
    f) -> (cells [n, D], (h, w))` (a frame at 0 is dropped, as the official code drops frames whose share rounds to
    zero), placed at its anchor cells, projected where the model projects after pooling; extras resized alike."""
    t, h0, w0 = tokens.grid
    frame_maps = ctx.prepool if ctx.prepool is not None else tokens.embeds.reshape(t, h0, w0, -1)
    pieces, anchors = [], []
    extras: dict[str, list[torch.Tensor]] = {name: [] for name in tokens.extras}
    for f, count in enumerate(counts):
        if count <= 0:
            continue
        cells, (h, w) = resize(frame_maps[f], count, f)
        pieces.append(cells)
        anchors.append(f * h0 * w0 + anchor_cells(h, w, h0, w0)[: cells.shape[0]])
        for name, values in tokens.extras.items():
            part = resize(values.reshape(t, h0, w0, -1)[f], count, f)[0]
            extras[name].append(part.reshape(-1, *values.shape[1:]))
    features = torch.cat(pieces)
    if ctx.prepool is not None and ctx.project is not None:
        features = ctx.project(features)
    # an upsampled frame takes its cells' positions from the nearest grid cells, so anchors can repeat
    out = tokens.select(torch.cat(anchors).to(tokens.embeds.device), allow_repeats=True)
    out.embeds = features.to(tokens.embeds.device, tokens.embeds.dtype)
    out.extras = {name: torch.cat(parts).to(tokens.extras[name].dtype) for name, parts in extras.items()}
    return out


def grid_frame_weights(weights: list[float], grid_frames: int) -> list[float]:
    """Frame weights on the model's temporal grid: Qwen models pair frames into one temporal patch (mean of the
    pair, the last frame repeated when the count is odd, as the processor pads it); renormalised."""
    if len(weights) == grid_frames:
        return list(weights)
    group = math.ceil(len(weights) / grid_frames)
    padded = list(weights) + [weights[-1]] * (group * grid_frames - len(weights))
    merged = [sum(padded[i * group : (i + 1) * group]) / group for i in range(grid_frames)]
    total = sum(merged)
    return [m / total for m in merged]


@vtc.method(
    "quota-clip",
    paper="QuoTA variant (vtc): CLIP frame scores instead of a VLM",
    summary="QuoTA's budgets with CLIP (open_clip) frame relevance",
    # a tiny random CLIP architecture shipped with vtc.testing (no download)
    test_params={"decouple_max_new_tokens": 4, "clip_model": "vtc-tiny-clip", "clip_pretrained": None},
    **COMMON,
)
class QuotaClip(Quota):
    """QuoTA with CLIP (open_clip) scoring the frames' relevance instead of a VLM (vtc's variant)."""

    scorer_kind: ClassVar[str] = "clip"
