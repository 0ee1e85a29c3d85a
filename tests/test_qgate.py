"""Q-Gate (abstract only, vtc's reading): the gate's answer parsed and muted (no subtitles: no contextual weight;
a parse failure: equal weights), the experts on a clip whose right answers are known (a small red object only a crop
sees, a reddish frame the whole-frame match prefers, a subtitle about red), the fusion following the
highest-weight expert, subtitles from .srt files, lists and callables, the host LLM asked for real, what
`handle.stats().frames` shows, composition, and bad inputs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

import vtc
import vtc_plugins.qgate as qgate
from tests.conftest import model_and_processor
from tests.probes import ColourEncoder
from vtc.media.encoders import FEATURE_CACHE, clip_encoder
from vtc.media.frame_selection import fps_candidates, inverse_transform_sampling
from vtc.testing.fixtures import register_tiny_clip
from vtc_plugins.qgate import fuse, gate_prompt, gate_weights, grid_crops, load_subtitles, parse_srt

THIRD = pytest.approx(1 / 3)


class WordEncoder(ColourEncoder):
    """ColourEncoder's images (mean RGB); any text: "red" -> (1, 0, 0), "blue" -> (0, 0, 1), anything else
    (0, 1, 0), summed over its words."""

    key = "test:colour-words"

    def __init__(self):
        super().__init__()
        self.texts: list[str] = []

    def encode_text(self, texts):
        self.texts.extend(texts)
        table = {"red": [1.0, 0.0, 0.0], "blue": [0.0, 0.0, 1.0]}
        out = []
        for t in texts:
            words = [table[w] for w in t.lower().replace("?", " ").split() if w in table]
            out.append(np.sum(words, axis=0) if words else [0.0, 1.0, 0.0])
        return torch.tensor(np.asarray(out, dtype=np.float32))


def evidence_clip() -> np.ndarray:
    """20 s at 4 fps, 48 x 48 grey: during second 5 a red square fills the top-left ninth (a crop sees it, the whole
    frame barely), during second 14 the whole frame is reddish (the whole-frame match prefers it)."""
    frames = np.full((80, 48, 48, 3), 90, dtype=np.uint8)
    frames[20:24, :16, :16, 0] = 250
    frames[56:60, :, :, 0] = 130
    return frames


SQUARE, REDDISH = 20, 56  # the 1-fps candidates of seconds 5 and 14
SUBTITLES = [(2.0, 3.0, "nothing to see"), (9.0, 9.5, "a red alert")]


def answer(vg, gm, ca, entities=("red ball",)):
    weights = f'{{"visual_grounding": {vg}, "global_matching": {gm}, "contextual_alignment": {ca}}}'
    return f'Sure. ```json\n{{"reasoning": "r", "weights": {weights}, "entities": {list(entities)!r}}}\n```'.replace(
        "'", '"'
    )


def test_the_gate_is_parsed_renormalised_and_muted():
    weights, entities, parsed = gate_weights(answer(0.6, 0.3, 0.1), has_subtitles=True)
    assert parsed and entities == ["red ball"]
    assert weights == pytest.approx({"visual_grounding": 0.6, "global_matching": 0.3, "contextual_alignment": 0.1})
    # below tau_mute: muted, the rest renormalised
    weights, _, _ = gate_weights(answer(0.62, 0.3, 0.08), has_subtitles=True)
    assert weights["contextual_alignment"] == 0 and weights["visual_grounding"] == pytest.approx(0.62 / 0.92)
    # weights that do not sum to 1 are renormalised before muting; missing ones count 0
    weights, _, _ = gate_weights('{"weights": {"global_matching": 3, "visual_grounding": 1}}', True)
    assert weights == pytest.approx({"visual_grounding": 0.25, "global_matching": 0.75, "contextual_alignment": 0})
    # a tau above every weight keeps the largest
    assert gate_weights(answer(0.4, 0.35, 0.25), True, tau_mute=0.5)[0]["visual_grounding"] == 1.0


def test_without_subtitles_the_contextual_weight_is_zero_and_a_bad_answer_gives_equal_weights():
    weights, _, parsed = gate_weights(answer(0.2, 0.2, 0.6), has_subtitles=False)
    assert parsed and weights == {"visual_grounding": 0.5, "global_matching": 0.5, "contextual_alignment": 0.0}
    for bad in ["no json here", '{"weights": "high"}', answer(-1, 1, 1), answer(0, 0, 0), '{"weights": {"a": 1}}']:
        weights, entities, parsed = gate_weights(bad, has_subtitles=True)
        assert not parsed and entities == [] and list(weights.values()) == [THIRD, THIRD, THIRD], bad
        weights, _, _ = gate_weights(bad, has_subtitles=False)
        assert weights == {"visual_grounding": 0.5, "global_matching": 0.5, "contextual_alignment": 0.0}
    # only the contextual expert asked for, and no subtitles: nothing left, so equal over the available two
    assert not gate_weights(answer(0, 0, 1), has_subtitles=False)[2]
    assert "Subtitles available: no." in gate_prompt("why?", False) and "Question: why?" in gate_prompt("why?", False)
    assert '"visual_grounding": a' in gate_prompt("q", True)


def test_fusion_follows_the_highest_weight_expert():
    grounding = np.array([0, 0, 9, 0, 0, 0, 1, 0], dtype=float)  # prefers position 2
    matching = np.array([0, 0, 1, 0, 0, 0, 9, 0], dtype=float)  # prefers position 6
    scores = {"visual_grounding": grounding, "global_matching": matching}
    for w, favourite in ((0.8, 2), (0.2, 6)):
        fused = fuse(scores, {"visual_grounding": w, "global_matching": 1 - w, "contextual_alignment": 0})
        drawn = Counter(inverse_transform_sampling(fused, 8, 3.0))
        assert drawn.most_common(1)[0][0] == favourite and drawn[favourite] >= 6
    # a muted expert (weight 0) adds nothing; all-equal scores say nothing (min-max gives 0)
    fused = fuse({**scores, "contextual_alignment": np.ones(8)}, {"visual_grounding": 1.0, "global_matching": 0.0})
    assert fused.tolist() == (grounding / 9).tolist()


def test_crops_tile_the_frame_row_major():
    frames = np.arange(2 * 7 * 6 * 3, dtype=np.uint8).reshape(2, 7, 6, 3)
    tiles = grid_crops(frames, 3)
    assert tiles.shape == (18, 2, 2, 3)
    assert (tiles[4] == frames[0, 2:4, 2:4]).all() and (tiles[9 + 8] == frames[1, 4:6, 4:6]).all()


def test_subtitles_from_srt_lists_and_callables(tmp_path):
    srt = (
        "1\n00:00:01,500 --> 00:00:03,000\n<i>Hello</i>\nthere\n\n2\r\n00:01:02,000 --> 00:01:04,250\r\n{\\an8}Bye\r\n"
    )
    assert parse_srt(srt) == [(1.5, 3.0, "Hello there"), (62.0, 64.25, "Bye")]
    vtt = "WEBVTT\n\n00:05.000 --> 00:06.500\nshort form\n"
    assert parse_srt(vtt) == [(5.0, 6.5, "short form")]
    path = tmp_path / "clip.srt"
    path.write_text(srt, encoding="utf-8")
    assert load_subtitles(str(path)) == load_subtitles(path) == parse_srt(srt)
    assert load_subtitles([(0, 1, "a"), [2, 3.5, "b"]]) == [(0.0, 1.0, "a"), (2.0, 3.5, "b")]
    assert load_subtitles(lambda video: SUBTITLES if video == "v" else None, "v") == SUBTITLES
    assert load_subtitles(None) == []
    with pytest.raises(FileNotFoundError, match="q-gate.subtitles"):
        load_subtitles(str(tmp_path / "missing.srt"))
    with pytest.raises(ValueError, match=r"q-gate.subtitles.*\(start_s, end_s, text\)"):
        load_subtitles([(1.0, "a")])
    with pytest.raises(ValueError, match="ends before it starts"):
        load_subtitles([(3.0, 1.0, "a")])


def sampled(model, processor, question="where is the red ball?", **params):
    """The FrameChoice q-gate makes for the evidence clip (through the method, as handle.prepare calls it)."""
    FEATURE_CACHE.clear()
    encoder = WordEncoder()
    method = vtc.registry()["q-gate"](encoder=encoder, num_frames=4, **params)
    ctx = vtc.core.tokens.Context(question=question, model=model, processor=processor)
    return method.sample(vtc.media.video.VideoSource.open(evidence_clip(), fps=4), ctx), encoder


def test_each_expert_finds_its_evidence_and_a_muted_expert_costs_nothing():
    model, processor = model_and_processor("qwen2_vl")
    # visual grounding alone: the red square (a crop is all red; the whole frame only a little)
    choice, encoder = sampled(model, processor, weights=(1, 0, 0))
    assert choice.indices == [SQUARE] * 4 and encoder.images_encoded == 20 + 20 * 9
    # global matching alone: the reddish frame; the crops are never encoded
    choice, encoder = sampled(model, processor, weights=(0, 1, 0))
    assert choice.indices == [REDDISH] * 4 and encoder.images_encoded == 20
    assert choice.candidates == fps_candidates(80, 4.0, 1) and max(choice.scores) == choice.scores[REDDISH // 4]
    # contextual alignment alone: the seconds within 1 s of the red subtitle (8, 9, 10); no image encoded at all
    of_video = lambda video: SUBTITLES if video.num_frames == 80 else None  # noqa: E731 (a callable, per video)
    choice, encoder = sampled(model, processor, weights=(0, 0, 1), subtitles=of_video)
    assert set(choice.indices) <= {32, 36, 40} and encoder.images_encoded == 0
    assert "a red alert" in encoder.texts
    # a fixed contextual-only gate without subtitles has nothing to weigh
    with pytest.raises(ValueError, match="weight 0"):
        sampled(model, processor, weights=(0, 0, 1))


def test_the_llm_gate_routes_to_its_favourite_expert(monkeypatch):
    model, processor = model_and_processor("qwen2_vl")
    prompts = []

    def gate_says(vg, gm, ca):
        return lambda model, processor, prompt, max_new_tokens: prompts.append(prompt) or answer(vg, gm, ca)

    monkeypatch.setattr(qgate, "ask_text", gate_says(0.7, 0.3, 0.0))
    choice, encoder = sampled(model, processor)
    counts = Counter(choice.indices)
    assert counts[SQUARE] > counts[REDDISH] >= 1 and "red ball" in encoder.texts  # the gate's entity is grounded
    monkeypatch.setattr(qgate, "ask_text", gate_says(0.3, 0.7, 0.0))
    counts = Counter(sampled(model, processor)[0].indices)
    assert counts[REDDISH] > counts[SQUARE]
    # the gate asks for subtitles where there are none: its contextual weight is dropped, the rest renormalised
    monkeypatch.setattr(qgate, "ask_text", gate_says(0.0, 0.5, 0.5))
    assert sampled(model, processor)[0].indices == [REDDISH] * 4
    assert all("Subtitles available: no." in p for p in prompts)
    sampled(model, processor, subtitles=SUBTITLES)
    assert "Subtitles available: yes." in prompts[-1]


def test_q_gate_asks_the_tiny_model_and_stats_show_the_frames(monkeypatch):
    model, processor = model_and_processor("qwen2_vl")
    answers = []
    real = qgate.ask_text
    monkeypatch.setattr(qgate, "ask_text", lambda *a: answers.append(real(*a)) or answers[-1])
    with vtc.patch(model, "q-gate", encoder=WordEncoder(), num_frames=4, gate_max_new_tokens=8) as handle:
        inputs = handle.prepare(processor, evidence_clip(), "where is the red ball?", fps=4)
        with torch.no_grad():
            model(**inputs)
        chosen = handle.stats().frames[0]
    assert len(answers) == 1 and isinstance(answers[0], str)  # the random model's answer: almost surely no JSON
    weights, _, parsed = gate_weights(answers[0], has_subtitles=False)
    assert parsed or weights == {"visual_grounding": 0.5, "global_matching": 0.5, "contextual_alignment": 0.0}
    assert chosen.method == "q-gate" and len(chosen.indices) == 4 and set(chosen.indices) <= {SQUARE, REDDISH}
    assert chosen.candidates == list(range(0, 80, 4))
    assert chosen.scores == [chosen.candidate_scores[chosen.candidates.index(i)] for i in chosen.indices]
    assert inputs["video_grid_thw"][0, 0].item() == 2


def test_q_gate_composes_with_a_connect_method_on_tiny_clip():
    register_tiny_clip()
    model, processor = model_and_processor("qwen2_5_vl")
    spec = "q-gate+vidcom2"
    params = {"encoder": "vtc-tiny-clip", "encoder_pretrained": None, "weights": (0.5, 0.5, 0.0), "crops": 2}
    with vtc.patch(model, spec, retention=0.5, num_frames=4, **params) as handle:
        inputs = handle.prepare(processor, evidence_clip(), "the red ball", fps=4)
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
    assert stats.frames[0].method == "q-gate" and len(stats.frames[0].indices) == 4
    assert stats.llm_tokens_in == round(stats.visual_tokens_in * 0.5)
    with pytest.raises(ValueError, match="'q-gate' and 'bolt' both decide frame selection"):
        vtc.patch(model, "q-gate+bolt")


def test_bad_inputs_name_the_problem():
    model, processor = model_and_processor("qwen2_vl")
    with vtc.patch(model, "q-gate", encoder=WordEncoder(), weights=(1, 1, 0)) as handle:
        with pytest.raises(ValueError, match="question"):
            handle.prepare(processor, evidence_clip(), "", fps=4)
    # no model to ask (prepare_inputs without one): the message says how to give fixed weights instead
    with pytest.raises(ValueError, match=r"q-gate.weights=\(vg, gm, ca\)"):
        vtc.prepare_inputs(processor, evidence_clip(), "the red ball", "q-gate", fps=4, encoder=WordEncoder())
    with pytest.raises(ValueError, match="unknown CLIP encoder 'ViT-Nope'.*q-gate.encoder"):
        vtc.prepare_inputs(processor, evidence_clip(), "q", "q-gate", fps=4, encoder="ViT-Nope", weights=(1, 0, 0))
    with pytest.raises(TypeError, match="q-gate.encoder.*encode_text"):
        clip_encoder(object(), param="q-gate.encoder")
    with pytest.raises(ValueError, match="three non-negative numbers"):
        vtc.patch(model, "q-gate", weights=(1.0, -1.0, 0.0))
