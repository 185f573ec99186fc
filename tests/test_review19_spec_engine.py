"""Review 19, speculative decoding in the engine: what a drafter returns is checked (ConfigError naming it, nothing
changed), `plan_pools` takes a device string, `prompt_lookup` proposes what the old full rescan proposed (a
differential test, also through the engine's per-request token history), a verify evicts from the prefix cache for
its drafts' pages as a plain step does, and the shipped spec harness names its devices.

The engine runs over `hwkv.engine.synthetic.SyntheticModel` (no weights) on the CPU.
"""
from __future__ import annotations

import random
from typing import List, Sequence

import numpy as np
import pytest
import torch

from hwkv.engine.drafters import prompt_lookup
from hwkv.engine.engine import Engine
from hwkv.engine.pools import build_cache, plan_pools
from hwkv.engine.presets import ModelShape, layer_pattern
from hwkv.engine.sampling import SamplingParams
from hwkv.engine.stats import RunnerStats
from hwkv.engine.synthetic import SyntheticModel
from hwkv.errors import ConfigError, DeviceError
from hwkv.graph import EagerAdapter

from test_engine_defects import _snapshot, _unchanged  # noqa: E402  the engine's refusal snapshot

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module

VOCAB = 11
CPU = torch.device("cpu")
SHAPE = ModelShape(name="t", layer_is_swa=layer_pattern(2, "sf"), window=4, num_heads=2, num_kv_heads=1, head_dim=8,
                   dtype_bytes=4)


def _engine(draft, context=96, chunk=32, num_draft=4, prefix_cache=True, graphs=False):
    plan = plan_pools(SHAPE, context=context, max_running=2, chunk=chunk, page_size=4, memory=None, device=CPU,
                      prefix_cache=prefix_cache)
    cache = build_cache(SHAPE, plan, torch.float32, CPU, backend_device="cpu")
    model = SyntheticModel(SHAPE, cache.backend, vocab_size=VOCAB, dtype=torch.float32, device=CPU,
                           positions=cache.rtt.max_context_len, seed=0)
    kw = dict(graph_adapter=EagerAdapter(), graph_choice="eager", whole_step=True) if graphs else {}
    return Engine(cache, model, stats=RunnerStats(SHAPE, plan), vocab_size=VOCAB, window=4,
                  prefix_cache=prefix_cache, draft=draft, num_draft=num_draft, **kw)


# ---- 4. a drafter's result that is not token ids: ConfigError naming it, before anything changes ------------------
BAD_DRAFTS = [
    ("None", lambda t, k: None, r"the drafter returned NoneType None"),
    ("str", lambda t, k: "ab", r"the drafter returned str 'ab'"),
    ("nested", lambda t, k: [[1, 2]], r"the drafter returned list \[\[1, 2\]\]: draft token id \[1, 2\] \(list, at index 0\)"),
    ("float", lambda t, k: [1.5], r"draft token id 1.5 \(float, at index 0\) is not an integer"),
    ("bool", lambda t, k: [1, True], r"draft token id True \(bool, at index 1\) is not an integer"),
    ("float tensor", lambda t, k: torch.tensor([1.0]), r"the drafter returned Tensor .*must hold integers, got "
                                                         r"torch.float32"),
    ("2-D array", lambda t, k: np.array([[1, 2]]), r"the drafter returned ndarray .*must be 1-D, got shape \[1, 2\]"),
    ("dict", lambda t, k: {1: 2}, r"the drafter returned dict \{1: 2\}"),
    ("outside the vocabulary", lambda t, k: [99], r"the drafter proposed token id 99, outside the vocabulary \[0, 11\)"),
]


@pytest.mark.parametrize("what, draft, message", BAD_DRAFTS, ids=[b[0] for b in BAD_DRAFTS])
def test_a_drafter_result_that_is_not_token_ids_is_a_config_error_and_changes_nothing(what, draft, message):
    e = _engine(draft)
    e.add_request([1, 2, 3, 1, 2], SamplingParams(max_new_tokens=5))
    e.step()  # the prompt: no drafts yet
    before = _snapshot(e)
    with pytest.raises(ConfigError, match=message):
        e.step()
    assert _unchanged(_snapshot(e), before)
    e.check_integrity()


@pytest.mark.parametrize("result", [(3, 1), np.array([3, 1]), torch.tensor([3, 1]), [np.int64(3), np.int32(1)],
                                    iter([3, 1]), [3, 1, 4, 1, 5, 9, 2, 6]],
                         ids=["tuple", "array", "tensor", "numpy ints", "generator", "more than k"])
def test_a_drafter_may_return_any_sequence_of_integer_ids(result):
    """Tuples, integer arrays and tensors, numpy integers and iterators are token ids (as for prompts); more than k
    are cut to k. The tokens are greedy decoding's whatever the drafts."""
    want = _engine(None).generate([[1, 2, 3, 1, 2]], SamplingParams(max_new_tokens=6))[0].tokens
    got = _engine(lambda t, k: result).generate([[1, 2, 3, 1, 2]], SamplingParams(max_new_tokens=6))[0]
    assert got.error is None and got.tokens == want


# ---- 5. plan_pools takes a device string, as build_cache and the pools do ------------------------------------------
@pytest.mark.parametrize("memory", [None, "1MiB"])
def test_plan_pools_takes_a_device_string(memory):
    kw = dict(context=48, max_running=2, chunk=16, page_size=4, memory=memory)
    assert plan_pools(SHAPE, device="cpu", **kw) == plan_pools(SHAPE, device=CPU, **kw)


@pytest.mark.parametrize("device", ["bogus", 3.5])
def test_plan_pools_refuses_what_is_no_device_with_a_device_error(device):
    with pytest.raises(DeviceError, match=f"device={device!r} is not a torch device"):
        plan_pools(SHAPE, context=48, max_running=2, chunk=16, page_size=4, memory=None, device=device)


# ---- 6. prompt_lookup: the old full rescan's drafts, without rescanning in Python --------------------------------
def old_prompt_lookup(max_ngram=3, min_ngram=1):
    """The implementation before review 19 (a Python rescan of every start position per step): the reference."""
    def draft(tokens, k):
        seq = list(tokens)
        for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start:start + n] == tail:
                    return seq[start + n:start + n + k]
        return []
    return draft


def _random_sequences(seed: int, count: int) -> List[List[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        vocab = rng.choice([2, 3, 5, 20, 1000, 50_000])
        out.append([rng.randrange(vocab) for _ in range(rng.randrange(0, 200))])
    return out


@pytest.mark.parametrize("max_ngram, min_ngram", [(3, 1), (2, 2), (4, 2), (1, 1), (5, 3)])
def test_prompt_lookup_proposes_what_the_full_rescan_proposed(max_ngram, min_ngram):
    new, old = prompt_lookup(max_ngram, min_ngram), old_prompt_lookup(max_ngram, min_ngram)
    rng = random.Random(max_ngram * 10 + min_ngram)
    for seq in _random_sequences(max_ngram * 7 + min_ngram, 400):
        k = rng.choice([0, 1, 3, 4, 8])
        for tokens in (seq, tuple(seq), np.array(seq, dtype=np.int64), torch.tensor(seq, dtype=torch.int64)):
            assert new(tokens, k) == old(seq, k), (seq, k)


def test_prompt_lookup_over_the_engines_token_history_proposes_what_the_full_rescan_proposed():
    """The engine hands a drafter each request's tokens as one object that grows with its outputs (no list built
    per step): grown token by token and queried at every length, prompt_lookup gives the old drafts."""
    from hwkv.engine.drafters import TokenHistory

    new, old = prompt_lookup(), old_prompt_lookup()
    for i, seq in enumerate(_random_sequences(5, 60)):
        cut = len(seq) // 3
        prompt, output = seq[:cut], []
        history = TokenHistory(prompt, output)
        for t in seq[cut:]:
            output.append(t)
            assert list(history) == prompt + output and len(history) == len(prompt) + len(output)
            assert history[-2:] == (prompt + output)[-2:] and history[0] == (prompt + output)[0]
            assert new(history, 4) == old(prompt + output, 4)


def test_a_token_history_reads_as_the_list_it_stands_for():
    """Index, slice (any start, stop and step: a list), equality with a list, `+`, numpy's view (read-only)."""
    from hwkv.engine.drafters import TokenHistory

    rng = random.Random(3)
    prompt, output = [rng.randrange(50) for _ in range(9)], [rng.randrange(50) for _ in range(6)]
    history, whole = TokenHistory(prompt, output), prompt + output
    bounds = [None, -20, -16, -15, -7, -1, 0, 1, 5, 8, 9, 10, 14, 15, 16, 30]
    for start in bounds:
        for stop in bounds:
            for step in (None, 1, 2, -1, -3):
                assert history[start:stop:step] == whole[start:stop:step], (start, stop, step)
    for i in range(-15, 15):
        assert history[i] == whole[i]
    for i in (-16, 15):
        with pytest.raises(IndexError):
            history[i]
    assert history == whole and history != whole[:-1] and history + [1] == whole + [1] and [1] + history == [1] + whole
    view = np.asarray(history)
    assert view.tolist() == whole and not view.flags.writeable
    mine = history.copy()  # a list of its own: editing it leaves the request's lists alone
    mine.append(7)
    assert history == whole and mine == whole + [7] and not hasattr(history, "prompt")


def test_the_engine_hands_each_request_one_growing_token_sequence():
    """Custom drafters keep working: they get the request's tokens so far (its prompt and the outputs read) as a
    sequence they can index, slice (lists), iterate and measure; the engine makes it once per request, not per
    step."""
    seen = {}

    def drafter(tokens, k):
        seen.setdefault(tokens[:5] == [1, 2, 3, 1, 2], []).append((tokens, list(tokens), len(tokens)))
        return prompt_lookup()(tokens, k)

    e = _engine(drafter)
    res = e.generate([[1, 2, 3, 1, 2]], SamplingParams(max_new_tokens=12))[0]
    calls = seen[True]
    assert len(calls) >= 2 and all(c[0] is calls[0][0] for c in calls), "one sequence object per request"
    for _, tokens, n in calls:
        assert n == len(tokens) and tokens == ([1, 2, 3, 1, 2] + res.tokens)[:n]


# ---- 7. a verify evicts from the prefix cache for its drafts' pages ----------------------------------------------
def _probe_run(e: Engine, prompt: Sequence[int], calls: List[int]) -> List[int]:
    """Run `prompt` to the end, integrity checked after every step; returns its tokens."""
    rid = e.add_request(list(prompt), SamplingParams(max_new_tokens=20))
    out = {}
    while e.has_work():
        out.update((r.rid, r.tokens) for r in e.step())
        e.check_integrity()
    return out[rid]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "verify graph"])
def test_a_verify_after_earlier_traffic_evicts_from_the_prefix_cache_as_a_plain_step_does(graphs):
    """Earlier requests' K/V fill the pools (the prefix cache keeps it until room is needed): the verify steps of a
    probe equal a fresh engine's (same drafter calls, same verify forwards, same tokens), the evictions being the
    prefix cache's (integrity after every step); with the whole-step graphs, the verifies replay a VerifyStepGraph."""
    def counting():
        calls = [0]

        def draft(tokens, k):
            calls[0] += 1
            return prompt_lookup()(tokens, k)
        return draft, calls

    probe = [1, 2, 3, 4, 5] * 6
    d_fresh, c_fresh = counting()
    fresh = _engine(d_fresh, graphs=graphs)
    want = _probe_run(fresh, probe, c_fresh)
    v_fresh = fresh.stats.forwards["TARGET_VERIFY"]
    assert v_fresh > 3

    d, calls = counting()
    e = _engine(d, graphs=graphs)
    g = torch.Generator().manual_seed(0)
    fill = [torch.randint(0, VOCAB, (60,), generator=g).tolist() for _ in range(8)]
    for p in fill:
        _probe_run(e, p, calls)
    a = e.cache.allocator
    assert e.prefix.evictable_full > 0 and a.full_available_size() < 4 * 5, "the cache holds the free room"
    v0, c0 = e.stats.forwards["TARGET_VERIFY"], calls[0]
    assert _probe_run(e, probe, calls) == want
    assert e.stats.forwards["TARGET_VERIFY"] - v0 == v_fresh
    assert calls[0] - c0 == c_fresh[0], "the drafter is called as often as on a fresh engine"
    if graphs:
        assert e.verify_graph is not None and e.verify_graph.replays > 0


# ---- 8. the shipped spec harness names its devices ------------------------------------------------------------
def test_the_spec_harness_tree_verify_runs_under_a_meta_default_device():
    from hwkv.batch import ForwardMode
    from hwkv.testing.harness import Harness, ModelGeometry
    from hwkv.testing.spec_harness import draft_steps, tree_verify
    from hwkv_cpu.backend import TorchCPUBackend

    torch.set_default_device("meta")
    try:
        h = Harness(TorchCPUBackend, "cpu", ModelGeometry(), size=512, size_swa=96, page_size=4)
        rids = [h.add_request() for _ in range(2)]
        h.forward(rids, [5, 7], ForwardMode.EXTEND)
        h.release()
        tree_verify(h, rids, [[-1, 0, 0], [-1, 0, 1]], [[0, 2], [0]])
        h.release()
        draft_steps(h, rids, 2)
        h.allocator.check_integrity()
    finally:
        torch.set_default_device(None)
