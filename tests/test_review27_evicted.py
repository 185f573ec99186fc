"""Review 27 (mutation round): the eager metadata step's debug check of window lists had no test. In debug mode a
window list entry whose key is inside the window but whose SWA slot was released (it translates to 0, the padding
slot) is an EvictedSlotError naming the window, in each of the three ways the CPU backend builds a window list: one
gather for equal lengths (`_table_lists`), a table for lengths apart (`_table_list`) and CSR entries (`_csr_list`,
what accelerators take, forced here). Without it the kernels read the padding slot's K/V in the key's place."""
import pytest
import torch

from hwkv import backend as backend_mod
from hwkv.batch import ForwardMode
from hwkv.errors import EvictedSlotError
from hwkv.testing.harness import Harness, ModelGeometry
from hwkv_cpu.backend import TorchCPUBackend

W = 4


@pytest.mark.parametrize("path, lens", [("equal lengths", [8, 8]), ("a table", [8, 6]), ("CSR entries", [8, 6])])
def test_a_released_in_window_slot_is_refused_in_debug_mode(monkeypatch, path, lens):
    if path == "CSR entries":   # the table's slack at none: every list is built as CSR entries
        monkeypatch.setattr(backend_mod, "TABLE_SLACK", -(1 << 30))
    geom = ModelGeometry(num_layers=2, swa_every=2, window=W, num_heads=2, num_kv_heads=1, head_dim=8)
    h = Harness(TorchCPUBackend, "cpu", geom, size=64, size_swa=32, page_size=1, max_reqs=4, max_context_len=16,
                debug=True)
    rids = [h.add_request() for _ in lens]
    h.forward(rids, lens, ForwardMode.EXTEND)
    batch = h.make_batch(rids, [1] * len(lens), ForwardMode.DECODE)
    h.backend.init_forward_metadata(batch)          # every window key mapped: fine
    row = h.requests[rids[0]].row
    pos = lens[0] - 1                               # the newest earlier key: inside the next query's window
    h.allocator.free_swa(h.rtt.req_to_token[row, pos:pos + 1].clone())
    with pytest.raises(EvictedSlotError, match=rf"window list \(W={W}\)"):
        h.backend.init_forward_metadata(batch)
