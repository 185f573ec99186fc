"""AITER stand-ins: `paged_attention_ragged` (decode) and `mha_batch_prefill_func` (prefill).

Schemas as declared in ROCm/aiter:
- csrc/cpp_itfs/pa/pa_ragged.py `paged_attention_ragged(out, workspace_buffer, query, key_cache,
  value_cache, scale, kv_indptr, kv_page_indices, kv_last_page_lens, block_size, max_num_partitions,
  alibi_slopes, kv_cache_dtype, kv_cache_layout, logits_soft_cap, k_scale, v_scale,
  fp8_out_scale=None, partition_size=256, mtp=1, q_scale=None)`: query/out fp16 or bf16 (anything
  else raises ValueError there); kv_cache_dtype "auto" (cache in the query's dtype) or
  "fp8"/"fp8_e4m3"/"fp8_e5m2" (cache bytes read as the GPU's fp8); kv_indptr, kv_page_indices and
  kv_last_page_lens are read through int* and k_scale/v_scale/fp8_out_scale through float*;
  "NHD" caches are [blocks, block_size, KVH, D], "HND" [blocks, KVH, block_size, D]; the query
  heads are a whole multiple of the cache's (gqa_ratio).
- aiter/ops/mha.py `mha_batch_prefill_func(q, k, v, cu_seqlens_q, kv_indptr, kv_page_indices,
  max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None, logits_soft_cap=0.0, causal=False,
  window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_lse=False,
  return_attn_probs=False, out=None)`: q [total_q, H, D], k/v [pages, KVH, D] (page size 1);
  causal and window masks are bottom-right aligned (the file's own note: "python side only support
  mask_enum::bottom_right"); head dims not a multiple of 8 are padded by the wrapper.
The fp8 cache dtype of each GPU: aiter/utility/dtypes.py (gfx942 -> float8_e4m3fnuz, gfx950 ->
float8_e4m3fn).
"""
from __future__ import annotations

import importlib.machinery
import types
from typing import Any, Dict

import torch

from hwkv.testing.vendor_schemas.core import (OpSchema, StandInOp, args, require, require_dims, require_dtype,
                                              softmax_rows)

REDUCED = (torch.float16, torch.bfloat16)
ARCH_FP8 = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}

PAGED_ATTENTION_RAGGED = OpSchema(
    "aiter.paged_attention_ragged",
    args("Tensor out, Tensor workspace_buffer, Tensor query, Tensor key_cache, Tensor value_cache, float scale, "
         "Tensor kv_indptr, Tensor kv_page_indices, Tensor? kv_last_page_lens, int block_size, "
         "int max_num_partitions, Tensor? alibi_slopes, str kv_cache_dtype, str kv_cache_layout, "
         "float logits_soft_cap, Tensor k_scale, Tensor v_scale, Tensor? fp8_out_scale=None, "
         "int partition_size=256, int mtp=1, Tensor? q_scale=None"),
    "ROCm/aiter csrc/cpp_itfs/pa/pa_ragged.py")

MHA_BATCH_PREFILL = OpSchema(
    "aiter.mha_batch_prefill_func",
    args("Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor kv_indptr, Tensor kv_page_indices, "
         "int max_seqlen_q, int max_seqlen_k, float dropout_p=0.0, float? softmax_scale=None, "
         "float logits_soft_cap=0.0, bool causal=False, any window_size=(-1, -1), Tensor? alibi_slopes=None, "
         "bool deterministic=False, bool return_lse=False, bool return_attn_probs=False, Tensor? out=None"),
    "ROCm/aiter aiter/ops/mha.py")


def _cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(logits / cap) if cap else logits


def _paged_attention_ragged(arch: str):
    op = PAGED_ATTENTION_RAGGED.op

    def impl(out, workspace_buffer, query, key_cache, value_cache, scale, kv_indptr, kv_page_indices,
             kv_last_page_lens, block_size, max_num_partitions, alibi_slopes, kv_cache_dtype, kv_cache_layout,
             logits_soft_cap, k_scale, v_scale, fp8_out_scale, partition_size, mtp, q_scale) -> None:
        require_dtype(op, "query", query, REDUCED)
        require_dtype(op, "out", out, REDUCED)
        require_dims(op, "query", query, 3, "[num_seqs, num_heads, head_size]")
        require(tuple(out.shape) == tuple(query.shape), op, f"out {list(out.shape)} must match query "
                f"{list(query.shape)} (one head size for Q, K, V and out)")
        require(kv_cache_layout in ("NHD", "HND"), op, f"kv_cache_layout must be 'NHD' or 'HND', got {kv_cache_layout!r}")
        require_dims(op, "key_cache", key_cache, 4, "[blocks, block_size, KVH, D] (NHD) or [blocks, KVH, block_size, D]")
        require(key_cache.shape == value_cache.shape, op, "key_cache and value_cache must have one shape")
        bsz_dim, head_dim_ = (1, 2) if kv_cache_layout == "NHD" else (2, 1)
        require(key_cache.shape[bsz_dim] == block_size, op, f"block_size={block_size} but the {kv_cache_layout} "
                f"cache holds {key_cache.shape[bsz_dim]} tokens per block")
        require(key_cache.shape[3] == query.shape[2], op, "the cache's head size must equal the query's")
        kvh = key_cache.shape[head_dim_]
        require(query.shape[1] % kvh == 0, op, f"num_heads={query.shape[1]} is not a multiple of the cache's {kvh}")
        for name, t in (("kv_indptr", kv_indptr), ("kv_page_indices", kv_page_indices)):
            require_dtype(op, name, t, (torch.int32,))  # read through int*
        if block_size > 1:
            require(kv_last_page_lens is not None, op, "kv_last_page_lens is read when block_size > 1")
            require_dtype(op, "kv_last_page_lens", kv_last_page_lens, (torch.int32,))
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale), ("fp8_out_scale", fp8_out_scale)):
            require_dtype(op, name, t, (torch.float32,))  # read through float*
        require(alibi_slopes is None, op, "hwkv's stand-in models no alibi")
        if kv_cache_dtype == "auto":
            require(key_cache.dtype == query.dtype and value_cache.dtype == query.dtype, op,
                    f"kv_cache_dtype 'auto' reads the cache as the query's {query.dtype}, got {key_cache.dtype}")
            kc, vc = key_cache.float(), value_cache.float()
        elif kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
            require(key_cache.element_size() == 1 and value_cache.element_size() == 1, op,
                    f"kv_cache_dtype {kv_cache_dtype!r} reads one byte per element, the cache is {key_cache.dtype}")
            fp8 = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else ARCH_FP8[arch]
            kc = key_cache.view(torch.uint8).view(fp8).float() * float(k_scale.reshape(-1)[0])
            vc = value_cache.view(torch.uint8).view(fp8).float() * float(v_scale.reshape(-1)[0])
        else:
            raise AssertionError(f"{op}: unsupported kv_cache_dtype {kv_cache_dtype!r}")
        if kv_cache_layout == "HND":
            kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
        s, h, d = query.shape
        require(workspace_buffer.numel() * workspace_buffer.element_size()
                >= s * h * max_num_partitions * (d * out.element_size() + 8), op,
                "workspace_buffer is smaller than exp_sums + max_logits + tmp_out")
        g = h // kvh
        ptr = kv_indptr.tolist()
        for b in range(s):
            pages = kv_page_indices[ptr[b]:ptr[b + 1]].long()
            n = pages.numel() if block_size == 1 else (pages.numel() - 1) * block_size + int(kv_last_page_lens[b])
            require(n <= max_num_partitions * partition_size, op,
                    f"sequence {b} has {n} keys, max_num_partitions * partition_size covers "
                    f"{max_num_partitions * partition_size}")
            keys = kc[pages].reshape(-1, kvh, d)[:n].repeat_interleave(g, 1)
            vals = vc[pages].reshape(-1, kvh, d)[:n].repeat_interleave(g, 1)
            logits = _cap(torch.einsum("hd,nhd->hn", query[b].float(), keys) * scale, logits_soft_cap)
            p = softmax_rows(logits[:, None, :], torch.ones_like(logits[:, None, :], dtype=torch.bool), None)
            out[b] = torch.einsum("hn,nhd->hd", p[:, 0], vals).to(out.dtype)

    return impl


def _mha_batch_prefill(q, k, v, cu_seqlens_q, kv_indptr, kv_page_indices, max_seqlen_q, max_seqlen_k, dropout_p,
                       softmax_scale, logits_soft_cap, causal, window_size, alibi_slopes, deterministic, return_lse,
                       return_attn_probs, out) -> Any:
    op = MHA_BATCH_PREFILL.op
    require_dtype(op, "q", q, REDUCED)
    require(k.dtype == q.dtype and v.dtype == q.dtype, op, f"q/k/v dtypes must match, got {q.dtype}/{k.dtype}/{v.dtype}")
    require_dims(op, "q", q, 3, "[total_q, H, D]")
    require_dims(op, "k", k, 3, "[pages, KVH, D] (page size 1)")
    require(v.dim() == 3 and v.shape[:2] == k.shape[:2], op, "v must be [pages, KVH, Dv] like k")
    require(k.shape[2] == q.shape[2], op, "k's head size must equal q's")
    require(q.shape[1] % k.shape[1] == 0, op, f"{q.shape[1]} query heads are not a multiple of {k.shape[1]}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("kv_indptr", kv_indptr), ("kv_page_indices", kv_page_indices)):
        require_dtype(op, name, t, (torch.int32,))
    require(dropout_p == 0.0 and alibi_slopes is None and not return_attn_probs, op, "inference call expected")
    require(isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(x, int) for x in window_size), op, f"window_size must be (left, right), got {window_size!r}")
    h, d, dv = q.shape[1], q.shape[2], v.shape[2]
    g = h // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    if out is None:
        out = q.new_empty(q.shape[0], h, dv)
    require(tuple(out.shape) == (q.shape[0], h, dv) and out.dtype == q.dtype, op, "out must be [total_q, H, Dv] in q's dtype")
    qo, kp = cu_seqlens_q.tolist(), kv_indptr.tolist()
    left, right = window_size
    for b in range(len(qo) - 1):
        nq, nk = qo[b + 1] - qo[b], kp[b + 1] - kp[b]
        require(nq <= max_seqlen_q and nk <= max_seqlen_k, op, f"sequence {b}: {nq}/{nk} exceed max_seqlen_q/k "
                f"{max_seqlen_q}/{max_seqlen_k}")
        if nq == 0:
            continue
        pages = kv_page_indices[kp[b]:kp[b + 1]].long()
        keys = k[pages].float().repeat_interleave(g, 1)
        vals = v[pages].float().repeat_interleave(g, 1)
        logits = _cap(torch.einsum("qhd,khd->hqk", q[qo[b]:qo[b + 1]].float(), keys) * scale, logits_soft_cap)
        diag = torch.arange(nq)[:, None] + (nk - nq)  # bottom-right alignment
        j = torch.arange(nk)[None, :]
        vis = torch.ones(nq, nk, dtype=torch.bool)
        if causal:
            vis &= j <= diag
        if left >= 0:
            vis &= j >= diag - left
        if right >= 0:
            vis &= j <= diag + right
        p = softmax_rows(logits, vis[None].expand_as(logits), None)
        out[qo[b]:qo[b + 1]] = torch.einsum("hqk,khd->qhd", p, vals).to(out.dtype)
    return out


def make_aiter(arch: str = "gfx942") -> types.ModuleType:
    """A module standing in for `aiter` on an `arch` GPU (its fp8 is ARCH_FP8[arch])."""
    mod = types.ModuleType("aiter")
    mod.__spec__ = importlib.machinery.ModuleSpec("aiter", None)
    mod.paged_attention_ragged = StandInOp(PAGED_ATTENTION_RAGGED, _paged_attention_ragged(arch))
    mod.mha_batch_prefill_func = StandInOp(MHA_BATCH_PREFILL, _mha_batch_prefill)
    mod.dtypes = types.SimpleNamespace(fp8=ARCH_FP8[arch])
    return mod


def calls(mod: types.ModuleType) -> Dict[str, int]:
    """How many times each stand-in op was called."""
    return {name: len(getattr(mod, name).calls) for name in ("paged_attention_ragged", "mha_batch_prefill_func")}

