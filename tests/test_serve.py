"""A real `vtc serve` process on a local port (Qwen2-VL and Qwen3-VL), answered through the OpenAI client: the
prompt holds exactly the text plus `retained_count` video tokens (an image-only request: the image pipeline's
count), a request may set its own retention, twelve concurrent requests answer as each does alone while a malformed
one among them gets HTTP 400, and a config that cannot serve stops `vtc serve` before vLLM starts."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.probes import coloured_clip
from vtc.media.video import synthetic_video
from vtc.testing import tiny
from vtc.vllm.client import image_message, request_settings, video_message
from vtc.vllm.config import ServeConfig

QUESTION = "What happens in this video?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVED = ("qwen2_vl", "qwen3_vl")


def start_server(path: str, vtc_args: list[str], prelude: str = ""):
    """`vtc serve path ...` on a free port -> (OpenAI client, the server's output lines, the process). `prelude`:
    Python run in the server process first (a test encoder registered by name)."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    args = ["serve", path, *vtc_args, "--port", str(port), "--dtype", "float32", "--enforce-eager"]
    args += ["--max-model-len", "8192", "--kv-cache-memory-bytes", str(1 << 28), "--served-model-name", "tiny"]
    # prompts of concurrent requests are prefilled together in chunks of at most 512 tokens, as under load
    args += ["--max-num-batched-tokens", "512", "--limit-mm-per-prompt", '{"video": 2, "image": 1}']
    if prelude:
        code = f"import sys; {prelude}; from vtc.tools.cli import main; sys.exit(main(sys.argv[1:]))"
        command = [sys.executable, "-c", code, *args]
    else:
        command = [sys.executable, "-m", "vtc.tools.cli", *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    deadline = time.time() + 240
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("vtc serve exited:\n" + "".join(lines[-40:]))
        try:
            client.models.list()
            break
        except Exception:
            time.sleep(2)
    else:
        proc.kill()
        raise RuntimeError("vtc serve did not come up in 240 s:\n" + "".join(lines[-40:]))
    return client, lines, proc


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module", params=SERVED)
def server(request, tmp_path_factory):
    family = request.param
    path = tiny.save(family, str(tmp_path_factory.mktemp("serve") / family))
    client, lines, proc = start_server(
        path, ["--methods", "vidcom2", "--retention", "0.25", "--retention-range", "0.1,0.75"]
    )
    yield client, lines, path, family
    stop_server(proc)


def kept_logs(
    lines: list[str], spec: str = "vidcom2", kind: str = "video"
) -> list[tuple[tuple[int, int, int], int, int]]:
    """(grid, kept, of) of every video (or image) the server's log says it compressed."""
    pattern = re.compile(
        re.escape(f"vtc {spec}: {kind}") + r" \d+, grid \((\d+), (\d+), (\d+)\): kept (\d+) of (\d+) tokens"
    )
    out = []
    for line in list(lines):
        m = pattern.search(line)
        if m:
            t, h, w, kept, total = (int(v) for v in m.groups())
            out.append(((t, h, w), kept, total))
    return out


def count(family: str, grid, retention: float = 0.25) -> int:
    return ServeConfig.from_dict({"methods": "vidcom2", "retention": retention}).pipeline(family).retained_count(grid)


def test_vtc_serve_answers_a_chat_completion_with_a_compressed_video(server):
    client, lines, path, family = server
    from transformers import AutoTokenizer

    frames = synthetic_video(8, 224, 224, seed=0)
    before = len(kept_logs(lines))
    reply = client.chat.completions.create(
        model="tiny", messages=[video_message(frames, QUESTION)], max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content is not None
    assert reply.usage.completion_tokens >= 1
    time.sleep(0.5)
    logs = kept_logs(lines)[before:]
    assert len(logs) == 1
    grid, kept, total = logs[0]
    assert total == grid[0] * grid[1] * grid[2]
    assert kept == count(family, grid)
    if family != "qwen2_vl":
        return  # Qwen3-VL's prompt also holds per-frame timestamps, counted in test_vllm.py
    # the text of the prompt: the chat template with the video as one placeholder token
    tokenizer = AutoTokenizer.from_pretrained(path)
    content = [{"type": "video"}, {"type": "text", "text": QUESTION}]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    text_tokens = len(tokenizer.encode(prompt, add_special_tokens=False)) - 1
    assert reply.usage.prompt_tokens == text_tokens + kept


def test_vtc_serve_compresses_an_image_only_request(server):
    """An image-only chat request (an OpenAI `image_url` part): the server compresses the image to the image
    pipeline's count, and the prompt is the chat template's text plus the kept tokens."""
    client, lines, path, family = server
    from transformers import AutoTokenizer

    question = "What is in the picture?"
    before = len(kept_logs(lines, kind="image"))
    _, prompt_tokens, _ = ask(client, image_message([synthetic_video(1, 112, 140, seed=32)[0]], question))
    time.sleep(0.5)
    ((grid, kept, total),) = kept_logs(lines, kind="image")[before:]
    pipeline = ServeConfig.from_dict({"methods": "vidcom2", "retention": 0.25}).pipeline(family).for_images()
    assert total == grid[0] * grid[1] * grid[2] and kept == pipeline.retained_count(grid) < total
    tokenizer = AutoTokenizer.from_pretrained(path)
    content = [{"type": "image"}, {"type": "text", "text": question}]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    assert prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False)) - 1 + kept


def test_a_malformed_video_gets_400_and_the_server_keeps_serving(server):
    client, _, _, _ = server
    import openai

    broken = {
        "role": "user",
        "content": [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,bm90IGEgdmlkZW8="}},
            {"type": "text", "text": QUESTION},
        ],
    }
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[broken], max_tokens=2)
    reply = client.chat.completions.create(
        model="tiny", messages=[video_message(synthetic_video(8, 224, 224, seed=1), QUESTION)], max_tokens=2
    )
    assert reply.usage.prompt_tokens > 0


BROKEN = {
    "role": "user",
    "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,bm90IGEgdmlkZW8="}},
        {"type": "text", "text": QUESTION},
    ],
}


def ask(client, message, extra=None):
    """(answer, prompt tokens, the first token's top-5 logprobs) of one chat request (`extra`: its extra_body)."""
    reply = client.chat.completions.create(
        model="tiny",
        messages=[message],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body=extra,
    )
    first = [(entry.token, entry.logprob) for entry in reply.choices[0].logprobs.content[0].top_logprobs]
    return reply.choices[0].message.content, reply.usage.prompt_tokens, first


def test_a_request_sets_its_own_retention(server):
    """`extra_body={"mm_processor_kwargs": {"vtc": {"retention": 0.5}}}` sizes that request's video to 0.5 (the
    server runs 0.25); a retention outside the server's range, or a setting a request may not change, gets HTTP
    400 naming the allowed values, and the server keeps serving."""
    client, lines, _, family = server
    import openai

    message = video_message(synthetic_video(8, 224, 224, seed=4), QUESTION)
    before = len(kept_logs(lines))
    text, base, first = ask(client, message)
    _, more, _ = ask(client, message, request_settings(retention=0.5))
    time.sleep(0.5)
    logs = kept_logs(lines)[before:]
    assert [kept for _, kept, _ in logs] == [count(family, logs[0][0]), count(family, logs[0][0], 0.5)]
    assert more - base == logs[1][1] - logs[0][1]
    for settings, message_part in [
        ({"retention": 0.9}, r"retention must be in \[0.1, 0.75\] on this server"),
        ({"methods": "random"}, "a request may set retention, params, seed"),
    ]:
        with pytest.raises(openai.BadRequestError, match=message_part):
            ask(client, message, {"mm_processor_kwargs": {"vtc": settings}})
    # asked again, the prompt's prefix comes from vLLM's prefix cache (its media slots are never recomputed)
    again_text, again, again_first = ask(client, message)
    assert again == base and again_text == text
    assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(again_first, first))


def test_concurrent_requests_answer_as_each_does_alone(server):
    """Twelve requests with different videos and sizes (one with two videos, one with a video and an image), sent
    at once with a malformed one among them: each good one gets its own compression and the answer, prompt tokens
    and first-token logprobs it gets alone (up to the last bits a batched forward changes in stock vLLM too); the
    malformed one gets HTTP 400.

    Under load every request carries `{"seed": 0}`, the server's own seed, as its vtc settings: the same
    compression under a new cache key, so each video is encoded and compressed again, among the others."""
    client, lines, _, family = server
    import openai

    shapes = [(8, 224), (12, 192), (8, 160), (16, 224)] * 3
    videos = [[synthetic_video(f, s, s, seed=10 + k)] for k, (f, s) in enumerate(shapes)]
    videos[5].append(synthetic_video(8, 192, 192, seed=30))
    picture = synthetic_video(1, 112, 140, seed=31)[0]
    messages = [video_message(v, QUESTION, images=[picture] if k == 6 else []) for k, v in enumerate(videos)]
    alone = [ask(client, message) for message in messages]
    before = len(kept_logs(lines))
    with ThreadPoolExecutor(len(messages) + 1) as pool:
        futures = [pool.submit(ask, client, message, request_settings(seed=0)) for message in messages]
        broken = pool.submit(ask, client, BROKEN)
        together = [future.result() for future in futures]
        with pytest.raises(openai.BadRequestError):
            broken.result()
    time.sleep(0.5)
    logs = kept_logs(lines)[before:]
    assert len(logs) == sum(len(v) for v in videos)  # every video compressed again, under load
    assert all(kept == count(family, grid) for grid, kept, _ in logs)
    for k, ((text, tokens, first), (text_alone, tokens_alone, first_alone)) in enumerate(zip(together, alone)):
        assert text == text_alone and tokens == tokens_alone, k
        assert [t for t, _ in first] == [t for t, _ in first_alone], k
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(first, first_alone)), k


def test_vtc_serve_refuses_a_method_that_cannot_serve_before_vllm_starts(tmp_path):
    path = tiny.save("qwen2_vl", str(tmp_path / "qwen2_vl"))
    start = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "vtc.tools.cli", "serve", path, "--methods", "fastv", "--retention", "0.25"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "fastv acts inside the LLM" in done.stdout and "vidcom2" in done.stdout
    assert time.time() - start < 60


def test_select_frames_keeps_the_most_relevant_frames_in_time_order():
    import numpy as np

    from vtc.media.relevance import clip_yes_probabilities, frame_weights, load_clip
    from vtc.testing.fixtures import register_tiny_clip
    from vtc.vllm.client import select_frames

    assert register_tiny_clip()
    frames = synthetic_video(12, 64, 64, seed=3)
    chosen, indices, weights = select_frames(frames, QUESTION, keep=4, clip_model="vtc-tiny-clip", clip_pretrained=None)
    clip, preprocess, tokenizer = load_clip("vtc-tiny-clip", None)
    all_weights = frame_weights(clip_yes_probabilities(clip, preprocess, tokenizer, frames, QUESTION, []), 100.0, 2.0)
    best = sorted(range(12), key=lambda i: (-all_weights[i], i))[:4]
    assert indices == sorted(best)
    assert np.array_equal(chosen, frames[indices])
    assert weights == [all_weights[i] for i in indices]
    with pytest.raises(ValueError, match=r"keep must be in \[1, 12\]"):
        select_frames(frames, QUESTION, keep=0, clip_model="vtc-tiny-clip", clip_pretrained=None)


# --- a sampler on the server ---------------------------------------------------------------------------------------
COLOUR = "from tests.probes import ColourEncoder; from vtc.media.encoders import register_encoder; " + (
    "register_encoder('test-colour', ColourEncoder())"
)


@pytest.fixture(scope="module")
def sampling_server(tmp_path_factory):
    """Qwen2-VL served with bolt (its CLIP: the test's colour encoder, registered in the server process) then
    vidcom2 at 0.5."""
    path = tiny.save("qwen2_vl", str(tmp_path_factory.mktemp("serve-sampling") / "qwen2_vl"))
    params = ["bolt.encoder=test-colour", "bolt.encoder_pretrained=None", "bolt.num_frames=4"]
    vtc_args = ["--methods", "bolt+vidcom2", "--retention", "0.5"] + [a for p in params for a in ("--param", p)]
    client, lines, proc = start_server(path, vtc_args, prelude=COLOUR)
    yield client, lines, path
    stop_server(proc)


def chosen_logs(lines: list[str]) -> list[tuple[list[int], str]]:
    pattern = re.compile(
        r"vtc bolt: chose \d+ of \d+ decoded frames \[[^]]*\] \(frames \[([^]]*)\] of the video\) for '(.*)'"
    )
    out = []
    for line in list(lines):
        m = pattern.search(line)
        if m:
            out.append(([int(v) for v in m.group(1).split(",")], m.group(2)))
    return out


def test_the_server_chooses_frames_per_question_and_encodes_only_those(sampling_server):
    """Through the OpenAI client: a 20-second clip (4 fps, 80 frames; vLLM decodes 32 of them), red in seconds 12-13,
    blue in second 3. Asked about red, then blue, then red again: each question gets its own frames (most in its
    colour's seconds), only 4 frames are encoded (a grid of 2 temporal patches), the prompt holds the
    text plus vidcom2's count of that grid, and the repeated question is served from the encoder cache."""
    client, lines, path = sampling_server
    from transformers import AutoTokenizer

    clip = coloured_clip(seconds=20, fps=4, red=(12, 13), blue=(3,), size=128)
    questions = ["Where is the red ball?", "When does the blue light appear?", "Where is the red ball?"]
    before_chosen, before_kept = len(chosen_logs(lines)), len(kept_logs(lines, "bolt+vidcom2"))
    replies = [
        client.chat.completions.create(
            model="tiny", messages=[video_message(clip, q, fps=4)], max_tokens=2, temperature=0
        )
        for q in questions
    ]
    time.sleep(0.5)
    chosen = chosen_logs(lines)[before_chosen:]
    kept = kept_logs(lines, "bolt+vidcom2")[before_kept:]
    assert [q for _, q in chosen] == questions
    red, blue, red_again = (frames for frames, _ in chosen)
    # frame numbers of the 80-frame clip (vLLM decoded 32, so about 1.6 frames per second are candidates)
    assert sum(12 <= f // 4 <= 13 for f in red) >= 3 and sum(f // 4 == 3 for f in blue) >= 2
    assert red_again == red
    assert len(kept) == 2  # red, blue; the repeat came from the encoder cache
    tokenizer = AutoTokenizer.from_pretrained(path)
    for (grid, count_kept, total), reply, question in zip(kept, replies, questions):
        assert grid[0] == 2 and total == grid[0] * grid[1] * grid[2]
        expected = ServeConfig.from_dict({"methods": "vidcom2", "retention": 0.5}).pipeline("qwen2_vl")
        assert count_kept == expected.retained_count(grid)
        content = [{"type": "video"}, {"type": "text", "text": question}]
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False)) - 1 + count_kept
