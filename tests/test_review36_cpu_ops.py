"""Review 36 (CPU attention path and torch custom ops): defects found in `hwkv_cpu/kernels.py`, `hwkv/ops.py`,
`hwkv_cuda/kernels/torch_ops.py` and `hwkv/reference.py`, each shown by a test that fails on the code as reviewed
and passes once the defect is fixed.

The Triton kernels behind `torch.ops.hwkv.*` run on CPU tensors under TRITON_INTERPRET=1, as in test_torch_ops.py.
"""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hwkv import ops, reference  # noqa: E402
from hwkv.errors import HwkvError, ShapeError  # noqa: E402
from hwkv_cpu import kernels  # noqa: E402

H, KVH, D = 4, 2, 16
I32, I64 = torch.int32, torch.int64


def _decode_case(seed=0):
    """Two requests of 5 and 9 keys at scattered slots of a 32-slot pool, one query each at its last position."""
    g = torch.Generator().manual_seed(seed)
    k_buf, v_buf = torch.randn(32, KVH, D, generator=g), torch.randn(32, KVH, D, generator=g)
    slots = torch.randperm(31, generator=g)[:14] + 1
    q = torch.randn(2, H, D, generator=g)
    return dict(q=q, k_buf=k_buf, v_buf=v_buf, kv_indptr=torch.tensor([0, 5, 14], dtype=I32), kv_indices=slots,
                kv_pos0=torch.zeros(2, dtype=I64), q_pos=torch.tensor([4, 8], dtype=I64))


def _decode_ref(c, scaling, window=None, sinks=None):
    outs = []
    for b, (a, e) in enumerate(((0, 5), (5, 14))):
        s = c["kv_indices"][a:e]
        outs.append(reference.attention(c["q"][b:b + 1], c["k_buf"][s], c["v_buf"][s], c["q_pos"][b:b + 1],
                                        torch.arange(e - a), scaling, window, 0.0, sinks))
    return torch.cat(outs)


# ---- hwkv_cpu.kernels: tensors on another device --------------------------------------------------------------
@pytest.mark.parametrize("name", ["sinks", "q_pos", "kv_pos0"])
def test_cpu_decode_refuses_a_list_or_sinks_tensor_on_another_device(name):
    """The public CPU decode checks the device of q/k_buf/v_buf/out/kv_indices only: sinks, q_pos or kv_pos0 on meta
    send the custom op to its fake kernel, which returns with `out` never written (silently)."""
    c = _decode_case()
    sinks = torch.zeros(H)
    if name == "sinks":
        sinks = sinks.to("meta")
    else:
        c[name] = c[name].to("meta")
    out = torch.full((2, H, D), float("nan"))
    with pytest.raises(ShapeError, match=name):   # as for q on meta: "q is on meta; hwkv_cpu kernels take CPU tensors"
        kernels.decode_attention(c["q"], c["k_buf"], c["v_buf"], c["kv_indptr"], c["kv_indices"], c["kv_pos0"],
                                 c["q_pos"], out, 0.25, None, 0.0, sinks, None, None)


def test_cpu_extend_refuses_q_pos0_on_another_device():
    """The public CPU extend does not check q_pos0's device either: on meta the op's fake runs and `out` stays
    unwritten (the Triton extend's check_same_device names it)."""
    c = _decode_case()
    q = torch.randn(14, H, D)
    out = torch.full((14, H, D), float("nan"))
    with pytest.raises(ShapeError, match="q_pos0"):
        kernels.extend_attention(q, c["k_buf"], c["v_buf"], c["kv_indptr"], c["kv_indices"], c["kv_pos0"],
                                 torch.tensor([0, 5, 14], dtype=I32), torch.zeros(2, dtype=I64, device="meta"), out,
                                 9, 0.25, None, 0.0, None, None, None)


# ---- hwkv_cpu.kernels.extend_attention: max_q_len ------------------------------------------------------------
def test_cpu_extend_refuses_max_q_len_none_with_a_typed_error():
    """max_q_len=None (read as optional, like decode's max_kv_len) skips check_csr_values' bound and then fails
    as a bare TypeError from int(None) in extend_attention."""
    c = _decode_case()
    q = torch.randn(14, H, D)
    out = torch.zeros(14, H, D)
    with pytest.raises(HwkvError, match="max_q_len"):
        kernels.extend_attention(q, c["k_buf"], c["v_buf"], c["kv_indptr"], c["kv_indices"], c["kv_pos0"],
                                 torch.tensor([0, 5, 14], dtype=I32), torch.zeros(2, dtype=I64), out, None, 0.25,
                                 None, 0.0, None, None, None)


# ---- hwkv.ops.store_kv: an empty loc ----------------------------------------------------------------------------
def test_ops_store_kv_checks_k_and_v_against_an_empty_loc():
    """hwkv.ops.store_kv returns on loc.numel() == 0 before its checks: 3 rows of K/V with an empty loc are dropped
    silently, where the checked CPU store and the Triton store raise ShapeError (k has 3 rows, loc 0)."""
    kb, vb = torch.zeros(8, KVH, D), torch.zeros(8, KVH, D)
    k, v = torch.randn(3, KVH, D), torch.randn(3, KVH, D)
    with pytest.raises(ShapeError, match=r"k has shape \[3, 2, 16\], expected \[0, 2, 16\]"):
        ops.store_kv_checked(kb, vb, torch.zeros(0, dtype=I64), k, v)   # the checked store: refused
    with pytest.raises(ShapeError, match=r"k has shape \[3, 2, 16\], expected \[0, 2, 16\]"):
        ops.store_kv(kb, vb, torch.zeros(0, dtype=I64), k, v)


# ---- torch.ops.hwkv.*: the kernels' arguments ---------------------------------------------------------------
def test_torch_op_decode_takes_scaling_none_as_the_kernel_does():
    """docs/architecture.md: the custom ops take the kernels' arguments; decode_attention(scaling=None) means
    1/sqrt(D), but torch.ops.hwkv.decode_attention declares `float scaling` and raises a bare RuntimeError."""
    from conftest import triton_device
    dev = triton_device()   # the interpreter over CPU tensors (CI), else the GPU (a device run)
    from hwkv_cuda.kernels import torch_ops  # noqa: F401  (registers torch.ops.hwkv.*)

    c = _decode_case(1)
    d = {k: v.to(dev) for k, v in c.items()}
    out = torch.zeros(2, H, D, device=dev)
    torch.ops.hwkv.decode_attention(d["q"], d["k_buf"], d["v_buf"], d["kv_indptr"], d["kv_indices"], d["kv_pos0"],
                                    d["q_pos"], out, None, 3)
    torch.testing.assert_close(out.cpu(), _decode_ref(c, 1 / math.sqrt(D), 3), atol=2e-5, rtol=2e-5)


# ---- hwkv.ops.quantize -----------------------------------------------------------------------------------------
def test_quantize_does_what_its_docstring_says():
    """quantize's docstring had said 'always a new tensor', but with x's own dtype and no scale it returns x itself
    (x.to(dtype) is a no-op, which the NPU store relies on every layer: a copy there cost 100x). The docstring now
    says so; a scaled or cast result is new, and x is never written."""
    assert "the result is x itself" in ops.quantize.__doc__
    x = torch.randn(4, KVH, D)
    before = x.clone()
    assert ops.quantize(x, torch.float32, None) is x
    for dtype, scale in ((torch.float32, 0.5), (torch.bfloat16, None), (torch.float8_e4m3fn, 2.0)):
        assert ops.quantize(x, dtype, scale).data_ptr() != x.data_ptr()
    assert torch.equal(x, before)


# ---- hwkv.reference ------------------------------------------------------------------------------------------
def test_reference_attention_positions_as_a_list_are_typed():
    """reference.attention(q_pos=[2, 3, 4]) (positions as a Python list) fails with a bare AttributeError
    ('list' object has no attribute 'dim') from its argument check, not a ShapeError naming q_pos."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(3, 2, 4, generator=g), torch.randn(5, 1, 4, generator=g), torch.randn(5, 1, 3, generator=g)
    want = reference.attention(q, k, v, torch.arange(2, 5), torch.arange(5))
    try:
        got = reference.attention(q, k, v, [2, 3, 4], torch.arange(5))
    except HwkvError as e:   # refused: fine, if it names the argument
        assert "q_pos" in str(e)
        return
    torch.testing.assert_close(got, want)   # or taken as the positions it lists
