"""One check shared by the HF and vLLM tests of prompts with several videos and images: a compressed prompt's M-RoPE
positions are the uncompressed prompt's, taken at its text and images and at each video's surviving cells."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def video_slots(input_ids: list[int] | Tensor, video_token_id: int, counts: list[int]) -> list[Tensor]:
    """Prompt indices of each video's tokens (raster order of its grid), given each video's token count."""
    ids = torch.as_tensor(input_ids)
    slots = torch.nonzero(ids == video_token_id).flatten()
    if slots.numel() != sum(counts):
        raise AssertionError(f"{slots.numel()} video tokens in the prompt, expected {sum(counts)}")
    return list(torch.split(slots, counts))


def assert_positions_kept(
    original: Tensor, compressed: Tensor, slots: list[Tensor], kept_cells: list[Tensor], compressed_length: int
) -> None:
    """`original` [3, L] positions of the uncompressed prompt, `slots[k]` the indices of video k's tokens in it,
    `kept_cells[k]` the grid cells video k kept; `compressed` [3, L'] the positions the LLM got. They must be the
    same columns (text, images and surviving video tokens each keep their own), and the prompt must end where the
    uncompressed one does, so decoding continues at the same position."""
    assert compressed.shape == (3, compressed_length), (tuple(compressed.shape), compressed_length)
    video = torch.zeros(original.shape[1], dtype=torch.bool)
    for s in slots:
        video[s] = True
    selected = [torch.nonzero(~video).flatten()] + [s[c.cpu().long()] for s, c in zip(slots, kept_cells)]
    expected = original[:, torch.cat(selected)]
    assert sorted(map(tuple, compressed.T.tolist())) == sorted(map(tuple, expected.T.tolist()))
    assert int(compressed.max()) == int(original.max())
