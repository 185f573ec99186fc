"""Review 37, backend (the core's eager path on the CPU backend and the reference backend).

Each test is a minimal reproduction of one defect: it fails on the code as reviewed and passes once the defect is
fixed (the expected behaviour is what it asserts).
"""
from __future__ import annotations

import pytest
import torch

from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ConfigError, LocError, ShapeError
from hwkv.testing.harness import Harness, ModelGeometry
from hwkv.testing.reference_backend import ReferenceBackend
from hwkv_cpu.backend import TorchCPUBackend

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module


def _harness(factory=TorchCPUBackend, window: int = 4, hybrid: bool = True, **options) -> Harness:
    """Two layers (one SWA of `window`, one full), fp32 on the CPU, every output checked against hwkv.reference."""
    g = ModelGeometry(num_layers=2, swa_every=2, window=window, num_heads=2, num_kv_heads=1, head_dim=8)
    return Harness(factory, geometry=g, size=64, size_swa=48 if hybrid else None, page_size=1, max_reqs=4,
                   max_context_len=64, **options)


# ---- 1. a W=1 window list of no keys: the dense-table path divides by its length ------------------------------------

@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "plain"])
def test_extend_of_no_new_tokens_with_a_window_of_one_runs(hybrid):
    """An EXTEND whose requests all add 0 tokens (allowed: 0 <= extend_seq_lens <= seq_lens) over a W=1 layer raised a
    bare torch RuntimeError ('step must be nonzero') in the CPU backend's table lists; it must run (no queries)."""
    h = _harness(window=1, hybrid=hybrid)
    r = h.add_request()
    h.forward([r], [3])
    outs = h.forward([r], [0], ForwardMode.EXTEND)   # as ReferenceBackend and the CSR lists do
    assert [tuple(o.shape) for o in outs] == [(0, 2, 8), (0, 2, 8)]
    h.forward([r], [1])   # and the request goes on


# ---- 2. a layer's forward runs on whatever metadata the backend last built ------------------------------------------

@pytest.mark.parametrize("factory", [TorchCPUBackend, ReferenceBackend], ids=["cpu", "reference"])
def test_forward_after_a_refused_metadata_step_does_not_write_into_the_previous_forwards_slots(factory):
    """A metadata step refused for batch B leaves the backend holding batch A's metadata, and `forward(..., B)` then
    stores B's K/V at A's write locs (overwriting A's token) and attends over A's lists, silently: it must be refused
    (ConfigError: no metadata for this batch), nothing written."""
    h = _harness(factory)
    a, b = h.add_request(), h.add_request()
    h.forward([a], [5])
    h.forward([b], [5])
    batch_a, inputs_a = h.prepare([a], [1])  # forward A: decode of request a, its token at loc_a
    h.step(batch_a, inputs_a)                # (metadata, then every layer)
    loc_a = batch_a.out_cache_loc.clone()
    batch_b, inputs = h.prepare([b], [1])    # forward B: decode of request b
    full_layer = h.layers[1]
    stored_a = h.pool.get_key_buffer(1)[loc_a].clone()
    bad = ForwardBatch(ForwardMode.DECODE, 1, batch_b.req_pool_indices, torch.tensor([999]), batch_b.out_cache_loc)
    with pytest.raises(ShapeError):          # B's metadata step refused (a length past the table)
        h.backend.init_forward_metadata(bad)
    with pytest.raises(ConfigError):
        h.backend.forward(inputs["q1"], inputs["k1"], inputs["v1"], full_layer, batch_b)
    assert torch.equal(h.pool.get_key_buffer(1)[loc_a], stored_a), "request a's K/V was overwritten by b's"


# ---- 3. host copies of the lengths that disagree with the lengths (CPU: both on the host) ---------------------------

@pytest.mark.parametrize("factory", [TorchCPUBackend, ReferenceBackend], ids=["cpu", "reference"])
def test_seq_lens_cpu_disagreeing_with_seq_lens_is_refused(factory):
    """A ForwardBatch whose `seq_lens_cpu` (the host copy) is one less than `seq_lens` (e.g. the lengths before the
    step): on the CPU both are host tensors, yet the metadata step sizes the lists from the copy and fills them from
    the tensor, and the layers' outputs are silently wrong (0.1-0.2 off the reference); it must be a typed error
    before anything is built."""
    h = _harness(factory)
    a, b = h.add_request(), h.add_request()
    h.forward([a, b], [5, 7])
    batch, _ = h.prepare([a, b], [1, 1], ForwardMode.DECODE)
    bad = ForwardBatch(ForwardMode.DECODE, 2, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc,
                       seq_lens_cpu=batch.seq_lens - 1)
    with pytest.raises(LocError, match="host copy"):
        h.backend.init_forward_metadata(bad)


@pytest.mark.parametrize("factory", [TorchCPUBackend, ReferenceBackend], ids=["cpu", "reference"])
def test_extend_seq_lens_cpu_disagreeing_with_extend_seq_lens_is_refused(factory):
    """The same for `extend_seq_lens_cpu`: [2, 2] where extend_seq_lens are [3, 1] (same sum, so no check catches it)
    put the queries at the wrong positions silently; it must be a ShapeError before anything is built."""
    h = _harness(factory)
    a, b = h.add_request(), h.add_request()
    h.forward([a, b], [5, 7])
    batch, _ = h.prepare([a, b], [3, 1], ForwardMode.EXTEND)
    bad = ForwardBatch(ForwardMode.EXTEND, 2, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc,
                       extend_seq_lens=batch.extend_seq_lens, extend_seq_lens_cpu=torch.tensor([2, 2]))
    with pytest.raises(LocError, match="host copy"):
        h.backend.init_forward_metadata(bad)


# ---- 4. a batch field reassigned after construction with another number of entries ---------------------------------

@pytest.mark.parametrize("factory", [TorchCPUBackend, ReferenceBackend], ids=["cpu", "reference"])
@pytest.mark.parametrize("field", ["req_pool_indices", "seq_lens", "extend_seq_lens"])
def test_a_field_reassigned_with_another_length_than_batch_size_is_refused(factory, field):
    """ForwardBatch checks its tensors' lengths against batch_size at construction only; the metadata step checks
    just the host copies' (`check_lens`, 'a field changed after construction'). A batch reused for the next step
    whose rows, lengths or extend lengths were reassigned with one entry for its two requests ran: the CPU backend
    raised bare torch/numpy errors (RuntimeError, IndexError, a 30 MB allocation), the reference backend read
    request 1's keys from request 0's row silently. It must be a ShapeError naming the field, nothing built."""
    h = _harness(factory)
    a, b = h.add_request(), h.add_request()
    h.forward([a, b], [5, 5])
    batch, _ = h.prepare([a, b], [2, 3], ForwardMode.EXTEND)
    setattr(batch, field, getattr(batch, field)[:1].clone())
    translations = h.backend.loc_cache.translations
    with pytest.raises(ShapeError, match=field):
        h.backend.init_forward_metadata(batch)
    assert h.backend.loc_cache.translations == translations


# ---- 5. the chunked CPU decode kernel cannot write an fp8 output ----------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_cpu_decode_of_an_fp8_query_runs_on_the_chunked_kernels_as_on_the_dense_ones(dtype):
    """A decode layer whose q (and so its output, q.new_empty) is fp8 runs on the dense kernels, and extend runs on
    either, but the chunked decode kernel (forwards past `dense_max_elements`, graph mode; `decode_attention`
    documents 'out (any float dtype)') ends in `out.index_copy_`, which has no fp8 CPU kernel: a bare
    NotImplementedError after the layer's K/V were stored. It must run and give the dense kernels' output."""
    h = _harness(dense_max_elements=0)   # the chunked kernels
    dense = TorchCPUBackend(h.pool, h.rtt, sliding_window=h.backend.windows)   # the dense ones, same pool and rows
    a, b = h.add_request(), h.add_request()
    h.forward([a, b], [5, 7])
    batch, inputs = h.prepare([a, b], [1, 1], ForwardMode.DECODE)
    q = inputs["q1"].to(dtype)
    dense.init_forward_metadata(batch)
    want = dense.forward(q, inputs["k1"], inputs["v1"], h.layers[1], batch)
    h.backend.init_forward_metadata(batch)
    got = h.backend.forward(q, inputs["k1"], inputs["v1"], h.layers[1], batch)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=0.07, rtol=0.13)
