"""A hypothesis state machine drives the device-resident allocators like an engine: new requests,
chunked extends, batched decode, batched out-of-window release, finishes, and bad frees.

After every step: `check_integrity()`, free-count accounting of both pools, and release safety
(every token a later query can see still maps to a live SWA slot). Runs on CPU tensors with the
immediate checks (CPU's default), with the deferred device-side checks (what GPUs run), and, when
a GPU is present, on it (HWKV_TEST_DEVICE=cuda selects it).
"""
import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.release import release_out_of_window_batch
from hwkv.req_to_token import ReqToTokenPool
from hwkv.errors import DoubleFreeError, HwkvError, NotAllocatedError, OutOfSlotsError
from hwkv.pool import SWAKVPool

DEVICE = os.environ.get("HWKV_TEST_DEVICE", "cpu")
SIZE, SIZE_SWA, ROWS, CTX = 128, 48, 6, 256


def cdiv(a, b):
    return -(-a // b)


class AllocatorMachine(RuleBasedStateMachine):
    deferred = False

    @initialize(page=st.sampled_from([1, 2, 4]), window=st.integers(1, 9))
    def setup(self, page, window):
        self.page, self.window = page, window
        pool = SWAKVPool(SIZE, SIZE_SWA, page, torch.float32, 1, 2, [0], [1], DEVICE)
        self.a = SWATokenToKVPoolAllocator(SIZE, SIZE_SWA, page, DEVICE, pool)
        if self.deferred:
            self.a.immediate = False
        self.rtt = ReqToTokenPool(ROWS, CTX, DEVICE)
        self.frontiers = torch.zeros(ROWS, dtype=torch.int64, device=DEVICE)
        self.reqs = {}  # row -> seq_len

    def dev(self, xs):
        return torch.tensor(xs, dtype=torch.int64, device=DEVICE)

    def alloc_extend(self, rows, new):
        prefix = [self.reqs.get(r, 0) for r in rows]
        seq = [p + n for p, n in zip(prefix, new)]
        last = self.rtt.req_to_token[self.dev(rows), (self.dev(prefix) - 1).clamp(min=0)]
        try:
            loc = self.a.alloc_extend(self.dev(prefix), self.dev(seq), last, sum(new),
                                      prefix_lens_cpu=torch.tensor(prefix), seq_lens_cpu=torch.tensor(seq))
        except OutOfSlotsError:
            return False
        start = 0
        for r, p, n in zip(rows, prefix, new):
            self.rtt.write(r, p, loc[start:start + n])
            self.reqs[r] = p + n
            start += n
        return True

    @precondition(lambda self: self.rtt.available_size() > 0)
    @rule(n=st.integers(1, 20))
    def new(self, n):
        row = self.rtt.alloc(1)[0]
        self.frontiers[row] = 0
        if not self.alloc_extend([row], [n]):
            self.rtt.free(row)

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 7), n=st.integers(1, 12))
    def extend(self, pick, n):
        rows = sorted(self.reqs)
        self.alloc_extend([rows[pick % len(rows)]], [n])

    @precondition(lambda self: self.reqs)
    @rule()
    def decode(self):
        rows = sorted(self.reqs)
        seq = [self.reqs[r] + 1 for r in rows]
        if max(seq) > CTX:
            return
        r_dev, s_dev = self.dev(rows), self.dev(seq)
        last = self.rtt.req_to_token[r_dev, s_dev - 2]
        try:
            loc = self.a.alloc_decode(s_dev, last, seq_lens_cpu=torch.tensor(seq))
        except OutOfSlotsError:
            return
        self.rtt.req_to_token[r_dev, s_dev - 1] = loc
        for r, s in zip(rows, seq):
            self.reqs[r] = s

    @precondition(lambda self: self.reqs)
    @rule()
    def release(self):
        rows = self.dev(sorted(self.reqs))
        f = self.frontiers[rows]
        release_out_of_window_batch(self.a, self.rtt.req_to_token, rows,
                                    self.dev([self.reqs[r] for r in sorted(self.reqs)]), f, self.window)
        self.frontiers[rows] = f

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 7))
    def finish(self, pick):
        rows = sorted(self.reqs)
        row = rows[pick % len(rows)]
        s = self.reqs.pop(row)
        self.a.free(self.rtt.req_to_token[row, :s].clone())
        self.rtt.free(row)

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 7))
    def bad_free(self, pick):
        """A double free and an SWA double release are reported and change nothing."""
        rows = sorted(self.reqs)
        row = rows[pick % len(rows)]
        s, f = self.reqs[row], int(self.frontiers[row])
        before = self.a.integrity_snapshot()
        if f:  # released pages: their SWA slots are gone already
            with pytest.raises(DoubleFreeError):
                self.a.free_swa(self.rtt.req_to_token[row, :1].clone())
                self.a.available_size()
        never = torch.tensor([SIZE], device=DEVICE)  # a slot of the pool's last page
        if int(self.a.pages.refs[-1]) < 1:  # the pool's last page is not live: freeing it must fail
            with pytest.raises((DoubleFreeError, NotAllocatedError)):
                self.a.free(never)
                self.a.available_size()
        after = self.a.integrity_snapshot()
        assert same_snapshot(before, after)  # rings, reference counts and the full->SWA table

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 7))
    def continue_released_page(self, pick):
        """A request whose partial last page lost its SWA slots decodes into that page: immediate mode
        raises NotAllocatedError before any change, deferred mode (on CPU tensors too) records it and the
        next sync raises it. The request is then finished."""
        p = self.page
        rows = [r for r in sorted(self.reqs) if self.reqs[r] % p and self.reqs[r] < CTX]
        if not rows:
            return
        row = rows[pick % len(rows)]
        s, f = self.reqs.pop(row), int(self.frontiers[row])
        start = s // p * p
        if start < f:
            self.reqs[row] = s
            return
        r_to_t = self.rtt.req_to_token
        self.a.free_swa(r_to_t[row, start:start + 1].clone())
        before = self.a.integrity_snapshot()
        with pytest.raises(NotAllocatedError, match="no SWA slot"):
            loc = self.a.alloc_decode(self.dev([s + 1]), r_to_t[row, s - 1:s].clone(),
                                      seq_lens_cpu=torch.tensor([s + 1]))
            r_to_t[row, s] = loc[0]
            s += 1
            self.a.available_size()
        if not self.deferred:
            assert same_snapshot(before, self.a.integrity_snapshot())
        if f:
            self.a.free(r_to_t[row, :f].clone(), with_swa=False)
        if start > f:
            self.a.free(r_to_t[row, f:start].clone())
        self.a.free(r_to_t[row, start:s].clone(), with_swa=False)
        self.rtt.free(row)

    @invariant()
    def consistent(self):
        if not hasattr(self, "a"):
            return
        a, p = self.a, self.page
        a.check_integrity()
        full_pages = sum(cdiv(s, p) for s in self.reqs.values())
        assert a.full_available_size() == SIZE - full_pages * p
        swa_pages = sum(cdiv(s, p) - int(self.frontiers[r]) // p for r, s in self.reqs.items())
        assert a.swa_available_size() == SIZE_SWA - swa_pages * p
        m = a.full_to_swa_index_mapping
        for r, s in self.reqs.items():
            f = int(self.frontiers[r])
            row = self.rtt.req_to_token[r, :s]
            assert f <= max(s - self.window + 1, 0), "a visible token was released"
            assert bool((m[row[f:]] > 0).all()), "a token at or after the frontier lost its SWA slot"
            assert bool((m[row[:f]] == 0).all()), "a released token still maps"


class DeferredAllocatorMachine(AllocatorMachine):
    deferred = True


SETTINGS = settings(max_examples=30, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = SETTINGS
TestDeferredAllocatorMachine = DeferredAllocatorMachine.TestCase
TestDeferredAllocatorMachine.settings = SETTINGS


def _triton_ops():
    pytest.importorskip("triton")
    from hwkv_cuda.kernels.alloc import TritonPageOps
    return TritonPageOps()


class TritonAllocatorMachine(AllocatorMachine):
    """The Triton kernels (interpreted on CPU tensors in CI) with device-side error records."""

    deferred = True

    @initialize(page=st.sampled_from([1, 4]), window=st.integers(1, 9))
    def setup(self, page, window):
        super().setup(page, window)
        self.a._ops = self.a.swa_attn_allocator._ops = _triton_ops()


TestTritonAllocatorMachine = pytest.mark.interpret(TritonAllocatorMachine.TestCase)
TestTritonAllocatorMachine.settings = settings(max_examples=8, stateful_step_count=20, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])


# ---- the host (numpy) path of checked CPU ops against the torch ops ------------------------------------------
class Twin:
    """An allocator whose every call also runs on a twin that applies the same ops through the torch ops
    (`host_ops = False`): the same outputs, the same refusals and the same state after each call, rings in
    the same order included (`integrity_snapshot` lists free pages in ring order)."""

    CALLS = ("alloc_extend", "alloc_decode", "free", "free_swa", "share")

    def __init__(self, host, torch_ops):
        self.host, self.twin = host, torch_ops
        torch_ops.host_ops = torch_ops.swa_attn_allocator.host_ops = False

    def same(self):
        assert same_snapshot(self.host.integrity_snapshot(), self.twin.integrity_snapshot())

    def __getattr__(self, name):
        attr = getattr(self.host, name)
        if name not in self.CALLS:
            return attr

        def both(*args, **kw):
            args2 = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]
            kw2 = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
            try:
                out = attr(*args, **kw)
            except HwkvError as e:
                with pytest.raises(type(e)):
                    getattr(self.twin, name)(*args2, **kw2)
                self.same()
                raise
            out2 = getattr(self.twin, name)(*args2, **kw2)
            assert (out is None and out2 is None) or torch.equal(out, out2), f"{name}: {out} != {out2}"
            self.same()
            return out

        return both


class HostOpsMachine(AllocatorMachine):
    """The engine-like machine above on twinned allocators, plus forks sharing a request's whole pages (the
    SWA pages too where still mapped), so pages with several holders are released and freed as well."""

    @initialize(page=st.sampled_from([1, 2, 4]), window=st.integers(1, 9))
    def setup(self, page, window):
        super().setup(page, window)
        twin_pool = SWAKVPool(SIZE, SIZE_SWA, page, torch.float32, 1, 2, [0], [1], DEVICE)
        self.a = Twin(self.a, SWATokenToKVPoolAllocator(SIZE, SIZE_SWA, page, DEVICE, twin_pool))
        self.forked = set()  # rows holding pages with another holder (the exclusive-page rules skip them)

    @precondition(lambda self: self.reqs and self.rtt.available_size() > 0)
    @rule(pick=st.integers(0, 7), pages=st.integers(1, 8))
    def fork(self, pick, pages):
        rows = sorted(self.reqs)
        src = rows[pick % len(rows)]
        n = min(pages * self.page, self.reqs[src] // self.page * self.page)
        if n == 0:
            return
        f = min(int(self.frontiers[src]), n)
        row = self.rtt.alloc(1)[0]
        locs = self.rtt.req_to_token[src, :n].clone()
        if f:
            self.a.share(locs[:f], with_swa=False)
        if f < n:
            self.a.share(locs[f:])
        self.rtt.write(row, 0, locs)
        self.frontiers[row] = f
        self.reqs[row] = n
        self.forked |= {src, row}

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 7))
    def share_and_free_repeated(self, pick):
        """One more holder of a request's in-window pages, taken and dropped through locs naming each page in
        two separate runs (as a batch of requests sharing a prefix does): each distinct page counts once."""
        rows = sorted(self.reqs)
        row = rows[pick % len(rows)]
        f, s = int(self.frontiers[row]), self.reqs[row]
        if f >= s:
            return
        locs = self.rtt.req_to_token[row, f:s]
        twice = torch.cat([locs, locs.flip(0), locs])
        self.a.share(twice)
        self.a.free(twice)

    def _exclusive(self):
        return {r: s for r, s in self.reqs.items() if r not in self.forked}

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 7))
    def bad_free(self, pick):
        reqs, self.reqs = self.reqs, self._exclusive()
        try:
            if self.reqs:
                super().bad_free(pick)
        finally:
            self.reqs = {**reqs, **{r: s for r, s in self.reqs.items()}}

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 7))
    def continue_released_page(self, pick):
        shared = {r: s for r, s in self.reqs.items() if r in self.forked}
        self.reqs = self._exclusive()
        try:
            super().continue_released_page(pick)
        finally:
            self.reqs.update(shared)

    @precondition(lambda self: self.reqs)
    @rule()
    def release(self):
        rows = self.dev(sorted(self.reqs))
        seq = self.dev([self.reqs[r] for r in sorted(self.reqs)])
        f = self.frontiers[rows]
        f2 = f.clone()
        rtt2 = self.rtt.req_to_token.clone()
        try:
            release_out_of_window_batch(self.a.host, self.rtt.req_to_token, rows, seq, f, self.window)
        except HwkvError as e:
            with pytest.raises(type(e)):
                release_out_of_window_batch(self.a.twin, rtt2, rows, seq, f2, self.window)
            self.a.same()
            raise
        release_out_of_window_batch(self.a.twin, rtt2, rows, seq, f2, self.window)
        assert torch.equal(f, f2)
        self.a.same()
        self.frontiers[rows] = f

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 7))
    def finish(self, pick):
        rows = sorted(self.reqs)
        row = rows[pick % len(rows)]
        s, f = self.reqs.pop(row), int(self.frontiers[row])
        if f:  # released pages: their SWA references are gone already (another holder may still have its own)
            self.a.free(self.rtt.req_to_token[row, :f].clone(), with_swa=False)
        if f < s:  # named twice, the second time backwards: pages go back in the order of their last entries
            locs = self.rtt.req_to_token[row, f:s]
            self.a.free(torch.cat([locs, locs.flip(0)]) if pick % 2 else locs.clone())
        self.rtt.free(row)
        self.forked.discard(row)

    @invariant()
    def consistent(self):
        if not hasattr(self, "a"):
            return
        self.a.check_integrity()
        self.a.twin.check_integrity()
        self.a.same()
        m = self.a.full_to_swa_index_mapping
        for r, s in self.reqs.items():
            f = int(self.frontiers[r])
            row = self.rtt.req_to_token[r, :s]
            assert bool((m[row[f:]] > 0).all()), "a token at or after the frontier lost its SWA slot"


# the host path runs on CPU tensors only: on a GPU both allocators would take the device's kernels (deferred
# refusals, frees appended to the rings in the order the device's programs finish), so nothing would be twinned
TestHostOpsMachine = pytest.mark.skipif(DEVICE != "cpu", reason="the host (numpy) path of the ops runs on CPU tensors "
                                        "only")(HostOpsMachine.TestCase)
TestHostOpsMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
