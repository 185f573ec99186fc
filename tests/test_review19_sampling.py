"""Review 19, the engine's sampling, scheduling and statistics: the counters `generate` reports equal the tokens
its results hold (overlap included), sampling values past float32 and torch bools are typed refusals, a refused
Engine constructor leaves its cache as it was, and the sampling constants live per request row on the device.

Over `hwkv.engine.synthetic.SyntheticModel` (no weights) on the CPU, as tests/test_engine_defects.py builds it.
"""
from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction
from typing import Dict, List

import numpy as np
import pytest
import torch

from hwkv.checks import as_int
from hwkv.engine.drafters import prompt_lookup
from hwkv.engine.engine import Engine
from hwkv.engine.inputs import prompt_ids
from hwkv.engine.sampling import SamplingParams, sample
from hwkv.engine.stats import RunnerStats
from hwkv.errors import ConfigError
from hwkv.graph import EagerAdapter

from test_engine_defects import VOCAB, _engine, _prompts, _unchanged  # noqa: E402  the tiny engine those tests use
from test_engine_defects2 import _cache  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module

F32_MAX = float(torch.finfo(torch.float32).max)


# ---- 1. the counters `generate` reports -----------------------------------------------------------------------
def _stops(prompts: List[List[int]]) -> List[int]:
    """A stop token per prompt that its greedy run first samples at output index >= 2."""
    ref = [r.tokens for r in _engine()[0].generate(prompts, SamplingParams(max_new_tokens=8))]
    return [next(t for i, t in enumerate(r) if i >= 2 and t not in r[:i]) for r in ref]


@pytest.mark.parametrize("kw", [dict(overlap=True), dict(overlap=True, prefix_cache=False),
                                dict(overlap=True, graphs=EagerAdapter(), whole_step=True), dict(overlap=False)],
                         ids=["overlap", "overlap-no-cache", "overlap-whole-step", "no-overlap"])
def test_generates_counters_equal_the_tokens_of_its_results_when_the_last_request_stops(kw):
    """Every request ends on a stop token, the last one too: with overlap the forward issued after its last
    read-back sampled one more token for it. The counters (and `on_step`'s counts) hold exactly the results'
    tokens, decode forwards count what they do without overlap, and nothing is left in flight."""
    prompts = _prompts(2)
    params = [SamplingParams(max_new_tokens=8, stop_token_ids=[s]) for s in _stops(prompts)]
    plain, _ = _engine(overlap=False)
    plain.generate(prompts, params)
    e, _ = _engine(**kw)
    counts: List[int] = []
    res = e.generate(prompts, params, on_step=counts.append)
    got = sum(len(r.tokens) for r in res)
    assert [r.finish_reason for r in res] == ["stop", "stop"]
    s = e.stats
    assert (s.generated_tokens, sum(counts), s.decode_tokens) == (got, got, plain.stats.decode_tokens)
    assert min(counts) >= 0 and s.tokens_per_second == got / s.seconds
    assert s.as_dict()["generated_tokens"] == got
    assert not e.has_work() and not e.readback.inflight
    e.check_integrity()


def test_a_request_queued_beside_generate_keeps_its_tokens_and_the_counters_stay_exact():
    """A request added with `add_request` still runs when generate's last request stops (overlap): generate's
    end reads what is in flight without losing that request's tokens, which come with later steps."""
    prompts = _prompts(3)
    e, _ = _engine(overlap=True)
    rid = e.add_request(prompts[2], SamplingParams(max_new_tokens=20))
    res = e.generate(prompts[:2], [SamplingParams(max_new_tokens=8, stop_token_ids=[s]) for s in _stops(prompts[:2])])
    so_far = len(e.unclaimed[rid].tokens) if rid in e.unclaimed else len(e.requests[rid].output)
    assert e.stats.generated_tokens == sum(len(r.tokens) for r in res) + so_far
    out = {}
    while e.has_work():
        out.update((r.rid, r) for r in e.step())
    other = out[rid] if rid in out else e.unclaimed[rid]
    assert len(other.tokens) == 20
    assert e.stats.generated_tokens == sum(len(r.tokens) for r in res) + 20
    e.check_integrity()


# ---- 2. values past float32 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field, limit", [
    (dict(temperature=1e39), "temperature", repr(F32_MAX)), (dict(temperature=1e300), "temperature", repr(F32_MAX)),
    (dict(temperature=10**400), "temperature", repr(F32_MAX)),
    (dict(temperature=Fraction(10**400)), "temperature", repr(F32_MAX)),
    (dict(temperature=np.float64(1e39)), "temperature", repr(F32_MAX)),
    (dict(top_p=10**400), "top_p", "(0, 1]"), (dict(top_p=-10**400), "top_p", "(0, 1]"),
])
def test_a_value_past_float32_is_a_config_error_naming_it_and_the_limit(kwargs, field, limit):
    """The sampler reads temperature and top_p as float32: 1e39 is inf there (a masked token's -inf logit over it
    is NaN, and every draw was token 0); 10**400 was a bare OverflowError."""
    with pytest.raises(ConfigError) as err:
        SamplingParams(**kwargs)
    msg = str(err.value)
    assert msg.startswith(field) and limit in msg and repr(next(iter(kwargs.values())))[:40] in msg, msg


def test_the_largest_float32_temperature_is_accepted_and_never_draws_a_masked_token():
    n = 1000
    p = SamplingParams(temperature=F32_MAX, seed=7)
    assert p.temperature == F32_MAX and not math.isinf(np.float32(p.temperature))
    logits = torch.tensor([-math.inf, 0.0, 5.0, 1.0]).expand(n, 4)
    tok = sample(logits, torch.full((n,), p.temperature), torch.ones(n), torch.full((n,), 7),
                 torch.arange(n), True)
    counts = torch.bincount(tok, minlength=4).tolist()
    assert counts[0] == 0 and min(counts[1:]) > 250, counts


# ---- 6. torch bools are no integers --------------------------------------------------------------------------
T = torch.tensor(True)


@pytest.mark.parametrize("make, message", [
    (lambda: SamplingParams(max_new_tokens=T), "max_new_tokens"),
    (lambda: SamplingParams(seed=T), "seed"),
    (lambda: SamplingParams(stop_token_ids=torch.tensor([True, False])), "stop_token_ids"),
    (lambda: SamplingParams(stop_token_ids=[T]), "stop_token_ids"),
    (lambda: prompt_ids([T, 5]), r"prompt token id tensor\(True\) \(Tensor, at index 0\) is not an integer"),
    (lambda: prompt_ids([5, torch.tensor([False])]), r"prompt token id tensor\(\[False\]\)"),
])
def test_a_torch_bool_is_refused_where_python_and_numpy_bools_are(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_as_int_refuses_bools_of_every_kind_and_keeps_integers():
    for b in (True, np.True_, torch.tensor(True), torch.tensor([False])):
        assert as_int(b) is None, b
    for i, want in ((3, 3), (np.int64(3), 3), (torch.tensor(3), 3), (torch.tensor([4], dtype=torch.int32), 4),
                    (np.uint8(5), 5)):
        assert as_int(i) == want
    assert SamplingParams(max_new_tokens=torch.tensor(3), seed=torch.tensor(2),
                          stop_token_ids=torch.tensor([1, 0])) == SamplingParams(3, seed=2, stop_token_ids=(1, 0))
    assert prompt_ids([torch.tensor(3), np.int64(4), 5]) == [3, 4, 5]


def test_an_engine_refuses_a_prompt_holding_a_torch_bool_and_queues_nothing():
    e, _ = _engine()
    with pytest.raises(ConfigError, match="is not an integer"):
        e.add_request([T, 5])
    assert not e.requests and not e.scheduler.waiting


# ---- 3-5. a refused Engine constructor leaves its cache as it was -------------------------------------------------
def _cache_snapshot(cache):
    """`test_engine_defects._snapshot`'s parts that belong to the cache (allocator, req_to_token, free rows)."""
    return (cache.allocator.integrity_snapshot(), cache.rtt.req_to_token.clone(), list(cache.rtt._free),
            cache.rtt.available_size())


class _RefusesCapture:
    """The model, raising while armed (a model whose code cannot be captured)."""

    def __init__(self, model) -> None:
        self.model, self.armed = model, True

    def __call__(self, *a):
        if self.armed:
            raise RuntimeError("not capturable")
        return self.model(*a)


class _RecordingAdapter(EagerAdapter):
    """A graph adapter that records device work (a whole-step graph needs the device's page-op kernels then)."""

    calls_step = False
    records_device_work = True


REFUSED = {
    "num_draft-str": (dict(num_draft="4"), "num_draft='4' must be an integer >= 1 and < 2\\*\\*63"),
    "num_draft-None": (dict(num_draft=None), "num_draft=None"),
    "num_draft-2**63": (dict(num_draft=2**63), "num_draft=9223372036854775808 must be .*< 2\\*\\*63"),
    "num_draft-0": (dict(num_draft=0), "num_draft=0"),
    "num_draft-float": (dict(num_draft=4.0), "num_draft=4.0"),
    "num_draft-True-draft": (dict(num_draft=True, draft=prompt_lookup()),
                             "speculative verify needs num_draft to be an integer >= 1.*got num_draft=True"),
    "num_draft-2**63-draft": (dict(num_draft=2**63, draft=prompt_lookup()), "num_draft=9223372036854775808"),
    "num_draft-torch-bool": (dict(num_draft=T, draft=prompt_lookup()), "num_draft=tensor\\(True\\)"),
    "draft-not-callable": (dict(draft=3), "draft=3"),
    "vocab_size-None": (dict(vocab_size=None), "vocab_size=None.*an integer >= 1"),
    "vocab_size-float": (dict(vocab_size=97.9), "vocab_size=97.9"),
    "vocab_size-True": (dict(vocab_size=True), "vocab_size=True"),
    "vocab_size-0": (dict(vocab_size=0), "vocab_size=0"),
    "vocab_size--1": (dict(vocab_size=-1), "vocab_size=-1"),
    "vocab_size-2**63": (dict(vocab_size=2**63), "vocab_size=9223372036854775808.*< 2\\*\\*63"),
    "window-2**63": (dict(window=2**63), "window=9223372036854775808.*< 2\\*\\*63"),
    "window-10**30": (dict(window=10**30), "window=1000000000000000000000000000000"),
    "model-None": (dict(model_step=None), "model_step must be callable"),
    "stats-None": (dict(stats=None), "stats must be a RunnerStats"),
    "whole_step-refused": (dict(graph_adapter=_RecordingAdapter(), graph_choice="on", whole_step=True),
                           "whole_step=True"),
    "capture-refused": (dict(capture_fails=True, graph_adapter=EagerAdapter(), graph_choice="eager"),
                        "graphs='eager': decode graph capture failed"),
    "capture-refused-layers": (dict(capture_fails=True, graph_adapter=EagerAdapter(), graph_choice="on",
                                    whole_step=False), "graphs='on': decode graph capture failed"),
    "capture-refused-verify": (dict(capture_fails=True, graph_adapter=EagerAdapter(), graph_choice="eager",
                                    whole_step=True, draft=prompt_lookup()), "decode graph capture failed"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_engine_leaves_its_cache_as_it_was_and_the_next_engine_on_it_runs(case):
    """Each argument is checked before the constructor takes the cache's padding row, and a refusal after that
    (whole_step=True where it cannot run, a capture refused under 'on'/'eager') gives the row back: the cache is
    exactly as before, and an engine built next on it admits max_running requests at once."""
    kw, message = REFUSED[case]
    kw = dict(kw)
    cache, model = _cache(max_running=4)
    before = _cache_snapshot(cache)
    args = dict(stats=RunnerStats(cache.shape, cache.plan), vocab_size=VOCAB, window=cache.shape.window)
    step = _RefusesCapture(model) if kw.pop("capture_fails", False) else model
    args["model_step"] = step
    args.update(kw)
    with pytest.raises(ConfigError, match=message):
        Engine(cache, args.pop("model_step"), **args)
    assert _unchanged(before, _cache_snapshot(cache)), "a refused Engine changed the cache"
    if isinstance(step, _RefusesCapture):
        step.armed = False
    e = Engine(cache, model, stats=RunnerStats(cache.shape, cache.plan), vocab_size=VOCAB, window=cache.shape.window)
    out = e.generate(_prompts(4), SamplingParams(max_new_tokens=3))
    assert [len(r.tokens) for r in out] == [3] * 4 and not any(r.error for r in out)
    e.check_integrity()


def test_numpy_integers_and_the_largest_values_are_accepted():
    cache, model = _cache()
    e = Engine(cache, model, stats=RunnerStats(cache.shape, cache.plan), vocab_size=np.int64(VOCAB), window=8,
               draft=prompt_lookup(), num_draft=np.int64(3))
    assert (e.num_draft, e.vocab_size) == (3, VOCAB) and type(e.num_draft) is int
    for kw in (dict(), dict(draft=prompt_lookup()),  # drafts are cut to what a step's budget and a request admit
               dict(draft=prompt_lookup(), graph_adapter=EagerAdapter(), graph_choice="eager", whole_step=True)):
        cache, model = _cache()
        e = Engine(cache, model, stats=RunnerStats(cache.shape, cache.plan), vocab_size=2**63 - 1, window=8,
                   num_draft=2**63 - 1, **kw)
        assert len(e.generate([[5, 6, 5, 6, 5]], SamplingParams(max_new_tokens=6))[0].tokens) == 6


@pytest.mark.parametrize("page_size", [4, 16])
def test_the_largest_window_releases_nothing_and_leaks_nothing(page_size):
    """window 2**63 - 1 is accepted (as layers accept it): past the rows' context nothing ever slides out, so the
    release keeps everything; its arithmetic on a one-token prompt must not overflow int64 (it had wrapped to a
    frontier of 2**63 - 16 and tried to release the whole of it)."""
    want = None
    for window in (2**63 - 1, 10**6, 200):
        cache, model = _cache(page_size=page_size)
        e = Engine(cache, model, stats=RunnerStats(cache.shape, cache.plan), vocab_size=VOCAB, window=window)
        out = [r.tokens for r in e.generate([[5], [7, 8]], SamplingParams(max_new_tokens=10))]
        e.check_integrity()
        assert int(e.slots.frontiers_cpu.max()) == 0
        want = out if want is None else want
        assert out == want, window


# ---- 7. sampling constants per request row, on the device ---------------------------------------------------------
_READS: Counter = Counter()


class _Counted(SamplingParams):
    """SamplingParams counting reads of the sampling constants (temperature, top_p, seed)."""

    def __getattribute__(self, name):
        if name in ("temperature", "top_p", "seed"):
            _READS[name] += 1
        return super().__getattribute__(name)


def _run(e: Engine, prompts, params) -> Dict[int, List[int]]:
    rids = [e.add_request(p, q) for p, q in zip(prompts, params)]
    out: Dict[int, List[int]] = {}
    while e.has_work():
        out.update((r.rid, r.tokens) for r in e.step())
        e.check_integrity()
    return [out[r] for r in rids]


def test_a_sampling_step_reads_no_request_parameters_after_admission():
    """Temperature, top_p and seed are written per request row at admission: the steps after it gather them on
    the device by the forward's rows, so a request's parameters are read as often for 4 tokens as for 16 (they had
    been read by every step, for every row)."""
    prompts = _prompts(4)
    reads = []
    for new in (4, 16):
        want = _run(_engine()[0], prompts, [SamplingParams(new, 0.8, 0.9, s) for s in range(4)])
        e, _ = _engine()
        _READS.clear()
        assert _run(e, prompts, [_Counted(max_new_tokens=new, temperature=0.8, top_p=0.9, seed=s)
                                 for s in range(4)]) == want
        reads.append(dict(_READS))
    assert reads[0] == reads[1], reads


SEEDED = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=11)


@pytest.mark.parametrize("kw", [dict(), dict(overlap=True), dict(prefix_cache=False, overlap=True),
                                dict(graphs=EagerAdapter(), whole_step=True, overlap=True),
                                dict(graphs=EagerAdapter(), whole_step=False), dict(max_running=1),
                                dict(max_running=2, chunk=5)],
                         ids=["plain", "overlap", "no-cache", "whole-step", "layers-graph", "one-row", "chunk-5"])
def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_rows(kw):
    """A seeded sampling request alone, first, last, or after other requests in the same row (sampling or greedy,
    one finishing on a stop token, one aborted): the same tokens. A greedy request in a row a sampling one left
    gives the greedy tokens (the row's constants are cleared when it is freed)."""
    prompts = _prompts(5)
    mine = prompts[1]
    alone = _run(_engine(**kw)[0], [mine], [SEEDED])[0]
    greedy = _run(_engine(**kw)[0], [prompts[3]], [SamplingParams(max_new_tokens=12)])[0]
    others = [SamplingParams(max_new_tokens=7, temperature=1.3, seed=2), SamplingParams(max_new_tokens=5),
              SamplingParams(max_new_tokens=9, temperature=0.5, top_p=0.5, seed=3, stop_token_ids=[alone[3]])]
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 0, 2, 3]):  # 0 is the seeded request, 1-3 the others
        ps = [mine if i == 0 else prompts[2 * i - 2] for i in order]
        qs = [SEEDED if i == 0 else others[i - 1] for i in order]
        e, _ = _engine(**kw)
        got = _run(e, ps, qs)
        assert got[order.index(0)] == alone, order
        # then a greedy request, in a row a sampling request held
        assert _run(e, [prompts[3]], [SamplingParams(max_new_tokens=12)])[0] == greedy
    # an aborted sampling request leaves its row to a greedy one
    e, _ = _engine(**kw)
    rid = e.add_request(mine, SEEDED)
    while not e.requests[rid].output:
        e.step()
    e.abort(rid)
    assert _run(e, [prompts[3]], [SamplingParams(max_new_tokens=12)])[0] == greedy
    assert _run(e, [mine], [SEEDED])[0] == alone
