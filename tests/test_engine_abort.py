"""`Engine.abort`: a queued request leaves the queue, a prefilling or decoding one leaves as a finished one does
(its slots back once, its KV to the prefix cache where there is one), a token a forward in flight sampled for it is
dropped; the other requests' tokens are those of a run that never had it, and nothing leaks.

Over `hwkv.engine.synthetic.SyntheticModel` (no weights: fast), as tests/test_engine_defects.py builds it.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from hwkv.engine.engine import Engine
from hwkv.engine.pools import build_cache, plan_pools
from hwkv.engine.sampling import SamplingParams
from hwkv.engine.stats import RunnerStats
from hwkv.engine.synthetic import SyntheticModel
from hwkv.errors import ConfigError
from hwkv.graph import EagerAdapter

from test_engine_defects import CPU, FULL, SHAPE, VOCAB  # noqa: E402  the tiny engine shapes those tests use
NEW = 8

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module


def _engine(shape=SHAPE, prefix_cache=True, overlap=False, graphs=None, whole_step=None, max_running=3):
    plan = plan_pools(shape, context=96, max_running=max_running, chunk=24, page_size=4, memory=None, device=CPU,
                      prefix_cache=prefix_cache)
    cache = build_cache(shape, plan, torch.float32, CPU, backend_device="cpu")
    model = SyntheticModel(shape, cache.backend, vocab_size=VOCAB, dtype=torch.float32, device=CPU,
                           positions=cache.rtt.max_context_len, seed=3)
    return Engine(cache, model, stats=RunnerStats(shape, plan), vocab_size=VOCAB,
                  window=shape.window if any(shape.layer_is_swa) else None, prefix_cache=prefix_cache,
                  overlap=overlap, graph_adapter=graphs, graph_choice="eager" if graphs is not None else "off",
                  whole_step=whole_step)


def _prompts(seed=0):
    """Four prompts behind one system prompt; the first is long (its prefill takes three chunks of 24)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    head = torch.randint(0, VOCAB, (13,), generator=g).tolist()
    return [head + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (45, 7, 12, 17)]


def _all_free(e: Engine) -> None:
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)
    assert e.cache.rtt.available_size() == e.cache.rtt.size - 1  # every row but the padding row
    assert not e.requests and not e.scheduler.running and not e.scheduler.waiting


def _run(e: Engine, prompts) -> List[List[int]]:
    rids = [e.add_request(p, SamplingParams(max_new_tokens=NEW)) for p in prompts]
    out: Dict[int, List[int]] = {}
    while e.has_work():
        out.update((r.rid, r.tokens) for r in e.step())
        e.check_integrity()
    _all_free(e)
    return [out[r] for r in rids]


# where the aborted request stands when it is aborted (between steps)
PHASES = {
    "queued": lambda req: req.row < 0,
    "prefilling": lambda req: req.row >= 0 and 0 < req.kv_len < len(req.prompt),
    "decoding": lambda req: len(req.output) >= 2,
}
CASES = {f"{phase}-{name}": (phase, kw) for phase in PHASES for name, kw in {
    "eager": dict(),
    "no-cache": dict(prefix_cache=False),
    "overlap": dict(overlap=True),
    "overlap-no-cache": dict(overlap=True, prefix_cache=False),
}.items()}
CASES["decoding-whole-step"] = ("decoding", dict(graphs=EagerAdapter(), whole_step=True, overlap=True))
CASES["decoding-whole-step-no-overlap"] = ("decoding", dict(graphs=EagerAdapter(), whole_step=True))
CASES["decoding-full-attention"] = ("decoding", dict(shape=FULL, prefix_cache=False, overlap=True))


@pytest.mark.parametrize("case", list(CASES))
def test_an_aborted_request_leaves_and_the_others_run_as_if_it_never_came(case):
    phase, kw = CASES[case]
    prompts = _prompts()
    # queued: the long prompt comes last and waits behind max_running=3; else it comes first
    target = 3 if phase == "queued" else 0
    full = _run(_engine(**kw), prompts)
    others = [p for i, p in enumerate(prompts) if i != target]
    want = _run(_engine(**kw), others)

    e = _engine(**kw)
    rids = [e.add_request(p, SamplingParams(max_new_tokens=NEW)) for p in prompts]
    req, out, aborted, steps = e.requests[rids[target]], {}, None, 0
    while e.has_work():
        if aborted is None and steps and PHASES[phase](req):
            inflight = req.pending
            if phase == "decoding" and e.overlap:
                assert inflight, "a forward in flight samples for it: the drop path is what this case tests"
            aborted = e.abort(rids[target])
            e.check_integrity()
            assert aborted.finish_reason == "abort" and aborted.rid == rids[target]
            assert aborted.tokens == full[target][:len(aborted.tokens)]  # the output so far
            assert (len(aborted.tokens) >= 2) == (phase == "decoding")
            assert rids[target] not in e.requests and req not in e.scheduler.running
            assert req not in e.scheduler.waiting
            assert e.abort(rids[target]) is None  # gone: a second abort changes nothing
            kept = list(req.output)
        out.update((r.rid, r.tokens) for r in e.step())
        steps += 1
        e.check_integrity()
    assert aborted is not None, f"the request never reached {phase}"
    assert req.output == kept, "a token sampled after the abort was appended"
    assert req.pending == 0  # its in-flight tokens were read and dropped
    assert rids[target] not in out
    assert [out[r] for i, r in enumerate(rids) if i != target] == want
    _all_free(e)


def test_a_finished_request_aborts_to_none_and_an_unknown_id_is_refused_with_nothing_changed():
    e = _engine(overlap=True)
    with pytest.raises(ConfigError, match=r"abort: int 0 is not a request id of this engine \(it has given none yet\)"):
        e.abort(0)
    prompts = _prompts()
    rids = [e.add_request(p, SamplingParams(max_new_tokens=2)) for p in prompts[1:]]
    done = []
    while not done:
        done = e.step()
    assert e.abort(done[0].rid) is None
    e.check_integrity()
    before = (e.cache.held_slots(), e.cache.rtt.available_size(), list(e.requests), list(e.scheduler.waiting),
              list(e.scheduler.running), [(r.kv_len, r.pending, list(r.output)) for r in e.scheduler.running])
    for bad in (len(rids), -1, 10 ** 6, "0", 1.0, True, None):
        with pytest.raises(ConfigError, match=rf"not a request id of this engine \(ids run from 0 to {len(rids) - 1}\)"):
            e.abort(bad)
    after = (e.cache.held_slots(), e.cache.rtt.available_size(), list(e.requests), list(e.scheduler.waiting),
             list(e.scheduler.running), [(r.kv_len, r.pending, list(r.output)) for r in e.scheduler.running])
    assert after == before
    e.check_integrity()
    while e.has_work():
        e.step()
        e.check_integrity()
    _all_free(e)


def test_abort_inside_a_step_is_refused():
    """The model (or a drafter) calling abort mid-step: ConfigError, the step gives back what it took and runs."""
    e = _engine()
    model, calls = e.model_step, []

    def aborting(batch, ids, pos, keep):
        if not calls:
            calls.append(1)
            e.abort(0)
        return model(batch, ids, pos, keep)

    e.model_step = aborting
    rid = e.add_request(_prompts()[1], SamplingParams(max_new_tokens=3))
    with pytest.raises(ConfigError, match="inside a step"):
        e.step()
    e.check_integrity()
    assert rid in e.requests
    out = []
    while e.has_work():
        out += e.step()
        e.check_integrity()
    assert [r.rid for r in out] == [rid] and out[0].finish_reason == "length"
    _all_free(e)
