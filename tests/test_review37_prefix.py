"""Review 37 (the prefix cache: hwkv/cache.py and the engine's use of it, hwkv/engine/prefixing.py).

Each test is a minimal failing reproduction of one defect; the expected behaviour is what the test asserts.

What held under review (CPU, `hwkv.engine.synthetic.SyntheticModel` with `ReferenceCheck` on every forward,
`check_integrity()` after every step, pools empty once the cache was cleared): ~1,150 random runs comparing greedy
tokens with the prefix cache on and off (W 1..33, page 1/2/4/8, chunk 1..48, 1-4 running, shared prefixes of 0, 1,
P-1, P, P+1, 2P, W-1, W, W+1, W+P tokens, duplicated prompts, multi-turn waves whose prompts extend earlier prompts
and outputs, stop tokens, max_new_tokens 1.., tight full pools, overlap, whole-step and layers' graphs, prompt-lookup
drafts, random aborts and clear_prefix_cache() between steps): tokens equal, attention exact, nothing leaked.
"""
from __future__ import annotations

import pytest
import torch

from hwkv.cache import HybridPrefixCache
from hwkv.engine.sampling import SamplingParams
from hwkv.engine.synthetic import SyntheticModel
from hwkv.errors import ConfigError
from test_cache_defects import Setup
from test_review31_windows import VOCAB, _engine, _prompts

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module


def _new_weights(model: SyntheticModel) -> None:
    """A weight update in place (as README's RL sync does it): every table, readout and the unembedding become
    another seed's."""
    other = SyntheticModel(model.shape, model.backend, vocab_size=model.vocab_size, dtype=model.dtype,
                           device=model.device, positions=model.positions, seed=11)
    for g, tables in model._tables.items():
        for mine, theirs in zip(tables, other._tables[g]):
            mine.copy_(theirs)
    for mine, theirs in zip(model._readout, other._readout):
        mine.copy_(theirs)
    model._unembed.copy_(other._unembed)


def test_clear_prefix_cache_after_a_weight_update_leaves_old_kv_that_later_requests_reuse():
    """clear_prefix_cache() keeps a running request's cached prompt (old weights' K/V): a later request reuses it."""
    prompt, params = _prompts(n=1, system=13, user=19)[0], SamplingParams(max_new_tokens=6)
    fresh = _engine(prefix_cache=False, check=False)
    _new_weights(fresh.model_step)
    want = fresh.generate([prompt], params)[0].tokens       # the new weights' tokens, nothing cached
    e = _engine(check=False)
    rid = e.add_request(prompt, params)
    while e.requests[rid].prefilling:                      # its prompt is cached (locked by the running request)
        e.step()
    _new_weights(e.model_step)
    try:
        e.clear_prefix_cache()     # README: "after a weight update ... call clear_prefix_cache() before the next step"
    except ConfigError:
        return                     # refusing it while requests run (SGLang's flush_cache does) is a fix too
    while e.has_work():
        e.step()
    got = e.generate([prompt], params)[0].tokens
    assert got == want, "a request admitted after clear_prefix_cache() was served K/V of the weights before it"


def test_a_window_past_int64_is_accepted_and_then_match_prefix_raises_a_bare_overflow_error():
    """HybridPrefixCache(alloc, 2**63) is accepted, then match_prefix raises a bare OverflowError (_reusable)."""
    s = Setup()
    try:
        s.c = HybridPrefixCache(s.a, 2 ** 63)
    except ConfigError as e:         # refused up front, as Engine refuses window=2**63 (bad inputs 119)
        assert "2**63" in str(e) or str(2 ** 63) in str(e)
        return
    r = s.run(list(range(20)), release=False)  # nothing leaves a window wider than the context
    s.finish(r)
    assert s.c.match_prefix(list(range(20))).length == 20  # every token's SWA is cached: the whole prefix


def test_release_request_takes_a_truthy_string_for_cache_and_caches():
    """release_request(..., cache="no") caches the request (a truthy "no" read as on), where flags are checked."""
    s = Setup()
    r = s.run(list(range(20)))
    before = s.snapshot()
    with pytest.raises(ConfigError, match="cache"):
        s.c.release_request(r["ids"], s.rtt, r["row"], r["seq"], r["frontier"], r["lock"], cache="no")
    assert s.same(before, s.snapshot()), "a refused release changed the cache or the pools"


def test_comparing_two_prefix_matches_raises_a_bare_runtime_error():
    """PrefixMatch's generated __eq__ compares its locs tensors: `m1 == m2` (and `m in list`) raise RuntimeError."""
    s = Setup()
    s.finish(s.run(list(range(20))))
    m1, m2 = s.c.match_prefix(list(range(20))), s.c.match_prefix(list(range(20)))
    assert isinstance(m1 == m2, bool)
    assert m1 in [m1]
