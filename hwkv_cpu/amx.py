"""The CPU compute path: the dtype the attention matmuls run in, and when sgl-kernel's CPU ops take over.

- No AMX: bf16/fp16/fp8 pools are upcast to fp32 one key chunk at a time. torch's bf16 CPU
  matmuls and attention run without bf16 hardware here (AVX2): bf16 SDPA measured 6.5-7x
  slower than fp32 SDPA, while the upcast bf16-pool decode runs at fp32 speed.
- AMX (amx_tile + amx_bf16 in /proc/cpuinfo): bf16 and fp8 pools stay in bf16 for the matmuls
  (oneDNN runs them on AMX tiles); fp8 e4m3/e5m2 converts to bf16 exactly. Measured on an AMX
  Xeon, 2 cores: bf16-pool decode 27.4 ms in bf16 vs 33.3 ms upcast (SDPA bf16 19 ms), extend
  325 vs 336 ms. fp16 is upcast to fp32 (AMX-FP16 is a separate, rarer feature and fp16 -> bf16
  would drop mantissa bits). Scores are bf16 on this path (tolerance ~4e-2 relative).
- sgl-kernel installed: its CPU decode/extend ops run the bf16/fp16 batches they can run
  exactly (no sinks, no v_scale, every listed key visible, i.e. no window mask); everything
  else takes the torch path.
- IPEX installed (for this torch): the backend hands the layers its paged-attention ops run exactly
  to them before any of the above (`hwkv_cpu.ipex`); `active_path` names it first.

The CPU probe is `hwkv._amx.cpu_features` (shared with `hwkv info`); nothing here parses
/proc/cpuinfo itself, and sgl_kernel is imported only on first use of its ops.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from hwkv._amx import CPUFeatures, cpu_features
from hwkv.metadata import block_table_from_csr
from hwkv.ops import FP8_DTYPES

_REDUCED = (torch.bfloat16, torch.float16)
_INT32_MAX = 2**31 - 1

# Argument names of the two sgl-kernel schemas this module calls. Verified against
# sgl-project/sglang sgl-kernel/csrc/cpu/torch_extension_cpu.cpp (the m.def strings) and the
# decode.cpp / extend.cpp entry points:
#   decode_attention_cpu(Tensor query, Tensor k_cache, Tensor v_cache, Tensor(a!) output,
#       Tensor key, Tensor value, Tensor loc, Tensor attn_logits, Tensor req_to_token,
#       Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap) -> ()
#     It first writes key/value [B, KVH, D] at k_cache[loc] (one row per request), then attends
#     request b over k_cache[req_to_token[req_pool_indices[b], :seq_lens[b]]] (req_to_token
#     rows are addressed with stride req_to_token.size(1); int32 or int64; seq_lens and
#     req_pool_indices int64); attn_logits is fp32 [B, H, num_kv_splits, Dv + 1] scratch;
#     output [B, H, Dv] has the query's dtype (bf16 or fp16 only).
#   extend_attention_cpu(Tensor q_extend, Tensor k_extend, Tensor v_extend, Tensor(a!) o_extend,
#       Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, Tensor req_pool_indices,
#       Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, int max_len_extend,
#       float sm_scale, float logit_cap) -> ()
#     Prefix keys (the first seq_len - extend_len of the row) come from the buffers, the
#     request's own new keys from k_extend/v_extend [T, KVH, D] with a causal mask.
# Other releases changed these schemas (a 10-argument decode without key/value/loc; decode and
# extend with K/V scales, cross attention and sliding-window arguments), so the schema
# is compared by argument names at first use and any other form is not called.
_DECODE_SCHEMA = ("query", "k_cache", "v_cache", "output", "key", "value", "loc", "attn_logits",
                  "req_to_token", "req_pool_indices", "seq_lens", "sm_scale", "logit_cap")
_EXTEND_SCHEMA = ("q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer",
                  "req_to_token", "req_pool_indices", "seq_lens", "extend_seq_lens",
                  "extend_start_loc", "max_len_extend", "sm_scale", "logit_cap")
SGL_NUM_KV_SPLITS = 8


@functools.lru_cache(maxsize=None)
def features() -> CPUFeatures:
    """The CPU probe, once per process."""
    return cpu_features()


def compute_dtype(buf_dtype: torch.dtype) -> torch.dtype:
    """The dtype the QK^T and PV matmuls run in for a pool of `buf_dtype`."""
    if buf_dtype == torch.float64:
        return torch.float64
    if features().amx and (buf_dtype == torch.bfloat16 or buf_dtype in FP8_DTYPES):
        return torch.bfloat16
    return torch.float32


@dataclass(frozen=True)
class SglOps:
    """sgl-kernel's CPU attention ops, with schemas checked against the ones above."""

    decode: Any
    extend: Any


def _schema_names(op: Any) -> tuple:
    names = tuple(a.name for a in op.default._schema.arguments)
    return tuple("v_cache" if n == "v_cahce" else n for n in names)  # a released schema spells it so


@functools.lru_cache(maxsize=None)
def sgl_ops() -> tuple[Optional[SglOps], str]:
    """(sgl-kernel's ops, "") when installed with a verified schema; otherwise (None, why not)."""
    if not features().sgl_kernel:
        return None, "sgl_kernel is not installed"
    try:
        import sgl_kernel  # noqa: F401  (registers torch.ops.sgl_kernel)
    except Exception as e:  # noqa: BLE001 - an installed but broken sgl-kernel raises anything (an op registered
        # twice, a torch version check): kept and reported by active_path(), never silent, as the NPU and ROCm
        # packages report theirs
        return None, f"import sgl_kernel failed: {type(e).__name__}: {e}"
    ns = torch.ops.sgl_kernel
    ops = {}
    for name, want in (("decode_attention_cpu", _DECODE_SCHEMA), ("extend_attention_cpu", _EXTEND_SCHEMA)):
        if not hasattr(ns, name):
            return None, f"sgl_kernel has no op {name}"
        got = _schema_names(getattr(ns, name))
        if got != want:
            return None, f"sgl_kernel.{name} takes {got}, hwkv verified only {want}"
        ops[name] = getattr(ns, name)
    return SglOps(ops["decode_attention_cpu"], ops["extend_attention_cpu"]), ""


def sgl_dtype_ok(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, out: torch.Tensor) -> bool:
    """sgl-kernel runs one reduced dtype end to end: query, pool and output alike (and `sgl_lists`' tables hold
    the pool's slots as int32 on their way)."""
    return (q.dtype in _REDUCED and q.dtype == k_buf.dtype == v_buf.dtype == out.dtype
            and k_buf.shape[0] <= _INT32_MAX)


@dataclass(frozen=True)
class SglLists:
    """What sgl-kernel's ops read of one forward's index list (`sgl_lists`: made once per forward and list, reused
    by every layer's call)."""

    req_to_token: torch.Tensor  # int64 [bs, max_len]: row b = request b's slots, 0-padded
    rows: torch.Tensor          # int64 [bs]: request b reads row b
    seq_lens: torch.Tensor      # int64 [bs]
    loc: torch.Tensor           # int64 [bs] zeros: decode's store goes to the padding slot 0
    new_slots: Optional[torch.Tensor] = None      # extend: int64 [T], the slots of each request's new tokens
    extend_lens: Optional[torch.Tensor] = None    # extend: int64 [bs]
    extend_starts: Optional[torch.Tensor] = None  # extend: int64 [bs], qo_indptr[:-1]


def sgl_lists(indptr: list, lens: list, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_pos0: torch.Tensor,
              qo_indptr: Optional[list] = None) -> SglLists:
    """The tables of a CSR list (host copies indptr and lens of kv_indptr) for sgl-kernel; qo_indptr: extend's."""
    bs = len(lens)
    # the core's table with page size 1 (entry j = the list's slot j, 0 past it), widened to the int64 the calls
    # above were checked with (int32 slots: callers keep pools within INT32_MAX slots on this path)
    table = block_table_from_csr(kv_indptr, kv_indices, kv_pos0, 1, max(max(lens), 1)).long()
    i64 = dict(dtype=torch.int64, device="cpu")
    rows, seq, loc = torch.arange(bs, **i64), torch.tensor(lens, **i64), torch.zeros(bs, **i64)
    if qo_indptr is None:
        return SglLists(table, rows, seq, loc)
    ext = [qo_indptr[b + 1] - qo_indptr[b] for b in range(bs)]
    new_slots = torch.cat([kv_indices[indptr[b] + lens[b] - ext[b]: indptr[b] + lens[b]] for b in range(bs)])
    return SglLists(table, rows, seq, loc, new_slots.long(), torch.tensor(ext, **i64),
                    torch.tensor(qo_indptr[:-1], **i64))


def sgl_decode(ops: SglOps, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, lists: SglLists,
               out: torch.Tensor, scaling: float, logit_cap: float) -> None:
    """Decode through sgl-kernel; every request has >= 1 key and all of its listed keys are visible."""
    bs, h, _ = q.shape
    # The op first stores key/value at k_buf[loc]: hand it slot 0 (the padding slot) and the
    # bytes already there, so the pool is left exactly as it was.
    key, value = k_buf[lists.loc], v_buf[lists.loc]
    logits = torch.empty(bs, h, SGL_NUM_KV_SPLITS, v_buf.shape[2] + 1, dtype=torch.float32, device="cpu")
    ops.decode(q.contiguous(), k_buf, v_buf, out, key, value, lists.loc, logits, lists.req_to_token, lists.rows,
               lists.seq_lens, scaling, logit_cap)


def sgl_extend(ops: SglOps, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, lists: SglLists,
               out: torch.Tensor, max_q_len: int, scaling: float, logit_cap: float) -> None:
    """Extend through sgl-kernel; every list starts at position 0 and ends at its last query."""
    ops.extend(q.contiguous(), k_buf[lists.new_slots], v_buf[lists.new_slots], out, k_buf, v_buf,
               lists.req_to_token, lists.rows, lists.seq_lens, lists.extend_lens, lists.extend_starts,
               int(max_q_len), scaling, logit_cap)


def active_path() -> tuple[str, str]:
    """(the CPU attention path hwkv_cpu takes, why). Imports sgl_kernel only when it is installed."""
    f = features()
    bf16 = "bf16 on AMX tiles" if f.amx else f"fp32 ({f.capability}, no AMX: {f.reason})"
    torch_path = f"torch matmul: fp32 pools in fp32, bf16/fp8 pools in {bf16}"
    ops, why_not = sgl_ops()
    if ops is not None:
        name, why = ("sgl-kernel CPU ops",
                     "sgl_kernel installed: bf16/fp16 batches without sinks, K/V scales or window masks use "
                     f"decode_attention_cpu/extend_attention_cpu; the rest: {torch_path}")
    else:
        name, why = ("torch matmul (AMX bf16)" if f.amx else "torch matmul (fp32 upcast)", f"{why_not}; {torch_path}")
    from hwkv_cpu import ipex  # imports IPEX only when it is installed for this torch

    in_use, ipex_why = ipex.status()
    if in_use:
        return "IPEX paged attention", f"{ipex_why}; the other layers: {name} ({why})"
    return name, f"{why}; IPEX: {ipex_why}"

