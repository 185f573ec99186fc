"""What the whole-step graphs (DecodeStepGraph, VerifyStepGraph, DraftStepGraph) and GraphRunner refuse, and what
the model step of a verify sees: a row outside req_to_token (-1 too) or a bucket not captured is refused with a
typed error before anything is staged or a page claimed (allocator, req_to_token, frontiers and the staged
buffers unchanged); under graphs `fn` sees the batch's extend_prefix_lens, as it does eagerly, never zeros.

Runs on CPU (the host 'graph', and the Triton page ops under the interpreter where TRITON_INTERPRET=1);
HWKV_TEST_DEVICE=cuda runs it under CUDA graphs, rows on the device checked in debug mode (HWKV_DEBUG=1)."""
import pytest
import torch

import hwkv
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ConfigError, LocError, ShapeError
from hwkv.graph import EagerAdapter, GraphRunner
from hwkv.pool import MHATokenToKVPool
from hwkv.step_graph import DecodeStepGraph, DraftStepGraph, VerifyStepGraph
from test_step_graph import DEVICE, INTERPRET, D, Engine, H, KVH, RecordingEager, W, adapter, same_state

SHAPES = {"q": ((H, D), torch.float32), "k": ((KVH, D), torch.float32), "v": ((KVH, D), torch.float32)}


def _graph(e, kind, buckets=(4,), recording=False):
    """A whole-step graph of `kind` over `e` (not captured) and the tokens it takes per request."""
    ad = adapter() or (RecordingEager() if recording else EagerAdapter())
    if kind == "decode":
        return DecodeStepGraph(e.backend, e.alloc, e.layers_fn, list(buckets), SHAPES, ad, e.frontiers, W), 1
    if kind == "verify":
        return VerifyStepGraph(e.backend, e.alloc, e.layers_fn, list(buckets), SHAPES, 2, ad), 3
    return DraftStepGraph(e.backend, e.alloc, e.draft_fn, list(buckets), SHAPES, 3, ad), 3


def _inputs(n):
    return {"q": torch.randn(n, H, D, device=DEVICE), "k": torch.randn(n, KVH, D, device=DEVICE),
            "v": torch.randn(n, KVH, D, device=DEVICE)}


def _staged(graph):
    return (graph.staged.cpu().clone(), graph.req_pool_indices.cpu().clone(), graph.seq_lens.cpu().clone(),
            {k: v.cpu().clone() for k, v in graph.inputs.items()})


def _same_staged(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[:3], b[:3])) and all(torch.equal(a[3][k], b[3][k]) for k in a[3])


@pytest.mark.parametrize("bad_row", [8, 99, -1])
@pytest.mark.parametrize("kind", ["decode", "verify", "draft"])
@pytest.mark.parametrize("bs", [2, 5])  # a replay of bucket 4, and the eager step past every bucket
def test_a_row_outside_req_to_token_is_refused_before_any_page_is_claimed(kind, bad_row, bs):
    """Request 4 continues at 40 tokens: its step opens a page, so a late check would have claimed one (and row -1
    would have written req_to_token's last row). Refused on the host rows, nothing staged, claimed or written."""
    e = Engine(4)
    graph, n = _graph(e, kind)
    graph.capture()
    pick = [0, 4] if bs == 2 else [0, 1, 2, 3, 4]
    rows = torch.tensor([e.rows[i] for i in pick[:-1]] + [bad_row], dtype=torch.int64)
    seq = e.seq[pick] + n
    before, staged = e.state(), _staged(graph)
    lo, hi = int(rows.min()), int(rows.max())
    with pytest.raises(LocError, match=rf"req_pool_indices hold values in \[{lo}, {hi}\], allowed range is \[0, 8\)"):
        graph.step(rows, seq, seq, _inputs(bs * n))
    assert same_state(before, e.state()) and _same_staged(staged, _staged(graph))
    assert graph.replays == 0 and graph.eager_runs == 0
    e.alloc.check_integrity()


@pytest.mark.skipif(DEVICE != "cpu" or not INTERPRET, reason="the Triton page ops on CPU: TRITON_INTERPRET=1")
@pytest.mark.parametrize("bad_row", [8, -1])
def test_a_row_outside_req_to_token_never_reaches_the_one_launch_allocation(bad_row):
    """The device path (alloc_step: rows, slots and the req_to_token write in one launch, interpreted) would store
    at the unchecked row, past the table's end: the host refuses first."""
    from hwkv_cuda.kernels import step as step_kernels
    from hwkv_cuda.kernels.alloc import TritonPageOps
    e = Engine(4)
    e.alloc._ops, e.alloc.immediate = TritonPageOps(), False
    graph, _ = _graph(e, "decode", recording=True)
    graph.kernels = step_kernels.KERNELS
    graph.capture()
    assert graph._one_launch
    rows = torch.tensor([e.rows[0], bad_row], dtype=torch.int64)
    seq = e.seq[[0, 4]] + 1
    before = e.state()
    with pytest.raises(LocError, match="allowed range is"):
        graph.step(rows, seq, seq, _inputs(2))
    assert same_state(before, e.state()) and graph.replays == 0
    e.alloc.check_integrity()


@pytest.mark.skipif(DEVICE == "cpu", reason="rows on an accelerator (HWKV_TEST_DEVICE=cuda)")
def test_rows_on_the_device_are_checked_in_debug_mode(monkeypatch):
    """Rows already on the device are read only in debug mode (a host sync otherwise): there they are refused
    before any page is claimed."""
    monkeypatch.setenv("HWKV_DEBUG", "1")
    e = Engine(4)
    graph, _ = _graph(e, "decode")
    graph.capture()
    rows = torch.tensor([e.rows[0], 8], dtype=torch.int64, device=DEVICE)
    seq_cpu = e.seq[[0, 4]] + 1
    before = e.state()
    with pytest.raises(LocError, match=r"req_pool_indices hold values in \[0, 8\], allowed range is \[0, 8\)"):
        graph.step(rows, seq_cpu.to(DEVICE), seq_cpu, _inputs(2))
    assert same_state(before, e.state()) and graph.replays == 0
    e.alloc.check_integrity()


@pytest.mark.parametrize("kind", ["decode", "verify", "draft"])
def test_a_step_of_a_bucket_not_captured_is_refused_before_any_page_is_claimed(kind):
    e = Engine(4)
    graph, n = _graph(e, kind, buckets=(2, 4))
    rows = torch.tensor([e.rows[0], e.rows[4]], dtype=torch.int64)
    seq = e.seq[[0, 4]] + n  # request 4's step opens a page
    before, staged = e.state(), _staged(graph)
    with pytest.raises(ConfigError, match=r"a batch of 2 replays bucket 2, which is not captured \(captured: none\)"):
        graph.step(rows, seq, seq, _inputs(2 * n))
    assert same_state(before, e.state()) and _same_staged(staged, _staged(graph))
    e.alloc.check_integrity()
    graph.capture()
    del graph.graphs[4]  # (a capture that stopped part way: the largest bucket is captured first, so fake it)
    three = torch.tensor([e.rows[i] for i in (0, 1, 4)], dtype=torch.int64)
    seq3 = e.seq[[0, 1, 4]] + n
    with pytest.raises(ConfigError, match=r"a batch of 3 replays bucket 4, which is not captured \(captured: \[2\]\)"):
        graph.step(three, seq3, seq3, _inputs(3 * n))
    assert same_state(before, e.state())
    e.alloc.check_integrity()


# ---- what the model step sees: extend_prefix_lens -------------------------------------------------------------

def _runner_setup(mode, adapter_):
    seen = []

    def fn(batch, inputs):
        seen.append(None if batch.extend_prefix_lens is None else batch.extend_prefix_lens.tolist())
        return inputs["x"].clone()

    pool = MHATokenToKVPool(256, 1, torch.float32, 2, 8, 1, "cpu")
    rtt = hwkv.ReqToTokenPool(8, 32, "cpu")
    be = hwkv.make_backend(pool, rtt, device="cpu")
    runner = GraphRunner(be, fn, [4], {"x": ((1,), torch.float32)}, adapter_, mode=mode, tokens_per_req=2)
    runner.capture()
    slot = 1
    for r in range(6):
        rtt.req_to_token[r, :20] = torch.arange(slot, slot + 20)
        slot += 20
    return runner, rtt, seen


def _verify_batch(mode, rtt, lens, prefix=True):
    bs = len(lens)
    seq, ext = torch.tensor(lens), torch.full((bs,), 2)
    loc = torch.cat([rtt.req_to_token[r, n - 2:n] for r, n in enumerate(lens)])
    return ForwardBatch(mode, bs, torch.arange(bs), seq, loc, seq - ext if prefix else None, ext,
                        seq_lens_cpu=seq.clone(), extend_seq_lens_cpu=ext.clone())


class _RecordingHost(EagerAdapter):
    records_device_work = True


@pytest.mark.parametrize("adapter_", [EagerAdapter, _RecordingHost])
@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND])
def test_graph_runner_hands_fn_the_batch_prefix_lens_as_the_eager_run_does(mode, adapter_):
    """Padded requests get prefix 0; a smaller batch after a larger one leaves no stale prefix; a batch past every
    bucket runs eagerly with the caller's batch: the same prefixes either way."""
    runner, rtt, seen = _runner_setup(mode, adapter_())
    for lens in ([9, 6, 12], [7], [10, 11, 8, 13], [9, 6, 12, 5, 14]):
        batch = _verify_batch(mode, rtt, lens)
        runner.run(batch, {"x": torch.zeros(2 * len(lens), 1)})
        want = [n - 2 for n in lens]
        assert seen[-1][:len(lens)] == want, f"fn saw {seen[-1]} for a batch whose prefixes are {want}"
        if len(lens) < 4:
            assert seen[-1][len(lens):] == [0] * (4 - len(lens))  # padded requests
    assert runner.replays == 3 and runner.eager_runs == 1
    batch = _verify_batch(mode, rtt, [9, 6], prefix=False)  # no prefixes given: those of the lengths
    runner.run(batch, {"x": torch.zeros(4, 1)})
    assert seen[-1] == [7, 4, 0, 0]


def test_graph_runner_refuses_prefix_lens_of_the_wrong_shape_and_changes_nothing():
    runner, rtt, seen = _runner_setup(ForwardMode.TARGET_VERIFY, EagerAdapter())
    batch = _verify_batch(ForwardMode.TARGET_VERIFY, rtt, [9, 6])
    batch.extend_prefix_lens = torch.tensor([7, 4, 1])
    before = [t.clone() for t in (runner.req_pool_indices, runner.seq_lens, runner.extend_prefix_lens,
                                  runner.out_cache_loc, runner.inputs["x"])]
    with pytest.raises(ShapeError, match=r"extend_prefix_lens has 3 entries, batch_size is 2"):
        runner.run(batch, {"x": torch.ones(4, 1)})
    after = (runner.req_pool_indices, runner.seq_lens, runner.extend_prefix_lens, runner.out_cache_loc,
             runner.inputs["x"])
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and runner.replays == 0


@pytest.mark.skipif(DEVICE != "cpu", reason="fn reads the prefixes on the host each step: a host 'graph'")
def test_verify_step_graph_hands_fn_the_prefix_lens_as_its_eager_step_does():
    """VerifyStepGraph's static batch carries extend_prefix_lens = lengths - tokens per request, filled in the
    captured step (the lengths are staged on the device): padded requests 0; the eager step past every bucket the
    same prefixes."""
    e = Engine(4)
    seen = []

    def fn(batch, inputs):
        seen.append(batch.extend_prefix_lens.tolist())
        return e.layers_fn(batch, inputs)

    graph = VerifyStepGraph(e.backend, e.alloc, fn, [4], SHAPES, 2, EagerAdapter())
    graph.capture()
    for pick in ([0, 4], [1, 2, 3], [0, 1, 2, 3, 4]):
        rows = torch.tensor([e.rows[i] for i in pick], dtype=torch.int64)
        seq = e.seq[pick] + 3
        graph.step(rows, seq, seq, _inputs(3 * len(pick)))
        e.seq[pick] = seq
        want = (seq - 3).tolist()
        assert seen[-1][:len(pick)] == want
        if len(pick) < 4:
            assert seen[-1][len(pick):] == [0] * (4 - len(pick))
    assert graph.replays == 2 and graph.eager_runs == 1
    e.alloc.check_integrity()
