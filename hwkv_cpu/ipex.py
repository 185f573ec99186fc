"""IPEX's paged-attention ops on CPU over hwkv's pools: which layers they run, the ops, the K/V store.

What was verified, and where. The API is `ipex.llm.modules.PagedAttention` (IPEX 2.8.0,
intel_extension_for_pytorch/llm/modules/mha_fusion.py), which hands CPU tensors to
`_IPEXPagedAttentionCPU` (transformers/models/cpu/fusions/mha_fusion.py) and so to
`torch.ops.torch_ipex.*`. The behaviour below was measured by running the 2.8.0+cpu wheel against
`hwkv.reference` (tests/test_ipex.py keeps those checks; docs/devices.md, "IPEX", has the run):
- Cache layout: the CPU kernels read K/V caches as [num_blocks, num_kv_heads, block_size, head_size]
  (the layout `single_query_cached_kv_attention`'s docstring gives; `reshape_and_cache`'s docstring
  says otherwise and is wrong). `flash_attn_varlen_func` ignores strides, so hwkv's token-major pool
  [S, KVH, D] fits only as block_size 1: the contiguous view [S, KVH, 1, D]. hwkv uses block_size 1 for
  every op, so a request's block table is its index list (slots, int32) and any page size works.
- `reshape_and_cache`: key/value dtype must equal the cache's (TORCH_CHECK), slot_mapping int32; it reads a
  token's heads through key/value's first two strides (a strided slice of a fused projection stored exactly) and
  each head's D values as one run, so k/v whose last dim is strided are made contiguous first (`_rows`).
- `single_query_cached_kv_attention`: int32 tables, head_mapping int32 [H] (q head -> KV head); q must be
  contiguous (a strided q gave wrong results); window_size = W in hwkv's meaning (key j visible to
  query i iff j > i - W); softcap s = cap * tanh(scale * q.k / cap); window_size together with softcap
  is refused (TORCH_CHECK). hwkv's decode window lists already hold exactly the visible keys, so a
  layer reading its own window list needs no window argument at all.
- `flash_attn_varlen_func`: is_causal must be True; queries are the last q_len keys of each request; q is
  handed over contiguous (the op's handling of a strided q was never run; the transformers integration passes a
  transposed view);
  window_size_left = W - 1 with window_size_right = 0, and window_size_left = 0 means no window (so
  W = 1 cannot be expressed); softcap works with or without a window; GQA; fp32, bf16, fp16.
- None of the ops takes attention sinks; fp8 caches are e5m2 only with kv_cache_dtype="fp8" (hwkv's
  e4m3fn pools and K/V scales take the torch path); a V head dim unlike K's corrupted the heap in the
  varlen op, so such layers are never handed to IPEX.
The probe, the block tables and the call hwkv_xpu makes are IPEX glue both Intel packages share: they live in
`hwkv_intel.ipex`, and the names the CPU backend uses are re-exported here. Nothing here translates locations.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from hwkv.metadata import KVIndexList
from hwkv.ops import store_kv_torch
from hwkv_intel.ipex import GraphTables, IpexList, IpexOps, installed_reason, load, plan_list

__all__ = ["DTYPES", "GraphTables", "IpexList", "IpexOps", "decode", "decode_window", "extend", "head_mapping",
           "installed_reason", "layer_reason", "load", "plan_list", "status", "store_kv_prechecked", "store_reason"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT32_MAX = 2**31 - 1

# ---- what each op can run ---------------------------------------------------------------------------

def layer_reason(q: torch.Tensor, layer: Any, kv: KVIndexList, k_buf: torch.Tensor, v_buf: torch.Tensor,
                 decode: bool) -> Optional[str]:
    """None when IPEX's op for this mode runs this layer exactly here, else why the layer falls back."""
    if layer.sinks is not None:
        return "IPEX paged attention takes no attention sinks"
    if q.dtype not in DTYPES or not (q.dtype == k_buf.dtype == v_buf.dtype):
        return f"IPEX needs q and the pool in one of fp32/bf16/fp16, got q {q.dtype}, pool {k_buf.dtype}"
    if layer.k_scale not in (None, 1.0) or layer.v_scale not in (None, 1.0):
        return "IPEX scales only e5m2 fp8 caches; K/V scales take the torch path"
    if v_buf.shape[2] != k_buf.shape[2]:
        return f"IPEX needs equal K/V head dims, got {k_buf.shape[2]} and {v_buf.shape[2]}"
    if decode:
        if layer.window is not None and kv.window != layer.window and layer.logit_cap:
            return "single_query_cached_kv_attention refuses a window together with softcap"
    elif layer.window == 1:
        return "flash_attn_varlen_func reads window_size_left=0 (W=1) as no window"
    return None


def decode_window(layer: Any, kv: KVIndexList) -> int:
    """window_size for single_query_cached_kv_attention: -1 when the list holds only visible keys."""
    return -1 if layer.window is None or kv.window == layer.window else int(layer.window)


# ---- the ops, as torch custom ops (opaque to torch.compile; they write only their outputs) -------------

def _cache(buf: torch.Tensor) -> torch.Tensor:
    """The pool [S, KVH, D] as IPEX's CPU cache [num_blocks=S, KVH, block_size=1, D]: a view."""
    return buf.unsqueeze(2)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """k or v [T, KVH, D] as reshape_and_cache reads it: any first two strides, each head's D values one run."""
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("hwkv_cpu::ipex_store_kv", mutates_args=("k_buf", "v_buf"), device_types="cpu")
def _store_op(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
    ops, _ = load()
    # PagedAttention.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, ...):
    # IPEX 2.8.0 llm/modules/mha_fusion.py; int32 slot_mapping, dtypes equal to the cache's
    ops.reshape_and_cache(key=_rows(k), value=_rows(v), key_cache=_cache(k_buf), value_cache=_cache(v_buf),
                          slot_mapping=loc.to(torch.int32), kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0)


@_store_op.register_fake
def _store_fake(*args, **kwargs) -> None:
    return None


@torch.library.custom_op("hwkv_cpu::ipex_decode", mutates_args=("out",), device_types="cpu")
def _decode_op(out: torch.Tensor, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               head_mapping: torch.Tensor, table: torch.Tensor, kv_lens: torch.Tensor, scale: float,
               max_kv: int, window: int, softcap: float) -> None:
    ops, _ = load()
    # PagedAttention.single_query_cached_kv_attention: IPEX 2.8.0 llm/modules/mha_fusion.py (argument
    # names in SIGNATURES); q contiguous, int32 tables, block_size 1 over the [S, KVH, 1, D] view
    ops.single_query_cached_kv_attention(
        output=out, query=q.contiguous(), key_cache=_cache(k_buf), value_cache=_cache(v_buf),
        head_mapping=head_mapping, scale=scale, block_tables=table, context_lens=kv_lens, block_size=1,
        max_context_len=max_kv, alibi_slopes=None, window_size=window, k_scale=1.0, v_scale=1.0,
        softcap=softcap)


@_decode_op.register_fake
def _decode_fake(*args, **kwargs) -> None:
    return None


@torch.library.custom_op("hwkv_cpu::ipex_extend", mutates_args=("out",), device_types="cpu")
def _extend_op(out: torch.Tensor, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               cu_q: torch.Tensor, cu_kv: torch.Tensor, table: torch.Tensor, max_q: int, max_kv: int,
               scale: float, window: int, softcap: float) -> None:
    ops, _ = load()
    # PagedAttention.flash_attn_varlen_func: IPEX 2.8.0 llm/modules/mha_fusion.py; causal only, queries
    # bottom-right aligned, window_size_left = W - 1 (0 would mean none), block_size 1 (strides ignored)
    ops.flash_attn_varlen_func(
        output=out, query=q.contiguous(), key_cache=_cache(k_buf), value_cache=_cache(v_buf), cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_kv, max_seqlen_q=max_q, max_seqlen_kv=max_kv, scale=scale, is_cusal=True,
        block_tables=table, alibi_slopes=None, window_size_left=window - 1 if window > 0 else -1,
        window_size_right=0 if window > 0 else -1, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0,
        softcap=softcap)


@_extend_op.register_fake
def _extend_fake(*args, **kwargs) -> None:
    return None


def decode(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, lst: IpexList, head_mapping: torch.Tensor,
           out: torch.Tensor, scaling: float, window: int, logit_cap: float) -> None:
    """out [B, H, D] for one query per request over its listed keys (window -1: every listed key)."""
    torch.ops.hwkv_cpu.ipex_decode(out, q, k_buf, v_buf, head_mapping, lst.table, lst.kv_lens, float(scaling),
                                   lst.max_kv, window, float(logit_cap) if logit_cap else -1.0)


def extend(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, lst: IpexList, qo_indptr: torch.Tensor,
           max_q: int, out: torch.Tensor, scaling: float, window: Optional[int], logit_cap: float) -> None:
    """out [T, H, D] for each request's queries, the last of its listed keys, causal and windowed by W."""
    torch.ops.hwkv_cpu.ipex_extend(out, q, k_buf, v_buf, qo_indptr, lst.cu_kv, lst.table, int(max_q), lst.max_kv,
                                   float(scaling), int(window or 0), float(logit_cap) if logit_cap else -1.0)


def head_mapping(num_heads: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """int32 [H]: the KV head each q head reads."""
    group = num_heads // num_kv_heads
    return torch.div(torch.arange(num_heads, device=device), group, rounding_mode="floor").to(torch.int32)


# ---- K/V store ----------------------------------------------------------------------------------------

def store_reason(k_buf: torch.Tensor, v_buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_scale: Optional[float], v_scale: Optional[float]) -> Optional[str]:
    """None when reshape_and_cache stores these K/V exactly, else why the torch store runs."""
    if k_scale not in (None, 1.0) or v_scale not in (None, 1.0):
        return "K/V scales"
    if k_buf.dtype not in DTYPES or not (k.dtype == v.dtype == k_buf.dtype == v_buf.dtype):
        return f"dtypes: k {k.dtype}, v {v.dtype}, pool {k_buf.dtype}"
    if v_buf.shape[2] != k_buf.shape[2] or not (k_buf.is_contiguous() and v_buf.is_contiguous()):
        return "V head dim differs from K's, or a strided pool"
    if k_buf.shape[0] > INT32_MAX:
        return "slots past int32"
    return None


def store_kv_prechecked(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, k_scale: Optional[float] = None, v_scale: Optional[float] = None) -> None:
    """The pool's store (loc and shapes already checked by the pool): reshape_and_cache where it stores
    exactly, the torch store otherwise. Registered for "cpu" only when IPEX is installed."""
    if load()[0] is None or store_reason(k_buf, v_buf, k, v, k_scale, v_scale) is not None:
        store_kv_torch(k_buf, v_buf, loc, k, v, k_scale, v_scale)
        return
    torch.ops.hwkv_cpu.ipex_store_kv(k_buf, v_buf, loc, k, v)


def status() -> Tuple[bool, str]:
    """(IPEX paged attention in use, why / what for) for `hwkv info` and the backend."""
    ops, why_not = load()
    if ops is None:
        return False, why_not
    return True, (f"IPEX {ops.version}: single_query_cached_kv_attention for decode of fp32/bf16/fp16 layers with "
                  "equal K/V head dims, no sinks and no K/V scale (not a window over the full list with softcap); "
                  "flash_attn_varlen_func for extend only with ipex_extend=True (slower here), not with W=1")
