"""A real `vtc serve` process on a local port, answered through the OpenAI client: the prompt holds exactly the
text plus `retained_count` video tokens, a malformed video gets HTTP 400 and the server keeps serving, and a
config that cannot serve stops `vtc serve` before vLLM starts."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from vtc.media.video import synthetic_video
from vtc.testing import tiny
from vtc.vllm.client import video_message
from vtc.vllm.config import ServeConfig

QUESTION = "What happens in this video?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tiny.save("qwen2_vl", str(tmp_path_factory.mktemp("serve") / "qwen2_vl"))
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "vtc.tools.cli", "serve", path, "--methods", "vidcom2", "--retention", "0.25"]
    command += ["--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "8192"]
    command += ["--kv-cache-memory-bytes", str(1 << 28), "--served-model-name", "tiny"]
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
    yield client, lines, path
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def kept_logs(lines: list[str]) -> list[tuple[tuple[int, int, int], int, int]]:
    pattern = re.compile(r"vtc vidcom2: video \d+, grid \((\d+), (\d+), (\d+)\): kept (\d+) of (\d+) tokens")
    out = []
    for line in list(lines):
        m = pattern.search(line)
        if m:
            t, h, w, kept, total = (int(v) for v in m.groups())
            out.append(((t, h, w), kept, total))
    return out


def test_vtc_serve_answers_a_chat_completion_with_a_compressed_video(server):
    client, lines, path = server
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
    assert kept == ServeConfig.from_dict({"methods": "vidcom2", "retention": 0.25}).pipeline("qwen2_vl").retained_count(
        grid
    )
    # the text of the prompt: the chat template with the video as one placeholder token
    tokenizer = AutoTokenizer.from_pretrained(path)
    content = [{"type": "video"}, {"type": "text", "text": QUESTION}]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    text_tokens = len(tokenizer.encode(prompt, add_special_tokens=False)) - 1
    assert reply.usage.prompt_tokens == text_tokens + kept


def test_a_malformed_video_gets_400_and_the_server_keeps_serving(server):
    client, _, _ = server
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

    from vtc.testing.fixtures import register_tiny_clip
    from vtc.vllm.client import select_frames
    from vtc_plugins.quota import clip_yes_probabilities, frame_weights, load_clip

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
