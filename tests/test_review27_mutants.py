"""Review 27 (test-suite audit by mutation): single-line mutants of hwkv's core that the rest of the suite let
through, each pinned here by a small deterministic test that passes on the code as it is and fails with the
mutant applied (each test's docstring names its mutant as `module:line  original -> mutant`).

Modules: hwkv/release.py (host checks of a batched release: frontier alignment and sign, the row bound, device
types; release_out_of_window's own alignment check under deferred checks), hwkv/spec.py (check_tree's ancestor
closure, check_tree_mask's position bound, the tree-decode buffers' capacity, accept_draft_tokens' host checks and
chain check), hwkv/draft.py (the graph state's batch bound, the span block's width at the row's end, the eager
draft's debug check of released window slots), hwkv/batch.py (IDLE's extend lengths, the contiguous copy of strided
fields, host copies of another batch size), hwkv/window.py (W = 0 is no window), hwkv/engine/scheduler.py (the
SWA pages a prefix-cache lock pins, a stopped request decodes no more), hwkv/engine/forward.py (the host frontier
never moves back, `undo` clears the row's entries), hwkv/spec_plan.py (ragged draft counts in a graph verify, the
tree mask's device type).
"""
import pytest
import torch

from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.errors import CapacityError, ConfigError, LocError, ShapeError
from hwkv.release import release_out_of_window, release_out_of_window_batch
from hwkv.spec import DraftTree, build_tree_mask, check_tree, check_tree_mask

from test_accept_draft import N, Setup as AcceptSetup

pytestmark = pytest.mark.usefixtures("one_thread")

I64 = torch.int64


# ---------------------------------------------------------------------------------------------- hwkv/release.py
def _one_row(page=4, width=32):
    """An allocator of page 4 and a req_to_token of 4 rows whose row 1 holds 32 allocated locs."""
    a = SWATokenToKVPoolAllocator(64, 64, page, "cpu", None)
    rtt = torch.zeros(4, width, dtype=I64)
    rtt[1, :32] = a.alloc(32)
    return a, rtt


def _unchanged(a, rtt, snap):
    return same_snapshot(snap[0], a.integrity_snapshot()) and torch.equal(rtt, snap[1])


def test_batched_release_refuses_a_frontier_off_a_page_boundary_and_changes_nothing():
    """release.py:118 `if (f % p).any():` -> `if False:`. A frontier of 1 at page size 4 released the SWA page of
    positions 0-3 as if it were the page at 1 (loc // 4), and moved the frontier to 8: page 4-7 was never released
    (a leak), with no error."""
    a, rtt = _one_row()
    snap = a.integrity_snapshot(), rtt.clone()
    f = torch.tensor([1], dtype=I64)
    with pytest.raises(LocError, match="frontier 1 is not a multiple of page_size 4"):
        release_out_of_window_batch(a, rtt, torch.tensor([1]), torch.tensor([16]), f, 2)
    assert _unchanged(a, rtt, snap) and f.tolist() == [1]


def test_batched_release_refuses_a_negative_frontier_and_changes_nothing():
    """release.py:120 drops `f.min() < 0 or`. A frontier of -4 (a multiple of 4) read position -4 of the row,
    numpy's last column: the page of positions 28-31, inside the window, had its SWA slots released."""
    a, rtt = _one_row()
    snap = a.integrity_snapshot(), rtt.clone()
    f = torch.tensor([-4], dtype=I64)
    with pytest.raises(LocError, match=r"frontier -\d+ is negative"):
        release_out_of_window_batch(a, rtt, torch.tensor([1]), torch.tensor([32]), f, 2)
    assert _unchanged(a, rtt, snap) and f.tolist() == [-4]
    # the page of positions 28..31 is still mapped
    assert int(a.full_to_swa_index_mapping[int(rtt[1, 28])]) > 0


@pytest.mark.parametrize("releases", [True, False])
def test_batched_release_refuses_the_row_one_past_req_to_token_with_a_loc_error(releases):
    """release.py:120 `r.max() >= rtt.shape[0]` -> `>`. Row 4 of a 4-row req_to_token passed the host check:
    a bare IndexError from numpy where it releases something, and nothing at all (no error) where it does not."""
    a, rtt = _one_row()
    snap = a.integrity_snapshot(), rtt.clone()
    seq = 32 if releases else 4
    with pytest.raises(LocError, match=r"request 0: row 4 is outside req_to_token's rows \[0, 4\)"):
        release_out_of_window_batch(a, rtt, torch.tensor([4]), torch.tensor([seq]), torch.zeros(1, dtype=I64), 2)
    assert _unchanged(a, rtt, snap)


def test_batched_release_refuses_tensors_on_another_device_type_with_a_loc_error():
    """release.py:57 `if t.device.type != allocator.device.type:` -> `if False:`. seq_lens on another device
    type than the allocator's (a meta tensor here) then failed deep inside with an untyped error."""
    a, rtt = _one_row()
    snap = a.integrity_snapshot(), rtt.clone()
    with pytest.raises(LocError, match="seq_lens is on meta"):
        release_out_of_window_batch(a, rtt, torch.tensor([1]), torch.tensor([32], device="meta"),
                                    torch.zeros(1, dtype=I64), 2)
    assert _unchanged(a, rtt, snap)


def test_single_release_refuses_a_frontier_off_a_page_boundary_on_the_host_with_deferred_checks():
    """release.py:191 `if frontier % p:` -> `if False:`. With deferred checks (a device's mode) the batched
    release only records a bad frontier; release_out_of_window, whose frontier is a host int, raises it at once.
    (With immediate checks the batched release's own host check raises the same error: equivalent there.)"""
    a, rtt = _one_row()
    a.immediate = False
    with pytest.raises(LocError, match="frontier 1 is not a multiple of page_size 4"):
        release_out_of_window(a, rtt[1], 16, 1, 2)
    a.immediate = True
    a.check_integrity()   # nothing recorded either
    assert release_out_of_window(a, rtt[1], 16, 0, 2) == 8


# ------------------------------------------------------------------------------------------------- hwkv/spec.py
def test_check_tree_refuses_a_row_whose_ancestor_has_ancestors_outside_it():
    """spec.py:120 drops `or bool((block[anc] & ~block[i]).any())`. Token 3's row names 1 (a root, depth 0), 2
    (depth 1) and itself: one token at every depth below its own, so the depth test passes, but 2's parent is 0,
    which 3's row lacks: no ancestor path."""
    rows = [[1, 0, 0, 0],
            [0, 1, 0, 0],
            [1, 0, 1, 0],
            [0, 1, 1, 1]]
    tree = DraftTree(torch.tensor(rows, dtype=torch.bool).reshape(-1))
    ext = torch.tensor([4])
    assert check_tree(tree, ext, debug=False) == 16
    with pytest.raises(ShapeError, match="not one ancestor path"):
        check_tree(tree, ext, debug=True)
    good = DraftTree.from_parents([[-1, -1, 0, 2]])
    assert check_tree(good, ext, debug=True) == 16


def test_check_tree_mask_refuses_a_position_one_past_the_requests_drafts():
    """spec.py:482 `(rel >= n[req])` -> `(rel > n[req])`. A chain of 3 drafts at 4, 5, 6: position 7 (= q_pos0 + n)
    lies outside the request's draft positions [4, 7)."""
    ext, qo, q_pos0 = torch.tensor([3]), torch.tensor([0, 3], dtype=torch.int32), torch.tensor([4])
    tree = build_tree_mask(DraftTree.from_parents([[-1, 0, 1]]), ext, qo, q_pos0, 9, 3)
    q = torch.zeros(3, 1, 4)
    assert tree.q_positions.tolist() == [4, 5, 6]
    check_tree_mask(tree, q, qo, q_pos0)
    bad = tree._replace(q_positions=torch.tensor([4, 5, 7]))
    with pytest.raises(ShapeError, match=r"tree.q_positions\[2\] = 7 lies outside request 0's draft positions"):
        check_tree_mask(bad, q, qo, q_pos0)


def test_tree_decode_list_refuses_buffers_one_key_too_narrow():
    """spec.py:203 `row_cap > out.row_cap` -> `row_cap > out.row_cap + 1`. Lists bounded by 9 keys a token were
    built into buffers sized for 8 a token (T x 8 + 1 entries) with no error: a batch whose lists reach the bound
    then overruns them (index_copy_ past the end, or into the dump entry that masked-off writes share)."""
    from hwkv.metadata import KVIndexList
    from hwkv.spec import alloc_tree_decode, tree_decode_list
    ext, qo, q_pos0 = torch.tensor([5]), torch.tensor([0, 5], dtype=torch.int32), torch.tensor([4])
    tree = build_tree_mask(DraftTree.from_parents([[-1, 0, 0, 1, 2]]), ext, qo, q_pos0, 25, 5)
    full = KVIndexList(torch.tensor([0, 9], dtype=torch.int32), torch.arange(10, 19), torch.tensor([0]), None, 9)
    small = alloc_tree_decode(5, 8, torch.device("cpu"))
    before = [t.clone() for t in small[:2]]
    with pytest.raises(CapacityError, match="5 draft tokens with lists of 9 keys exceed"):
        tree_decode_list(tree, full, qo, q_pos0, ext, 5, 9, out=small)
    assert all(torch.equal(x, y) for x, y in zip(before, small[:2]))
    fits = alloc_tree_decode(5, 9, torch.device("cpu"))
    got = tree_decode_list(tree, full, qo, q_pos0, ext, 5, 9, out=fits)
    assert got.indptr.tolist() == [0, 5, 11, 17, 24, 31]   # prefix 4 + depth + 1 keys each


def _accept(s, index, lens, prefix=None, **kw):
    idx = torch.zeros(2, N, dtype=I64)
    for b, a in enumerate(index):
        idx[b, :len(a)] = torch.tensor(a, dtype=I64)
    lens = torch.tensor(lens, dtype=I64)
    prefix = s.prefix if prefix is None else torch.tensor(prefix, dtype=I64)
    from hwkv.spec import accept_draft_tokens
    return accept_draft_tokens(s.a, s.pool, s.rtt.req_to_token, s.rows, prefix, idx, lens,
                               prefix_lens_cpu=prefix, accept_lens_cpu=lens, **kw)


@pytest.mark.parametrize("page", [1, 4])
def test_accept_refuses_a_negative_host_accept_length_and_changes_nothing(page):
    """spec.py:409 drops `or int(acc_cpu.min()) < 0`. accept_lens_cpu of -1 counted one more rejected draft than
    were drafted (page 1: a kept slot freed) or a page more to free (page 4), with no error."""
    s = AcceptSetup(page, immediate=True)
    snap = s.snapshot()
    with pytest.raises(ShapeError, match="request 0 accepts -1 tokens"):
        _accept(s, [[], [0]], [-1, 1])
    assert s.unchanged(snap)
    s.finish(_accept(s, [[0], [0]], [1, 1]))


def test_accept_refuses_drafts_reaching_one_past_max_context_len():
    """spec.py:417 `> req_to_token.shape[1]` -> `> req_to_token.shape[1] + 1`. Drafts at positions 61..64 of a
    64-column row passed the check and failed with a bare IndexError."""
    s = AcceptSetup(1, immediate=True)
    snap = s.snapshot()
    with pytest.raises(ShapeError, match="drafts reach position 65, past max_context_len 64"):
        _accept(s, [[0], [0]], [1, 1], prefix=[61, 6])
    assert s.unchanged(snap)


def test_accept_refuses_a_frontier_one_past_the_prefix():
    """spec.py:442 `(frontiers.cpu() > prefix_cpu)` -> `> prefix_cpu + 1`. A frontier one past the prefix (a
    release ran on the drafted length first) was let through at page size 1."""
    s = AcceptSetup(1, immediate=True)
    snap = s.snapshot()
    with pytest.raises(ShapeError, match="an SWA frontier passed its request's prefix"):
        _accept(s, [[0], [0]], [1, 1], frontiers=torch.tensor([6, 0], dtype=I64))
    assert s.unchanged(snap)
    s.finish(_accept(s, [[0], [0]], [1, 1], frontiers=torch.tensor([5, 6], dtype=I64)))


@pytest.mark.parametrize("page", [1, 4])
def test_accept_with_chain_refuses_an_accept_index_that_is_no_chain(page):
    """spec.py:322 the `chain` check removed. chain=True over accept_index [1, 0] moved no K/V at page size 4
    (a chain's drafts stay in place) although draft 1 became position 0: the row's K/V then lied."""
    s = AcceptSetup(page, immediate=True)
    snap = s.snapshot()
    with pytest.raises(ShapeError, match="chain=True, but accept_index of request 0 is no chain"):
        _accept(s, [[1, 0], [0]], [2, 1], chain=True)
    assert s.unchanged(snap)
    s.finish(_accept(s, [[0, 1], [0]], [2, 1], chain=True))


# ------------------------------------------------------------------------------------------------ hwkv/draft.py
def test_draft_graph_state_refuses_a_larger_batch_than_it_was_built_for():
    """draft.py:142 drops `or max_bs > ds.max_bs`. A second init_draft_graph_state for 4 requests after one for 2
    grew the base state only: steps 1.. kept buffers of 2 requests, and no error said so."""
    from test_spec_refusals import harness
    h, _ = harness()
    be = h.backend
    be.init_draft_graph_state(2, 3)
    with pytest.raises(ConfigError, match="draft graph state exists for 3 steps of 2 requests; asked for 3 of 4"):
        be.init_draft_graph_state(4, 3)
    with pytest.raises(ConfigError, match="asked for 4 of 2"):
        be.init_draft_graph_state(2, 4)
    be.init_draft_graph_state(2, 3)     # the same sizes, or smaller: kept
    be.init_draft_graph_state(1, 2)
    assert be.draft_static.max_bs == 2 and len(be.draft_static.steps) == 3


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_draft_whose_span_block_would_pass_the_row_end_gathers_inside_the_rows(graph, monkeypatch):
    """draft.py:65 `min(window + num_steps - 1, ctx)` -> `window + num_steps - 1`. With W + k - 1 past
    max_context_len (W 4, k 4, rows of 6), each window's span block must stop at the row's end. Wider, its gather
    asks for positions past the row: the torch fill clamps them (so the outputs still match the reference), but
    the Triton fill (`hwkv_cuda.kernels.index`) reads on into the next row, and past req_to_token's end from the
    last row. A spy on the gather checks every run it is asked for lies inside its row."""
    from hwkv import ops
    from hwkv.batch import ForwardMode
    from hwkv.graph import EagerAdapter
    from hwkv.testing.harness import Harness, ModelGeometry
    from hwkv.testing.spec_harness import draft_graphs, draft_steps
    from hwkv_cpu.backend import TorchCPUBackend
    runs_past = []
    inner = ops._FILL.get("cpu", ops.fill_kv_indices_torch)

    def spy(req_to_token, rows, pos0, indptr, out):
        lens = (indptr[1:] - indptr[:-1]).to(I64)
        ends = pos0.to(I64) + lens
        bad = (lens > 0) & ((pos0 < 0) | (ends > req_to_token.shape[1]))
        if bool(bad.any()):
            runs_past.append((req_to_token.shape[1], ends[bad].tolist()))
        inner(req_to_token, rows, pos0, indptr, out)

    monkeypatch.setitem(ops._FILL, "cpu", spy)
    geom = ModelGeometry(num_layers=2, swa_every=2, window=4, num_heads=2, num_kv_heads=1, head_dim=8)
    h = Harness(TorchCPUBackend, "cpu", geom, size=64, size_swa=32, page_size=1, max_reqs=4, max_context_len=6,
                seed=7)
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [2, 1, 2], ForwardMode.EXTEND)
    runner = draft_graphs(h, [4], EagerAdapter(), 4) if graph else None
    draft_steps(h, rids, 4, runner=runner)    # every step checked against the reference
    assert [h.requests[r].seq_len for r in rids] == [6, 5, 6]
    assert not runs_past, f"gathers past the row's end (max_context_len, run ends): {runs_past}"


def test_an_eager_draft_in_debug_mode_refuses_a_window_list_naming_a_released_slot():
    """draft.py:124 `self._check_not_evicted(out, w)` -> `pass`. In debug mode an in-window key whose SWA slot was
    released (translating to 0, the padding slot) is an EvictedSlotError, as in the plain metadata step; the
    eager draft step had read the padding slot's K/V in its place, silently."""
    from hwkv.batch import ForwardMode
    from hwkv.errors import EvictedSlotError
    from hwkv.testing.harness import Harness, ModelGeometry
    from hwkv.testing.spec_harness import draft_batch
    from hwkv_cpu.backend import TorchCPUBackend
    geom = ModelGeometry(num_layers=2, swa_every=2, window=4, num_heads=2, num_kv_heads=1, head_dim=8)
    h = Harness(TorchCPUBackend, "cpu", geom, size=64, size_swa=32, page_size=1, max_reqs=4, max_context_len=16,
                debug=True)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [6, 7], ForwardMode.EXTEND)
    batch = draft_batch(h, rids, 2)
    h.backend.init_draft_metadata(batch)        # every window key mapped: fine
    row = h.requests[rids[1]].row
    h.allocator.free_swa(h.rtt.req_to_token[row, 5:6].clone())   # position 5: inside every step's window
    with pytest.raises(EvictedSlotError, match=r"window list \(W=4\)"):
        h.backend.init_draft_metadata(batch)


# ------------------------------------------------------------------------------------------------ hwkv/batch.py
def test_an_idle_batch_adds_no_tokens_per_request():
    """batch.py:122 `is_decode_or_idle()` -> `is_decode()` in `extend_lens`. IDLE (no requests, planned as a DECODE
    of none) then answered its extend_seq_lens, None, where a tensor of no ones is asked for."""
    from hwkv.batch import ForwardBatch, ForwardMode
    e = torch.zeros(0, dtype=I64)
    b = ForwardBatch(ForwardMode.IDLE, 0, e, e, e)
    lens = b.extend_lens()
    assert isinstance(lens, torch.Tensor) and lens.shape == (0,)
    assert [x.shape for x in b.host_lens()] == [(0,), (0,)]


def test_a_strided_batch_field_becomes_a_contiguous_copy_of_the_same_values():
    """batch.py:106 the contiguity copy removed. A column of a table (stride 2) reaches the kernels, which read rows
    and lengths with stride 1 (the Triton fill, `hwkv_cuda.kernels.index`, reads req_pool_indices + b): a contiguous
    copy is made here, once; a contiguous tensor stays the caller's own."""
    from hwkv.batch import ForwardBatch, ForwardMode
    table = torch.tensor([[3, 7], [1, 9], [2, 11]], dtype=I64)
    loc = torch.tensor([4, 5, 6], dtype=I64)
    b = ForwardBatch(ForwardMode.DECODE, 3, table[:, 0], table[:, 1], loc)
    for name, want in (("req_pool_indices", [3, 1, 2]), ("seq_lens", [7, 9, 11])):
        t = getattr(b, name)
        assert t.is_contiguous() and t.stride() == (1,) and t.tolist() == want, name
    assert b.out_cache_loc is loc
    ext = torch.tensor([[2, 0], [1, 0], [1, 0]], dtype=I64)[:, 0]
    rows = torch.tensor([0, 1, 2], dtype=I64)
    e = ForwardBatch(ForwardMode.EXTEND, 3, rows, table[:, 1], torch.arange(1, 5), extend_seq_lens=ext)
    assert e.req_pool_indices is rows and e.extend_seq_lens.is_contiguous() and e.extend_seq_lens.tolist() == [2, 1, 1]


def test_check_lens_refuses_host_lengths_of_another_batch_size():
    """batch.py:154 `if len(lens) != bs:` -> `if False:`. Host copies of 3 lengths for a batch of 2 (a field changed
    after construction) passed when their values were in range: the metadata step then sized its lists for 3."""
    from hwkv.batch import ForwardBatch, ForwardMode
    b = ForwardBatch(ForwardMode.EXTEND, 2, torch.tensor([0, 1]), torch.tensor([4, 5]), torch.arange(1, 4),
                     extend_seq_lens=torch.tensor([1, 2]))
    b.check_lens([4, 5], [1, 2], 4, 16)
    with pytest.raises(ShapeError, match=r"seq_lens has 3 entries \(its host copy\), batch_size is 2"):
        b.check_lens([4, 5, 6], [1, 2], 4, 16)
    with pytest.raises(ShapeError, match=r"extend_seq_lens has 3 entries \(its host copy\), batch_size is 2"):
        b.check_lens([4, 5], [1, 1, 1], 4, 16)


# ----------------------------------------------------------------------------------------------- hwkv/window.py
@pytest.mark.parametrize("w", [None, 0, -3])
def test_no_window_is_none_or_at_most_zero_in_every_helper(w):
    """window.py:9 and :22 `window <= 0` -> `window < 0`. W = 0 means no window (as `hwkv.checks.check_window` reads
    it): first_visible then hid every key (pos + 1), and no_window(0) said a window. (window_left's own `<= 0` ->
    `< 0` is equivalent: 0 - 1 is -1 too.)"""
    from hwkv.reference import visible_mask
    from hwkv.window import first_visible, no_window, window_left
    assert first_visible(5, w) == 0 and no_window(w) and window_left(w) == -1
    pos = torch.arange(6)
    assert torch.equal(visible_mask(pos, pos, w), visible_mask(pos, pos, None))
    assert first_visible(5, 1) == 5 and not no_window(1) and window_left(1) == 0


# ------------------------------------------------------------------------------------- hwkv/engine/scheduler.py
@pytest.mark.parametrize("window", [8, 6])
def test_a_cached_engines_swa_reservation_counts_the_window_a_cache_lock_pins(window):
    """scheduler.py:117 `(window + p - 1) // p + 1` -> `(window + p - 1) // p`. A request's prefix-cache lock can pin
    the last window of its cached prompt, which need not start on a page: round_up(W, P) + P slots
    (`hwkv.engine.plan.cache_lock_tokens`, what `plan_pools(prefix_cache=True)` sizes the SWA pool for). One page
    fewer per request let admission over-commit the SWA pool by a page per running request."""
    from hwkv.engine.plan import cache_lock_tokens, swa_tokens_per_request
    from hwkv.integrations.hf_model import PoolPlan
    from hwkv.integrations.sampling import SamplingParams
    from hwkv.integrations.scheduler import Request, Scheduler
    p = 4
    plan = PoolPlan(size=512, size_swa=256, page_size=p, context=128, max_running=8, chunk=16,
                    full_bytes_per_token=1, swa_bytes_per_token=1, memory_bytes=0)
    lock_pages = cache_lock_tokens(window, p, plan.context) // p
    assert lock_pages == 3                                         # round_up(W, 4) + 4 = 12 slots either way
    sched = Scheduler(plan, window, cached=True)
    req = Request(0, [5] * 40, SamplingParams(max_new_tokens=8))   # 47 KV tokens: 12 full pages
    sched.add(req)
    own = min(12, swa_tokens_per_request(window, p) // p)
    assert req.full_pages == 12 and req.swa_pages == own + lock_pages
    short = Request(1, [5] * 5, SamplingParams(max_new_tokens=2))  # a prompt of 2 pages: its lock pins at most those
    sched.add(short)
    assert short.swa_pages == min(2, swa_tokens_per_request(window, p) // p) + 2
    assert Scheduler(plan, window, cached=False).swa_locked == 0


def test_a_request_that_saw_its_stop_token_decodes_no_more():
    """scheduler.py:67 drops `and self.finish_reason is None` from `Request.decodes`. A request whose stop token was
    read (finish_reason "stop", fewer than max_new_tokens sampled) stayed in `schedule()`'s decoding rows."""
    from hwkv.integrations.hf_model import PoolPlan
    from hwkv.integrations.sampling import SamplingParams
    from hwkv.integrations.scheduler import Request, Scheduler
    plan = PoolPlan(size=256, size_swa=0, page_size=4, context=64, max_running=4, chunk=16,
                    full_bytes_per_token=1, swa_bytes_per_token=0, memory_bytes=0)
    sched = Scheduler(plan, None)
    reqs = [Request(i, [3, 4, 5], SamplingParams(max_new_tokens=8, stop_token_ids=[9])) for i in range(2)]
    for r in reqs:
        sched.add(r)
    assert sched.admit() == reqs
    for r in reqs:
        r.kv_len = 3
    assert not reqs[0].add_token(7) and reqs[1].add_token(9)       # request 1 stops at its first token
    assert reqs[0].decodes and not reqs[1].decodes and reqs[1].finish_reason == "stop"
    assert [row.req for row in sched.schedule()] == [reqs[0]]


# --------------------------------------------------------------------------------------- hwkv/engine/forward.py
def _forward_slots(window=4, page=4):
    from hwkv.engine.forward import ForwardSlots
    from hwkv.req_to_token import ReqToTokenPool
    alloc = SWATokenToKVPoolAllocator(256, 128, page, "cpu", None)
    return ForwardSlots(alloc, ReqToTokenPool(4, 64, "cpu"), window)


def test_the_host_frontier_never_moves_back_from_a_cached_start():
    """forward.py:281 `np.maximum(old, ...)` -> `np.maximum(0, ...)`. A request started from a cached prefix has its
    frontier where the cache's SWA begins (`set_frontier`), ahead of the rule's value for short lengths; the
    device release keeps the larger one, so the host copy must too (it had moved back to 0 and said it moved)."""
    slots = _forward_slots()
    row = slots.new_rows(1)[0]
    slots.set_frontier(row, 16)
    assert not slots.move_frontiers([row], [20])          # the rule gives (20 - 4 + 1) // 4 * 4 - 4 = 12 < 16
    assert slots.frontiers_cpu[row] == 16 and int(slots.frontiers[row]) == 16
    assert slots.move_frontiers([row], [28]) and slots.frontiers_cpu[row] == 20


def test_undo_gives_back_the_opened_pages_and_clears_the_rows_entries():
    """forward.py:182 `rtt[row_of, pos_t] = 0` removed. After a forward that raised, `undo` gives back the pages its
    tokens opened and the rows' entries for those tokens become the padding slot 0; they had kept the freed locs
    (a later reader of the row past its length, or a second undo, would take slots another request now holds)."""
    from hwkv.batch import ForwardMode
    slots = _forward_slots()
    rows = slots.new_rows(2)
    a = slots.allocator
    free0 = a.full_available_size()
    s = slots.plan_extend(ForwardMode.EXTEND, rows, [0, 0], [6, 3])
    batch = slots.allocate(s)
    rtt = slots.rtt.req_to_token
    assert a.full_available_size() == free0 - 3 * 4 and int((rtt[rows] > 0).sum()) == 9
    assert slots.undo(rows, [0, 0], [6, 3], batch.out_cache_loc)
    assert a.full_available_size() == free0 and a.swa_available_size() == 128
    assert not bool(rtt[rows].any()), "the undone tokens' req_to_token entries name no slot"
    a.check_integrity()


# ------------------------------------------------------------------------------------------- hwkv/spec_plan.py
def test_a_graph_verify_of_ragged_draft_counts_that_add_up_is_refused_without_host_lengths():
    """spec_plan.py:70 drops `or value_range(ext) != (per, per)`. Draft counts [1, 3] make 4 tokens over 2 requests,
    so tokens == bs * per (per 2) and a mask of bs * per^2 = 8 entries passes the static size check, though the
    counts need sum(n^2) = 10: without the host copy only the device lengths (readable on CPU) can say so."""
    import dataclasses
    from test_spec_refusals import VERIFY, assert_unchanged, harness, snapshot
    h, rids = harness()
    be = h.backend
    be.init_graph_state(2, 8)
    good = h.make_batch(rids, [2, 2], VERIFY)
    good.spec_info = DraftTree.from_parents([[-1, 0], [-1, 0]])
    be.init_forward_metadata_graph(good, max_q_len=2)
    bad = dataclasses.replace(h.make_batch(rids, [1, 3], VERIFY), extend_seq_lens_cpu=None, seq_lens_cpu=None)
    bad.spec_info = DraftTree.from_parents([[-1, 0], [-1, 0]])
    before = snapshot(h)
    with pytest.raises(ShapeError, match=r"a graph verify takes equal draft counts per request: extend_seq_lens are "
                                         r"\[1, 3\], 4 tokens over 2 requests"):
        be.init_forward_metadata_graph(bad)
    assert_unchanged(h, before)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_verify_tree_on_another_device_type_than_the_pool_is_a_shape_error(graph):
    """spec_plan.py:59 the device check removed. A DraftTree mask on another device type (meta here) than the pool
    went on to the mask build and failed there untyped, or worse on a real second device."""
    from test_spec_refusals import VERIFY, assert_unchanged, harness, snapshot
    h, rids = harness()
    be = h.backend
    if graph:
        be.init_graph_state(2, 8)
    batch = h.make_batch(rids, [2, 2], VERIFY)
    batch.spec_info = DraftTree(DraftTree.from_parents([[-1, 0], [-1, 0]]).mask.to("meta"))
    before = snapshot(h)
    with pytest.raises(ShapeError, match="DraftTree.mask lives on meta"):
        be.init_forward_metadata_graph(batch, max_q_len=2) if graph else be.init_forward_metadata(batch)
    assert_unchanged(h, before)
