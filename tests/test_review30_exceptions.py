"""Review 30: exception safety when something fails in the middle of a graph capture, a graph replay or an engine step.

Each failing test is one defect: after the failed call hwkv is left in a state from which the next call is not
correct (pages nobody holds, requests nobody holds, a flag of a graph that was never captured, an untyped error).
The passing tests at the end pin behaviour verified while reviewing (a capture failing at any bucket under
graphs="auto", a drafter raising, a capture retried after a failure). CPU only: EagerAdapter (the step's Python as
its 'replay'), subclasses of it that fail where a device adapter can (the host update before a replay), and
torch.compile (CompileGraphAdapter).
"""
from __future__ import annotations

import pytest
import torch

import hwkv
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.engine.drafters import prompt_lookup
from hwkv.engine.engine import Engine
from hwkv.engine.pools import build_cache, plan_pools
from hwkv.engine.sampling import SamplingParams
from hwkv.engine.stats import RunnerStats
from hwkv.engine.synthetic import SyntheticModel
from hwkv.errors import ConfigError
from hwkv.graph import EagerAdapter, GraphRunner
from hwkv.pool import MHATokenToKVPool
from hwkv.step_graph import DecodeStepGraph, DraftStepGraph, VerifyStepGraph
from test_engine_defects import CPU, SHAPE, VOCAB, _engine, _prompts
from test_step_graph import W, Engine as StepEngine, same_state
from test_step_graph_refusals import SHAPES, _inputs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module


class HostUpdateFails(EagerAdapter):
    """An adapter whose host-side update before a replay (`pre_replay`: NPU graphs update their tasks there) raises
    once armed: nothing of the replay ran."""

    armed = False

    def pre_replay(self, graph):
        if self.armed:
            self.armed = False
            raise RuntimeError("the graph's host update failed")


def _interrupt_first_call(monkeypatch, owner, name, nth=1):
    """`owner.name` raising KeyboardInterrupt at its first (`nth`) call (a Ctrl-C before it changed anything), itself
    otherwise; the list it appends to when it fired."""
    original, fired, calls = getattr(owner, name), [], []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            fired.append(1)
            raise KeyboardInterrupt()
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)
    return fired


def _drain_interrupted(e, rids, limit=3, max_steps=500, survive=(KeyboardInterrupt,), once=False):
    """Steps until no work, as a server loop that survives Ctrl-C of one step does (`survive`: the errors it
    survives): (each request's tokens, the other errors its steps raised and the integrity failures after each step).
    `once`: a request with other than exactly one Result gives the list of them. Bounded: a request stranded as
    running would keep the engine busy for ever (reported as an error)."""
    out, errors, steps = {}, [], 0
    while e.has_work() and len(errors) < limit:
        steps += 1
        if steps > max_steps:
            errors.append(f"still has work after {max_steps} steps: " + str(
                [(r.rid, r.finish_reason, len(r.output), r.pending) for r in e.scheduler.running]))
            break
        try:
            for r in e.step():
                out.setdefault(r.rid, []).append(r.tokens)
        except survive:
            pass
        except Exception as err:  # noqa: BLE001 - reported
            errors.append(repr(err))
        try:
            e.check_integrity()
        except AssertionError as err:
            errors.append(str(err))
    if once:
        return [out[r][0] if len(out.get(r, [])) == 1 else out.get(r) for r in rids], errors
    return [out[r][-1] if r in out else None for r in rids], errors


def _drain(e, rids):
    out = {}
    while e.has_work():
        out.update((r.rid, r.tokens) for r in e.step())
        e.check_integrity()
    return [out[r] for r in rids]


# ---- 1. a whole-step replay that fails before its allocation keeps the pages `reserve` claimed -------------------
@pytest.mark.parametrize("kind", ["decode", "verify", "draft"])
def test_a_step_graph_replay_that_fails_before_it_ran_gives_back_its_claimed_pages(kind):
    """DecodeStepGraph.step (and VerifyStepGraph's, DraftStepGraph's) settles the step's room with
    `allocator.reserve(pages)`, which moves the rings' host heads (hwkv/step_graph.py:267), then stages and calls
    `adapter.pre_replay` and `adapter.replay` (step_graph.py:293-294) with no handler: when either raises before
    the replay's allocation ran (a vendor's host update failing, a device graph launch failing, Ctrl-C in the
    staging ring's wait) the claimed pages are never opened and never given back. The allocator then counts pages
    that are neither free nor held ("a page is lost") and every later step has that much less room: a step that
    never ran must leave the allocator, req_to_token and the frontiers as they were."""
    e = StepEngine(4)
    ad = HostUpdateFails()
    if kind == "decode":
        graph, n = DecodeStepGraph(e.backend, e.alloc, e.layers_fn, [4], SHAPES, ad, e.frontiers, W), 1
    elif kind == "verify":
        graph, n = VerifyStepGraph(e.backend, e.alloc, e.layers_fn, [4], SHAPES, 2, ad), 3
    else:
        graph, n = DraftStepGraph(e.backend, e.alloc, e.draft_fn, [4], SHAPES, 3, ad), 3
    graph.capture()
    rows = torch.tensor([e.rows[0], e.rows[4]], dtype=torch.int64)
    seq = e.seq[[0, 4]] + n  # request 4's step opens a page
    before, free = e.state(), e.alloc.available_size()
    ad.armed = True
    with pytest.raises(RuntimeError, match="host update failed"):
        graph.step(rows, seq, seq, _inputs(2 * n))
    assert e.alloc.available_size() == free, "the failed replay's claimed pages stay claimed"
    e.alloc.check_integrity()
    assert same_state(before, e.state())


@pytest.mark.parametrize("draft", [False, True])
def test_an_engine_step_whose_graph_replay_fails_before_it_ran_leaks_nothing(draft):
    """The engine's whole-step decode (and its verify graph) undo a failed replay with `ForwardSlots.undo(..., loc=None,
    head)` (hwkv/engine/forward.py:171-174), which gives pages back only when req_to_token shows the replay allocated
    them; a replay that raised before its allocation (the adapter's host update, a failed launch, Ctrl-C in the
    staging wait) leaves `reserve`'s claim in place and `undo` returns False: `check_integrity` then reports a lost
    page, and a long-running server loses pages at each such failure until admission stalls. Every decode step
    fails once here before it runs; the run must then hold nothing once it ends."""
    prompts = _prompts()
    if draft:
        prompts = [p + p[:9] for p in prompts]
    ad = HostUpdateFails()
    e, _ = _engine(graphs=ad, whole_step=True, draft=prompt_lookup() if draft else None)
    assert e.whole_step and (e.verify_graph is not None) == draft
    rids = [e.add_request(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    out, failures = {}, 0
    while e.has_work():
        if not e.scheduler.waiting and e.scheduler.running and all(r.decodes for r in e.scheduler.running):
            ad.armed = True
            try:
                out.update((r.rid, r.tokens) for r in e.step())
            except RuntimeError:
                failures += 1
            ad.armed = False
            e.check_integrity()
        out.update((r.rid, r.tokens) for r in e.step())
        e.check_integrity()
    assert failures and len(out) == len(rids)
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)


# ---- 2. an exception between the forward and its bookkeeping leaks the forward's pages -----------------------------
@pytest.mark.parametrize("where,prefix_cache", [("release", True), ("cache_prompts", True), ("release", False)])
def test_ctrl_c_between_a_forward_and_its_bookkeeping_leaks_no_pages(where, prefix_cache):
    """Engine._step undoes a forward only inside its try (hwkv/engine/engine.py:393-400); the prompt caching and the
    out-of-window release that follow (engine.py:401-405) run before `_send` moves the requests' lengths on. Ctrl-C
    (or an error) there leaves the forward's pages allocated and written into req_to_token while each request's
    kv_len stays where it was: the next step allocates the same positions again, and the first allocation's pages
    are held by nobody for good (check_integrity: "a leak"; held_slots non-zero after every request finished and
    the prefix cache was cleared). The step must be undone like a forward that raised, or completed."""
    e, _ = _engine(prefix_cache=prefix_cache)
    target = e._prefixing if where == "cache_prompts" else e.slots
    original = getattr(target, where)

    def interrupted(*args, **kwargs):
        setattr(target, where, original)
        raise KeyboardInterrupt()

    rids = [e.add_request(p, SamplingParams(max_new_tokens=10)) for p in _prompts()]
    setattr(target, where, interrupted)  # the first step (prompt chunks): interrupted after its forward
    with pytest.raises(KeyboardInterrupt):
        e.step()
    e.check_integrity()
    assert len(_drain(e, rids)) == len(rids)
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)


@pytest.mark.parametrize("graphs", [None, "whole-step"])
def test_ctrl_c_in_a_verify_steps_acceptance_keeps_greedy_tokens_and_leaks_nothing(graphs, monkeypatch):
    """Engine._verify leaves its try once the argmax is read (hwkv/engine/engine.py:535): `_accept` then appends the
    accepted tokens to each request's output (engine.py:573) before it frees the rejected drafts' slots
    (`accept_draft_tokens`, engine.py:584), releases, and moves kv_len and next_ids (engine.py:588). Ctrl-C in
    between (the acceptance and release run device ops and a host loop per row) leaves outputs that already hold the
    new tokens beside a kv_len, a next_ids and draft slots of the step before: the next step verifies from the old
    position and the request's tokens are no longer greedy decoding's (the engine's promise with a drafter), and the
    draft pages stay held by nobody. The step must be undone whole, or finished."""
    prompts = [p + p[:9] for p in _prompts()]
    kw = dict(graphs=EagerAdapter(), whole_step=True) if graphs else {}
    e, _ = _engine(draft=prompt_lookup(), **kw)
    want = _drain(e, [e.add_request(p, SamplingParams(max_new_tokens=10)) for p in prompts])
    import hwkv.engine.engine as engine_mod
    e, _ = _engine(draft=prompt_lookup(), **kw)
    original, fired = engine_mod.accept_draft_tokens, []

    def interrupted(*args, **kwargs):
        if len(fired) < 2:  # the first two verify steps
            fired.append(1)
            raise KeyboardInterrupt()
        return original(*args, **kwargs)

    monkeypatch.setattr(engine_mod, "accept_draft_tokens", interrupted)
    got, errors = _drain_interrupted(e, [e.add_request(p, SamplingParams(max_new_tokens=10)) for p in prompts])
    assert len(fired) == 2
    assert got == want, "tokens differ from greedy decoding after the interrupted verify"
    assert not errors, errors[0]
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)


# ---- 3. a failed capture under graphs="auto" leaves the runner's layers frozen --------------------------------------
def test_a_capture_that_failed_under_auto_does_not_freeze_the_runners_weights():
    """HybridRunner sets `table.frozen` (weights are graph addresses: a replaced sinks tensor is refused) from the
    adapter before the engine captures (hwkv/integrations/runner.py:102). Under graphs="auto" a capture that fails
    (fp32 grouped_mm MoE experts on CUDA: GPT-OSS) leaves decode eager and no graph at all, but `frozen` stays True:
    a weight sync by `load_state_dict(assign=True)` (an RL loop) is then refused with "while this runner holds
    graphs that read the old ones", where the same runner with graphs off serves the new weights."""
    pytest.importorskip("transformers", reason="hwkv's test extra")
    import hwkv.integrations.runner as runner_mod
    from hwkv.integrations.transformers import HybridRunner
    from test_review28_between_steps import KW, PROMPTS, _model

    class CaptureFails:  # a device adapter (not EagerAdapter) whose capture the model's code refuses
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

        def replay(self, graph):
            return graph()

        def pre_replay(self, graph):
            return None

    new = {k: v.clone() for k, v in _model("gpt_oss", seed=5).state_dict().items()}
    got = {}
    for graphs in ("off", "auto"):
        m = _model("gpt_oss")
        mp = pytest.MonkeyPatch()
        mp.setattr(runner_mod, "graph_adapter", lambda spec, choice: CaptureFails() if choice == "auto" else None)
        try:
            with HybridRunner(m, graphs=graphs, **KW) as r:
                assert r.graph is None and (r.stats.graph_error is not None) == (graphs == "auto")
                _drain(r, [r.add_request(p, SamplingParams(max_new_tokens=3)) for p in PROMPTS[:2]])
                m.load_state_dict({k: v.clone() for k, v in new.items()}, assign=True)
                got[graphs] = _drain(r, [r.add_request(p, SamplingParams(max_new_tokens=4)) for p in PROMPTS[:2]])
        finally:
            mp.undo()
    assert got["auto"] == got["off"]


# ---- 4. a GraphRunner whose capture stopped part way ------------------------------------------------------------
def _runner(fail_at=None):
    pool = MHATokenToKVPool(256, 1, torch.float32, 2, 8, 1, "cpu")
    rtt = hwkv.ReqToTokenPool(8, 32, "cpu")
    be = hwkv.make_backend(pool, rtt, device="cpu")
    state = {"fail": fail_at}

    def fn(batch, inputs):
        if state["fail"] == batch.batch_size:
            raise RuntimeError("the model failed")
        return inputs["x"] * 2

    runner = GraphRunner(be, fn, [1, 2, 4], {"x": ((1,), torch.float32)}, EagerAdapter())
    row = rtt.alloc(1)[0]
    rtt.req_to_token[row, :3] = torch.tensor([3, 4, 5])
    return runner, state, row


def _decode(row, bs):
    return ForwardBatch(ForwardMode.DECODE, bs, torch.tensor([row] * bs), torch.tensor([3] * bs),
                        torch.tensor([5] * bs), seq_lens_cpu=torch.tensor([3] * bs))


def test_a_graph_runner_whose_capture_stopped_part_way_refuses_an_uncaptured_bucket_with_a_typed_error():
    """GraphRunner.capture captures the largest bucket first; a model that raises at bucket 2 leaves bucket 4
    captured and 1, 2 not. `run` of a batch of 1 then copies the batch into the static buffers and refills the
    metadata (`prepare`) and only then fails with a bare `KeyError: 1` at `self.graphs[step.bucket]`
    (hwkv/graph.py:339). DecodeStepGraph refuses the same case with a ConfigError naming the bucket and the captured
    ones before anything is staged (tests/test_step_graph_refusals.py); GraphRunner should too (or run eagerly)."""
    runner, state, row = _runner(fail_at=2)
    with pytest.raises(RuntimeError, match="the model failed"):
        runner.capture()
    assert sorted(runner.graphs) == [4]
    staged = (runner.req_pool_indices.clone(), runner.seq_lens.clone(), runner.inputs["x"].clone())
    with pytest.raises(ConfigError, match="not captured"):
        runner.run(_decode(row, 1), {"x": torch.ones(1, 1)})
    assert all(torch.equal(a, b) for a, b in zip(staged, (runner.req_pool_indices, runner.seq_lens,
                                                          runner.inputs["x"])))


def test_a_failed_eager_fallback_is_not_counted_as_an_eager_run():
    """GraphRunner.replay counts `eager_runs += 1` before it calls the model for a batch past every bucket
    (hwkv/graph.py:337), so a fallback whose model raised is counted as run; `replays` (graph.py:342) and
    DecodeStepGraph's `eager_runs` (step_graph.py:352) count only steps that returned. The contract suite and the
    bench read these counters (hwkv/testing/contract.py:180): after a failed call they must be as before it."""
    runner, state, row = _runner()
    runner.capture()
    state["fail"] = 5
    with pytest.raises(RuntimeError, match="the model failed"):
        runner.run(_decode(row, 5), {"x": torch.ones(5, 1)})
    assert (runner.eager_runs, runner.replays) == (0, 0)


# ---- 5. a generate() that raised leaves its requests running, held by nobody ------------------------------------
@pytest.mark.parametrize("failure", ["on_step", "model"])
def test_a_generate_that_raised_leaves_no_request_running(failure):
    """Engine.generate queues every prompt, then steps until its own requests finished (hwkv/engine/engine.py:
    308-320) with no handler: when a step or `on_step` raises (the model's error, Ctrl-C), the requests it queued
    stay in the engine, running and holding rows and pages, though the caller never got their ids. The next
    generate() runs them beside its own prompts (their time, their slots) and returns while they still run
    (has_work() stays True, their pages stay held): a server that retries a failed generate pays for the old one
    for ever. generate should abort what it queued when it raises (as Engine.abort does between steps)."""
    e, model = _engine()
    calls = [0]

    def on_step(tokens):
        calls[0] += 1
        if failure == "on_step" and calls[0] == 3:
            raise RuntimeError("the callback failed")

    if failure == "model":
        model.exc = RuntimeError("the model failed")  # the first step's forward
    with pytest.raises(RuntimeError, match="failed"):
        e.generate(_prompts(), SamplingParams(max_new_tokens=10), on_step=on_step)
    e.check_integrity()
    res = e.generate([_prompts()[0]], SamplingParams(max_new_tokens=3))
    assert len(res) == 1 and len(res[0].tokens) == 3
    assert not e.has_work() and not e.requests, "requests of the failed generate() still run"
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)


# ---- pinned: what was verified to hold -------------------------------------------------------------------------
class _CaptureFailsOnce:
    """The model, raising on its `nth` call while armed (during the engine's captures), then the model itself."""

    def __init__(self, model, nth):
        self.model, self.nth, self.calls, self.armed = model, nth, 0, True

    def __call__(self, batch, ids, pos, keep):
        if self.armed:
            self.calls += 1
            if self.calls == self.nth:
                raise RuntimeError("not capturable")
        return self.model(batch, ids, pos, keep)


def _auto_engine(nth=None, draft=None, choice="auto"):
    plan = plan_pools(SHAPE, context=96, max_running=4, chunk=24, page_size=4, memory=None, device=CPU,
                      prefix_cache=True)
    cache = build_cache(SHAPE, plan, torch.float32, CPU, backend_device="cpu")
    model = SyntheticModel(SHAPE, cache.backend, vocab_size=VOCAB, dtype=torch.float32, device=CPU,
                           positions=cache.rtt.max_context_len, seed=3)
    if nth is not None:
        model = _CaptureFailsOnce(model, nth)
    e = Engine(cache, model, stats=RunnerStats(SHAPE, plan), vocab_size=VOCAB, window=SHAPE.window, overlap=False,
               graph_adapter=EagerAdapter() if choice != "off" else None, graph_choice=choice, draft=draft)
    if nth is not None:
        model.armed = False
    return e


@pytest.mark.parametrize("draft", [False, True])
def test_pinned_a_capture_failing_at_any_bucket_under_auto_falls_back_to_exact_eager_decode(draft):
    """Under graphs="auto" a capture failing at the warm-up or the capture of any bucket (whole-step decode graph,
    then the verify graph) leaves decode eager with the reason in stats.graph_error, the padding row kept, and the
    run gives the tokens of an engine with graphs off, leaking nothing."""
    prompts = _prompts()
    if draft:
        prompts = [p + p[:9] for p in prompts]
    mk = (lambda: prompt_lookup()) if draft else (lambda: None)

    def run(e):
        rids = [e.add_request(p, SamplingParams(max_new_tokens=10)) for p in prompts]
        got = _drain(e, rids)
        e.clear_prefix_cache()
        assert e.cache.held_slots() == (0, 0)
        return got

    want = run(_auto_engine(draft=mk(), choice="off"))
    for nth in (1, 2, 4, 6) + ((7, 12) if draft else ()):
        e = _auto_engine(nth, draft=mk())
        assert e.graph is None and e.verify_graph is None and not e.whole_step
        assert "decode graph capture failed: RuntimeError: not capturable" in e.stats.graph_error
        assert run(e) == want


def test_pinned_a_drafter_that_raises_leaves_the_engine_able_to_go_on():
    """A drafter raising inside a verify step (before anything was allocated for the drafts): the step raises, the
    pools are consistent, and the run then gives the tokens of a run whose drafter never failed."""
    prompts = [p + p[:9] for p in _prompts()]
    want = _drain(*(lambda e: (e, [e.add_request(p, SamplingParams(max_new_tokens=10)) for p in prompts]))(
        _engine(draft=prompt_lookup())[0]))
    inner, calls = prompt_lookup(), [0]

    def flaky(history, k):
        calls[0] += 1
        if calls[0] in (3, 8):
            raise RuntimeError("the drafter failed")
        return inner(history, k)

    e, _ = _engine(draft=flaky)
    rids = [e.add_request(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    out, failures = {}, 0
    while e.has_work():
        try:
            out.update((r.rid, r.tokens) for r in e.step())
        except RuntimeError:
            failures += 1
        e.check_integrity()
    assert failures == 2 and [out[r] for r in rids] == want


@pytest.mark.parametrize("compiled", [False, True])
def test_pinned_a_capture_retried_after_it_failed_part_way_replays_correctly(compiled):
    """A GraphRunner capture that failed at bucket 2 (bucket 4 captured), retried once the model works: every bucket
    replays the model's output over the batch's inputs (EagerAdapter, and torch.compile's adapter)."""
    from hwkv_cpu.graph import CompileGraphAdapter

    runner, state, row = _runner(fail_at=2)
    if compiled:
        runner.adapter = CompileGraphAdapter("eager")
    with pytest.raises(RuntimeError, match="the model failed"):
        runner.capture()
    state["fail"] = None
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4]
    for bs in (1, 2, 3, 4):
        x = torch.arange(bs, dtype=torch.float32).view(bs, 1) + 1
        assert torch.equal(runner.run(_decode(row, bs), {"x": x}), x * 2)


def test_pinned_cancel_reserve_gives_back_a_claim_that_never_ran_and_keeps_one_that_did():
    """`Allocator.cancel_reserve`: a claim whose allocation never ran goes back whole (both rings' free counts and
    the integrity snapshot as before the reserve); one whose allocation ran is left to the caller (nothing moves)."""
    from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
    from hwkv.torch_page_ops import TORCH_OPS
    from test_captured_op_order import T, _scene

    a = SWATokenToKVPoolAllocator(64, 64, 4, "cpu", None)
    a._ops = a.swa_attn_allocator._ops = TORCH_OPS
    rtt = _scene(a)
    before, free = a.integrity_snapshot(), a.available_size()
    a.reserve(2)
    assert a.available_size() == free - 2 * 4
    assert a.cancel_reserve(2)
    assert a.available_size() == free and same_snapshot(before, a.integrity_snapshot())
    a.check_integrity()
    heads = a.reserve(1)
    a.alloc_reserved(T([10]), T([13]), rtt[0, 9:10].clone(), torch.zeros(3, dtype=torch.int64), heads, 1)
    after = a.integrity_snapshot()
    assert not a.cancel_reserve(1)
    assert same_snapshot(after, a.integrity_snapshot())
    a.check_integrity()
    assert not a.cancel_reserve(0)


def test_pinned_interrupts_held_raises_a_ctrl_c_once_the_block_is_over(python_sigint):
    """`interrupts_held`: a SIGINT inside the block is raised after it (the block ran to its end); the block's own
    error wins over a held Ctrl-C; the default handler is back after either; off the main thread it holds nothing."""
    import os
    import signal
    import threading

    from hwkv.engine.engine import interrupts_held

    ran = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            ran.append("after the signal")
    assert ran == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(ValueError, match="its own"):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            raise ValueError("its own")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    seen = []

    def off_main():
        with interrupts_held() as held:
            seen.append(held.held)

    t = threading.Thread(target=off_main)
    t.start()
    t.join()
    assert seen == [False]
