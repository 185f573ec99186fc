"""torch_npu stand-ins: fused infer attention (v1, v2, their `.out` and workspace variants), ATB
reshape-and-cache, and the NPU graph task-group runtime that `torch.npu` exposes.

Schemas as declared in Ascend/op-plugin:
- docs/context/torch_npu-npu_fused_infer_attention_score.md: query, key, value positional, every other
  argument keyword-only (names and defaults below); page attention needs block_table int32
  [B, >= max blocks], actual_seq_lengths_kv, and caches [blocks, block_size, KVH * D] for BSH/BSND;
  fp16/bf16 query; num_heads / num_key_value_heads <= 64; N <= 256, D <= 512, D a multiple of 16;
  KV_N * D above 65535 is refused for the [blocks, block_size, H] cache; with Q_S == 1 the op ignores
  pre_tokens, next_tokens and sparse_mode and takes a bool mask [B, (1, 1,) KV_S] (True = masked) with
  KV_S >= max blocks * block_size; with Q_S > 1 page attention needs block_size a multiple of 128 in
  [128, 512], sparse_mode 2/3/4 take the compressed 2048 x 2048 lower-triangular mask, and modes 3
  and 4 measure from the bottom-right corner (docs "sparse_mode参数说明": 4 = band between pre_tokens
  and next_tokens, origin bottom right).
- docs/context/torch_npu-npu_fused_infer_attention_score_v2.md with `learnable_sink` (op-plugin
  FusedInferAttentionScoreV2 kernel source; one logit per query head in the softmax denominator, as
  torch_npu's test_fused_infer_attention_score_v2 reference `npSoftmax_new(x, sinks)` computes it);
  hicann/ops-transformer attention/fused_infer_attention_score/docs/aclnnFusedInferAttentionScoreV4.md
  (the aclnn the v2 kernel calls), row learnableSinkOptional: BFLOAT16/FLOAT16, ND, shape (Q_N), and
  only with V_D 128 or 64.
- The `.out` overloads take `workspace=` and `out=[attention_out, softmax_lse]`, and
  `_npu_fused_infer_attention_score_get_max_workspace` takes the op's arguments
  (docs/context/torch_npu-npu-graph_task_group_begin.md, torch_npu-npu-graph_task_update_begin.md).
- `_npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)` (atb schema): caches ND
  [blocks, block_size, KVH, D] in the key's dtype (fp16/bf16/int8), slot_indices int32.

The graph runtime it runs against (installed as `torch.npu`) is `npu_runtime.FakeNPURuntime`.
"""
from __future__ import annotations

import importlib.machinery
import types
from typing import Any, Dict, List, Optional, Tuple

import torch

from hwkv.testing.vendor_schemas.core import (OpSchema, StandInOp, args, require, require_dims, require_dtype,
                                              softmax_rows)
from hwkv.testing.vendor_schemas.npu_runtime import FakeNPURuntime

REDUCED = (torch.float16, torch.bfloat16)
INT_MAX = 2147483647
MASK_SIZE = 2048
SINK_DV = (64, 128)
SOURCE = "Ascend/op-plugin docs/context/torch_npu-npu_fused_infer_attention_score.md"

_FIA_KW = args(
    "Tensor? pse_shift=None, Tensor? atten_mask=None, int[]? actual_seq_lengths=None, "
    "int[]? actual_seq_lengths_kv=None, Tensor? dequant_scale1=None, Tensor? quant_scale1=None, "
    "Tensor? dequant_scale2=None, Tensor? quant_scale2=None, Tensor? quant_offset2=None, "
    "Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, Tensor? block_table=None, "
    "Tensor? query_padding_size=None, Tensor? kv_padding_size=None, Tensor? key_antiquant_scale=None, "
    "Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, Tensor? value_antiquant_offset=None, "
    "Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, int[]? actual_shared_prefix_len=None, "
    "Tensor? query_rope=None, Tensor? key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, "
    "float scale=1.0, int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout='BSH', "
    "int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, int antiquant_mode=0, "
    "bool softmax_lse_flag=False, int key_antiquant_mode=0, int value_antiquant_mode=0", kw_only=True)
_V2_KW = args(
    "Tensor? query_rope=None, Tensor? key_rope=None, Tensor? pse_shift=None, Tensor? atten_mask=None, "
    "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, Tensor? block_table=None, "
    "Tensor? dequant_scale_query=None, Tensor? dequant_scale_key=None, Tensor? dequant_offset_key=None, "
    "Tensor? dequant_scale_value=None, Tensor? dequant_offset_value=None, Tensor? dequant_scale_key_rope=None, "
    "Tensor? quant_scale_out=None, Tensor? quant_offset_out=None, Tensor? learnable_sink=None, "
    "int num_query_heads=1, int num_key_value_heads=0, float softmax_scale=1.0, int pre_tokens=2147483647, "
    "int next_tokens=2147483647, str input_layout='BSH', int sparse_mode=0, int block_size=0, "
    "int query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, int inner_precise=0, "
    "bool return_softmax_lse=False, int? query_dtype=None, int? key_dtype=None, int? value_dtype=None, "
    "int? query_rope_dtype=None, int? key_rope_dtype=None, int? key_shared_prefix_dtype=None, "
    "int? value_shared_prefix_dtype=None, int? dequant_scale_query_dtype=None, int? dequant_scale_key_dtype=None, "
    "int? dequant_scale_value_dtype=None, int? dequant_scale_key_rope_dtype=None, int? out_dtype=None", kw_only=True)
_QKV = args("Tensor query, Tensor key, Tensor value")
_OUT_KW = args("Tensor? workspace=None, Tensor[] out", kw_only=True)

FIA = OpSchema("torch_npu.npu_fused_infer_attention_score", _QKV + _FIA_KW, SOURCE)
FIA_OUT = OpSchema("torch_npu.npu_fused_infer_attention_score.out", _QKV + _FIA_KW + _OUT_KW, SOURCE)
FIA_WORKSPACE = OpSchema("torch_npu._npu_fused_infer_attention_score_get_max_workspace", _QKV + _FIA_KW, SOURCE)
FIA_V2 = OpSchema("torch_npu.npu_fused_infer_attention_score_v2", _QKV + _V2_KW, SOURCE.replace("score.md", "score_v2.md"))
FIA_V2_OUT = OpSchema("torch_npu.npu_fused_infer_attention_score_v2.out", _QKV + _V2_KW + _OUT_KW, FIA_V2.source)
FIA_V2_WORKSPACE = OpSchema("torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace", _QKV + _V2_KW,
                            FIA_V2.source)
RESHAPE_AND_CACHE = OpSchema(
    "torch_npu._npu_reshape_and_cache",
    args("Tensor key, Tensor value, Tensor key_cache, Tensor value_cache, Tensor slot_indices"),
    "Ascend/op-plugin atb::_npu_reshape_and_cache")

V2_TO_V1 = {"num_query_heads": "num_heads", "softmax_scale": "scale", "actual_seq_qlen": "actual_seq_lengths",
            "actual_seq_kvlen": "actual_seq_lengths_kv", "return_softmax_lse": "softmax_lse_flag"}
_QUANT_V1 = ("pse_shift", "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2", "quant_offset2",
             "antiquant_scale", "antiquant_offset", "query_padding_size", "kv_padding_size", "key_antiquant_scale",
             "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset", "key_shared_prefix",
             "value_shared_prefix", "actual_shared_prefix_len", "query_rope", "key_rope", "key_rope_antiquant_scale")
_QUANT_V2 = ("query_rope", "key_rope", "pse_shift", "dequant_scale_query", "dequant_scale_key", "dequant_offset_key",
             "dequant_scale_value", "dequant_offset_value", "dequant_scale_key_rope", "quant_scale_out",
             "quant_offset_out")


def _normalized(p: Dict[str, Any], v2: bool) -> Dict[str, Any]:
    """v2's argument names mapped onto v1's (the computation is the same), after checking hwkv passes
    none of the quantization / rope / prefix inputs (the stand-in models none of them)."""
    op = (FIA_V2 if v2 else FIA).op
    for name in (_QUANT_V2 if v2 else _QUANT_V1):
        require(p.get(name) is None, op, f"{name} is not modeled by hwkv's stand-in (hwkv passes none)")
    if not v2:
        return dict(p, sinks=None)
    out = {V2_TO_V1.get(k, k): v for k, v in p.items()}
    out["sinks"] = p.get("learnable_sink")  # absent from releases that predate it
    return out


def _mask_is_compressed_causal(m: torch.Tensor) -> bool:
    m2 = m.reshape(m.shape[-2], m.shape[-1])
    return tuple(m2.shape) == (MASK_SIZE, MASK_SIZE) and bool(m2[0, 1]) and not bool(m2[1, 0]) and not bool(m2[5, 5])


def _check_and_pages(p: Dict[str, Any], op: str) -> Tuple[torch.Tensor, int, int, int, int, List[int]]:
    """The documented constraints; returns (q as BSND, B, S, KVH, Dv, kv lengths)."""
    q, key, value, layout = p["query"], p["key"], p["value"], p["input_layout"]
    require(layout in ("BSND", "BSH"), op, f"hwkv's stand-in models BSND/BSH only, got {layout!r}")
    require_dtype(op, "query", q, REDUCED)
    require(key.dtype == q.dtype and value.dtype == q.dtype, op,
            f"key/value must be the query's {q.dtype} (int8 needs antiquant inputs hwkv does not pass), "
            f"got {key.dtype}/{value.dtype}")
    for name, t in (("query", q), ("key", key), ("value", value)):
        require(t.is_contiguous(), op, f"{name} must be contiguous")
    n = p["num_heads"]
    if layout == "BSH":
        require_dims(op, "query", q, 3, "[B, S, H]")
        q = q.view(q.shape[0], q.shape[1], n, -1)
    require_dims(op, "query", q, 4, "[B, S, N, D]")
    bsz, s, qn, d = q.shape
    require(qn == n, op, f"num_heads={n} but the query has {qn} heads")
    kvh = p["num_key_value_heads"] or n
    require(n % kvh == 0 and n // kvh <= 64, op, f"num_heads/num_key_value_heads = {n}/{kvh}: a divisor, ratio <= 64")
    require(d % 16 == 0 and d <= 512 and n <= 256, op, f"D={d} must be a multiple of 16 and <= 512, N={n} <= 256")
    table = p["block_table"]
    require(table is not None, op, "hwkv's stand-in models page attention only (block_table given)")
    require_dtype(op, "block_table", table, (torch.int32,))
    require(table.dim() == 2 and table.shape[0] == bsz, op, f"block_table must be [B={bsz}, blocks], got {list(table.shape)}")
    require_dims(op, "key", key, 3, "[blocks, block_size, KVH * D] (page attention, BSH/BSND)")
    require(value.dim() == 3 and value.shape[:2] == key.shape[:2], op, "value must be [blocks, block_size, KVH * Dv]")
    blk = p["block_size"]
    require(key.shape[1] == blk, op, f"block_size={blk} but the cache holds {key.shape[1]} tokens per block")
    require(key.shape[2] == kvh * d, op, f"key's last dim {key.shape[2]} != num_key_value_heads * D = {kvh * d}")
    require(kvh * d <= 65535, op, f"KV_N * D = {kvh * d} exceeds 65535 for a [blocks, block_size, H] cache")
    if s == 1:
        require(blk % 16 == 0, op, f"block_size={blk} must be a multiple of 16 for Q_S = 1")
    else:
        require(blk % 128 == 0 and 128 <= blk <= 512, op, f"block_size={blk} must be a multiple of 128 in [128, 512] "
                "for Q_S > 1 page attention")
    kv_lens = p["actual_seq_lengths_kv"]
    require(kv_lens is not None, op, "page attention needs actual_seq_lengths_kv")
    require(len(kv_lens) == 1 or len(kv_lens) >= bsz, op, f"actual_seq_lengths_kv has {len(kv_lens)} entries for B={bsz}")
    kv = [kv_lens[0]] * bsz if len(kv_lens) == 1 else list(kv_lens[:bsz])
    cap = table.shape[1] * blk
    require(all(0 <= x <= cap for x in kv), op, f"actual_seq_lengths_kv {kv} exceed block_table capacity {cap}")
    return q, bsz, s, kvh, value.shape[2] // kvh, kv


def fia_compute(p: Dict[str, Any], v2: bool) -> torch.Tensor:
    """attention_out [B, S, N, Dv] (BSND) of one fused-infer-attention call, checked as documented."""
    op = (FIA_V2 if v2 else FIA).op
    p = _normalized(p, v2)
    q, bsz, s, kvh, dv, kv = _check_and_pages(p, op)
    n, d, blk = q.shape[2], q.shape[3], p["block_size"]
    require(not p["softmax_lse_flag"], op, "hwkv asks for no softmax_lse")
    mask, sparse, sinks = p["atten_mask"], p["sparse_mode"], p["sinks"]
    if mask is not None:
        require_dtype(op, "atten_mask", mask, (torch.bool, torch.int8, torch.uint8))
    if s == 1:  # IncreFlashAttention: pre_tokens, next_tokens, sparse_mode ignored
        if mask is not None:
            require(mask.dim() in (2, 3, 4) and mask.shape[0] == bsz and all(x == 1 for x in mask.shape[1:-1]), op,
                    f"a Q_S = 1 mask is [B, (1, 1,) KV_S], got {list(mask.shape)}")
            require(mask.shape[-1] >= p["block_table"].shape[1] * blk, op, "mask KV_S < max blocks * block_size")
        q_lens = [1] * bsz
    else:
        require(sparse in (0, 2, 3, 4), op, f"sparse_mode={sparse}: hwkv's stand-in models 0 (no mask), 2, 3, 4")
        if sparse == 0:
            require(mask is None, op, "sparse_mode 0 with a full mask is not modeled")
        else:
            require(mask is not None and _mask_is_compressed_causal(mask), op,
                    f"sparse_mode {sparse} takes the compressed 2048 x 2048 lower-triangular mask")
        ql = p["actual_seq_lengths"]
        q_lens = [s] * bsz if ql is None else ([ql[0]] * bsz if len(ql) == 1 else list(ql[:bsz]))
        require(all(0 <= x <= s for x in q_lens), op, f"actual_seq_lengths {q_lens} exceed Q_S={s}")
    if sinks is not None:
        require(sinks.dtype in REDUCED and tuple(sinks.shape) == (n,), op,
                f"learnable_sink must be BFLOAT16/FLOAT16 of shape (Q_N={n},), got {sinks.dtype} {list(sinks.shape)}")
        require(dv in SINK_DV, op, f"learnable_sink needs V_D 64 or 128, got {dv}")
    g = n // kvh
    kc = p["key"].view(-1, blk, kvh, d)
    vc = p["value"].view(-1, blk, kvh, dv)
    out = torch.zeros(bsz, s, n, dv, dtype=q.dtype, device=q.device)
    for b in range(bsz):
        nk, nq = kv[b], q_lens[b]
        if nq == 0 or nk == 0:
            continue
        j = torch.arange(nk, device=q.device)
        pages, offs = p["block_table"][b].long()[j // blk], j % blk
        keys = kc[pages, offs].float().repeat_interleave(g, 1)
        vals = vc[pages, offs].float().repeat_interleave(g, 1)
        logits = torch.einsum("qhd,khd->hqk", q[b, :nq].float(), keys) * p["scale"]
        vis = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
        if s == 1 and mask is not None:
            vis &= ~mask.reshape(bsz, -1)[b, :nk].bool()[None, :]
        elif s > 1 and sparse in (2, 3, 4):
            diag = torch.arange(nq, device=q.device)[:, None] + (0 if sparse == 2 else nk - nq)
            if sparse == 4:  # band from the bottom-right corner
                vis &= (j[None, :] >= diag - p["pre_tokens"]) & (j[None, :] <= diag + p["next_tokens"])
            else:
                vis &= j[None, :] <= diag
        probs = softmax_rows(logits, vis[None].expand_as(logits), sinks)
        out[b, :nq] = torch.einsum("hqk,khd->qhd", probs, vals).to(out.dtype)
    return out


def _fia_out(schema: OpSchema, v2: bool, runtime: FakeNPURuntime):
    def impl(**p: Any) -> None:
        out = p.pop("out")
        workspace = p.pop("workspace")
        require(len(out) == 2, schema.op, "out=[attention_out, softmax_lse]")
        require(workspace is not None and workspace.dtype == torch.uint8, schema.op,
                "workspace from _npu_fused_infer_attention_score_get_max_workspace")

        def compute(params: Dict[str, Any]) -> None:
            res = fia_compute({k: v for k, v in params.items() if k not in ("out", "workspace")}, v2)
            attn = params["out"][0]
            require(attn.dtype == res.dtype and attn.numel() == res.numel(), schema.op,
                    f"attention_out must hold {list(res.shape)} {res.dtype}, got {list(attn.shape)} {attn.dtype}")
            attn.view(res.shape).copy_(res)

        runtime.issue(schema.op, dict(p, out=out, workspace=workspace), compute)
    return impl


def _workspace(v2: bool):
    def impl(**p: Any) -> torch.Tensor:
        fia_compute(p, v2)  # the same checks as the op itself
        return torch.zeros(64, dtype=torch.uint8, device=p["query"].device)
    return impl


def _fia(v2: bool):
    def impl(**p: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        res = fia_compute(p, v2)
        q = p["query"]
        return (res.view(*q.shape[:-1], -1) if p["input_layout"] == "BSH" else res,
                torch.zeros(1, dtype=torch.float32, device=q.device))
    return impl


def _reshape_and_cache(key, value, key_cache, value_cache, slot_indices) -> None:
    op = RESHAPE_AND_CACHE.op
    require_dims(op, "key_cache", key_cache, 4, "[blocks, block_size, KVH, D] (ND)")
    require(value_cache.dim() == 4 and value_cache.shape[:3] == key_cache.shape[:3], op, "value_cache like key_cache")
    require_dtype(op, "key_cache", key_cache, REDUCED + (torch.int8,))
    require(key.dtype == key_cache.dtype and value.dtype == value_cache.dtype, op, "key/value in the caches' dtype")
    require(key.dim() == 3 and key.shape[1:] == key_cache.shape[2:], op, "key must be [T, KVH, D] of the cache")
    require(value.dim() == 3 and value.shape[1:] == value_cache.shape[2:], op, "value must be [T, KVH, Dv]")
    require_dtype(op, "slot_indices", slot_indices, (torch.int32,))
    require(slot_indices.shape == (key.shape[0],), op, "one slot per token")
    blk = key_cache.shape[1]
    s = slot_indices.long()
    key_cache[s // blk, s % blk] = key
    value_cache[s // blk, s % blk] = value


def make_torch_npu(v2_sinks: bool = True, runtime: Optional[FakeNPURuntime] = None) -> types.ModuleType:
    """A module standing in for `torch_npu` (install it with `torch.npu = mod.npu` as importing would);
    `v2_sinks=False` is a torch_npu whose v2 op predates `learnable_sink`."""
    rt = runtime or FakeNPURuntime()
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    mod.npu = rt
    v1 = StandInOp(FIA, _fia(False))
    v1.overloads["out"] = StandInOp(FIA_OUT, _fia_out(FIA_OUT, False, rt))
    mod.npu_fused_infer_attention_score = v1
    mod._npu_fused_infer_attention_score_get_max_workspace = StandInOp(FIA_WORKSPACE, _workspace(False))
    v2_schema, v2_out, v2_ws = FIA_V2, FIA_V2_OUT, FIA_V2_WORKSPACE
    if not v2_sinks:
        drop = tuple(a for a in FIA_V2.args if a.name != "learnable_sink")
        v2_schema = OpSchema(FIA_V2.op, drop, FIA_V2.source)
        v2_out = OpSchema(FIA_V2_OUT.op, drop + _OUT_KW, FIA_V2.source)
        v2_ws = OpSchema(FIA_V2_WORKSPACE.op, drop, FIA_V2.source)
    v2 = StandInOp(v2_schema, _fia(True))
    v2.overloads["out"] = StandInOp(v2_out, _fia_out(v2_out, True, rt))
    mod.npu_fused_infer_attention_score_v2 = v2
    mod._npu_fused_infer_attention_score_v2_get_max_workspace = StandInOp(v2_ws, _workspace(True))
    mod._npu_reshape_and_cache = StandInOp(RESHAPE_AND_CACHE, _reshape_and_cache)
    return mod
