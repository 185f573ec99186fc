"""fill_kv_indices: gather each request's run of slots from req_to_token into a CSR list."""
from __future__ import annotations

from typing import Dict

import torch
import triton
import triton.language as tl

from hwkv.checks import check_rows, check_tensors, values_checkable
from hwkv.csr_checks import check_dims, check_index_dtypes, check_same_device, indptr_span
from hwkv.errors import LocError
from hwkv_cuda.kernels.common import interpreting
from hwkv_cuda.kernels.launch import Launch, launch


@triton.jit
def _fill_kv_indices_kernel(req_to_token, req_pool_indices, pos0, indptr, out, stride_row,
                            BLOCK: tl.constexpr):
    b = tl.program_id(0)
    start = tl.load(indptr + b).to(tl.int64)
    n = tl.load(indptr + b + 1).to(tl.int64) - start
    row = tl.load(req_pool_indices + b).to(tl.int64)
    src = req_to_token + row * stride_row + tl.load(pos0 + b).to(tl.int64)
    for off in range(0, n, BLOCK):
        j = off + tl.arange(0, BLOCK)
        mask = j < n
        vals = tl.load(src + j, mask=mask)
        tl.store(out + start + j, vals.to(out.dtype.element_ty), mask=mask)


def fill_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, pos0: torch.Tensor,
                    indptr: torch.Tensor, out: torch.Tensor) -> None:
    """out[indptr[b] + j] = req_to_token[req_pool_indices[b], pos0[b] + j], j < indptr[b+1]-indptr[b].

    One program per request, looping over blocks; entries of `out` past indptr[bs] are left
    as they were. Nothing is read back to the host.
    """
    check_tensors(req_to_token=req_to_token, req_pool_indices=req_pool_indices, pos0=pos0, indptr=indptr, out=out)
    check_dims("req_to_token", req_to_token, [None, None])
    bs = req_pool_indices.shape[0] if req_pool_indices.dim() == 1 else -1
    check_dims("req_pool_indices", req_pool_indices, [bs])
    check_dims("pos0", pos0, [bs])
    check_dims("indptr", indptr, [bs + 1])
    check_dims("out", out, [None])
    if out.dtype not in (torch.int64, torch.int32):
        raise LocError(f"out must be an int64 (or int32) tensor, got {out.dtype}")
    check_same_device(req_to_token=req_to_token, req_pool_indices=req_pool_indices, pos0=pos0,
                      indptr=indptr, out=out)
    check_index_dtypes((("req_to_token", req_to_token), ("req_pool_indices", req_pool_indices), ("pos0", pos0),
                        ("indptr", indptr)))
    if bs and values_checkable(indptr):   # (CPU, debug mode: a device read elsewhere) every access in bounds
        _check_fill_values(req_to_token, req_pool_indices, pos0, indptr, out)
    fill_kv_indices_prechecked(req_to_token, req_pool_indices, pos0, indptr, out)


def fill_kv_indices_prechecked(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, pos0: torch.Tensor,
                               indptr: torch.Tensor, out: torch.Tensor) -> None:
    """`fill_kv_indices` without its checks: the core's own per-forward lists (`hwkv.ops.fill_kv_indices`), built
    in bounds, take no host work beyond the launch."""
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    block, warps = (16, 1) if interpreting() else (1024, 4)
    launch(_LAUNCHES, bs, _fill_kv_indices_kernel, (bs,),
           (req_to_token, req_pool_indices, pos0, indptr, out, req_to_token.stride(0)),
           dict(BLOCK=block, num_warps=warps))


def _check_fill_values(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, pos0: torch.Tensor,
                       indptr: torch.Tensor, out: torch.Tensor) -> None:
    """LocError unless indptr ends inside out and every run lies inside its req_to_token row."""
    indptr_span("indptr", indptr, out.shape[0], f"out's {out.shape[0]} entries")
    check_rows(req_pool_indices, req_to_token.shape[0])
    lens = indptr[1:].to(torch.int64) - indptr[:-1].to(torch.int64)
    start = pos0.to(torch.int64)
    end = start + lens
    bad = (start < 0) | (end > req_to_token.shape[1])
    if bool(bad.any()):
        b = int(bad.to(torch.int8).argmax())
        raise LocError(f"request {b} reads positions {int(start[b])}..{int(end[b])} of its req_to_token row, outside "
                       f"[0, {req_to_token.shape[1]}]")


_LAUNCHES: Dict[int, Launch] = {}  # planned launches, by request count
