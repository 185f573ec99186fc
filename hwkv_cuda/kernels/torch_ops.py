"""hwkv's Triton kernels as torch custom ops (`torch.ops.hwkv.*`), so a model compiled with
`torch.compile(fullgraph=True)` calls them without a graph break.

Each op writes into tensors the caller owns (declared in `mutates_args`) and returns nothing, so
its fake implementation is a no-op: the compiler sees the mutation and the shapes it already has.
The backend itself calls the kernels directly (a custom op adds a dispatcher hop per call on the
hot path); these are for engines that compile their own layers around hwkv's kernels.
"""
from __future__ import annotations

from typing import Optional

import torch

from hwkv.errors import ShapeError
from hwkv.spec import TreeMask
from hwkv_cuda.kernels.decode import decode_attention
from hwkv_cuda.kernels.extend import extend_attention
from hwkv_cuda.kernels.store import store_kv


@torch.library.custom_op("hwkv::store_kv", mutates_args=("k_buf", "v_buf"))
def store_kv_op(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_scale: Optional[float] = None, v_scale: Optional[float] = None) -> None:
    """k_buf[loc] = k / k_scale, v_buf[loc] = v / v_scale (see hwkv_cuda.kernels.store_kv)."""
    store_kv(k_buf, v_buf, loc, k, v, k_scale, v_scale)


@store_kv_op.register_fake
def _(k_buf, v_buf, loc, k, v, k_scale=None, v_scale=None) -> None:
    return None


@torch.library.custom_op("hwkv::decode_attention", mutates_args=("out",))
def decode_attention_op(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indptr: torch.Tensor,
                        kv_indices: torch.Tensor, kv_pos0: torch.Tensor, q_pos: torch.Tensor, out: torch.Tensor,
                        scaling: Optional[float], window: Optional[int] = None, logit_cap: float = 0.0,
                        sinks: Optional[torch.Tensor] = None, k_scale: Optional[float] = None,
                        v_scale: Optional[float] = None, max_kv_len: Optional[int] = None) -> None:
    """One query per request over its listed keys into `out` (see hwkv_cuda.kernels.decode_attention)."""
    decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, q_pos, out, scaling, window, logit_cap,
                     sinks, k_scale, v_scale, max_kv_len)


@decode_attention_op.register_fake
def _(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, q_pos, out, scaling, window=None, logit_cap=0.0,
      sinks=None, k_scale=None, v_scale=None, max_kv_len=None) -> None:
    return None


@torch.library.custom_op("hwkv::extend_attention", mutates_args=("out",))
def extend_attention_op(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indptr: torch.Tensor,
                        kv_indices: torch.Tensor, kv_pos0: torch.Tensor, qo_indptr: torch.Tensor,
                        q_pos0: torch.Tensor, out: torch.Tensor, max_q_len: int, scaling: Optional[float],
                        window: Optional[int] = None, logit_cap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                        k_scale: Optional[float] = None, v_scale: Optional[float] = None,
                        tree_mask: Optional[torch.Tensor] = None, tree_mask_indptr: Optional[torch.Tensor] = None,
                        tree_q_positions: Optional[torch.Tensor] = None) -> None:
    """Causal (+ window) query runs over their listed keys into `out` (see hwkv_cuda.kernels.extend_attention);
    a verify tree as its three tensors (the fields of hwkv.spec.TreeMask: all three or none)."""
    extend_attention(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0, out, max_q_len, scaling,
                     window, logit_cap, sinks, k_scale, v_scale,
                     tree=_tree(tree_mask, tree_mask_indptr, tree_q_positions))


@extend_attention_op.register_fake
def _(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0, out, max_q_len, scaling, window=None,
      logit_cap=0.0, sinks=None, k_scale=None, v_scale=None, tree_mask=None, tree_mask_indptr=None,
      tree_q_positions=None) -> None:
    _tree(tree_mask, tree_mask_indptr, tree_q_positions)
    return None


def _tree(mask: Optional[torch.Tensor], mask_indptr: Optional[torch.Tensor],
          q_positions: Optional[torch.Tensor]) -> Optional[TreeMask]:
    given = [t is not None for t in (mask, mask_indptr, q_positions)]
    if not any(given):
        return None
    if not all(given):
        raise ShapeError("a verify tree takes tree_mask, tree_mask_indptr and tree_q_positions together; got "
                         + ", ".join(n for n, g in zip(("tree_mask", "tree_mask_indptr", "tree_q_positions"), given)
                                     if g) + " only")
    return TreeMask(mask, mask_indptr, q_positions)
