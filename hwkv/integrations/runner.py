"""HybridRunner: a Hugging Face causal LM generating through hwkv's hybrid cache, continuously batched.

The step loop is `hwkv.engine.engine.Engine`'s; this class reads the model's layer kinds and geometry from its
config, plans and builds the pools, serves the model's attention through hwkv (the model runs with every
request packed into one row, B=1, position_ids per token, `use_cache=False`: attention is the only place
tokens meet, and hwkv does it per request) and captures decode graphs where the device has them. The model's
attention implementation is "hwkv" while a runner is open on it; the last of its runners to close gives it back
the implementation it had before the first opened. A forward in which fewer layers than the model's ran hwkv
attention (the model, or a layer, was switched to another implementation meanwhile) is a ConfigError, never
tokens from another attention.
"""
from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from hwkv.batch import ForwardBatch
from hwkv.engine.drafters import Drafter
from hwkv.engine.engine import Engine, Result, check_switches
from hwkv.engine.pools import build_cache, plan_pools
from hwkv.engine.stats import RunnerStats
from hwkv.errors import ConfigError
from hwkv.graph import EagerAdapter
from hwkv.integrations.device_choice import graph_adapter, graph_choice, resolve_spec
from hwkv.integrations.hf_attention import ATTN_IMPLEMENTATION, RUNNING, ForwardContext, LayerTable, register
from hwkv.integrations.hf_model import (check_rope_context, check_servable, model_positions, model_shape,
                                        position_limit)

GraphsOption = Union[bool, str]
__all__ = ["HybridRunner", "Result"]


@dataclass
class _OpenOn:
    """The runners open on one model and the attention implementation it had before the first of them opened."""

    previous: Any
    count: int = 0


_OPEN: "weakref.WeakKeyDictionary[Any, _OpenOn]" = weakref.WeakKeyDictionary()  # model -> its open runners


def _give_back_attention(model: Any, opened: _OpenOn) -> None:
    """One runner on `model` is gone (closed, or collected without `close()`): the last gives the model back the
    attention implementation it had before the first opened. Called at most once a runner (its finalizer)."""
    opened.count -= 1
    if opened.count == 0:
        if _OPEN.get(model) is opened:
            del _OPEN[model]
        model.set_attn_implementation(opened.previous)


class HybridRunner(Engine):
    """Continuous batching over one transformers model (see `Engine`): `add_request` any time, `step` runs one
    forward, `generate` runs all."""

    def __init__(self, model: Any, *, device: Optional[str] = None, memory: Union[None, int, str] = None,
                 context: Optional[int] = None, max_running: int = 16, chunk: int = 512, page_size: int = 16,
                 graphs: GraphsOption = "auto", graph_batch_sizes: Optional[Sequence[int]] = None,
                 overlap: Optional[bool] = None, prefix_cache: bool = True,
                 whole_step: Optional[bool] = None, draft: Optional[Drafter] = None, num_draft: int = 4) -> None:
        check_switches(overlap, prefix_cache, whole_step)  # before any of them is read (a truthy "no" is no switch)
        dev = check_servable(model)
        self.model = model
        self.spec = resolve_spec(device, dev.type)
        if context is None:
            context = min(model_positions(model.config) or 4096, 4096)
        else:
            limit = position_limit(model)
            if limit is not None and isinstance(context, int) and context > limit:
                raise ConfigError(f"context={context} is past the model's {limit} positions (max_position_embeddings, "
                                  "a learned position table): give at most that")
        check_rope_context(model, context)
        self.shape = model_shape(model.config, model.dtype)
        cached = prefix_cache and bool(self.shape.swa_layer_ids)  # the prefix cache serves the hybrid pools
        pool_plan = plan_pools(self.shape, context=context, max_running=max_running, chunk=chunk,
                               page_size=page_size, memory=memory, device=dev, prefix_cache=cached)
        cache = build_cache(self.shape, pool_plan, model.dtype, dev, backend_device=self.spec)
        self.table = LayerTable(self.shape.layer_is_swa, self.shape.window, self.shape)
        # what the pools and graphs were made for, read back before every step (_check_model): the input embeddings,
        # their rows (resize_token_embeddings), dtype and device (model.to / .float() / .half() change them)
        self._embed = model.get_input_embeddings()
        # where the model holds it (get_input_embeddings costs ~6 us, an attribute path ~1): set_input_embeddings
        # puts a new module there
        self._embed_at = next((operator.attrgetter(name) for name, mod in model.named_modules()
                               if mod is self._embed and name), None)
        w = self._embed.weight
        self._built_for = (tuple(w.shape), w.dtype, w.device, model.dtype)
        choice = graph_choice(graphs)  # every check that needs no engine before the model is touched
        self._open_on = _OPEN.get(model)
        if self._open_on is None:
            self._open_on = _OPEN[model] = _OpenOn(model.config._attn_implementation)
        self._open_on.count += 1
        # a runner dropped without close() (no `with`, an exception in the caller) gives its count back when collected:
        # it had left the model on hwkv attention for good, a later runner's close() no longer reaching zero
        self._give_back = weakref.finalize(self, _give_back_attention, model, self._open_on)
        self.closed = False
        try:  # from here on a refusal closes this runner (the model's own attention back if it was the last)
            model.set_attn_implementation(register())
            if model.config._attn_implementation != ATTN_IMPLEMENTATION:   # transformers only warns where it cannot
                raise ConfigError(f"{type(model).__name__} kept its {model.config._attn_implementation!r} attention "
                                  f"after set_attn_implementation({ATTN_IMPLEMENTATION!r}): its attention does not go "
                                  "through transformers' attention interface, so hwkv cannot serve it")
            adapter = graph_adapter(self.spec, choice)
            # a replay of captured graphs (device graphs, torch.compile) runs the tensors they captured: a layer's
            # sinks replaced under them are refused (hwkv's own "eager" replays call the model and follow them)
            self.table.frozen = adapter is not None and not isinstance(adapter, EagerAdapter)
            super().__init__(cache, self._run_model, stats=RunnerStats(self.shape, pool_plan),
                             vocab_size=int(model.get_output_embeddings().weight.shape[0]),
                             window=self.shape.window if self.shape.swa_layer_ids else None,
                             graph_adapter=adapter, graph_choice=choice,
                             graph_batch_sizes=graph_batch_sizes, overlap=overlap, prefix_cache=cached,
                             whole_step=whole_step, draft=draft, num_draft=num_draft)
            if self.graph is None and self.verify_graph is None:  # graphs='auto' fell back to eager decode: no
                self.table.frozen = False                         # replay reads the weights' addresses
        except BaseException:
            self.close()
            raise

    # ---- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Close this runner (again: nothing); the last runner open on the model gives it back the attention
        implementation it had before the first one opened."""
        if self.closed:
            return
        self.closed = True
        self._give_back()

    def __enter__(self) -> "HybridRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_model(self) -> None:
        """The model is still what this runner was built for (a few attribute reads a step, ~3 us on the CPU): hwkv's
        attention (a graph replay would run the hwkv attention it captured whatever the model says now, an eager
        forward another attention over the packed row), and its input embeddings' shape, dtype and device."""
        # the config's attribute reads cost ~3 us (its __getattribute__); its stored value is a dict read
        impl = self.model.config.__dict__.get("_attn_implementation_internal") or \
            self.model.config._attn_implementation
        if impl != ATTN_IMPLEMENTATION:
            raise ConfigError(f"the model's attention implementation is {impl!r}, not {ATTN_IMPLEMENTATION!r} "
                              "(set_attn_implementation was called while this runner is open?): "
                              f"model.set_attn_implementation({ATTN_IMPLEMENTATION!r}) before the next step")
        shape, dtype, device, pools = self._built_for
        now = self._embed_at(self.model) if self._embed_at is not None else self.model.get_input_embeddings()
        if now is not self._embed:
            raise ConfigError(f"the model's input embeddings were replaced while this runner is open "
                              f"(set_input_embeddings: {type(now).__name__}); its token checks and graphs were made "
                              "for the old ones: open a new runner")
        w = self._embed.weight   # resize_token_embeddings and .to() change this module's weight in place
        if w.shape != shape:
            raise ConfigError(f"the model's input embeddings changed from {list(shape)} to {list(w.shape)} while this "
                              "runner is open (resize_token_embeddings?); its token checks and graphs were made for "
                              "the old vocabulary: open a new runner")
        if w.dtype != dtype or w.device != device:
            raise ConfigError(f"the model moved from {dtype} on {device} to {w.dtype} on {w.device} while this runner "
                              f"is open; its pools hold {pools} K/V on {device} (the new model's K/V rounded into them "
                              "would change its tokens): move it back, or open a new runner")

    def _run_model(self, batch: ForwardBatch, ids: torch.Tensor, pos: torch.Tensor,
                   keep: Union[int, torch.Tensor]) -> torch.Tensor:
        """The HF model over one packed row; logits [K, V] at `keep` (0: every token)."""
        ctx = ForwardContext(self.cache.backend, batch, self.table)
        outer, RUNNING.model = RUNNING.model, type(self.model).__name__
        try:
            out = self.model(input_ids=ids[None], position_ids=pos[None], use_cache=False, logits_to_keep=keep,
                             hwkv_forward=ctx)
        finally:
            RUNNING.model = outer
        if ctx.calls < self.shape.num_layers:  # a host count: some layers ran another attention (wrong tokens)
            raise ConfigError(f"the model's forward ran, but {ctx.calls} of its {self.shape.num_layers} attention "
                              "layers ran hwkv attention: its attention "
                              f"implementation is {self.model.config._attn_implementation!r}, not "
                              f"{ATTN_IMPLEMENTATION!r} (set_attn_implementation was called while this runner is "
                              f"open?): model.set_attn_implementation({ATTN_IMPLEMENTATION!r}) before the next step")
        return out.logits[0]
