"""Small random-weight models of every model family, built offline from configs.

Used by the test suite, by `vtc run` with no arguments (the offline demo) and by `vtc bench` (the mid-size
timing model). Nothing is downloaded: the tokenizer is a byte-level BPE trained in-process on a few fixed
sentences, the weights are random (seeded), and the processors are built from their classes.

Each family names its builder in its `Family` record (`vtc.core.families`, `Family.tiny`): a function of a
`TinySize` returning `(model, processor)`. The builders of vtc's own families live here.

These models answer with noise. They exist to exercise every code path of a real checkpoint of the same
architecture (token layout, M-RoPE, DeepStack, pooling, newline tokens), not to produce meaningful text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vtc.core.families import family_names, get_family


def __getattr__(name: str):
    # `FAMILIES`: every registered family (asked of the registry on use, so a family added later is included)
    if name == "FAMILIES":
        return family_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
LLAVA_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>", "<video>"]
# InternVL (-hf checkpoints): a Qwen2.5 tokenizer plus the image tokens its processor reads from the tokenizer
INTERNVL_IMAGE_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
INTERNVL_SPECIAL_TOKENS = QWEN_SPECIAL_TOKENS + list(INTERNVL_IMAGE_TOKENS.values())

# Enough varied text for a byte-level BPE to learn a useful vocabulary; the content is irrelevant.
_TRAINING_TEXT = [
    "What happens in this video? Describe the scene in detail.",
    "A red square moves from the left to the right while a blue circle stays still.",
    "The camera cuts to a new scene with a green triangle and a yellow background.",
    "How many objects are visible, and which one moves the fastest?",
    "Answer with the option's letter from the given choices directly.",
    "user assistant system You are a helpful assistant.",
    "0 1 2 3 4 5 6 7 8 9 seconds frames time <0.5 seconds> <1.0 seconds>",
]

QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAVA_OV_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'video' %}<video>\n{% elif content['type'] == 'image' %}<image>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAVA_NEXT_VIDEO_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'video' %}<video>\n{% elif content['type'] == 'image' %}<image>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

# InternVL3 / InternVL3.5 -hf: an image is one <IMG_CONTEXT> (the processor expands it to <img>...</img> per tile), a
# video one <video> (expanded to "Frame1: <img>...</img>\nFrame2: ..." per frame)
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'video' %}<video>\n{% elif content['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class TinySize:
    """Shape of the language model and, for the released shapes, of the vision tower (the toy sizes keep a
    2-4 block, 64-wide tower, which hides the tower's share of time to first token)."""

    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 512  # BPE vocabulary to train (the few training sentences may yield fewer tokens)
    # released shapes: the family they belong to, the checkpoint, its vision config (merged over the family's tiny
    # one) and its LLM depth, of which `layers` are built (benchmarks scale the LLM's time by released / built)
    family: str | None = None
    checkpoint: str | None = None
    vision: tuple[tuple[str, Any], ...] = ()
    released_layers: int | None = None

    @property
    def released(self) -> bool:
        return self.checkpoint is not None

    @property
    def layer_scale(self) -> float:
        """Released LLM depth / built depth (1 for the toy sizes and the full-depth released shapes)."""
        return (self.released_layers or self.layers) / self.layers

    def describe(self) -> str:
        """What a benchmark built, for its title: the checkpoint's shape and how much of its LLM."""
        if self.layer_scale == 1.0:
            llm = f"LLM at its full {self.layers} layers"
        else:
            llm = f"LLM {self.layers} of its {self.released_layers} layers built, LLM time x{self.layer_scale:g}"
        return f"random-weight {self.checkpoint} shape (vision tower as released; {llm})"

    def vision_config(self, tiny: dict[str, Any]) -> dict[str, Any]:
        """The family's tiny vision config with this shape's released values over it."""
        merged = dict(tiny)
        merged.update({key: list(v) if isinstance(v, tuple) else v for key, v in self.vision})
        return merged


_QWEN25_TOWER = (  # Qwen2.5-VL-3B/7B/72B share the vision tower (32 blocks of 1280, window attention)
    ("depth", 32),
    ("hidden_size", 1280),
    ("intermediate_size", 3420),
    ("num_heads", 16),
    ("fullatt_block_indexes", (7, 15, 23, 31)),
    ("window_size", 112),
)
_QWEN2_TOWER = (("depth", 32), ("embed_dim", 1280), ("num_heads", 16), ("mlp_ratio", 4))  # Qwen2-VL-2B/7B/72B
_QWEN2_7B = dict(hidden=3584, heads=28, kv_heads=4, intermediate=18944, released_layers=28)

# Released checkpoints' shapes (from their config.json), random weights: the vision tower is the checkpoint's own, the
# LLM of its width with 4 of its layers built (the 7-8B LLMs do not fit a 2-core machine's time or 24 GiB in fp32),
# except qwen2-vl-2b, built whole: the one released shape whose in-LLM schedules (FastV's K, FrameFusion's merge
# layers) run at their real depth on such a machine. `vtc bench --size NAME`.
RELEASED_SIZES = {
    "qwen2-vl-2b": TinySize(  # Qwen2-1.5B as the LLM, all 28 layers
        hidden=1536,
        layers=28,
        heads=12,
        kv_heads=2,
        intermediate=8960,
        vocab=1024,
        family="qwen2_vl",
        checkpoint="Qwen/Qwen2-VL-2B-Instruct",
        released_layers=28,
        vision=_QWEN2_TOWER,
    ),
    "qwen2-vl-7b": TinySize(
        layers=4,
        vocab=1024,
        family="qwen2_vl",
        checkpoint="Qwen/Qwen2-VL-7B-Instruct",
        **_QWEN2_7B,
        vision=_QWEN2_TOWER,
    ),
    "qwen2.5-vl-7b": TinySize(
        layers=4,
        vocab=1024,
        family="qwen2_5_vl",
        checkpoint="Qwen/Qwen2.5-VL-7B-Instruct",
        **_QWEN2_7B,
        vision=_QWEN25_TOWER,
    ),
    "qwen2.5-vl-3b": TinySize(
        hidden=2048,
        layers=4,
        heads=16,
        kv_heads=2,
        intermediate=11008,
        vocab=1024,
        family="qwen2_5_vl",
        checkpoint="Qwen/Qwen2.5-VL-3B-Instruct",
        vision=_QWEN25_TOWER,
        released_layers=36,
    ),
    "qwen3-vl-8b": TinySize(
        hidden=4096,
        layers=4,
        heads=32,
        kv_heads=8,
        intermediate=12288,
        vocab=1024,
        family="qwen3_vl",
        checkpoint="Qwen/Qwen3-VL-8B-Instruct",
        released_layers=36,
        vision=(
            ("depth", 27),
            ("hidden_size", 1152),
            ("intermediate_size", 4304),
            ("num_heads", 16),
            ("num_position_embeddings", 2304),
            ("deepstack_visual_indexes", (8, 16, 24)),
        ),
    ),
    "llava-onevision-7b": TinySize(  # SigLIP-so400m as LLaVA-OneVision keeps it: 26 of its 27 layers
        layers=4,
        vocab=1024,
        family="llava_onevision",
        checkpoint="llava-hf/llava-onevision-qwen2-7b-ov-hf",
        **_QWEN2_7B,
        vision=(
            ("hidden_size", 1152),
            ("intermediate_size", 4304),
            ("num_hidden_layers", 26),
            ("num_attention_heads", 16),
        ),
    ),
    "llava-next-video-7b": TinySize(  # CLIP ViT-L/14 at 336 px, a Vicuna-7B LLM
        hidden=4096,
        layers=4,
        heads=32,
        kv_heads=32,
        intermediate=11008,
        vocab=1024,
        family="llava_next_video",
        checkpoint="llava-hf/LLaVA-NeXT-Video-7B-hf",
        released_layers=32,
        vision=(
            ("hidden_size", 1024),
            ("intermediate_size", 4096),
            ("num_hidden_layers", 24),
            ("num_attention_heads", 16),
            ("projection_dim", 768),
        ),
    ),
}


SIZES = {
    # unit tests: every forward well under a second
    "tiny": TinySize(),
    # `vtc run` demo: big enough that compression visibly speeds up prefill on 2 CPU cores
    "demo": TinySize(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1536, vocab=1024),
    # `vtc bench` default: Qwen2-0.5B-shaped LLM (ENVIRONMENT.md: ~15 s per 1k-token prefill on 2 cores)
    "bench": TinySize(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=1024),
    # `vtc bench --backend vllm` default: the same shape with 12 layers (the EVS peer measurement's model)
    "bench12": TinySize(hidden=896, layers=12, heads=14, kv_heads=2, intermediate=4864, vocab=1024),
    **RELEASED_SIZES,
}


def build_tokenizer(family: str, vocab_size: int = 512):
    """A byte-level BPE tokenizer with the family's special tokens, trained in-process (no network). `family` picks
    the token set: "qwen*" (Qwen-VL), "internvl" (Qwen tokens + InternVL's image tokens), anything else LLaVA's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if family.startswith("qwen"):
        special = QWEN_SPECIAL_TOKENS
    elif family == "internvl":
        special = INTERNVL_SPECIAL_TOKENS
    else:
        special = LLAVA_SPECIAL_TOKENS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TRAINING_TEXT * 4, trainer=trainer)
    if family.startswith("qwen"):
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
        )
    elif family == "internvl":
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            padding_side="left",
            extra_special_tokens=dict(INTERNVL_IMAGE_TOKENS),
        )
    else:
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
            padding_side="left",
            extra_special_tokens={"image_token": "<image>", "video_token": "<video>"},
        )
    return fast


def _text_config(size: TinySize, tokenizer, **extra) -> dict[str, Any]:
    return dict(
        vocab_size=len(tokenizer),  # every id the model can emit decodes to text
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=32768,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **extra,
    )


def _qwen_ids(tokenizer) -> dict[str, int]:
    ids = tokenizer.convert_tokens_to_ids
    return dict(
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )


def _mrope_section(size: TinySize) -> list[int]:
    half = size.hidden // size.heads // 2  # head_dim / 2
    t = half // 4
    rest = half - t
    return [t, rest // 2, rest - rest // 2]


def build(family: str, size: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.float32):
    """Return `(model, processor)` for a random-weight model of `family` (any registered family with a tiny builder,
    `vtc.core.families.Family.tiny`)."""
    builder = get_family(family).tiny_builder()  # ValueError naming the known families
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    shape = SIZES[size]
    if shape.family is not None and shape.family != family:
        raise ValueError(f"size {size!r} is the shape of {shape.checkpoint}, a {shape.family} model, not {family}")
    torch.manual_seed(seed)
    model, processor = builder(shape)
    tokenizer = getattr(processor, "tokenizer", processor)
    model = model.to(dtype).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, processor


def _qwen_text_config(shape: TinySize, tokenizer) -> dict[str, Any]:
    return _text_config(
        shape,
        tokenizer,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _mrope_section(shape)},
    )


def build_qwen2_vl(shape: TinySize):
    tokenizer = build_tokenizer("qwen2_vl", shape.vocab)
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    config = Qwen2VLConfig(
        text_config=_qwen_text_config(shape, tokenizer),
        vision_config=shape.vision_config(
            dict(depth=2, embed_dim=64, hidden_size=shape.hidden, num_heads=4, mlp_ratio=2)
        ),
        **_qwen_ids(tokenizer),
    )
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(),
        video_processor=Qwen2VLVideoProcessor(),
        tokenizer=tokenizer,
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    return Qwen2VLForConditionalGeneration(config), processor


def build_qwen2_5_vl(shape: TinySize):
    tokenizer = build_tokenizer("qwen2_5_vl", shape.vocab)
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    config = Qwen2_5_VLConfig(
        text_config=_qwen_text_config(shape, tokenizer),
        vision_config=shape.vision_config(
            dict(
                depth=4,
                hidden_size=64,
                intermediate_size=128,
                num_heads=4,
                out_hidden_size=shape.hidden,
                fullatt_block_indexes=[1, 3],
                window_size=56,
            )
        ),
        **_qwen_ids(tokenizer),
    )
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(),
        video_processor=Qwen2VLVideoProcessor(),
        tokenizer=tokenizer,
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    return Qwen2_5_VLForConditionalGeneration(config), processor


def build_qwen3_vl(shape: TinySize):
    tokenizer = build_tokenizer("qwen3_vl", shape.vocab)
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    text = _text_config(
        shape,
        tokenizer,
        head_dim=shape.hidden // shape.heads,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": _mrope_section(shape),
            "mrope_interleaved": True,
        },
    )
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=shape.vision_config(
            dict(
                depth=3,
                hidden_size=64,
                intermediate_size=128,
                num_heads=4,
                patch_size=16,
                out_hidden_size=shape.hidden,
                num_position_embeddings=256,
                deepstack_visual_indexes=[0, 1],
            )
        ),
        **_qwen_ids(tokenizer),
    )
    # Qwen3-VL normalises images and videos alike (mean = std = 0.5, as its video processor's defaults); vLLM
    # normalises video pixels inside the model with the image processor's values
    image_processor = Qwen2VLImageProcessor(patch_size=16, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        video_processor=Qwen3VLVideoProcessor(),
        tokenizer=tokenizer,
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    return Qwen3VLForConditionalGeneration(config), processor


def build_llava_onevision(shape: TinySize):
    tokenizer = build_tokenizer("llava_onevision", shape.vocab)
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    ids = tokenizer.convert_tokens_to_ids
    config = LlavaOnevisionConfig(
        text_config=dict(model_type="qwen2", **_text_config(shape, tokenizer)),
        vision_config=shape.vision_config(
            dict(
                model_type="siglip_vision_model",
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                image_size=384,
                patch_size=14,
                vision_use_head=False,  # LLaVA-OneVision drops SigLIP's pooling head
            )
        ),
        image_token_index=ids("<image>"),
        video_token_index=ids("<video>"),
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
    )
    processor = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(),
        video_processor=LlavaOnevisionVideoProcessor(),
        tokenizer=tokenizer,
        num_image_tokens=729,
        vision_feature_select_strategy="full",
        chat_template=LLAVA_OV_CHAT_TEMPLATE,
    )
    return LlavaOnevisionForConditionalGeneration(config), processor


def build_llava_next_video(shape: TinySize):
    tokenizer = build_tokenizer("llava_next_video", shape.vocab)
    from transformers import (
        LlavaNextImageProcessor,
        LlavaNextVideoConfig,
        LlavaNextVideoForConditionalGeneration,
        LlavaNextVideoProcessor,
        LlavaNextVideoVideoProcessor,
    )

    ids = tokenizer.convert_tokens_to_ids
    config = LlavaNextVideoConfig(
        text_config=dict(model_type="llama", **_text_config(shape, tokenizer)),
        vision_config=shape.vision_config(
            dict(
                model_type="clip_vision_model",
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                image_size=336,
                patch_size=14,
                projection_dim=64,
            )
        ),
        image_token_index=ids("<image>"),
        video_token_index=ids("<video>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    size = {"shortest_edge": 336}
    crop = {"height": 336, "width": 336}
    processor = LlavaNextVideoProcessor(
        video_processor=LlavaNextVideoVideoProcessor(size=size, crop_size=crop),
        image_processor=LlavaNextImageProcessor(size=size, crop_size=crop),
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # the CLIP tower's CLS token (what released checkpoints set)
        chat_template=LLAVA_NEXT_VIDEO_CHAT_TEMPLATE,
    )
    return LlavaNextVideoForConditionalGeneration(config), processor


def build_internvl(shape: TinySize):
    """InternVL3-shaped: a 2-layer InternViT (224 px, patch 14: 16 x 16 patches + CLS per frame), pixel shuffle 0.5
    to 8 x 8 = 64 tokens per frame, the 2-layer MLP projector, a Qwen2 LLM (1-D RoPE). Frames are encoded as
    one-tile images (`pixel_values`), each its own `<img>...</img>` run behind a `FrameK: ` label."""
    tokenizer = build_tokenizer("internvl", shape.vocab)
    from transformers import (
        GotOcr2ImageProcessor,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        InternVLVideoProcessor,
    )

    side, patch = 224, 14
    config = InternVLConfig(
        text_config=dict(model_type="qwen2", **_text_config(shape, tokenizer)),
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=side,
            patch_size=patch,
        ),
        image_token_id=tokenizer.context_image_token_id,
        image_seq_length=(side // patch // 2) ** 2,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    size = {"height": side, "width": side}
    processor = InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=True, max_patches=4),
        video_processor=InternVLVideoProcessor(size=size),
        tokenizer=tokenizer,
        image_seq_length=(side // patch // 2) ** 2,
        chat_template=INTERNVL_CHAT_TEMPLATE,
    )
    return InternVLForConditionalGeneration(config), processor


def save(
    family: str,
    path: str,
    size: str = "tiny",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    built: tuple[Any, Any] | None = None,
) -> str:
    """Save a tiny random-weight model of `family` and its processor to `path`, loadable offline by transformers
    and by vLLM (`vllm.LLM(path)`, `vllm serve path`). Returns `path`. `built`: the (model, processor) to save
    instead of building them (a test that compares HF with vLLM saves the very model it runs).

    transformers 5.x saves LLaVA vision towers as `vision_tower.embeddings...`; vLLM's loaders expect the CLIP /
    SigLIP wrapper name (`vision_tower.vision_model...`), so the checkpoint is rewritten with those names
    (transformers reads both)."""
    import os

    from safetensors.torch import load_file, save_file

    model, processor = built if built is not None else build(family, size=size, seed=seed, dtype=dtype)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    if family.startswith("llava"):
        weights = os.path.join(path, "model.safetensors")
        state = load_file(weights)
        renamed = {}
        for key, value in state.items():
            if ".vision_tower." in f".{key}" and ".vision_model." not in key:
                key = key.replace("vision_tower.", "vision_tower.vision_model.", 1)
            renamed[key] = value
        save_file(renamed, weights, metadata={"format": "pt"})
    return path
