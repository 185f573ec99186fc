"""Review 24: an allocation from `reserve()`'s claim holds to the claim.

`alloc_reserved` and the one-launch `alloc_step` take the pages `reserve` claimed at the rings' heads; they size the
step themselves from the lengths they read (on the device, for a captured step). Where those lengths need more
pages than were claimed, the torch ops had clamped (two tokens on one slot) and the Triton kernels had read past the
claim (a page still on the free ring marked live, handed out again by the next claim); where they need fewer, the
torch ops marked every claimed page live (held by nobody) and the kernels dropped the rest from the ring (lost).
Now: no page past the claim is opened, its tokens take the padding slot 0 and the first such request is recorded
(ERR_CLAIM, a LocError at the next check); claimed pages the step does not open go back to the rings' tail. Both
implementations agree; the pools stay whole (`check_integrity`) either way. A whole-step graph whose device lengths
are not its host lengths (`step(rows, seq_lens, seq_lens_cpu)` with the two apart) is the way an engine gets there.
Both implementations run under TRITON_INTERPRET=1 on CPU tensors.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hwkv.allocator import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator  # noqa: E402
from hwkv.errors import HwkvError, LocError  # noqa: E402
from hwkv.ops import TORCH_STEP  # noqa: E402
from hwkv.pages import ERR_CLAIM, decode_key, error_key  # noqa: E402
from hwkv.torch_page_ops import TORCH_OPS  # noqa: E402

triton = pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = [pytest.mark.interpret,
              pytest.mark.skipif(not INTERPRET, reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")]

from tests.test_review20_pages import I64, P, T, triton_ops  # noqa: E402  (page size 4; the kernels' ops)


OPS = [pytest.param(lambda: TORCH_OPS, id="torch"), pytest.param(triton_ops, id="triton")]


def make(ops, hybrid=True):
    a = SWATokenToKVPoolAllocator(64, 64, P, "cpu", None) if hybrid else PagedTokenToKVPoolAllocator(64, P, "cpu")
    a._ops = ops()
    if hybrid:
        a.swa_attn_allocator._ops = a._ops
    return a


def raised(fn):
    try:
        fn()
    except HwkvError as e:
        return type(e), str(e)
    return None


def state(a):
    """What the pools hold: every ring's head, tail, free list in order and references; the mapping."""
    s = [(r.head, int(r.tail[0]), r.free_list().tolist(), r.refs.tolist()) for r in a._rings()]
    return s, (None if a._mapping is None else a._mapping.tolist())


def test_the_new_code_keys_rank_and_decode():
    """The error key's code field has room for the ninth code: it decodes, and ranks after the others in one op."""
    assert decode_key(error_key(3, ERR_CLAIM, 7)) == (ERR_CLAIM, 7)
    assert decode_key(error_key(0, 1, -5)) == (1, -5)
    assert error_key(2, ERR_CLAIM, 0) < error_key(2, 1, 0) < error_key(1, ERR_CLAIM, 0)
    assert error_key(0, 1, -(1 << 32)) < (1 << 63)


def _reserved(ops, claim, seq=(6, 3, 9), hybrid=True, immediate=True):
    """Three fresh requests (pages 2, 1, 3) from a claim of `claim` pages, with reserve's host heads."""
    a = make(ops, hybrid)
    a.immediate = immediate
    a.alloc(8)  # two pages held before: the claim starts past them
    heads = a.reserve(claim)
    n = sum(seq)
    out = torch.full((n,), -1, dtype=I64)
    z = torch.zeros(len(seq), dtype=I64)
    a.alloc_reserved(z, T(list(seq)), z.clone(), out, heads, claim)
    return a, out


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "full"])
@pytest.mark.parametrize("ops", OPS)
def test_a_short_claim_opens_no_page_past_it(ops, hybrid):
    """Six pages needed, four claimed: requests 0 and 1 get theirs, request 2 its first; its tokens past the
    claim take slot 0 and it is recorded; the pool is whole and a new claim hands out none of the opened pages."""
    a, out = _reserved(ops, 4, hybrid=hybrid)
    o = out.tolist()
    assert all(v > 0 for v in o[:13]) and o[13:] == [0] * 5, o
    assert len({v // P for v in o[:13]}) == 4
    err = raised(a.check_integrity)
    assert err is not None and err[0] is LocError and "request 2" in err[1], err
    a.check_integrity()  # the record raised once; the pool itself is whole
    assert a.available_size() == 64 - 8 - 16
    again = a.alloc(16)
    assert not set((again // P).tolist()) & set(v // P for v in o[:13])


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "full"])
@pytest.mark.parametrize("ops", OPS)
def test_a_claim_larger_than_the_need_gives_the_rest_back(ops, hybrid):
    a, out = _reserved(ops, 9, hybrid=hybrid)
    assert all(v > 0 for v in out.tolist())
    a.check_integrity()
    assert a.available_size() == 64 - 8 - 24


@pytest.mark.parametrize("claim", [0, 4, 6, 9])
def test_torch_and_triton_agree_on_a_claim(claim):
    got = []
    for ops in (lambda: TORCH_OPS, triton_ops):
        a, out = _reserved(ops, claim, immediate=False)
        got.append((out.tolist(), a.pages.pending(), raised(a.check_integrity), state(a)))
    assert got[0] == got[1]
    assert (got[0][1] is None) == (claim >= 6)


@pytest.mark.parametrize("ops", OPS)
def test_a_claim_with_no_request_goes_back(ops):
    a = make(ops)
    before = state(a)
    heads = a.reserve(3)
    a.alloc_reserved(T([]), T([]), T([]), torch.zeros(0, dtype=I64), heads, 3)
    a.check_integrity()
    assert a.available_size() == 64
    assert state(a)[0][0][3] == before[0][0][3]  # no page live


def _step(how, claim_word):
    """One decode step of three requests at lengths 8, 5 and 12 -> 9, 6, 13 (request 0 and 2 open a page) through
    the heads and claim on the device: Triton's one launch, its three launches, or the torch path (host heads)."""
    from hwkv_cuda.kernels import step as step_kernels
    a = make(TORCH_OPS.__class__ if how == "torch" else triton_ops)
    a.immediate = False
    rtt = torch.zeros(4, 32, dtype=I64)  # row 3: the padding row
    for r, n in enumerate((8, 5, 12)):
        rtt[r, :n] = a.alloc_extend(T([0]), T([n]), T([0]), n, prefix_lens_cpu=T([0]), seq_lens_cpu=T([n]))
    a.check_integrity()
    heads = a.reserve(claim_word)
    staged = T([heads[0], heads[1], 3, a.op_number, claim_word, 0, 9, 1, 6, 2, 13])
    ctl, rows_in, seq_in = staged[:5], staged[5::2], staged[6::2]
    rows, seq, out = (torch.zeros(3, dtype=I64) for _ in range(3))
    if how == "triton one launch":
        a.alloc_step(ctl, rows_in, seq_in, 3, rtt, rows, seq, out)
    else:
        kern = TORCH_STEP if how == "torch" else step_kernels.KERNELS
        prefix, last = torch.zeros(3, dtype=I64), torch.zeros(3, dtype=I64)
        kern.prologue(ctl, rows_in, seq_in, 3, rtt, rows, seq, prefix, last, out)
        a.alloc_reserved(prefix, seq, last, out, heads if how == "torch" else ctl, claim_word)
        kern.write(rtt, rows, seq, out, None, None)
    return out.tolist(), raised(a.check_integrity), state(a), rtt.tolist()


@pytest.mark.parametrize("claim", [0, 1, 2, 3])
def test_one_launch_three_launches_and_torch_agree_on_a_claim(claim):
    got = {how: _step(how, claim) for how in ("torch", "triton three launches", "triton one launch")}
    for how, g in got.items():
        assert g == got["torch"], how
    out, err = got["torch"][0], got["torch"][1]
    if claim >= 2:
        assert err is None and all(v > 0 for v in out)
    else:
        assert err is not None and err[0] is LocError
        assert f"request {claim * 2}" in err[1], err  # the first request past the claim
        assert out[2] == 0 and (claim == 1) == (out[0] > 0)


# ---- the way an engine gets there: a whole-step graph whose device lengths are not its host lengths ------------------
@pytest.mark.parametrize("recording", ["one launch", "three launches", False])
def test_step_graph_with_device_lengths_apart_from_the_host_keeps_the_pool(recording):
    from tests.test_step_graph import H, KVH, D, W, CheckedRecording, Engine, ThreeLaunchOps
    from hwkv.graph import EagerAdapter
    from hwkv.step_graph import DecodeStepGraph
    got = Engine(4)
    if recording:
        got.alloc._ops = triton_ops() if recording == "one launch" else ThreeLaunchOps()
        got.alloc.immediate = False
    graph = DecodeStepGraph(got.backend, got.alloc, got.layers_fn, [4],
                            {"q": ((H, D), torch.float32), "k": ((KVH, D), torch.float32),
                             "v": ((KVH, D), torch.float32)},
                            CheckedRecording() if recording else EagerAdapter(), frontiers=got.frontiers, window=W)
    graph.capture()
    got.alloc.check_integrity()
    rows = T([got.rows[0], got.rows[1]])
    gen = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(2, *s, generator=gen) for k, s in (("q", (H, D)), ("k", (KVH, D)), ("v", (KVH, D)))}
    # host: 13 -> 14 and 30 -> 31 open no page (positions 13, 30); the device's lengths (13 and 29: positions 12, 28)
    # open two
    graph.step(rows, T([13, 29]), T([14, 31]), inputs)
    err = raised(got.alloc.check_integrity)
    assert err is not None and err[0] is LocError and "request 0" in err[1], err
    got.alloc.check_integrity()



# ---- the programs of one launch in any order (a GPU gives none): the interpreter run last to first ----------------
@pytest.fixture
def reversed_programs(monkeypatch):
    """The interpreter runs each grid's programs from the last to the first (a legal GPU schedule)."""
    from triton.runtime import interpreter
    b = interpreter.interpreter_builder
    dims, set_dim, set_idx = {}, b.set_grid_dim, b.set_grid_idx

    def grid_dim(nx, ny, nz):
        dims["x"] = nx
        return set_dim(nx, ny, nz)

    monkeypatch.setattr(b, "set_grid_dim", grid_dim)
    monkeypatch.setattr(b, "set_grid_idx", lambda x, y, z: set_idx(dims["x"] - 1 - x, y, z))


def test_the_give_back_waits_for_every_programs_reads(reversed_programs):
    """A fresh ring, a claim of 10 pages, request 0 opens 2 and the last program none: the last program to run gives
    the 8 back to where request 0's pages were read (it had run first in program order, so nothing showed)."""
    a = make(triton_ops, hybrid=False)
    a.immediate = False
    heads = a.reserve(10)
    out = torch.full((8,), -1, dtype=I64)
    a.alloc_reserved(T([0, 0]), T([8, 0]), T([0, 0]), out, heads, 10)
    assert out.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    a.check_integrity()
    assert a.available_size() == 64 - 8


def test_the_one_launch_step_gives_back_after_every_program(reversed_programs):
    """alloc_step over two programs (32 decode rows at page size 1, 16 a program under the interpreter), a claim of
    40 pages for 32."""
    a = PagedTokenToKVPoolAllocator(64, 1, "cpu")
    a._ops, a.immediate = triton_ops(), False
    heads = a.reserve(40)
    staged = torch.zeros(5 + 64, dtype=I64)
    staged[:5] = T([heads[0], 0, 32, a.op_number, 40])
    staged[5::2], staged[6::2] = torch.arange(32), 1
    rtt = torch.zeros(33, 4, dtype=I64)
    rows, seq, out = (torch.zeros(32, dtype=I64) for _ in range(3))
    a.alloc_step(staged[:5], staged[5::2], staged[6::2], 32, rtt, rows, seq, out)
    assert sorted(out.tolist()) == list(range(1, 33))
    a.check_integrity()
    assert a.available_size() == 64 - 32


@pytest.mark.parametrize("one_launch", [False, True], ids=["alloc_reserved", "alloc_step"])
def test_a_claim_on_the_device_for_no_request_goes_back(one_launch):
    a = make(triton_ops)
    heads = a.reserve(3)
    ctl = T(heads + [0, a.op_number, 3])
    e = torch.zeros(0, dtype=I64)
    if one_launch:
        a.alloc_step(ctl, e, e, 0, torch.zeros(1, 4, dtype=I64), e, e.clone(), e.clone())
    else:
        a.alloc_reserved(e, e.clone(), e.clone(), e.clone(), ctl, 0)
    a.check_integrity()
    assert a.available_size() == 64


def test_the_one_launch_step_counts_only_the_batchs_lanes():
    """A live count (ctl[2]) wider than the batch: lanes past it are no request (as the prologue clips them), so the
    step's page count, and what goes back, are the batch's: 20 pages of a claim of 24 opened, 4 given back."""
    for live_word in (20, 32):
        a = PagedTokenToKVPoolAllocator(64, 1, "cpu")
        a._ops, a.immediate = triton_ops(), False
        heads = a.reserve(24)
        staged = torch.zeros(5 + 64, dtype=I64)
        staged[:5] = T([heads[0], 0, live_word, a.op_number, 24])
        staged[5::2], staged[6::2] = torch.arange(32), 1
        rows, seq, out = (torch.zeros(20, dtype=I64) for _ in range(3))
        a.alloc_step(staged[:5], staged[5::2], staged[6::2], 32, torch.zeros(33, 4, dtype=I64), rows, seq, out)
        a.check_integrity()
        assert a.available_size() == 64 - 20, live_word
