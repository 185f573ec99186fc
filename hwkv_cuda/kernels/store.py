"""store_kv: one Triton launch writes the K and V rows of every new token into the pool.

k_buf[loc[i]] = k[i] / k_scale cast to k_buf.dtype (fp8 buffers: clamped to the finite
range first), the same for V. The caller's k and v are only read.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from hwkv.csr_checks import check_store
from hwkv_cuda.kernels.common import FP8_MAX, as_scale, next_pow2
from hwkv_cuda.kernels.launch import Launch, launch, spec


@dataclass(frozen=True)
class StoreConfig:
    """Tokens per program (None: about 4096 elements per tile) and warps."""

    block_t: Optional[int] = None
    num_warps: int = 4


@triton.jit
def _store_rows(buf, src, loc, rows, mask_t, scale, stride_bs, stride_bh, stride_sn, stride_sh,
                KVH: tl.constexpr, D: tl.constexpr, BLOCK_E: tl.constexpr,
                HAS_SCALE: tl.constexpr, CLAMP: tl.constexpr):
    """Copy rows [BLOCK_T] x (KVH*D) of `src` to buf[loc[rows]], scaled and cast."""
    e = tl.arange(0, BLOCK_E)
    h = e // D
    d = e % D
    mask = mask_t[:, None] & (e < KVH * D)[None, :]
    x = tl.load(src + rows[:, None] * stride_sn + (h * stride_sh + d)[None, :], mask=mask)
    if HAS_SCALE:
        x = tl.math.div_rn(x.to(tl.float32), scale)  # IEEE division: bit-equal to torch x / scale
    if CLAMP > 0:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -CLAMP), CLAMP)
    slot = tl.load(loc + rows, mask=mask_t, other=0).to(tl.int64)
    tl.store(buf + slot[:, None] * stride_bs + (h * stride_bh + d)[None, :],
             x.to(buf.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n"])  # the token count: one compile, whatever the batch
def _store_kv_kernel(k, v, sk_n, sk_h, sv_n, sv_h,                            # a call's
                     k_buf, v_buf, k_scale, v_scale, skb_s, skb_h, svb_s, svb_h,  # a pool layer's (_BUFFER_AT)
                     loc, n,                                                 # a forward's (_FORWARD_AT)
                     KVH: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_EK: tl.constexpr, BLOCK_EV: tl.constexpr,
                     K_SCALE: tl.constexpr, V_SCALE: tl.constexpr,
                     K_CLAMP: tl.constexpr, V_CLAMP: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = rows < n
    _store_rows(k_buf, k, loc, rows, mask_t, k_scale, skb_s, skb_h, sk_n, sk_h,
                KVH, D, BLOCK_EK, K_SCALE, K_CLAMP)
    _store_rows(v_buf, v, loc, rows, mask_t, v_scale, svb_s, svb_h, sv_n, sv_h,
                KVH, DV, BLOCK_EV, V_SCALE, V_CLAMP)


# Triton decided when it decorated the kernel whether it interprets it; the launch sizes follow that
_INTERPRETED = not isinstance(_store_kv_kernel, triton.runtime.JITFunction)


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, k_scale: Optional[float] = None, v_scale: Optional[float] = None, *,
             config: Optional[StoreConfig] = None) -> None:
    """k_buf[loc] = k / k_scale, v_buf[loc] = v / v_scale, cast to the buffers' dtypes; one launch.

    k_buf [S, KVH, D], v_buf [S, KVH, Dv]; loc int64 [n], stride 1; k [n, KVH, D], v [n, KVH, Dv] (any
    row/head strides, contiguous last dim). fp8 buffers are clamped to their finite range.
    n == 0 launches nothing. k and v are never written.
    """
    check_store(k_buf, v_buf, loc, k, v)
    if loc.shape[0] == 0:
        return
    _launch(k_buf, v_buf, loc, k, v, k_scale, v_scale, config)


def store_kv_prechecked(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, k_scale: Optional[float] = None, v_scale: Optional[float] = None) -> None:
    """`store_kv` for a caller that checked `loc` (1-D int64 of stride 1 on the buffers' device: `hwkv.checks.check_loc`)
    and the k/v shapes, as the pool does once per forward (`hwkv.ops.register_store_kv(..., prechecked=...)`). What
    the caller cannot know is compared here (a strided last dim, k/v on another device): such calls take the
    checked path, which raises the usual typed error."""
    kt, vt = k.stride(), v.stride()  # read once: the check and the launch share them
    dev = k_buf.get_device()
    if ((kt[-1] != 1 and k.shape[-1] > 1) or (vt[-1] != 1 and v.shape[-1] > 1)
            or k.get_device() != dev or v.get_device() != dev):
        store_kv(k_buf, v_buf, loc, k, v, k_scale, v_scale)
        return
    if loc.shape[0]:
        _launch(k_buf, v_buf, loc, k, v, k_scale, v_scale, None, True, kt, vt)


@functools.lru_cache(maxsize=None)
def _launch_config(kvh: int, d: int, dv: int, k_dtype: torch.dtype, v_dtype: torch.dtype,
                   config: Optional[StoreConfig]) -> Tuple[int, int, int, int, float, float]:
    """(block_t, warps, block_ek, block_ev, k clamp, v clamp) of one buffer geometry, computed once."""
    block_ek = next_pow2(kvh * d)
    block_ev = next_pow2(kvh * dv)
    if _INTERPRETED:
        block_t, warps = 4, 1
    else:
        cfg = config or StoreConfig()
        block_t = cfg.block_t or max(1, min(16, 4096 // max(block_ek, block_ev)))
        warps = cfg.num_warps
    return block_t, warps, block_ek, block_ev, FP8_MAX.get(k_dtype, 0.0), FP8_MAX.get(v_dtype, 0.0)


_BUFFER_AT, _FORWARD_AT = 6, 14   # where the kernel's parameters of a pool layer and of a forward begin


def _buffer_part(k_buf, v_buf, ks, vs, kept) -> Tuple[Tuple[Any, ...], Optional[Tuple[Any, ...]], Tuple[Any, ...]]:
    """(the kernel's arguments of a pool layer, their spec, the launch key's part): the spec and key kept across
    calls by the buffers' identity for a pool's own buffers (`kept`; weak references, and the entry holds no
    tensor: a freed pool's buffers are not held); made afresh, without spec (the launch compares every
    argument), for a public call."""
    if kept:
        entry = _BUFFERS.get(id(k_buf))
        if entry is not None and entry[0]() is k_buf and entry[1]() is v_buf and entry[2] == (ks, vs):
            return (k_buf, v_buf) + entry[3], entry[4], entry[5]
    kb, vb = k_buf.stride(), v_buf.stride()
    rest = (ks, vs, kb[0], kb[1], vb[0], vb[1])
    args = (k_buf, v_buf) + rest
    found = spec(_store_kv_kernel, args, _BUFFER_AT) if kept else None
    key = (k_buf.shape, v_buf.shape[2], k_buf.dtype, v_buf.dtype, ks != 1.0, vs != 1.0)
    if kept:
        if len(_BUFFERS) >= 256:
            _BUFFERS.clear()
        _BUFFERS[id(k_buf)] = (weakref.ref(k_buf), weakref.ref(v_buf), (ks, vs), rest, found, key)
    return args, found, key


def _launch(k_buf, v_buf, loc, k, v, k_scale, v_scale, config, kept=False, kt=None, vt=None) -> None:
    """The one launch. Its arguments come in three parts (a call's k and v, a pool layer's buffers and scales, a
    forward's locs); a pool's buffers part is made once (`kept`), so a layer's store compares two specs."""
    n = loc.shape[0]
    ks = 1.0 if k_scale is None else as_scale(k_scale, "k_scale")
    vs = 1.0 if v_scale is None else as_scale(v_scale, "v_scale")
    if kt is None:
        kt, vt = k.stride(), v.stride()
    call = (k, v, kt[0], kt[1], vt[0], vt[1])
    buffer_args, buffer_spec, buffer_key = _buffer_part(k_buf, v_buf, ks, vs, kept)
    forward = (loc, n)
    args = call + buffer_args + forward
    # the buffers' geometry fixes the rest of the key: a layer's store is one dict lookup and the launch
    key = (n, config, buffer_key)
    planned = _LAUNCHES.get(key)
    if planned is not None:
        if buffer_spec is not None:
            planned.parts(args, (buffer_spec,))
        else:
            planned(*args)
        return
    kvh, d, dv = k_buf.shape[1], k_buf.shape[2], v_buf.shape[2]
    block_t, warps, block_ek, block_ev, k_clamp, v_clamp = _launch_config(
        kvh, d, dv, k_buf.dtype, v_buf.dtype, config)
    launch(_LAUNCHES, key, _store_kv_kernel, (-(-n // block_t),), args,
           dict(KVH=kvh, D=d, DV=dv, BLOCK_T=block_t, BLOCK_EK=block_ek, BLOCK_EV=block_ev,
                K_SCALE=ks != 1.0, V_SCALE=vs != 1.0, K_CLAMP=k_clamp, V_CLAMP=v_clamp, num_warps=warps),
           ((_BUFFER_AT, _FORWARD_AT),))


# planned launches of the store, by token count and buffer geometry (the layers of a forward share one)
_LAUNCHES: Dict[Tuple, Launch] = {}
# a pool layer's part of the launch, by id(k_buf): see _buffer_part
_BUFFERS: Dict[int, Tuple[Any, ...]] = {}
