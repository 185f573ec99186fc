"""Stand-ins for every vendor op hwkv calls, derived from the vendors' published schemas, in one place.

- `aiter`: aiter.paged_attention_ragged, aiter.mha_batch_prefill_func (ROCm)
- `npu`: torch_npu's fused infer attention (v1, v2, `.out`, max-workspace), _npu_reshape_and_cache, and
  the `torch.npu` graph task-group runtime (Ascend)
- `sgl_kernel`: torch.ops.sgl_kernel.decode_attention_cpu / extend_attention_cpu (CPU)

Each stand-in binds a call against the vendor's argument list (names, kinds, keyword-only), checks the
dtypes, layouts and constraints the vendor documents or asserts, then computes the documented result
in plain torch; any mismatch raises `VendorCallError`, so a wrong call fails in CPU CI. Nothing here
imports a vendor library.
"""
from hwkv.testing.vendor_schemas.core import OpSchema, StandInOp, VendorCallError

__all__ = ["OpSchema", "StandInOp", "VendorCallError"]
