"""A captured page op ranks its errors by the replay's op number, not the capture's.

The error record keeps the earliest op's error since the last check (`hwkv.pages`). A device graph replays its
launches with the arguments of its capture, so an op number passed as an argument stayed the capture's: a replay's
error outranked an earlier eager op's (a double free reported as the later step's continuation error). The
launches a graph captures read the number from the control words the host stages per replay (`ctl[3]`). Here
`LaunchGraph` replays the Triton launches it recorded with the captured arguments, as a device graph does, under
TRITON_INTERPRET=1 on CPU tensors (the Triton page ops, as tests/test_page_ops_differential.py).
"""
import pytest
import torch
# (first: it sets TRITON_INTERPRET=1 without a GPU; its tests are marked as this module's are)
import test_review20_pages as pages_tests

from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.errors import ConfigError, DoubleFreeError, HwkvError
from hwkv.release import release_out_of_window_batch
from hwkv.testing.capture_check import CaptureCheckingAdapter
from hwkv.torch_page_ops import TORCH_OPS

pytestmark, I64, T = pages_tests.pytestmark, pages_tests.I64, pages_tests.T


class LaunchGraph:
    """Runs fn once, recording its Triton launches; `replay()` launches them again with the captured arguments
    and nothing else (fn's Python does not run again), as a device graph replays its capture."""

    def __init__(self, fn):
        from triton.runtime.interpreter import InterpretedFunction
        original, launches = InterpretedFunction.run, []

        def run(kernel, *args, **kwargs):
            launches.append((kernel, args, kwargs))
            return original(kernel, *args, **kwargs)

        InterpretedFunction.run = run
        try:
            fn()
        finally:
            InterpretedFunction.run = original
        self.launches, self._run = launches, original
        assert launches, "fn launched no Triton kernel"

    def replay(self):
        for kernel, args, kwargs in self.launches:
            self._run(kernel, *args, **kwargs)


def _allocator():
    from hwkv_cuda.kernels.alloc import TritonPageOps
    a = SWATokenToKVPoolAllocator(256, 256, 4, "cpu", None)
    a._ops = a.swa_attn_allocator._ops = TritonPageOps()
    a.immediate = False  # errors recorded on the device, as accelerators run
    return a


def _scene(a):
    """Row 0 holds 10 tokens (its last page, tokens 8..11, partial), row 1 4 tokens."""
    rtt = torch.zeros(3, 64, dtype=I64)
    rtt[0, :10] = a.alloc_extend(T([0]), T([10]), T([0]), 10, prefix_lens_cpu=T([0]), seq_lens_cpu=T([10]))
    rtt[1, :4] = a.alloc_extend(T([0]), T([4]), T([0]), 4, prefix_lens_cpu=T([0]), seq_lens_cpu=T([4]))
    a.check_integrity()
    return rtt


def _earlier_double_free(a, rtt):
    """Eager ops after the capture: row 0's partial page loses its SWA slots, then row 1 is freed twice (the
    double free recorded at this op, before the step's)."""
    a.check_integrity()  # the record and the op count start over
    a.free_swa(rtt[0, 8:9].clone())
    a.free(rtt[1, :4].clone())
    a.free(rtt[1, :4].clone())


def _error(a):
    try:
        a.check_integrity()
    except HwkvError as e:
        return type(e)
    return None


def _one_launch(graph):
    """A decode step of row 0 to 11 tokens in `alloc_step` (it continues the released page: recorded)."""
    a = _allocator()
    rtt = _scene(a)
    staged = torch.zeros(6, dtype=I64)
    ctl, rows_in, seq_in = staged[:4], staged[4::2], staged[5::2]
    out = [torch.zeros(1, dtype=I64) for _ in range(3)]

    def stage(live):
        heads = a.reserve(0)
        staged.copy_(T(heads + [live, a.op_number, 0, 11]))

    def step():
        a.alloc_step(ctl, rows_in, seq_in, 2, rtt, *out)

    stage(0)
    captured = LaunchGraph(step) if graph else None
    _earlier_double_free(a, rtt)
    stage(1)
    captured.replay() if graph else step()
    return _error(a)


def _three_launches(graph):
    """The same step as `alloc_reserved` with the heads and op number on the device (a verify's, a draft's)."""
    a = _allocator()
    rtt = _scene(a)
    ctl = torch.zeros(4, dtype=I64)
    prefix, seq, last, out = T([10]), T([11]), rtt[0, 9:10].clone(), torch.zeros(1, dtype=I64)

    def stage():
        heads = a.reserve(0)
        ctl.copy_(T(heads + [0, a.op_number]))

    def step():
        a.alloc_reserved(prefix, seq, last, out, ctl, 0)

    stage()
    captured = LaunchGraph(step) if graph else None
    _earlier_double_free(a, rtt)
    stage()
    captured.replay() if graph else step()
    return _error(a)


def _release(graph):
    """A captured out-of-window release whose stale frontier re-releases row 0's first page (recorded), numbered
    as the op after the one the host staged."""
    a = _allocator()
    rtt = _scene(a)
    frontiers, op_word = torch.zeros(3, dtype=I64), torch.zeros(1, dtype=I64)
    rows, lens = T([0]), T([10])
    release_out_of_window_batch(a, rtt, rows, lens, frontiers, 1, by_row=True)  # row 0 releases to token 4
    a.check_integrity()

    def stage():
        a.reserve(0, ops=2)
        op_word[0] = a.op_number - 1

    def step():
        release_out_of_window_batch(a, rtt, rows, lens, frontiers, 1, by_row=True, op_word=op_word)

    stage()
    captured = LaunchGraph(step) if graph else None  # (releases nothing: the frontier is current)
    frontiers[0] = 0  # stale: the step frees page 1's SWA slots again (recorded)
    a.check_integrity()
    a.free(rtt[1, :4].clone())
    a.free(rtt[1, :4].clone())
    stage()
    captured.replay() if graph else step()
    return _error(a)


@pytest.mark.parametrize("how", [_one_launch, _three_launches, _release], ids=["alloc_step", "alloc_reserved",
                                                                             "release"])
def test_a_replayed_page_op_ranks_its_error_after_an_earlier_eager_ops(how):
    assert how(False) is DoubleFreeError  # the eager step: the double free came first
    assert how(True) is DoubleFreeError   # and the replay of a capture made before it


def test_a_one_launch_step_moves_the_staged_op_number_on_by_its_ops():
    """With `advance`, the launch leaves ctl[3] at the next step's number (the host copies nothing when the rows
    stay and no op came between): its allocation, and its release where it has one."""
    for release in (False, True):
        a = _allocator()
        rtt = _scene(a)
        frontiers = torch.zeros(3, dtype=I64)
        staged = torch.zeros(6, dtype=I64)
        heads = a.reserve(0, ops=1 + release)
        staged.copy_(T(heads + [1, a.op_number - release, 0, 11]))
        out = [torch.zeros(1, dtype=I64) for _ in range(3)]
        more = dict(frontiers=frontiers, window=1) if release else {}
        assert a.alloc_step(staged[:4], staged[4::2], staged[5::2], 2, rtt, *out, advance=True, **more)
        a.reserve(0, ops=1 + release)
        assert int(staged[3]) == a.op_number - release  # what the next step stages
        assert int(staged[5]) == 12
        a.check_integrity()


def test_reserve_and_the_release_op_word_refuse_bad_values_before_anything_changes():
    a = _allocator()
    rtt = _scene(a)
    before = (a.op_number, a.pages.head)
    for ops in (0, -1, True, 1.0, "2"):
        with pytest.raises(ConfigError, match="ops="):
            a.reserve(1, ops=ops)
    assert (a.op_number, a.pages.head) == before
    frontiers = torch.zeros(3, dtype=I64)
    for word in (T([]), torch.zeros(1, dtype=torch.int32), [0]):
        with pytest.raises(ConfigError, match="op_word"):
            release_out_of_window_batch(a, rtt, T([0]), T([10]), frontiers, 1, by_row=True, op_word=word)
    b = SWATokenToKVPoolAllocator(256, 256, 4, "cpu", None)
    b._ops = b.swa_attn_allocator._ops = TORCH_OPS  # the torch ops number on the host: no word to read
    b.immediate = False
    with pytest.raises(ConfigError, match="op_word"):
        release_out_of_window_batch(b, rtt, T([0]), T([10]), frontiers, 1, by_row=True, op_word=T([0]))
    assert int(frontiers.abs().sum()) == 0 and a.op_number == before[0]
    a.check_integrity()


def test_an_allocator_handed_the_torch_ops_allocates_in_no_graph():
    """The torch ops size themselves from host values: handed them explicitly, an allocator is one without page-op
    kernels (no whole-step graph, no heads on the device), not one whose captured allocation would run with k=0."""
    a = SWATokenToKVPoolAllocator(64, 64, 4, "cpu", None)
    a._ops = a.swa_attn_allocator._ops = TORCH_OPS
    assert not a.allocates_in_graph and not a.allocates_step_in_one
    assert _allocator().allocates_in_graph
    rtt = _scene(a)
    heads = a.reserve(1)
    before = a.integrity_snapshot()
    with pytest.raises(ConfigError, match="heads on the device"):
        a.alloc_reserved(T([10]), T([13]), rtt[0, 9:10].clone(), torch.zeros(3, dtype=I64), T(heads + [0, 0]), 1)
    assert same_snapshot(before, a.integrity_snapshot())
    a.alloc_reserved(T([10]), T([13]), rtt[0, 9:10].clone(), torch.zeros(3, dtype=I64), heads, 1)
    a.check_integrity()


def _step_graph(records=CaptureCheckingAdapter):
    """A whole-step decode graph over tests/test_step_graph.py's engine with the Triton page ops and step kernels
    (interpreted), its allocator checking immediately (CPU; HWKV_DEBUG=1 on a device): the release follows the
    layers."""
    import test_step_graph as sg
    from hwkv.step_graph import DecodeStepGraph
    from hwkv_cuda.kernels import step as step_kernels
    from hwkv_cuda.kernels.alloc import TritonPageOps

    class Recording(records):
        records_device_work = True

    e = sg.Engine(1)
    e.alloc._ops = e.alloc.swa_attn_allocator._ops = TritonPageOps()
    shapes = {"q": ((sg.H, sg.D), torch.float32), "k": ((sg.KVH, sg.D), torch.float32),
              "v": ((sg.KVH, sg.D), torch.float32)}
    g = DecodeStepGraph(e.backend, e.alloc, e.layers_fn, [2, 4], shapes, Recording(), frontiers=e.frontiers,
                        window=sg.W)
    g.kernels = step_kernels.KERNELS
    assert e.alloc.immediate and g._one_launch and not g._releases_first
    return sg, e, g


def _inputs(sg, n, gen):
    return {"q": torch.randn(n, sg.H, sg.D, generator=gen), "k": torch.randn(n, sg.KVH, sg.D, generator=gen),
            "v": torch.randn(n, sg.KVH, sg.D, generator=gen)}


def test_a_release_after_the_layers_runs_as_the_op_after_its_steps_allocation(monkeypatch):
    """The one-launch allocation must not move the staged op number on before a release that follows the layers
    reads it: that release had run as the next step's allocation's number."""
    from hwkv_cuda.kernels.alloc import TritonPageOps
    sg, e, g = _step_graph()
    seen = []
    original = TritonPageOps.release_window

    def spy(*args, op_word=None, **kwargs):
        seen.append(None if op_word is None else int(op_word[0]) + 1)  # the kernel numbers it op_word + 1
        return original(*args, op_word=op_word, **kwargs)

    monkeypatch.setattr(TritonPageOps, "release_window", staticmethod(spy))
    g.capture()
    gen = torch.Generator().manual_seed(0)
    for pick in ([0, 1, 2], [1, 3], [0, 1, 2, 3], [0, 1, 2, 3]):
        seen.clear()
        e.graph_step(g, pick, _inputs(sg, len(pick), gen), on_host=True)
        assert seen == [g._op + 1] and e.alloc.op_number == g._op + 1  # reserve(pages, ops=2) numbered both
    e.alloc.check_integrity()


def test_the_release_reads_nothing_back_while_a_graph_captures(monkeypatch):
    """Its host check (CPU, debug mode) stands down while a stream captures, as every other value check does
    (`values_checkable`): a device-to-host read there fails the capture, and debug mode had never run the graphs.
    Here the adapter's capture and replays (which re-run the step, as a device graph replays its capture) say they
    capture; the eager steps around them check as before."""
    import hwkv.release as release
    capturing = []

    def inside(call, *args):
        capturing.append(True)
        try:
            return call(*args)
        finally:
            capturing.pop()

    class Capturing(CaptureCheckingAdapter):
        def capture(self, fn):
            return inside(super().capture, fn)

        def replay(self, graph):
            return inside(super().replay, graph)

    checked = []
    original = release._check_release

    def check(*args, **kwargs):
        checked.append(bool(capturing))
        return original(*args, **kwargs)

    monkeypatch.setattr(release, "_check_release", check)
    monkeypatch.setattr(release, "values_checkable", lambda t: not capturing)  # as on a device in debug mode
    sg, e, g = _step_graph(Capturing)
    g.capture()
    gen = torch.Generator().manual_seed(1)
    e.graph_step(g, [0, 1], _inputs(sg, 2, gen), on_host=True)
    e.graph_step(g, [0, 1, 2, 3, 4], _inputs(sg, 5, gen), on_host=True)  # past every bucket: the eager step
    assert checked and not any(checked) and g.eager_runs == 1  # the eager step and the warm-ups checked, no replay
    e.alloc.check_integrity()
