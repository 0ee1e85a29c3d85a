"""Reading videos (decord, else torchcodec, else PyAV: the same frames whichever is used) and making test
clips with real structure (moving shapes, scene cuts, static stretches) for offline demos and tests."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import math
import os
from typing import Sequence

import numpy as np

from vtc.core.families import FRAME_RULES, family_names, get_family


def available_backends() -> list[str]:
    names = []
    for module, name in (("decord", "decord"), ("torchcodec", "torchcodec"), ("av", "pyav")):
        if importlib.util.find_spec(module) is not None:
            names.append(name)
    return names


def as_rgb_frames(frames: np.ndarray, what: str = "a frame array") -> np.ndarray:
    """Frames in memory as a contiguous [T, H, W, 3] uint8 array, by one rule for every array vtc takes:

    the dtype must be uint8 (RGB values 0..255): any other dtype is refused with how to convert it, since vtc
    cannot know whether floats are in [0, 1] or [0, 255] (casting [0, 1] floats would give black frames);
    the shape is [T, H, W, 3] RGB, or grey [T, H, W] / [T, H, W, 1], whose value is repeated into three channels;
    T >= 1. A 3-D array ending in 3 or 4 channels is one frame [H, W, C], not a grey video, and is refused (as is
    RGBA), with how to pass it."""
    frames = np.asarray(frames)
    if frames.dtype != np.uint8:
        if np.issubdtype(frames.dtype, np.floating):
            how = (
                "floats in [0, 1]: (frames * 255).round().astype(np.uint8); "
                "floats in [0, 255]: frames.round().astype(np.uint8)"
            )
        else:
            how = "values in [0, 255]: frames.astype(np.uint8)"
        raise ValueError(
            f"{what} must be uint8 (RGB values 0..255), got dtype {frames.dtype} with shape {frames.shape}; "
            f"vtc does not guess the value range of other dtypes. Convert it first, {how}"
        )
    if frames.ndim == 3 and frames.shape[-1] in (3, 4):
        raise ValueError(
            f"{what} of shape {frames.shape} is one image [H, W, {frames.shape[-1]}], not a video: a video is "
            "[T, H, W, 3] (frames[None] for a one-frame video; frames[..., :3] drops an alpha channel)"
        )
    if frames.ndim == 4 and frames.shape[-1] == 4:
        raise ValueError(f"{what} of shape {frames.shape} is RGBA; pass RGB [T, H, W, 3]: frames[..., :3]")
    if frames.ndim == 3 or (frames.ndim == 4 and frames.shape[-1] == 1):
        frames = np.repeat(frames.reshape(frames.shape[:3])[..., None], 3, axis=-1)  # grey -> RGB
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise ValueError(
            f"{what} must be [T, H, W, 3] RGB (or [T, H, W] grey) uint8 with T >= 1, got shape {frames.shape}"
        )
    return np.ascontiguousarray(frames)


@dataclasses.dataclass
class VideoSource:
    """A video to sample frames from: a file (decoded lazily) or frames already in memory.

    Attributes: `num_frames` (total frames), `fps`, `width`, `height`, `duration` (seconds), `backend`.
    """

    path: str | None
    num_frames: int
    fps: float
    width: int
    height: int
    backend: str
    _frames: np.ndarray | None = None

    @property
    def duration(self) -> float:
        return self.num_frames / self.fps if self.fps else 0.0

    @classmethod
    def open(
        cls, video: "str | os.PathLike | np.ndarray | VideoSource", fps: float | None = None, backend: str | None = None
    ) -> "VideoSource":
        """Wrap a path, a frame array (with its `fps`, default 1.0; see `as_rgb_frames`) or an existing source."""
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
            raise ValueError(f"fps must be a positive number, got {fps!r}")
        if isinstance(video, VideoSource):
            return video
        if isinstance(video, np.ndarray):
            frames = as_rgb_frames(video)
            return cls(None, frames.shape[0], float(fps or 1.0), frames.shape[2], frames.shape[1], "array", frames)
        path = os.fspath(video)
        if not os.path.exists(path):
            raise FileNotFoundError(f"video not found: {path}")
        if backend is not None and backend not in _PROBE:
            raise ValueError(f"unknown video backend {backend!r}; choose {', '.join(_PROBE)}")
        backends = [backend] if backend is not None else available_backends()
        if not backends:
            raise RuntimeError("no video decoder installed; install one of: decord, torchcodec, av (PyAV)")
        errors = []
        for name in backends:
            try:
                num, rate, width, height = _PROBE[name](path)
            except Exception as err:  # noqa: BLE001 - each decoder fails its own way on a bad file
                errors.append(f"{name}: {type(err).__name__}: {str(err).strip()[:200]}")
                continue
            if num < 1:
                errors.append(f"{name}: no video frames")
                continue
            return cls(path, num, float(fps or rate), width, height, name)
        raise ValueError(f"cannot read {path} as a video; decoders tried: " + "; ".join(errors))

    def read(self, indices: Sequence[int]) -> np.ndarray:
        """Frames at `indices` as a [n, H, W, 3] uint8 array."""
        indices = [int(i) for i in indices]
        bad = [i for i in indices if not 0 <= i < self.num_frames]
        if bad:
            raise IndexError(f"frame indices {bad[:5]} outside [0, {self.num_frames})")
        if self._frames is not None:
            return self._frames[indices]
        return _READ[self.backend](self.path, indices)


SAMPLING_RULES = FRAME_RULES  # "round", "floor", "middle" (see `uniform_indices`)


def sampling_rule(family: str | None) -> str:
    """The uniform-sampling rule of a family's reference pipeline (its `Family.frame_rule`; "round" when the family
    is unknown)."""
    if family and family in family_names():
        return get_family(family).frame_rule
    return "round"


def __getattr__(name: str):
    # `FRAME_SAMPLING` (family -> rule) is derived from the family registry on use
    if name == "FRAME_SAMPLING":
        return {name: get_family(name).frame_rule for name in family_names()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def uniform_indices(total: int, count: int, rule: str = "round") -> list[int]:
    """`count` frame indices spread evenly over `total` frames, by one of two reference rules:

    "round": qwen-vl-utils (the Qwen-VL families): `linspace(0, total - 1, count).round()`; a clip with fewer
        frames than asked gives each frame once (qwen-vl-utils refuses that request; vtc samples what exists).
    "floor": LLaVA's evaluation wrappers and QuoTA's pipeline: `np.linspace(0, total - 1, count, dtype=int)`,
        which truncates and keeps duplicates when the clip is shorter: 11 frames, 4 samples -> [0, 3, 6, 10]
        ("round" gives [0, 3, 7, 10]); 3 frames, 5 samples -> [0, 0, 1, 1, 2].
    "middle": InternVL's `get_index` (its video demo and lmms-eval's InternVL wrappers): the middle frame of
        `count` equal segments of `total - 1` frames, `int(seg / 2 + round(seg * i))` with seg = (total - 1) / count:
        11 frames, 4 samples -> [1, 3, 6, 9]; a shorter clip keeps duplicates (3 frames, 5 samples -> [0, 0, 1, 1, 2]).
    """
    if isinstance(count, bool) or int(count) != count or count < 1:
        raise ValueError(f"number of frames must be a positive integer, got {count!r}")
    if total < 1:
        raise ValueError(f"the video has no frames (total={total})")
    if rule not in SAMPLING_RULES:
        raise ValueError(f"frame sampling rule must be one of {', '.join(SAMPLING_RULES)}, got {rule!r}")
    count = int(count)
    if rule == "floor":
        return np.linspace(0, total - 1, count, dtype=int).tolist()
    if rule == "middle":
        segment = (total - 1) / count
        return [int(segment / 2 + np.round(segment * i)) for i in range(count)]
    if count >= total:
        return list(range(total))
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


# --- backends -------------------------------------------------------------------------------------------------
def _probe_decord(path):
    import decord

    reader = decord.VideoReader(path, num_threads=1)
    height, width = reader[0].shape[:2]
    return len(reader), float(reader.get_avg_fps()), width, height


def _read_decord(path, indices):
    import decord

    return decord.VideoReader(path, num_threads=1).get_batch(indices).asnumpy()


def _probe_torchcodec(path):
    from torchcodec.decoders import VideoDecoder

    meta = VideoDecoder(path).metadata
    return int(meta.num_frames), float(meta.average_fps), int(meta.width), int(meta.height)


def _read_torchcodec(path, indices):
    from torchcodec.decoders import VideoDecoder

    frames = VideoDecoder(path).get_frames_at(indices).data
    return frames.permute(0, 2, 3, 1).numpy()


def _probe_pyav(path):
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        num = stream.frames or sum(1 for _ in container.decode(stream))
        rate = float(stream.average_rate) if stream.average_rate else 1.0
        return int(num), rate, stream.codec_context.width, stream.codec_context.height


def _read_pyav(path, indices):
    import av

    wanted = sorted(set(indices))
    found: dict[int, np.ndarray] = {}
    with av.open(path) as container:
        for i, frame in enumerate(container.decode(video=0)):
            if i in wanted:
                found[i] = frame.to_ndarray(format="rgb24")
            if i >= wanted[-1]:
                break
    return np.stack([found[i] for i in indices])


_PROBE = {"decord": _probe_decord, "torchcodec": _probe_torchcodec, "pyav": _probe_pyav}
_READ = {"decord": _read_decord, "torchcodec": _read_torchcodec, "pyav": _read_pyav}


# --- synthetic clips ----------------------------------------------------------------------------------------------
def synthetic_video(num_frames: int = 64, height: int = 224, width: int = 224, seed: int = 0) -> np.ndarray:
    """A clip with structure compression methods can find, as [T, H, W, 3] uint8.

    Three scenes (cuts at 1/3 and 2/3): a red square moving left to right over a blue circle that stays
    still; a static stretch (identical frames) with a green triangle; a yellow disc bouncing over a random
    texture (fixed by `seed`).
    """
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    cut1, cut2 = num_frames // 3, 2 * num_frames // 3
    texture = (rng.integers(0, 40, size=(height, width, 1)) + np.array([30, 30, 60])).astype(np.uint8)
    for t in range(num_frames):
        if t < cut1:
            img = np.full((height, width, 3), (235, 235, 235), dtype=np.uint8)
            cy, cx, r = height // 2, width // 4, min(height, width) // 8
            img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = (40, 60, 200)
            side = min(height, width) // 6
            x0 = int((width - side) * t / max(cut1 - 1, 1))
            y0 = height // 5
            img[y0 : y0 + side, x0 : x0 + side] = (210, 30, 30)
        elif t < cut2:
            img = np.full((height, width, 3), (20, 90, 40), dtype=np.uint8)
            tri = (yy > height // 4) & (yy < 3 * height // 4) & (np.abs(xx - width // 2) < (yy - height // 4) // 2)
            img[tri] = (120, 230, 120)
        else:
            img = texture.copy()
            phase = (t - cut2) / max(num_frames - cut2, 1)
            cy = int(height / 2 + height / 3 * math.sin(2 * math.pi * phase))
            cx = int(width * (0.2 + 0.6 * phase))
            r = min(height, width) // 10
            img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = (240, 210, 40)
        frames[t] = img
    return frames


def static_clip(num_frames: int = 32, height: int = 224, width: int = 224, seed: int = 0, object_size: int = 24):
    """A static-heavy clip, as [T, H, W, 3] uint8: a still background (a slide-like layout of flat panels and a
    fixed texture, the same bytes in every frame, as a surveillance camera or a screen recording) with one small
    square moving across it. Most of every frame repeats the frame before exactly."""
    rng = np.random.default_rng(seed)
    background = np.full((height, width, 3), (245, 245, 240), dtype=np.uint8)
    background[: height // 6] = (30, 60, 120)  # a title bar
    background[height // 3 : 2 * height // 3, width // 8 : width // 2] = (200, 210, 225)  # a panel
    th, tw = height // 4, width // 3
    texture = rng.integers(0, 255, size=(th, tw, 3), dtype=np.uint8)
    background[height - th - 8 : height - 8, width - tw - 8 : width - 8] = texture  # a picture on the slide
    frames = np.repeat(background[None], num_frames, axis=0)
    span_y, span_x = max(height - object_size, 1), max(width - object_size, 1)
    for t in range(num_frames):
        phase = t / max(num_frames - 1, 1)
        y0 = int(span_y * (0.25 + 0.5 * phase))
        x0 = int(span_x * phase)
        frames[t, y0 : y0 + object_size, x0 : x0 + object_size] = (220, 40, 40)
    return frames


def encode_video(frames: np.ndarray, fps: float = 8.0) -> bytes:
    """Encode frames ([T, H, W, 3] uint8, or grey [T, H, W]: `as_rgb_frames`) as an mp4 (mpeg4 with PyAV, so it
    decodes everywhere) and return its bytes."""
    import av

    frames = as_rgb_frames(frames)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=int(round(fps)))
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "2"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def write_video(path: "str | os.PathLike", frames: np.ndarray, fps: float = 8.0) -> str:
    """Encode frames ([T, H, W, 3] uint8) to an mp4 file (see `encode_video`)."""
    path = os.fspath(path)
    with open(path, "wb") as f:
        f.write(encode_video(frames, fps))
    return path
