"""`hwkv info`'s table for ROCm: which path each layer kind takes (asks `aiter_ops.decide`, as the backend does).

The installed AITER is read through `aiter_ops.load_aiter`, the backend's own loader (its signature checks), so an
AITER of another release, or one that does not import, shows the Triton rows the backend would run; no device context
beyond the GPU's name. Off a ROCm machine it answers for an MI300 (gfx942), and without AITER for one with the verified
signatures; the table's assumptions say so.
"""
from __future__ import annotations

import importlib.util
from typing import List, Tuple

import torch

from hwkv.errors import ConfigError
from hwkv.paths import Geometry, LayerKind, LayerPath, PathTable, kind_features, layer_kinds
from hwkv_rocm import aiter_ops


def _env() -> Tuple[aiter_ops.AiterEnv, List[str]]:
    assumptions: List[str] = []
    arch = "gfx942"
    if torch.version.hip and torch.cuda.is_available():
        arch = aiter_ops.gpu_arch(torch.device("cuda", 0))
    else:
        assumptions.append("no ROCm GPU here: answering for gfx942 (MI300)")
    if not any(a in arch for a in aiter_ops.SUPPORTED_ARCH):  # the backend's order: the GPU first, then AITER
        why = f"GPU architecture {arch} is not one of {list(aiter_ops.SUPPORTED_ARCH)}"
        return aiter_ops.AiterEnv(arch, False, False, why, why), assumptions
    if importlib.util.find_spec("aiter") is None:
        assumptions.append("aiter is not installed here: answering as if it were, with the verified signatures")
        env = aiter_ops.AiterEnv(arch, True, True)
    else:
        try:
            env = aiter_ops.load_aiter().env(arch)
        except ConfigError as e:
            assumptions.append(f"the ROCm backend refuses to build here unless aiter=False ({e}): answering for "
                               "aiter=False")
            why = "aiter=False: the installed aiter does not import"
            return aiter_ops.AiterEnv(arch, False, False, why, why), assumptions
    if env.decode:
        assumptions.append(f"max_context_len <= {aiter_ops.MAX_CONTEXT}: a backend built for longer contexts "
                           "decodes on Triton")
    return env, assumptions


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
