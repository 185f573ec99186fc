"""Review 35 (engine loop, prefix caching during generation, allocator, release, runner).

What held under review (CPU, synthetic model, `check_integrity()` after every step, pools empty once the cache was
cleared): ~2,000 random engine runs comparing greedy tokens with the prefix cache on and off (hybrid "sf", "sfs" and
all-SWA "ss" shapes; W 1..16 and W >= context; page sizes 1/2/3/4/8; chunks 1..24; contexts 1..96 including
p-1, p, p+1; shared prefixes ending mid-page and prompts wholly cached; whole-step graphs, the layers' graph
runner, overlap, prompt-lookup drafts; tight full pools forcing evictions; the reference check on every forward
in the small-context runs), ~300 runs of interleaved add_request / abort / clear_prefix_cache / step with sampling
and stop tokens, and ~200 random sequences of direct HybridPrefixCache calls (run, cache_running, release, evict,
evict_swa, out-of-window release) checking that every eviction frees exactly the tokens it reports in each pool.
No leak, mismatch or over-reported eviction was found there. The defects below: a refusal gap in the prefix
cache's token-id boundary, and (the reviewer's unconfirmed note, confirmed) clear_prefix_cache from inside a step.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hwkv.errors import LocError
from test_cache_defects import Setup, t


@pytest.mark.parametrize("make", [lambda a: torch.tensor(a), lambda a: np.asarray(a)], ids=["tensor", "ndarray"])
def test_a_2d_batch_of_token_ids_is_refused_not_flattened_into_one_prefix(make):
    """Defect: `HybridPrefixCache._ids` (hwkv/cache.py:123-139) flattens any tensor or array with `reshape(-1)`, so a
    [B, L] batch of prompts handed to `match_prefix`, `insert`, `cache_running` or `release_requests` is read as ONE
    sequence of B*L tokens: `match_prefix` of the batch [[0..3], [4..7], [8..11]] returns a 12-token match (the
    concatenation), and `insert` caches the concatenation under the first row's page. A list of lists is refused
    (LocError: token ids must be integers), and the engine's own boundary refuses a non-1-D prompt
    (`hwkv.engine.inputs.token_ids`: "a prompt must be 1-D"), so the cache is the one entry point that silently
    changes the meaning of a bad argument. Expected: LocError naming the shape, before any change (the snapshot
    below); suggested fix: in `_ids`, refuse `ndim != 1` for tensors and arrays as `token_ids` does."""
    s = Setup(page=4, window=8)
    s.finish(s.run(list(range(12))))           # [0, 12) cached
    batch = make([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    with pytest.raises(LocError, match="1-D|shape"):
        s.c.match_prefix(batch)
    # insert: a batch of two prompts would be cached as one 8-token sequence of the first row's locs
    row = s.rtt.alloc(1)[0]
    s.rtt.write(row, 0, s.a.alloc_extend([0], [8], t([0]), 8))
    before = s.snapshot()
    with pytest.raises(LocError, match="1-D|shape"):
        s.c.insert(make([[20, 21, 22, 23], [24, 25, 26, 27]]), s.rtt.req_to_token[row, :8], 0)
    assert s.same(before, s.snapshot())


def test_clear_prefix_cache_runs_between_steps_of_an_open_engine_only():
    """The reviewer's note, confirmed: `Engine.clear_prefix_cache()` evicted from inside a step (a model or drafter
    calling it: the step lock held), where `abort` refuses. Now a ConfigError, with the cache's nodes and the pools
    as they were."""
    from hwkv.errors import ConfigError
    from test_engine_defects import _engine, _prompts
    from hwkv.engine.sampling import SamplingParams
    e, _ = _engine()
    e.generate(_prompts(2), SamplingParams(max_new_tokens=2))
    held = e.cache.held_slots()
    assert held != (0, 0)   # the finished prompts' pages stay cached
    with e._step_lock:   # as inside a step
        with pytest.raises(ConfigError, match="inside a step"):
            e.clear_prefix_cache()
    assert e.cache.held_slots() == held
    assert e.clear_prefix_cache() > 0 and e.cache.held_slots() == (0, 0)   # between steps: evicts
