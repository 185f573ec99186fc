"""The whole-step graph's bookkeeping around the allocation in one launch each (`hwkv.ops.StepKernels`).

A captured decode step (`hwkv.step_graph.DecodeStepGraph`) turns the host's staged rows and lengths into
the padded batch, gathers each request's last slot, and after the allocation writes the new slots into
req_to_token and gathers the release frontiers. In torch ops that is about fifteen tiny launches, each a
node of the graph (about 2 us apiece on the H200 at B=1); here it is two.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from hwkv.ops import StepKernels
from hwkv_cuda.kernels.common import request_block
from hwkv_cuda.kernels.launch import Launch, launch


@triton.jit
def _prologue_kernel(ctl, rows_in, seq_in, stride_in, pad_row, req_to_token, stride_rtt, rows, seq, prefix, last,
                     out, bs, TOKENS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < bs
    live = i < tl.load(ctl + 2)
    r = tl.where(live, tl.load(rows_in + i * stride_in, mask=m & live, other=0).to(tl.int64), pad_row)
    s = tl.where(live, tl.load(seq_in + i * stride_in, mask=m & live, other=TOKENS).to(tl.int64), TOKENS)
    p = s - live.to(tl.int64) * TOKENS
    before = tl.load(req_to_token + r * stride_rtt + tl.maximum(p - 1, 0), mask=m, other=0)
    tl.store(rows + i, r, mask=m)
    tl.store(seq + i, s, mask=m)
    tl.store(prefix + i, p, mask=m)
    tl.store(last + i, before.to(tl.int64), mask=m)
    for j in tl.static_range(TOKENS):
        tl.store(out + i * TOKENS + j, tl.zeros([BLOCK], tl.int64), mask=m)


@triton.jit
def _write_kernel(req_to_token, stride_rtt, rows, seq, out, frontiers, f, bs, HAS_F: tl.constexpr,
                  TOKENS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < bs
    r = tl.load(rows + i, mask=m, other=0).to(tl.int64)
    s = tl.load(seq + i, mask=m, other=1).to(tl.int64)
    for j in tl.static_range(TOKENS):
        tl.store(req_to_token + r * stride_rtt + s - TOKENS + j, tl.load(out + i * TOKENS + j, mask=m, other=0),
                 mask=m)
    if HAS_F:
        tl.store(f + i, tl.load(frontiers + r, mask=m, other=0), mask=m)


def step_prologue(ctl: torch.Tensor, rows_in: torch.Tensor, seq_in: torch.Tensor, pad_row: int,
                  req_to_token: torch.Tensor, rows: torch.Tensor, seq: torch.Tensor, prefix: torch.Tensor,
                  last: torch.Tensor, out: torch.Tensor, tokens: int = 1) -> None:
    """`hwkv.ops.StepKernels.prologue` in one launch (rows_in and seq_in may be strided views of one buffer)."""
    bs = rows.shape[0]
    if bs == 0:
        return
    block, programs = request_block(bs)
    launch(_LAUNCHES, ("prologue", bs, block, tokens), _prologue_kernel, (programs,),
           (ctl, rows_in, seq_in, rows_in.stride(0), int(pad_row), req_to_token, req_to_token.stride(0), rows, seq,
            prefix, last, out, bs), dict(TOKENS=int(tokens), BLOCK=block, num_warps=4 if block >= 256 else 1))


def step_write(req_to_token: torch.Tensor, rows: torch.Tensor, seq: torch.Tensor, out: torch.Tensor,
               frontiers: Optional[torch.Tensor], f: Optional[torch.Tensor], tokens: int = 1) -> None:
    """`hwkv.ops.StepKernels.write` in one launch."""
    bs = rows.shape[0]
    if bs == 0:
        return
    block, programs = request_block(bs)
    has_f = frontiers is not None
    launch(_LAUNCHES, ("write", bs, block, has_f, tokens), _write_kernel, (programs,),
           (req_to_token, req_to_token.stride(0), rows, seq, out, frontiers if has_f else out, f if has_f else out,
            bs), dict(HAS_F=has_f, TOKENS=int(tokens), BLOCK=block, num_warps=4 if block >= 256 else 1))


_LAUNCHES: Dict[Tuple, Launch] = {}  # planned launches, by kernel and batch size
KERNELS = StepKernels(step_prologue, step_write)
