"""sgl-kernel CPU stand-ins: `decode_attention_cpu` and `extend_attention_cpu` (torch.ops.sgl_kernel).

Schemas as registered in sgl-project/sglang sgl-kernel/csrc/cpu/torch_extension_cpu.cpp (the m.def
strings) with the semantics of decode.cpp / extend.cpp, as hwkv_cpu.amx documents them: decode first
stores key/value [B, KVH, D] at k_cache[loc] (loc int64, one row per request), then attends request b
over k_cache[req_to_token[req_pool_indices[b], :seq_lens[b]]]; attn_logits is fp32
[B, H, num_kv_splits, Dv + 1]; output [B, H, Dv] in the query's dtype (bf16 or fp16). Extend takes
the prefix keys from the buffers and the request's own new keys from k_extend/v_extend [T, KVH, D],
causally; seq_lens and req_pool_indices are int64, extend_seq_lens and extend_start_loc in req_to_token's
dtype (extend.cpp: "expect extend_seq_lens and extend_start_loc to have same dtype as req_to_token").
"""
from __future__ import annotations

import torch

from hwkv import reference
from hwkv.testing.vendor_schemas.core import OpSchema, StandInOp, args, require, require_dims, require_dtype

SOURCE = "sgl-project/sglang sgl-kernel/csrc/cpu/torch_extension_cpu.cpp"
REDUCED = (torch.float16, torch.bfloat16)
DECODE = OpSchema(
    "sgl_kernel.decode_attention_cpu",
    args("Tensor query, Tensor k_cache, Tensor v_cache, Tensor output, Tensor key, Tensor value, Tensor loc, "
         "Tensor attn_logits, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float sm_scale, "
         "float logit_cap"), SOURCE)
EXTEND = OpSchema(
    "sgl_kernel.extend_attention_cpu",
    args("Tensor q_extend, Tensor k_extend, Tensor v_extend, Tensor o_extend, Tensor k_buffer, Tensor v_buffer, "
         "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, "
         "Tensor extend_start_loc, int max_len_extend, float sm_scale, float logit_cap"), SOURCE)


def _common(op: str, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, out: torch.Tensor,
            req_to_token: torch.Tensor, ints: dict) -> None:
    require_dtype(op, "query", q, REDUCED)
    require(k_buf.dtype == q.dtype and v_buf.dtype == q.dtype and out.dtype == q.dtype, op,
            "one reduced dtype end to end (query, caches, output)")
    require(q.is_contiguous() and out.is_contiguous(), op, "query and output must be contiguous")
    require(q.shape[1] % k_buf.shape[1] == 0, op, "query heads must be a multiple of the cache's")
    require_dtype(op, "req_to_token", req_to_token, (torch.int32, torch.int64))
    require_dims(op, "req_to_token", req_to_token, 2, "[rows, max_context]")
    for name, t in ints.items():
        require_dtype(op, name, t, (torch.int64,))


def _decode(query, k_cache, v_cache, output, key, value, loc, attn_logits, req_to_token, req_pool_indices,
            seq_lens, sm_scale, logit_cap) -> None:
    op = DECODE.op
    _common(op, query, k_cache, v_cache, output, req_to_token,
            {"loc": loc, "req_pool_indices": req_pool_indices, "seq_lens": seq_lens})
    bsz, h, _ = query.shape
    dv = v_cache.shape[2]
    require(tuple(output.shape) == (bsz, h, dv), op, f"output must be [B, H, Dv] = {[bsz, h, dv]}")
    require(key.shape == (bsz,) + tuple(k_cache.shape[1:]) and loc.shape == (bsz,), op, "key/loc: one row per request")
    require_dtype(op, "attn_logits", attn_logits, (torch.float32,))
    require(attn_logits.dim() == 4 and tuple(attn_logits.shape[:2]) == (bsz, h) and attn_logits.shape[3] == dv + 1,
            op, f"attn_logits must be [B, H, splits, Dv + 1], got {list(attn_logits.shape)}")
    k_cache[loc], v_cache[loc] = key, value
    for b in range(bsz):
        n = int(seq_lens[b])
        slots = req_to_token[req_pool_indices[b], :n].long()
        o = reference.attention(query[b:b + 1], k_cache[slots], v_cache[slots], torch.tensor([n - 1]),
                                torch.arange(n), sm_scale, None, logit_cap)
        output[b] = o[0].to(output.dtype)


def _extend(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
            extend_seq_lens, extend_start_loc, max_len_extend, sm_scale, logit_cap) -> None:
    op = EXTEND.op
    _common(op, q_extend, k_buffer, v_buffer, o_extend, req_to_token,
            {"req_pool_indices": req_pool_indices, "seq_lens": seq_lens})
    for name, t in (("extend_seq_lens", extend_seq_lens), ("extend_start_loc", extend_start_loc)):
        require(t.dtype == req_to_token.dtype, op, f"{name} must have req_to_token's dtype {req_to_token.dtype}, "
                f"got {t.dtype}")
    require(k_extend.shape[0] == q_extend.shape[0] and k_extend.shape[1:] == k_buffer.shape[1:], op,
            "k_extend must be [T, KVH, D] of the buffer")
    for b in range(seq_lens.shape[0]):
        n, e, s = int(seq_lens[b]), int(extend_seq_lens[b]), int(extend_start_loc[b])
        require(e <= max_len_extend, op, f"request {b} extends {e} > max_len_extend={max_len_extend}")
        pre = req_to_token[req_pool_indices[b], :n - e].long()
        k = torch.cat([k_buffer[pre], k_extend[s:s + e]])
        v = torch.cat([v_buffer[pre], v_extend[s:s + e]])
        o = reference.attention(q_extend[s:s + e], k, v, torch.arange(n - e, n), torch.arange(n), sm_scale, None,
                                logit_cap)
        o_extend[s:s + e] = o.to(o_extend.dtype)


def make_sgl_ops() -> "tuple[StandInOp, StandInOp]":
    """(decode_attention_cpu, extend_attention_cpu) stand-ins, as torch.ops.sgl_kernel would hold them."""
    return StandInOp(DECODE, _decode), StandInOp(EXTEND, _extend)
