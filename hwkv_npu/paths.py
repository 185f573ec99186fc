"""`hwkv info`'s table for the NPU: which path each layer kind takes (asks `fia.decide`, as the backend does).

Reads the installed torch_npu's op schemas when torch_npu is importable (no device work); one that is installed
but fails to import (whatever it raises) sends every layer to plain torch with that reason. Otherwise it
answers for a torch_npu with the fused op, v2's learnable_sink and the graph task-update API (v2's graph
entry points included), and says so in the table's assumptions. Eager and graph answers differ only where
the graph API (or v2's part of it, for sink layers) is missing.
"""
from __future__ import annotations

import importlib.util
from typing import List, Tuple

import torch

from hwkv.errors import ConfigError
from hwkv.paths import Geometry, LayerKind, LayerPath, PathTable, kind_features, layer_kinds
from hwkv_npu import fia, import_torch_npu


def _env() -> Tuple[fia.NPUEnv, List[str]]:
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            return fia.load_env(import_torch_npu()), []
        except ConfigError as e:  # installed but its import raised: every row says why
            return fia.NPUEnv(False, str(e)), []
    return (fia.NPUEnv(True, "", True, "", True, "", graph_sinks=True),
            ["torch_npu is not installed here: answering for a release with the fused op, v2 learnable_sink "
             "and the graph task-update API"])


def _facts(kind: LayerKind, g: Geometry, graph: bool) -> fia.LayerFacts:
    f = kind_features(kind, g)
    kv = torch.float8_e4m3fn if f["fp8"] else torch.bfloat16
    return fia.LayerFacts(kind.mode, kind.swa, bool(f["sinks"]), float(f["logit_cap"]), torch.bfloat16, kv,
                          g.head_dim, g.head_dim, g.num_heads, g.num_kv_heads, bool(f["fp8"]), g.page_size, graph)


def _path(kind: LayerKind, g: Geometry, env: fia.NPUEnv) -> LayerPath:
    eager, graph = fia.decide(_facts(kind, g, False), env), fia.decide(_facts(kind, g, True), env)
    if graph.path == eager.path:
        return eager
    return LayerPath(eager.path, eager.op, f"{eager.why}; in graph replays {graph.path}: {graph.why}")


def layer_paths(geometry: Geometry = Geometry()) -> PathTable:
    env, assumptions = _env()
    rows = tuple((k, _path(k, geometry, env)) for k in layer_kinds())
    return PathTable("npu", rows, tuple(assumptions), geometry.describe("float8_e4m3fn"))
