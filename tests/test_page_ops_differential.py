"""The torch page ops (`hwkv.torch_page_ops.TorchPageOps`) against the Triton ones (`hwkv_cuda.kernels.alloc`).

Both drive one allocator each through the same random op sequences (hypothesis: alloc_extend, alloc_decode,
free, free_swa, share, release_out_of_window_batch, and bad ops, all with the deferred device-side checks
accelerators run) and are compared after every op: free pages as a multiset (their order in the ring is
unspecified: a GPU pushes in whatever order its programs run, so the Triton ring is given the torch order
after each comparison), reference counts, the full->SWA table, frontiers, req_to_token and the error record.
A sweep (page-rounded runs released out of window and freed, page sizes 4..256, windows 1..8) must return
every page. CI runs the kernels under TRITON_INTERPRET=1 on CPU tensors; `HWKV_TEST_DEVICE=cuda` runs them
compiled on a GPU, with larger pools and more examples.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule  # noqa: E402

from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot  # noqa: E402
from hwkv.release import release_out_of_window_batch  # noqa: E402
from hwkv.req_to_token import ReqToTokenPool  # noqa: E402
from hwkv.torch_page_ops import TORCH_OPS  # noqa: E402
from hwkv.errors import HwkvError  # noqa: E402
from hwkv.ops import TORCH_STEP  # noqa: E402

triton = pytest.importorskip("triton")

DEVICE = os.environ.get("HWKV_TEST_DEVICE", "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
GPU = DEVICE != "cpu"
pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(not GPU and not INTERPRET, reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1 "
                                                         "(on a GPU machine set HWKV_TEST_DEVICE=cuda)"),
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA GPU on this machine"),
]
if DEVICE == "cuda":
    pytestmark.append(pytest.mark.cuda)

I64 = torch.int64


def triton_ops():
    from hwkv_cuda.kernels.alloc import TritonPageOps
    return TritonPageOps()


def allocator(ops, size, size_swa, page):
    a = SWATokenToKVPoolAllocator(size, size_swa, page, DEVICE, None)
    a._ops = a.swa_attn_allocator._ops = ops
    a.immediate = False  # device-side checks, errors recorded: what accelerators run
    return a


def T(xs):
    return torch.tensor(xs, dtype=I64, device=DEVICE)


class System:
    """One allocator with its rows (and one more: a whole-step graph's padding row) and frontiers."""

    def __init__(self, ops, page, pages, swa_pages, rows, ctx):
        self.a = allocator(ops, pages * page, swa_pages * page, page)
        self.rtt = torch.zeros(rows + 1, ctx, dtype=I64, device=DEVICE)
        self.pad_row = rows
        self.frontiers = torch.zeros(rows + 1, dtype=I64, device=DEVICE)


def captured_step(s, heads, opened, rows, seq, bucket, three_launches=None, window=None):
    """A whole-step graph's allocation (hwkv.step_graph) from a staged block as the graph sends it: [head_full,
    head_swa, live] then (row, length) pairs, stale ones past the live; returns (rows, seq, out) of the bucket.
    One launch where the allocator's ops have `alloc_step`, else the torch path's three steps (or these); with a
    window, the rows' out-of-window release too (in the launch, or after the three as the step graph runs it)."""
    n = len(rows)
    staged = torch.full((3 + 2 * bucket,), 5, dtype=I64, device=DEVICE)  # stale pairs: row 5, length 5
    staged[:3] = T([heads[0], heads[1] if len(heads) > 1 else 0, n])
    staged[3:3 + 2 * n:2], staged[4:4 + 2 * n:2] = T(rows), T(seq)
    ctl, rows_in, seq_in = staged[:3], staged[3::2], staged[4::2]
    out = [torch.full((bucket,), -9, dtype=I64, device=DEVICE) for _ in range(3)]
    if three_launches is None and s.a.allocates_step_in_one:
        s.a.alloc_step(ctl, rows_in, seq_in, s.pad_row, s.rtt, *out, frontiers=s.frontiers if window else None,
                       window=window or 0)
        return out
    kernels = three_launches or TORCH_STEP
    prefix, last = torch.zeros(bucket, dtype=I64, device=DEVICE), torch.zeros(bucket, dtype=I64, device=DEVICE)
    kernels.prologue(ctl, rows_in, seq_in, s.pad_row, s.rtt, out[0], out[1], prefix, last, out[2])
    if three_launches is None:  # the torch ops size themselves from host values
        s.a.alloc_reserved(prefix[:n], out[1][:n], last[:n], out[2][:n], heads, opened)
    else:
        s.a.alloc_reserved(prefix, out[1], last, out[2], ctl, 0)
    kernels.write(s.rtt, out[0], out[1], out[2], None, None)
    if window:
        release_out_of_window_batch(s.a, s.rtt, out[0], out[1], s.frontiers, window, by_row=True)
    return out


def same_state(ref: System, tri: System, what: str) -> None:
    """Compare, then give the Triton ring the torch ring's order and clear both error records."""
    for r, t in zip(ref.a._rings(), tri.a._rings()):
        assert r.head == t.head and int(r.tail[0]) == int(t.tail[0]), f"{what}: {r.name} head/tail differ"
        assert sorted(r.free_list().tolist()) == sorted(t.free_list().tolist()), f"{what}: {r.name} free pages"
        assert torch.equal(r.refs.cpu(), t.refs.cpu()), f"{what}: {r.name} reference counts"
        assert r.pending() == t.pending(), f"{what}: {r.name} error record torch {r.pending()} triton {t.pending()}"
    assert torch.equal(ref.a.full_to_swa_index_mapping.cpu(), tri.a.full_to_swa_index_mapping.cpu()), \
        f"{what}: full->SWA table"
    assert torch.equal(ref.frontiers.cpu(), tri.frontiers.cpu()), f"{what}: frontiers"
    assert torch.equal(ref.rtt.cpu(), tri.rtt.cpu()), f"{what}: req_to_token (the allocated slots)"
    for r, t in zip(ref.a._rings(), tri.a._rings()):
        t.ring.copy_(r.ring)
        for ring in (r, t):
            try:
                ring.raise_pending()
            except HwkvError:
                pass


class PageOpsMachine(RuleBasedStateMachine):
    """Engine-like and bad ops on two allocators, torch and Triton page ops, compared after each."""

    ROWS = 4
    PAGES, SWA_PAGES, CTX, LEN = (48, 20, 256, 40) if GPU else (24, 10, 96, 12)

    @initialize(page=st.sampled_from([1, 2, 4, 8] if GPU else [1, 2, 4]), window=st.integers(1, 9))
    def setup(self, page, window):
        self.page, self.window = page, window
        self.sys = [System(ops, page, self.PAGES, self.SWA_PAGES, self.ROWS, self.CTX)
                    for ops in (TORCH_OPS, triton_ops())]
        self.reqs = {}  # row -> seq_len
        self.free_rows = list(range(self.ROWS))

    # ---- helpers -------------------------------------------------------------------------------
    def both(self, what, fn):
        """Run fn(system) on both; the same typed error or none; then compare."""
        res = []
        for s in self.sys:
            try:
                res.append((None, fn(s)))
            except HwkvError as e:
                res.append((type(e), str(e)))
        assert res[0][0] == res[1][0], f"{what}: torch {res[0]} triton {res[1]}"
        same_state(*self.sys, what)
        return res[0][0] is None

    @property
    def ref(self):
        return self.sys[0]

    def frontier(self, row):
        return int(self.ref.frontiers[row])

    def swa_refs(self, locs):
        a = self.ref.a
        sp = a.full_to_swa_index_mapping[locs] // self.page
        return a.swa_attn_allocator.pages.refs[sp]

    def alloc(self, rows, prefix, new):
        seq = [p + n for p, n in zip(prefix, new)]

        def go(s):
            last = s.rtt[T(rows), (T(prefix) - 1).clamp(min=0)]
            loc = s.a.alloc_extend(T(prefix), T(seq), last, sum(new), prefix_lens_cpu=torch.tensor(prefix),
                                   seq_lens_cpu=torch.tensor(seq))
            at = 0
            for r, p, n in zip(rows, prefix, new):
                s.rtt[r, p:p + n] = loc[at:at + n]
                at += n
        return go, seq

    # ---- engine ops ----------------------------------------------------------------------------
    @precondition(lambda self: self.free_rows)
    @rule(lens=st.lists(st.integers(1, 99), min_size=1, max_size=3))
    def new(self, lens):
        rows = self.free_rows[:len(lens)]
        lens = [1 + x % self.LEN for x in lens[:len(rows)]]
        go, seq = self.alloc(rows, [0] * len(rows), lens)

        def fresh(s):
            s.frontiers[T(rows)] = 0
            go(s)
        if self.both("new", fresh):
            self.reqs.update(zip(rows, seq))
            self.free_rows = self.free_rows[len(rows):]

    @precondition(lambda self: self.reqs)
    @rule(picks=st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True),
          lens=st.lists(st.integers(0, 99), min_size=4, max_size=4))
    def extend(self, picks, lens):
        """Several requests at once, continuing partial pages; a request may add nothing."""
        live = sorted(self.reqs)
        rows = sorted({live[p % len(live)] for p in picks})
        new = [x % (self.LEN // 2 + 1) for x in lens[:len(rows)]]
        prefix = [self.reqs[r] for r in rows]
        if max(p + n for p, n in zip(prefix, new)) > self.CTX:
            return
        go, seq = self.alloc(rows, prefix, new)
        if self.both("extend", go):
            self.reqs.update(zip(rows, seq))

    @precondition(lambda self: self.reqs)
    @rule(host=st.booleans())
    def decode(self, host):
        rows = sorted(self.reqs)
        seq = [self.reqs[r] + 1 for r in rows]
        if max(seq) > self.CTX:
            return

        def go(s):
            last = s.rtt[T(rows), T(seq) - 2]
            loc = s.a.alloc_decode(T(seq), last, seq_lens_cpu=torch.tensor(seq) if host else None)
            s.rtt[T(rows), T(seq) - 1] = loc
        if self.both("decode", go):
            self.reqs.update(zip(rows, seq))

    @precondition(lambda self: self.reqs)
    @rule(by_row=st.booleans())
    def release(self, by_row):
        """The batch's frontiers gathered and put back, or (by_row) moved where they are kept: the Triton kernel
        reads and writes them by row, the torch ops gather and scatter around the release."""
        rows = sorted(self.reqs)
        if by_row:
            self.both("release by row", lambda s: release_out_of_window_batch(
                s.a, s.rtt, T(rows), T([self.reqs[r] for r in rows]), s.frontiers, self.window, by_row=True))
        else:
            self.both("release", lambda s: self._release(s, rows, [self.reqs[r] for r in rows]))

    def _release(self, s, rows, seq, frontiers=None):
        f = s.frontiers[T(rows)] if frontiers is None else frontiers
        release_out_of_window_batch(s.a, s.rtt, T(rows), T(seq), f, self.window)
        if frontiers is None:
            s.frontiers[T(rows)] = f

    @precondition(lambda self: self.reqs)
    @rule(pad=st.integers(0, 3), rev=st.booleans(), release=st.booleans())
    def captured_step(self, pad, rev, release):
        """A whole-step graph's allocation from its staged block (padded to a bucket, stale pairs past the live
        ones): Triton's one launch (`alloc_step`) against the torch path's prologue, allocation and write."""
        rows = sorted(self.reqs, reverse=rev)
        seq = [self.reqs[r] + 1 for r in rows]
        if max(seq) > self.CTX:
            return
        n, opened = len(rows), sum((x - 1) % self.page == 0 for x in seq)

        def go(s):
            heads = s.a.reserve(opened)
            s.step_out = captured_step(s, heads, opened, rows, seq, n + pad, window=self.window if release else None)
        if self.both("captured step", go):
            assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(self.ref.step_out, self.sys[1].step_out))
            self.reqs.update(zip(rows, seq))

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 7), strided=st.booleans())
    def finish(self, pick, strided):
        """Free a request: below its frontier without SWA (released already), from it with."""
        row = sorted(self.reqs)[pick % len(self.reqs)]
        seq, f = self.reqs.pop(row), self.frontier(row)

        def view(x):  # a strided view: the kernels must not read it as contiguous
            return torch.stack([x, torch.zeros_like(x)], 1)[:, 0] if strided else x.clone()

        def go(s):
            if f:
                s.a.free(view(s.rtt[row, :f]), with_swa=False)
            s.a.free(view(s.rtt[row, f:seq]))
            s.rtt[row] = 0
        self.both("finish", go)
        self.free_rows.append(row)

    @precondition(lambda self: self.reqs and self.free_rows)
    @rule(pick=st.integers(0, 7), n=st.integers(0, 99))
    def share(self, pick, n):
        """A new request takes the whole pages of another from its frontier on (a cached prefix), then extends."""
        src = sorted(self.reqs)[pick % len(self.reqs)]
        f = self.frontier(src)
        k = (self.reqs[src] - f) // self.page * self.page
        if k == 0:
            return
        row, new = self.free_rows[0], n % self.LEN
        go, seq = self.alloc([row], [k], [new])

        def shared(s):
            s.frontiers[row] = 0
            s.rtt[row, :k] = s.rtt[src, f:f + k]
            go(s)                      # allocate first: out of slots changes nothing
            s.a.share(s.rtt[row, :k].clone())
        if self.both("share", shared):
            self.reqs[row] = seq[0]
            self.free_rows.pop(0)
        else:
            for s in self.sys:
                s.rtt[row] = 0

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 7))
    def free_swa_shared(self, pick):
        """Another holder of a request's first live page drops its SWA reference (legal when shared)."""
        row = sorted(self.reqs)[pick % len(self.reqs)]
        f = self.frontier(row)
        if f + self.page > self.reqs[row] or int(self.swa_refs(self.ref.rtt[row, f:f + 1])[0]) < 2:
            return
        self.both("free_swa", lambda s: s.a.free_swa(s.rtt[row, f:f + 1].clone()))

    # ---- bad ops (deferred: recorded, skipped) ----------------------------------------------------
    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 7))
    def free_swa_released(self, pick):
        row = sorted(self.reqs)[pick % len(self.reqs)]
        if self.frontier(row):
            self.both("free_swa of a released page", lambda s: s.a.free_swa(s.rtt[row, :1].clone()))

    @rule(kinds=st.lists(st.integers(0, 3), min_size=1, max_size=40), salt=st.integers(0, 10 ** 6))
    def bad_locs(self, kinds, salt):
        """Locs that may not be freed or shared: free pages, never allocated ones, out of range, negative."""
        a, p = self.ref.a, self.page
        refs = a.pages.refs.cpu()
        free = (refs[1:] == 0).nonzero().flatten() + 1
        never = (refs[1:] == -1).nonzero().flatten() + 1
        locs = []
        for i, kind in enumerate(kinds):
            h = salt + 7919 * i
            if kind == 0 and free.numel():
                locs.append(int(free[h % free.numel()]) * p + h % p)
            elif kind == 1 and never.numel():
                locs.append(int(never[h % never.numel()]) * p + h % p)
            elif kind == 2:
                locs.append((a.num_pages + 1) * p + h % (3 * p))
            else:
                locs.append(-1 - h % (2 * p))
        op = ("free", "share", "free_swa")[salt % 3]
        self.both(f"bad {op}", lambda s: getattr(s.a, op)(T(locs)))

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 7))
    def rerelease(self, pick):
        """A frontier set back to 0 right after a release: every page it names is released already."""
        row = sorted(self.reqs)[pick % len(self.reqs)]
        self.both("release", lambda s: self._release(s, [row], [self.reqs[row]]))
        if self.frontier(row):
            self.both("release over released pages", lambda s: self._release(
                s, [row], [self.reqs[row]], frontiers=torch.zeros(1, dtype=I64, device=DEVICE)))

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 7), off=st.integers(-9, 9).filter(bool), by_row=st.booleans())
    def off_grid_frontier(self, pick, off, by_row):
        """A frontier off the page grid (or negative) in a release batch beside a good row: recorded
        (ERR_FRONTIER) alike, that row releasing nothing and its frontier kept; then set back."""
        rows = sorted(self.reqs)
        row = rows[pick % len(rows)]
        good = self.frontier(row)
        bad = good + off if good + off < 0 or (good + off) % self.page else -abs(off)
        seq = [self.reqs[r] for r in rows]
        for s in self.sys:
            s.frontiers[row] = bad
        if by_row:
            self.both("release over a bad frontier, by row", lambda s: release_out_of_window_batch(
                s.a, s.rtt, T(rows), T(seq), s.frontiers, self.window, by_row=True))
        else:
            self.both("release over a bad frontier", lambda s: self._release(s, rows, seq))
        assert self.frontier(row) == bad, "the bad row's frontier moved"
        for s in self.sys:
            s.frontiers[row] = good

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 7))
    def release_twice_in_one_batch(self, pick):
        """One request named twice in a release batch: each page it passes is dropped twice, with one holder."""
        row = sorted(self.reqs)[pick % len(self.reqs)]
        seq, f, p = self.reqs[row], self.frontier(row), self.page
        new_f = max(f, ((seq - self.window + 1) // p) * p - p)
        if new_f == f or bool((self.swa_refs(self.ref.rtt[row, f:new_f:p]) != 1).any()):
            return  # nothing to release, or a shared page (dropping it twice would be legal)

        def go(s):
            fs = s.frontiers[T([row, row])]
            self._release(s, [row, row], [seq, seq], frontiers=fs)
            s.frontiers[row] = fs[0]
        self.both("release twice in one batch", go)

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 7))
    def continue_released_page(self, pick):
        """A request's partial last page loses its SWA slots, then a decode continues it: recorded
        (ERR_CONT_RELEASED); the request is then finished."""
        p = self.page
        rows = [r for r in sorted(self.reqs) if self.reqs[r] % p and self.reqs[r] + 1 <= self.CTX]
        if not rows:
            return
        row = rows[pick % len(rows)]
        seq, f = self.reqs[row], self.frontier(row)
        start = seq // p * p
        if start < f or int(self.swa_refs(self.ref.rtt[row, start:start + 1])[0]) != 1:
            return
        self.both("free_swa of the last page", lambda s: s.a.free_swa(s.rtt[row, start:start + 1].clone()))

        def go(s):
            loc = s.a.alloc_decode(T([seq + 1]), s.rtt[row, seq - 1:seq].clone(), seq_lens_cpu=torch.tensor([seq + 1]))
            s.rtt[row, seq] = loc[0]
        self.both("decode continuing a released page", go)
        del self.reqs[row]

        def finish(s):
            if f:
                s.a.free(s.rtt[row, :f].clone(), with_swa=False)
            if start > f:
                s.a.free(s.rtt[row, f:start].clone())
            s.a.free(s.rtt[row, start:seq + 1].clone(), with_swa=False)
            s.rtt[row] = 0
        self.both("finish", finish)
        self.free_rows.append(row)


SUPPRESS = [HealthCheck.too_slow, HealthCheck.filter_too_much]
TestPageOpsMachine = PageOpsMachine.TestCase
TestPageOpsMachine.settings = (settings(max_examples=150, stateful_step_count=60, deadline=None,
                                        suppress_health_check=SUPPRESS) if GPU else
                               settings(max_examples=20, stateful_step_count=30, deadline=None,
                                        suppress_health_check=SUPPRESS,  # shrinking interpreted kernels: minutes
                                        phases=[Phase.explicit, Phase.reuse, Phase.generate]))


# ---- the sweep of issue 21 ------------------------------------------------------------------------
SWEEP = ([(p, w) for p in (4, 8, 16, 32, 64, 128, 256) for w in range(1, 9)] if GPU else
         [(4, 1), (4, 3), (16, 8), (32, 2)])


def release_points(seq_len, page, most=48):
    """Lengths to release at, up to seq_len - 1: every page boundary and its neighbours (a spread of
    them on long runs) and the last."""
    pts = sorted({s for k in range(seq_len // page + 1) for s in (k * page - 1, k * page, k * page + 1)
                  if 1 <= s <= seq_len - 1})
    if len(pts) > most:
        pts = [pts[i * len(pts) // most] for i in range(most)]
    return pts + [seq_len - 1] if seq_len > 1 else pts


@pytest.mark.parametrize("page, window", SWEEP)
def test_sweep_returns_every_page(page, window):
    """Allocate a page-rounded run, write req_to_token, release out of window up to seq_len - 1, free,
    repeat: every page of both pools comes back, torch and Triton alike, with nothing recorded."""
    pages = 1024 if GPU else 12
    systems = [System(ops, page, pages, pages, 1, pages * page) for ops in (TORCH_OPS, triton_ops())]
    row = T([0])
    for seq_len in (pages * page - page // 2, pages * page // 3 + 1, page + 1, pages * page):
        run = -(-seq_len // page) * page
        for s in systems:
            loc = s.a.alloc(run)
            s.rtt[0, :run] = loc
            f = torch.zeros(1, dtype=I64, device=DEVICE)
            for n in release_points(seq_len, page):
                release_out_of_window_batch(s.a, s.rtt, row, T([n]), f, window)
            s.frontiers[0] = f[0]
            s.a.free(loc)
        same_state(*systems, f"sweep page {page} window {window} seq_len {seq_len}")
        for s in systems:
            s.a.check_integrity()
            assert s.a.full_available_size() == s.a.swa_available_size() == pages * page


# (page, window, seq_len) -> frontier, worked by hand as in test_allocator.FRONTIERS
FRONTIERS = [(1, 1, 2, 1), (1, 4, 10, 6), (2, 1, 4, 2), (2, 1, 5, 2), (2, 3, 6, 2), (2, 8, 20, 10),
             (4, 1, 7, 0), (4, 1, 8, 4), (4, 1, 12, 8), (4, 5, 30, 20), (4, 8, 15, 4), (4, 8, 14, 0)]


@pytest.mark.parametrize("page, window, seq, expect", FRONTIERS)
def test_triton_release_frontier_by_hand(page, window, seq, expect):
    a = allocator(triton_ops(), 64 * page, 64 * page, page)
    rows = torch.zeros(1, 64, dtype=I64, device=DEVICE)
    rows[0, :seq] = a.alloc_extend(T([0]), T([seq]), T([0]), seq, prefix_lens_cpu=torch.tensor([0]),
                                   seq_lens_cpu=torch.tensor([seq]))
    f = torch.zeros(1, dtype=I64, device=DEVICE)
    release_out_of_window_batch(a, rows, T([0]), T([seq]), f, window)
    assert int(f[0]) == expect
    m = a.full_to_swa_index_mapping[rows[0, :seq]]
    assert (m[:expect] == 0).all() and (m[expect:] > 0).all()
    a.check_integrity()


def test_strided_inputs_are_read_by_their_strides():
    """Index tensors that are views with a stride (a column, every other entry) free and release the
    same pages as the torch ops; a strided frontier view moves in place."""
    systems = [System(ops, 4, 32, 32, 2, 64) for ops in (TORCH_OPS, triton_ops())]
    for s in systems:
        loc = s.a.alloc_extend(T([0, 0]), T([20, 24]), T([0, 0]), 44, prefix_lens_cpu=torch.tensor([0, 0]),
                               seq_lens_cpu=torch.tensor([20, 24]))
        s.rtt[0, :20], s.rtt[1, :24] = loc[:20], loc[20:]
        table = torch.zeros(2, 3, dtype=I64, device=DEVICE)
        release_out_of_window_batch(s.a, s.rtt, T([0, 1]), T([20, 24]), table[:, 1], 2)
        s.frontiers[:2].copy_(table[:, 1])
        s.a.free(torch.stack([s.rtt[1, 16:24], s.rtt[1, 16:24]], 1)[:, 0], with_swa=True)
    same_state(*systems, "strided")
    assert systems[1].frontiers[:2].tolist() == [12, 16]


@pytest.mark.parametrize("page", [1, 3, 4])
@pytest.mark.parametrize("hybrid", [True, False])
def test_alloc_step_equals_three_launches_over_several_programs(page, hybrid):
    """`alloc_step`'s one launch against the three it replaces (the step prologue, the allocation with the heads
    on the device, the write), all Triton, on the same random batches: 40 requests in a bucket of 48 span several
    programs (16 requests each interpreted), so each counts the pages the earlier ones open; page 3 maps whole
    pages through a masked block. Rows, lengths, slots, req_to_token, rings, references and the table agree."""
    from hwkv.allocator import PagedTokenToKVPoolAllocator
    from hwkv_cuda.kernels import step as step_kernels
    gen = torch.Generator().manual_seed(page * 2 + hybrid)
    reqs, ctx = 40, 64
    systems = []
    for _ in range(2):
        pages = 4 * reqs * ctx // page
        s = System(triton_ops(), page, pages, pages, reqs, ctx)
        if not hybrid:
            s.a = PagedTokenToKVPoolAllocator(pages * page, page, DEVICE)
            s.a._ops = triton_ops()
            s.a.immediate = False
        systems.append(s)
    lens = torch.randint(1, ctx // 2, (reqs,), generator=gen).tolist()
    for s in systems:  # prefill each request
        loc = s.a.alloc_extend(T([0] * reqs), T(lens), T([0] * reqs), sum(lens), prefix_lens_cpu=torch.zeros(reqs, dtype=I64),
                               seq_lens_cpu=torch.tensor(lens))
        for r, at, n in zip(range(reqs), [0] + list(torch.tensor(lens).cumsum(0)[:-1]), lens):
            s.rtt[r, :n] = loc[int(at):int(at) + n]
    for step in range(6):
        rows = torch.randperm(reqs, generator=gen)[:reqs - step * 5].tolist()
        seq = [lens[r] + 1 for r in rows]
        opened = sum((x - 1) % page == 0 for x in seq)
        outs = []
        for s, three in zip(systems, (None, step_kernels.KERNELS)):
            heads = s.a.reserve(opened)
            outs.append(captured_step(s, heads, opened, rows, seq, 48, three_launches=three,
                                      window=(3 if step % 2 else 2 * page + 1) if hybrid else None))
        for r in rows:
            lens[r] += 1
        for a, b in zip(*outs):
            assert torch.equal(a, b), f"step {step}"
        ref, got = systems
        if hybrid:  # released pages are pushed in another order (by lane, not by request): compared as a multiset
            same_state(ref, got, f"step {step}")
        else:
            assert torch.equal(ref.rtt, got.rtt), f"step {step}: req_to_token"
            assert ref.a.pages.head == got.a.pages.head and torch.equal(ref.a.pages.buf, got.a.pages.buf)
    assert not hybrid or int(systems[0].frontiers.max()) > 0  # the releases ran
    for s in systems:
        s.a.check_integrity()


def test_alloc_step_refuses_staged_pairs_shorter_than_the_batch():
    """Every lane of `alloc_step` reads its staged (row, length) pair, live or padded: staged views shorter than the
    bucket are refused with a LocError before the launch, the allocator untouched."""
    from hwkv.errors import LocError
    s = System(triton_ops(), 4, 64, 64, 4, 32)
    staged = torch.zeros(3 + 2 * 2, dtype=I64, device=DEVICE)   # a block for 2 requests...
    out = [torch.zeros(4, dtype=I64, device=DEVICE) for _ in range(3)]   # ...and a bucket of 4
    before = s.a.integrity_snapshot()
    with pytest.raises(LocError, match="reads 4 staged"):
        s.a.alloc_step(staged[:3], staged[3::2], staged[4::2], s.pad_row, s.rtt, *out)
    assert same_snapshot(before, s.a.integrity_snapshot())
