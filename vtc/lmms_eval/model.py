"""lmms-eval's `vtc` model: a HuggingFace video-LLM patched with vtc, answering each task's own chat messages.

    lmms-eval --model vtc --tasks videomme \\
        --model_args pretrained=Qwen/Qwen2.5-VL-7B-Instruct,methods=framefusion+quota,retention=0.25,num_frames=32

The task brings its messages (its prompts, its video); the model's own chat template renders them. vtc picks the
frames (the pipeline's `sample` stage, uniform by the family's rule without one) and compresses as patched.
With `backend=vllm` the same frames and prompt go to a `vllm.LLM` running vtc's serving config.
Every answer carries a per-document record (visual tokens in and out per stage, prefill time, TTFT) in the
logged sample's `token_counts`, and their means go to the results JSON's `throughput` block (`avg_vtc_*`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from typing import Any

import torch
from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from lmms_eval.api.model import lmms
from lmms_eval.models.model_utils.gen_metrics import log_metrics
from lmms_eval.protocol import ChatMessages
from tqdm import tqdm
from transformers import LogitsProcessor

import vtc
from vtc.core.pipeline import Pipeline
from vtc.core.stats import MediaItem
from vtc.hf.adapters import config_adapter, resolve_adapter
from vtc.hf.adapters.base import CapturedInputs
from vtc.hf.loading import load_model
from vtc.hf.timing import LLMTimer, synchronize
from vtc.lmms_eval.efficiency import doc_record, frame_record, served_record, summarize
from vtc.media.inputs import SampledVideo, prepare_batch, processor_video_kwargs, sample_frames
from vtc.media.video import VideoSource
from vtc.vllm.config import KEY, ServeConfig, family_of
from vtc.vllm.sampling import LAST_FRAMES


@dataclasses.dataclass
class ModelArgs:
    """`--model_args` of `--model vtc`. Any other key is a parameter of one of the methods (`k=3`, `fastv.k=3`)."""

    pretrained: str  # checkpoint id or path
    methods: str | None = None  # a method spec ("framefusion+quota"); None or "none": the uncompressed model
    retention: float | None = None  # fraction of visual tokens the LLM sees; None: the methods' official defaults
    num_frames: int | None = 32  # frames per video (uniform without a sampler); none: the sampler's own rule
    positions: str | None = None  # "keep" / "compact"; default: what each method's official code does
    seed: int = 0  # seed of every random choice a method makes
    images: bool = True  # compress each image of a document too (false: images pass whole), on either backend
    dtype: str = "auto"  # auto, bfloat16, float16, float32
    device_map: str | None = None  # from_pretrained's device_map (default: "auto" on GPU, CPU otherwise)
    attn_implementation: str | None = None  # e.g. flash_attention_2 (FastV-style methods read attention anyway)
    max_new_tokens: int | None = None  # cap on the task's own max_new_tokens
    system_prompt: str | None = None  # a system message (text or a file) put before the task's messages
    max_pixels: int | None = None  # Qwen families: the video processor's pixel cap per frame (as lmms-eval's qwen)
    min_pixels: int | None = None  # Qwen families: its floor
    backend: str = "hf"  # "hf" (transformers generate) or "vllm" (vllm.LLM with vtc's additional_config)
    vllm_args: dict | str | None = None  # backend=vllm: vllm.LLM options as JSON, e.g. {"max_model_len": 32768}
    # backend=vllm with a frame sampler: frames decoded uniformly for the server's sampler to choose from (it runs
    # in vLLM's prompt processor, on what the client sent; `vllm serve` decodes 32 by default)
    candidate_frames: int | None = None  # default CANDIDATE_FRAMES
    # set by lmms-eval from its own flags
    batch_size: int | str = 1
    max_batch_size: int | None = None
    device: str | None = None


MODEL_ARGS = tuple(f.name for f in dataclasses.fields(ModelArgs))
CANDIDATE_FRAMES = 128
BACKENDS = ("hf", "vllm")
HF_ONLY = ("device_map", "attn_implementation", "positions")


def split_model_args(args: dict[str, Any]) -> tuple[ModelArgs, dict[str, Any]]:
    """(vtc's model args, method parameters) from `--model_args`, checked: method parameters need `methods=`,
    and every key must be a model arg or a parameter of the named methods (the error names both lists)."""
    if "pretrained" not in args:
        raise ValueError("--model_args needs pretrained=<checkpoint id or path> for --model vtc")
    # lmms-eval passes "none" through as text
    own = {k: None if isinstance(v, str) and v.lower() == "none" else v for k, v in args.items() if k in MODEL_ARGS}
    params = {k: v for k, v in args.items() if k not in MODEL_ARGS}
    parsed = ModelArgs(**own)
    if parsed.methods == "":
        parsed.methods = None
    if parsed.methods is None and (params or parsed.retention is not None):
        given = sorted(params) + (["retention"] if parsed.retention is not None else [])
        raise ValueError(
            f"unknown model args {given} for --model vtc without methods=: vtc's model args are "
            f"{', '.join(MODEL_ARGS)}; method parameters and retention need methods=<spec> (see `vtc methods`)"
        )
    if parsed.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {parsed.backend!r}")
    if not isinstance(parsed.images, bool):
        raise ValueError(f"images must be true or false, got {parsed.images!r}")
    if parsed.backend == "vllm":
        given = [name for name in HF_ONLY if getattr(parsed, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: only with backend=hf (pass vLLM's options in vllm_args)")
        if isinstance(parsed.vllm_args, str):
            try:
                parsed.vllm_args = json.loads(parsed.vllm_args)
            except json.JSONDecodeError as err:
                raise ValueError(f"vllm_args must be a JSON object, got {parsed.vllm_args!r} ({err})") from None
        if parsed.vllm_args is not None and not isinstance(parsed.vllm_args, dict):
            raise ValueError(f"vllm_args must be a JSON object, got {parsed.vllm_args!r}")
    elif parsed.vllm_args is not None:
        raise ValueError("vllm_args: only with backend=vllm")
    frames = parsed.num_frames
    if frames is not None and (not isinstance(frames, int) or isinstance(frames, bool) or frames < 1):
        raise ValueError(f"num_frames must be a positive integer or none (the sampler's own rule), got {frames!r}")
    candidates = parsed.candidate_frames
    if candidates is not None and parsed.backend != "vllm":
        raise ValueError("candidate_frames: only with backend=vllm (on hf the sampler reads every frame of the file)")
    if candidates is not None and (not isinstance(candidates, int) or isinstance(candidates, bool) or candidates < 1):
        raise ValueError(f"candidate_frames must be a positive integer, got {candidates!r}")
    return parsed, params


class _FirstTokenClock(LogitsProcessor):
    """Notes the time the first new token's logits exist (called once per generation step)."""

    def __init__(self) -> None:
        self.time: float | None = None

    def __call__(self, input_ids, scores):
        if self.time is None:
            synchronize()
            self.time = time.perf_counter()
        return scores


@dataclasses.dataclass
class Chat:
    """One document's chat, as the task wrote it: HF-format messages, the user's text (what query-aware methods
    read), its video (a path) and images."""

    messages: list[dict[str, Any]]
    question: str
    video: Any
    images: list[Any]

    @classmethod
    def parse(cls, raw_messages: list[dict], system_prompt: str, where: str, model: lmms) -> "Chat":
        chat = ChatMessages(messages=raw_messages)
        images, videos, audios = chat.extract_media()
        if audios:
            raise ValueError(f"{where}: --model vtc takes video, images and text; this document has audio")
        if len(videos) > 1:
            raise ValueError(f"{where}: --model vtc takes one video per document, this one has {len(videos)}")
        for message in chat.messages:
            for content in message.content:
                if content.type == "video" and (content.start_time is not None or content.end_time is not None):
                    raise ValueError(f"{where}: video segments (start/end times) are not supported by --model vtc")
        question = "\n".join(
            c.text for m in chat.messages if m.role == "user" for c in m.content if c.type == "text"
        ).strip()
        video = videos[0] if videos else None
        if isinstance(video, dict):  # lmms-eval passes {"path": ...} for some tasks
            video = video.get("path") or video.get("url")
        messages = model._apply_system_prompt(chat.to_hf_messages(), system_prompt)
        return cls(messages, question, video, list(images))


class VtcModel(lmms):
    """A chat model: lmms-eval hands it each document's messages (`doc_to_messages`). `backend=hf` runs
    transformers' `generate` on the patched model; `backend=vllm` runs `vllm.LLM` with vtc's serving config on the
    same frames (connect-stage methods in fixed-count mode, as `vtc serve` runs them)."""

    is_simple = False

    def __init__(self, **model_args: Any) -> None:
        super().__init__()
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError(
                "--model vtc runs in one process (device_map=auto spreads a large model over the GPUs; vLLM's "
                "tensor_parallel_size goes in vllm_args); data-parallel launches are not supported"
            )
        self.args, params = split_model_args(model_args)
        if str(self.args.batch_size) != "1":
            warnings.warn(
                f"--model vtc answers one document at a time (per-document TTFT and token counts): batch_size="
                f"{self.args.batch_size} changes nothing but the speed you might have expected",
                stacklevel=2,
            )
        self.system_prompt = self._resolve_system_prompt(self.args.system_prompt) if self.args.system_prompt else ""
        self.handle: vtc.PatchHandle | None = None  # backend=hf
        self.llm = None  # backend=vllm
        self.serving: ServeConfig | None = None
        self._served_pipeline: Pipeline | None = None  # the serving config's pipeline, built once per engine
        self.keep_loaded = False
        self._warned_no_video = False
        if self.args.backend == "hf":
            device_map = self.args.device_map or _device_map(self.args.device)
            extra = {"attn_implementation": self.args.attn_implementation} if self.args.attn_implementation else {}
            self.model, self.processor = load_model(self.args.pretrained, self.args.dtype, device_map, **extra)
            self.adapter = resolve_adapter(self.model)
            self.family = self.adapter.family
        else:
            from transformers import AutoConfig, AutoProcessor

            config = AutoConfig.from_pretrained(self.args.pretrained)
            self.family = family_of(getattr(config, "architectures", None))
            self.adapter = config_adapter(self.family, config)
            self.processor = AutoProcessor.from_pretrained(self.args.pretrained)
        self.processor_kwargs = {k: v for k in ("max_pixels", "min_pixels") if (v := getattr(self.args, k)) is not None}
        if self.processor_kwargs and not self.family.startswith("qwen"):
            raise ValueError(
                f"{', '.join(self.processor_kwargs)}: Qwen families only (their video processors cap pixels per "
                f"frame); {self.family} resizes frames to its vision tower's fixed size"
            )
        self.configure(self.args.methods, self.args.retention, params)

    # --- compression ----------------------------------------------------------------------------------------------
    def configure(self, methods: str | None, retention: float | None = None, params: dict[str, Any] | None = None):
        """Switch the compression (`vtc eval` runs a whole grid on one loaded model; on vLLM a new config needs a
        new engine, as a server needs a restart). `methods=None`: the model as loaded."""
        params = dict(params or {})
        if self.args.backend == "vllm":
            self._start_engine(methods, retention, params)
            return
        if self.handle is not None:
            self.handle.unpatch()
            self.handle = None
        if methods is None:
            return
        try:
            self.handle = vtc.patch(
                self.model,
                methods,
                retention=retention,
                positions=self.args.positions,
                processor=self.processor,
                seed=self.args.seed,
                images=self.args.images,
                **params,
            )
        except (ValueError, KeyError) as err:
            raise ValueError(f"{err} (vtc's own model args: {', '.join(MODEL_ARGS)})") from err

    def _start_engine(self, methods: str | None, retention: float | None, params: dict[str, Any]) -> None:
        from vtc.vllm.engine import shutdown, start

        serving = pipeline = None
        if methods is not None:
            params = self._sampler_count(methods, params)
            raw = {
                "methods": methods,
                "retention": retention,
                "params": params,
                "seed": self.args.seed,
                "images": self.args.images,
            }
            serving = ServeConfig.from_dict(raw)
            pipeline = serving.pipeline(self.family)  # family checks before an engine starts
        if self.llm is not None:
            shutdown(self.llm)
            self.llm = None
        options: dict[str, Any] = {"seed": 0, "disable_log_stats": False}  # per-request TTFT needs the stats
        if self.args.dtype != "auto":
            options["dtype"] = self.args.dtype
        options.update(self.args.vllm_args or {})
        self.serving, self._served_pipeline = serving, pipeline
        self.llm = start(self.args.pretrained, serving.to_dict() if serving else None, **options)

    def _sampler_count(self, methods: str, params: dict[str, Any]) -> dict[str, Any]:
        """`num_frames` as the served sampler's own count (`{sampler}.num_frames`), as the HF backend passes it to
        the sampler, unless the parameters set it."""
        if self.args.num_frames is None:
            return params
        for entry in Pipeline(methods).stage_entries("sample"):
            name = entry.card.name
            fields = {f.name for f in dataclasses.fields(type(entry.method))}
            if "num_frames" in fields and f"{name}.num_frames" not in params:
                params = {**params, f"{name}.num_frames": self.args.num_frames}
        return params

    @property
    def pipeline(self) -> Pipeline | None:
        if self.args.backend == "vllm":
            return self._served_pipeline
        return self.handle.pipeline if self.handle is not None else None

    # --- lmms-eval's interface ------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        results: list[GenerationResult] = []
        records: list[dict[str, Any]] = []
        for request in tqdm(requests, disable=self.rank != 0, desc="vtc: answering"):
            ctx, doc_to_messages, gen_kwargs, doc_id, task, split = request.args
            messages = doc_to_messages(self.task_dict[task][split][doc_id])
            text, record = self.answer(messages, gen_kwargs, where=f"task {task}, doc {doc_id}")
            counts = _VtcTokenCounts(
                input_tokens=record["llm_prompt_tokens"], output_tokens=record["output_tokens"], vtc=record
            )
            results.append(GenerationResult(text=text, token_counts=counts))
            records.append(record)
            self.cache_hook.add_partial("generate_until", (ctx, gen_kwargs), text)
        if records:
            summary = summarize(records)
            elapsed = sum(r["generate_s"] for r in records)
            tokens = sum(r["output_tokens"] for r in records)
            log_metrics(
                total_elapsed_time=elapsed,
                total_gen_tokens=tokens,
                avg_speed=tokens / elapsed if elapsed else 0.0,
                additional_metrics={f"vtc_{k}": v for k, v in summary.items() if not k.startswith("docs_")},
            )
        return results

    def clean(self) -> None:
        """lmms-eval calls this after a run and drops the model; `vtc eval` sets `keep_loaded` to run the next cell
        on the same loaded model."""
        if self.keep_loaded:
            return
        if self.llm is not None:
            from vtc.vllm.engine import shutdown

            shutdown(self.llm)
            self.llm = None
        elif self.handle is not None:
            self.configure(None)
        super().clean()

    def loglikelihood(self, requests):
        raise NotImplementedError(
            "--model vtc generates answers (output_type generate_until, what video tasks use); it does not score "
            "loglikelihoods"
        )

    def generate_until_multi_round(self, requests):
        raise NotImplementedError("--model vtc answers single-round tasks (output_type generate_until) only")

    # --- one document ---------------------------------------------------------------------------------------------
    def answer(self, raw_messages: list[dict], gen_kwargs: dict[str, Any], where: str = "") -> tuple[str, dict]:
        """The answer to one chat in lmms-eval's message format (greedy unless the task asks for sampling), and
        the document's record."""
        chat = Chat.parse(raw_messages, self.system_prompt, where, self)
        images_pass = not self.args.images or not chat.images
        if chat.video is None and self.pipeline is not None and images_pass and not self._warned_no_video:
            self._warned_no_video = True
            why = "images=false" if chat.images else "no image either"
            warnings.warn(
                f"{where}: no video in this document, so {self.pipeline.spec} compresses nothing ({why}). Its record "
                "says so; further documents like it are not warned about",
                stacklevel=2,
            )
        if self.args.backend == "vllm":
            return self._answer_vllm(chat, gen_kwargs)
        return self._answer_hf(chat, gen_kwargs)

    def _answer_hf(self, chat: Chat, gen_kwargs: dict[str, Any]) -> tuple[str, dict]:
        start = time.perf_counter()
        if chat.video is None:
            inputs = self._text_and_images(chat)
        elif self.handle is not None:
            inputs = self.handle.prepare(
                self.processor,
                chat.video,
                chat.question,
                num_frames=self.args.num_frames,
                messages=chat.messages,
                images=chat.images,
                processor_kwargs=self.processor_kwargs,
            )
        else:
            inputs, _ = prepare_batch(
                self.processor,
                [chat.video],
                [chat.question],
                num_frames=self.args.num_frames,
                family=self.family,
                messages=[chat.messages],
                images=[chat.images],
                processor_kwargs=self.processor_kwargs,
            )
        sample_s = time.perf_counter() - start
        inputs = inputs.to(self.model.device)

        clock = _FirstTokenClock()
        with LLMTimer(self.model) as timer, torch.no_grad():
            synchronize()
            start = time.perf_counter()
            out = self.model.generate(**inputs, **self._generation_options(gen_kwargs), logits_processor=[clock])
            synchronize()
        end = time.perf_counter()
        new_tokens = out[0, inputs["input_ids"].shape[1] :]
        text = self.processor.batch_decode([new_tokens], skip_special_tokens=True)[0]

        spans = self._spans(inputs)
        record = doc_record(
            self.handle.stats() if self.handle is not None else None,
            visual_tokens=sum(s.num_tokens for s in spans),
            grids=[s.grid for s in spans],
            prompt_tokens=int(inputs["input_ids"].shape[1]),
            output_tokens=int(new_tokens.numel()),
            ttft_s=(clock.time or end) - start,
            generate_s=end - start,
            prefill_s=timer.first,
            sample_s=sample_s if chat.video is not None else 0.0,
        )
        return _cut_at_stop(text, gen_kwargs.get("until")), record

    def _answer_vllm(self, chat: Chat, gen_kwargs: dict[str, Any]) -> tuple[str, dict]:
        """The same frames and prompt as the HF backend, sent to vLLM; the record's uncompressed counts come from
        the HF processor's expansion of the same inputs, the compressed ones from the pipeline's fixed count."""
        from vllm import SamplingParams

        start = time.perf_counter()
        prompt = self.processor.apply_chat_template(chat.messages, add_generation_prompt=True, tokenize=False)
        data: dict[str, Any] = {}
        images = chat.images or None
        pipeline = self.pipeline
        # a sampler runs on the server, among the candidates sent; without one the client sends num_frames frames
        served_sampler = pipeline is not None and pipeline.has_stage("sample")
        kwargs = dict(self.processor_kwargs)
        sampled = None
        if chat.video is not None:
            source, count = VideoSource.open(chat.video), self.args.num_frames  # the file probed once
            if served_sampler:
                count = min(self.args.candidate_frames or CANDIDATE_FRAMES, source.num_frames)
                if any(e.card.query_aware for e in pipeline.stage_entries("sample")):
                    kwargs[KEY] = {"question": chat.question}  # the task's question, as the HF backend's sampler
            sampled = sample_frames(source, chat.question, None, count, family=self.family)
            data["video"] = (sampled.frames, {**sampled.metadata, "do_sample_frames": False})
        if images:
            data["image"] = images if len(images) > 1 else images[0]
        sample_s = time.perf_counter() - start

        params = SamplingParams(**self._sampling_options(gen_kwargs))
        start = time.perf_counter()
        request = {"prompt": prompt, "multi_modal_data": data, "mm_processor_kwargs": kwargs}
        (out,) = self.llm.generate([request], params, use_tqdm=False)
        generate_s = time.perf_counter() - start
        metrics = out.metrics
        shown = None  # the frames the server chose (a sampler), in the video's own frame numbers
        if sampled is not None and served_sampler:
            chosen = LAST_FRAMES[-1]
            shown = dataclasses.replace(
                chosen["selection"],
                indices=chosen["frames"],
                timestamps=[i / sampled.source.fps for i in chosen["frames"]],
                total_frames=sampled.source.num_frames,
                fps=sampled.source.fps,
            )
            sampled = SampledVideo(sampled.frames[chosen["selection"].indices], chosen["frames"], sampled.source)
        if sampled is not None:  # the uncompressed counts: the HF processor's expansion of what was encoded
            full = self.processor(
                text=[prompt],
                videos=[sampled.frames],
                images=images,
                return_tensors="pt",
                **processor_video_kwargs(self.processor, [sampled]),
                **self.processor_kwargs,
            )
        else:
            full = self.processor(text=[prompt], images=images, return_tensors="pt")
        spans = self._spans(full)
        items = self._served_items(full, spans, compress_images=bool(images) and self.args.images)
        visual = sum(item.tokens_in for item in items if item.compressed)
        record = served_record(
            self.serving.methods if self.serving is not None else None,
            grids=[s.grid for s in spans],
            visual_tokens=visual,
            kept_tokens=sum(item.tokens_out for item in items if item.compressed),
            items=items,
            prompt_tokens=int(full["input_ids"].shape[1]),
            llm_prompt_tokens=len(out.prompt_token_ids),
            output_tokens=len(out.outputs[0].token_ids),
            ttft_s=metrics.first_token_latency if metrics is not None else None,
            prefill_s=metrics.first_token_ts - metrics.scheduled_ts if metrics is not None else None,
            generate_s=generate_s,
            sample_s=sample_s if chat.video is not None else 0.0,
        )
        if shown is not None:
            record["frames"] = [frame_record(shown)]
        return out.outputs[0].text, record

    def _spans(self, inputs, kind: str = "video") -> list:
        """Where each video's (or image's) tokens sit in the (uncompressed) prompt, with their grids."""
        captured = CapturedInputs(inputs["input_ids"], inputs.get("attention_mask"), dict(inputs))
        if kind == "image":
            return self.adapter.image_spans(captured) if self.adapter.has_image(captured) else []
        return self.adapter.video_spans(captured) if self.adapter.has_video(captured) else []

    def _served_items(self, inputs, videos: list, compress_images: bool) -> list[MediaItem]:
        """Each video and image (each view of a LLaVA image) of a document sent to vLLM, with the count the server
        keeps of it: the pipeline's fixed count, the image pipeline's for an image (whole when images pass)."""
        pipeline = self.pipeline
        images = self._spans(inputs, "image")
        image_pipeline = pipeline.for_images() if pipeline is not None and compress_images and images else None
        items = []
        for span in sorted(videos + images, key=lambda s: int(s.seq_index.min())):
            by = pipeline if span.kind == "video" else image_pipeline
            kept = span.num_tokens if by is None else by.retained_count(span.grid)
            items.append(
                MediaItem(span.kind, span.video, 0, span.grid, span.num_tokens, kept, by is not None, span.view)
            )
        return items

    def _text_and_images(self, chat: Chat):
        text = self.processor.apply_chat_template(chat.messages, add_generation_prompt=True, tokenize=False)
        return self.processor(text=[text], images=chat.images or None, return_tensors="pt")

    def _max_new_tokens(self, gen_kwargs: dict[str, Any]) -> int:
        max_new = int(gen_kwargs.get("max_new_tokens") or 128)
        if self.args.max_new_tokens is not None:
            max_new = min(max_new, int(self.args.max_new_tokens))
        return max_new

    def _sampling(self, gen_kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The task's sampling settings (temperature and the given top_p / top_k), or None for greedy decoding."""
        temperature = float(gen_kwargs.get("temperature") or 0.0)
        if not (temperature > 0 or gen_kwargs.get("do_sample")):
            return None
        options: dict[str, Any] = {"temperature": temperature or 1.0}
        for key in ("top_p", "top_k"):
            if gen_kwargs.get(key) is not None:
                options[key] = gen_kwargs[key]
        return options

    def _generation_options(self, gen_kwargs: dict[str, Any]) -> dict[str, Any]:
        """lmms-eval's generation kwargs as `generate` options (greedy unless the task asks for sampling)."""
        options: dict[str, Any] = {
            "max_new_tokens": self._max_new_tokens(gen_kwargs),
            "num_beams": int(gen_kwargs.get("num_beams") or 1),
        }
        sampling = self._sampling(gen_kwargs)
        if sampling is not None:
            options.update(do_sample=True, **sampling)
        else:
            options.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        tokenizer = getattr(self.processor, "tokenizer", None)
        if tokenizer is not None and tokenizer.pad_token_id is not None:
            options["pad_token_id"] = tokenizer.pad_token_id
        return options

    def _sampling_options(self, gen_kwargs: dict[str, Any]) -> dict[str, Any]:
        """The same kwargs as vLLM `SamplingParams` (beam search is not a vLLM sampling option)."""
        if int(gen_kwargs.get("num_beams") or 1) > 1:
            raise ValueError("backend=vllm samples or decodes greedily; the task asks for beam search (num_beams > 1)")
        options: dict[str, Any] = {"max_tokens": self._max_new_tokens(gen_kwargs), "temperature": 0.0}
        options.update(self._sampling(gen_kwargs) or {})
        stops = _stops(gen_kwargs.get("until"))
        if stops:
            options["stop"] = stops
        return options


@dataclasses.dataclass
class _VtcTokenCounts(TokenCounts):
    """lmms-eval's per-sample token counts plus vtc's record (written to the logged sample as `vtc`)."""

    vtc: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        if self.vtc is not None:
            data["vtc"] = self.vtc
        return data


def _device_map(device: str | None) -> str:
    """lmms-eval's `--device` as a device_map: "auto" (GPUs when there are any) unless a device is named."""
    if device is None:
        return "auto"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device} but CUDA is not available here; pass --device cpu")
    return device


def _stops(until) -> list[str]:
    """The task's stop strings (`until` is one string or a list)."""
    stops = [until] if isinstance(until, str) else list(until or [])
    return [stop for stop in stops if stop]


def _cut_at_stop(text: str, until) -> str:
    """The answer up to the first of the task's stop strings."""
    for stop in _stops(until):
        if stop in text:
            text = text.split(stop)[0]
    return text
