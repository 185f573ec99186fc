"""Review 34 (windows, write-loc translation, per-forward lists): the graph refill's batch checks.

`AttentionBackend.init_forward_metadata_graph` promises the eager step's checks on what the host can read without a
sync (`_check_graph_lens`: "The eager step's checks (`ForwardBatch.check_lens` ...) ... before any static buffer is
written"), and `max_q_len` as "a bound on any request's new tokens". Three batches show where it falls short of the
eager step over the same pools and host lengths:

1. extend lengths that do not add up to the write locs: the eager step refuses them (ShapeError), the graph refill
   builds qo_indptr and window lists from them (the kernels then read q / write out past their rows, or the CPU
   kernels run silently);
2. a request with no new tokens, last in the batch (which the eager step takes): the refill's own list check indexes
   `out_cache_loc` at qo_indptr[bs - 1] == num_tokens and raises a bare IndexError after the static buffers and
   the write-loc translation were refilled;
3. `max_q_len` below the host-known extend lengths: accepted, and the Triton extend kernel's grid then leaves the
   rows past the bound unwritten (uninitialised output, ~1e14 off the reference). Now a CapacityError naming both.

Every run is on the CPU (Triton through its interpreter for 3), checked against `hwkv.reference` by the harness.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from hwkv.batch import ForwardBatch, ForwardMode  # noqa: E402
from hwkv.errors import CapacityError, ConfigError, ShapeError  # noqa: E402
from hwkv.testing.harness import Harness, ModelGeometry  # noqa: E402
from hwkv.testing.reference_backend import ReferenceBackend  # noqa: E402
from hwkv_cpu.backend import TorchCPUBackend  # noqa: E402
from conftest import triton_runs_cpu_tensors  # noqa: E402

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("one_thread")]

W = 4


def _prefilled(backend=ReferenceBackend) -> tuple:
    """Two requests prefilled past the window (5 and 3 tokens), graph state for 4 requests / 64 tokens."""
    h = Harness(backend, geometry=ModelGeometry(num_layers=2, window=W), size=256, size_swa=64, page_size=1,
                max_context_len=64, seed=7)
    rids = [h.add_request(), h.add_request()]
    h.forward(rids, [5, 3], ForwardMode.EXTEND)
    h.backend.init_graph_state(4, 64)
    return h, rids


def _graph_state(h: Harness) -> dict:
    """Every static buffer a graph refill writes (lists, positions, the translated write locs), cloned."""
    st = h.backend.static
    snap = {name: getattr(st, name).clone() for name in ("qo_indptr", "q_pos0", "lens", "full_indices",
                                                          "list_indptr", "list_pos0", "win_rows")}
    snap["swa_out"] = h.backend.loc_cache.buffer.clone()
    return snap


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- 1. extend lengths that do not sum to the write locs -------------------------------------------------------

@pytest.mark.parametrize("backend", [ReferenceBackend, TorchCPUBackend], ids=["reference", "cpu"])
def test_graph_refill_refuses_extend_lens_that_do_not_sum_to_the_write_locs(backend):
    """Expected: the ShapeError the eager step raises ("extend_seq_lens sum to 6 new tokens, out_cache_loc has 5"),
    before any static buffer is written: the host copies are there, the check is a sum. Actual: the graph refill
    builds qo_indptr = [0, 3, 6] for 5 query rows and returns metadata; the layers then run over it (the CPU
    backend silently; the Triton kernels read q and write out one row past the batch where values are not
    checkable)."""
    h, rids = _prefilled(backend)
    batch, _ = h.prepare(rids, [3, 3], ForwardMode.EXTEND)
    bad = ForwardBatch(ForwardMode.EXTEND, 2, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc[:5],
                       extend_seq_lens=batch.extend_seq_lens, seq_lens_cpu=batch.seq_lens_cpu,
                       extend_seq_lens_cpu=batch.extend_seq_lens_cpu)
    with pytest.raises(ShapeError, match="6"):   # the eager step over the same batch
        h.backend.init_forward_metadata(bad)
    before = _graph_state(h)
    with pytest.raises(ShapeError, match="6"):
        h.backend.init_forward_metadata_graph(bad)
    assert _same(before, _graph_state(h)), "the refused refill changed the static buffers"


# ---- 2. a request without new tokens, last in the batch -----------------------------------------------------------

def test_graph_refill_takes_a_last_request_without_new_tokens_as_the_eager_step_does():
    """Expected: a batch the eager step takes (extend lengths [3, 0]: 0 <= extend <= seq, summing to the write locs)
    gets its graph metadata, and its outputs match the reference. Actual: the refill's list check
    (`_check_list_values(..., batch.out_cache_loc[views.qo_indptr[:bs]])`) reads each row's first write loc at
    qo_indptr[1] == 3 == len(out_cache_loc): a bare IndexError, after the lists and the write locs' translation were
    refilled."""
    h, (a, b) = _prefilled()
    batch, inputs = h.prepare([a, b], [3, 0], ForwardMode.EXTEND)
    h.backend.init_forward_metadata(batch)   # the eager step takes it
    h.backend.init_forward_metadata_graph(batch)   # IndexError: index 3 is out of bounds for dimension 0 with size 3
    flat = h.model_step(batch, inputs)
    h.complete([a, b], [3, 0], inputs, flat)   # every query against hwkv.reference


# ---- 3. max_q_len below the host-known extend lengths -----------------------------------------------------------

def test_graph_refill_refuses_a_max_q_len_below_the_batch_extend_lens():
    """Expected: `max_q_len` is "a bound on any request's new tokens"; a bound of 2 for requests of 20 new tokens,
    whose host copies the refill reads anyway (`_check_graph_lens`), is refused with a typed error naming both
    (before any buffer changes), or else the outputs stay exact. Actual: accepted; the Triton extend kernel sizes its
    grid from it and leaves query rows past the bound unwritten: max |out - reference| ~ 1e14 on the SWA layer."""
    triton_runs_cpu_tensors()
    from hwkv_cuda.backend import TritonBackend
    h, rids = _prefilled(TritonBackend)
    batch, inputs = h.prepare(rids, [20, 20], ForwardMode.EXTEND)
    before = _graph_state(h)
    with pytest.raises(CapacityError, match="request 0 extends by 20 new tokens; the graph's max_q_len .* is 2"):
        h.backend.init_forward_metadata_graph(batch, max_q_len=2)
    assert _same(before, _graph_state(h)), "the refused refill changed the static buffers"
    h.backend.init_forward_metadata_graph(batch, max_q_len=20)   # the bound that holds: exact
    flat = h.model_step(batch, inputs)
    h.complete(rids, [20, 20], inputs, flat)


def test_graph_refill_takes_a_numpy_max_q_len_as_an_int():
    """`max_q_len` as a numpy or 0-d tensor integer is the int it holds, as sizes are elsewhere (`as_int`): a bound
    that holds is taken, one below the batch's extends refused as the int's is; a bool stays refused (True is no
    bound). It had refused every numpy integer with "must be an int >= 1"."""
    h, rids = _prefilled()
    batch, inputs = h.prepare(rids, [3, 2], ForwardMode.EXTEND)
    for bad in (True, np.int64(0), 2.0):
        with pytest.raises(ConfigError, match="max_q_len=.* must be an int >= 1"):
            h.backend.init_forward_metadata_graph(batch, max_q_len=bad)
    with pytest.raises(CapacityError, match="extends by 3 new tokens; the graph's max_q_len .* is 2"):
        h.backend.init_forward_metadata_graph(batch, max_q_len=np.int64(2))
    md = h.backend.init_forward_metadata_graph(batch, max_q_len=torch.tensor(3))
    assert md.max_q_len == 3 and type(md.max_q_len) is int
    h.complete(rids, [3, 2], inputs, h.model_step(batch, inputs))
