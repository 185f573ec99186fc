"""Review 26 (deferred checks): refusals that immediate mode makes before any change, but that deferred mode (the
default on accelerators: `allocator.immediate = False`) neither records nor keeps atomic.

1. `release_out_of_window_batch` with a frontier that is negative or off the page grid: immediate mode refuses it
   (LocError); deferred mode recorded nothing and released pages off the grid (torch ops, the Triton release and the
   one-launch step alike). Now each records ERR_FRONTIER (a LocError naming the row) and that row releases nothing.
2. `HybridPrefixCache.insert` (and the other calls that `_precheck` first) promise "a refusal changes nothing".
   With deferred checks the allocator recorded the refused share, but the tree kept the new nodes; once the
   error had been raised (once), the cache still held nodes over pages it has no reference on, and a later
   eviction freed pages another holder owns. On the CPU the cache now checks its shares on the host in both
   modes (reading CPU tensors waits for nothing).
3. The engine with the prefix cache and deferred checks: an error a device op recorded earlier is raised by the
   first synchronizing read, which is admission's `full_available_size()` in `EnginePrefix.start`, after the
   request's match was locked (`c.lock(m)`) and before anything unlocks it: the lock leaks, and the matched
   nodes stay locked (never evictable) for the rest of the engine's life, with no request running.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hwkv.allocator import same_snapshot  # noqa: E402
from hwkv.cache import HybridPrefixCache  # noqa: E402
from hwkv.errors import HwkvError, LocError, NotAllocatedError  # noqa: E402
from hwkv.req_to_token import ReqToTokenPool  # noqa: E402
from hwkv.engine.sampling import SamplingParams  # noqa: E402
from hwkv.pages import ERR_DOUBLE_FREE  # noqa: E402
from hwkv.release import release_out_of_window_batch  # noqa: E402

I64 = torch.int64
P = 4

pytestmark = pytest.mark.usefixtures("one_thread")


def T(xs):
    return torch.tensor(xs, dtype=I64)


def hybrid(ops="torch", immediate=False, size=128):
    """test_review20_pages' hybrid CPU allocator with the torch ops or the Triton kernels (interpreted)."""
    from test_review20_pages import make, triton_ops
    from hwkv.torch_page_ops import TORCH_OPS
    if ops == "triton" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1")
    return make(TORCH_OPS if ops == "torch" else triton_ops, immediate, size, size)


# ---- 1. a release with a frontier off the page grid (deferred) ------------------------------------------------
@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_deferred_release_with_a_frontier_off_the_page_grid_is_recorded(ops):
    """Immediate mode: LocError "frontier 3 is not a multiple of page_size 4", nothing changes. Deferred, before: no
    record; the release freed the pages of positions 3, 7, 11 and moved the frontier to 16. Now: recorded (the
    next check raises the LocError naming the row), and that row releases nothing: its frontier and every page
    and mapping stay as they were."""
    a = hybrid(ops, immediate=False)
    loc = a.alloc_extend([0], [24], [0], 24)
    rtt = torch.zeros(1, 32, dtype=I64)
    rtt[0, :24] = loc
    a.check_integrity()
    before = a.integrity_snapshot()
    f = T([3])
    release_out_of_window_batch(a, rtt, T([0]), T([24]), f, 4)      # deferred: recorded, nothing raised here
    with pytest.raises(LocError, match="request row 0's release frontier is negative or not a multiple of page_size"):
        a.check_integrity()
    assert f.tolist() == [3], "the bad row's frontier stays"
    assert same_snapshot(before, a.integrity_snapshot()), "the bad row released pages"


# ---- 2. the prefix cache under deferred checks -----------------------------------------------------------------
def test_deferred_cache_insert_refusal_leaves_the_tree_unchanged():
    """insert() of pages that are not live: immediate mode raises NotAllocatedError and the cache is unchanged.
    Deferred, before: the allocator recorded the refused share (raised by the next check), but the tree kept 8 tokens
    of nodes over pages it holds no reference on. Now refused at once on the CPU, every node, count and page as
    before."""
    from test_cache_defects import Setup
    st = Setup.__new__(Setup)
    st.a = hybrid(immediate=False, size=32)
    st.c = HybridPrefixCache(st.a, 8)
    st.rtt = ReqToTokenPool(2, 32, "cpu")
    loc = st.a.alloc(8)
    st.a.free(loc)                                # the pages are free again: a stale loc list
    before = st.snapshot()
    with pytest.raises(NotAllocatedError, match="not live"):
        st.c.insert(list(range(8)), loc, 0)
    st.a.check_integrity()                        # nothing recorded either
    assert st.same(before, st.snapshot()), "the refused insert changed the cache or the allocator"
    st.c.check_integrity()


def test_deferred_cache_refusal_later_frees_another_holders_pages():
    """The consequence the previous test guards against: had the tree kept the refused insert, the next request
    would take every page and the cache's eviction would free two pages that request holds. The refusal comes at
    once on the CPU, deferred checks or not, and nothing the cache holds names another holder's pages."""
    a = hybrid(immediate=False, size=32)
    c = HybridPrefixCache(a, 8)
    loc = a.alloc(8)
    a.free(loc)
    with pytest.raises(HwkvError, match="not live"):
        c.insert(list(range(8)), loc, 0)
    a.check_integrity()                           # nothing recorded either
    other = a.alloc(32)                           # every page, held by another request
    assert other.numel() == 32
    assert (c.full_tokens, c.evictable_full) == (0, 0)   # nothing to evict: the tree kept nothing
    a.check_integrity()
    c.check_integrity()
    assert a.available_size() == 0


# ---- 3. the engine: a deferred error raised at admission leaks the match's lock ---------------------------------
def test_engine_admission_that_raises_a_deferred_error_leaks_the_cache_lock():
    """Expected: the step raises the recorded error (the next synchronizing call does) and leaves the cache as it
    was: once every request has finished, everything cached is evictable again. Actual: the lock `EnginePrefix.start`
    took on the match before reading `full_available_size()` is never released; at the end of the run, with no
    request running, 28 of the cache's 32 full tokens (and 8 SWA tokens) stay locked for good."""
    from test_engine_defects import _engine  # the tiny engine over SyntheticModel, CPU
    e, _ = _engine()
    a = e.cache.allocator
    a.immediate = False                           # deferred checks, as on accelerators
    prompt = list(range(1, 30))
    e.add_request(prompt, SamplingParams(max_new_tokens=3))
    while e.has_work():
        e.step()
    e.check_integrity()
    c = e.prefix
    assert c.evictable_full == c.full_tokens > 0
    # an error a device op recorded (a caller's bad free, say), not raised yet: the next sync raises it
    a.record_error(torch.tensor([True]), torch.tensor([3]), ERR_DOUBLE_FREE)
    e.add_request(prompt + [5, 6], SamplingParams(max_new_tokens=3))
    with pytest.raises(HwkvError, match="already free"):
        e.step()                                  # raised at admission, after the match was locked
    while e.has_work():                           # the request is admitted on the next step and finishes
        e.step()
    e.check_integrity()
    assert not e.scheduler.running and not e.scheduler.waiting
    assert (c.evictable_full, c.evictable_swa) == (c.full_tokens, c.swa_tokens), \
        (f"with no request running, only {c.evictable_full} of {c.full_tokens} cached full tokens and "
         f"{c.evictable_swa} of {c.swa_tokens} SWA tokens are evictable: the refused admission's lock leaked")


# ---- 1b. the one-launch step's release checks its frontiers as the release does -----------------------------------
STEP_PATHS = ("torch", "triton three launches", "triton one launch")


def step_by_path(how, frontier_rows, bucket=1, window=1):
    """One deferred decode step of request row 0 (10 tokens, to 11) in a bucket of `bucket` lanes, the others padded
    onto row 1, page size 4, by `how` (one of STEP_PATHS), with the frontiers of `frontier_rows` ({row: value}) set
    first. Returns (allocator, rtt, frontiers, the allocator's snapshot before the step)."""
    from hwkv.ops import TORCH_STEP
    from hwkv_cuda.kernels import step as step_kernels
    a = hybrid("torch" if how == "torch" else "triton", immediate=False, size=64)
    rtt, frontiers = torch.zeros(2, 32, dtype=I64), torch.zeros(2, dtype=I64)  # row 1: the padding row
    rtt[0, :10] = a.alloc_extend(T([0]), T([10]), T([0]), 10, prefix_lens_cpu=T([0]), seq_lens_cpu=T([10]))
    a.check_integrity()
    for row, value in frontier_rows.items():
        frontiers[row] = value
    before = a.integrity_snapshot()
    heads = a.reserve(0)
    staged = T([heads[0], heads[1], 1] + [0, 11] + [0, 0] * (bucket - 1))
    ctl, rows_in, seq_in = staged[:3], staged[3::2], staged[4::2]
    rows, seq, out = (torch.zeros(bucket, dtype=I64) for _ in range(3))
    if how == "triton one launch":
        a.alloc_step(ctl, rows_in, seq_in, 1, rtt, rows, seq, out, frontiers=frontiers, window=window)
    else:
        kern = TORCH_STEP if how == "torch" else step_kernels.KERNELS
        prefix, last = torch.zeros(bucket, dtype=I64), torch.zeros(bucket, dtype=I64)
        kern.prologue(ctl, rows_in, seq_in, 1, rtt, rows, seq, prefix, last, out)
        if how == "torch":   # the torch ops size themselves from the host's live count
            a.alloc_reserved(prefix[:1], seq[:1], last[:1], out[:1], heads, 0)
        else:
            a.alloc_reserved(prefix, seq, last, out, ctl, 0)
        kern.write(rtt, rows, seq, out, None, None)
        release_out_of_window_batch(a, rtt, rows, seq, frontiers, window, by_row=True)
    return a, rtt, frontiers, before


def _step_with_an_off_grid_frontier(how):
    """A decode step to 11 tokens at W=1 whose row's frontier is 2 (page size 4): the torch path, the Triton three
    launches and the one-launch `alloc_step` each record one LocError and leave the frontier and pages as they were."""
    a, rtt, frontiers, before = step_by_path(how, {0: 2})
    with pytest.raises(HwkvError, match="row 0's release frontier is negative or not a multiple of page_size 4"):
        a.check_integrity()
    after = a.integrity_snapshot()
    # the step's own token took its slot; no SWA page was released
    assert torch.equal(after["full->SWA"]["table"][:40], before["full->SWA"]["table"][:40])
    return frontiers.tolist(), a.translate_loc_from_full_to_swa(rtt[0, :10]).tolist()


def test_one_launch_step_records_an_off_grid_frontier_like_the_other_paths():
    got = {how: _step_with_an_off_grid_frontier(how) for how in STEP_PATHS}
    assert got["torch"][0][0] == 2, "the bad row's frontier stays"
    assert all(g == got["torch"] for g in got.values()), got
