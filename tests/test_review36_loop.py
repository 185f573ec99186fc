"""Review 36 (the engine's step loop: overlap, whole-step graphs, read-back, abort/finish, errors mid-step).

What held under review (CPU, synthetic model, `check_integrity()` plus pending/kv_len/next_ids invariants after every
step, pools empty once the cache was cleared): ~550 random scripts (1-7 requests, greedy and sampling, stop tokens,
max_new_tokens 1.., requests added mid-run, hybrid "sf"/"fs"/"ss" and full shapes, page 1-4, chunk 4-24) each run
over overlap on/off x prefix cache on/off x eager / whole-step (EagerAdapter) / layers' graph runner with identical
tokens and finish reasons, `generated_tokens` equal to the results' tokens, prompt = reused + prefill tokens and one
recorded forward per model call; ~560 scripts with aborts at random steps (results a prefix of the unaborted run's,
the others unchanged, abort twice -> None); ~340 chat-like scripts whose later prompts extend earlier prompts and
outputs (prefix-cache hits under overlap); ~1,300 model errors before/after the layers at random forwards (step
rerun, tokens unchanged); ~11,000 real SIGINTs at engine-component method calls (drafter too). The defects below.
"""
from __future__ import annotations

import os
import signal
from typing import Dict, List

import pytest
import torch

from hwkv.engine.engine import Engine
from hwkv.engine.pools import build_cache, plan_pools
from hwkv.engine.sampling import SamplingParams
from hwkv.engine.stats import RunnerStats
from hwkv.engine.synthetic import SyntheticModel
from hwkv.errors import ConfigError, ShapeError
from hwkv.graph import EagerAdapter
from test_engine_abort import _engine
from test_engine_defects import CPU, SHAPE, VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest

PROMPTS = [[5, 17, 3, 42, 8, 11], [60, 2, 2, 9]]
SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)


def _drive(e: Engine) -> List[List[int]]:
    """Run PROMPTS (sampling) as a server loop would: a KeyboardInterrupt out of a step is caught and stepping goes
    on; integrity after every step."""
    rids = [e.add_request(p, SAMPLED) for p in PROMPTS]
    out: Dict[int, List[int]] = {}
    for _ in range(200):
        if not e.has_work():
            break
        try:
            out.update((r.rid, r.tokens) for r in e.step())
        except KeyboardInterrupt:
            pass
        e.check_integrity()
    return [out[r] for r in rids]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_ctrl_c_after_a_whole_step_replay_sampled_does_not_skip_a_sampling_draw(python_sigint, overlap):
    """Defect: `_decode_whole` (hwkv/engine/engine.py:856-858) samples (RowSampling.sample moves each row's draw
    count on the device) and then calls `scheduler.new_pages` inside the try whose handler undoes the step. A Ctrl-C
    there undoes the replay (pages back, the same rows run again) but not the draw counts, so the rerun draws the
    next output index: a seeded sampling request's tokens differ from the uninterrupted run (one draw skipped),
    against "a request's tokens depend only on its own logits and seed" and "the next step runs the same rows
    again". Expected: the same tokens as without the Ctrl-C."""
    want = _drive(_engine(graphs=EagerAdapter(), whole_step=True, overlap=overlap))
    e = _engine(graphs=EagerAdapter(), whole_step=True, overlap=overlap)
    replayed, fired = [], []
    replay, new_pages = e.slots.replay_decode, e.scheduler.new_pages

    def noting_replay(*args, **kwargs):
        out = replay(*args, **kwargs)
        replayed.append(1)
        return out

    def sigint_after_replay(*args, **kwargs):
        if replayed and not fired:   # the call right after a replay's sampling
            fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return new_pages(*args, **kwargs)

    e.slots.replay_decode, e.scheduler.new_pages = noting_replay, sigint_after_replay
    got = _drive(e)
    assert fired
    assert got == want, "a Ctrl-C after the sampler ran changed the sampled tokens"


@pytest.mark.parametrize("bad", ["tuple", "zero-width"])
def test_model_step_logits_that_are_no_tensor_or_zero_wide_are_a_typed_refusal(bad):
    """Defect: `Engine._logits` (hwkv/engine/engine.py:818-823) checks the model's logits by `logits.dim()` and
    `shape[1] > vocab_size` only: a model_step returning a tuple (an HF-style output, `(logits,)`) fails with a bare
    AttributeError ('tuple' object has no attribute 'dim'), and logits [K, 0] pass the check and fail in the sampler
    with a bare IndexError (argmax over an empty dim). Expected: the documented ShapeError ("model_step returned
    logits of shape ..., expected [K, V] with V <= vocab_size"; a ConfigError for a non-tensor would do), the step
    undone and the engine still usable."""
    e = _engine(prefix_cache=False)
    model = e.model_step
    if bad == "tuple":
        e.model_step = lambda batch, ids, pos, keep: (model(batch, ids, pos, keep),)
    else:
        e.model_step = lambda batch, ids, pos, keep: model(batch, ids, pos, keep)[:, :0]
    rid = e.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(ShapeError if bad == "zero-width" else (ShapeError, ConfigError)):
        e.step()
    e.check_integrity()
    e.model_step = model
    out = {}
    while e.has_work():
        out.update((r.rid, r.tokens) for r in e.step())
    assert len(out[rid]) == 2


def test_whole_step_true_without_a_graph_adapter_is_refused_or_honoured():
    """Defect: `Engine._graph_runner` (hwkv/engine/engine.py:170) returns before the whole_step check when
    `graph_adapter` is None, so `Engine(whole_step=True)` (graphs off; `HybridRunner(graphs="off", whole_step=True)`)
    silently runs eager decode with `engine.whole_step` False, where docs/bad-inputs.md #119 and the Engine docstring
    say whole_step=True where it cannot run is a ConfigError. Expected: ConfigError naming whole_step (or the whole
    step honoured: graphs='eager' runs it on the CPU)."""
    plan = plan_pools(SHAPE, context=96, max_running=3, chunk=24, page_size=4, memory=None, device=CPU,
                      prefix_cache=True)
    cache = build_cache(SHAPE, plan, torch.float32, CPU, backend_device="cpu")
    model = SyntheticModel(SHAPE, cache.backend, vocab_size=VOCAB, dtype=torch.float32, device=CPU,
                           positions=cache.rtt.max_context_len, seed=3)
    try:
        e = Engine(cache, model, stats=RunnerStats(SHAPE, plan), vocab_size=VOCAB, window=SHAPE.window,
                   graph_adapter=None, whole_step=True)
    except ConfigError as err:
        assert "whole_step" in str(err)
        return
    assert e.whole_step, "whole_step=True was accepted and silently ignored"
