"""Review 22 (graph machinery and page ops): what the whole-step graphs, GraphRunner and the allocator's `reserve`
refuse, each with a typed error naming the value and the limit, before anything is reserved, staged or written
(allocator integrity, req_to_token, frontiers, K/V, the backend's graph state and the graphs' static buffers
compared before and after):

- `step()` of rows, seq_lens or seq_lens_cpu that are not 1-D (a [bs, 1] column): ShapeError before the step's
  pages are reserved (they had been claimed, then a bare numpy/torch error lost them);
- GraphRunner.prepare of a batch whose forward mode is not the runner's (a DECODE runner had replayed an EXTEND
  batch of 2 and 0 new tokens as two decodes: wrong outputs); a DECODE runner takes IDLE;
- with HWKV_DEBUG, a malformed DraftTree: ShapeError before `prepare` writes any static buffer (the refill had
  refused it after every buffer held the batch);
- `allocator.reserve(True)`: ConfigError, as reserve(ops=True) (a page had been claimed).

Runs on CPU (a host 'graph'); HWKV_TEST_DEVICE=cuda runs them under CUDA graphs."""
import re

import numpy as np
import pytest
import torch

from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ConfigError, ShapeError
from hwkv.graph import EagerAdapter, GraphRunner
from hwkv.spec import DraftTree
from test_review20_graphs import SHAPES, _inputs, _runner, _whole_step, assert_unchanged, snapshot
from test_step_graph import DEVICE, Engine, adapter

I64 = torch.int64


# ---- 1. rows and lengths that are not 1-D ---------------------------------------------------------------------

@pytest.mark.parametrize("which", ["rows", "seq_lens", "seq_lens_cpu", "all"])
@pytest.mark.parametrize("bs", [2, 5])  # a replay of bucket 4 that opens a page, and the eager step past every bucket
@pytest.mark.parametrize("kind", ["decode", "verify", "draft"])
def test_step_refuses_rows_or_lengths_that_are_not_1d_before_any_page_is_reserved(kind, bs, which):
    """[bs, 1] columns had reserved the step's pages, then raised a bare ValueError/RuntimeError: the pages were held
    by nobody (check_integrity failed), and past every bucket the slots were allocated and never written."""
    e = Engine(4)
    graph, n = _whole_step(e, kind, None)
    graph.capture()
    pick = [0, 4] if bs == 2 else [0, 1, 2, 3, 4]  # request 4 (length 40) opens a page in every kind
    args = {"rows": torch.tensor([e.rows[i] for i in pick], dtype=I64), "seq_lens": e.seq[pick] + n,
            "seq_lens_cpu": e.seq[pick] + n}
    for name in args if which == "all" else [which]:
        args[name] = args[name].view(-1, 1)
    shapes = ", ".join(str(list(t.shape)) for t in args.values())
    before, head = snapshot(e, graph), e.alloc.pages.head
    with pytest.raises(ShapeError, match=rf"^rows, seq_lens and seq_lens_cpu must be 1-D \[bs\], got shapes "
                                         rf"{re.escape(shapes)}$"):
        graph.step(args["rows"].to(DEVICE), args["seq_lens"].to(DEVICE), args["seq_lens_cpu"], _inputs(bs * n))
    assert e.alloc.pages.head == head, "the step's pages were reserved"
    assert_unchanged(before, snapshot(e, graph))
    e.alloc.check_integrity()
    rows = args["rows"].reshape(-1)  # the same step with 1-D tensors runs
    graph.step(rows.to(DEVICE), (e.seq[pick] + n).to(DEVICE), e.seq[pick] + n, _inputs(bs * n))
    e.alloc.check_integrity()


def test_step_refuses_0d_rows_and_lengths():
    """One request as 0-d tensors (numel 1) is no [1] row list either."""
    e = Engine(4)
    graph, _ = _whole_step(e, "decode", None)
    graph.capture()
    before = snapshot(e, graph)
    row, seq = torch.tensor(e.rows[4], dtype=I64), e.seq[4] + 1
    with pytest.raises(ShapeError, match=r"must be 1-D \[bs\], got shapes \[\], \[\], \[\]$"):
        graph.step(row.to(DEVICE), seq.to(DEVICE), seq, _inputs(1))
    assert_unchanged(before, snapshot(e, graph))


# ---- 2. a batch of another forward mode than the runner's ------------------------------------------------------

def _mode_batch(e, mode, rows, new):
    """A batch of `mode` continuing `rows` by `new` tokens each (write locs outside any live slot: never written)."""
    bs = len(rows)
    pre = e.seq[rows]
    ext = torch.tensor(new, dtype=I64)
    seq = pre + ext
    loc = torch.arange(1000, 1000 + int(ext.sum()), device=DEVICE)
    r = torch.tensor([e.rows[i] for i in rows], device=DEVICE)
    if mode == ForwardMode.DECODE:
        return ForwardBatch(mode, bs, r, seq.to(DEVICE), loc, seq_lens_cpu=seq)
    return ForwardBatch(mode, bs, r, seq.to(DEVICE), loc, pre.to(DEVICE), ext.to(DEVICE), seq_lens_cpu=seq,
                        extend_seq_lens_cpu=ext)


MISMATCHES = [(ForwardMode.DECODE, ForwardMode.EXTEND, [2, 0]),   # the reviewer's batch: 2 tokens for 2 requests
              (ForwardMode.DECODE, ForwardMode.EXTEND, [1, 1]),
              (ForwardMode.DECODE, ForwardMode.MIXED, [1, 1]),
              (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, [1, 1]),
              (ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND, [3, 3]),
              (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND, [3, 3]),
              (ForwardMode.TARGET_VERIFY, ForwardMode.DECODE, [1, 1]),
              (ForwardMode.DRAFT_EXTEND, ForwardMode.TARGET_VERIFY, [3, 3])]


@pytest.mark.parametrize("runner_mode,mode,new", MISMATCHES, ids=lambda v: getattr(v, "name", str(v)))
def test_graph_runner_refuses_a_batch_of_another_mode_before_any_static_buffer_changes(runner_mode, mode, new):
    """A DECODE runner had replayed an EXTEND batch of 2 and 0 new tokens as two decodes (off by up to 2.9 from the
    eager forward, nothing raised): the runner's static batch runs its own mode, so another mode is refused."""
    e = Engine(4)
    runner, _ = _runner(e, runner_mode)
    batch = _mode_batch(e, mode, list(range(len(new))), new)
    before = snapshot(e, runner)
    with pytest.raises(ConfigError, match=rf"^these graphs were captured for {runner_mode.name} batches, the batch "
                                          rf"is {mode.name}"):
        runner.run(batch, _inputs(batch.num_tokens))
    assert_unchanged(before, snapshot(e, runner))


def test_a_decode_runner_takes_idle_batches_and_its_own_mode():
    """IDLE is a DECODE of no requests (the eager step plans it so): a DECODE runner replays it; batches of the
    runner's own mode replay as before."""
    e = Engine(4)
    runner, _ = _runner(e, ForwardMode.DECODE)
    z = torch.zeros(0, dtype=I64, device=DEVICE)
    idle = ForwardBatch(ForwardMode.IDLE, 0, z, z, z, seq_lens_cpu=z.cpu())
    assert runner.run(idle, _inputs(0)).shape[0] == 0 and runner.replays == 1
    e2 = Engine(4)
    verify, tpr = _runner(e2, ForwardMode.TARGET_VERIFY)
    verify.run(_mode_batch(e2, ForwardMode.TARGET_VERIFY, [0, 1], [tpr, tpr]), _inputs(6))
    assert verify.replays == 1


# ---- 3. a malformed DraftTree in debug mode ----------------------------------------------------------------------

BAD_TREES = {"diagonal unset": [True, False, False, False], "a bit above the diagonal": [True, True, True, True],
             "good first, diagonal unset second": [True, False, True, True, True, False, False, False]}


@pytest.mark.parametrize("host_ext", [True, False], ids=["host-ext", "no-host-ext"])
@pytest.mark.parametrize("bad", list(BAD_TREES))
def test_debug_refuses_a_malformed_tree_before_prepare_writes_any_static_buffer(monkeypatch, bad, host_ext):
    """HWKV_DEBUG=1: the refill's value check had refused the tree after inputs, rows, lengths, write locs and the
    tree mask held the refused batch (a prepared batch replayed after it would run with its rows)."""
    monkeypatch.setenv("HWKV_DEBUG", "1")
    e = Engine(4)
    assert e.backend.debug
    runner = GraphRunner(e.backend, e.layers_fn, [2, 4], SHAPES, adapter() or EagerAdapter(),
                         mode=ForwardMode.TARGET_VERIFY, tokens_per_req=2, tree=True)
    runner.capture()
    bits = BAD_TREES[bad]
    mask = torch.tensor(bits * (2 if len(bits) == 4 else 1), device=DEVICE)
    pre = e.seq[:2]
    ext = torch.tensor([2, 2])
    seq = pre + ext
    batch = ForwardBatch(ForwardMode.TARGET_VERIFY, 2, torch.tensor(e.rows[:2], device=DEVICE), seq.to(DEVICE),
                         torch.arange(1000, 1004, device=DEVICE), pre.to(DEVICE), ext.to(DEVICE),
                         spec_info=DraftTree(mask), seq_lens_cpu=seq, extend_seq_lens_cpu=ext if host_ext else None)
    before, mask_before = snapshot(e, runner), runner.tree_mask.clone()
    with pytest.raises(ShapeError, match=r"DraftTree.mask block at \d+ \(2 x 2\) must have its diagonal set and "
                                         r"nothing above it"):
        e.backend.init_forward_metadata(batch)  # the eager step's refusal of the same batch
    with pytest.raises(ShapeError, match=r"DraftTree.mask block at \d+ \(2 x 2\) must have its diagonal set and "
                                         r"nothing above it"):
        runner.run(batch, _inputs(4))
    assert_unchanged(before, snapshot(e, runner))
    assert torch.equal(mask_before, runner.tree_mask), "the static tree mask changed"
    good = ForwardBatch(ForwardMode.TARGET_VERIFY, 2, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc,
                        batch.extend_prefix_lens, batch.extend_seq_lens,
                        spec_info=DraftTree(torch.tensor([True, False, True, True] * 2, device=DEVICE)),
                        seq_lens_cpu=seq, extend_seq_lens_cpu=batch.extend_seq_lens_cpu)
    # (its new tokens' write locs are made up and not in req_to_token: debug mode's evicted-slot check of the window
    # lists would refuse them; only the tree's check is under test here)
    monkeypatch.setattr(e.backend, "_check_not_evicted", lambda *a: None)
    runner.prepare(good, _inputs(4))  # a well-formed tree passes


# ---- 4. reserve's page count ------------------------------------------------------------------------------------

@pytest.mark.parametrize("pages", [True, False, np.bool_(True), torch.tensor(True), 1.0, "1", -1, None], ids=repr)
def test_reserve_refuses_a_page_count_no_integer_or_negative_before_anything_is_claimed(pages):
    """True had been read as one page (the head moved, the op number advanced), as reserve(ops=True) never was."""
    a = SWATokenToKVPoolAllocator(64, 64, 4, "cpu", None)
    snap, op = a.integrity_snapshot(), a.op_number
    with pytest.raises(ConfigError, match=rf"^reserve\(pages={re.escape(repr(pages))}\) needs an integer >= 0"):
        a.reserve(pages)
    assert same_snapshot(snap, a.integrity_snapshot()) and a.op_number == op
    a.check_integrity()


@pytest.mark.parametrize("pages", [2, np.int64(2), np.int32(2)], ids=repr)
def test_reserve_takes_python_and_numpy_integers(pages):
    a = SWATokenToKVPoolAllocator(64, 64, 4, "cpu", None)
    head = a.pages.head
    a.reserve(pages)
    assert a.pages.head == head + 2
