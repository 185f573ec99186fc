"""hwkv's Triton kernels as torch custom ops: the same results as the direct calls, and a layer that
calls them compiles with torch.compile(fullgraph=True) (no graph break). Interpreted on CPU in CI."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from hwkv import reference  # noqa: E402
from hwkv_cuda.kernels import torch_ops  # noqa: E402,F401  (registers torch.ops.hwkv.*)

pytestmark = pytest.mark.interpret
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _layer(k_buf, v_buf, loc, q, k, v, indptr, indices, pos0, q_pos, scaling, window):
    """One decode layer as an engine writes it: store the new K/V, attend."""
    torch.ops.hwkv.store_kv(k_buf, v_buf, loc, k, v)
    out = torch.empty(q.shape[0], q.shape[1], v_buf.shape[2], dtype=q.dtype, device=q.device)
    torch.ops.hwkv.decode_attention(q, k_buf, v_buf, indptr, indices, pos0, q_pos, out, scaling, window)
    return out * 1.0


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    s, h, kvh, d, n = 40, 4, 2, 16, 6  # one request, 6 keys in the pool already + 1 new
    k_buf = torch.randn(s, kvh, d, generator=g).to(DEV)
    v_buf = torch.randn(s, kvh, d, generator=g).to(DEV)
    slots = torch.tensor([3, 9, 11, 20, 21, 30, 7], device=DEV)
    q = torch.randn(1, h, d, generator=g).to(DEV)
    k, v = torch.randn(2, 1, kvh, d, generator=g).to(DEV)
    indptr = torch.tensor([0, n + 1], dtype=torch.int32, device=DEV)
    pos0 = torch.zeros(1, dtype=torch.int64, device=DEV)
    q_pos = torch.tensor([n], dtype=torch.int64, device=DEV)
    return k_buf, v_buf, slots[n:], q, k, v, indptr, slots, pos0, q_pos


@pytest.mark.parametrize("window", [None, 3])
def test_ops_match_the_reference(window):
    k_buf, v_buf, loc, q, k, v, indptr, indices, pos0, q_pos = _case()
    out = _layer(k_buf, v_buf, loc, q, k, v, indptr, indices, pos0, q_pos, 0.25, window)
    keys, vals = k_buf[indices].cpu(), v_buf[indices].cpu()
    ref = reference.attention(q.cpu(), keys, vals, q_pos.cpu(), torch.arange(7), 0.25, window)
    assert torch.equal(k_buf[7].cpu(), k[0].cpu())  # the store wrote the new key where it belongs
    assert torch.allclose(out.float().cpu(), ref, atol=2e-5)


def test_a_layer_calling_the_ops_compiles_without_graph_breaks():
    args = _case(1)
    compiled = torch.compile(_layer, fullgraph=True, backend="aot_eager")  # raises on any graph break
    out = compiled(*args, 0.25, 3)
    eager = _layer(*_case(1), 0.25, 3)
    assert torch.allclose(out, eager, atol=1e-6)


def test_extend_op_matches_the_reference():
    g = torch.Generator().manual_seed(2)
    t, h, kvh, d = 5, 4, 2, 16
    k_buf = torch.randn(16, kvh, d, generator=g).to(DEV)
    v_buf = torch.randn(16, kvh, d, generator=g).to(DEV)
    indices = torch.arange(1, t + 1, device=DEV)
    q = torch.randn(t, h, d, generator=g).to(DEV)
    out = torch.empty(t, h, d, device=DEV)
    i32 = dict(dtype=torch.int32, device=DEV)
    torch.ops.hwkv.extend_attention(q, k_buf, v_buf, torch.tensor([0, t], **i32), indices,
                                    torch.zeros(1, dtype=torch.int64, device=DEV), torch.tensor([0, t], **i32),
                                    torch.zeros(1, dtype=torch.int64, device=DEV), out, t, 0.25, 2)
    ref = reference.attention(q.cpu(), k_buf[indices].cpu(), v_buf[indices].cpu(), torch.arange(t), torch.arange(t),
                              0.25, 2)
    assert torch.allclose(out.cpu(), ref, atol=2e-5)
