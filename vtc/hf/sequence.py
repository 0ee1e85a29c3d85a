"""Rewriting the LLM input sequence after the connect stage: pure tensor code, no model objects.

Each batch row is rebuilt from its text tokens (kept in place, with their original positions) and the
surviving tokens of its videos (`VideoTokens`, in the order the plugins left them, each inside its own
frame's segment). Rows are then re-padded on the side the input was padded on, so the last prompt token
stays last (what `generate` reads logits from).
"""

from __future__ import annotations

import dataclasses

import torch

from vtc.core.tokens import TokenLayout, VideoTokens
from vtc.hf.adapters.base import VideoSpan

Tensor = torch.Tensor


@dataclasses.dataclass
class RebuiltSequence:
    embeds: Tensor  # [B, L', D]
    attention_mask: Tensor  # [B, L'] long
    positions: Tensor  # [P, B, L'] (P = 3 for M-RoPE, 1 for 1-D RoPE)
    layout: TokenLayout  # slot bookkeeping for the prefill runtime
    deepstack: Tensor | None  # [B, L', levels, D] dense, zero on slots without DeepStack features
    deepstack_mask: Tensor | None  # [B, L'] slots that carry DeepStack features (images and videos)


def deepstack_per_token(visual_pos_masks: Tensor, deepstack: list[Tensor], shape: tuple[int, int]) -> Tensor:
    """Dense [B, L, levels, D] view of transformers' row-major `deepstack_visual_embeds` list."""
    bsz, length = shape
    levels = torch.stack(list(deepstack), dim=1)  # [n_visual, levels, D]
    dense = levels.new_zeros(bsz, length, *levels.shape[1:])
    dense[visual_pos_masks.to(dense.device)] = levels
    return dense


def rebuild(
    embeds: Tensor,
    attention_mask: Tensor,
    positions: Tensor,
    spans: list[VideoSpan],
    outputs: list[VideoTokens],
    compact: bool,
    deepstack: Tensor | None = None,
    deepstack_mask: Tensor | None = None,
) -> RebuiltSequence:
    """Assemble the new padded batch. `positions` are the original [P, B, L] positions of every token."""
    bsz, _, dim = embeds.shape
    device = embeds.device
    valid_in = attention_mask.bool().to(device)
    right_align = bool(valid_in[:, -1].all())
    rows = []
    for b in range(bsz):
        row_spans = [(s, o) for s, o in zip(spans, outputs) if s.batch == b]
        compressible = torch.zeros_like(valid_in[b])
        for span, _ in row_spans:
            compressible[span.seq_index.to(device)] = True
        text_idx = torch.nonzero(valid_in[b] & ~compressible).flatten()
        keys = [2 * text_idx]
        sources = [text_idx]
        parts = [embeds[b, text_idx]]
        n_text = text_idx.numel()
        visual = [torch.zeros(n_text, dtype=torch.bool, device=device)]
        frame = [torch.full((n_text,), -1, device=device)]
        patch = [torch.full((n_text,), -1, device=device)]
        video = [torch.full((n_text,), -1, device=device)]
        tag_names = sorted({name for _, tokens in row_spans for name in tokens.tags})
        tag_parts = {name: [torch.full((n_text,), -1, device=device)] for name in tag_names}
        ds_parts = [deepstack[b, text_idx]] if deepstack is not None else []
        ds_mask_parts = [deepstack_mask[b, text_idx].to(device)] if deepstack_mask is not None else []
        for k, (span, tokens) in enumerate(row_spans):
            n = len(tokens)
            if span.in_place:  # each token back at its own index (a grid whose rows end with a newline token)
                keys.append(2 * tokens.seq_index.to(device) + 1)
            else:
                keys.append(2 * span.frame_slot.to(device)[tokens.frame.to(device)] + 1)
            sources.append(tokens.seq_index.to(device))
            parts.append(tokens.embeds.to(device, embeds.dtype))
            visual.append(torch.ones(n, dtype=torch.bool, device=device))
            frame.append(tokens.frame.to(device))
            patch.append((tokens.row * span.grid[2] + tokens.col).to(device))
            video.append(torch.full((n,), k, device=device))
            for name in tag_names:
                tag = tokens.tags.get(name)
                tag_parts[name].append(tag.to(device) if tag is not None else torch.full((n,), -1, device=device))
            if deepstack is not None:
                ds_parts.append(tokens.extras["deepstack"].to(deepstack.device, deepstack.dtype))
                ds_mask_parts.append(torch.ones(n, dtype=torch.bool, device=device))
        order = torch.sort(torch.cat(keys), stable=True).indices
        row = {
            "embeds": torch.cat(parts)[order],
            "source": torch.cat(sources)[order],
            "visual": torch.cat(visual)[order],
            "frame": torch.cat(frame)[order],
            "patch": torch.cat(patch)[order],
            "video": torch.cat(video)[order],
            "tags": {name: torch.cat(parts)[order] for name, parts in tag_parts.items()},
        }
        if deepstack is not None:
            row["deepstack"] = torch.cat(ds_parts)[order.to(deepstack.device)]
            row["deepstack_mask"] = torch.cat(ds_mask_parts)[order]
        rows.append(row)

    length = max(r["embeds"].shape[0] for r in rows)
    out_embeds = embeds.new_zeros(bsz, length, dim)
    out_mask = torch.zeros(bsz, length, dtype=torch.long, device=device)
    out_pos = positions.new_ones(positions.shape[0], bsz, length)
    layout_fields = {
        name: torch.full((bsz, length), -1, dtype=torch.long, device=device) for name in ("frame", "patch", "video")
    }
    visual = torch.zeros(bsz, length, dtype=torch.bool, device=device)
    tags = {
        name: torch.full((bsz, length), -1, dtype=torch.long, device=device) for row in rows for name in row["tags"]
    }
    out_ds = deepstack.new_zeros(bsz, length, *deepstack.shape[2:]) if deepstack is not None else None
    out_ds_mask = torch.zeros(bsz, length, dtype=torch.bool, device=device) if deepstack is not None else None
    for b, row in enumerate(rows):
        n = row["embeds"].shape[0]
        sl = slice(length - n, length) if right_align else slice(0, n)
        out_embeds[b, sl] = row["embeds"]
        out_mask[b, sl] = 1
        if compact:
            out_pos[:, b, sl] = torch.arange(n, device=device, dtype=positions.dtype)
        else:
            out_pos[:, b, sl] = positions[:, b, row["source"].to(positions.device)]
        visual[b, sl] = row["visual"]
        for name in layout_fields:
            layout_fields[name][b, sl] = row[name]
        for name, values in row["tags"].items():
            tags[name][b, sl] = values
        if out_ds is not None:
            out_ds[b, sl] = row["deepstack"]
            out_ds_mask[b, sl] = row["deepstack_mask"]
    index = torch.arange(length, device=device)[None].expand(bsz, -1).contiguous()
    layout = TokenLayout(index=index, valid=out_mask.bool(), visual=visual, tags=tags, **layout_fields)
    return RebuiltSequence(out_embeds, out_mask, out_pos, layout, out_ds, out_ds_mask)


def identity_layout(attention_mask: Tensor, spans: list[VideoSpan]) -> TokenLayout:
    """Layout of an unchanged sequence (no connect-stage rewrite), for the prefill runtime."""
    bsz, length = attention_mask.shape
    device = attention_mask.device
    fields = {
        name: torch.full((bsz, length), -1, dtype=torch.long, device=device) for name in ("frame", "patch", "video")
    }
    visual = torch.zeros(bsz, length, dtype=torch.bool, device=device)
    per_row: dict[int, int] = {}
    for span in spans:
        k = per_row.get(span.batch, 0)
        per_row[span.batch] = k + 1
        frame, row, col = span.frame_row_col()
        idx = span.seq_index.to(device)
        visual[span.batch, idx] = True
        fields["frame"][span.batch, idx] = frame.to(device)
        fields["patch"][span.batch, idx] = (row * span.grid[2] + col).to(device)
        fields["video"][span.batch, idx] = k
    index = torch.arange(length, device=device)[None].expand(bsz, -1).contiguous()
    return TokenLayout(index=index, valid=attention_mask.bool(), visual=visual, **fields)
