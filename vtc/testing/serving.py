"""vLLM engines on the tiny offline models, for tests and benchmarks on CPU.

`engine(path, vtc=...)` starts an in-process `vllm.LLM` (no worker processes: ~20 s on 2 cores instead of ~35 s,
and vtc's model objects stay reachable); `reconfigure(llm, config)` switches the vtc config of a running engine so
a test can try several methods on one engine (a real server's config is fixed at start). `video_request` builds
the prompt and multimodal data for one or more generated clips (and images); `record_positions` makes an engine
keep the M-RoPE positions of the prompts it runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vtc.media.inputs import build_messages
from vtc.vllm.config import CONFIG_ATTR, ServeConfig
from vtc.vllm.engine import CPU_ENV, shutdown, start  # noqa: F401  (re-exported for tests and benchmarks)


def engine(path: str, vtc: dict[str, Any] | None = None, **kwargs: Any):
    """A `vllm.LLM` on `path` in this process, with prefix caching off (a test that reconfigures vtc sends the
    same prompt twice); `vtc` is the additional_config entry. On a machine without CUDA: vLLM's CPU build, fp32,
    a 256 MiB KV cache."""
    options: dict[str, Any] = dict(
        max_model_len=8192, limit_mm_per_prompt={"video": 2, "image": 0}, seed=0, enable_prefix_caching=False
    )
    options.update(kwargs)
    return start(path, vtc, **options)


def reconfigure(llm, config: dict[str, Any]) -> None:
    """Switch a running engine started with a vtc config to another vtc config (prompt side and model side).
    Clears the encoder cache, which holds the previous config's results (a server must restart for a new
    config). An engine without vtc is another engine: the start config also switches vLLM's pruning path on."""
    from vtc.vllm.models import Serving

    hf_config = llm.llm_engine.model_config.hf_config
    checked = ServeConfig.from_dict(config).for_model(getattr(hf_config, "vision_config", None))  # as at start
    setattr(hf_config, CONFIG_ATTR, checked.to_dict())

    def switch(model):
        if getattr(model, "vtc", None) is None:
            raise RuntimeError("this engine was not started with a vtc config (or vtc's plugin was not loaded)")
        model.vtc = Serving(model, model.family, checked)

    llm.apply_model(switch)
    clear_caches(llm)


def clear_caches(llm) -> None:
    """Forget processed media and encoder outputs (vLLM reuses both by media hash, across requests)."""
    llm.reset_mm_cache()
    llm.llm_engine.reset_encoder_cache()


def last_kept_cells(model) -> list[int]:
    """The grid cells the last compressed video kept in this worker, [] if it compressed none (a pipeline stage
    after the first). `llm.apply_model(last_kept_cells)` asks every worker; a module-level function, so vLLM can
    send it to worker processes."""
    from vtc.vllm.models import LAST_KEPT

    return LAST_KEPT[-1]["cells"].tolist() if LAST_KEPT else []


POSITIONS: list[Any] = []  # M-RoPE positions [3, L] of the prompts an engine ran, newest last (record_positions)


def record_positions(model) -> None:
    """Make an in-process engine's model record the M-RoPE positions of every prompt in `POSITIONS`
    (`llm.apply_model(record_positions)`): a stock model's when the request is scheduled, vtc's each time a chunk
    of media embeddings fills them, so the last entry is the last prompt's final positions."""
    for name in ("get_mrope_input_positions", "recompute_mrope_positions"):
        method = getattr(model, name, None)
        if method is None or (name == "recompute_mrope_positions" and getattr(model, "vtc", None) is None):
            continue

        def recording(*args, _method=method, _name=name, **kwargs):
            out = _method(*args, **kwargs)
            POSITIONS.append((out[0] if _name == "get_mrope_input_positions" else out[1]).clone().cpu())
            del POSITIONS[:-256]
            return out

        setattr(model, name, recording)


def video_metadata(num_frames: int, fps: float = 8.0) -> dict[str, Any]:
    return {
        "fps": fps,
        "total_num_frames": num_frames,
        "duration": num_frames / fps,
        "frames_indices": list(range(num_frames)),
        "do_sample_frames": False,
    }


def video_request(
    tokenizer, frames: list[np.ndarray] | np.ndarray, question: str, fps: float = 8.0, images: list[Any] = ()
) -> dict[str, Any]:
    """A `generate` request with one or more videos ([T, H, W, 3] uint8 each, sampled at `fps`), then `images`
    (PIL), then the question."""
    videos = [frames] if isinstance(frames, np.ndarray) else list(frames)
    chat = build_messages(question, videos=len(videos), images=len(images))
    prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    data = [(v, video_metadata(len(v), fps)) for v in videos]
    media: dict[str, Any] = {"video": data[0] if len(data) == 1 else data}
    if images:
        media["image"] = images[0] if len(images) == 1 else list(images)
    return {"prompt": prompt, "multi_modal_data": media}
