"""vtc's offline demo encoders: a tiny random CLIP (`vtc-tiny-clip`, an open_clip config) and a tiny random DINOv2
(`vtc-tiny-dinov2`, saved to a temporary directory on first use). The samplers' tests, `vtc viz`'s demo and a vLLM
server started for a demo name them instead of the papers' checkpoints, which need a download.
Both names are known in every process that loads them (`vtc.media.relevance.load_clip`, `vtc.media.encoders
.image_encoder` register them on first use): a vLLM server's prompt processor too."""

from __future__ import annotations

import functools
import os

import torch

ASSETS = os.path.join(os.path.dirname(__file__), "assets")
TINY_CLIP, TINY_DINOV2 = "vtc-tiny-clip", "vtc-tiny-dinov2"


def register_tiny_clip() -> bool:
    """Make open_clip know `vtc-tiny-clip` (a tiny random CLIP, for quota-clip without downloads). False when
    open_clip is not installed."""
    try:
        import open_clip
    except ImportError:
        return False
    open_clip.add_model_config(ASSETS)
    return True


@functools.lru_cache(maxsize=None)
def tiny_dinov2_path() -> str:
    """A random-weight DINOv2 (2 layers, width 32, patch 14 at 56 px) and its image processor, saved in a temporary
    directory: what an image-encoder parameter (`encoder=`) of a sampler takes in tests, as a user passes
    `facebook/dinov2-base`."""
    import tempfile

    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    path = os.path.join(tempfile.mkdtemp(prefix="vtc-tiny-dinov2-"), "dinov2")
    torch.manual_seed(0)
    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=56, patch_size=14
    )
    Dinov2Model(config).eval().save_pretrained(path)
    processor = BitImageProcessor(
        size={"shortest_edge": 64},
        crop_size={"height": 56, "width": 56},
        do_center_crop=True,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
        resample=3,
    )
    processor.save_pretrained(path)
    return path


def register_tiny_dinov2() -> None:
    """Make `"vtc-tiny-dinov2"` an image-encoder name (`tiny_dinov2_path`, saved on first use), for the samplers'
    `test_params`."""
    from vtc.media.encoders import register_alias  # encoders imports this module lazily

    register_alias(TINY_DINOV2, tiny_dinov2_path)
