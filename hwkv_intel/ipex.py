"""IPEX's paged-attention API as both Intel device packages use it: the probe, the verified signatures, the
per-forward block tables and the varlen call; hwkv_cpu and hwkv_xpu import it, and neither owns it.

IPEX pins torch's major.minor (its __init__ refuses any other), so the probe compares versions from package
metadata before importing anything; `load()` imports IPEX on first use only, so importing this module stays
cheap. Nothing here translates locations: the tables are read off the index lists the core built (SWA slots
already for SWA layers). What each op was measured to do on CPU is in `hwkv_cpu.ipex`.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from hwkv.metadata import KVIndexList, block_table_from_csr, cumsum_into

MODULE = "intel_extension_for_pytorch"
DIST = "intel-extension-for-pytorch"

# Argument names of ipex.llm.modules.PagedAttention in IPEX 2.8.0 (llm/modules/mha_fusion.py); called by
# keyword, so another release's order cannot shift an argument; any other set of names is not called.
SIGNATURES = {
    "reshape_and_cache": ("key", "value", "key_cache", "value_cache", "slot_mapping", "kv_cache_dtype",
                          "k_scale", "v_scale"),
    "single_query_cached_kv_attention": (
        "output", "query", "key_cache", "value_cache", "head_mapping", "scale", "block_tables",
        "context_lens", "block_size", "max_context_len", "alibi_slopes", "window_size", "k_scale",
        "v_scale", "softcap"),
    "flash_attn_varlen_func": (
        "output", "query", "key_cache", "value_cache", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q",
        "max_seqlen_kv", "scale", "is_cusal", "block_tables", "alibi_slopes", "window_size_left",
        "window_size_right", "kv_cache_dtype", "k_scale", "v_scale", "softcap"),
}


# ---- probe -----------------------------------------------------------------------------------------

def _major_minor(version: str) -> str:
    m = re.match(r"(\d+\.\d+)", version)
    return m.group(1) if m else ""


def installed_reason() -> Optional[str]:
    """None when IPEX is installed for this torch (nothing imported), else why not."""
    if importlib.util.find_spec(MODULE) is None:
        return f"{MODULE} is not installed (pip install 'hwkv[ipex]')"
    try:
        version = importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return f"{MODULE} is importable but its distribution {DIST} has no metadata"
    if _major_minor(version) != _major_minor(torch.__version__):
        return f"IPEX {version} needs torch {_major_minor(version)}.*, this is torch {torch.__version__}"
    return None


@dataclass(frozen=True)
class IpexOps:
    """The three `PagedAttention` class methods, their argument names checked against SIGNATURES."""

    reshape_and_cache: Any
    single_query_cached_kv_attention: Any
    flash_attn_varlen_func: Any
    version: str


_LOADED: Optional[Tuple[Optional[IpexOps], str]] = None


def load() -> Tuple[Optional[IpexOps], str]:
    """(the ops, "") when IPEX is installed with the verified API; otherwise (None, why not). Imports IPEX
    at the first call; later calls (the store, per layer) read the kept answer."""
    global _LOADED
    if _LOADED is None:
        _LOADED = _load()
    return _LOADED


def _load() -> Tuple[Optional[IpexOps], str]:
    reason = installed_reason()
    if reason is not None:
        return None, reason
    try:
        import intel_extension_for_pytorch as ipex
        paged = ipex.llm.modules.PagedAttention
    except Exception as e:  # noqa: BLE001 - kept and reported (status), never silent: a broken install raises anything
        return None, f"import {MODULE} failed: {type(e).__name__}: {e}"
    fns = {}
    for name, want in SIGNATURES.items():
        fn = getattr(paged, name, None)
        if fn is None:
            return None, f"IPEX {ipex.__version__}: PagedAttention has no {name}"
        got = tuple(inspect.signature(fn).parameters)
        if got != want:
            return None, f"IPEX {ipex.__version__}: PagedAttention.{name} takes {got}, hwkv verified only {want}"
        fns[name] = fn
    return IpexOps(version=str(ipex.__version__), **fns), ""


# ---- per-forward plan ---------------------------------------------------------------------------------

@dataclass
class IpexList:
    """One index list as IPEX takes it: a block table from the page holding the list's first key."""

    table: torch.Tensor     # int32 [bs, width]: pages (slots when block_size is 1), 0 past the list
    kv_lens: torch.Tensor   # int32 [bs]: keys from the first table entry's start (listed + pos0 % block)
    cu_kv: torch.Tensor     # int32 [bs + 1]: their cumulative sums
    max_kv: int             # host bound on any request's kv_lens


def plan_list(kv: KVIndexList, width: int, block: int = 1, out: Optional["GraphTables"] = None) -> IpexList:
    """The list's block table and lengths: a few torch ops, no host read. With `out` (graph mode) they are
    written into its static buffers' [:bs] rows. With block > 1 the table starts at the page of the first
    listed key, whose earlier keys a window mask must hide (IPEX's window arguments do)."""
    bs = kv.pos0.shape[0]
    table = block_table_from_csr(kv.indptr, kv.indices, kv.pos0, block, width)
    lens = kv.indptr[1:] - kv.indptr[:-1]
    if block > 1:
        lens = lens + (kv.pos0 % block).to(lens.dtype)
    cu = kv.indptr if block == 1 else cumsum_into(lens, torch.empty_like(kv.indptr))
    if out is not None:
        w = kv.window
        table = out.tables[w][:bs].copy_(table)
        lens = out.lens[w][:bs].copy_(lens)
        cu = out.cu[w][:bs + 1].copy_(cu)
    return IpexList(table, lens.to(torch.int32), cu.to(torch.int32), int(kv.max_len) + block - 1)


@dataclass
class GraphTables:
    """Static IPEX tables per list (None: the full list), allocated once per static buffer set (the backend's
    alloc_graph_tables) and shared by every runner; sized for any batch of that set."""

    tables: Dict[Optional[int], torch.Tensor]
    lens: Dict[Optional[int], torch.Tensor]
    cu: Dict[Optional[int], torch.Tensor]

    @classmethod
    def alloc(cls, max_bs: int, max_num_tokens: int, context: int, windows: Tuple[int, ...],
              device: torch.device, block: int = 1) -> "GraphTables":
        keys = {None: context, **{w: min(context, w + max_num_tokens - 1) for w in windows}}
        i32 = dict(dtype=torch.int32, device=device)
        return cls({w: torch.zeros(max_bs, -(-(n + block - 1) // block), **i32) for w, n in keys.items()},
                   {w: torch.zeros(max_bs, **i32) for w in keys},
                   {w: torch.zeros(max_bs + 1, **i32) for w in keys})

    def width(self, window: Optional[int]) -> int:
        return self.tables[window].shape[1]


# ---- Intel GPU (hwkv_xpu, opt-in) ------------------------------------------------------------------------
# Read in the IPEX source, not run (no Intel GPU here): intel/intel-extension-for-pytorch,
# intel_extension_for_pytorch/transformers/models/xpu/fusions/mha_fusion.py, `_IPEXPagedAttentionXPU`:
# - flash_attn_varlen_func takes block_size = k_cache.size(1), i.e. caches [num_blocks, block_size, KVH, D]:
#   hwkv's pool [S, KVH, D] viewed as [S / P, P, KVH, D], no copy; it forwards window_size_left/right and
#   softcap to torch_ipex.chunked_prefill; no sinks argument;
# - an fp8 cache is converted whole (k_cache.to(q.dtype) * k_scale) on every call, and a head dim that is
#   not a multiple of 64 pads every block the table names, also on every call: such layers stay on Triton;
# - single_query_cached_kv_attention there takes a kv dtype before window_size and does not pass
#   window_size on: hwkv_xpu does not call it (decode runs the varlen op with one query per request).
# The window convention (W - 1, as measured on CPU), causal alignment and the block sizes the XPU kernel
# accepts could not be checked here, so hwkv_xpu uses this path only with XPUBackend(..., ipex=True).
XPU_DTYPES = (torch.float16, torch.bfloat16)


def xpu_reason() -> Optional[str]:
    """None when an XPU build of IPEX with the verified API is importable, else why not (imports IPEX)."""
    ops, why_not = load()
    if ops is None:
        return why_not
    if "xpu" not in ops.version:
        return f"IPEX {ops.version} is not an XPU build"
    return None


def xpu_layer_reason(q: torch.Tensor, layer: Any, k_buf: torch.Tensor, v_buf: torch.Tensor) -> Optional[str]:
    """None when IPEX's XPU flash_attn_varlen_func runs this layer without per-call copies, else why not."""
    if layer.sinks is not None:
        return "IPEX paged attention takes no attention sinks"
    if q.dtype not in XPU_DTYPES or not (q.dtype == k_buf.dtype == v_buf.dtype):
        return f"fp16/bf16 q and pool only, got q {q.dtype}, pool {k_buf.dtype}"
    if layer.k_scale not in (None, 1.0) or layer.v_scale not in (None, 1.0):
        return "K/V scales: IPEX XPU converts the whole fp8 cache per call"
    if v_buf.shape[2] != k_buf.shape[2] or k_buf.shape[2] % 64:
        return f"head dims {k_buf.shape[2]}/{v_buf.shape[2]}: IPEX XPU pads every block unless 64 | D = Dv"
    if layer.window == 1:
        return "window_size_left=0 (W=1) reads as no window"
    return None


def xpu_caches(k_buf: torch.Tensor, v_buf: torch.Tensor, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The pool [S, KVH, D] as IPEX's XPU caches [S / P, P, KVH, D]: views, no copy."""
    s, kvh = k_buf.shape[0], k_buf.shape[1]
    return k_buf.view(s // block, block, kvh, k_buf.shape[2]), v_buf.view(s // block, block, kvh, v_buf.shape[2])


def varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lst: IpexList, qo_indptr: torch.Tensor,
           max_q: int, out: torch.Tensor, scaling: float, window: Optional[int], logit_cap: float) -> None:
    """IPEX's flash_attn_varlen_func, called directly on caches in the device's layout (hwkv_xpu: `xpu_caches`)
    with the plan's block tables; decode is one query per request. q is handed over contiguous (a no-op when it
    is): the op's handling of a strided query was never run."""
    ops, _ = load()
    # PagedAttention.flash_attn_varlen_func: IPEX llm/modules/mha_fusion.py (names in SIGNATURES); on XPU
    # transformers/models/xpu/fusions/mha_fusion.py _IPEXPagedAttentionXPU.flash_attn_varlen_func
    ops.flash_attn_varlen_func(
        output=out, query=q.contiguous(), key_cache=k_cache, value_cache=v_cache, cu_seqlens_q=qo_indptr,
        cu_seqlens_kv=lst.cu_kv, max_seqlen_q=int(max_q), max_seqlen_kv=lst.max_kv, scale=float(scaling),
        is_cusal=True, block_tables=lst.table, alibi_slopes=None,
        window_size_left=window - 1 if window else -1, window_size_right=0 if window else -1,
        kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, softcap=float(logit_cap) if logit_cap else -1.0)
