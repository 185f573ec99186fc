"""AITER for the ROCm backend: decode through `aiter.paged_attention_ragged`, extend (prefill, chunked
prefill, speculative verify) through `aiter.mha_batch_prefill_func`, each where it computes the layer
exactly as hwkv defines it; `decide` is the one place that says which layer takes which path.

hwkv's index lists are ragged lists of token slots: both ops take them as pages of size 1 (the pool
viewed as [slots, 1, KVH, D] "NHD" for decode, [slots, KVH, D] for prefill), the way SGLang's AITER
backend calls them (sgl-project/sglang python/sglang/srt/layers/attention/aiter_backend.py).

Verified in the vendor's source, not guessed (the stand-ins in hwkv.testing.vendor_schemas.aiter carry
the same schemas and constraints):
- paged_attention_ragged (ROCm/aiter csrc/cpp_itfs/pa/pa_ragged.py): argument order as EXPECTED_PARAMS;
  indptr/indices read as int32; fp16/bf16 query; `logits_soft_cap` applied in the kernel (soft-cap
  layers take it); kv_cache_dtype "fp8"/"fp8_e4m3" reads the cache bytes as the GPU's fp8 with fp32
  per-tensor `k_scale`/`v_scale` (fp8 KV takes it when the pool holds that GPU's fp8: gfx942 reads
  float8_e4m3fnuz, gfx950 float8_e4m3fn, per aiter/utility/dtypes.py); no sink argument (sink layers
  stay on Triton); one head size for Q, K, V. The kernel's support gate (vLLM's
  `use_rocm_custom_paged_attention`): gfx90a/gfx942/gfx950, head size 64 or 128, 1 <= H/KVH <= 16,
  context <= 128K.
- mha_batch_prefill_func (ROCm/aiter aiter/ops/mha.py): q [T, H, D], k/v [pages, KVH, D], cu_seqlens_q,
  kv_indptr, kv_page_indices int32, host max lengths, `logits_soft_cap`, `causal` and
  `window_size=(left, right)` aligned to the bottom-right corner ("python side only support
  mask_enum::bottom_right" in the same file), which is hwkv's window with (W - 1, 0) for any list that
  ends at the request's last key; no sink argument; the cache in the query's dtype (fp8 prefill there
  needs fp8 queries with q_descale, so fp8 extend stays on Triton); non-multiple-of-8 head dims are padded
  by the wrapper (hwkv sends only multiples of 8, so `out` is written in place), CK instances up to 256.
The installed AITER's signatures are compared with these when the backend is built; a mismatch keeps
that op's layers on Triton (`ROCmBackend.aiter_status` says why).

Not called: paged_attention_rocm, pa_fwd_asm, paged_attention_v1 (vLLM's 5-D cache layout or signatures
that changed across releases).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from hwkv.errors import ConfigError
from hwkv.paths import FUSED, TRITON, LayerFacts, LayerPath, layer_facts
from hwkv.window import window_left

EXPECTED_PARAMS = ("out", "workspace_buffer", "query", "key_cache", "value_cache", "scale", "kv_indptr",
                   "kv_page_indices", "kv_last_page_lens", "block_size", "max_num_partitions", "alibi_slopes",
                   "kv_cache_dtype", "kv_cache_layout", "logits_soft_cap", "k_scale", "v_scale",
                   "fp8_out_scale", "partition_size")
PREFILL_POSITIONAL = ("q", "k", "v", "cu_seqlens_q", "kv_indptr", "kv_page_indices", "max_seqlen_q", "max_seqlen_k")
PREFILL_KEYWORDS = ("softmax_scale", "logits_soft_cap", "causal", "window_size", "out")
PARTITION_SIZE = 256
MAX_CONTEXT = 128 * 1024
SUPPORTED_ARCH = ("gfx90a", "gfx942", "gfx950")
ARCH_FP8 = {"gfx942": "float8_e4m3fnuz", "gfx950": "float8_e4m3fn"}  # aiter/utility/dtypes.py
HEAD_SIZES = (64, 128)
MAX_GQA = 16
PREFILL_MAX_HEAD = 256
DTYPES = (torch.float16, torch.bfloat16)
DECODE_OP = "aiter.paged_attention_ragged"
PREFILL_OP = "aiter.mha_batch_prefill_func"


def _param_names(fn: Any) -> Tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a torch op: read its schema instead
        schema = getattr(fn, "_schema", None) or getattr(getattr(fn, "default", None), "_schema", None)
        return tuple(a.name for a in schema.arguments) if schema is not None else ()


def _import_aiter() -> Tuple[Any, str]:
    if importlib.util.find_spec("aiter") is None:
        return None, "aiter is not installed"
    try:
        return importlib.import_module("aiter"), ""
    except ImportError as e:
        raise ConfigError(f"aiter is installed but does not import ({e}); pass aiter=False to use the "
                          "Triton kernels") from e


def load_paged_attention_ragged() -> Tuple[Optional[Callable[..., Any]], str]:
    """(aiter.paged_attention_ragged, "") when AITER is installed with the verified signature,
    else (None, why not). An AITER that is installed but fails to import is an error."""
    aiter, why = _import_aiter()
    if aiter is None:
        return None, why
    fn = getattr(aiter, "paged_attention_ragged", None)
    if fn is None:
        return None, "this aiter has no paged_attention_ragged"
    names = _param_names(fn)
    if names[:len(EXPECTED_PARAMS)] != EXPECTED_PARAMS:
        return None, (f"aiter.paged_attention_ragged takes {list(names)}, not the verified "
                      f"{list(EXPECTED_PARAMS)}")
    return fn, ""


def load_batch_prefill() -> Tuple[Optional[Callable[..., Any]], str]:
    """(aiter.mha_batch_prefill_func, "") when installed with the verified arguments, else (None, why not)."""
    aiter, why = _import_aiter()
    if aiter is None:
        return None, why
    fn = getattr(aiter, "mha_batch_prefill_func", None)
    if fn is None:
        return None, "this aiter has no mha_batch_prefill_func"
    names = _param_names(fn)
    missing = [n for n in PREFILL_KEYWORDS if n not in names]
    if names[:len(PREFILL_POSITIONAL)] != PREFILL_POSITIONAL or missing:
        return None, (f"aiter.mha_batch_prefill_func takes {list(names)}, not the verified "
                      f"{list(PREFILL_POSITIONAL)} + {list(PREFILL_KEYWORDS)}")
    return fn, ""


def gpu_arch(device: torch.device) -> str:
    """The gfx name of a ROCm GPU (e.g. "gfx942")."""
    return torch.cuda.get_device_properties(device).gcnArchName.split(":", 1)[0]


def arch_reason(device: torch.device) -> Optional[str]:
    """None on an AMD GPU the AITER kernels support, else why not."""
    if device.type != "cuda" or not torch.version.hip:
        return f"the pool lives on {device}, not on a ROCm GPU"
    arch = gpu_arch(device)
    if not any(a in arch for a in SUPPORTED_ARCH):
        return f"GPU architecture {arch} is not one of {list(SUPPORTED_ARCH)}"
    return None


@dataclass(frozen=True)
class AiterEnv:
    """What this machine offers: the GPU's architecture and which verified AITER ops are importable."""

    arch: str
    decode: bool
    prefill: bool
    decode_why: str = ""
    prefill_why: str = ""

    @property
    def fp8(self) -> Optional[torch.dtype]:
        name = ARCH_FP8.get(self.arch)
        return getattr(torch, name, None) if name else None


@dataclass(frozen=True)
class AiterOps:
    """The installed AITER's verified ops, each None with why hwkv will not call it."""

    decode: Optional[Callable[..., Any]]
    prefill: Optional[Callable[..., Any]]
    decode_why: str = ""
    prefill_why: str = ""

    def env(self, arch: str) -> AiterEnv:
        """What `decide` reads on a GPU of `arch` with these ops."""
        return AiterEnv(arch, self.decode is not None, self.prefill is not None, self.decode_why, self.prefill_why)


def load_aiter(max_context_len: Optional[int] = None) -> AiterOps:
    """AITER's decode and prefill through the signature checks above; decode only up to MAX_CONTEXT tokens. The
    one loader of ROCmBackend and `hwkv info`, so the two cannot disagree. An aiter that is installed but fails to
    import (whatever it raises) is a ConfigError, chained."""
    try:
        decode, decode_why = load_paged_attention_ragged()
        prefill, prefill_why = load_batch_prefill()
    except ConfigError:
        raise
    except Exception as e:  # an OSError from a HIP library, say: named, never swallowed
        raise ConfigError(f"aiter is installed but does not import ({type(e).__name__}: {e}); pass aiter=False to "
                          "use the Triton kernels") from e
    if decode is not None and max_context_len is not None and max_context_len > MAX_CONTEXT:
        decode, decode_why = None, f"max_context_len {max_context_len} > {MAX_CONTEXT}"
    return AiterOps(decode, prefill, decode_why, prefill_why)


def _kv_cache_dtype(f: LayerFacts, env: AiterEnv) -> Tuple[Optional[str], str]:
    """paged_attention_ragged's kv_cache_dtype for this pool, or (None, why not)."""
    if f.kv_dtype == f.q_dtype:
        return ("auto", "") if not f.scaled else (None, "K/V scales on a non-fp8 pool")
    if f.kv_dtype.itemsize == 1 and f.kv_dtype.is_floating_point:
        if env.fp8 is None:
            return None, f"fp8 KV: {env.arch} has no fp8 paged attention in AITER (gfx942/gfx950 only)"
        if f.kv_dtype != env.fp8:
            return None, (f"fp8 KV: the pool holds {f.kv_dtype} but {env.arch} reads fp8 as {env.fp8} "
                          f"(allocate the pool in {env.fp8})")
        return "fp8", ""
    return None, f"dtypes q={f.q_dtype} kv={f.kv_dtype}"


@functools.lru_cache(maxsize=None)
def decide(f: LayerFacts, env: AiterEnv) -> LayerPath:
    """The path one layer takes on ROCm (the backend per layer and `hwkv info` ask this, nothing else)."""
    if f.sinks:
        op = DECODE_OP if f.mode == "decode" else PREFILL_OP
        return LayerPath(TRITON, "triton", f"sinks: {op} takes no sink argument")
    if f.q_dtype not in DTYPES:
        return LayerPath(TRITON, "triton", f"query dtype {f.q_dtype} (AITER takes fp16/bf16)")
    if f.num_heads % f.num_kv_heads:
        return LayerPath(TRITON, "triton", "query heads not a multiple of KV heads")
    if f.mode == "decode":
        if not env.decode:
            return LayerPath(TRITON, "triton", env.decode_why)
        if not f.list_trimmed:
            return LayerPath(TRITON, "triton", "the index list is not trimmed to the layer's window")
        kv_dtype, why = _kv_cache_dtype(f, env)
        if kv_dtype is None:
            return LayerPath(TRITON, "triton", why)
        if f.head_dim not in HEAD_SIZES or f.v_head_dim != f.head_dim:
            return LayerPath(TRITON, "triton", f"head dims {f.head_dim}/{f.v_head_dim} (paged_attention_ragged: "
                             f"one size, {' or '.join(map(str, HEAD_SIZES))})")
        if not 1 <= f.num_heads // f.num_kv_heads <= MAX_GQA:
            return LayerPath(TRITON, "triton", f"GQA group {f.num_heads // f.num_kv_heads} > {MAX_GQA}")
        notes = [n for n, on in (("soft-cap", f.logit_cap > 0), ("fp8 KV", kv_dtype == "fp8")) if on]
        return LayerPath(FUSED, DECODE_OP, "supported" + (f" ({', '.join(notes)} in the kernel)" if notes else ""))
    if not env.prefill:
        return LayerPath(TRITON, "triton", env.prefill_why)
    if f.kv_dtype != f.q_dtype or f.scaled:
        return LayerPath(TRITON, "triton", f"{'fp8 ' if f.kv_dtype.itemsize == 1 else ''}KV {f.kv_dtype}"
                         f"{' with scales' if f.scaled else ''}: the verified batch prefill reads the cache in "
                         "the query's dtype")
    if f.head_dim % 8 or f.v_head_dim % 8 or max(f.head_dim, f.v_head_dim) > PREFILL_MAX_HEAD:
        return LayerPath(TRITON, "triton", f"head dims {f.head_dim}/{f.v_head_dim} (multiples of 8 up to 256)")
    notes = [n for n, on in (("window (W-1, 0)", f.swa), ("soft-cap", f.logit_cap > 0)) if on]
    return LayerPath(FUSED, PREFILL_OP, "supported" + (f" ({', '.join(notes)} in the kernel)" if notes else ""))


def facts_of(mode: str, q: torch.Tensor, layer: Any, kv: Any, k_buf: torch.Tensor, v_buf: torch.Tensor) -> LayerFacts:
    """A layer's facts from the tensors of this forward."""
    return layer_facts(mode, q, layer, kv, k_buf, v_buf)


class AiterKernels:
    """The verified AITER ops with the buffers they need (grown eagerly, never freed while a captured
    graph may still point at them)."""

    def __init__(self, decode_fn: Optional[Callable[..., Any]], prefill_fn: Optional[Callable[..., Any]],
                 device: torch.device, max_context_len: int) -> None:
        self.decode_fn, self.prefill_fn, self.device = decode_fn, prefill_fn, device
        self.num_partitions = -(-int(max_context_len) // PARTITION_SIZE)
        self.workspace = torch.empty(0, dtype=torch.uint8, device=device)
        self.last_page_lens = torch.ones(0, dtype=torch.int32, device=device)
        self._scales: Dict[float, torch.Tensor] = {}
        self._retired: List[torch.Tensor] = []

    def _scale(self, value: Optional[float]) -> torch.Tensor:
        """A fp32 [1] device tensor holding a K/V scale (one per distinct value, kept for the backend's life)."""
        v = 1.0 if value is None else float(value)
        t = self._scales.get(v)
        if t is None:
            t = self._scales[v] = torch.full((1,), v, dtype=torch.float32, device=self.device)
        return t

    def _scratch(self, bs: int, h: int, d: int) -> Tuple[torch.Tensor, torch.Tensor]:
        need = bs * h * self.num_partitions * (d * 4 + 2 * 4)  # tmp_out (<= 4 B/elem) + exp_sums + max_logits
        if self.workspace.numel() < need:  # grow geometrically: few retired buffers
            self._retired.append(self.workspace)
            self.workspace = torch.empty(max(need, 2 * self.workspace.numel()), dtype=torch.uint8, device=self.device)
        if self.last_page_lens.numel() < bs:
            self._retired.append(self.last_page_lens)
            self.last_page_lens = torch.ones(max(bs, 2 * self.last_page_lens.numel()), dtype=torch.int32,
                                             device=self.device)
        return self.workspace, self.last_page_lens[:bs]

    def decode(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, indptr: torch.Tensor,
               indices_i32: torch.Tensor, out: torch.Tensor, layer: Any) -> None:
        """out [B, H, D] = decode attention of q [B, H, D] over the ragged slot lists (int32)."""
        bs, h, d = q.shape
        kvh = k_buf.shape[1]
        ws, last = self._scratch(bs, h, d)
        kv_cache_dtype = "auto" if k_buf.dtype == q.dtype else "fp8"
        self.decode_fn(out, ws, q.contiguous(), k_buf.view(-1, 1, kvh, d), v_buf.view(-1, 1, kvh, d),
                       float(layer.scaling), indptr, indices_i32, last, 1, self.num_partitions, None, kv_cache_dtype,
                       "NHD", float(layer.logit_cap or 0.0), self._scale(layer.k_scale), self._scale(layer.v_scale),
                       None, PARTITION_SIZE)

    def prefill(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, qo_indptr: torch.Tensor,
                indptr: torch.Tensor, indices_i32: torch.Tensor, max_q_len: int, max_kv_len: int,
                out: torch.Tensor, layer: Any) -> None:
        """out [T, H, Dv] = causal (and windowed) attention of q [T, H, D] over the ragged slot lists."""
        window = (window_left(layer.window), 0) if layer.window is not None else (-1, -1)
        self.prefill_fn(q.contiguous(), k_buf, v_buf, qo_indptr, indptr, indices_i32, int(max(max_q_len, 1)),
                        int(max(max_kv_len, 1)), softmax_scale=float(layer.scaling),
                        logits_soft_cap=float(layer.logit_cap or 0.0), causal=True, window_size=window, out=out)
