"""Auxiliary frame encoders for the sample stage (CLIP through open_clip, DINOv2 through transformers), and the
bounded cache of the features they compute.

A sampler names its encoder as a parameter: a model name the library knows (`"ViT-L-14"` with weights tag
`"openai"` for open_clip, `"facebook/dinov2-base"` for transformers), a local path (an open_clip checkpoint file,
a saved transformers directory), or an encoder object (anything with `key`, `encode_images` and, for
question-aware samplers, `encode_text` and `logit_scale`). Tests use random-weight encoders saved locally; users
run the paper's checkpoints.

Features are computed once per (video, encoder, frames, pooling) and kept in a process-wide LRU cache bounded in
bytes (`FEATURE_CACHE`, 256 MiB by default; `VTC_FEATURE_CACHE_MB` sets it, 0 turns it off), so an evaluation
grid that asks many questions of one video at many retentions encodes its frames once. A 1-hour video at 1 fps
with CLIP ViT-L/14 features (768 floats a frame) takes 11 MiB.

Pure functions and small classes over frames; no backend, no plugin.
"""

from __future__ import annotations

import collections
import hashlib
import os
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch

from vtc.media.demo_encoders import TINY_DINOV2, register_tiny_dinov2
from vtc.media.relevance import load_clip

BATCH = 32  # frames per encoder forward


class FrameEncoder(Protocol):
    """What samplers need from an encoder. `key` names it in the feature cache (two encoders with the same key must
    give the same features)."""

    key: str

    def encode_images(self, frames: np.ndarray) -> torch.Tensor:
        """[n, H, W, 3] uint8 frames -> [n, D] float32 features (not normalised)."""
        ...


class TextImageEncoder(FrameEncoder, Protocol):
    logit_scale: float  # CLIP's exp(logit_scale): similarities are `logit_scale * cos`
    logit_bias: float  # SigLIP's bias (0 for CLIP)

    def encode_text(self, texts: Sequence[str]) -> torch.Tensor:
        """[n, D] float32 text features (not normalised)."""
        ...


class EncoderLoadError(RuntimeError):
    """An encoder could not be loaded; the message names the parameter that takes a local path."""


def _offline_hint(param: str, what: str, example: str) -> str:
    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("TRANSFORMERS_OFFLINE") == "1"
    where = "offline (HF_HUB_OFFLINE=1) it must be on disk already" if offline else "it could not be downloaded"
    return f"{where}; pass {what} as `{param}` (e.g. {example})"


class ClipEncoder:
    """An open_clip model: image and text towers, with CLIP's learned logit scale."""

    def __init__(self, name: str, pretrained: str | None, *, param: str = "encoder"):
        try:
            import open_clip
        except ImportError as err:
            raise ImportError("CLIP frame scoring needs open_clip: pip install 'vtc[clip]'") from err
        try:  # the process-wide open_clip cache quota-clip loads from too: one model for both
            model, preprocess, self.tokenizer = load_clip(name, pretrained)
        except Exception as err:  # noqa: BLE001 - open_clip and the hub fail in many ways; all mean "not loadable"
            if name not in open_clip.list_models():
                raise ValueError(
                    f"unknown CLIP encoder {name!r} for `{param}`: not an open_clip architecture (open_clip"
                    f".list_models() has {len(open_clip.list_models())}, e.g. ViT-B-32, ViT-L-14, ViT-SO400M-14-SigLIP)"
                ) from err
            hint = _offline_hint(f"{param}_pretrained", "a local open_clip checkpoint file", "/models/vit-l-14.bin")
            raise EncoderLoadError(f"cannot load CLIP {name!r} with weights {pretrained!r}: {hint} ({err})") from err
        self.model = model
        self.preprocess = preprocess
        self.key = f"open_clip:{name}:{pretrained}"
        self.logit_scale = float(self.model.logit_scale.detach().exp()) if hasattr(self.model, "logit_scale") else 100.0
        bias = getattr(self.model, "logit_bias", None)
        self.logit_bias = float(bias.detach()) if bias is not None else 0.0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def encode_images(self, frames: np.ndarray) -> torch.Tensor:
        from PIL import Image

        out = []
        for start in range(0, len(frames), BATCH):
            batch = torch.stack([self.preprocess(Image.fromarray(f)) for f in frames[start : start + BATCH]])
            out.append(self.model.encode_image(batch.to(self.device)).float().cpu())
        return torch.cat(out)

    @torch.no_grad()
    def encode_text(self, texts: Sequence[str]) -> torch.Tensor:
        return self.model.encode_text(self.tokenizer(list(texts)).to(self.device)).float().cpu()


class DinoEncoder:
    """A transformers image backbone (DINOv2): `pooling="mean"` averages every output token, CLS included (DIG's CAFS
    features), `"pooler"` is the model's `pooler_output` (KTV's)."""

    def __init__(self, name: str, pooling: str = "mean", *, param: str = "encoder"):
        if pooling not in ("mean", "pooler"):
            raise ValueError(f"pooling must be 'mean' or 'pooler', got {pooling!r}")
        from transformers import AutoImageProcessor, AutoModel

        try:
            self.processor = AutoImageProcessor.from_pretrained(name)
            self.model = AutoModel.from_pretrained(name).eval()
        except OSError as err:
            hint = _offline_hint(param, "a local directory saved with save_pretrained", "/models/dinov2-base")
            raise EncoderLoadError(f"cannot load the image encoder {name!r}: {hint} ({err})") from err
        self.pooling = pooling
        self.key = f"transformers:{name}:{pooling}"

    @torch.no_grad()
    def encode_images(self, frames: np.ndarray) -> torch.Tensor:
        out = []
        device = next(self.model.parameters()).device
        for start in range(0, len(frames), BATCH):
            pixels = self.processor(images=list(frames[start : start + BATCH]), return_tensors="pt")["pixel_values"]
            result = self.model(pixel_values=pixels.to(device))
            feats = result.pooler_output if self.pooling == "pooler" else result.last_hidden_state.mean(dim=1)
            out.append(feats.float().cpu())
        return torch.cat(out)


_ENCODERS: dict[tuple, Any] = {}

# names that stand for a local directory made on first use (`register_alias`; the test suite's "vtc-tiny-dinov2" is
# a random DINOv2 saved in a temporary directory, as "vtc-tiny-clip" is an open_clip config)
ALIASES: dict[str, Callable[[], str]] = {}


def register_alias(name: str, make_path: Callable[[], str]) -> None:
    """Let `image_encoder(name)` load the directory `make_path()` returns (called once, on first use)."""
    ALIASES[name] = make_path


def register_encoder(name: str, encoder: Any) -> None:
    """Let `name` stand for an encoder object (with `key` and `encode_images`, plus `encode_text` for a CLIP), where
    a parameter must be a string: a vLLM server's config is JSON. Registered in the process that chooses frames
    (for `vllm serve`, from a vLLM general plugin)."""
    _checked_object(encoder, f"register_encoder({name!r})", ("encode_images",))
    _ENCODERS[("named", name)] = encoder


def clip_encoder(spec: Any, pretrained: str | None = None, *, param: str = "encoder") -> TextImageEncoder:
    """A CLIP encoder from an open_clip architecture name (+ weights tag or local checkpoint file), or `spec` itself
    when it is already an encoder object. Loaded once per process."""
    if not isinstance(spec, str):
        return _checked_object(spec, param, ("encode_images", "encode_text"))
    if ("named", spec) in _ENCODERS:
        return _checked_object(_ENCODERS[("named", spec)], param, ("encode_images", "encode_text"))
    key = ("clip", spec, pretrained)
    if key not in _ENCODERS:
        _ENCODERS[key] = ClipEncoder(spec, pretrained, param=param)
    return _ENCODERS[key]


def image_encoder(spec: Any, pooling: str = "mean", *, param: str = "encoder") -> FrameEncoder:
    """A transformers image backbone by hub name or local directory, or `spec` itself when it is an encoder object.
    Loaded once per process."""
    if not isinstance(spec, str):
        return _checked_object(spec, param, ("encode_images",))
    if ("named", spec) in _ENCODERS:
        return _ENCODERS[("named", spec)]
    if spec == TINY_DINOV2 and spec not in ALIASES:
        register_tiny_dinov2()  # the offline demo DINOv2, known in every process that asks for it
    if spec in ALIASES:
        spec = ALIASES[spec]()
    key = ("image", spec, pooling)
    if key not in _ENCODERS:
        _ENCODERS[key] = DinoEncoder(spec, pooling, param=param)
    return _ENCODERS[key]


def _checked_object(obj: Any, param: str, methods: tuple[str, ...]):
    missing = [m for m in ("key", *methods) if not hasattr(obj, m)]
    if missing:
        raise TypeError(
            f"`{param}` must be a model name, a local path or an encoder object with key, {', '.join(methods)}; "
            f"{type(obj).__name__} has no {', '.join(missing)}"
        )
    return obj


# --- the feature cache ---------------------------------------------------------------------------------------------
class FeatureCache:
    """LRU of frame features, bounded in bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple) -> torch.Tensor | None:
        value = self._items.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(key)
        return value

    def put(self, key: tuple, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.max_bytes:
            return
        if key in self._items:
            old = self._items.pop(key)
            self.bytes -= old.numel() * old.element_size()
        self._items[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()

    def clear(self) -> None:
        self._items.clear()
        self.bytes = self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._items)


FEATURE_CACHE = FeatureCache(int(float(os.environ.get("VTC_FEATURE_CACHE_MB", "256")) * 2**20))


def video_key(source) -> tuple:
    """What identifies a video's frames: a file by path, size and modification time; frames in memory by a hash of
    their bytes."""
    if source.path is not None:
        stat = os.stat(source.path)
        return ("file", os.path.realpath(source.path), stat.st_size, stat.st_mtime_ns)
    key = getattr(source, "_feature_key", None)
    if key is None:  # hashed once per source (samplers encode a long video chunk by chunk)
        frames = np.ascontiguousarray(source.read(range(source.num_frames)))
        key = ("array", frames.shape, hashlib.blake2b(frames.data, digest_size=16).hexdigest())
        object.__setattr__(source, "_feature_key", key)
    return key


def frame_features(encoder: FrameEncoder, source, indices: Sequence[int]) -> torch.Tensor:
    """[len(indices), D] features of the video's frames at `indices`, from the cache when this encoder has seen them."""
    key = (video_key(source), encoder.key, tuple(int(i) for i in indices))
    cached = FEATURE_CACHE.get(key)
    if cached is not None:
        return cached
    feats = encoder.encode_images(source.read(list(indices)))
    FEATURE_CACHE.put(key, feats)
    return feats


def similarity_logits(encoder: TextImageEncoder, text: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """CLIP's scaled cosine `logit_scale * cos(t, v) + logit_bias` of one text against each image: [n]."""
    text = torch.nn.functional.normalize(text.reshape(1, -1), dim=-1)
    images = torch.nn.functional.normalize(images, dim=-1)
    return (images @ text.T).squeeze(-1) * encoder.logit_scale + encoder.logit_bias
