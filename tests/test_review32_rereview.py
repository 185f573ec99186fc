"""Review 32's re-review (e1522e5..27a8ec8: the verify's hand-over through `_finishing`, `Scheduler.admit(start,
admitted)`, the strided-q / full-list / graph-refill value checks, `hwkv bench`'s flag minimums).

Checked and found to hold (no test here): the verify's exception paths before and after the change (a release that
raises, a hand-over that raises or is refused, a Ctrl-C held through the settle, nested `interrupts_held`): no Result
lost or duplicated, no request handed over twice; the strided-q refusal matches the kernels' `check_dims` (t = 0,
d = 1, expanded q); the full-list check's bound (size + page_size: slot 0 and the last padding page in range) for
plain and hybrid pools, page sizes 1/4, the fused / CSR / dense-table eager paths, tree and chain verify; a graph
refill of a padded batch whose padding row is unused (the engine's `pad_row`); every `_FLAG_MINIMUMS` entry against
its workload's own check (0 = off / all kept where the workload means it). The existing graph, step-graph, contract,
review 30/32 engine test files pass.

Each test below fails on the current code and shows one defect. CPU tensors, tiny shapes.
"""
from __future__ import annotations

import os
import random
import signal
from typing import List

import pytest
import torch

from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.engine.sampling import SamplingParams
from hwkv.errors import EvictedSlotError, HwkvError
from hwkv.testing.harness import Harness
from hwkv.testing.spec_harness import draft_batch, draft_model
from test_review30_exceptions import _drain_interrupted
from test_review32_contract import BACKENDS, _debug_graph
from test_review31_windows import VOCAB, _engine

pytestmark = pytest.mark.usefixtures("one_thread")

H, KVH, D = 4, 2, 16




# ---- 1. debug mode's graph-refill check refuses a valid padded batch -------------------------------------------------
@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
def test_debug_graph_refill_does_not_refuse_a_padded_batch_whose_padding_row_is_a_live_request(backend_name):
    """Wrong: `AttentionBackend._check_list_values` (hwkv/backend.py:410-427) tells a padding row's window entries
    from an evicted token's by their full slot being 0 (`torch.where(locs == 0, 1, ...)`). But `GraphRunner._pad`
    (hwkv/graph.py:237-246) pads with request row 0 at length tpr, which reads req_to_token[0, :tpr]: where row 0 is
    a live request (hwkv.ReqToTokenPool hands out row 0 first), that is its first token, whose full slot is not 0 and
    whose SWA slot the out-of-window release legitimately freed (0). Debug mode then raises EvictedSlotError for a
    batch the eager step and the non-debug replay run correctly: here one live request of 11 tokens (W = 4, its first
    six SWA slots released) replayed in bucket 2.
    Expected: the padded replay runs (a padding row is not the live request's history: check only the batch's
    live rows, e.g. rows [:live] of the GraphRunner's static batch, or check before the padding in `prepare`), and
    gives the eager step's output."""
    alloc, r2t, backend, fn, runner = _debug_graph(backend_name, 4, [2])
    row = r2t.alloc(1)[0]
    assert row == 0
    loc = alloc.alloc_extend([0], [10], [0], 10)
    r2t.write(row, 0, loc)
    alloc.free_swa(loc[:6].clone())   # out of the window of every later query (keys >= 7 with W = 4): released
    last = int(r2t.req_to_token[row, 9])
    new = alloc.alloc_decode([11], [last])
    r2t.write(row, 10, new)
    batch = ForwardBatch(ForwardMode.DECODE, 1, torch.tensor([row], device="cpu"), torch.tensor([11], device="cpu"),
                         new)
    x = torch.randn(1, H, D, generator=torch.Generator(device="cpu").manual_seed(0), device="cpu")
    backend.init_forward_metadata(batch)   # eager, debug: accepted (no in-window token was released)
    want = fn(batch, {"x": x}).clone()
    got = runner.run(batch, {"x": x})
    torch.testing.assert_close(got[:1], want, atol=1e-4, rtol=1e-4)


# ---- 2. the multi-step draft metadata misses the new full-list check -------------------------------------------------
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_draft_metadata_refuses_a_history_slot_outside_the_pool_before_any_layer_stores(graph):
    """Wrong: bad input 233's check (`check_slots` of the full list, hwkv/backend.py:221 and 416) is in
    `init_forward_metadata` and `init_forward_metadata_graph` only; `DraftMetadataMixin.init_draft_metadata` and
    `init_draft_metadata_graph` (hwkv/draft.py:90-135, 162-203) build each step's full list from the same
    req_to_token rows unchecked. A -1 in a request's history (out of every window) passes the draft metadata; the
    full layer stores its K/V and the CPU kernel then raises a bare IndexError ("index out of range in self"): an
    untyped error after the pool changed, which 233 fixed for the other forwards.
    Expected: a typed HwkvError (LocError naming the slot) from the draft metadata step, the pool unchanged."""
    from hwkv_cpu.backend import TorchCPUBackend

    h = Harness(TorchCPUBackend, size=256, size_swa=96, max_context_len=64, shadow=False)
    if graph:
        h.backend.init_draft_graph_state(2, 2)
    rid = h.add_request()
    h.forward([rid], [20], ForwardMode.EXTEND, check=False)
    h.rtt.req_to_token[rid, 0] = -1   # position 0: outside every window of the draft steps
    batch = draft_batch(h, [rid], 2)
    before = [t.clone() for g in (h.pool.full_kv_pool, h.pool.swa_kv_pool) for t in (*g.k_buffer, *g.v_buffer)]
    inputs = h.random_inputs(2)
    with pytest.raises(HwkvError):
        steps = (h.backend.init_draft_metadata_graph if graph else h.backend.init_draft_metadata)(batch)
        draft_model(h, h.layers)(steps, inputs)
    after = [t for g in (h.pool.full_kv_pool, h.pool.swa_kv_pool) for t in (*g.k_buffer, *g.v_buffer)]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a layer stored its K/V before the refusal"


# ---- 3. debug mode's evicted-slot check still misses draft graph refills --------------------------------------------
def test_debug_mode_refuses_an_evicted_in_window_token_in_a_draft_graph_refill():
    """Wrong: bad input 234 extended debug mode's EvictedSlotError to `init_forward_metadata_graph`
    (`_check_list_values`), but `init_draft_metadata_graph` (hwkv/draft.py:162-203, what DraftGraphRunner refills
    with) cuts each step's window lists from the translated span block with no check, while the eager
    `init_draft_metadata` (draft.py:123-124) refuses the same batch. An in-window token whose SWA slot was released
    is read as the padding slot's K/V, silently, in the graph draft only.
    Expected: the same EvictedSlotError (W=8) from the draft graph refill in debug mode, where values are checkable."""
    from hwkv_cpu.backend import TorchCPUBackend

    def setup(graph: bool):
        h = Harness(TorchCPUBackend, size=256, size_swa=96, max_context_len=64, shadow=False, debug=True)
        if graph:
            h.backend.init_draft_graph_state(2, 2)
        rid = h.add_request()
        h.forward([rid], [20], ForwardMode.EXTEND, check=False)
        h.allocator.free_swa(h.rtt.req_to_token[rid, 17:18].clone())   # in the window (W = 8) of the next query
        return h, draft_batch(h, [rid], 2)

    h, batch = setup(graph=False)
    with pytest.raises(EvictedSlotError, match=r"W=8"):
        h.backend.init_draft_metadata(batch)   # eager: refused (holds today)
    h, batch = setup(graph=True)
    with pytest.raises(EvictedSlotError, match=r"W=8"):
        h.backend.init_draft_metadata_graph(batch)


# ---- 4/5. a Ctrl-C in admission's bookkeeping: the fix covers only a raising `start` --------------------------------
def _tokens(n: int, seed: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


_PROMPTS = (_tokens(12, 3), _tokens(9, 4))
_PARAMS = (SamplingParams(max_new_tokens=8, temperature=1.0, seed=7), SamplingParams(max_new_tokens=4))


def _sigint_at_first_call(owner, name: str) -> List[int]:
    """A real Ctrl-C (SIGINT to this process) as `owner.name` is first entered; the list it appends to when sent.
    Python raises it at its next check, as the original starts: a block holding Ctrl-C (`interrupts_held`) defers it."""
    original, sent = getattr(owner, name), []

    def interrupted(*args, **kwargs):
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    setattr(owner, name, interrupted)
    return sent


def _run_interrupted(prefix_cache: bool, target):
    e = _engine(prefix_cache=prefix_cache)
    sent = _sigint_at_first_call(*target(e)) if target is not None else [1]
    rids = [e.add_request(p, s) for p, s in zip(_PROMPTS, _PARAMS)]
    got, errors = _drain_interrupted(e, rids, limit=3, max_steps=60)
    assert sent, "the interrupted call was never reached"
    return got, errors


def test_ctrl_c_in_a_plain_admissions_row_setup_does_not_strand_the_admitted_requests(python_sigint):
    """Wrong: without the prefix cache `Engine._step` (hwkv/engine/engine.py:397-404) takes requests into
    `scheduler.running` (`scheduler.admit()`) and only then gives them rows (`self.slots.new_rows`, a req_to_token
    alloc and a host-to-device copy of their frontiers) and writes their sampling constants (`_admitted`). Change 2
    made only the prefix-cache path keep what was admitted when a later call raises. A Ctrl-C in `new_rows` leaves
    both requests running with row -1: every later step raises LocError ("req_pool_indices hold values in [-1, -1]")
    and `check_integrity` fails; nothing finishes them.
    Expected: an interrupted step leaves the engine able to go on with an uninterrupted run's tokens (admission,
    rows and constants landing together, e.g. under `interrupts_held`, or undone)."""
    want, errors = _run_interrupted(False, None)
    assert not errors
    got, errors = _run_interrupted(False, lambda e: (e.slots, "new_rows"))
    assert not errors, "\n".join(errors)
    assert got == want


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix-cache", "plain"])
def test_ctrl_c_in_admitted_requests_sampling_setup_does_not_leave_them_greedy(prefix_cache, python_sigint):
    """Wrong: `Engine._admitted` (hwkv/engine/engine.py:486-491: the prompt counts, then `sampling.admit`'s
    host-to-device copy of temperature, top_p, seed and draw count) runs unheld after the requests are running with
    their rows. Change 2 calls it when `start` raises, but a Ctrl-C inside it (here as `sampling.admit` begins) still
    leaves a sampling request (temperature 1.0, seed 7) with its row's stale constants: it decodes greedily, and
    nothing writes them later. (Its prompt is not counted in the statistics either.)
    Expected: the uninterrupted run's tokens (the bookkeeping held with the admission, or caught up next step)."""
    want, errors = _run_interrupted(prefix_cache, None)
    assert not errors
    got, errors = _run_interrupted(prefix_cache, lambda e: (e.sampling, "admit"))
    assert not errors, "\n".join(errors)
    assert got == want
