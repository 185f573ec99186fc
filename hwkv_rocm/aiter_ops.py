"""AITER decode for the ROCm backend: `aiter.paged_attention_ragged` over hwkv's token-slot lists.

hwkv's index lists are ragged lists of token slots, which is the ragged kernel with block_size 1
(the pool viewed as [slots, 1, KVH, D], layout "NHD"), the way SGLang's AITER backend calls it.
Decode window lists already hold exactly the visible keys, so the kernel needs no window argument
and no page table is built.

Verified, not guessed:
- argument order, dtypes and workspace: ROCm/aiter csrc/cpp_itfs/pa/pa_ragged.py and
  pa_ragged.cpp.jinja (`paged_attention_ragged(out, workspace_buffer, query, key_cache, value_cache,
  scale, kv_indptr, kv_page_indices, kv_last_page_lens, block_size, max_num_partitions,
  alibi_slopes, kv_cache_dtype, kv_cache_layout, logits_soft_cap, k_scale, v_scale,
  fp8_out_scale=None, partition_size=256, ...)`; indptr and indices are read as int32;
  kv_last_page_lens is unused for block_size 1; one head size for Q, K, V and out; fp16/bf16 with
  kv_cache_dtype "auto"; workspace = exp_sums + max_logits (fp32, S*H*parts each) + tmp_out
  (S*H*parts*D));
- the call pattern: sgl-project/sglang python/sglang/srt/layers/attention/aiter_backend.py
  (`forward_decode`, workspace sizing in `__init__`);
- the kernel's support gate (paged_attention_ll4mi_QKV_mfma16): vLLM's
  `use_rocm_custom_paged_attention` (gfx90a/gfx942/gfx950, fp16/bf16, head size 64 or 128,
  1 <= H/KVH <= 16, context <= 128K, no sinks).
The installed AITER's signature is compared with that list when the backend is built; a
mismatch keeps every layer on Triton (`ROCmBackend.aiter_status` says why).

Not called: paged_attention_rocm, pa_fwd_asm and paged_attention_v1 (vLLM's 5-D key-cache layout,
or signatures that changed across AITER versions, e.g. paged_attention_v1's sliding_window), and
mha_batch_prefill (extend stays on hwkv's Triton kernel).
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import Any, Callable, List, Optional, Tuple

import torch

from hwkv.errors import ConfigError

EXPECTED_PARAMS = ("out", "workspace_buffer", "query", "key_cache", "value_cache", "scale", "kv_indptr",
                   "kv_page_indices", "kv_last_page_lens", "block_size", "max_num_partitions", "alibi_slopes",
                   "kv_cache_dtype", "kv_cache_layout", "logits_soft_cap", "k_scale", "v_scale",
                   "fp8_out_scale", "partition_size")
PARTITION_SIZE = 256
MAX_CONTEXT = 128 * 1024
SUPPORTED_ARCH = ("gfx90a", "gfx942", "gfx950")
HEAD_SIZES = (64, 128)
MAX_GQA = 16
DTYPES = (torch.float16, torch.bfloat16)


def _param_names(fn: Any) -> Tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a torch op: read its schema instead
        schema = getattr(fn, "_schema", None) or getattr(getattr(fn, "default", None), "_schema", None)
        return tuple(a.name for a in schema.arguments) if schema is not None else ()


def load_paged_attention_ragged() -> Tuple[Optional[Callable[..., Any]], str]:
    """(aiter.paged_attention_ragged, "") when AITER is installed with the verified signature,
    else (None, why not). An AITER that is installed but fails to import is an error."""
    if importlib.util.find_spec("aiter") is None:
        return None, "aiter is not installed"
    try:
        aiter = importlib.import_module("aiter")
    except ImportError as e:
        raise ConfigError(f"aiter is installed but does not import ({e}); pass aiter=False to use the "
                          "Triton kernels") from e
    fn = getattr(aiter, "paged_attention_ragged", None)
    if fn is None:
        return None, "this aiter has no paged_attention_ragged"
    names = _param_names(fn)
    if names[:len(EXPECTED_PARAMS)] != EXPECTED_PARAMS:
        return None, (f"aiter.paged_attention_ragged takes {list(names)}, not the verified "
                      f"{list(EXPECTED_PARAMS)}")
    return fn, ""


def arch_reason(device: torch.device) -> Optional[str]:
    """None on an AMD GPU the AITER decode kernel supports, else why not."""
    if device.type != "cuda" or not torch.version.hip:
        return f"the pool lives on {device}, not on a ROCm GPU"
    arch = torch.cuda.get_device_properties(device).gcnArchName
    if not any(a in arch for a in SUPPORTED_ARCH):
        return f"GPU architecture {arch} is not one of {list(SUPPORTED_ARCH)}"
    return None


def layer_reason(q: torch.Tensor, layer: Any, kv: Any, k_buf: torch.Tensor, v_buf: torch.Tensor) -> Optional[str]:
    """None when AITER's decode computes this layer exactly as hwkv defines it, else why not."""
    if layer.sinks is not None:
        return "sinks"
    if layer.k_scale not in (None, 1.0) or layer.v_scale not in (None, 1.0):
        return "K/V scales"
    if layer.window is not None and kv.window != layer.window:
        return "the index list is not trimmed to the layer's window"
    h, d = q.shape[1], q.shape[2]
    kvh = k_buf.shape[1]
    if q.dtype not in DTYPES or k_buf.dtype != q.dtype or v_buf.dtype != q.dtype:
        return f"dtypes q={q.dtype} k={k_buf.dtype} v={v_buf.dtype}"
    if d not in HEAD_SIZES or v_buf.shape[2] != d:
        return f"head dims {d}/{v_buf.shape[2]}"
    if not 1 <= h // kvh <= MAX_GQA:
        return f"GQA group {h // kvh}"
    return None


class AiterDecode:
    """Calls aiter.paged_attention_ragged with the buffers it needs (grown eagerly, never freed while
    a captured graph may still point at them)."""

    def __init__(self, fn: Callable[..., Any], device: torch.device, max_context_len: int) -> None:
        self.fn, self.device = fn, device
        self.num_partitions = -(-int(max_context_len) // PARTITION_SIZE)
        self.scale_one = torch.ones(1, dtype=torch.float32, device=device)
        self.workspace = torch.empty(0, dtype=torch.uint8, device=device)
        self.last_page_lens = torch.ones(0, dtype=torch.int32, device=device)
        self._retired: List[torch.Tensor] = []

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

    def __call__(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, indptr: torch.Tensor,
                 indices_i32: torch.Tensor, out: torch.Tensor, scaling: float, logit_cap: float) -> None:
        """out [B, H, D] = decode attention of q [B, H, D] over the ragged slot lists (int32)."""
        bs, h, d = q.shape
        kvh = k_buf.shape[1]
        ws, last = self._scratch(bs, h, d)
        self.fn(out, ws, q.contiguous(), k_buf.view(-1, 1, kvh, d), v_buf.view(-1, 1, kvh, d), float(scaling),
                indptr, indices_i32, last, 1, self.num_partitions, None, "auto", "NHD", float(logit_cap or 0.0),
                self.scale_one, self.scale_one, None, PARTITION_SIZE)
