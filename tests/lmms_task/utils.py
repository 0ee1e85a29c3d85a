"""The `vtc_clips` task: generated clips with known answers. Importing this module (lmms-eval does, to resolve
the YAML's functions, before it loads the dataset) writes the clips and `data/clips.jsonl` if they are missing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from vtc.media.video import write_video

DATA = Path(__file__).parent / "data"
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 80, 230), "yellow": (230, 210, 40)}
DIRECTIONS = ("left to right", "right to left")
FRAMES, SIZE, FPS = 8, 112, 4.0


def clip(colour: str, direction: str) -> np.ndarray:
    """[FRAMES, SIZE, SIZE, 3] uint8: a 28-pixel square crossing a grey frame."""
    frames = np.full((FRAMES, SIZE, SIZE, 3), 128, dtype=np.uint8)
    side = 28
    for t in range(FRAMES):
        x = round(t * (SIZE - side) / (FRAMES - 1))
        if direction == "right to left":
            x = SIZE - side - x
        frames[t, 42 : 42 + side, x : x + side] = COLOURS[colour]
    return frames


def documents() -> list[dict]:
    docs = []
    for i, (colour, direction) in enumerate(
        [("red", DIRECTIONS[0]), ("green", DIRECTIONS[1]), ("blue", DIRECTIONS[0]), ("yellow", DIRECTIONS[1])]
    ):
        video = f"clip{i}.mp4"
        options = list(COLOURS)
        docs.append(
            {
                "id": f"colour-{i}",
                "video": video,
                "question": "What colour is the moving square?",
                "options": [f"{letter}. {name}" for letter, name in zip("ABCD", options)],
                "answer": "ABCD"[options.index(colour)],
                "colour": colour,
                "direction": direction,
            }
        )
        docs.append(
            {
                "id": f"direction-{i}",
                "video": video,
                "question": "Which way does the square move?",
                "options": [f"{letter}. {name}" for letter, name in zip("AB", DIRECTIONS)],
                "answer": "AB"[DIRECTIONS.index(direction)],
                "colour": colour,
                "direction": direction,
            }
        )
    return docs


def ensure_data() -> Path:
    """Write the clips and the JSONL (deterministic; skipped when present)."""
    index = DATA / "clips.jsonl"
    if index.exists():
        return index
    DATA.mkdir(parents=True, exist_ok=True)
    docs = documents()
    for doc in docs:
        path = DATA / doc["video"]
        if not path.exists():
            write_video(path, clip(doc["colour"], doc["direction"]), fps=FPS)
    tmp = index.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tmp.replace(index)
    return index


def doc_to_visual(doc):
    return [str(DATA / doc["video"])]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    kwargs = lmms_eval_specific_kwargs or {}
    return (
        kwargs.get("pre_prompt", "")
        + doc["question"]
        + "\n"
        + "\n".join(doc["options"])
        + kwargs.get("post_prompt", "")
    )


def process_results(doc, results):
    match = re.search(r"\b([A-D])\b", results[0].strip())
    return {"accuracy": float(match is not None and match.group(1) == doc["answer"])}


ensure_data()
