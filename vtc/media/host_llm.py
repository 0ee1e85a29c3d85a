"""Asking the host model a text-only question, for samplers that consult the LLM before choosing frames: QuoTA's
query decoupling (`quota`) and Q-Gate's expert gating (`q-gate`). One user turn through the processor's chat
template, greedy decoding, the answer decoded without special tokens.

Inside `handle.prepare` vtc's hooks are suspended while a sampler runs, so this prompt is not compressed and does
not appear in `handle.stats()`.
"""

from __future__ import annotations

import torch


def ask_text(model, processor, prompt: str, max_new_tokens: int) -> str:
    """The model's greedy answer to `prompt` alone (no video, no image)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], return_tensors="pt").to(next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    tokenizer = getattr(processor, "tokenizer", processor)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
