"""How relevant each frame is to a question, scored by CLIP: the frame scoring QuoTA's `quota-clip` variant uses,
shared by everything that ranks frames against a question (the `quota-clip` plugin, MemStream's frame
embeddings, and `vtc.vllm.client.select_frames`, which chooses frames on the client before a serving request).

Pure functions over frames and an open_clip model; no backend, no plugin. open_clip is optional
(`pip install 'vtc[clip]'`) and imported only when a model is loaded.
"""

from __future__ import annotations

import torch

from vtc.media.demo_encoders import TINY_CLIP, register_tiny_clip

_CLIP_CACHE: dict[tuple[str, str | None], tuple] = {}


def load_clip(name: str, pretrained: str | None):
    """An open_clip model, its image preprocessing and tokenizer (loaded once per process)."""
    key = (name, pretrained)
    if key not in _CLIP_CACHE:
        try:
            import open_clip
        except ImportError as err:
            raise ImportError(
                "CLIP frame scoring (quota-clip, select_frames) needs open_clip: pip install 'vtc[clip]'"
            ) from err
        if name == TINY_CLIP:
            register_tiny_clip()  # the offline demo CLIP, an open_clip config of vtc's own
        model, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=pretrained)
        _CLIP_CACHE[key] = (model.eval(), preprocess, open_clip.get_tokenizer(name))
    return _CLIP_CACHE[key]


def clip_yes_probabilities(clip, preprocess, tokenizer, frames, question: str, objects: list[str]) -> list[float]:
    """CLIP zero-shot "relevant vs. anything" per frame ([T, H, W, 3] uint8), as P(yes): the text "a photo
    containing <objects>." (or the question itself when there are no objects) against "a photo."."""
    from PIL import Image

    relevant = ("a photo containing " + ", ".join(objects) + ".") if objects else question
    device = next(clip.parameters()).device
    with torch.no_grad():
        images = torch.stack([preprocess(Image.fromarray(f)) for f in frames]).to(device)
        image = torch.nn.functional.normalize(clip.encode_image(images).float(), dim=-1)
        text_tokens = tokenizer([relevant, "a photo."]).to(device)
        texts = torch.nn.functional.normalize(clip.encode_text(text_tokens).float(), dim=-1)
        logits = 100.0 * image @ texts.T
    return torch.softmax(logits, dim=-1)[:, 0].tolist()


def frame_weights(scores: list[float], scale: float, power: float) -> list[float]:
    """QuoTA's frame weights: w_i = (scale * p_i) ** power, normalised to sum to 1 (uniform when every score is 0)."""
    raw = [(scale * p) ** power for p in scores]
    total = sum(raw)
    return [w / total for w in raw] if total > 0 else [1.0 / len(raw)] * len(raw)
