"""Attention geometry of real hybrid models (the one preset table) and the CLI flags that pick or build one.

Byte arithmetic is per token: a layer stores one K row (kv_heads x head_dim) and one V row
(kv_heads x v_head_dim) per token, `dtype_bytes` each element. This module itself does not import torch.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import Any, Dict, NamedTuple, Optional, Tuple

from hwkv import checks
from hwkv.errors import ConfigError
from hwkv.pool import default_swa_v_head_dim

KV_DTYPE_BYTES: Dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
SINKS_CHOICES = ("none", "all", "swa")


class LayerGeometry(NamedTuple):
    """What one layer needs: heads, KV heads, K and V head dims, window (None = full), sinks."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    window: Optional[int]
    sinks: bool


@dataclass(frozen=True)
class ModelShape:
    """Attention geometry of one model; `swa_*` fields left None take the full layers' values (`swa_v_head_dim`:
    `hwkv.pool.default_swa_v_head_dim`, the full layers' V head dim unless the SWA K head dim differs)."""

    name: str
    layer_is_swa: Tuple[bool, ...]
    window: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: Optional[int] = None
    swa_num_heads: Optional[int] = None
    swa_num_kv_heads: Optional[int] = None
    swa_head_dim: Optional[int] = None
    swa_v_head_dim: Optional[int] = None
    logit_cap: float = 0.0
    sinks: bool = False                 # full-attention layers carry per-head sink logits
    swa_sinks: Optional[bool] = None    # SWA layers do (None: same as `sinks`)
    scaling: Optional[float] = None     # softmax scale (None: head_dim ** -0.5)
    dtype_bytes: int = 2                # KV cache element size (bf16)
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        s = object.__setattr__
        flags = checks.items_of(self.layer_is_swa)   # (text is none: "ff" would be two truthy characters)
        if flags is None or not all(checks.is_bool(x) and getattr(x, "ndim", 0) == 0 for x in flags):
            raise ConfigError(f"{self.name}: layer_is_swa must hold one bool a layer (True: sliding window; e.g. "
                              f"layer_pattern(4, 'sf')), got {self.layer_is_swa!r}")
        checks.check_flag(f"{self.name}: sinks", self.sinks)
        checks.check_flag(f"{self.name}: swa_sinks", self.swa_sinks, none=True)
        s(self, "layer_is_swa", tuple(bool(x) for x in flags))
        s(self, "v_head_dim", self.head_dim if self.v_head_dim is None else self.v_head_dim)
        s(self, "swa_num_heads", self.num_heads if self.swa_num_heads is None else self.swa_num_heads)
        s(self, "swa_num_kv_heads", self.num_kv_heads if self.swa_num_kv_heads is None else self.swa_num_kv_heads)
        s(self, "swa_head_dim", self.head_dim if self.swa_head_dim is None else self.swa_head_dim)
        if self.swa_v_head_dim is None:
            s(self, "swa_v_head_dim", default_swa_v_head_dim(self.head_dim, self.v_head_dim, self.swa_head_dim))
        s(self, "swa_sinks", self.sinks if self.swa_sinks is None else self.swa_sinks)
        self._validate()

    def _validate(self) -> None:
        if not self.layer_is_swa:
            raise ConfigError(f"{self.name}: the model needs at least one layer, got layer_is_swa=()")
        positive = ("num_heads", "num_kv_heads", "head_dim", "v_head_dim", "swa_num_heads",
                    "swa_num_kv_heads", "swa_head_dim", "swa_v_head_dim", "dtype_bytes")
        for name in positive + (("window",) if self.swa_layer_ids else ()):
            value = getattr(self, name)
            if not checks.is_int(value) or value < 1:
                raise ConfigError(f"{self.name}: {name} must be an integer >= 1, got {value!r}")
        for q, kv in (("num_heads", "num_kv_heads"), ("swa_num_heads", "swa_num_kv_heads")):
            if getattr(self, q) % getattr(self, kv):
                raise ConfigError(f"{self.name}: {q}={getattr(self, q)} is not a multiple of "
                                  f"{kv}={getattr(self, kv)} (GQA groups must be whole)")
        cap = self.logit_cap
        if not checks.logit_cap_ok(cap):  # (the layers' rule, checked here before any layer is built)
            raise ConfigError(f"{self.name}: logit_cap must be a finite number >= 0 (0 = off), got {cap!r}; "
                              f"{checks.LOGIT_CAP_LIMITS}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_is_swa)

    @property
    def swa_layer_ids(self) -> Tuple[int, ...]:
        return tuple(i for i, swa in enumerate(self.layer_is_swa) if swa)

    @property
    def full_layer_ids(self) -> Tuple[int, ...]:
        return tuple(i for i, swa in enumerate(self.layer_is_swa) if not swa)

    @property
    def bytes_per_token_full_layer(self) -> int:
        """K+V bytes of one token in one full-attention layer."""
        return self.num_kv_heads * (self.head_dim + self.v_head_dim) * self.dtype_bytes

    @property
    def bytes_per_token_swa_layer(self) -> int:
        """K+V bytes of one token in one SWA layer."""
        return self.swa_num_kv_heads * (self.swa_head_dim + self.swa_v_head_dim) * self.dtype_bytes

    @property
    def bytes_per_token_full_group(self) -> int:
        """K+V bytes of one token over all full-attention layers (one slot of the full pool)."""
        return len(self.full_layer_ids) * self.bytes_per_token_full_layer

    @property
    def bytes_per_token_swa_group(self) -> int:
        """K+V bytes of one token over all SWA layers (one slot of the SWA pool)."""
        return len(self.swa_layer_ids) * self.bytes_per_token_swa_layer

    @property
    def bytes_per_token_all_full(self) -> int:
        """One token when every layer, SWA ones included, keeps it in one pool at its own geometry."""
        return self.bytes_per_token_full_group + self.bytes_per_token_swa_group

    def saving_limit(self, context: int) -> float:
        """Ideal all-full / hybrid KV bytes for one request of `context` tokens.

        = all_full * context / (full_group * context + swa_group * min(W, context)): the hybrid
        cache keeps every token for full layers and only the last W tokens for SWA layers. No
        paging, release margin, prefill chunk or padding slot is counted, so real plans land
        slightly below it.
        """
        checks.check_int_option("context", context, 1)
        hybrid = self.bytes_per_token_full_group * context
        if self.swa_layer_ids:   # (a shape of full layers only may have no window: nothing to add)
            hybrid += self.bytes_per_token_swa_group * min(self.window, context)
        return self.bytes_per_token_all_full * context / hybrid

    def layer(self, layer_id: int) -> LayerGeometry:
        """Geometry of global layer `layer_id`."""
        lid = checks.as_int(layer_id)
        if lid is None or not 0 <= lid < self.num_layers:
            raise ConfigError(f"{self.name}: layer_id {layer_id!r} outside [0, {self.num_layers})")
        layer_id = lid
        if self.layer_is_swa[layer_id]:
            return LayerGeometry(self.swa_num_heads, self.swa_num_kv_heads, self.swa_head_dim,
                                 self.swa_v_head_dim, self.window, self.swa_sinks)
        return LayerGeometry(self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim,
                             None, self.sinks)

    def pool_kwargs(self) -> Dict[str, object]:
        """Keyword arguments of `hwkv.pool.SWAKVPool` that come from the model (sizes, dtype, device aside)."""
        return dict(head_num=self.num_kv_heads, head_dim=self.head_dim, v_head_dim=self.v_head_dim,
                    swa_attention_layer_ids=list(self.swa_layer_ids),
                    full_attention_layer_ids=list(self.full_layer_ids),
                    swa_head_num=self.swa_num_kv_heads, swa_head_dim=self.swa_head_dim,
                    swa_v_head_dim=self.swa_v_head_dim)

    def summary(self) -> str:
        """One line: layer split, window, per-group heads and dims."""
        full = f"{len(self.full_layer_ids)} full ({self.num_heads}/{self.num_kv_heads} heads, " \
               f"dim {self.head_dim}/{self.v_head_dim})"
        swa = f"{len(self.swa_layer_ids)} SWA W={self.window} ({self.swa_num_heads}/{self.swa_num_kv_heads} " \
              f"heads, dim {self.swa_head_dim}/{self.swa_v_head_dim})"
        return f"{self.num_layers} layers: {full} + {swa}"


MAX_LAYERS = 4096  # far above any published model's (MiMo-V2 48, Gemma 3 62): a larger count is a typo


def layer_pattern(num_layers: int, pattern: Optional[str] = None,
                  full_every: Optional[int] = None) -> Tuple[bool, ...]:
    """Per-layer is-SWA flags from a tiled 's'/'f' string or 'layer i is full iff (i+1) % K == 0'.

    Neither given: alternating, sliding first ("sf"). Both given: ConfigError.
    """
    layers, every = checks.as_int(num_layers), checks.as_int(full_every)   # numpy integers taken; bools, floats not
    if layers is None:
        raise ConfigError(f"layers must be an integer >= 1, got {num_layers!r}")
    if full_every is not None and every is None:
        raise ConfigError(f"--full-every must be an integer >= 1, got {full_every!r}")
    num_layers, full_every = layers, every
    if num_layers < 1:
        raise ConfigError(f"layers must be >= 1, got {num_layers}")
    if num_layers > MAX_LAYERS:  # (one flag a layer is built below: 10**11 of them would fill the host's memory)
        raise ConfigError(f"layers must be <= {MAX_LAYERS}, got {num_layers}")
    if pattern is not None and full_every is not None:
        raise ConfigError(f"give --pattern ({pattern!r}) or --full-every ({full_every}), not both")
    if full_every is not None:
        if full_every < 1:
            raise ConfigError(f"--full-every must be >= 1, got {full_every}")
        return tuple((i + 1) % full_every != 0 for i in range(num_layers))
    pattern = "sf" if pattern is None else pattern.strip().lower()
    if not pattern or set(pattern) - {"s", "f"}:
        raise ConfigError(f"--pattern must be a non-empty string of 's' (sliding) and 'f' (full), got {pattern!r}")
    if len(pattern) > num_layers:
        raise ConfigError(f"--pattern has {len(pattern)} entries but the model has {num_layers} layers")
    return tuple(pattern[i % len(pattern)] == "s" for i in range(num_layers))


# --- The one preset table ----------------------------------------------------------------------
# Every number is the published Hugging Face config.json value. layer_types / is_sliding decide the
# pattern; where the config lists the pattern implicitly, the rule used by transformers is noted.

PRESETS: Dict[str, ModelShape] = {s.name: s for s in (
    ModelShape(
        name="gpt-oss-20b", layer_is_swa=layer_pattern(24, "sf"), window=128,
        num_heads=64, num_kv_heads=8, head_dim=64, sinks=True,
        source="openai/gpt-oss-20b config.json: num_hidden_layers 24, layer_types alternate "
               "sliding_attention/full_attention starting with sliding, sliding_window 128, "
               "num_attention_heads 64, num_key_value_heads 8, head_dim 64; every layer has "
               "learned attention sinks (GptOssAttention.sinks)."),
    ModelShape(
        name="gpt-oss-120b", layer_is_swa=layer_pattern(36, "sf"), window=128,
        num_heads=64, num_kv_heads=8, head_dim=64, sinks=True,
        source="openai/gpt-oss-120b config.json: as gpt-oss-20b but num_hidden_layers 36 "
               "(18 sliding + 18 full, sliding first), sliding_window 128, 64/8 heads, head_dim 64, sinks."),
    ModelShape(
        name="gemma-2-27b", layer_is_swa=layer_pattern(46, "sf"), window=4096,
        num_heads=32, num_kv_heads=16, head_dim=128, logit_cap=50.0, scaling=144 ** -0.5,
        source="google/gemma-2-27b config.json: num_hidden_layers 46, num_attention_heads 32, "
               "num_key_value_heads 16, head_dim 128, sliding_window 4096, attn_logit_softcapping 50.0, "
               "query_pre_attn_scalar 144; sliding on even layers "
               "(transformers Gemma2DecoderLayer.is_sliding = not bool(layer_idx % 2))."),
    ModelShape(
        name="gemma-3-27b", layer_is_swa=layer_pattern(62, full_every=6), window=1024,
        num_heads=32, num_kv_heads=16, head_dim=128, scaling=168 ** -0.5,
        source="google/gemma-3-27b-it config.json text_config: num_hidden_layers 62, num_attention_heads 32, "
               "num_key_value_heads 16, head_dim 128, sliding_window 1024, sliding_window_pattern 6 "
               "(layer i full iff (i+1) % 6 == 0: layers 5, 11, ..., 59 = 10 full, 52 sliding), "
               "attn_logit_softcapping null, query_pre_attn_scalar 168."),
    ModelShape(
        name="mimo-v2-flash", layer_is_swa=layer_pattern(48, "fssss" + "fsssss" * 7 + "f"), window=128,
        num_heads=64, num_kv_heads=4, head_dim=192, v_head_dim=128,
        swa_num_heads=64, swa_num_kv_heads=8, swa_head_dim=192, swa_v_head_dim=128,
        sinks=False, swa_sinks=True,
        source="XiaomiMiMo/MiMo-V2-Flash config.json: num_hidden_layers 48, hybrid_layer_pattern "
               "(0 = full) full at layers 0, 5, 11, ..., 41, 47 = 9 full + 39 SWA, sliding_window 128; "
               "full: 64 heads, 4 KV heads, head_dim 192, v_head_dim 128; SWA: 64 heads, 8 KV heads, "
               "swa_head_dim 192, swa_v_head_dim 128; add_swa_attention_sink_bias true, "
               "add_full_attention_sink_bias false. The model card's '8 blocks of 5 SWA + 1 GA' "
               "disagrees with the config's pattern (layer 0 is full); the config is used."),
)}


def get_preset(name: str) -> ModelShape:
    """The preset called `name`; ConfigError lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; presets: {', '.join(sorted(PRESETS))}") from None


def custom_shape(*, layers: int, window: int, heads: int, kv_heads: int, head_dim: int,
                 pattern: Optional[str] = None, full_every: Optional[int] = None,
                 v_head_dim: Optional[int] = None, swa_heads: Optional[int] = None,
                 swa_kv_heads: Optional[int] = None, swa_head_dim: Optional[int] = None,
                 swa_v_head_dim: Optional[int] = None, logit_cap: float = 0.0, sinks: str = "none",
                 dtype_bytes: int = 2, name: str = "custom") -> ModelShape:
    """A ModelShape from CLI-style values; `sinks` is 'none', 'all' or 'swa'."""
    if sinks not in SINKS_CHOICES:
        raise ConfigError(f"sinks must be one of {SINKS_CHOICES}, got {sinks!r}")
    return ModelShape(
        name=name, layer_is_swa=layer_pattern(layers, pattern, full_every), window=window,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim,
        swa_num_heads=swa_heads, swa_num_kv_heads=swa_kv_heads, swa_head_dim=swa_head_dim,
        swa_v_head_dim=swa_v_head_dim, logit_cap=logit_cap, sinks=sinks == "all",
        swa_sinks=sinks in ("all", "swa"), dtype_bytes=dtype_bytes, source="custom shape from CLI flags")


# --- Shared CLI flags (`hwkv plan`, `hwkv bench`) -----------------------------------------------
_GEOMETRY_FLAGS = {  # argparse dest -> ModelShape field
    "window": "window", "heads": "num_heads", "kv_heads": "num_kv_heads", "head_dim": "head_dim",
    "v_head_dim": "v_head_dim", "swa_heads": "swa_num_heads", "swa_kv_heads": "swa_num_kv_heads",
    "swa_head_dim": "swa_head_dim", "swa_v_head_dim": "swa_v_head_dim", "logit_cap": "logit_cap",
}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --model and the custom-shape flags; with --model, any flag given overrides the preset."""
    g = parser.add_argument_group("model", "a preset (--model) and/or a custom shape; flags override the preset")
    g.add_argument("--model", choices=sorted(PRESETS), help="preset geometry")
    g.add_argument("--layers", type=int, help="number of layers (custom shape)")
    g.add_argument("--pattern", help="layer kinds as a tiled string of 's'/'f', e.g. 'sf' "
                   "(alternating, sliding first) or 'sssssf' (5 sliding : 1 full); default 'sf'")
    g.add_argument("--full-every", type=int, metavar="K", help="layer i is full iff (i+1) %% K == 0")
    g.add_argument("--window", type=int, help="sliding window W (HF sliding_window)")
    g.add_argument("--heads", type=int, help="query heads")
    g.add_argument("--kv-heads", type=int, help="KV heads of full layers")
    g.add_argument("--head-dim", type=int, help="K head dim of full layers")
    g.add_argument("--v-head-dim", type=int, help="V head dim of full layers (default: --head-dim)")
    g.add_argument("--swa-heads", type=int, help="query heads of SWA layers (default: --heads)")
    g.add_argument("--swa-kv-heads", type=int, help="KV heads of SWA layers (default: --kv-heads)")
    g.add_argument("--swa-head-dim", type=int, help="K head dim of SWA layers (default: --head-dim)")
    g.add_argument("--swa-v-head-dim", type=int, help="V head dim of SWA layers (default: --v-head-dim where "
                   "the SWA layers keep --head-dim, else --swa-head-dim)")
    g.add_argument("--logit-cap", type=float, help="attention logit soft-cap (0 = off)")
    g.add_argument("--sinks", choices=SINKS_CHOICES, help="which layers carry attention sinks")
    g.add_argument("--kv-dtype", choices=sorted(KV_DTYPE_BYTES),
                   help="KV cache dtype (default bf16; `hwkv bench` runs fp32 on the CPU unless this or --dtype is "
                        "given)")


def shape_from_args(args: argparse.Namespace) -> ModelShape:
    """The ModelShape named by --model (with overrides) or built from the custom-shape flags."""
    def get(name: str) -> Any:
        return getattr(args, name, None)

    dtype_bytes = KV_DTYPE_BYTES[get("kv_dtype")] if get("kv_dtype") else None
    if get("model") is None:
        missing = [f"--{n.replace('_', '-')}" for n in ("layers", "window", "heads", "kv_heads", "head_dim")
                   if get(n) is None]
        if missing:
            raise ConfigError(f"give --model ({', '.join(sorted(PRESETS))}) or a custom shape; "
                              f"missing {' '.join(missing)}")
        values = {flag: get(flag) for flag in _GEOMETRY_FLAGS if get(flag) is not None}
        return custom_shape(layers=get("layers"), pattern=get("pattern"), full_every=get("full_every"),
                            sinks=get("sinks") or "none", dtype_bytes=dtype_bytes or 2, **values)
    shape = get_preset(get("model"))
    overrides = {fld: get(flag) for flag, fld in _GEOMETRY_FLAGS.items() if get(flag) is not None}
    if get("layers") is not None or get("pattern") is not None or get("full_every") is not None:
        if get("pattern") is None and get("full_every") is None:
            raise ConfigError(f"--layers {get('layers')} with --model {shape.name} needs --pattern or --full-every")
        layers = shape.num_layers if get("layers") is None else get("layers")  # a given 0 is refused, not replaced
        overrides["layer_is_swa"] = layer_pattern(layers, get("pattern"), get("full_every"))
    if get("sinks") is not None:
        overrides.update(sinks=get("sinks") == "all", swa_sinks=get("sinks") in ("all", "swa"))
    if dtype_bytes is not None:
        overrides["dtype_bytes"] = dtype_bytes
    if not overrides:
        return shape
    fields = {**_derived_as_unset(shape), **overrides}
    return replace(shape, **fields, source=shape.source + " (overridden from the command line)")


_DERIVED = (("v_head_dim", "head_dim"), ("swa_num_heads", "num_heads"), ("swa_num_kv_heads", "num_kv_heads"),
            ("swa_head_dim", "head_dim"), ("swa_sinks", "sinks"))


def _derived_as_unset(shape: ModelShape) -> Dict[str, None]:
    """The fields that merely copy their default source, as None, so they follow an overridden source."""
    unset = {d: None for d, src in _DERIVED if getattr(shape, d) == getattr(shape, src)}
    if shape.swa_v_head_dim == default_swa_v_head_dim(shape.head_dim, shape.v_head_dim, shape.swa_head_dim):
        unset["swa_v_head_dim"] = None
    return unset
