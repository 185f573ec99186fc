"""A Hugging Face config as hwkv sees it: layer kinds and geometry (`model_shape`). The pools' sizes and the
pools themselves (`plan_pools`, `build_cache`, `Cache`, `PoolPlan`) live in `hwkv.engine.pools` and are
re-exported here, where the integration imported them from before.

Nothing here imports transformers: a config is read through its attributes only.
"""
from __future__ import annotations

import inspect
from typing import Any, Optional, Tuple

import torch

from hwkv.engine.pools import (CPU_MEMORY_CAP, CPU_MEMORY_FRACTION, DEFAULT_MEMORY_FRACTION, MEMINFO,  # noqa: F401
                               Cache, PoolPlan, available_ram_bytes, build_cache, default_memory_cap,
                               free_device_bytes, kv_bytes_needed, plan_pools)
from hwkv.engine.presets import ModelShape
from hwkv.pool import default_swa_v_head_dim
from hwkv.errors import ConfigError
from hwkv.engine.inputs import shown

SLIDING, FULL = "sliding_attention", "full_attention"


def text_config(config: Any) -> Any:
    """The decoder's config (a multimodal config's text part; the config itself otherwise)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")   # frequencies from the forward's largest position


def _base(model: Any) -> Any:
    """The model under a `torch.compile` wrapper (whose forward takes *args, **kwargs and whose name is its own)."""
    return getattr(model, "_orig_mod", model)


def _decoder_modules(model: Any) -> Any:
    """The decoder's modules (a multimodal model's language model; its vision tower attends bidirectionally)."""
    get_decoder = getattr(model, "get_decoder", None)
    try:
        decoder = get_decoder() if callable(get_decoder) else model
    except Exception:   # noqa: BLE001 - a model without a separable decoder: scan all of it
        decoder = model
    return (decoder if isinstance(decoder, torch.nn.Module) else model).modules()


def check_servable(model: Any) -> torch.device:
    """The device of a model hwkv can serve, or a ConfigError saying why not: a transformers causal LM (a language
    head, no encoder-decoder) whose forward takes per-token positions (the runner packs requests into one row) and
    whose decoder attends causally. Read before the model is touched (`check_rope_context` follows, with the
    context)."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ConfigError(f"HybridRunner needs a transformers model (load it with load_model), got {shown(model)}")
    base = _base(model)
    name = type(base).__name__
    param = next(iter(model.parameters()), None)
    if param is None:
        raise ConfigError(f"{name} has no parameters: not a model hwkv can serve")
    if getattr(model.config, "is_encoder_decoder", False) or getattr(text_config(model.config),
                                                                     "is_encoder_decoder", False):
        raise ConfigError(f"{name} is an encoder-decoder model: hwkv serves decoder-only causal LMs")
    get_head = getattr(base, "get_output_embeddings", None)
    if not callable(get_head) or getattr(get_head(), "weight", None) is None:
        raise ConfigError(f"{name} has no language-model head: load a causal LM (AutoModelForCausalLM, load_model)")
    try:
        takes_positions = "position_ids" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):   # no signature to read: the forward is trusted
        takes_positions = True
    if not takes_positions:
        raise ConfigError(f"{name}.forward takes no position_ids: hwkv packs the requests of a forward into one row "
                          "and needs each token's position, which this model would number 0.. itself")
    for mod in _decoder_modules(base):
        if getattr(mod, "is_causal", True) is False and hasattr(mod, "layer_idx"):
            raise ConfigError(f"{name}'s attention ({type(mod).__name__}) is not causal (is_causal=False): hwkv "
                              "attention is causal")
    return param.device


def _rope_bound(mod: Any, kind: str, layer_type: Optional[str]) -> int:
    """The largest forward length (max position + 1) whose frequencies a position-dependent rotary embedding keeps at
    their original ones (transformers: longrope past `original_max_position_embeddings` takes its long factors,
    dynamic past `original_max_seq_len` rescales); 0 where it names none."""
    if kind == "longrope":
        params = getattr(getattr(mod, "config", None), "rope_parameters", None) or {}
        if layer_type is not None:
            params = params.get(layer_type) or {}
        bound = params.get("original_max_position_embeddings") if isinstance(params, dict) else None
    else:
        bound = getattr(mod, "original_max_seq_len", None)
    return int(bound) if isinstance(bound, int) and not isinstance(bound, bool) else 0


def check_rope_context(model: Any, context: Any) -> None:
    """ConfigError where the model's rotary frequencies follow the forward's largest position (transformers' dynamic
    and longrope RoPE) and `context` lets a position pass the bound where they change: in hwkv's packed forward that
    position is the batch's longest request's, so a request's tokens would depend on the others. Within the bound
    every forward keeps the original frequencies, as transformers' own generate() does."""
    if not isinstance(context, int) or isinstance(context, bool):
        return   # (the pool planner refuses it, naming it)
    base = _base(model)
    for mod in _decoder_modules(base):
        kinds = getattr(mod, "rope_type", None)
        pairs = list(kinds.items()) if isinstance(kinds, dict) else [(None, kinds)]
        for layer_type, kind in pairs:
            if not isinstance(kind, str):
                continue
            for dependent in _POSITION_DEPENDENT_ROPE:
                if dependent in kind and context > _rope_bound(mod, dependent, layer_type):
                    raise ConfigError(
                        f"context={context} is past {_rope_bound(mod, dependent, layer_type)} positions, where "
                        f"{type(base).__name__}'s {kind!r} rotary embedding changes its frequencies with the "
                        "forward's largest position: in hwkv's packed forward that is the batch's longest request's, "
                        "so a request's tokens would depend on the others; give a context of at most that")


def model_positions(config: Any) -> Optional[int]:
    """The positions the model was built for (`max_position_embeddings`; None where the config names none): the
    runner's default context stops there."""
    value = getattr(text_config(config), "max_position_embeddings", None)
    return int(value) if value else None


def position_limit(model: Any) -> Optional[int]:
    """The context past which the model cannot run: its positions where it looks them up in a learned table (GPT-2's
    wpe, OPT's table of positions + 2 rows); None where positions are computed (rotary, ALiBi), which run past
    max_position_embeddings as transformers' own generate() does."""
    positions = model_positions(model.config)
    if positions is None:
        return None
    embed = model.get_input_embeddings()
    learned = any(isinstance(m, torch.nn.Embedding) and m is not embed
                  and positions <= m.num_embeddings <= positions + 2 for m in model.modules())
    return positions if learned else None


def layer_kinds(config: Any) -> Tuple[bool, ...]:
    """Per layer: is it sliding-window? From `layer_types`, else `use_sliding_window` / `sliding_window`
    (Mistral-style: a window and no layer types means every layer slides)."""
    cfg = text_config(config)
    n = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        types = list(types)
        unknown = sorted(set(types) - {SLIDING, FULL})
        if unknown:
            raise ConfigError(f"layer_types holds {unknown}; hwkv runs only {FULL!r} and {SLIDING!r} layers")
        if len(types) != n:
            raise ConfigError(f"layer_types has {len(types)} entries, num_hidden_layers is {n}")
        if SLIDING in types and not window:
            raise ConfigError(f"layer_types names sliding layers but sliding_window is {window!r}")
        return tuple(t == SLIDING for t in types)
    if getattr(cfg, "use_sliding_window", True) is False or not window:
        return (False,) * n
    return (True,) * n


# Models whose attention modules give SWA layers another geometry than the config's shared fields say, and
# how transformers' own module builds it (the config carries no field for it): model_type -> SWA KV heads
# as a multiple of num_key_value_heads.
SWA_KV_HEADS_MULTIPLE = {"mimo_v2_flash": 2}  # MiMoV2FlashAttention: "SWA layers double the kv heads"


def _positive(cfg: Any, name: str) -> Optional[int]:
    value = getattr(cfg, name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config {name}={value!r}: expected an integer >= 1")
    return value


def _by_kind(cfg: Any, name: str, kinds: Tuple[bool, ...]) -> Tuple[Optional[int], Optional[int]]:
    """(full layers', sliding layers') value of a config field, each an integer >= 1 or None (not set): the config's
    one value, or each kind's own where transformers keeps the field per layer (`per_layer_attributes`: Gemma 4's
    head_dim, 256 on its sliding layers and 512 on its full ones, which the config refuses to give as one value).
    ConfigError where layers of one kind differ: hwkv keeps one geometry a pool."""
    if name not in (getattr(cfg, "per_layer_attributes", None) or ()):
        value = _positive(cfg, name)
        return value, value
    layers = cfg.per_layer_config
    full_swa = []
    for swa in (False, True):
        values = {_positive(layers[i], name) for i, k in enumerate(kinds) if k == swa} - {None}
        if len(values) > 1:
            raise ConfigError(f"config {name} differs across the {'sliding' if swa else 'full'}-attention layers "
                              f"({sorted(values)}): hwkv keeps one {name} for each kind of layer")
        full_swa.append(next(iter(values), None))
    full, swa = full_swa
    return full or swa, swa or full


def model_shape(config: Any, dtype: torch.dtype, name: Optional[str] = None) -> ModelShape:
    """The attention geometry of a Hugging Face config as `hwkv plan`'s ModelShape (KV in `dtype`).

    Full layers: `num_key_value_heads`, `head_dim` (K) and `v_head_dim` (V, when the config has one, as
    MiMo-V2 does). SWA layers: `swa_num_key_value_heads` / `swa_head_dim` / `swa_v_head_dim` where the config
    names them, else the model type's rule (`SWA_KV_HEADS_MULTIPLE`), else the sliding layers' own values where the
    config keeps a field per layer (Gemma 4), else the full layers' values."""
    cfg = text_config(config)
    model_type = str(getattr(cfg, "model_type", "model"))
    kinds = layer_kinds(cfg)
    heads = _by_kind(cfg, "num_attention_heads", kinds)[0]  # (the full layers': Step 3.7 keeps them per layer;
    if heads is None:                                        # the pools hold KV heads, read per kind below)
        raise ConfigError("config num_attention_heads is not set")
    kv_heads, layer_swa_kv_heads = _by_kind(cfg, "num_key_value_heads", kinds)
    kv_heads = kv_heads or heads
    head_dim, layer_swa_head_dim = _by_kind(cfg, "head_dim", kinds)
    head_dim = head_dim or cfg.hidden_size // heads
    v_head_dim = _positive(cfg, "v_head_dim") or head_dim
    swa_kv_heads = _positive(cfg, "swa_num_key_value_heads") or (
        layer_swa_kv_heads if layer_swa_kv_heads not in (None, kv_heads) else None)
    multiple = SWA_KV_HEADS_MULTIPLE.get(model_type)
    if multiple is not None:
        if swa_kv_heads is not None and swa_kv_heads != multiple * kv_heads:
            raise ConfigError(f"{model_type}: swa_num_key_value_heads={swa_kv_heads}, but transformers' model builds "
                              f"its SWA layers with {multiple} x num_key_value_heads = {multiple * kv_heads}")
        swa_kv_heads = multiple * kv_heads
    swa_head_dim = _positive(cfg, "swa_head_dim") or layer_swa_head_dim or head_dim
    swa_v_head_dim = _positive(cfg, "swa_v_head_dim") or default_swa_v_head_dim(head_dim, v_head_dim, swa_head_dim)
    window = int(cfg.sliding_window) if any(kinds) else 0
    return ModelShape(name=name or model_type, layer_is_swa=kinds, window=window,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim,
                      swa_num_kv_heads=swa_kv_heads, swa_head_dim=swa_head_dim, swa_v_head_dim=swa_v_head_dim,
                      dtype_bytes=torch.empty(0, dtype=dtype, device="cpu").element_size(),
                      source="read from the Hugging Face config")
