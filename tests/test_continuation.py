"""Forwards that continue a compressed prompt: decode steps inside one generate call work; a second generate call
on the same cache (a multi-turn chat) would re-feed tokens the model already saw, because generate infers the
processed length from the shortened cache — vtc refuses it with a clear error instead of answering wrongly;
continuing by hand with only the new tokens and the whole-sequence mask works and matches re-running the whole
sequence."""

from __future__ import annotations

import pytest
import torch

import vtc
from tests.conftest import model_and_processor, single_inputs


def extra_ids(processor, text: str) -> torch.Tensor:
    return processor.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


@pytest.mark.parametrize("fam", ["qwen2_vl", "llava_onevision"])
def test_a_second_generate_call_on_a_compressed_cache_is_refused(fam):
    model, processor = model_and_processor(fam)
    inputs = single_inputs(fam)
    with vtc.patch(model, "random", retention=0.5):
        first = model.generate(**inputs, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
        ids = torch.cat([first.sequences, extra_ids(processor, " And then?")], 1)
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
        if "mm_token_type_ids" in inputs:
            pad = torch.zeros(1, ids.shape[1] - inputs["input_ids"].shape[1], dtype=torch.long)
            kwargs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], pad], 1)
            kwargs["video_grid_thw"] = inputs["video_grid_thw"]
        with pytest.raises(ValueError, match="cannot continue a compressed cache across generate calls"):
            model.generate(**kwargs, past_key_values=first.past_key_values)
        # the supported way: the whole conversation again, compressed anew
        again = model.generate(**{**inputs, "input_ids": inputs["input_ids"]}, max_new_tokens=2, do_sample=False)
        assert torch.equal(again, first.sequences)


def test_continuing_by_hand_with_the_new_tokens_matches_the_whole_sequence():
    """LLaVA (1-D RoPE): feed only the new tokens with the whole-sequence mask; vtc maps the mask and positions onto
    the compressed cache, and the logits equal a fresh forward of the whole sequence (which the patch compresses
    the same way)."""
    model, processor = model_and_processor("llava_onevision")
    inputs = single_inputs("llava_onevision")
    new = extra_ids(processor, " And then?")
    with vtc.patch(model, "random", retention=0.5):
        with torch.no_grad():
            out = model(**inputs, use_cache=True)
            length = inputs["input_ids"].shape[1] + new.shape[1]
            cont = model(
                input_ids=new,
                attention_mask=torch.ones(1, length, dtype=torch.long),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
            whole = dict(inputs)
            whole["input_ids"] = torch.cat([inputs["input_ids"], new], 1)
            whole["attention_mask"] = torch.ones_like(whole["input_ids"])
            ref = model(**whole, use_cache=False).logits[:, -new.shape[1] :]
        with pytest.raises(ValueError, match="attention mask of .* columns"):
            with torch.no_grad():
                model(
                    input_ids=new,
                    attention_mask=torch.ones(1, length - 3, dtype=torch.long),
                    past_key_values=model(**inputs, use_cache=True).past_key_values,
                )
    torch.testing.assert_close(cont.logits, ref, atol=2e-5, rtol=1e-4)


def test_a_new_video_in_a_continued_forward_is_refused():
    model, processor = model_and_processor("llava_onevision")
    inputs = single_inputs("llava_onevision")
    with vtc.patch(model, "random", retention=0.5):
        with torch.no_grad():
            out = model(**inputs, use_cache=True)
            second = dict(inputs)
            length = inputs["input_ids"].shape[1] * 2
            second["attention_mask"] = torch.ones(1, length, dtype=torch.long)
            with pytest.raises(ValueError, match="brings a new video"):
                model(**second, past_key_values=out.past_key_values, use_cache=True)
