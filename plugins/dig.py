"""DIG: "Divide, then Ground: Adapting Frame Selection to Query Types for Long-Form Video Understanding" (Li et al.,
CVPR 2026, arXiv 2512.04000). Official code: Jialuo-Li/DIG (`pipeline/query_identification.py`, `pipeline/cafs.py`,
`pipeline/reward_assignment.py`, `pipeline/video_refinement.py`, the prompts in `utils.py`).

An LLM first sorts the question into global (the whole video is needed: uniform frames) or localized. A localized
question gets the grounding pipeline: shot boundaries by content-adaptive frame selection (CAFS: DINOv2 features at
2 fps, peaks of `1 - cos` between neighbours, in 60-s chunks), one representative frame (r-frame) per shot, a 0-100
reward per r-frame from the LMM, the r-frames that survive thresholding (iterated mean or half of the maximum,
whichever keeps fewer) widened to +-2 boundaries and merged, and the k frames spread evenly over those intervals.
Stage: sample.

Where vtc runs differently from the official code:
- The classifier (official: Qwen3-Next-80B-A3B behind a vLLM server) and the reward model (official: the target
  LMM behind vLLM) are by default the patched model itself; `classifier=` / `judge=` name another checkpoint
  (loaded with `load_pretrained("vlm", ...)`), a `(model, processor)` pair, or a function `(prompt, image) -> text`
  (an OpenAI-compatible client, as the official scripts use).
- Decoding is greedy by default (official: temperature 0.7) so runs repeat; `temperature=0.7` is the official
  setting. A greedy answer would not change on a retry, so only a sampling run, or a function, retries
  (`max_retries`, 5).
- The JSON answers are read without `json_repair` (not a vtc dependency): strict JSON, else the first JSON object in
  the text that has the key, else the key's value by pattern (what `json_repair` recovers from a truncated or
  loosely quoted answer). A reward that is not a finite number counts as a failure.
- A question the classifier could not type gets uniform frames (the official refinement refines only 'local').
- A video shorter than one second (the official code has no 2-fps frames there and fails) counts as one second, as
  in `vtc.media.frame_selection.cafs_candidates`: one shot, one r-frame, the whole clip.
- Positions: the frames go to the processor as the official lmms-eval wrapper hands a frame list to qwen-vl-utils,
  which tells the model they are 0.5 s apart (`fps=2`, `frames_indices=0..n-1`); `timestamps="real"` passes the
  true frame numbers instead.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch

import vtc
from vtc.core.loading import load_pretrained
from vtc.media.encoders import frame_features, image_encoder
from vtc.media.frame_selection import cafs_candidates, cafs_chunks, scene_boundaries, scene_cuts
from vtc.media.video import uniform_indices

# --- the official prompts (utils.py, verbatim: they define the method) ----------------------------------------------
QUERY_IDENTIFICATION_PROMPT = """You are a helpful assistant in a video-based question-answering process. 

**Core Task & Definitions**

You will classify the given query into one of two categories:

1. Global Query (isGlobal: true): The query requires going through and understanding the entire video content.

2. Localized Query (isGlobal: false): The query that can be fully answered by extracting and analyzing several specific segments within the video.
   
**Instructions for Analysis and Response**

In your analysis, please follow this structured reasoning process to classify the query:

Step 1. Understand the Query: First, read the query to understand its general meaning and core intent.

Step 2. Infer Video Style (Hypothetically): Based on the query's phrasing, make a reasonable inference about the style of the video (e.g., is it a narrative film, an educational lesson, a documentary, etc.)?

Step 3. Identify Referents: Analyze if the query has specific referents. A referent is an entity (person, object), action, event, or even specific piece of information, depending on the type of video you inferred. For instance, in 'What does Professor Smith write about quantum physics?', the referent is 'Professor Smith' and 'quantum physics' since the video style is likely a lesson.

Step 4. Evaluate Referents in Context: Based on the results from step 3 and the criteria below, determine whether the query is Global or Localized.

    (i) The query is Global if it meets either condition: 1. Lacks a specific referent. The examples include: Summary-based: "primary focus," "in summary," "what is the video about,"; Negations: "what was not mentioned" 2. Has a referent, but answering still requires a holistic understanding from going through the entire video. The examples include: "what is the boy's overall role?"

    (ii) The query is Localized if it has specific referents, and the answer can be found by focusing on specific, related segments where it appears. The examples include:
        Entity-based: "the person in the red shirt," "the black dog," "Professor Smith," "the little girl."
        Action/Event-based: "what is [X] doing," "how does [X] build,"
        Temporal/Sequential: "at the beginning," "after the explosion," 

Please provide your answer in the following format: {"analysis_step1": str, "analysis_step2": str, "analysis_step3": str, "analysis_step4": str, "isGlobal": true/false}

User Query: <<<question>>>"""  # noqa: E501, W291, W293


REWARD_ASSIGNMENT_PROMPT = """You are a reward model for a video-based question-answering system.

**Task**

You will receive a question and a sampled video frame. Your task is to evaluate the relevance of this frame for answering the question. Please assign a reward score that indicates how useful or informative the provided frame is in the context of the given question.

**Instructions for Analysis and Response**

In your analysis, please perform the following steps to finish your evaluation:

1. Describe the visual content of the sampled frame, focusing on elements relevant to the question, if such elements are present.

2. Assign a relevance reward between 0 and 100 based on: (1) The sampled frame's direct usefulness in answering the question (2) Whether the frame suggests that adjacent frames might provide additional information that help answer the question more effectively.

Please provide your answer in the following format: {"description": str, "reward": int}.

**User Input**

Video Duration: <<<duration>>> seconds
Sampled Frame Timestamp: <<<timestamp>>> seconds
Question: <<<question>>>"""  # noqa: E501


# --- reading the answers --------------------------------------------------------------------------------------------
_MISSING = object()
_DECODER = json.JSONDecoder()


def _json_objects(text: str) -> list[dict]:
    """Every top-level JSON object embedded in `text` (prose, markdown fences and all around them)."""
    found, start = [], text.find("{")
    while start != -1:
        try:
            value, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
            continue
        if isinstance(value, dict):
            found.append(value)
        start = text.find("{", end)
    return found


def _loose_value(token: str) -> Any:
    token = token.strip()
    if len(token) >= 2 and token[0] == token[-1] and token[0] in "\"'":
        return token[1:-1]
    lowered = token.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return float(token)
    except ValueError:
        return token


def answer_field(text: str, key: str) -> Any:
    """The value of `key` in a model's JSON answer, or `_MISSING`. Strict JSON first (the official `json.loads`),
    then the first JSON object in the text that has the key, then `"key": value` by pattern: what the official
    `json_repair` fallback recovers from answers wrapped in prose, cut off before the closing brace, or quoted
    loosely."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        value = None
    items = value if isinstance(value, list) else [value]
    for item in [*items, *_json_objects(text or "")]:
        if isinstance(item, dict) and key in item:
            return item[key]
    match = re.search(rf"[\"']?{re.escape(key)}[\"']?\s*:\s*(\"[^\"]*\"|'[^']*'|[^,}}\s]+)", text or "")
    return _loose_value(match.group(1)) if match else _MISSING


def parse_query_type(text: str) -> str | None:
    """'global' or 'local' from the classifier's answer (`query_identification.py`), None when it has no `isGlobal`.
    As officially: a bool is taken as is, a string is global only when it reads 'true', anything else is local."""
    value = answer_field(text, "isGlobal")
    if value is _MISSING:
        return None
    if isinstance(value, bool):
        return "global" if value else "local"
    if isinstance(value, str):
        return "global" if value.lower() == "true" else "local"
    return "local"


def parse_reward(text: str) -> float | None:
    """The reward in the judge's answer (`reward_assignment.py`: `float(data['reward'])`), None when there is none or
    it is not a finite number."""
    value = answer_field(text, "reward")
    if value is _MISSING:
        return None
    try:
        reward = float(value)
    except (TypeError, ValueError):
        return None
    return reward if math.isfinite(reward) else None


def query_prompt(question: str) -> str:
    return QUERY_IDENTIFICATION_PROMPT.replace("<<<question>>>", question)


def reward_prompt(question: str, duration: float, timestamp: float) -> str:
    """The reward prompt for one r-frame; duration and timestamp in seconds rounded to 0.01 as officially."""
    return (
        REWARD_ASSIGNMENT_PROMPT.replace("<<<question>>>", question)
        .replace("<<<duration>>>", str(round(duration, 2)))
        .replace("<<<timestamp>>>", str(round(timestamp, 2)))
    )


# --- CAFS: shot boundaries and r-frames (cafs.py::get_r_frames) -----------------------------------------------------
# The candidates (2 fps), the 60-s chunks and the find_peaks cut rule are vtc.media.frame_selection's (shared with
# InfoShot); what is DIG's own is the r-frame of each shot.
def snapped_midpoints(boundaries: Sequence[int], candidates: Sequence[int]) -> list[int]:
    """DIG's r-frames: the middle `(a + b) // 2` of every two consecutive boundaries, snapped to the nearest
    candidate frame (the earlier one on a tie, as `argmin`)."""
    grid = np.asarray(candidates, dtype=np.int64)
    return [int(grid[np.abs(grid - (a + b) // 2).argmin()]) for a, b in zip(boundaries[:-1], boundaries[1:])]


def cafs_r_frames(
    features,
    candidates: Sequence[int],
    chunks: Sequence[Sequence[int]] | None,
    total_frames: int,
    prominence: float = 0.1,
) -> tuple[list[int], list[int]]:
    """(r-frames, boundaries) from the candidates' features ([len(candidates), D]; mean-pooled DINOv2 officially):
    cuts by `scene_cuts` within each chunk (positions, `cafs_chunks`), boundaries 0, the cut frames and the last
    frame, one r-frame per shot. The official loop builds the same lists chunk by chunk: each chunk's midpoints
    start from the previous chunk's last cut, so together they are the midpoints of consecutive boundaries."""
    boundaries = scene_boundaries(candidates, scene_cuts(features, chunks, prominence), total_frames)
    return snapped_midpoints(boundaries, candidates), boundaries


# --- refinement and the k frames (video_refinement.py) ---------------------------------------------------------------
def normalize_rewards(rewards: Sequence[float]) -> np.ndarray:
    """Min-max to 0-100 (with the official 1e-8 in the denominator); all equal -> zeros."""
    r = np.asarray(rewards, dtype=np.float64)
    low, high = r.min(), r.max()
    if high == low:
        return np.zeros_like(r)
    return (r - low) / (high - low + 1e-8) * 100


def merge_intervals(intervals: Sequence[Sequence[int]]) -> list[list[int]]:
    """Sorted by start; an interval starting at or before the previous end joins it."""
    merged: list[list[int]] = []
    for start, end in sorted((int(a), int(b)) for a, b in intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _window(boundaries: Sequence[int], i: int, wlen: int, n: int) -> list[int]:
    # the upper clamp is n - 1 with n r-frames (len(boundaries) - 2): the official code never reaches the last boundary
    return [int(boundaries[max(0, i - wlen)]), int(boundaries[min(n - 1, i + wlen)])]


def surviving_rewards(scores: np.ndarray) -> np.ndarray:
    """The official threshold over the positive normalised rewards: s1 subtracts the mean (zeros included) and clips
    at 0 until the number of zeros stops changing; s2 keeps what exceeds half the maximum; the one with fewer
    positives wins (s1 on a tie)."""
    s1 = scores.copy()
    while True:
        zeros = np.count_nonzero(s1 == 0)
        s1 = np.maximum(s1 - s1.mean(), 0)
        if np.count_nonzero(s1 == 0) == zeros:
            break
    s2 = np.maximum(scores - 0.5 * scores.max(), 0)
    return s1 if np.count_nonzero(s1 > 0) <= np.count_nonzero(s2 > 0) else s2


def refine_intervals(rewards: Sequence[float], boundaries: Sequence[int], wlen: int = 2) -> list[list[int]]:
    """The frame intervals kept for a localized question (`video_refinement`): rewards normalised to 0-100; none
    positive -> the whole video; one -> its window; otherwise the survivors of `surviving_rewards`, each widened to
    `[b[i - wlen], b[i + wlen]]` (clamped) and merged (none survive -> the whole video)."""
    scores = normalize_rewards(rewards)
    n = len(scores)
    positive = np.flatnonzero(scores > 0)
    whole = [[int(boundaries[0]), int(boundaries[-1])]]
    if len(positive) == 0:
        return whole
    if len(positive) == 1:
        return [_window(boundaries, int(positive[0]), wlen, n)]
    kept = surviving_rewards(scores[positive])
    windows = [_window(boundaries, int(positive[j]), wlen, n) for j in np.flatnonzero(kept > 0)]
    return merge_intervals(windows) or whole


def frames_in_intervals(intervals: Sequence[Sequence[int]], k: int) -> list[int]:
    """k frames evenly spread over the intervals laid end to end (`select_k_indices`): the points
    `linspace(0, total - 1, k)` (truncated) of their summed length, each mapped back into its interval."""
    starts = np.asarray([a for a, _ in intervals], dtype=np.int64)
    lengths = np.asarray([b - a + 1 for a, b in intervals], dtype=np.int64)
    ends = np.cumsum(lengths)
    points = np.linspace(0, int(ends[-1]) - 1, k, dtype=int)
    which = np.searchsorted(ends, points, side="right")
    return (starts[which] + points - (ends[which] - lengths[which])).astype(int).tolist()


# --- asking a model ---------------------------------------------------------------------------------------------------
Answerer = Callable[[Sequence[str], Sequence[Any] | None], list[str]]


def generate_answers(
    model,
    processor,
    prompts: Sequence[str],
    images: Sequence[Any] | None = None,
    *,
    max_new_tokens: int = 1024,
    temperature: float = 0.0,
    max_pixels: int | None = None,
) -> list[str]:
    """One chat turn per prompt (an image before the text when `images` is given), answered in one batch: greedy
    at temperature 0, else sampled. `max_pixels` caps the image size on Qwen processors (the official reward
    server's `max_pixels`). `processor` may be a bare tokenizer for a text-only model."""
    is_tokenizer = not hasattr(processor, "tokenizer")
    texts = []
    for prompt in prompts:
        if is_tokenizer:
            content: Any = prompt
        else:
            content = ([{"type": "image"}] if images is not None else []) + [{"type": "text", "text": prompt}]
        chat = [{"role": "user", "content": content}]
        texts.append(processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    kwargs: dict[str, Any] = {"text": texts, "return_tensors": "pt"}
    if len(texts) > 1:
        kwargs.update(padding=True, padding_side="left")
    if images is not None:
        kwargs["images"] = list(images)
        image_processor = getattr(processor, "image_processor", None)
        if max_pixels is not None and type(image_processor).__name__.startswith("Qwen"):
            size = image_processor.size
            kwargs["images_kwargs"] = {"size": {"shortest_edge": size["shortest_edge"], "longest_edge": max_pixels}}
    inputs = processor(**kwargs)
    param = next(model.parameters())
    inputs = {
        k: v.to(param.device, param.dtype) if v.is_floating_point() else v.to(param.device)
        for k, v in inputs.items()
        if torch.is_tensor(v)
    }
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, **sampling)
    tokenizer = getattr(processor, "tokenizer", processor)
    return tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def _spec_kind(spec: Any) -> str:
    if spec is None:
        return "patched"
    if isinstance(spec, str):
        return "name"
    if isinstance(spec, (tuple, list)) and len(spec) == 2:
        return "pair"
    if callable(spec) and not isinstance(spec, torch.nn.Module):
        return "function"
    return "bad"


UNIFORM_FPS = 2.0  # qwen-vl-utils' sample_fps for a video given as a list of frames (the official wrapper's input)


@vtc.method(
    "dig",
    paper="DIG (CVPR 2026)",
    url="https://arxiv.org/abs/2512.04000",
    summary="global questions get uniform frames; localized ones the LMM-rewarded shots (DINOv2 cuts) widened, merged",
    test_params={"max_new_tokens": 8, "encoder": "vtc-tiny-dinov2"},
)
class Dig(vtc.FrameSampler):
    """Query-type-adaptive frame selection: uniform for global questions, reward-grounded shots for localized ones."""

    num_frames: int = vtc.param(32, range="[1, inf)", doc="k, frames handed to the processor (8 to 256; paper: 32)")
    query_type: str = vtc.param(
        "auto", choices=("auto", "global", "local"), doc="auto: ask the classifier; global / local: skip it"
    )
    timestamps: str = vtc.param(
        "uniform", choices=("uniform", "real"), doc="uniform: the official 0.5-s spacing; real: the true frame times"
    )
    encoder: Any = vtc.param(
        "facebook/dinov2-base", doc="CAFS features: transformers DINOv2 name or local path, or an encoder object"
    )
    fps: float = vtc.param(2.0, range="(0, inf)", doc="sample_per_sec: rate of the CAFS frames")
    chunk_seconds: float = vtc.param(60.0, range="(0, inf)", doc="CAFS compares neighbours within chunks this long")
    prominence: float = vtc.param(0.1, range="(0, inf)", doc="find_peaks prominence of a shot cut in 1 - cos")
    wlen: int = vtc.param(2, range="[0, inf)", doc="boundaries kept on each side of a surviving r-frame")
    classifier: Any = vtc.param(
        None, doc="query typing: None = the patched model; a checkpoint, (model, processor) or f(prompt, image)"
    )
    judge: Any = vtc.param(
        None, doc="r-frame rewards: None = the patched model; a checkpoint, (model, processor) or f(prompt, image)"
    )
    temperature: float = vtc.param(0.0, range="[0, inf)", doc="0 = greedy (vtc); the official runs use 0.7")
    max_retries: int = vtc.param(5, range="[1, inf)", doc="attempts per answer when sampling (greedy asks once)")
    max_new_tokens: int = vtc.param(1024, range="[1, inf)", doc="answer length for the classifier and the judge")
    reward_max_pixels: int = vtc.param(262144, range="[1, inf)", doc="image size cap for the judge (Qwen processors)")
    batch_size: int = vtc.param(8, range="[1, inf)", doc="r-frames rewarded per generate call")

    query_aware = True

    def validate(self):
        for name in ("classifier", "judge"):
            if _spec_kind(getattr(self, name)) == "bad":
                raise ValueError(
                    f"dig: {name} must be None (the patched model), a checkpoint name or path, a (model, processor) "
                    f"pair or a function (prompt, image) -> text; got {type(getattr(self, name)).__name__}"
                )

    def host_model_use(self) -> str | None:
        asked = []
        if self.query_type == "auto" and _spec_kind(self.classifier) == "patched":
            asked.append("dig.classifier")
        if self.query_type != "global" and _spec_kind(self.judge) == "patched":
            asked.append("dig.judge")
        if not asked:
            return None
        return (
            f"give {' and '.join(asked)} (a checkpoint name or path, or a function (prompt, image) -> text), or "
            "dig.query_type='global'"
        )

    # --- the model asked ------------------------------------------------------------------------------------------
    def _answerer(self, name: str, ctx) -> Answerer:
        spec = getattr(self, name)
        kind = _spec_kind(spec)
        if kind == "function":
            return lambda prompts, images: [
                str(spec(p, None if images is None else img))
                for p, img in zip(prompts, images if images is not None else [None] * len(prompts))
            ]
        if kind == "patched":
            if ctx.model is None or ctx.processor is None:
                raise ValueError(
                    f"dig asks the patched model for its {name} answers: use handle.prepare(processor, video, "
                    f"question) on the patched model, or pass dig.{name}= (a checkpoint, a (model, processor) pair "
                    "or a function)"
                )
            model, processor = ctx.model, ctx.processor
        elif kind == "pair":
            model, processor = spec
        else:
            loaded = getattr(self, "_loaded", None)
            if loaded is None:
                loaded = self._loaded = {}  # checkpoints loaded once per method (a cache, not a parameter)
            if spec not in loaded:
                try:
                    loaded[spec] = load_pretrained("vlm", spec)
                except (OSError, ValueError) as err:
                    raise ValueError(
                        f"dig.{name}: cannot load {spec!r} as a video-LLM ({err}); pass a local path, a (model, "
                        "processor) pair or a function (prompt, image) -> text"
                    ) from err
            model, processor = loaded[spec]

        def answer(prompts, images):
            return generate_answers(
                model,
                processor,
                prompts,
                images,
                max_new_tokens=self.max_new_tokens,
                temperature=self.temperature,
                max_pixels=self.reward_max_pixels if images is not None else None,
            )

        return answer

    def _attempts(self, name: str) -> int:
        """max_retries when the answers can change between attempts (sampling, or a function whose decoding vtc
        does not control); one greedy attempt otherwise, since it would repeat itself."""
        varies = self.temperature > 0 or _spec_kind(getattr(self, name)) == "function"
        return self.max_retries if varies else 1

    def classify(self, question: str, ctx) -> tuple[str | None, str]:
        """('global' | 'local' | None, the last answer) for the question."""
        answer = self._answerer("classifier", ctx)
        text = ""
        for _ in range(self._attempts("classifier")):
            text = answer([query_prompt(question)], None)[0]
            kind = parse_query_type(text)
            if kind is not None:
                return kind, text
        return None, text

    def rewards(self, video, r_frames: list[int], question: str, ctx) -> tuple[list[float], int]:
        """One reward per r-frame (0.0 where no attempt gave one, as officially) and how many failed."""
        answer = self._answerer("judge", ctx)
        last = video.num_frames - 1
        duration = video.num_frames / video.fps
        found: list[float | None] = [None] * len(r_frames)
        pending = list(range(len(r_frames)))
        for _ in range(self._attempts("judge")):
            for start in range(0, len(pending), self.batch_size):
                batch = pending[start : start + self.batch_size]
                frames = video.read([min(r_frames[i], last) for i in batch])
                prompts = [reward_prompt(question, duration, r_frames[i] / video.fps) for i in batch]
                for i, text in zip(batch, answer(prompts, list(frames))):
                    found[i] = parse_reward(text)
            pending = [i for i in pending if found[i] is None]
            if not pending:
                break
        return [0.0 if r is None else r for r in found], len(pending)

    # --- sample ---------------------------------------------------------------------------------------------------
    def _metadata(self, count: int) -> dict[str, Any] | None:
        if self.timestamps == "real":
            return None
        return {
            "fps": UNIFORM_FPS,
            "frames_indices": list(range(count)),
            "total_num_frames": count,
            "duration": count / UNIFORM_FPS,
        }

    def sample(self, video, ctx):
        if not ctx.question:
            raise ValueError("dig types and grounds the question: pass one to handle.prepare(...)")
        count = int(ctx.num_frames or self.num_frames)
        kind = self.query_type
        if kind == "auto":
            kind, text = self.classify(ctx.question, ctx)
            if kind is None:
                warnings.warn(
                    f"dig: no query type in the classifier's answer after {self._attempts('classifier')} attempt(s) "
                    f"(last answer {text[:80]!r}); uniform frames, as the official pipeline gives an untyped question",
                    UserWarning,
                    stacklevel=2,
                )
        ctx.report(query_type=kind)
        if kind == "local":
            return self._ground(video, ctx, count)
        # global (or untyped): video_refinement.py's np.linspace(0, n - 1, k, dtype=int)
        return vtc.FrameChoice(uniform_indices(video.num_frames, count, "floor"), metadata=self._metadata(count))

    def _ground(self, video, ctx, count: int):
        encoder = image_encoder(self.encoder, "mean", param="dig.encoder")
        candidates = cafs_candidates(video.num_frames, video.fps, self.fps)
        chunks = cafs_chunks(candidates, video.num_frames, video.fps, self.chunk_seconds)
        # one chunk of frames read and encoded at a time, as officially (a long video's frames never all in memory)
        parts = {}
        for chunk in chunks:
            parts.update(zip(chunk, frame_features(encoder, video, [candidates[p] for p in chunk])))
        features = torch.stack([parts[p] for p in range(len(candidates))])
        r_frames, boundaries = cafs_r_frames(features, candidates, chunks, video.num_frames, self.prominence)
        rewards, failed = self.rewards(video, r_frames, ctx.question, ctx)
        if failed:
            warnings.warn(
                f"dig: {failed} of {len(r_frames)} r-frame rewards could not be read from the judge's answers after "
                f"{self._attempts('judge')} attempt(s); they count as 0.0 (the official fallback)",
                UserWarning,
                stacklevel=3,
            )
        intervals = refine_intervals(rewards, boundaries, self.wlen)
        ctx.report(boundaries=boundaries, intervals=intervals, rewards_failed=failed)
        indices = frames_in_intervals(intervals, count)
        return vtc.FrameChoice(indices, candidates=r_frames, scores=rewards, metadata=self._metadata(count))
