"""CPU attention kernels over the paged pool: the interface of docs/architecture.md.

`decode_attention` and `extend_attention` check their arguments once, then run as the torch
custom ops `hwkv_cpu::decode_attention` / `hwkv_cpu::extend_attention` (opaque to
torch.compile, which the CPU graph adapter uses; they mutate only `out`). Inside, sgl-kernel's
CPU ops take batches they run exactly (see `hwkv_cpu.amx`); everything else runs the vectorized
torch kernels of `kernels_decode` / `kernels_extend`. Only the CSR list metadata is read on the
host (`tolist`, free on CPU), with what the kernels derive from it per request, once per forward and list
(`hwkv_cpu.host_plan`, through the backend's forward counter `epoch`).

Threads: the torch kernels use as many threads as torch.get_num_threads(), as Python threads
that each run torch single-threaded (`kernels_decode.parallel_map`); while a call runs,
torch.set_num_threads(1) holds process-wide, and the caller's setting is restored on return.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple, Union

import torch

from hwkv.checks import check_attention_options, check_max_q_len, check_shape, check_tensors, scale_value
from hwkv.csr_checks import check_csr_values, check_float_dtypes, check_index_dtypes, check_same_device
from hwkv.errors import ShapeError
from hwkv.spec import TreeMask, check_tree_mask
from hwkv_cpu import amx
from hwkv_cpu.host_plan import HostLists, host_lists
from hwkv_cpu.kernels_decode import Params, decode_torch, key_range
from hwkv_cpu.kernels_extend import extend_torch

Scale = Union[None, float, int, torch.Tensor]

__all__ = ["decode_attention", "extend_attention"]


def _scalars(q: torch.Tensor, scaling: Optional[float], window: Optional[int], logit_cap: Optional[float],
             k_scale: Scale, v_scale: Scale) -> Tuple[float, float, float, int]:
    """(qk_scale, cap, v_scale, window) as the ops take them: scaling * k_scale folded into q
    (divided by the cap when soft-capping), cap 0 = off, window 0 = none."""
    scale = (1.0 / math.sqrt(q.shape[-1]) if scaling is None else float(scaling)) * scale_value("k_scale", k_scale)
    cap = float(logit_cap or 0.0)
    if cap <= 0:
        return scale, 0.0, scale_value("v_scale", v_scale), int(window) if window and window > 0 else 0
    return scale / cap, cap, scale_value("v_scale", v_scale), int(window) if window and window > 0 else 0


def _compute_dtype(k_buf: torch.Tensor, v_buf: torch.Tensor) -> torch.dtype:
    """The matmuls' dtype: the pool's (`amx.compute_dtype`); K and V buffers of different dtypes compute in float32
    (float64 where either is), as the Triton kernels do."""
    if k_buf.dtype == v_buf.dtype:
        return amx.compute_dtype(k_buf.dtype)
    return torch.float64 if torch.float64 in (k_buf.dtype, v_buf.dtype) else torch.float32


def _check_common(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indptr: torch.Tensor,
                  kv_indices: torch.Tensor, kv_pos0: torch.Tensor, out: torch.Tensor,
                  sinks: Optional[torch.Tensor]) -> None:
    check_tensors(q=q, k_buf=k_buf, v_buf=v_buf, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_pos0=kv_pos0,
                  out=out, sinks=sinks)
    check_shape("k_buf", k_buf, [None, None, None])
    slots, kvh, d = k_buf.shape
    check_shape("v_buf", v_buf, [slots, kvh, None])
    check_shape("q", q, [None, None, d])
    n, h = q.shape[0], q.shape[1]
    if h % kvh:
        raise ShapeError(f"q has {h} heads, not a multiple of the pool's {kvh} KV heads")
    check_shape("out", out, [n, h, v_buf.shape[2]])
    bs = kv_pos0.shape[0] if kv_pos0.dim() == 1 else -1
    check_shape("kv_pos0", kv_pos0, [None])
    check_shape("kv_indptr", kv_indptr, [bs + 1])
    check_shape("kv_indices", kv_indices, [None])
    if sinks is not None:
        check_shape("sinks", sinks, [h])
    if q.device.type != "cpu":
        raise ShapeError(f"q is on {q.device}; hwkv_cpu kernels take CPU tensors")
    # every other tensor on q's device, the Triton kernels' rule (a meta one would run the op's do-nothing fake)
    check_same_device(q=q, k_buf=k_buf, v_buf=v_buf, out=out, kv_indices=kv_indices, kv_indptr=kv_indptr,
                      kv_pos0=kv_pos0, sinks=sinks)
    for name, t in (("k_buf", k_buf), ("v_buf", v_buf)):
        if not t.is_contiguous():
            raise ShapeError(f"{name} must be contiguous, got strides {t.stride()}")
    check_index_dtypes((("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_pos0", kv_pos0)))
    check_float_dtypes((("q", q), ("k_buf", k_buf), ("v_buf", v_buf), ("out", out), ("sinks", sinks)))


def _norm_sinks(sinks: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if sinks is None else sinks.detach().to(torch.float32).contiguous()


# ---- custom ops ---------------------------------------------------------------------------

@torch.library.custom_op("hwkv_cpu::decode_attention", mutates_args=("out",), device_types="cpu")
def _decode_op(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indptr: torch.Tensor,
               kv_indices: torch.Tensor, kv_pos0: torch.Tensor, q_pos: torch.Tensor, out: torch.Tensor,
               qk_scale: float, cap: float, v_scale: float, window: int,
               sinks: Optional[torch.Tensor], epoch: Optional[torch.Tensor] = None) -> None:
    host = host_lists(epoch, (kv_indptr, kv_pos0, q_pos), (kv_indices,))
    ptr, pos0, qp = host.lists
    indices = kv_indices.long()
    p = Params(qk_scale, cap, v_scale, window, _compute_dtype(k_buf, v_buf))
    if sinks is None and v_scale == 1.0 and amx.sgl_dtype_ok(q, k_buf, v_buf, out) and out.is_contiguous():
        ops, _ = amx.sgl_ops()
        if ops is not None:
            lists = host.get(("sgl", window), lambda: _sgl_decode_lists(host, kv_indptr, kv_indices, kv_pos0, window))
            if lists is not None:
                amx.sgl_decode(ops, q, k_buf, v_buf, lists, out, qk_scale * cap if cap else qk_scale, cap)
                return
    decode_torch(q, k_buf, v_buf, ptr, indices, pos0, qp, out, p, sinks, plans=host)


def _sgl_decode_lists(host: HostLists, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_pos0: torch.Tensor,
                      window: int) -> Optional[amx.SglLists]:
    """sgl-kernel's tables of a decode list, or None where it would be wrong: it has no window mask, so every
    listed key must be visible (and every request must list one)."""
    ptr, pos0, qp = host.lists
    lens = [ptr[b + 1] - ptr[b] for b in range(len(pos0))]
    if all(n > 0 and key_range(n, pos0[b], qp[b], qp[b], window) == (0, n) for b, n in enumerate(lens)):
        return amx.sgl_lists(ptr, lens, kv_indptr, kv_indices, kv_pos0)
    return None


@_decode_op.register_fake
def _decode_fake(*args, **kwargs) -> None:
    return None


@torch.library.custom_op("hwkv_cpu::extend_attention", mutates_args=("out",), device_types="cpu")
def _extend_op(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indptr: torch.Tensor,
               kv_indices: torch.Tensor, kv_pos0: torch.Tensor, qo_indptr: torch.Tensor,
               q_pos0: torch.Tensor, out: torch.Tensor, max_q_len: int, qk_scale: float, cap: float,
               v_scale: float, window: int, sinks: Optional[torch.Tensor],
               tree_mask: Optional[torch.Tensor] = None, tree_mask_indptr: Optional[torch.Tensor] = None,
               tree_q_positions: Optional[torch.Tensor] = None, epoch: Optional[torch.Tensor] = None) -> None:
    host = host_lists(epoch, (kv_indptr, kv_pos0, qo_indptr, q_pos0), (kv_indices, tree_mask_indptr))
    ptr, pos0, qo, qp0 = host.lists
    indices = kv_indices.long()
    p = Params(qk_scale, cap, v_scale, window, _compute_dtype(k_buf, v_buf))
    if tree_mask is not None:  # sgl-kernel takes no tree mask
        extend_torch(q, k_buf, v_buf, ptr, indices, pos0, qo, qp0, out, p, sinks,
                     tree=TreeMask(tree_mask, tree_mask_indptr, tree_q_positions), plans=host)
        return
    if sinks is None and v_scale == 1.0 and amx.sgl_dtype_ok(q, k_buf, v_buf, out) and out.is_contiguous():
        ops, _ = amx.sgl_ops()
        if ops is not None and q.shape[-1] % 32 == 0 and v_buf.shape[-1] % 32 == 0:
            lists = host.get(("sgl", window), lambda: _sgl_extend_lists(host, kv_indptr, kv_indices, kv_pos0, window))
            if lists is not None:
                amx.sgl_extend(ops, q, k_buf, v_buf, lists, out, max_q_len, qk_scale * cap if cap else qk_scale, cap)
                return
    extend_torch(q, k_buf, v_buf, ptr, indices, pos0, qo, qp0, out, p, sinks, plans=host)


def _sgl_extend_lists(host: HostLists, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_pos0: torch.Tensor,
                      window: int) -> Optional[amx.SglLists]:
    """sgl-kernel's tables of an extend list, or None where it would be wrong: it masks causally only, so lists
    must start at 0, end at the last query, and no query may have a key outside its window."""
    ptr, pos0, qo, qp0 = host.lists
    lens = [ptr[b + 1] - ptr[b] for b in range(len(pos0))]
    if all(pos0[b] == 0 and n == qp0[b] + qo[b + 1] - qo[b] and (not window or n <= window)
           for b, n in enumerate(lens)):
        return amx.sgl_lists(ptr, lens, kv_indptr, kv_indices, kv_pos0, qo)
    return None


@_extend_op.register_fake
def _extend_fake(*args, **kwargs) -> None:
    return None


# ---- public entry points ------------------------------------------------------------------

def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, kv_pos0: torch.Tensor, q_pos: torch.Tensor, out: torch.Tensor,
                     scaling: Optional[float], window: Optional[int], logit_cap: Optional[float],
                     sinks: Optional[torch.Tensor], k_scale: Scale, v_scale: Scale,
                     max_kv_len: Optional[int] = None, *, _own_lists: bool = False,
                     _epoch: Optional[torch.Tensor] = None) -> None:
    """out[b] = softmax(scaling * q[b] . K^T) V over request b's keys visible to position q_pos[b].

    q [B, H, D]; k_buf [S, KVH, D], v_buf [S, KVH, Dv] (fp32, bf16, fp16, fp8; loaded values
    are multiplied by k_scale / v_scale); request b's keys are the slots
    kv_indices[kv_indptr[b]:kv_indptr[b+1]], at positions kv_pos0[b] + j. window None/0:
    causal only; logit_cap > 0: s = cap * tanh(s / cap) after scaling; sinks [H] fp32: one raw
    logit per q head in the denominator. out [B, H, Dv] (any float dtype) is the only tensor
    written; a request with no visible key gets zeros. max_kv_len is accepted for interface
    parity (the GPU split-K bound) and not needed here. (`_own_lists`, `_epoch`: `BackendKernels`' per-layer call,
    whose lists are the forward's own, with the backend's forward counter: `hwkv_cpu.host_plan`.)
    """
    _check_common(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, out, sinks)
    check_tensors(q_pos=q_pos)
    check_shape("q_pos", q_pos, [kv_pos0.shape[0]])
    check_same_device(q=q, q_pos=q_pos)
    check_index_dtypes((("q_pos", q_pos),))
    if q.shape[0] != kv_pos0.shape[0]:
        raise ShapeError(f"q has {q.shape[0]} rows, the index list has {kv_pos0.shape[0]} requests")
    if not _own_lists:   # (the backend's per-layer calls: its layers and lists were checked once)
        check_csr_values(kv_indptr, kv_indices, k_buf.shape[0])
        check_attention_options(scaling, window, logit_cap, sinks)
    if q.shape[0] == 0:
        return
    qk_scale, cap, v_sc, win = _scalars(q, scaling, window, logit_cap, k_scale, v_scale)
    torch.ops.hwkv_cpu.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, q_pos, out,
                                        qk_scale, cap, v_sc, win, _norm_sinks(sinks), _epoch)


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, kv_pos0: torch.Tensor, qo_indptr: torch.Tensor,
                     q_pos0: torch.Tensor, out: torch.Tensor, max_q_len: int, scaling: Optional[float],
                     window: Optional[int], logit_cap: Optional[float], sinks: Optional[torch.Tensor],
                     k_scale: Scale, v_scale: Scale, *, tree: Optional[TreeMask] = None,
                     _own_lists: bool = False, _epoch: Optional[torch.Tensor] = None) -> None:
    """out[t] for query rows t of request b (qo_indptr[b] <= t < qo_indptr[b+1], position
    q_pos0[b] + t - qo_indptr[b]) over the keys of request b visible to it; q [T, H, D],
    out [T, H, Dv]. Everything else as in `decode_attention`. The new tokens' K/V are read from
    the pool (stored before attention runs).

    tree: a verify tree (`hwkv.spec.TreeMask`, checked by `check_tree_mask`): row t sits at position
    tree.q_positions[t] and sees the prefix keys (list positions < q_pos0[b]) inside its window and
    draft key j (list position q_pos0[b] + j) iff the tree's mask says j is t or an ancestor and
    j's position is inside t's window (see hwkv.spec).
    """
    _check_common(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, out, sinks)
    check_tensors(qo_indptr=qo_indptr, q_pos0=q_pos0)
    bs = kv_pos0.shape[0]
    check_shape("qo_indptr", qo_indptr, [bs + 1])
    check_shape("q_pos0", q_pos0, [bs])
    check_index_dtypes((("qo_indptr", qo_indptr), ("q_pos0", q_pos0)))
    check_same_device(q=q, qo_indptr=qo_indptr, q_pos0=q_pos0)
    if not _own_lists:   # (a backend's per-layer call: its plan made max_q_len and the lists, checked once)
        check_max_q_len(max_q_len)
        check_csr_values(kv_indptr, kv_indices, k_buf.shape[0], qo_indptr, q.shape[0], max_q_len)
        check_attention_options(scaling, window, logit_cap, sinks)
    if tree is not None:
        check_tree_mask(tree, q, qo_indptr, q_pos0)
    if q.shape[0] == 0 or bs == 0:
        return
    qk_scale, cap, v_sc, win = _scalars(q, scaling, window, logit_cap, k_scale, v_scale)
    trees = (None, None, None) if tree is None else tuple(tree)
    torch.ops.hwkv_cpu.extend_attention(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0,
                                        out, int(max_q_len), qk_scale, cap, v_sc, win, _norm_sinks(sinks), *trees,
                                        _epoch)


class BackendKernels:
    """`TorchCPUBackend`'s per-layer kernel calls: its lists are the forward's own metadata, built from the batch the
    backend checked once per forward, so each layer checks shapes and dtypes but not the lists' values again (an
    aminmax over every index, up to ~40 us a layer at 64 x 2K keys). `epoch`: the backend's forward counter
    (`hwkv_cpu.host_plan`), so that the layers of a forward share what the ops read of its lists on the host."""

    def __init__(self, epoch: Optional[torch.Tensor] = None) -> None:
        self.epoch = epoch

    def decode_attention(self, *args: Any, **kwargs: Any) -> None:
        decode_attention(*args, _own_lists=True, _epoch=self.epoch, **kwargs)

    def extend_attention(self, *args: Any, **kwargs: Any) -> None:
        extend_attention(*args, _own_lists=True, _epoch=self.epoch, **kwargs)
