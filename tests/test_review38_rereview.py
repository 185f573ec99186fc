"""Review 38 (re-review of this session's fixes: the prefix cache's cleared rows, the CPU dense plan's stale
table entries, the Triton extend kernel's clamped int32 tile mask, the CLI's closed streams, bench serve's device).

The fixes held (see the report). The regression they caused is in an existing test
(tests/test_review28_packaging.py: its serve_hwkv stub takes no `device`), so it is not repeated here. What is
below was found while checking the Triton mask fix's variants: one test per defect, each stating what is expected.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hwkv import reference  # noqa: E402
from hwkv.errors import HwkvError  # noqa: E402

from conftest import triton_device  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

I32, I64 = torch.int32, torch.int64


# ---- 1. the Triton kernels see keys at negative positions, which the CPU kernels and the reference hide -------------
@pytest.mark.interpret
@pytest.mark.parametrize("kernel", ["decode", "extend"])
def test_triton_kernels_treat_a_negative_kv_pos0_as_the_cpu_kernels_and_the_reference(kernel):
    """Triton decode/extend with kv_pos0 < 0 attend to keys at negative positions; expected: a typed refusal or the
    reference's output (the CPU kernels give the reference's)."""
    # hwkv.window.first_visible clamps at 0, so the reference (and hwkv_cpu.kernels.decode_attention /
    # extend_attention, which match it to 2e-7 here) hide the 5 keys at positions -5..-1; the Triton kernels take
    # kv_pos0 as given and fold them in (max |out - reference| ~0.8), and nothing refuses the negative kv_pos0
    # (check_csr_values checks indptr/indices only). A direct caller computing pos0 = q_pos - W + 1 unclamped gets
    # one answer on the CPU and another on a GPU.
    dev = triton_device()   # the interpreter's CPU here, the GPU on a device run
    from hwkv_cuda.kernels import decode_attention, extend_attention
    g = torch.Generator().manual_seed(1)
    h, kvh, d, n, kv_pos0 = 4, 2, 16, 20, -5
    k_buf, v_buf = torch.randn(32, kvh, d, generator=g), torch.randn(32, kvh, d, generator=g)
    slots = torch.arange(1, n + 1)
    q_pos = kv_pos0 + n - 1        # the query is the list's last key: keys at -5..14, of which 0..14 visible
    q = torch.randn(1, h, d, generator=g)
    want = reference.attention(q, k_buf[slots], v_buf[slots], torch.tensor([q_pos]),
                               torch.arange(kv_pos0, kv_pos0 + n), 0.25, None)
    args = tuple(t.to(dev) for t in (k_buf, v_buf, torch.tensor([0, n], dtype=I32), slots,
                                     torch.tensor([kv_pos0], dtype=I64)))
    q, pos = q.to(dev), torch.tensor([q_pos], device=dev)
    out = torch.full((1, h, d), float("nan"), device=dev)
    try:
        if kernel == "decode":
            decode_attention(q, *args, pos, out, 0.25, None)
        else:
            extend_attention(q, *args, torch.tensor([0, 1], dtype=I32, device=dev), pos, out, 1, 0.25, None)
    except HwkvError:
        return   # a typed refusal of the negative kv_pos0 is a correct answer too
    err = (out.cpu() - want).abs().max().item()
    assert err < 1e-5, f"{kernel} with kv_pos0={kv_pos0}: max |out - reference| = {err:.3g} (tolerance 1e-5)"
