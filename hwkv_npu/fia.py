"""torch_npu's fused infer attention for the NPU backend: which layers it computes (`decide`), the plans
it reads (page tables and host lengths, once per forward), and its eager and graph calls.

Verified in Ascend/op-plugin (the stand-ins in hwkv.testing.vendor_schemas.npu carry the same schemas):
- docs/context/torch_npu-npu_fused_infer_attention_score.md: page attention takes `block_table` int32
  [B, >= max blocks], `block_size`, host `actual_seq_lengths_kv` and caches [blocks, block_size, KVH*D]
  for BSH/BSND; fp16/bf16 query, key/value of one shape (so D == Dv) in the query's dtype (int8 only with
  antiquant scales: no fp8 KV); no soft-cap argument; num_heads/num_key_value_heads <= 64, N <= 256,
  D <= 512 and a multiple of 16, KV_N * D <= 65535. With Q_S == 1 the op ignores pre_tokens,
  next_tokens and sparse_mode and takes no 2048 x 2048 mask: decode windows are trimmed by the index list
  plus a bool mask [B, 1, 1, KV_S] (True = masked) over the keys before the window on its first page, and
  so are extend-like forwards whose requests have one new token each (decode=True). With Q_S > 1,
  page attention needs block_size a multiple of 128 in [128, 512]; sparse_mode 3 is causal and 4 a band
  between pre_tokens and next_tokens, both measured from the bottom-right corner (docs
  "sparse_mode参数说明"), with the compressed 2048 x 2048 lower-triangular mask: SWA prefill is
  sparse_mode 4 with pre_tokens = W - 1 (`hwkv.window.window_left`), next_tokens = 0.
- docs/context/torch_npu-npu_fused_infer_attention_score_v2.md and op-plugin's v2 kernel source
  (`npu_fused_infer_attention_score_v2_symint` and its `_out_symint`, which take `learnable_sink` and
  hand it to aclnnFusedInferAttentionScoreV4; the `.out` form takes `workspace`): one logit per
  query head in the softmax denominator (torch_npu's v2 test computes it so): sink layers take v2 when
  the installed release has it (vllm-ascend passes the model's sinks there the same way).
  hicann/ops-transformer attention/fused_infer_attention_score/docs/aclnnFusedInferAttentionScoreV4.md,
  row learnableSinkOptional: BFLOAT16/FLOAT16, ND, shape (Q_N), V_D 128 or 64 only. So sink layers of
  another Dv run the torch path (`decide`), and the op gets the sinks cast to the query's dtype from a
  copy kept per layer (`KeptSinks`: a captured call keeps its address), never the layer's own tensor
  (often fp32).
- graphs (docs/context/torch_npu-npu-graph_task_group_begin.md, ..._update_begin.md): inside capture an
  ExternalEvent is waited and reset, the `.out` overload runs between graph_task_group_begin/end with a
  workspace from `_npu_fused_infer_attention_score_get_max_workspace` (same arguments), and before
  every replay graph_task_update_begin/end re-issues it on another stream with the new host lengths,
  then records the event (hwkv_npu.graph does that from the adapter's pre_replay hook). Sink layers
  need v2's own `.out` and `_npu_fused_infer_attention_score_v2_get_max_workspace` (op-plugin
  FusedInferAttentionScoreV2KernelNpuOpApi.cpp defines them apart from the functional v2): where a
  release lacks either, sink layers in graphs run the torch path (`NPUEnv.graph_sinks`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from hwkv.paths import FUSED, TORCH, LayerFacts, LayerPath, layer_facts
from hwkv.window import window_left

FIA_DTYPES = (torch.float16, torch.bfloat16)
FIA_MASK_SIZE = 2048  # sparse_mode 2/3/4 take a compressed 2048 x 2048 causal mask
INT_MAX = 2147483647
V1, V2 = "npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2"
V1_ARGS = ("block_table", "block_size", "actual_seq_lengths", "actual_seq_lengths_kv", "num_heads",
           "num_key_value_heads", "input_layout", "atten_mask", "sparse_mode", "pre_tokens", "next_tokens")
V2_ARGS = ("block_table", "block_size", "actual_seq_qlen", "actual_seq_kvlen", "num_query_heads",
           "num_key_value_heads", "input_layout", "atten_mask", "sparse_mode", "pre_tokens", "next_tokens",
           "softmax_scale", "learnable_sink")
SINK_DV = (64, 128)  # learnable_sink: V_D 128/64 only (aclnnFusedInferAttentionScoreV4.md)
V1_TO_V2 = {"num_heads": "num_query_heads", "actual_seq_lengths": "actual_seq_qlen",
            "actual_seq_lengths_kv": "actual_seq_kvlen"}
GRAPH_API = ("graph_task_group_begin", "graph_task_group_end", "graph_task_update_begin", "graph_task_update_end",
             "ExternalEvent")


def _names(op: Any) -> Tuple[str, ...]:
    """Argument names of a torch op overload or packet (its schema), () when absent."""
    schema = getattr(op, "_schema", None) or getattr(getattr(op, "default", None), "_schema", None)
    return tuple(a.name for a in schema.arguments) if schema is not None else ()


@dataclass(frozen=True)
class NPUEnv:
    """What the installed torch_npu offers hwkv: the fused op, v2 with sinks, the graph update API, and
    v2's graph entry points (`.out`, its workspace query) for sink layers in graphs."""

    fused: bool
    fused_why: str = ""
    sinks: bool = False
    sinks_why: str = ""
    graph: bool = False
    graph_why: str = ""
    scale_kw: str = "scale"
    graph_sinks: bool = False
    graph_sinks_why: str = ""


def load_env(mod: Any) -> NPUEnv:
    """Read the ops' schemas of an imported torch_npu (no device work)."""
    v1 = getattr(mod, V1, None)
    names = _names(v1)
    if not names:
        return NPUEnv(False, f"torch_npu has no {V1}")
    missing = [n for n in V1_ARGS if n not in names]
    scale_kw = "scale" if "scale" in names else "scale_value"  # older releases name it scale_value
    if missing or scale_kw not in names:
        return NPUEnv(False, f"{V1} lacks {missing or ['scale']}")
    v2 = getattr(mod, V2, None)
    v2_names = _names(v2)
    v2_missing = [n for n in V2_ARGS if n not in v2_names]
    sinks_why = "" if not v2_missing else (f"{V2} lacks {v2_missing}" if v2_names else f"torch_npu has no {V2}")
    rt = getattr(torch, "npu", None)
    gaps = [n for n in GRAPH_API if not hasattr(rt, n)] + _graph_entry_gaps(v1, mod, V1)
    graph_why = f"torch_npu lacks the graph task-update API ({', '.join(gaps)})" if gaps else ""
    sink_gaps = _graph_entry_gaps(v2, mod, V2, "learnable_sink")
    graph_sinks_why = f"torch_npu lacks v2's graph entry points ({', '.join(sink_gaps)})" if sink_gaps else ""
    return NPUEnv(True, "", not v2_missing, sinks_why, not gaps, graph_why, scale_kw,
                  graph_sinks=not (gaps or v2_missing or sink_gaps), graph_sinks_why=graph_sinks_why)


def _graph_entry_gaps(op: Any, mod: Any, name: str, needs: Optional[str] = None) -> List[str]:
    """The graph entry points of op `name` that torch_npu lacks: its `.out` overload and `_<name>_get_max_workspace`
    (where either declares a schema, it must take the argument `needs` too)."""
    gaps = []
    for label, entry in ((f"{name}.out", getattr(op, "out", None)),
                         (f"_{name}_get_max_workspace", getattr(mod, f"_{name}_get_max_workspace", None))):
        if entry is None:
            gaps.append(label)
        elif needs is not None and _names(entry) and needs not in _names(entry):
            gaps.append(f"{label} without {needs}")
    return gaps


def page_size_reason(mode: str, p: int) -> Optional[str]:
    if mode == "decode" and p % 16:
        return f"page size {p} (Q_S = 1 page attention: a multiple of 16)"
    if mode == "extend" and (p % 128 or not 128 <= p <= 512):
        return f"page size {p} (Q_S > 1 page attention: a multiple of 128 in [128, 512])"
    return None


@functools.lru_cache(maxsize=None)
def decide(f: LayerFacts, env: NPUEnv) -> LayerPath:
    """The path one layer takes on the NPU (the backend per layer and `hwkv info` ask this, nothing else)."""
    if not env.fused:
        return LayerPath(TORCH, "torch", env.fused_why)
    if f.graph and not env.graph:
        return LayerPath(TORCH, "torch", f"graph replay: {env.graph_why}")
    if f.logit_cap:
        return LayerPath(TORCH, "torch", "soft-cap: the fused op (v1 and v2) has no soft-cap argument")
    if f.kv_dtype != f.q_dtype or f.scaled:
        return LayerPath(TORCH, "torch", f"KV {f.kv_dtype}{' with scales' if f.scaled else ''}: the fused op reads "
                         "fp16/bf16 caches in the query's dtype (int8 only with antiquant scales; no fp8)")
    if f.sinks and not env.sinks:
        return LayerPath(TORCH, "torch", f"sinks: {env.sinks_why}")
    if f.sinks and f.v_head_dim not in SINK_DV:
        return LayerPath(TORCH, "torch", f"sinks with Dv={f.v_head_dim}: v2's learnable_sink takes V_D 64 or 128 only")
    if f.sinks and f.graph and not env.graph_sinks:
        return LayerPath(TORCH, "torch", f"graph replay with sinks: {env.graph_sinks_why}")
    if f.q_dtype not in FIA_DTYPES:
        return LayerPath(TORCH, "torch", f"dtype {f.q_dtype} (the fused op takes fp16/bf16)")
    h, kvh, d = f.num_heads, f.num_kv_heads, f.head_dim
    if f.v_head_dim != d or d % 16 or d > 512 or h > 256 or h % kvh or h // kvh > 64 or kvh * d > 65535:
        return LayerPath(TORCH, "torch", f"geometry H={h} KVH={kvh} D={d} Dv={f.v_head_dim} (one K/V shape, "
                         "D % 16 == 0 and <= 512, H <= 256, H/KVH <= 64, KVH*D <= 65535)")
    why = page_size_reason(f.mode, f.page_size)
    if why is not None:
        return LayerPath(TORCH, "torch", why)
    if f.mode == "decode" and not f.list_trimmed:
        return LayerPath(TORCH, "torch", "the index list is not trimmed to the layer's window")
    op = f"torch_npu.{V2 if f.sinks else V1}"
    how = {("decode", False): "page attention", ("decode", True): "window list + head mask",
           ("extend", False): "sparse_mode 3", ("extend", True): "band sparse_mode 4, pre_tokens W-1"}[(f.mode, f.swa)]
    notes = [how] + (["learnable_sink"] if f.sinks else []) + (["graph task update"] if f.graph else [])
    return LayerPath(FUSED, op, f"supported ({', '.join(notes)})")


def facts_of(mode: str, q: torch.Tensor, layer: Any, kv: Any, k_buf: torch.Tensor, v_buf: torch.Tensor,
             page_size: int, graph: bool) -> LayerFacts:
    """A layer's facts for the NPU rules (page size and graph mode matter here)."""
    return layer_facts(mode, q, layer, kv, k_buf, v_buf, page_size, graph)


@dataclass
class FIAPlan:
    """One index list's inputs to the fused op for this forward (graph plans persist, refilled in place)."""

    block_table: torch.Tensor           # int32 [bs, max_pages]
    kv_lens: List[int]                  # host: keys from the list's first page start to seq_len
    block_size: int
    mask: Optional[torch.Tensor] = None  # decode windows: bool [bs, 1, 1, max_pages * P], True = masked
    q_lens: Optional[List[int]] = None   # extend: query rows per request (host)


def causal_mask(device: torch.device) -> torch.Tensor:
    """The compressed 2048 x 2048 mask sparse_mode 3/4 take: True above the diagonal (masked)."""
    return torch.ones(FIA_MASK_SIZE, FIA_MASK_SIZE, dtype=torch.bool, device=device).triu_(1)


class KeptSinks:
    """Each sink layer's sinks as v2's learnable_sink takes them (BFLOAT16/FLOAT16, shape (Q_N)) where the layer
    keeps them in another dtype (often fp32): a copy in the query's dtype per layer and dtype, made at the layer's
    first fused call and kept for the backend's life (sinks already in the query's dtype go to the op as they are:
    nothing kept, nothing refreshed).

    Kept, not cast per call: a call captured in a graph task group keeps the addresses it was issued with (the
    task updates re-issue it with the same tensors), so a per-call cast would leave a replay reading a freed
    temporary. The copy's values follow the layer's sinks through `refresh`, one in-place cast copy per kept
    layer, which the backend's metadata step runs once per forward on the forward's stream: before the layers
    of an eager forward, and before the task updates and the replay of a graph forward (the refill runs outside
    the graph). Refreshed unconditionally, not on a change test: a weight load through `param.data.copy_` does
    not bump the tensor's version counter, and reading the values would sync. A layer given another sinks
    tensor is refreshed from that one, into the same kept copy."""

    def __init__(self) -> None:
        self._kept: Dict[Tuple[Any, torch.dtype], torch.Tensor] = {}

    def get(self, layer: Any, dtype: torch.dtype) -> torch.Tensor:
        """The kept copy of `layer.sinks` in `dtype` (made, with the sinks' current values, on first use)."""
        t = self._kept.get((layer, dtype))
        if t is None:
            with torch.inference_mode(False):  # a normal tensor: refreshed in and out of inference mode alike
                t = self._kept[(layer, dtype)] = torch.empty(layer.sinks.shape, dtype=dtype, device=layer.sinks.device)
                t.copy_(layer.sinks.detach())
        return t

    def refresh(self) -> None:
        """Copy every kept layer's current sinks into its kept copy, in place (cast to the copy's dtype); a layer
        whose sinks are gone or changed shape is skipped (it takes v1, or the forward's checks refuse it)."""
        for (layer, _), t in self._kept.items():
            src = layer.sinks
            if src is not None and src.shape == t.shape:
                t.copy_(src.detach())


def kwargs_for(plan: FIAPlan, layer: Any, decode: bool, env: NPUEnv, mask2048: Optional[torch.Tensor],
               bs: int, sinks: Optional[torch.Tensor]) -> Dict[str, Any]:
    """The op's keyword arguments (v1 names, or v2's for sink layers: `sinks` is then the layer's kept
    learnable_sink, `KeptSinks.get`) for `bs` requests of `plan`."""
    kw: Dict[str, Any] = dict(num_heads=layer.num_heads, num_key_value_heads=layer.num_kv_heads, input_layout="BSND",
                              block_table=plan.block_table[:bs], block_size=plan.block_size,
                              actual_seq_lengths_kv=list(plan.kv_lens[:bs]))
    if decode:
        kw["atten_mask"] = None if plan.mask is None else plan.mask[:bs]
    else:
        kw.update(atten_mask=mask2048, actual_seq_lengths=list(plan.q_lens[:bs]))
        if layer.window is not None:
            kw.update(sparse_mode=4, pre_tokens=window_left(layer.window), next_tokens=0)
        else:
            kw.update(sparse_mode=3)
    if sinks is None:
        kw[env.scale_kw] = float(layer.scaling)
        return kw
    kw = {V1_TO_V2.get(k, k): v for k, v in kw.items()}
    kw.update(softmax_scale=float(layer.scaling), learnable_sink=sinks)
    return kw


def run_eager(mod: Any, q4: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, plan: FIAPlan, layer: Any,
              decode: bool, env: NPUEnv, mask2048: Optional[torch.Tensor],
              sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """One functional call over q4 [B, S, H, D] (BSND), v2 with `sinks` (kept, in q's dtype); returns [B, S, H, Dv]."""
    p, kvh = plan.block_size, k_buf.shape[1]
    op = getattr(mod, V2 if sinks is not None else V1)
    out, _ = op(q4, k_buf.view(-1, p, kvh * k_buf.shape[2]), v_buf.view(-1, p, kvh * v_buf.shape[2]),
                **kwargs_for(plan, layer, decode, env, mask2048, q4.shape[0], sinks))
    return out


@dataclass
class FIACall:
    """One captured call site: the tensors it runs on (fixed at capture) and the plan whose host lengths
    it reads when issued, at capture and at every task update."""

    mod: Any
    q4: torch.Tensor
    k3: torch.Tensor
    v3: torch.Tensor
    out4: torch.Tensor
    lse: torch.Tensor
    workspace: torch.Tensor
    plan: FIAPlan
    layer: Any
    decode: bool
    env: NPUEnv
    mask2048: Optional[torch.Tensor]
    sinks: Optional[torch.Tensor]        # the layer's kept learnable_sink (v2), None for v1
    bs: int = field(init=False)

    def __post_init__(self) -> None:
        self.bs = self.q4.shape[0]

    def kwargs(self) -> Dict[str, Any]:
        return kwargs_for(self.plan, self.layer, self.decode, self.env, self.mask2048, self.bs, self.sinks)

    def issue(self) -> None:
        """The `.out` overload with this forward's lengths (inside a task group at capture or update)."""
        op = getattr(self.mod, V2 if self.sinks is not None else V1).out
        op(self.q4, self.k3, self.v3, workspace=self.workspace, **self.kwargs(), out=[self.out4, self.lse])


def graph_call(mod: Any, q4: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, out4: torch.Tensor,
               plan: FIAPlan, layer: Any, decode: bool, env: NPUEnv, mask2048: Optional[torch.Tensor],
               sinks: Optional[torch.Tensor],
               scratch: Callable[[Tuple[Any, ...], Callable[[], torch.Tensor]], torch.Tensor],
               record: Callable[[Any, Any, FIACall], None]) -> None:
    """The layer's fused call in a graph step: inside capture, its own task group (recorded for updates);
    otherwise (warm-up, or a re-run replay) the `.out` overload on the same buffers."""
    p, kvh = plan.block_size, k_buf.shape[1]
    k3, v3 = k_buf.view(-1, p, kvh * k_buf.shape[2]), v_buf.view(-1, p, kvh * v_buf.shape[2])
    bs = q4.shape[0]
    lse = scratch(("lse", bs, q4.shape[1], layer.layer_id),
                  lambda: torch.zeros(1, dtype=torch.float32, device=q4.device))
    v2 = sinks is not None
    ws_fn = getattr(mod, f"_{V2 if v2 else V1}_get_max_workspace")
    # one workspace per bucket and call shape, shared by the layers (they run one after another)
    shape_key = ("workspace", v2, bs, q4.shape[1], q4.shape[2], kvh, q4.shape[3], p, decode, layer.window is not None)
    workspace = scratch(shape_key, lambda: ws_fn(q4, k3, v3, **kwargs_for(plan, layer, decode, env, mask2048, bs,
                                                                          sinks)))
    call = FIACall(mod, q4, k3, v3, out4, lse, workspace, plan, layer, decode, env, mask2048, sinks)
    rt = torch.npu
    if not rt.is_current_stream_capturing():
        call.issue()
        return
    stream = rt.current_stream()
    event = rt.ExternalEvent()  # the replay waits here until pre_replay's update records it
    event.wait(stream)
    event.reset(stream)
    rt.graph_task_group_begin(stream)
    call.issue()
    handle = rt.graph_task_group_end(stream)
    record(handle, event, call)
