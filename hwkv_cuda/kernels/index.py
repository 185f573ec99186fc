"""fill_kv_indices: gather each request's run of slots from req_to_token into a CSR list."""
from __future__ import annotations

from typing import Dict

import torch
import triton
import triton.language as tl

from hwkv.errors import LocError
from hwkv.csr_checks import check_dims, check_same_device
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
    if bs == 0:
        return
    block, warps = (16, 1) if interpreting() else (1024, 4)
    launch(_LAUNCHES, bs, _fill_kv_indices_kernel, (bs,),
           (req_to_token, req_pool_indices, pos0, indptr, out, req_to_token.stride(0)),
           dict(BLOCK=block, num_warps=warps))


_LAUNCHES: Dict[int, Launch] = {}  # planned launches, by request count
