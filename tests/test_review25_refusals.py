"""Review 25: refusals that were missing or came after a change, each pinned by a test that failed before its fix.

Every test states the project's rule it checks: bad input gets a typed `hwkv.errors` error and leaves every pool,
table, allocator, prefix cache and static buffer as it was."""
import pytest
import torch

import hwkv
from hwkv.allocator import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, same_snapshot
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ConfigError, HwkvError, LocError, ShapeError
from hwkv.pool import MHATokenToKVPool
from hwkv.req_to_token import ReqToTokenPool

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- 1. a whole-step graph's step naming one request row twice -----------------------------------------------------
@pytest.mark.parametrize("page", [1, 4])
def test_step_graph_step_with_a_row_named_twice_is_refused_before_anything_changes(page):
    """DecodeStepGraph.step checks rows against req_to_token but not for repeats. Page 1: the step claims and opens
    two pages, writes req_to_token, runs the layers, then the out-of-window release raises LocError ('named twice')
    with the pages taken (one held by nobody: req_to_token keeps only one of them). Page 4: both tokens continue the
    row's page and get the same slot; nothing is raised at all. Either way the step must be refused up front."""
    from test_step_graph import Engine, same_state
    from test_step_graph_refusals import _graph, _inputs
    e = Engine(page)
    graph, _ = _graph(e, "decode")
    graph.capture()
    rows = torch.tensor([e.rows[0], e.rows[0]], dtype=torch.int64)
    seq = e.seq[[0, 0]] + 1
    before = e.state()
    with pytest.raises(HwkvError, match="twice"):
        graph.step(rows, seq, seq, _inputs(2))
    assert same_state(before, e.state()), "the refused step changed the allocator, req_to_token or frontiers"


# ---- 2. HybridPrefixCache.release_requests: a 0-d tensor row and the same int row -----------------------------------
def test_release_requests_refuses_one_row_named_twice_as_a_tensor_and_an_int():
    """release_requests refuses a row named twice with `row in rows` on the raw values; row_locs takes 0-d tensor rows
    (as_int), but a tensor hashes by identity, so torch.tensor(r) and r pass as two rows: the request's references are
    dropped twice and a page the cache still holds goes free (check_integrity: 'a cached full page is not live')."""
    from test_review21_cache import Side
    s = Side()
    ids = list(range(100, 108))
    row, lock = s.running(ids)
    before = s.snapshot()
    with pytest.raises(LocError, match=f"row {row} is named twice"):
        s.c.release_requests([(ids, torch.tensor(row), 8, 0, None), (ids, row, 8, 0, lock)], s.rtt)
    after = s.snapshot()
    assert same_snapshot(before[0], after[0]) and before[2] == after[2], "refused release changed the books"
    s.check()


# ---- 3. ForwardSlots.free: the allocator frees before the request rows are checked ----------------------------------
def _forward_slots():
    from hwkv.engine.forward import ForwardSlots
    s = ForwardSlots(SWATokenToKVPoolAllocator(512, 256, 4, "cpu", None), ReqToTokenPool(6, 96, "cpu"), 8)
    rows = s.new_rows(6)
    for r in rows:
        s.allocate(s.plan_extend(ForwardMode.EXTEND, [r], [0], [5]))
    return s, rows


@pytest.mark.parametrize("which", ["row named twice", "row -1"])
def test_forward_slots_free_checks_rows_before_freeing_slots(which):
    """ForwardSlots.free frees the rows' slots (allocator.free) and only then hands the rows to ReqToTokenPool.free,
    which checks them: a row named twice raises DoubleFreeError after the slots went back; row -1 frees the LAST row's
    slots (another live request's: req_to_token[-1] wraps) and then raises LocError."""
    s, rows = _forward_slots()
    free_rows = [rows[0], rows[0]] if which == "row named twice" else [-1]
    before = (s.allocator.integrity_snapshot(), s.rtt.req_to_token.clone(), list(s.rtt._free))
    with pytest.raises(HwkvError):
        s.free(free_rows, [5] * len(free_rows))
    assert same_snapshot(before[0], s.allocator.integrity_snapshot()), "slots were freed by a refused free"
    assert list(s.rtt._free) == before[2]


# ---- 4. init_forward_metadata_graph: rows and lengths the eager step refuses ----------------------------------------
def _graph_backend():
    from test_backend_refusals import Setup
    s = Setup()
    s.backend.init_graph_state(4, 16)
    s.backend.init_forward_metadata_graph(s.decode)
    return s


def _static(s):
    b = s.backend.static
    return [x.clone() for x in (b.qo_indptr, b.q_pos0, b.lens, b.list_indptr, b.list_pos0, b.full_indices, b.win_rows,
                                s.backend.loc_cache.buffer, *b.win_scratch.values())]


t = torch.tensor


@pytest.mark.parametrize("make, error", [
    (lambda s: ForwardBatch(ForwardMode.DECODE, 1, t([99]), t([7]), s.loc1), LocError),   # bare IndexError today
    (lambda s: ForwardBatch(ForwardMode.DECODE, 1, t([-1]), t([7]), s.loc1), LocError),   # reads the last row
    (lambda s: ForwardBatch(ForwardMode.DECODE, 1, t([0]), t([0]), s.loc1), ShapeError),  # seq_len 0 accepted
    (lambda s: ForwardBatch(ForwardMode.EXTEND, 1, t([0]), t([2]), torch.cat([s.loc1] * 3), t([0]), t([3])),
     ShapeError),                                                                          # extend_len 3 > seq_len 2
], ids=["row 99", "row -1", "seq_len 0", "extend past seq_len"])
def test_graph_metadata_refuses_what_the_eager_step_refuses(make, error):
    """backend.init_forward_metadata_graph checks the host lengths' upper bound (_check_graph_context) but never
    `batch.check_lens` (rows inside req_to_token, 1 <= seq_lens, 0 <= extend_lens <= seq_lens), which the eager step
    and init_draft_metadata_graph (`_check_draft_lens`) run on the same host-readable values: row 99 is a bare
    IndexError; row -1, seq_len 0 and an extend longer than its request are refilled into the static buffers."""
    s = _graph_backend()
    batch = make(s)
    with pytest.raises(error):
        s.backend.init_forward_metadata_graph(batch)


@pytest.mark.parametrize("make", [
    lambda s: ForwardBatch(ForwardMode.DECODE, 1, t([-1]), t([7]), s.loc1),
    lambda s: ForwardBatch(ForwardMode.DECODE, 1, t([0]), t([0]), s.loc1),
], ids=["row -1", "seq_len 0"])
def test_graph_metadata_refusal_leaves_the_static_buffers(make):
    s = _graph_backend()
    before = _static(s)
    with pytest.raises(HwkvError):
        s.backend.init_forward_metadata_graph(make(s))
    assert all(torch.equal(a, b) for a, b in zip(before, _static(s))), "a bad batch was refilled into static buffers"


# ---- 5. alloc_extend: a host copy with another number of requests than its tensor -----------------------------------
@pytest.mark.parametrize("immediate", [True, False])
def test_alloc_extend_refuses_a_host_copy_of_another_length(immediate):
    """alloc_decode refuses `seq_lens_cpu has 1 entries, seq_lens 2` (LocError); alloc_extend swaps the host copy in
    (`_host_ints`) without comparing its entry count with the tensor's (a host attribute): immediate mode raises a
    bare numpy ValueError ('operands could not be broadcast'), deferred mode takes pages for the mismatched batch."""
    a = SWATokenToKVPoolAllocator(64, 64, 4, "cpu", None)
    a.immediate = immediate
    before = a.integrity_snapshot()
    with pytest.raises(LocError, match="prefix_lens"):
        a.alloc_extend(torch.tensor([0, 0]), torch.tensor([4]), torch.tensor([0]), 4, prefix_lens_cpu=torch.tensor([0]))
    assert same_snapshot(before, a.integrity_snapshot())


# ---- 6. AttentionLayer: a bool or float layer id ---------------------------------------------------------------------
@pytest.mark.parametrize("layer_id", [True, 1.0])
def test_attention_layer_refuses_a_layer_id_that_is_no_integer(layer_id):
    """AttentionLayer checks every geometry field (a bool is none) but not layer_id: True and 1.0 hash as 1, so
    the pool's layers_mapping routes them to layer 1 and backend.forward reads and writes layer 1's K/V (on a plain
    MHATokenToKVPool, 1.0 is a bare TypeError from list indexing)."""
    with pytest.raises(ConfigError, match="layer_id"):
        hwkv.AttentionLayer(layer_id, 4, 2, 8)


def test_a_float_layer_id_on_a_plain_pool_is_no_bare_type_error():
    pool = MHATokenToKVPool(16, 1, torch.float32, 2, 8, 2, "cpu")
    with pytest.raises(HwkvError):
        pool.get_key_buffer(1.0)


# ---- 7. pools and allocators: a bool where a size goes -----------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda: MHATokenToKVPool(8, True, torch.float32, 2, 8, 1, "cpu"),
    lambda: MHATokenToKVPool(8, 1, torch.float32, True, 8, 1, "cpu"),
    lambda: PagedTokenToKVPoolAllocator(8, True, "cpu"),
], ids=["pool page_size=True", "pool head_num=True", "allocator page_size=True"])
def test_a_bool_size_is_refused(make):
    """MHATokenToKVPool and PagedTokenToKVPoolAllocator test sizes with isinstance(val, int), which True passes (as 1);
    SWAKVPool's own swa_head_num check and every other count in hwkv refuse bools ('a bool is no count')."""
    with pytest.raises(ConfigError):
        make()


# ---- 8. HybridPrefixCache.cache_running: a frontier past seq_len -------------------------------------------------------
def test_cache_running_refuses_a_frontier_past_seq_len_as_release_request_does():
    """release_request refuses `frontier ... in [0, seq_len]`; cache_running takes frontier 16 for a request of 8 tokens
    and caches its tokens as tombstones (the request's SWA pages treated as released)."""
    from test_review21_cache import Side
    s = Side()
    ids = list(range(100, 108))
    row = s.rtt.alloc(1)[0]
    s.rtt.write(row, 0, s.a.alloc(8))
    before = s.snapshot()
    with pytest.raises(LocError, match="frontier 16"):
        s.c.cache_running(ids, s.rtt, row, 8, 16)
    after = s.snapshot()
    assert same_snapshot(before[0], after[0]) and before[2] == after[2]


# ---- 9. release_out_of_window_batch: frontiers as a [bs, 1] column ------------------------------------------------------
def test_release_refuses_a_frontier_column_before_releasing():
    """frontiers are checked for dtype only: a [bs, 1] column (numel bs) passes, the host path releases the SWA pages
    (`_release_on_host`), then `frontiers.copy_(new [bs])` raises a bare RuntimeError (broadcast [2, 1] vs [2, 2]):
    the pages are gone while the caller's frontiers still say 0, so the next release frees them again."""
    from hwkv.release import release_out_of_window_batch
    a = SWATokenToKVPoolAllocator(256, 256, 4, "cpu", None)
    rtt = ReqToTokenPool(4, 64, "cpu")
    for r in range(2):
        rtt.write(r, 0, a.alloc(40))
    f = torch.zeros(2, 1, dtype=torch.int64)
    before = a.integrity_snapshot()
    with pytest.raises(LocError, match="frontiers"):
        release_out_of_window_batch(a, rtt.req_to_token, torch.tensor([0, 1]), torch.tensor([40, 40]), f, 8)
    assert same_snapshot(before, a.integrity_snapshot()), "SWA pages released by a refused call"


# ---- 10. GraphRunner / step graphs: an input that is no tensor -----------------------------------------------------------
def test_graph_inputs_that_are_no_tensor_get_a_typed_error():
    """GraphRunner._check_inputs reads `src.shape` unguarded: a list input (DecodeStepGraph.step, GraphRunner.run) is a
    bare AttributeError ('list' object has no attribute 'shape')."""
    from test_step_graph import Engine
    from test_step_graph_refusals import _graph, _inputs
    e = Engine(4)
    graph, _ = _graph(e, "decode")
    graph.capture()
    rows = torch.tensor([e.rows[0], e.rows[1]], dtype=torch.int64)
    seq = e.seq[[0, 1]] + 1
    inputs = _inputs(2)
    inputs["k"] = inputs["k"].tolist()
    with pytest.raises(ShapeError, match="'k'"):
        graph.step(rows, seq, seq, inputs)
