"""Review 31 (sliding windows across the engine's paths, and the prefix cache with windows).

The failing tests are defects; the `test_pinned_*` tests at the end pin behaviour verified while reviewing. Every run
is the engine over `hwkv.engine.synthetic.SyntheticModel` on the CPU, most with `ReferenceCheck` on every forward
(every query of every request recomputed densely by `hwkv.reference` from its token ids), `check_integrity()` after
every step and, once every request finished and the prefix cache was cleared, no slot held.

What held under review (a random search of ~3,500 runs with the reference check on every forward: W 1..16 and
W > context, page sizes 1/2/4/8/16, chunks 1..24, prefix cache on/off with tight pools (full and SWA evictions,
tombstones, matches cut back), whole_step and the layers' graph runner, overlap, speculative verify with drafts
rejected near the window edge, aborts mid-prefill, stop tokens, an engine window wider than the model's, the
Triton page ops with deferred checks releasing inside the whole-step allocation): attention stayed exact and
nothing leaked. The defects found are on the exception paths the engine promises to survive ("a forward that ran
keeps its lengths even when its prompt caching or release raises (the next step's catch up)"; "A step that raises
(the model, a vendor's host update, Ctrl-C) leaves the engine able to go on", docs/architecture.md).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import pytest
import torch

import hwkv.engine.forward as forward_mod
from hwkv.engine.engine import Engine
from hwkv.engine.pools import build_cache, plan_pools
from hwkv.engine.presets import ModelShape, layer_pattern
from hwkv.engine.sampling import SamplingParams
from hwkv.engine.stats import RunnerStats
from hwkv.engine.synthetic import ReferenceCheck, SyntheticModel, engine_history
from hwkv.graph import EagerAdapter
from test_engine_defects import _run as _run_checked
from test_review30_exceptions import _drain_interrupted, _interrupt_first_call

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module

VOCAB = 97
CPU = torch.device("cpu")


def _shape(window: int) -> ModelShape:
    # SWA and full layers alternating, sinks on the SWA layers, a soft-cap, GQA
    return ModelShape(name="tiny", layer_is_swa=layer_pattern(4, "sf"), window=window, num_heads=4, num_kv_heads=2,
                      head_dim=16, swa_sinks=True, logit_cap=30.0, dtype_bytes=4)


def _engine(window: int = 8, page_size: int = 4, prefix_cache: bool = True, chunk: int = 24, max_running: int = 4,
            context: int = 96, whole_step: Optional[bool] = None, graphs: bool = False, draft=None, num_draft: int = 4,
            overlap: bool = False, check: bool = True, full_pages: Optional[int] = None,
            engine_window: Optional[int] = None) -> Engine:
    shape = _shape(window)  # (the engine keeps `engine_window` where given, the model's `window` otherwise)
    plan = plan_pools(shape, context=context, max_running=max_running, chunk=chunk, page_size=page_size, memory=None,
                      device=CPU, prefix_cache=prefix_cache)
    if full_pages is not None:  # a full pool of that many pages (memory pressure)
        plan = dataclasses.replace(plan, size=full_pages * page_size)
    cache = build_cache(shape, plan, torch.float32, CPU, backend_device="cpu")
    model = SyntheticModel(shape, cache.backend, vocab_size=VOCAB, dtype=torch.float32, device=CPU,
                           positions=cache.rtt.max_context_len, seed=3)
    e = Engine(cache, model, stats=RunnerStats(shape, plan), vocab_size=VOCAB, window=engine_window or window,
               prefix_cache=prefix_cache, overlap=overlap, graph_adapter=EagerAdapter() if graphs else None,
               graph_choice="eager" if graphs else "off", whole_step=whole_step, draft=draft, num_draft=num_draft)
    if check:  # every query of every request of every forward against the dense reference
        model.check = ReferenceCheck(model, engine_history(e), every=1, requests=8, queries=96)
    return e


def _prompts(n: int = 3, system: int = 13, user: int = 7, step: int = 5, seed: int = 0) -> List[List[int]]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    head = torch.randint(0, VOCAB, (system,), generator=g).tolist()
    return [head + torch.randint(0, VOCAB, (user + step * i,), generator=g).tolist() for i in range(n)]


def _run(e: Engine, prompts: Sequence[Sequence[int]], new: int = 10) -> List[List[int]]:
    """Every prompt to the end, integrity checked after every step; the pools hold nothing once the cache is
    cleared."""
    return _run_checked(e, None, prompts, new=new)


# ---- 1. Ctrl-C inside the out-of-window release: the host's frontiers say released, the pages say not ------------
def test_ctrl_c_inside_the_out_of_window_release_leaves_no_swa_page_behind(monkeypatch):
    """`ForwardSlots.release` (hwkv/engine/forward.py:266) first moves the host's copy of the rows' frontiers
    (`move_frontiers`, forward.py:285) and only then runs the device release (`release_out_of_window_batch`,
    forward.py:271) and moves the device frontiers (forward.py:272). A Ctrl-C (or any error) landing inside that
    release, after the forward ran, leaves `frontiers_cpu` past SWA pages the request still holds: the next step's
    `move_frontiers` sees nothing new to release (no catch-up while the frontier stays on the same page), and
    - `check_integrity` reports a leak at once (its holders are counted from the host frontier);
    - the request's finish hands its K/V to the prefix cache with that host frontier
      (`EnginePrefix.release`, prefixing.py:147), which frees [0, frontier) full-only while the request still holds
      their SWA pages: the allocator refuses it (LocError "would keep fewer full holders than its SWA slots ...")
      and the request never leaves.
    Expected (the engine's contract for an interrupted release): the run goes on to the uninterrupted run's tokens,
    every step's integrity holds and nothing stays held. Page 16, W 8, a 40-token prompt and 3 new tokens: the
    prompt's release moves the frontier to 16 and no later step of the request moves it again."""
    prompt = _prompts(n=1, system=13, user=27)[0]
    want = _run(_engine(page_size=16, chunk=48), [prompt], new=3)
    e = _engine(page_size=16, chunk=48)
    fired = _interrupt_first_call(monkeypatch, forward_mod, "release_out_of_window_batch")
    rid = e.add_request(prompt, SamplingParams(max_new_tokens=3))
    got, errors = _drain_interrupted(e, [rid], limit=4, max_steps=200)
    assert fired, "the release was never reached"
    assert not errors, "\n".join(errors)
    assert got == want
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)


# ---- 2. Ctrl-C while a finished request hands its K/V to the prefix cache: the request never leaves -------------
def test_ctrl_c_while_a_finished_request_goes_to_the_prefix_cache_does_not_strand_it(monkeypatch):
    """`Engine._read_one` appends each read token (`req.add_token`, hwkv/engine/engine.py:494: `finish_reason` is set
    there) and then leaves `_finish` (engine.py:497) to hand the finished requests' K/V to the prefix cache
    (`EnginePrefix.release` -> `HybridPrefixCache.release_requests`, engine.py:509), free their rows and take them
    off the scheduler (engine.py:510-513). A Ctrl-C in that hand-over (here: as it starts, before the cache changed
    anything) leaves a request that is finished (`finish_reason` "length") but still in `scheduler.running`, with
    its row, reservation, lock and pages: it never decodes again and nothing ever calls `_finish` for it, so its
    Result never comes, `has_work()` stays True for ever and `generate()` would loop for ever.
    Expected: the engine goes on and the request's Result (the uninterrupted run's tokens) comes with a later step,
    nothing leaked."""
    prompts = _prompts()
    want = _run(_engine(), prompts, new=6)
    e = _engine()
    fired = _interrupt_first_call(monkeypatch, e.prefix, "release_requests")
    rids = [e.add_request(p, SamplingParams(max_new_tokens=6)) for p in prompts]
    got, errors = _drain_interrupted(e, rids, limit=4, max_steps=200)
    assert fired
    assert not errors, "\n".join(errors)
    assert got == want
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)


# ---- pinned: behaviour verified while reviewing ---------------------------------------------------------------------
# (window, page size, chunk): W = 1; W equal to the page; W not a multiple of it; a chunk ending at / inside the
# window edge; page 1 and 16
EDGES = [(1, 1, 7), (1, 4, 5), (4, 4, 4), (5, 4, 3), (3, 16, 5), (9, 4, 7), (16, 16, 24)]


@pytest.mark.parametrize("window,page_size,chunk", EDGES)
def test_pinned_window_edges_are_exact_on_every_path(window, page_size, chunk):
    """Two rounds of prompts sharing a system prompt (the second from the prefix cache), every forward's attention
    equal to the dense reference on every path: the plain step, the whole-step graph (EagerAdapter), the layers' graph
    runner, overlap; all give the tokens of the run without the prefix cache."""
    prompts = _prompts(n=3)
    again = prompts[::-1] + [prompts[0][:17] + [1, 2, 3]]
    base = _engine(window, page_size, prefix_cache=False, chunk=chunk)
    want = (_run(base, prompts, new=12), _run(base, again, new=12))
    for kw in (dict(), dict(graphs=True, whole_step=True), dict(graphs=True, whole_step=False), dict(overlap=True)):
        e = _engine(window, page_size, chunk=chunk, **kw)
        assert (_run(e, prompts, new=12), _run(e, again, new=12)) == want, kw


class _Oracle:
    """Drafts from known continuations, one of every other proposal corrupted (a rejection inside the drafts), else
    random tokens (rejected at once)."""

    def __init__(self, known: Sequence[Sequence[int]]) -> None:
        self.known, self.calls = [list(k) for k in known], 0

    def __call__(self, history, k):
        self.calls += 1
        h = list(history)
        for seq in self.known:
            if len(seq) > len(h) and seq[:len(h)] == h:
                d = seq[len(h):len(h) + k]
                if d and self.calls % 2:
                    i = self.calls % len(d)
                    d[i] = (d[i] + 1) % VOCAB
                return d
        return [(self.calls * 31 + i) % VOCAB for i in range(k)]


@pytest.mark.parametrize("window,page_size,whole_step", [(1, 1, False), (4, 4, True), (5, 4, False), (3, 16, True)])
def test_pinned_speculative_verify_rejected_near_the_window_edge_keeps_greedy_tokens(window, page_size, whole_step):
    """A verify whose drafts are partly rejected (kept drafts ending on either side of a page and of the window
    edge) keeps greedy decoding's tokens, attention exact in every verify, nothing leaked."""
    prompts = _prompts(n=3, user=9)
    want = _run(_engine(window, page_size, prefix_cache=False, chunk=16), prompts, new=14)
    drafter = _Oracle([p + w for p, w in zip(prompts, want)])
    kw = dict(graphs=True, whole_step=True) if whole_step else {}
    e = _engine(window, page_size, chunk=16, draft=drafter, num_draft=3, **kw)
    assert _run(e, prompts, new=14) == want
    assert e.stats.draft_tokens > e.stats.accepted_tokens > 0


@pytest.mark.parametrize("window,page_size", [(8, 4), (4, 4), (5, 1), (3, 16)])
def test_pinned_prefix_hits_over_released_windows_and_aborted_prefills_are_exact(window, page_size):
    """A finished history whose early SWA slid out of the window is cached as tombstones: a next turn continuing it
    (and one cut inside it) starts from the longest prefix whose last window is still cached, or recomputes; a prompt
    aborted mid-prefill leaves its prefilled pages to the cache and the same prompt then starts from them. Attention
    stays exact, the tokens are the cache-off run's, nothing leaks."""
    first = _prompts(n=1, system=5, user=3)[0]

    def script(e: Engine) -> List[List[int]]:
        history = first + _run_keep(e, [first], new=30)[0]
        turns = [history + [5, 6, 7], history[:21] + [9, 9], history[:33]]
        out = _run_keep(e, turns, new=6)
        long = [(7 * i + 3) % VOCAB for i in range(80)]  # shares nothing cached
        rid = e.add_request(long, SamplingParams(max_new_tokens=4))
        e.step()
        e.step()                                 # two chunks of 24 prefilled
        assert e.requests[rid].prefilling
        assert e.abort(rid).finish_reason == "abort"
        e.check_integrity()
        out += _run_keep(e, [long], new=4)
        e.clear_prefix_cache()
        assert e.cache.held_slots() == (0, 0)
        return out

    want = script(_engine(window, page_size, prefix_cache=False, max_running=2))
    e = _engine(window, page_size, max_running=2)
    assert script(e) == want
    assert e.stats.reused_tokens > 0


def _run_keep(e: Engine, prompts: Sequence[Sequence[int]], new: int) -> List[List[int]]:
    """`_run` without clearing the cache at the end."""
    out: Dict[int, List[int]] = {}
    rids = [e.add_request(list(p), SamplingParams(max_new_tokens=new)) for p in prompts]
    while e.has_work():
        for r in e.step():
            out[r.rid] = r.tokens
        e.check_integrity()
    return [out[r] for r in rids]
