"""Review 38 (window): window-edge correctness and the feature matrix of the attention paths, against hwkv.reference.

What held (not tested again here): a differential hunt of ~3,000 random harness scenarios (chunked prefill with chunks
crossing the window and page edges, decode right after extend, MIXED forwards, tree and chain verify with accept/reject
near the window edge, multi-step drafts, out-of-window release after every step with every free page of both pools
poisoned with NaN) over the CPU backend (dense and chunked kernels, extend and decode-like verify) and the Triton
backend interpreted (extend and decode-like verify), and the graph runners (decode, tree and chain verify, drafts)
through the capture check; W in {1, 2, P - 1, P, P + 1, 2P, 3P + 1, 5, 64} and two windows per model, pages 1/2/4,
GQA groups 1/2/4/8, D != Dv, sinks, soft-cap, fp32/bf16/fp16 and fp8 K/V with scales; and ~800 direct kernel calls
(CPU and Triton decode/extend) with lists at arbitrary kv_pos0 (0 .. 2**33) and queries before, inside and after
their list. What failed is below: one test per defect, each saying what is wrong and what is expected.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hwkv import reference  # noqa: E402
from hwkv.batch import ForwardMode  # noqa: E402
from hwkv.testing.harness import Harness, ModelGeometry  # noqa: E402
from hwkv_cpu.backend import TorchCPUBackend  # noqa: E402

from conftest import triton_device  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

I32, I64 = torch.int32, torch.int64


# ---- 1. the Triton extend kernel's int32 tile mask wraps for a query >= 2**31 positions past a key tile ------------
@pytest.mark.interpret
@pytest.mark.parametrize("window", [None, 2 ** 31 + 90], ids=["no-window", "window-cuts-the-list"])
def test_triton_extend_sees_keys_of_a_query_2_31_positions_past_them(window):
    """Triton extend drops keys >= 2**31 positions before its query (int32 wrap); expected: the reference's output."""
    # extend.py `dq = (q_rel - start).to(tl.int32)` in the MASK32 tile mask wraps negative, so every key of the tile
    # reads as after the query; decode (`_visible_range`: int64, then clamped), the CPU kernels and the NPU torch path
    # see the keys. Reached only by direct kernel calls (the backend's positions stay below max_context_len).
    dev = triton_device()   # the interpreter's CPU here, the GPU on a device run
    from hwkv_cuda.kernels import decode_attention, extend_attention
    g = torch.Generator().manual_seed(0)
    h, kvh, d, n = 4, 2, 16, 20
    k_buf, v_buf = torch.randn(32, kvh, d, generator=g), torch.randn(32, kvh, d, generator=g)
    slots = torch.arange(1, n + 1)
    q_pos = 2 ** 31 + 100          # keys at positions 0..19: all visible, or 11..19 inside the window
    q = torch.randn(1, h, d, generator=g)
    want = reference.attention(q, k_buf[slots], v_buf[slots], torch.tensor([q_pos]), torch.arange(n), 0.25, window)
    args = tuple(t.to(dev) for t in (k_buf, v_buf, torch.tensor([0, n], dtype=I32), slots, torch.zeros(1, dtype=I64)))
    q, pos = q.to(dev), torch.tensor([q_pos], device=dev)
    dec = torch.full((1, h, d), float("nan"), device=dev)
    decode_attention(q, *args, pos, dec, 0.25, window)
    assert (dec.cpu() - want).abs().max().item() < 1e-5, "decode sees them (the extend kernel's counterpart)"
    ext = torch.full((1, h, d), float("nan"), device=dev)
    extend_attention(q, *args, torch.tensor([0, 1], dtype=I32, device=dev), pos, ext, 1, 0.25, window)
    err = (ext.cpu() - want).abs().max().item()
    assert err < 1e-5, f"extend at position {q_pos}: max |out - reference| = {err:.3g} (tolerance 1e-5)"


# ---- 2. the CPU dense kernels read req_to_token entries past a request's length (a finished request's slots) ---------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpu_dense_kernels_do_not_read_a_finished_requests_stale_slots(dtype):
    """CPU dense kernels read a finished request's stale slots past a row's length; expected: listed keys only."""
    # `_table_list` (hwkv/backend.py) pads a shorter request's [bs, max_len] table with its req_to_token row past its
    # length: a finished request's stale locs (or the request's own later draft slots, not yet written). Masked to a
    # zero weight, their non-finite K/V (here inf, as an fp16 overflow leaves) still make the scores NaN (-inf + inf)
    # and 0 * inf = NaN in P @ V. Expected: each request's output depends on its listed keys only (the reference's).
    geo = ModelGeometry(num_layers=2, swa_every=2, window=4, num_heads=2, num_kv_heads=1, head_dim=8)
    h = Harness(TorchCPUBackend, "cpu", geo, size=256, size_swa=64, page_size=1, dtype=dtype)
    a = h.add_request()
    h.forward([a], [8], ForwardMode.EXTEND)
    row = h.requests[a].row
    stale = h.rtt.req_to_token[row, :8].clone()
    h.finish(a)                       # its slots are free; its row keeps its locs past any later length
    full_layer = geo.full_layer_ids[0]
    for buf in (h.pool.get_key_buffer(full_layer), h.pool.get_value_buffer(full_layer)):
        buf[stale] = float("inf")     # what a freed slot holds is not the next request's business
    b, c = h.add_request(), h.add_request()
    assert h.requests[b].row == row, "b takes a's row (its entries past b's length are a's)"
    h.forward([b, c], [3, 6], ForwardMode.EXTEND)   # ReferenceMismatchError (NaN) on the dense path
    h.forward([b, c], [1, 1], ForwardMode.DECODE)   # (so is the decode, once the extend is right)
