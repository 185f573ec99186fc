"""The attention function transformers calls per layer, routed into hwkv's backend.

transformers (5.x, with `use_cache=False` and explicit `position_ids`) hands each attention module's call
the new tokens' q/k/v after RoPE as [1, H, T, D] plus the keyword arguments the model's forward was given;
the runner passes one `ForwardContext` there (`hwkv_forward=`), so the function needs no global state.
The context holds the forward's `ForwardBatch` (the metadata step already ran) and one `AttentionLayer` per
layer, built on the layer's first call from what the model passes (scaling, window, sinks, soft-cap) and
reused after: a layer call compares a few host values and launches the backend's write + attention.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from hwkv.batch import ForwardBatch
from hwkv.checks import check_sink_values
from hwkv.errors import ConfigError, ShapeError
from hwkv.layer import AttentionLayer, storage_key

ATTN_IMPLEMENTATION = "hwkv"
_registered = False


@dataclass
class LayerTable:
    """Every layer's AttentionLayer, made once from the config's kinds and the first call's arguments."""

    is_swa: Sequence[bool]
    window: int
    shape: Any = None  # the ModelShape the pools were built for: each layer's K/V geometry is checked against it
    layers: Dict[int, AttentionLayer] = field(default_factory=dict)
    frozen: bool = False  # the runner replays captured graphs (device graphs, torch.compile): weights are addresses

    def get(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: Optional[float],
            sliding_window: Optional[int], softcap: Optional[float], sinks: Optional[torch.Tensor]) -> AttentionLayer:
        """The layer of `module.layer_idx`, checked against what this call passes (host values only)."""
        layer_id = module.layer_idx
        layer = self.layers.get(layer_id)
        if layer is None:
            layer = self._make(layer_id, query, key, value, scaling, sliding_window, softcap, sinks)
            self.layers[layer_id] = layer
        elif scaling is not None and scaling != layer.scaling:
            raise ConfigError(f"layer {layer_id}: scaling {scaling} differs from its first call's {layer.scaling}")
        elif sinks is not None and not torch.compiler.is_compiling() and (
                layer.sinks is None or sinks.data_ptr() != layer.sinks.data_ptr() or sinks.dtype != layer.sinks.dtype):
            # the weights were replaced, not copied into (load_state_dict(assign=True), param.data = ...): the layer
            # attends with the model's sinks as they are now (the backends key their kept state on the sinks), their
            # values checked here (a graph forward's backend reads none); under captured graphs, which replay the
            # old sinks' address, refused (at the eager forwards: torch.compile traces no data pointer)
            if self.frozen:
                raise ConfigError(f"layer {layer_id}: its sinks were replaced (load_state_dict(assign=True), "
                                  "param.data = ...) while this runner holds graphs that read the old ones: update "
                                  "the weights in place (load_state_dict(sd), copy_), or open a new runner")
            check_sink_values(sinks, f"layer {layer_id}: ")
            layer.sinks = sinks.detach()
            layer.sinks_checked = storage_key(layer.sinks)
        return layer

    def _make(self, layer_id: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              scaling: Optional[float], sliding_window: Optional[int], softcap: Optional[float],
              sinks: Optional[torch.Tensor]) -> AttentionLayer:
        if not isinstance(layer_id, int) or not 0 <= layer_id < len(self.is_swa):
            raise ConfigError(f"attention module has layer_idx {layer_id!r}; the config has {len(self.is_swa)} layers")
        swa = self.is_swa[layer_id]
        expected = self.window if swa else None
        if sliding_window != expected:
            raise ConfigError(f"layer {layer_id}: the model passes sliding_window={sliding_window!r}, the config "
                              f"read as {'sliding' if swa else 'full'} gives {expected!r}")
        if self.shape is not None:
            s = self.shape
            want = (s.swa_num_kv_heads, s.swa_head_dim, s.swa_v_head_dim) if swa else \
                (s.num_kv_heads, s.head_dim, s.v_head_dim)
            got = (int(key.shape[1]), int(key.shape[-1]), int(value.shape[-1]))
            if got != want:
                raise ConfigError(f"layer {layer_id} ({'sliding' if swa else 'full'}): the model passes K/V with "
                                  f"(kv heads, head_dim, v_head_dim) = {got}, the pools were built from the config "
                                  f"as {want}; hwkv does not know this model's {s.name!r} attention geometry")
        return AttentionLayer(layer_id, int(query.shape[1]), int(key.shape[1]), int(query.shape[-1]),
                              scaling=scaling, v_head_dim=int(value.shape[-1]), sliding_window=expected,
                              logit_cap=float(softcap or 0.0), sinks=None if sinks is None else sinks.detach())


class _Running(threading.local):
    """The model class a HybridRunner step is running in this thread (None outside one): a layer that reaches hwkv
    attention without hwkv_forward= inside a step dropped the forward's keyword arguments, outside one was not run
    through a runner. An attribute of a thread-local, which torch.compile traces in a compiled step (a ContextVar
    adds frames)."""

    model: Optional[str] = None


RUNNING = _Running()


@dataclass
class ForwardContext:
    """What one forward hands every layer: the backend (metadata initialised for `batch`) and the layers; `served`
    marks the layer ids hwkv served (the runner refuses a forward that missed some: the model ran another attention;
    a layer served twice is refused at its second call, before it overwrites the K/V the first call stored)."""

    backend: Any
    batch: ForwardBatch
    table: LayerTable
    served: int = 0   # a bit a layer id (an int, which torch.compile traces without a graph break, as a set is not)

    @property
    def calls(self) -> int:
        """The attention layers this forward served."""
        return self.served.bit_count()

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: Optional[float], sliding_window: Optional[int], softcap: Optional[float],
               sinks: Optional[torch.Tensor]) -> torch.Tensor:
        """Write this layer's K/V and attend: [1, H, T, D] in, [1, T, H, Dv] out (views, never copies of q/k/v
        unless the last dimension is strided)."""
        if query.shape[0] != 1:
            raise ShapeError(f"hwkv attention takes the batch packed into one row (B=1), got query {list(query.shape)}")
        layer = self.table.get(module, query, key, value, scaling, sliding_window, softcap, sinks)
        bit = 1 << layer.layer_id
        if self.served & bit:
            raise ConfigError(f"layer {layer.layer_id} ({type(module).__name__}) ran attention twice in one forward: "
                              "hwkv keeps one K/V a layer and token, which the second call would overwrite (a model "
                              "that attends more than once a layer, or runs a layer module more than once, is not "
                              "served)")
        self.served |= bit
        out = self.backend.forward(_tokens_major(query), _tokens_major(key), _tokens_major(value), layer, self.batch)
        return out.unsqueeze(0)


def _tokens_major(t: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] -> [T, H, D] (one view; a copy only when D is not the innermost dimension)."""
    t = t[0].transpose(0, 1)
    return t if t.stride(-1) == 1 else t.contiguous()


def hwkv_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                   sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                   s_aux: Optional[torch.Tensor] = None, hwkv_forward: Optional[ForwardContext] = None,
                   **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns (out [1, T, H, Dv], None).

    The soft-cap is the `softcap` the model passes (Gemma 2 passes its `attn_logit_softcapping`; models
    that pass none get none, as in transformers' own kernels); sinks arrive as `s_aux` (GPT-OSS).
    """
    if hwkv_forward is None:
        running = RUNNING.model
        if running is not None:
            raise ConfigError(f"{running}'s attention ({type(module).__name__}) reached hwkv attention without "
                              "hwkv_forward= during a HybridRunner step: its layers do not pass the forward's keyword "
                              "arguments on to their attention function, so hwkv cannot serve this model")
        raise ConfigError(f"attention implementation {ATTN_IMPLEMENTATION!r} was called without hwkv_forward=: "
                          "run the model through hwkv.integrations.transformers.HybridRunner, or switch it back "
                          "with model.set_attn_implementation('sdpa')")
    if attention_mask is not None:
        raise ConfigError(f"hwkv attention masks by request and window itself; got an attention_mask of shape "
                          f"{list(attention_mask.shape)} (call the model without one)")
    if dropout and module.training:
        raise ConfigError(f"hwkv attention is for inference: dropout={dropout} with the module in training mode")
    return hwkv_forward.attend(module, query, key, value, scaling, sliding_window, softcap, s_aux), None


def register() -> str:
    """Register `hwkv_attention` with transformers under "hwkv" (once; imports transformers) and return the name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, hwkv_attention)
        _registered = True
    return ATTN_IMPLEMENTATION
