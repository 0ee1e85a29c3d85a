"""Shrinking the sequence inside the LLM during prefill, for `prefill` plugins (FastV, FrameFusion, ...).

Hooks, all on the patched model's own modules (removed by `remove()`):
  * decoder layer forward pre-hook: calls plugins at "layer_start"; once the sequence has changed, feeds
    the layer the shortened hidden states and the matching rows of the RoPE (cos, sin) and position ids;
  * post-attention norm pre-hook + MLP forward hook + decoder layer forward hook: calls plugins at
    "after_attention" on the residual stream (h + Attn(LN(h))), and if they shrink it, runs the MLP on the
    short stream and makes the layer return `short + MLP(LN(short))`, exactly as a forward written for it
    would (the layer's own full-length residual add is discarded);
  * the registered attention function (`vtc.llm.attention`): explicit attention rows for plugins that ask,
    and masks for layers whose keys no longer line up with the mask transformers built.
Layers cache only the tokens alive when they ran, so the KV cache is ragged across layers; decode steps
use per-layer key masks recorded at prefill. Survivors keep their original positions (RoPE rows are
gathered, never recomputed), so decoding continues from the original prompt length.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable

import torch

from vtc.llm import attention as attn_mod

Tensor = torch.Tensor


@dataclasses.dataclass
class TokenLayout:
    """Per-slot bookkeeping of the sequence inside the LLM; every field is [B, n].

    index: position of the slot's token in the sequence that entered the LLM (gathers RoPE rows)
    valid: a real token (False for padding)
    visual: a compressible visual token; frame/patch/video are -1 elsewhere
    patch: spatial index within the frame (row * W + col)
    """

    index: Tensor
    valid: Tensor
    visual: Tensor
    frame: Tensor
    patch: Tensor
    video: Tensor

    def gather(self, idx: Tensor, valid: Tensor) -> "TokenLayout":
        fields = {f.name: torch.gather(getattr(self, f.name), 1, idx) for f in dataclasses.fields(self)}
        fields["valid"] = valid
        fields["visual"] = fields["visual"] & valid
        return TokenLayout(**fields)

    @property
    def num_visual(self) -> int:
        return int((self.visual & self.valid).sum())


class LLMState:
    """What a `prefill` plugin sees at each call; changes go through `keep` and `merge_mean`."""

    def __init__(self, runtime: "LLMRuntime") -> None:
        self._rt = runtime

    # where we are
    @property
    def layer(self) -> int:
        return self._rt.layer

    @property
    def point(self) -> str:
        return self._rt.point

    @property
    def num_layers(self) -> int:
        return len(self._rt.layers)

    @property
    def family(self) -> str:
        return self._rt.family

    # what is there
    @property
    def hidden(self) -> Tensor:
        """The residual stream [B, n, D] at this point (read it; change it only through keep/merge)."""
        return self._rt.hidden

    @property
    def layout(self) -> TokenLayout:
        return self._rt.layout

    @property
    def grids(self) -> list[list[tuple[int, int, int]]]:
        """Token grid (T, H, W) of each video, per batch row."""
        return self._rt.grids

    @property
    def visual_tokens_in(self) -> Tensor:
        """[B] visual tokens each row had when it entered the LLM."""
        return self._rt.visual_in

    # attention rows
    def request_attention(self, num_rows: int = 1, upcast: bool = True) -> None:
        """Ask for the attention probabilities of the last `num_rows` prompt tokens at *this* layer.

        Call at "layer_start"; read them with `attention()` at this layer's "after_attention" or later.
        `upcast`: softmax in float32 (transformers' eager attention) instead of the model dtype.
        """
        if self.point != "layer_start":
            raise RuntimeError("request_attention must be called at the 'layer_start' point of a layer")
        self._rt.requests[self.layer] = (num_rows, upcast)

    def attention(self, layer: int | None = None) -> Tensor:
        """Captured probabilities [B, heads, rows, keys] of `layer` (default: the current one)."""
        layer = self.layer if layer is None else layer
        if layer not in self._rt.captured:
            raise RuntimeError(f"no attention rows were captured at layer {layer}; call request_attention first")
        return self._rt.captured[layer]

    # changes
    def keep(self, mask: Tensor) -> None:
        """Keep the slots where `mask` [B, n] is True. Only visual tokens may be dropped."""
        self._rt.keep(mask)

    def merge_mean(self, batch: Tensor, dst: Tensor, src: Tensor) -> None:
        """Fold slot (batch[e], src[e]) into (batch[e], dst[e]) for every e: each destination becomes the
        plain mean of itself and the sources folded into it (FrameFusion's rule), then sources are removed.
        Side features (Qwen3-VL DeepStack) are folded the same way."""
        self._rt.merge_mean(batch, dst, src)


class LLMRuntime:
    """Drives `prefill` plugins inside one patched text model."""

    def __init__(
        self,
        text_model: torch.nn.Module,
        layers: list[torch.nn.Module],
        call_plugins: Callable[[LLMState, bool], None],
        family: str,
        deepstack: bool = False,
    ) -> None:
        self.text_model = text_model
        self.layers = list(layers)
        self.call_plugins = call_plugins
        self.family = family
        self.deepstack = deepstack
        self.state = LLMState(self)
        self._handles: list[Any] = []
        self._orig_attn: dict[torch.nn.Module, Callable] = {}
        self._config_attn_before: str | None = None
        self._reset_prefill()
        self.layer_key_valid: dict[int, Tensor] = {}

    # --- install / remove ------------------------------------------------------------------------------------
    def install(self) -> None:
        attn_mod.ensure_registered()
        config = self.text_model.config
        self._config_attn_before = config._attn_implementation
        for i, layer in enumerate(self.layers):
            module = layer.self_attn
            self._orig_attn[module] = attn_mod.original_attention(self._config_attn_before, module)
            attn_mod.RUNTIME_BY_MODULE[module] = self
            self._handles.append(layer.register_forward_pre_hook(self._make_layer_pre_hook(i), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._layer_post_hook, with_kwargs=True))
            self._handles.append(layer.post_attention_layernorm.register_forward_pre_hook(self._post_attn_norm_hook))
            self._handles.append(layer.mlp.register_forward_hook(self._mlp_hook))
        config._attn_implementation = attn_mod.ATTENTION_NAME
        if self.deepstack:
            original = self.text_model._deepstack_process
            runtime = self

            def deepstack_process(_self, hidden_states, visual_pos_masks, visual_embeds):
                return runtime.deepstack_process(original, hidden_states, visual_pos_masks, visual_embeds)

            self.text_model._deepstack_process = types.MethodType(deepstack_process, self.text_model)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self._orig_attn:
            attn_mod.RUNTIME_BY_MODULE.pop(module, None)
        self._orig_attn.clear()
        self.text_model.config._attn_implementation = self._config_attn_before
        if self.deepstack and "_deepstack_process" in vars(self.text_model):
            del self.text_model._deepstack_process
        self._reset_prefill()
        self.layer_key_valid = {}

    # --- per forward -----------------------------------------------------------------------------------------
    def _reset_prefill(self) -> None:
        self.active = False  # inside a prefill forward with a video
        self.decoding = False  # inside a later forward that reuses the prefill's cache
        self.layer = -1
        self.point = ""
        self.hidden: Tensor | None = None
        self.layout: TokenLayout | None = None
        self.altered = False
        self.right_align = True
        self.full_cos_sin: tuple[Tensor, Tensor] | None = None
        self.full_text_positions: Tensor | None = None
        self.cos_sin: tuple[Tensor, Tensor] | None = None
        self.text_positions: Tensor | None = None
        self.side: dict[str, Tensor] = {}
        self.requests: dict[int, tuple[int, bool]] = {}
        self.captured: dict[int, Tensor] = {}
        self.grids: list[list[tuple[int, int, int]]] = []
        self.visual_in: Tensor | None = None
        self.layer_visual: list[int] = []
        self._mid_short: Tensor | None = None
        self._layer_out: Tensor | None = None

    def reset(self) -> None:
        """Forget the previous prompt (a new prefill starts)."""
        self._reset_prefill()
        self.layer_key_valid = {}

    def begin_prefill(
        self, layout: TokenLayout, grids: list[list[tuple[int, int, int]]], side: dict[str, Tensor] | None = None
    ) -> None:
        self.reset()
        self.active = True
        self.layout = layout
        self.grids = grids
        self.side = dict(side or {})
        self.right_align = bool(layout.valid[:, -1].all())
        self.visual_in = (layout.visual & layout.valid).sum(1)

    def begin_decode(self) -> None:
        self.decoding = bool(self.layer_key_valid)

    def end_forward(self) -> list[int]:
        counts = self.layer_visual
        self.active = False
        self.decoding = False
        self.hidden = None
        self.side = {}
        self.captured = {}
        self.full_cos_sin = self.cos_sin = None
        self.full_text_positions = self.text_positions = None
        return counts

    # --- sequence changes ------------------------------------------------------------------------------------
    def keep(self, mask: Tensor) -> None:
        layout = self.layout
        mask = mask.to(layout.valid.device) & layout.valid
        forced = layout.valid & ~layout.visual
        if bool((forced & ~mask).any()):
            raise RuntimeError("a prefill plugin tried to drop a non-visual token; only visual tokens can be dropped")
        if bool((mask == layout.valid).all()):
            return  # nothing dropped (padding slots are never "kept")
        counts = mask.sum(1)
        n_new = int(counts.max())
        # kept slots first, in their original order
        order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :n_new]
        arange = torch.arange(n_new, device=mask.device)[None, :]
        if self.right_align:
            pos = arange - (n_new - counts)[:, None]
        else:
            pos = arange.expand(mask.shape[0], -1)
        valid = (pos >= 0) & (pos < counts[:, None])
        idx = torch.gather(order, 1, pos.clamp(min=0, max=n_new - 1))
        self._apply_gather(idx, valid)

    def merge_mean(self, batch: Tensor, dst: Tensor, src: Tensor) -> None:
        if src.numel() == 0:
            return
        bsz, n = self.layout.valid.shape
        device = self.hidden.device
        flat_dst = (batch * n + dst).to(device)
        flat_src = (batch * n + src).to(device)
        anchors, counts = torch.unique(flat_dst, return_counts=True)

        def fold(x: Tensor) -> Tensor:
            flat = x.reshape(bsz * n, *x.shape[2:]).clone()
            flat.index_add_(0, flat_dst.to(x.device), flat[flat_src.to(x.device)])
            shape = (-1,) + (1,) * (flat.dim() - 1)
            flat[anchors.to(x.device)] /= (counts + 1).to(x.device, flat.dtype).view(shape)
            return flat.view(x.shape)

        self.hidden = fold(self.hidden)
        self.side = {name: fold(t) for name, t in self.side.items()}
        keep = torch.ones(bsz * n, dtype=torch.bool, device=self.layout.valid.device)
        keep[flat_src.to(keep.device)] = False
        self.keep(keep.view(bsz, n))

    def _apply_gather(self, idx: Tensor, valid: Tensor) -> None:
        self.layout = self.layout.gather(idx, valid)
        h_idx = idx.to(self.hidden.device)
        self.hidden = torch.gather(self.hidden, 1, h_idx[..., None].expand(-1, -1, self.hidden.shape[-1]))
        self.side = {
            name: torch.gather(
                t, 1, idx.to(t.device).view(*idx.shape, *([1] * (t.dim() - 2))).expand(*idx.shape, *t.shape[2:])
            )
            for name, t in self.side.items()
        }
        self.altered = True
        self._refresh_positions()

    def _refresh_positions(self) -> None:
        if self.full_cos_sin is None:
            return
        index = self.layout.index
        cos, sin = self.full_cos_sin
        gathered = []
        for t in (cos, sin):
            i = index.to(t.device)
            if t.shape[0] != i.shape[0]:  # RoPE tables shared across the batch
                t = t.expand(i.shape[0], *t.shape[1:])
            gathered.append(torch.gather(t, 1, i[..., None].expand(-1, -1, t.shape[-1])))
        self.cos_sin = (gathered[0], gathered[1])
        if self.full_text_positions is not None:
            tp = self.full_text_positions
            i = index.to(tp.device)
            if tp.shape[0] != i.shape[0]:
                tp = tp.expand(i.shape[0], -1)
            self.text_positions = torch.gather(tp, 1, i)

    # --- hooks -------------------------------------------------------------------------------------------------
    def _make_layer_pre_hook(self, layer_idx: int):
        def hook(module, args, kwargs):
            if not self.active:
                return None
            self.layer = layer_idx
            hidden = args[0] if args else kwargs["hidden_states"]
            if layer_idx == 0:
                cos, sin = kwargs["position_embeddings"]
                self.full_cos_sin = (cos, sin)
                self.full_text_positions = kwargs.get("position_ids")
            self.hidden = hidden
            self.point = "layer_start"
            self.call_plugins(self.state, False)
            self.layer_visual.append(self.layout.num_visual)
            if not self.altered:
                return None
            hidden = self.hidden
            args = (hidden,) + tuple(args[1:]) if args else args
            if not args:
                kwargs["hidden_states"] = hidden
            kwargs["position_embeddings"] = self.cos_sin
            if kwargs.get("position_ids") is not None:
                kwargs["position_ids"] = self.text_positions
            return args, kwargs

        return hook

    def _post_attn_norm_hook(self, module, args):
        if not self.active:
            return None
        altered_before = self.altered
        layout_before = self.layout
        self.hidden = args[0]
        self.point = "after_attention"
        self.call_plugins(self.state, False)
        if self.layout is layout_before and altered_before == self.altered:
            return None
        self._mid_short = self.hidden
        return (self.hidden,)

    def _mlp_hook(self, module, args, output):
        if self._mid_short is None:
            return None
        self._layer_out = self._mid_short + output
        self._mid_short = None
        # the layer adds this to its full-length residual; its result is discarded by _layer_post_hook
        return output.new_zeros(())

    def _layer_post_hook(self, module, args, kwargs, output):
        if self._layer_out is None:
            return None
        out = self._layer_out
        self._layer_out = None
        return out

    def deepstack_process(self, original, hidden_states, visual_pos_masks, visual_embeds):
        """Qwen3-VL adds DeepStack features after the first layers; once the sequence changed, add them to
        the surviving visual slots (their features were gathered/merged along with the tokens)."""
        if not (self.active and self.altered):
            return original(hidden_states, visual_pos_masks, visual_embeds)
        level = self.layer
        features = self.side.get("deepstack")
        if features is None or level >= features.shape[2]:
            return hidden_states
        # features are zero on slots that had none (text), so adding them over all real slots is exact
        mask = self.layout.valid.to(hidden_states.device)
        out = hidden_states.clone()
        out[mask] = out[mask] + features[:, :, level].to(out.device, out.dtype)[mask]
        return out

    # --- attention -------------------------------------------------------------------------------------------
    def attention(self, module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        original = self._orig_attn[module]
        q_len, kv_len = query.shape[2], key.shape[2]
        if self.active:
            layout = self.layout
            if layer in self.requests:
                self._capture(layer, query, key, kwargs.get("scaling", module.scaling))
            if not self.altered:
                return original(module, query, key, value, attention_mask, **kwargs)
            if kv_len != q_len:
                raise RuntimeError(
                    "vtc prefill plugins compress the first forward of a sequence only; this forward continues "
                    "a non-empty cache with a new video"
                )
            self.layer_key_valid[layer] = layout.valid.clone()
            # no padding: plain causal attention (SDPA's is_causal path, the fast one)
            mask = None if bool(layout.valid.all()) else self._prefill_mask(layout.valid.to(query.device))
            return attn_mod.original_attention("sdpa")(module, query, key, value, mask, **kwargs)
        key_valid = self.layer_key_valid.get(layer) if self.decoding else None
        if key_valid is None:
            return original(module, query, key, value, attention_mask, **kwargs)
        if q_len == 1 and bool(key_valid.all()):
            mask = None  # one new token sees every cached key
        else:
            mask = self._decode_mask(key_valid.to(query.device), q_len, kv_len)
        return attn_mod.original_attention("sdpa")(module, query, key, value, mask, **kwargs)

    @staticmethod
    def _prefill_mask(valid: Tensor) -> Tensor:
        n = valid.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=valid.device).tril()
        mask = causal[None] & valid[:, None, :]
        # a padding query row attends to itself so it stays finite (its output is never used)
        mask |= torch.eye(n, dtype=torch.bool, device=valid.device)[None] & ~valid[:, :, None]
        return mask[:, None]

    @staticmethod
    def _decode_mask(prefill_valid: Tensor, q_len: int, kv_len: int) -> Tensor:
        bsz, n_pref = prefill_valid.shape
        device = prefill_valid.device
        new = torch.ones(bsz, kv_len - n_pref, dtype=torch.bool, device=device)
        key_valid = torch.cat([prefill_valid, new], dim=1)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
        causal = torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]
        return (causal[None] & key_valid[:, None, :])[:, None]

    def _capture(self, layer: int, query: Tensor, key: Tensor, scaling: float) -> None:
        num_rows, upcast = self.requests[layer]
        valid = self.layout.valid.to(query.device)
        n = valid.shape[1]
        # last `num_rows` valid slots of every row (left-aligned rows: the last real tokens)
        slot = torch.arange(n, device=query.device)[None].expand_as(valid)
        last = torch.where(valid, slot, -1).max(dim=1).values
        rows = (last[:, None] - torch.arange(num_rows - 1, -1, -1, device=query.device)[None]).clamp(min=0)
        visible = (torch.arange(n, device=query.device)[None, None, :] <= rows[:, :, None]) & valid[:, None, :]
        self.captured[layer] = attn_mod.attention_rows(query, key, rows, visible, scaling, upcast)
