"""Review 20 (graph paths): what the whole-step graphs (DecodeStepGraph, VerifyStepGraph, DraftStepGraph) and
GraphRunner refuse, each with a typed error naming the value and the limit, and every pool, table, allocator, the
backend's graph state and the graphs' static buffers unchanged (snapshots compared):

- a release window that is no integer (a bool, a float) or below the backend's sliding window, or one over pools
  without an SWA pool: ConfigError at construction, before anything is built (the engine's rule, `release_window`);
- a padding row that is no integer or outside req_to_token: ConfigError at construction;
- GraphRunner.prepare of a batch whose rows or host lengths the eager metadata step refuses: the same errors,
  before any static buffer is written;
- float or bool request rows and lengths (`step()`, `ForwardBatch`, and every caller of `check_int_dtype`):
  LocError naming the dtype.

And the comparison test_step_graph.py's equivalence tests make sees a release inside the graph that frees slots
the SWA layer still reads (its layers_fn returns every layer's output).

Runs on CPU (a host 'graph'); HWKV_TEST_DEVICE=cuda runs the construction and dtype refusals under CUDA graphs."""
import dataclasses
import re

import numpy as np
import pytest
import torch

import hwkv
from hwkv.allocator import PagedTokenToKVPoolAllocator, same_snapshot
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.checks import check_int_dtype
from hwkv.errors import ConfigError, LocError, ShapeError
from hwkv.graph import EagerAdapter, GraphRunner
from hwkv.pool import MHATokenToKVPool
from hwkv.release import release_out_of_window_batch
from hwkv.step_graph import DecodeStepGraph, DraftStepGraph, VerifyStepGraph
from test_step_graph import DEVICE, D, Engine, H, KVH, W, adapter

SHAPES = {"q": ((H, D), torch.float32), "k": ((KVH, D), torch.float32), "v": ((KVH, D), torch.float32)}
ROWS, CTX, PAGE = 8, 128, 4  # Engine(4): req_to_token of 8 rows x 128 positions, pages of 4


def _tensors(obj):
    """Host copies of every tensor in `obj` (a tensor, a dict or a dataclass of them, None)."""
    if isinstance(obj, torch.Tensor):
        return [obj.cpu().clone()]
    if isinstance(obj, dict):
        return [t for k in sorted(obj) for t in _tensors(obj[k])]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    return []


def snapshot(e, graph=None):
    """Everything a refusal must leave as it was: the allocator (rings, references, full->SWA table), req_to_token
    and its free rows, the frontiers, every K/V buffer, the backend's graph state (None until a graph is built) and
    the graph's static buffers, staged words and counts."""
    p = e.pool
    kv = [b for sub in (p.full_kv_pool, p.swa_kv_pool) for b in (*sub.k_buffer, *sub.v_buffer)]
    static = None if e.backend.static is None else _tensors(e.backend.static)
    own = []
    if graph is not None:
        own = _tensors({k: getattr(graph, k) for k in ("req_pool_indices", "seq_lens", "seq_lens_cpu",
                                                       "out_cache_loc", "extend_prefix_lens", "staged")
                        if getattr(graph, k, None) is not None}) + _tensors(graph.inputs)
        own.append(torch.tensor([graph.replays, graph.eager_runs]))
    return (e.alloc.integrity_snapshot(), e.rtt.req_to_token.cpu().clone(), e.rtt.available_size(),
            e.frontiers.cpu().clone(), _tensors(kv), static, own)


def assert_unchanged(before, after):
    assert same_snapshot(before[0], after[0]), "the allocator changed"
    assert torch.equal(before[1], after[1]), "req_to_token changed"
    assert before[2] == after[2], "a request row was taken or given back"
    assert torch.equal(before[3], after[3]), "the frontiers changed"
    assert all(torch.equal(a, b) for a, b in zip(before[4], after[4])), "a K/V buffer changed"
    assert (before[5] is None) == (after[5] is None), "the backend's graph state was built"
    if before[5] is not None:
        assert all(torch.equal(a, b) for a, b in zip(before[5], after[5])), "a static metadata buffer changed"
    assert len(before[6]) == len(after[6]) and all(torch.equal(a, b) for a, b in zip(before[6], after[6])), \
        "a static buffer, the staged words or the replay counts of the graph changed"


def _inputs(n):
    return {"q": torch.randn(n, H, D, device=DEVICE), "k": torch.randn(n, KVH, D, device=DEVICE),
            "v": torch.randn(n, KVH, D, device=DEVICE)}


# ---- 1. the release window of a DecodeStepGraph ---------------------------------------------------------------

BAD_WINDOWS = [True, False, 2.5, 8.0, np.float64(8.0), "8", 3, 7, 0, -8, 2**63]


@pytest.mark.parametrize("window", BAD_WINDOWS, ids=repr)
def test_a_window_no_integer_or_below_the_backend_window_is_refused_before_anything_is_built(window):
    """A release that keeps less than the SWA layers read frees slots they still read (window 3, True read as 1,
    2.5 as 2: wrong outputs from the first steps on); refused at construction, no row taken, no graph state."""
    e = Engine(4)
    before = snapshot(e)
    with pytest.raises(ConfigError, match=rf"window={re.escape(repr(window))} for the hybrid pools of .*must be an "
                                          rf"integer >= {W} \(the model's sliding window {W}, or context {CTX} - "
                                          rf"page_size {PAGE} \+ 1 where smaller"):
        DecodeStepGraph(e.backend, e.alloc, e.layers_fn, [4], SHAPES, adapter(), e.frontiers, window)
    assert_unchanged(before, snapshot(e))
    e.alloc.check_integrity()


@pytest.mark.parametrize("window,kept", [(W, W), (np.int64(12), 12), (torch.tensor(9), 9),
                                         (2**40, CTX + PAGE)], ids=repr)
def test_a_window_at_or_above_the_backend_window_is_kept_as_an_int(window, kept):
    """As the engine keeps it: an int, one past the rows' context plus a page releasing what that one does."""
    e = Engine(4)
    graph = DecodeStepGraph(e.backend, e.alloc, e.layers_fn, [4], SHAPES, adapter(), e.frontiers, window)
    assert type(graph.window) is int and graph.window == kept


def test_a_window_over_pools_without_an_swa_pool_is_refused_before_anything_is_built():
    """Full-attention pools have nothing to release (the release had raised at capture, after the graph state)."""
    pool = MHATokenToKVPool(256, 1, torch.float32, KVH, D, 1, DEVICE)
    alloc = PagedTokenToKVPoolAllocator(256, 1, DEVICE)
    rtt = hwkv.ReqToTokenPool(ROWS, 32, DEVICE)
    backend = hwkv.make_backend(pool, rtt, device=DEVICE)
    free = rtt.available_size()
    with pytest.raises(ConfigError, match=r"window=8, but the pools of .* have no SWA pool \(every layer is full "
                                          r"attention\): give window=None"):
        DecodeStepGraph(backend, alloc, lambda b, i: i["q"], [4], {"q": ((H, D), torch.float32)}, EagerAdapter(),
                        torch.zeros(ROWS, dtype=torch.int64, device=DEVICE), W)
    assert rtt.available_size() == free and backend.static is None


# ---- 2. the padding row -----------------------------------------------------------------------------------------

def _whole_step(e, kind, pad_row, buckets=(4,)):
    ad = adapter() or EagerAdapter()
    if kind == "decode":
        return DecodeStepGraph(e.backend, e.alloc, e.layers_fn, list(buckets), SHAPES, ad, e.frontiers, W,
                               pad_row=pad_row), 1
    if kind == "verify":
        return VerifyStepGraph(e.backend, e.alloc, e.layers_fn, list(buckets), SHAPES, 2, ad, pad_row=pad_row), 3
    return DraftStepGraph(e.backend, e.alloc, e.draft_fn, list(buckets), SHAPES, 3, ad, pad_row=pad_row), 3


@pytest.mark.parametrize("pad_row", [True, np.bool_(True), torch.tensor(True), 2.7, 7.0, "3", ROWS, 100, -1],
                         ids=repr)
@pytest.mark.parametrize("kind", ["decode", "verify", "draft"])
def test_a_padding_row_no_integer_or_outside_req_to_token_is_refused_before_anything_is_built(kind, pad_row):
    """True had padded into row 1 (a live request's first slot overwritten every padded replay), 2.7 and "3" into
    rows 2 and 3, a row past the table had been a bare IndexError at capture (on a GPU a store past it)."""
    e = Engine(4)
    before = snapshot(e)
    with pytest.raises(ConfigError, match=rf"pad_row={re.escape(repr(pad_row))} must be an integer request row in "
                                          rf"\[0, {ROWS}\)"):
        _whole_step(e, kind, pad_row)
    assert_unchanged(before, snapshot(e))


@pytest.mark.parametrize("pad_row", [7, np.int64(7), torch.tensor(7)], ids=repr)
def test_a_padding_row_of_any_integer_type_is_kept_as_an_int(pad_row):
    e = Engine(4)
    graph, _ = _whole_step(e, "decode", pad_row)
    assert type(graph.pad_row) is int and graph.pad_row == 7


# ---- 3. GraphRunner.prepare checks what the eager metadata step checks ------------------------------------------

def _runner(e, mode):
    tpr = 1 if mode == ForwardMode.DECODE else 3
    runner = GraphRunner(e.backend, e.layers_fn, [4], SHAPES, adapter() or EagerAdapter(), mode=mode,
                         tokens_per_req=tpr)
    runner.capture()
    return runner, tpr


def _batch(mode, tpr, rows, seq, host):
    bs = len(rows)
    rows_t, seq_t = torch.tensor(rows, device=DEVICE), torch.tensor(seq, device=DEVICE)
    loc = torch.arange(1000, 1000 + bs * tpr, device=DEVICE)
    seq_cpu = torch.tensor(seq) if host else None
    if mode == ForwardMode.DECODE:
        return ForwardBatch(mode, bs, rows_t, seq_t, loc, seq_lens_cpu=seq_cpu)
    ext = torch.full((bs,), tpr)
    return ForwardBatch(mode, bs, rows_t, seq_t, loc, seq_t - ext.to(DEVICE), ext.to(DEVICE), seq_lens_cpu=seq_cpu,
                        extend_seq_lens_cpu=ext if host else None)


CASES = [  # (rows, lengths, error, message): as the eager metadata step refuses the batch
    ([0, 1, 2, 3], [200] * 4, ShapeError, rf"seq_lens\[0\] is 200; allowed range is \[1, {CTX}\]"),
    ([0, 1, 2, 3], [14, 0, 8, 22], ShapeError, rf"seq_lens\[1\] is 0; allowed range is \[1, {CTX}\]"),
    ([0, 1, 2, 99], [14, 31, 8, 22], LocError, rf"req_pool_indices hold values in \[0, 99\], allowed range is "
                                               rf"\[0, {ROWS}\)"),
    ([-1, 1], [14, 31], LocError, rf"req_pool_indices hold values in \[-1, 1\], allowed range is \[0, {ROWS}\)"),
]


@pytest.mark.parametrize("host", [True, False], ids=["host lengths", "no host copies"])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY], ids=lambda m: m.name)
@pytest.mark.parametrize("rows,seq,error,match", CASES)
def test_graph_runner_refuses_what_the_eager_step_refuses_before_any_static_buffer_is_written(
        mode, host, rows, seq, error, match):
    """Lengths past max_context_len had run silently (4 x 200 tokens: a full list of 800 in a static buffer of
    512), length 0 too, a row past req_to_token had been a bare IndexError from the refill (on a GPU a read past the
    table). Checked on the host copies (or lengths already on the host): no device read."""
    if not host and DEVICE != "cpu":
        pytest.skip("lengths on the device without host copies are not read (no sync)")
    if error is LocError and DEVICE != "cpu":   # the H100 run of 2026-12-05: the eager step raised nothing
        pytest.skip("rows live on the device (a batch has no host copy of them): the deferred device checks take "
                    "them, with no sync")
    e = Engine(4)
    runner, tpr = _runner(e, mode)
    batch = _batch(mode, tpr, rows, seq, host)
    with pytest.raises(error, match=match):  # the eager step's refusal of the same batch
        e.backend.init_forward_metadata(batch)
    before = snapshot(e, runner)
    with pytest.raises(error, match=match):
        runner.run(batch, _inputs(len(rows) * tpr))
    assert_unchanged(before, snapshot(e, runner))


def test_graph_runner_refuses_a_verify_whose_lengths_hold_fewer_tokens_than_it_runs():
    """A verify of 3 tokens per request at length 2: the eager step's extend-length check, on the host copies."""
    e = Engine(4)
    runner, tpr = _runner(e, ForwardMode.TARGET_VERIFY)
    batch = _batch(ForwardMode.TARGET_VERIFY, tpr, [0, 1], [14, 2], True)
    match = r"extend_seq_lens\[1\] is 3; allowed range is \[0, seq_lens\[1\]\] = \[0, 2\]"
    with pytest.raises(ShapeError, match=match):
        e.backend.init_forward_metadata(batch)
    before = snapshot(e, runner)
    with pytest.raises(ShapeError, match=match):
        runner.run(batch, _inputs(6))
    assert_unchanged(before, snapshot(e, runner))


# ---- 4. float and bool request rows and lengths -----------------------------------------------------------------

def _bad(t, dtype):
    return t.to(torch.bool) if dtype == torch.bool else t.to(dtype) + 0.5


@pytest.mark.parametrize("dtype", [torch.float64, torch.bool], ids=str)
@pytest.mark.parametrize("which", ["rows", "seq_lens", "seq_lens_cpu"])
@pytest.mark.parametrize("bs", [2, 5])  # a replay of bucket 4, and the eager step past every bucket
@pytest.mark.parametrize("kind", ["decode", "verify", "draft"])
def test_step_refuses_float_or_bool_rows_and_lengths_before_anything_is_staged(kind, bs, which, dtype):
    """Rows [0.9, 2.9] had run rows 0 and 2, lengths [15.5, 9.5] as [15, 9], bool rows [False, True] rows 0 and 1."""
    e = Engine(4)
    graph, n = _whole_step(e, kind, None)
    graph.capture()
    pick = [0, 2] if bs == 2 else [0, 1, 2, 3, 4]
    args = {"rows": torch.tensor([e.rows[i] for i in pick], dtype=torch.int64), "seq_lens": e.seq[pick] + n,
            "seq_lens_cpu": e.seq[pick] + n}
    args[which] = _bad(args[which], dtype)
    before = snapshot(e, graph)
    with pytest.raises(LocError, match=rf"^{which} must hold integers, got {re.escape(str(dtype))}$"):
        graph.step(args["rows"].to(DEVICE), args["seq_lens"].to(DEVICE), args["seq_lens_cpu"], _inputs(bs * n))
    assert_unchanged(before, snapshot(e, graph))
    e.alloc.check_integrity()


FIELDS = ["req_pool_indices", "seq_lens", "out_cache_loc", "extend_prefix_lens", "extend_seq_lens", "positions",
          "seq_lens_cpu", "extend_seq_lens_cpu"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool], ids=str)
@pytest.mark.parametrize("field", FIELDS)
def test_a_forward_batch_of_float_or_bool_rows_locs_or_lengths_is_refused_at_construction(field, dtype):
    """The eager metadata step had read float lengths and rows truncated (alloc_decode and the release refuse the
    same tensors): refused where the batch is made, nothing built."""
    e = Engine(4)
    rows, seq, ext = torch.tensor([0, 1]), e.seq[:2] + 2, torch.tensor([2, 2])
    fields = dict(req_pool_indices=rows, seq_lens=seq, out_cache_loc=torch.arange(1000, 1004),
                  extend_prefix_lens=seq - ext, extend_seq_lens=ext, positions=torch.arange(4),
                  seq_lens_cpu=seq.clone(), extend_seq_lens_cpu=ext.clone())
    fields[field] = _bad(fields[field], dtype)
    before = snapshot(e)
    with pytest.raises(LocError, match=rf"^{field} must hold integers, got {re.escape(str(dtype))}$"):
        e.backend.init_forward_metadata(ForwardBatch(ForwardMode.EXTEND, 2, **fields))
    assert_unchanged(before, snapshot(e))


def test_check_int_dtype_refuses_bools_and_floats_and_takes_every_integer_dtype():
    for dtype in (torch.bool, torch.float16, torch.float64, torch.complex64):
        with pytest.raises(LocError, match=rf"^x must hold integers, got {re.escape(str(dtype))}$"):
            check_int_dtype("x", torch.zeros(2, dtype=dtype))
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        check_int_dtype("x", torch.zeros(2, dtype=dtype))
    check_int_dtype("x", [1, 2])  # not a tensor: its callers check lists themselves


def test_every_caller_of_check_int_dtype_refuses_bool_tensors_and_changes_nothing():
    """alloc_decode, alloc_extend, release_out_of_window_batch and ReqToTokenPool.write: a bool tensor had been
    read as 0s and 1s (lengths, rows or locs)."""
    e = Engine(4)
    rows = torch.tensor(e.rows[:2], dtype=torch.int64, device=DEVICE)
    seq = (e.seq[:2] + 1).to(DEVICE)
    last = e.rtt.req_to_token[rows, seq - 2]
    flags = torch.tensor([True, True], device=DEVICE)
    f = e.frontiers[rows]
    for call, name in (
            (lambda: e.alloc.alloc_decode(flags, last), "seq_lens"),
            (lambda: e.alloc.alloc_decode(seq, flags, seq_lens_cpu=seq.cpu()), "last_loc"),
            (lambda: e.alloc.alloc_decode(seq, last, seq_lens_cpu=flags.cpu()), "seq_lens's host copy"),
            (lambda: e.alloc.alloc_extend(seq - 1, seq, flags, 2), "last_loc"),
            (lambda: release_out_of_window_batch(e.alloc, e.rtt.req_to_token, flags, seq, f, W), "req_pool_indices"),
            (lambda: release_out_of_window_batch(e.alloc, e.rtt.req_to_token, rows, flags, f, W), "seq_lens"),
            (lambda: e.rtt.write(e.rows[0], 0, flags), "locs")):
        before = snapshot(e)
        with pytest.raises(LocError, match=rf"^{re.escape(name)} must hold integers, got torch.bool$"):
            call()
        assert_unchanged(before, snapshot(e))
    e.alloc.check_integrity()


# ---- the test gap: the equivalence tests see the SWA layer's output ---------------------------------------------

@pytest.mark.skipif(DEVICE != "cpu", reason="a host 'graph' whose window is changed after construction")
def test_the_equivalence_comparison_sees_a_release_that_frees_slots_the_swa_layer_reads():
    """test_step_graph.py compares Engine.layers_fn's output: with a release of window 3 inside the graph (set past
    the constructor's check, as a wrong release would be) it must differ from the eager step's within a few steps.
    It had returned only the last (full) layer's output, identical either way."""
    ref, got = Engine(4), Engine(4)
    graph = DecodeStepGraph(got.backend, got.alloc, got.layers_fn, [4], SHAPES, EagerAdapter(), got.frontiers, W)
    graph.window = 3  # a release inside the graph that keeps less than the SWA layer reads
    graph.capture()
    gen = torch.Generator().manual_seed(1)
    diffs = []
    for _ in range(6):
        inputs = {"q": torch.randn(4, H, D, generator=gen), "k": torch.randn(4, KVH, D, generator=gen),
                  "v": torch.randn(4, KVH, D, generator=gen)}
        want = ref.eager_step([0, 1, 2, 3], inputs)
        have = got.graph_step(graph, [0, 1, 2, 3], inputs, on_host=True)
        diffs.append(float((have - want).abs().max()))
    assert max(diffs) > 1e-2, f"the outputs compared never differ ({diffs}): the SWA layer's output is not in them"
