"""`hwkv info`'s table for ROCm: which path each layer kind takes (asks `aiter_ops.decide`, as the backend does).

Cheap: no AITER import and no device context beyond the GPU's name. Off a ROCm machine (or without
AITER) it answers for an MI300 (gfx942) with AITER installed, and says so in the table's assumptions;
AITER's signatures are checked when the backend is built, not here.
"""
from __future__ import annotations

import importlib.util
from typing import List, Tuple

import torch

from hwkv.paths import Geometry, LayerKind, LayerPath, PathTable, kind_features, layer_kinds
from hwkv_rocm import aiter_ops


def _env() -> Tuple[aiter_ops.AiterEnv, List[str]]:
    assumptions: List[str] = []
    arch = "gfx942"
    if torch.version.hip and torch.cuda.is_available():
        arch = aiter_ops.gpu_arch(torch.device("cuda", 0))
    else:
        assumptions.append("no ROCm GPU here: answering for gfx942 (MI300)")
    supported = any(a in arch for a in aiter_ops.SUPPORTED_ARCH)
    installed = importlib.util.find_spec("aiter") is not None
    if not installed:
        assumptions.append("aiter is not installed here: answering as if it were, with the verified signatures")
    why = "" if supported else f"GPU architecture {arch} is not one of {list(aiter_ops.SUPPORTED_ARCH)}"
    return aiter_ops.AiterEnv(arch, supported, supported, why, why), assumptions


def _facts(kind: LayerKind, g: Geometry, env: aiter_ops.AiterEnv) -> aiter_ops.LayerFacts:
    f = kind_features(kind, g)
    kv = (env.fp8 or torch.float8_e4m3fn) if f["fp8"] else torch.bfloat16
    return aiter_ops.LayerFacts(kind.mode, kind.swa, bool(f["sinks"]), float(f["logit_cap"]), torch.bfloat16, kv,
                                g.head_dim, g.head_dim, g.num_heads, g.num_kv_heads, bool(f["fp8"]))


def layer_paths(geometry: Geometry = Geometry()) -> PathTable:
    env, assumptions = _env()
    rows: List[Tuple[LayerKind, LayerPath]] = [(k, aiter_ops.decide(_facts(k, geometry, env), env))
                                               for k in layer_kinds()]
    fp8 = str(env.fp8 or torch.float8_e4m3fn).replace("torch.", "")
    return PathTable("rocm", tuple(rows), tuple(assumptions), geometry.describe(fp8) + f", {env.arch}")
