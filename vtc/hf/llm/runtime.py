"""Shrinking the sequence inside the LLM during prefill, for `prefill` plugins (FastV, FrameFusion, ...).

Hooks, all on the patched model's own modules (removed by `remove()`):
  * decoder layer forward pre-hook: calls plugins at "layer_start"; once the sequence has changed, feeds
    the layer the shortened hidden states and the matching rows of the RoPE (cos, sin) and position ids;
  * post-attention norm pre-hook + MLP forward hook + decoder layer forward hook: calls plugins at
    "after_attention" on the residual stream (h + Attn(LN(h))), and if they shrink it, runs the MLP on the
    short stream and makes the layer return `short + MLP(LN(short))`, exactly as a forward written for it
    would (the layer's own full-length residual add is discarded);
  * attention module forward pre-hook + vtc's dispatcher (`vtc.hf.llm.attention`): explicit attention rows for
    plugins that ask, and masks for layers whose keys no longer line up with the mask transformers built, while
    the layer's output comes from the model's own attention implementation.
Layers cache only the tokens alive when they ran, so the KV cache is ragged across layers; decode steps
use per-layer key masks recorded at prefill. Survivors keep their original positions (RoPE rows are
gathered, never recomputed), so decoding continues from the original prompt length.

Which attention implementation each layer runs (the model's own is `config._attn_implementation`, read per
attention module when patching: "sdpa", "eager", "flash_attention_2", or any function registered with
transformers' `AttentionInterface`):
  * layers before any change, and every forward without a video: the model's own, with transformers' own mask
    (bit-identical to the unpatched model);
  * a layer whose attention rows a method requests (`request_attention`): the model's own for the layer's output,
    over the full sequence; the requested rows are computed separately by vtc (`attention_rows`: softmax of those
    query rows against the layer's keys), never by switching the layer to eager;
  * layers after a prune or merge: the model's own, on the shortened sequence with its gathered RoPE rows and
    position ids, given the mask that implementation takes (`attention.mask_format`): none at all when there is
    no padding (SDPA's and flash-attention's `is_causal` path), otherwise SDPA's dense boolean mask, eager's
    additive mask, flash-attention's 2-D padding mask (the unpadded varlen path transformers uses for any padded
    batch), or what the implementation's registered mask function builds;
  * decode steps: the same rule over the layer's own (ragged) cache, with the keys it cached at prefill (and those
    `mask_keys` hides) masked;
  * `attend_bidirectionally()`: SDPA and eager run non-causal with a dense mask, flash-attention with
    `is_causal=False` and its padding mask;
  * what no mask can express for the model's implementation (it registered no mask function and the batch is
    padded or cached keys are hidden; a bidirectional layer on an implementation other than those above; a mask
    function that fails on the shortened layout): that layer runs SDPA with a dense mask. vtc warns once per
    patch (`AttentionFallbackWarning`) and records each such layer in `handle.stats().attention_fallbacks`.
`handle.stats().layer_attention` lists the implementation that computed each layer at the last prefill.

Methods that declare `MethodInfo(acts_during_decode=True)` are also called at "layer_start" of every layer during decode
steps (`state.phase == "decode"`), where they may read attention rows of the new token and hide cached
prompt keys from the following layers for that step (`state.mask_keys`), as DyCoke's dynamic KV pruning does.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import warnings
from typing import Any, Callable

import torch

from vtc.core.stats import AttentionFallback
from vtc.core.tokens import TokenLayout
from vtc.hf.llm import attention as attn_mod
from vtc_kernels import mean_into_anchors
from vtc_kernels.attention import attention_rows

Tensor = torch.Tensor


class AttentionFallbackWarning(UserWarning):
    """A layer of a patched model ran SDPA instead of the model's own attention implementation (see
    `handle.stats().attention_fallbacks`)."""


@dataclasses.dataclass
class _Implementation:
    """One attention module's own implementation, as found when patching."""

    name: str  # config._attn_implementation
    function: Callable  # what the module's forward dispatches to
    mask: str  # the mask it takes (`attention.mask_format`)
    config: Any  # the module's real config
    view: attn_mod.DispatchConfig  # what the module sees during its forward while vtc drives it


FALLBACK_REASONS = {
    "padding": "the batch is padded after a prune and {impl} takes no attention mask",
    "bidirectional": "a method asked for bidirectional attention, which vtc cannot request from {impl}",
    "masked keys": "this layer's cached keys are ragged or partly hidden and {impl} takes no attention mask",
    "mask function": "the mask function registered for {impl} failed on the shortened sequence",
}


class LLMState:
    """What a `prefill` plugin sees at each call; changes go through `keep`, `merge_mean`, `replace_hidden`
    (prefill) and `mask_keys` (decode)."""

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
    def phase(self) -> str:
        """ "prefill" (the prompt) or "decode" (a later forward reusing its cache)."""
        return "decode" if self._rt.decoding else "prefill"

    @property
    def num_layers(self) -> int:
        return len(self._rt.layers)

    @property
    def family(self) -> str:
        return self._rt.family

    # what is there
    @property
    def hidden(self) -> Tensor:
        """The residual stream [B, n, D] at this point (prefill: the prompt; decode: the new tokens)."""
        return self._rt.hidden

    @property
    def layout(self) -> TokenLayout:
        """Slots of the prompt as they are now (prefill) or were at the end of prefill (decode)."""
        return self._rt.layout

    def prefill_layout(self, layer: int) -> TokenLayout:
        """The prompt's slots as `layer` saw them at prefill = what its KV cache holds, in order."""
        return self._rt.layer_layouts[layer]

    @property
    def grids(self) -> list[list[tuple[int, int, int]]]:
        """Token grid (T, H, W) of each video, per batch row."""
        return self._rt.grids

    @property
    def visual_tokens_in(self) -> Tensor:
        """[B] visual tokens each row had when it entered the LLM."""
        return self._rt.visual_in

    # attention rows
    def request_attention(self, num_rows: int | str = 1, upcast: bool = True) -> None:
        """Ask for attention probabilities at *this* layer, of the last `num_rows` prompt tokens, or of every
        token after the last visual token (`num_rows="after_visual"`, PruneVid's text queries). During decode
        the rows are the new tokens.

        Call at "layer_start"; read them with `attention()` at this layer's "after_attention" or later.
        `upcast`: softmax in float32 (transformers' eager attention) instead of the model dtype.
        """
        if self.point != "layer_start":
            raise RuntimeError("request_attention must be called at the 'layer_start' point of a layer")
        if not (isinstance(num_rows, int) and num_rows >= 1) and num_rows != "after_visual":
            raise ValueError(f"num_rows must be a positive int or 'after_visual', got {num_rows!r}")
        self._rt.requests[self.layer] = (num_rows, upcast)

    def attention(self, layer: int | None = None) -> Tensor:
        """Captured probabilities [B, heads, rows, keys] of `layer` (default: the current one). Rows that do
        not exist for a batch row (padding of "after_visual") are all zero; see `attention_rows_valid`."""
        layer = self.layer if layer is None else layer
        if layer not in self._rt.captured:
            raise RuntimeError(f"no attention rows were captured at layer {layer}; call request_attention first")
        return self._rt.captured[layer]

    def attention_rows_valid(self, layer: int | None = None) -> Tensor:
        """[B, rows] which captured rows are real."""
        return self._rt.captured_rows_valid[self.layer if layer is None else layer]

    def projections(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """This layer's query rows and keys before the rotary embedding, from the stream entering it (call at
        "layer_start"): rows [B, R] slot indices -> (query [B, heads, R, d], key [B, kv_heads, n, d]), computed as
        the layer's attention computes them (input norm, q/k projections, Qwen3's q/k norms) but stopped before
        RoPE. PruneVid scores tokens with these."""
        if self.point != "layer_start" or self.phase != "prefill":
            raise RuntimeError("projections are available at the 'layer_start' point of a prefill layer")
        return self._rt.projections(rows)

    def attention_at_start(self, num_rows: int | str = 1, upcast: bool = True) -> Tensor:
        """This layer's attention probabilities [B, heads, rows, keys] of the last `num_rows` prompt tokens (or
        `"after_visual"`), computed at "layer_start" of a prefill layer from the stream entering it, before the
        layer runs: its input norm and q/k projections (`projections`), RoPE at the current slots' positions (the
        attention module's own `apply_rotary_pos_emb`), then `attention_rows` with the causal and padding mask of
        `request_attention`. A method can then drop tokens before the very layer that ranks them (PyramidDrop);
        `attention_rows_valid` is not set (every row is real unless `"after_visual"`)."""
        if self.point != "layer_start" or self.phase != "prefill":
            raise RuntimeError("attention_at_start is available at the 'layer_start' point of a prefill layer")
        if not (isinstance(num_rows, int) and num_rows >= 1) and num_rows != "after_visual":
            raise ValueError(f"num_rows must be a positive int or 'after_visual', got {num_rows!r}")
        return self._rt.attention_at_start(num_rows, upcast)

    def attend_bidirectionally(self) -> None:
        """Let this layer's prompt tokens attend to every prompt token, later ones included (padding stays
        masked), for this prefill only. Call at "layer_start". Reproduces official code whose attention-reading
        layer loses its causal mask (HoliTom's layer k-1 under SDPA)."""
        if self.point != "layer_start" or self.phase != "prefill":
            raise RuntimeError("attend_bidirectionally must be called at the 'layer_start' point of a prefill layer")
        self._rt.bidirectional.add(self.layer)

    # changes (prefill)
    def keep(self, mask: Tensor, prune_cache: bool = False) -> None:
        """Keep the slots where `mask` [B, n] is True. Only visual tokens may be dropped. With `prune_cache`,
        the KV cache of every earlier layer drops the same tokens (PruneVid), which requires those layers to
        have cached exactly the current slots."""
        self._rt.keep(mask, prune_cache)

    def merge_mean(self, batch: Tensor, dst: Tensor, src: Tensor) -> None:
        """Fold slot (batch[e], src[e]) into (batch[e], dst[e]) for every e: each destination becomes the
        plain mean of itself and the sources folded into it (FrameFusion's rule), then sources are removed.
        Side features (Qwen3-VL DeepStack) are folded the same way."""
        self._rt.merge_mean(batch, dst, src)

    def replace_hidden(self, hidden: Tensor) -> None:
        """Replace the residual stream with new values of the same shape (e.g. a custom merge rule followed by
        `keep`)."""
        if hidden.shape != self._rt.hidden.shape:
            raise ValueError(f"replace_hidden needs shape {tuple(self._rt.hidden.shape)}, got {tuple(hidden.shape)}")
        self._rt.hidden = hidden

    # changes (decode)
    def mask_keys(self, visible: Tensor) -> None:
        """During a decode step, let the following layers attend only to the cached prompt slots where
        `visible` [B, n_prompt] is True (the prompt slots of `prefill_layout(layer)`; newer tokens stay
        visible). Applies from the current layer on, for this step only."""
        if self.phase != "decode":
            raise RuntimeError("mask_keys applies to decode steps")
        self._rt.step_mask = (self.layer, visible)


class LLMRuntime:
    """Drives `prefill` plugins inside one patched text model."""

    def __init__(
        self,
        text_model: torch.nn.Module,
        layers: list[torch.nn.Module],
        call_plugins: Callable[[LLMState, bool], None],
        family: str,
        deepstack: bool = False,
        decode_plugins: bool = False,
        recorder: Any = None,
    ) -> None:
        self.text_model = text_model
        self.layers = list(layers)
        self.call_plugins = call_plugins
        self.family = family
        self.deepstack = deepstack
        self.decode_plugins = decode_plugins
        self.state = LLMState(self)
        # where attention fallbacks are recorded (`StatsRecorder`); by default the recorder of the patch whose
        # method `call_plugins` is
        if recorder is None:
            recorder = getattr(getattr(call_plugins, "__self__", None), "recorder", None)
        self.recorder = recorder
        self._handles: list[Any] = []
        self._impl: dict[torch.nn.Module, _Implementation] = {}
        self._warned = False
        self.reset()

    # --- install / remove ------------------------------------------------------------------------------------
    def install(self) -> None:
        attn_mod.ensure_registered()
        for i, layer in enumerate(self.layers):
            module = layer.self_attn
            self._impl[module] = self._implementation(module, module.config)
            attn_mod.RUNTIME_BY_MODULE[module] = self
            self._handles.append(layer.register_forward_pre_hook(self._make_layer_pre_hook(i), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._layer_post_hook, with_kwargs=True))
            self._handles.append(module.register_forward_pre_hook(self._attention_pre_hook))
            self._handles.append(layer.post_attention_layernorm.register_forward_pre_hook(self._post_attn_norm_hook))
            self._handles.append(layer.mlp.register_forward_hook(self._mlp_hook))
        if self.deepstack:
            original = self.text_model._deepstack_process
            runtime = self

            def deepstack_process(_self, hidden_states, visual_pos_masks, visual_embeds):
                return runtime.deepstack_process(original, hidden_states, visual_pos_masks, visual_embeds)

            self.text_model._deepstack_process = types.MethodType(deepstack_process, self.text_model)

    @staticmethod
    def _implementation(module: torch.nn.Module, config: Any) -> _Implementation:
        """The module's own implementation (its config is usually the text model's, shared by every layer)."""
        name = config._attn_implementation
        return _Implementation(
            name=name,
            function=attn_mod.original_attention(name, module),
            mask=attn_mod.mask_format(name),
            config=config,
            view=attn_mod.DispatchConfig(config),
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module, impl in self._impl.items():
            attn_mod.RUNTIME_BY_MODULE.pop(module, None)
            module.config = impl.config
        self._impl.clear()
        if self.deepstack and "_deepstack_process" in vars(self.text_model):
            del self.text_model._deepstack_process
        self.reset()

    # --- per forward -----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the previous prompt (a new prefill starts, or the patch is removed)."""
        self.active = False  # inside a prefill forward with a video
        self.decoding = False  # inside a later forward that reuses the prefill's cache
        self.layer = -1
        self.point = ""
        self.hidden: Tensor | None = None
        self.layout: TokenLayout | None = None
        self.altered = False
        self.right_align = True
        self.cache = None
        self.full_cos_sin: tuple[Tensor, Tensor] | None = None
        self.full_text_positions: Tensor | None = None
        self.cos_sin: tuple[Tensor, Tensor] | None = None
        self.text_positions: Tensor | None = None
        self.side: dict[str, Tensor] = {}
        self.requests: dict[int, tuple[int | str, bool]] = {}
        self.bidirectional: set[int] = set()  # prefill layers whose prompt attention is not causal
        self.captured: dict[int, Tensor] = {}
        self.captured_rows_valid: dict[int, Tensor] = {}
        self.grids: list[list[tuple[int, int, int]]] = []
        self.visual_in: Tensor | None = None
        self.layer_visual: list[int] = []
        self.layer_impl: dict[int, str] = {}  # the implementation that computed each layer at this prefill
        self.fallbacks: list[AttentionFallback] = []  # this prompt's layers that could not run their own
        self._mid_short: Tensor | None = None
        self._layer_out: Tensor | None = None
        # kept after the prefill, for decode steps
        self.layer_layouts: dict[int, TokenLayout] = {}  # what each layer cached at prefill
        self.layer_altered: dict[int, bool] = {}  # its cache no longer matches transformers' mask
        self.step_mask: tuple[int, Tensor] | None = None

    def begin_prefill(
        self, layout: TokenLayout, grids: list[list[tuple[int, int, int]]], side: dict[str, Tensor] | None = None
    ) -> None:
        self.reset()
        for module, impl in self._impl.items():  # `model.set_attn_implementation(...)` since the last prefill
            if impl.config._attn_implementation != impl.name:
                self._impl[module] = self._implementation(module, impl.config)
        self.active = True
        self.layout = layout
        self.grids = grids
        self.side = dict(side or {})
        self.right_align = bool(layout.valid[:, -1].all())
        self.visual_in = (layout.visual & layout.valid).sum(1)

    def begin_decode(self) -> None:
        self.decoding = bool(self.layer_layouts)
        self.step_mask = None
        self.requests = {}
        self.captured = {}

    def end_forward(self) -> list[int]:
        counts = self.layer_visual
        stats = None if self.recorder is None else self.recorder.current
        if self.active and stats is not None and self.layer_impl:
            stats.layer_attention = [self.layer_impl.get(i, "") for i in range(len(self.layers))]
        self.active = False
        self.decoding = False
        self.hidden = None
        self.side = {}
        self.captured = {}
        self.captured_rows_valid = {}
        self.step_mask = None
        self.full_cos_sin = self.cos_sin = None
        self.full_text_positions = self.text_positions = None
        self.cache = None
        return counts

    # --- sequence changes ------------------------------------------------------------------------------------
    def keep(self, mask: Tensor, prune_cache: bool = False) -> None:
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
        if prune_cache:
            self._prune_cache(idx, valid)
        self._apply_gather(idx, valid)

    def _prune_cache(self, idx: Tensor, valid: Tensor) -> None:
        """Apply the slot selection `idx` to the KV cache of every layer before the current one."""
        if self.cache is None:
            return
        new_layout = self.layout.gather(idx, valid)
        for layer in range(self.layer):
            seen = self.layer_layouts.get(layer)
            if seen is None or not torch.equal(seen.index, self.layout.index):
                raise RuntimeError(
                    f"cannot prune layer {layer}'s cache: it holds a different sequence than the current one"
                )
            cached = self.cache.layers[layer]
            gather = idx.to(cached.keys.device)[:, None, :, None]
            cached.keys = torch.gather(
                cached.keys, 2, gather.expand(-1, cached.keys.shape[1], -1, cached.keys.shape[3])
            )
            cached.values = torch.gather(
                cached.values, 2, gather.expand(-1, cached.values.shape[1], -1, cached.values.shape[3])
            )
            self.layer_layouts[layer] = new_layout
            self.layer_altered[layer] = True

    def merge_mean(self, batch: Tensor, dst: Tensor, src: Tensor) -> None:
        if src.numel() == 0:
            return
        bsz, n = self.layout.valid.shape
        flat_dst = batch * n + dst
        flat_src = batch * n + src

        def fold(x: Tensor) -> Tensor:
            flat = x.reshape(bsz * n, *x.shape[2:])
            return mean_into_anchors(flat, flat_dst.to(x.device), flat_src.to(x.device)).view(x.shape)

        self.hidden = fold(self.hidden)
        self.side = {name: fold(t) for name, t in self.side.items()}
        keep = torch.ones(bsz * n, dtype=torch.bool, device=self.layout.valid.device)
        keep[flat_src.to(keep.device)] = False
        self.keep(keep.view(bsz, n))

    def projections(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        module = self.layers[self.layer]
        attn = module.self_attn
        with torch.no_grad():
            normed = module.input_layernorm(self.hidden)
            picked = torch.gather(normed, 1, rows.to(normed.device)[..., None].expand(-1, -1, normed.shape[-1]))
            query = attn.q_proj(picked).view(*picked.shape[:-1], -1, attn.head_dim)
            key = attn.k_proj(normed).view(*normed.shape[:-1], -1, attn.head_dim)
            if getattr(attn, "q_norm", None) is not None:  # Qwen3: q/k RMS norms before RoPE
                query, key = attn.q_norm(query), attn.k_norm(key)
        return query.transpose(1, 2), key.transpose(1, 2)

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
            if not (self.active or (self.decoding and self.decode_plugins)):
                return None
            self.layer = layer_idx
            hidden = args[0] if args else kwargs["hidden_states"]
            if layer_idx == 0:
                self.cache = kwargs.get("cache", kwargs.get("past_key_values"))
                if self.active:
                    self.full_cos_sin = tuple(kwargs["position_embeddings"])
                    self.full_text_positions = kwargs.get("position_ids")
            self.hidden = hidden
            self.point = "layer_start"
            self.call_plugins(self.state, self.decoding)
            if self.decoding:
                return None
            self.layer_visual.append(self.layout.num_visual)
            if self.hidden is hidden and not self.altered:
                return None
            args = (self.hidden,) + tuple(args[1:]) if args else args
            if not args:
                kwargs["hidden_states"] = self.hidden
            if self.altered:
                kwargs["position_embeddings"] = self.cos_sin
                if kwargs.get("position_ids") is not None:
                    kwargs["position_ids"] = self.text_positions
            return args, kwargs

        return hook

    def _post_attn_norm_hook(self, module, args):
        if not self.active:
            return None
        stream = args[0]
        self.hidden = stream
        self.point = "after_attention"
        self.call_plugins(self.state, False)
        if self.hidden is stream:
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
    def _attention_pre_hook(self, module, args):
        """While vtc drives a forward, the module looks its attention function up in a view of its config that
        names vtc's dispatcher (which puts the real config back at once); otherwise it runs as unpatched."""
        impl = self._impl.get(module)
        if impl is not None:
            module.config = impl.view if (self.active or self.decoding) else impl.config
        return None

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        impl = self._impl[module]
        module.config = impl.config  # the dispatch is done: the function sees the module as it is
        layer = module.layer_idx
        q_len, kv_len = query.shape[2], key.shape[2]
        scaling = kwargs.get("scaling", module.scaling)
        if self.active:
            layout = self.layout
            self.layer_layouts[layer] = layout
            self.layer_altered[layer] = self.altered
            if layer in self.requests:
                self._capture_prefill(layer, query, key, scaling)
            causal = layer not in self.bidirectional
            if not self.altered and causal:
                self.layer_impl[layer] = impl.name
                return impl.function(module, query, key, value, attention_mask, **kwargs)
            if kv_len != q_len:
                raise RuntimeError(
                    "vtc prefill plugins compress the first forward of a sequence only; this forward continues "
                    "a non-empty cache with a new video"
                )
            valid = layout.valid.to(query.device)
            return self._prefill_attention(impl, module, query, key, value, valid, causal, kwargs)
        if not self.decoding or layer not in self.layer_layouts:
            return impl.function(module, query, key, value, attention_mask, **kwargs)
        prefix = self.layer_layouts[layer].valid.to(query.device)
        if self.step_mask is not None and layer >= self.step_mask[0]:
            prefix = prefix & self.step_mask[1].to(query.device)
        elif not self.layer_altered.get(layer, False) and layer not in self.requests:
            return impl.function(module, query, key, value, attention_mask, **kwargs)
        visible = self._decode_mask(prefix, q_len, kv_len)
        if layer in self.requests:
            probs = attention_rows(
                query,
                key,
                torch.arange(q_len, device=query.device)[None].expand(query.shape[0], -1),
                visible[:, 0],
                scaling,
                self.requests[layer][1],
            )
            self.captured[layer] = probs
            self.captured_rows_valid[layer] = torch.ones(probs.shape[0], q_len, dtype=torch.bool)
        return self._decode_attention(impl, module, query, key, value, prefix, visible, kwargs)

    def _prefill_attention(self, impl, module, query, key, value, valid: Tensor, causal: bool, kwargs):
        """A prefill layer over the current (shortened) slots: the model's own implementation with the mask it
        takes, or SDPA where no mask it takes says what is needed."""
        padded = not bool(valid.all())
        kind = impl.mask
        reason = None
        if kind == "sdpa":
            # no padding: plain causal attention (SDPA's is_causal path, the fast one)
            mask = None if causal and not padded else self._prefill_mask(valid, causal)
        elif kind == "eager":
            mask = self._additive(self._prefill_mask(valid, causal), query.dtype)
        elif kind == "flash":
            mask = valid if padded else None  # the unpadded (varlen) path, as for any padded batch
            if not causal:
                kwargs = {**kwargs, "is_causal": False}
        elif not causal:
            mask, reason = None, "bidirectional"
        elif kind == "custom":
            mask, reason = self._registered_mask(impl, query, valid, valid.shape[1], 0)
        else:  # no mask function: transformers never hands this implementation a mask
            mask, reason = None, ("padding" if padded else None)
        if reason is not None:
            mask = None if causal and not padded else self._prefill_mask(valid, causal)
            return self._fallback(impl, module, reason, "prefill", query, key, value, mask, kwargs)
        self.layer_impl[module.layer_idx] = impl.name
        return impl.function(module, query, key, value, mask, **kwargs)

    def _decode_attention(self, impl, module, query, key, value, prefix: Tensor, visible: Tensor, kwargs):
        """A decode step over a layer whose cache is ragged or partly hidden: `visible` [B, 1, q, kv] is the
        dense mask; each implementation gets it in the form it takes."""
        q_len, kv_len = query.shape[2], key.shape[2]
        sees_all = q_len == 1 and bool(visible.all())  # one new token sees every cached key
        kind = impl.mask
        reason = None
        if kind == "sdpa":
            mask = None if sees_all else visible
        elif kind == "eager":
            mask = None if sees_all else self._additive(visible, query.dtype)
        else:
            new = torch.ones(prefix.shape[0], kv_len - prefix.shape[1], dtype=torch.bool, device=prefix.device)
            keys = torch.cat([prefix, new], dim=1)  # [B, kv] which cached keys count
            if kind == "flash":
                mask = None if bool(keys.all()) else keys
            elif kind == "custom":
                mask, reason = self._registered_mask(impl, query, keys, q_len, kv_len - q_len)
            else:
                mask, reason = None, (None if bool(keys.all()) else "masked keys")
        if reason is not None:
            mask = None if sees_all else visible
            return self._fallback(impl, module, reason, "decode", query, key, value, mask, kwargs)
        return impl.function(module, query, key, value, mask, **kwargs)

    @staticmethod
    def _registered_mask(impl, query: Tensor, keys: Tensor, q_len: int, q_offset: int):
        """The mask the implementation's registered mask function builds for `keys` [B, kv] (causal, queries at
        `q_offset`), as transformers calls it; (None, "mask function") when it fails."""
        from transformers.masking_utils import causal_mask_function

        try:
            mask = attn_mod.mask_function(impl.name)(
                batch_size=keys.shape[0],
                q_length=q_len,
                kv_length=keys.shape[1],
                q_offset=q_offset,
                kv_offset=0,
                mask_function=causal_mask_function,
                attention_mask=keys,
                allow_is_causal_skip=True,
                dtype=query.dtype,
                config=impl.config,
                use_vmap=False,
                device=query.device,
            )
        except Exception:  # another transformers generation's signature, or a layout it cannot describe
            return None, "mask function"
        return mask, None

    def _fallback(self, impl, module, reason: str, phase: str, query, key, value, mask, kwargs):
        """Run SDPA with a dense mask where the model's implementation cannot take the mask needed; warn once per
        patch and record the layer in the prompt's stats."""
        layer = module.layer_idx
        record = AttentionFallback(layer=layer, from_impl=impl.name, to_impl="sdpa", reason=reason, phase=phase)
        if record not in self.fallbacks:
            self.fallbacks.append(record)
        if self.recorder is not None:
            self.recorder.attention_fallback(record)
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"vtc: layer {layer} of this {self.family} model ran SDPA with a dense mask instead of its own "
                f"attention implementation {impl.name!r} ({phase}): "
                f"{FALLBACK_REASONS[reason].format(impl=repr(impl.name))}. Each such layer is listed in "
                f"handle.stats().attention_fallbacks; this patch warns only once.",
                AttentionFallbackWarning,
                stacklevel=2,
            )
        if phase == "prefill":
            self.layer_impl[layer] = "sdpa"
        return attn_mod.original_attention("sdpa")(module, query, key, value, mask, **kwargs)

    @staticmethod
    def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
        """A boolean mask (True = may attend) as eager attention takes it: 0 where allowed, the dtype's minimum
        elsewhere."""
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)

    @staticmethod
    def _prefill_mask(valid: Tensor, causal: bool = True) -> Tensor:
        """[B, 1, n, n] boolean mask over the prompt's slots: causal (or not) and no padding keys."""
        n = valid.shape[1]
        order = torch.ones(n, n, dtype=torch.bool, device=valid.device)
        mask = (order.tril() if causal else order)[None] & valid[:, None, :]
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

    def _capture_prefill(self, layer: int, query: Tensor, key: Tensor, scaling: float) -> None:
        num_rows, upcast = self.requests[layer]
        rows, rows_valid, visible = self._prompt_rows(layer, num_rows, query.device)
        probs = attention_rows(query, key, rows, visible, scaling, upcast)
        self.captured[layer] = probs * rows_valid[:, None, :, None].to(probs.dtype)
        self.captured_rows_valid[layer] = rows_valid

    def _prompt_rows(self, layer: int, num_rows: int | str, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """(rows [B, r] query slots, rows_valid [B, r], visible [B, r, n] keys each row may attend to) of the
        current prompt: the last `num_rows` real slots, or every slot after the last visual token."""
        valid = self.layout.valid.to(device)
        bsz, n = valid.shape
        slot = torch.arange(n, device=device)[None].expand_as(valid)
        last = torch.where(valid, slot, -1).max(dim=1).values
        if num_rows == "after_visual":
            visual = (self.layout.visual & self.layout.valid).to(device)
            first = torch.where(visual, slot, -1).max(dim=1).values + 1  # the slot after the last visual token
            counts = (last - first + 1).clamp(min=1)
            width = int(counts.max())
            offsets = torch.arange(width, device=device)[None]
            rows_valid = offsets < counts[:, None]
            rows = torch.minimum(first[:, None] + offsets, last[:, None])
        else:
            rows = (last[:, None] - torch.arange(num_rows - 1, -1, -1, device=device)[None]).clamp(min=0)
            rows_valid = torch.ones_like(rows, dtype=torch.bool)
        visible = (torch.arange(n, device=device)[None, None, :] <= rows[:, :, None]) & valid[:, None, :]
        if layer in self.bidirectional:  # every row sees every real key
            visible = valid[:, None, :].expand(-1, rows.shape[1], -1)
        return rows, rows_valid, visible

    def attention_at_start(self, num_rows: int | str, upcast: bool) -> Tensor:
        """`LLMState.attention_at_start`: the layer's attention rows from the stream entering it, with the RoPE rows
        of the current slots, before the layer runs."""
        module = self.layers[self.layer]
        attn = module.self_attn
        cos_sin = self.cos_sin if self.altered else self.full_cos_sin
        if cos_sin is None:
            raise RuntimeError("attention_at_start needs the layer's rotary embedding (position_embeddings)")
        device = self.hidden.device
        rows, rows_valid, visible = self._prompt_rows(self.layer, num_rows, device)
        query, key = self.projections(rows)  # [B, H, r, d], [B, Hkv, n, d], before RoPE
        rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb  # how this attention module rotates
        cos, sin = (t.to(device) for t in cos_sin)
        if cos.shape[0] != rows.shape[0]:  # RoPE tables shared across the batch
            cos, sin = cos.expand(rows.shape[0], -1, -1), sin.expand(rows.shape[0], -1, -1)
        index = rows[..., None].expand(-1, -1, cos.shape[-1])
        with torch.no_grad():
            query = rotate(query, query, torch.gather(cos, 1, index), torch.gather(sin, 1, index))[0]
            key = rotate(key, key, cos, sin)[1]
            picked = torch.arange(rows.shape[1], device=device)[None].expand_as(rows)
            scaling = getattr(attn, "scaling", attn.head_dim**-0.5)
            probs = attention_rows(query, key, picked, visible, scaling, upcast)
        return probs * rows_valid[:, None, :, None].to(probs.dtype)
