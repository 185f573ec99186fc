"""Which attention path each kind of layer takes on a device: data a device plugin reports.

A layer kind is full or SWA, decode or extend, and one feature (none, sinks, soft-cap, fp8 KV).
A device plugin answers every kind with a `LayerPath` (the path and why) through the function its
`DeviceSpec.layer_paths` names; its backend takes the same decisions per layer at run time from the
same function, so `hwkv info` and the backend cannot disagree. `hwkv info` prints the table.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch

FEATURES = ("plain", "sinks", "soft-cap", "fp8")
MODES = ("decode", "extend")

# the paths, as `hwkv info` names them
FUSED = "fused vendor op"
TRITON = "Triton"
TORCH = "plain torch"


@dataclass(frozen=True)
class LayerKind:
    """One kind of attention layer: SWA or full, decode or extend, and one feature."""

    swa: bool
    mode: str      # "decode" | "extend"
    feature: str   # "plain" | "sinks" | "soft-cap" | "fp8"

    @property
    def label(self) -> str:
        return f"{'SWA' if self.swa else 'full'} {self.mode} {self.feature}"


@dataclass(frozen=True)
class LayerFacts:
    """What a vendor's path rules read of one layer in one forward: mode, features, dtypes, head geometry
    (the same facts for every device, so ROCm, NPU and `hwkv info` decide from one description)."""

    mode: str                  # "decode" | "extend"
    swa: bool
    sinks: bool
    logit_cap: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    head_dim: int
    v_head_dim: int
    num_heads: int
    num_kv_heads: int
    scaled: bool               # a K/V scale other than 1
    page_size: int = 1
    graph: bool = False
    list_trimmed: bool = True  # the index list holds only the layer's window (decode reads every listed key)


def layer_facts(mode: str, q: torch.Tensor, layer: Any, kv: Any, k_buf: torch.Tensor, v_buf: torch.Tensor,
                page_size: int = 1, graph: bool = False) -> LayerFacts:
    """A layer's facts from the tensors of this forward (`kv`: the index list it reads)."""
    return LayerFacts(mode, layer.window is not None, layer.sinks is not None, float(layer.logit_cap or 0.0),
                      q.dtype, k_buf.dtype, q.shape[2], v_buf.shape[2], q.shape[1], k_buf.shape[1],
                      layer.k_scale not in (None, 1.0) or layer.v_scale not in (None, 1.0), page_size, graph,
                      layer.window is None or kv.window == layer.window)


@dataclass(frozen=True)
class LayerPath:
    """The path a layer kind takes: `path` is FUSED, TRITON or TORCH; `op` names the kernel; `why` the reason."""

    path: str
    op: str
    why: str


@dataclass(frozen=True)
class PathTable:
    """A device's answer for every layer kind; `assumptions` says what the answer presumes (e.g. the
    vendor library installed, when it is not installed here) and `geometry` the layer it was asked for."""

    device: str
    rows: Tuple[Tuple[LayerKind, LayerPath], ...]
    assumptions: Tuple[str, ...] = ()
    geometry: str = ""

    def as_dict(self) -> Dict[str, object]:
        return {"device": self.device, "geometry": self.geometry, "assumptions": list(self.assumptions),
                "rows": [{"layer": "SWA" if k.swa else "full", "mode": k.mode, "feature": k.feature,
                          "path": p.path, "op": p.op, "why": p.why} for k, p in self.rows]}


def layer_kinds() -> List[LayerKind]:
    """Every kind, full before SWA, decode before extend, features in FEATURES order."""
    return [LayerKind(swa, mode, feature)
            for swa, mode, feature in itertools.product((False, True), MODES, FEATURES)]


@dataclass(frozen=True)
class Geometry:
    """The layer `hwkv info` asks each device about (a common serving shape; bf16 pools, fp8 for the fp8 kind)."""

    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 128
    logit_cap: float = 30.0
    kv_scale: float = 0.5

    def describe(self, fp8: str) -> str:
        return (f"H={self.num_heads} KVH={self.num_kv_heads} D={self.head_dim} page {self.page_size}, bf16 "
                f"(fp8 kind: {fp8} pool, K/V scale {self.kv_scale})")


def kind_features(kind: LayerKind, geometry: Geometry) -> Dict[str, object]:
    """The per-kind inputs of a device's decision: sinks, soft-cap, and whether the pool is fp8 and scaled."""
    return {"sinks": kind.feature == "sinks", "logit_cap": geometry.logit_cap if kind.feature == "soft-cap" else 0.0,
            "fp8": kind.feature == "fp8"}
