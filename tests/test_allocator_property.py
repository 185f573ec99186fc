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

from hwkv.allocator import ReqToTokenPool, SWATokenToKVPoolAllocator, release_out_of_window_batch, same_snapshot
from hwkv.errors import DoubleFreeError, NotAllocatedError, OutOfSlotsError
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
