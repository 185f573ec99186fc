"""hwkv.engine.synthetic: a model-shaped ModelStep on the engine, and the reference check around it."""
import pytest
import torch

from hwkv.engine.engine import Engine
from hwkv.engine.pools import build_cache, plan_pools
from hwkv.engine.presets import ModelShape, layer_pattern
from hwkv.engine.sampling import SamplingParams
from hwkv.engine.stats import RunnerStats
from hwkv.engine.synthetic import ReferenceCheck, SyntheticModel, engine_history
from hwkv.errors import ConfigError, ReferenceMismatchError

VOCAB = 97
CPU = torch.device("cpu")
# SWA and full layers alternating, sinks on the SWA layers only, a soft-cap, GQA, a small window
SHAPE = ModelShape(name="tiny", layer_is_swa=layer_pattern(4, "sf"), window=8, num_heads=4, num_kv_heads=2,
                   head_dim=16, swa_sinks=True, logit_cap=30.0, dtype_bytes=4)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module


def _engine(shape=SHAPE, page_size=4, prefix_cache=True, max_running=4, chunk=24, every=1, requests=4, queries=64,
            overlap=None):
    plan = plan_pools(shape, context=160, max_running=max_running, chunk=chunk, page_size=page_size,
                      memory=None, device=CPU, prefix_cache=prefix_cache)
    cache = build_cache(shape, plan, torch.float32, CPU, backend_device="cpu")
    model = SyntheticModel(shape, cache.backend, vocab_size=VOCAB, dtype=torch.float32, device=CPU,
                           positions=cache.rtt.max_context_len, seed=3)
    engine = Engine(cache, model, stats=RunnerStats(shape, plan), vocab_size=VOCAB, window=shape.window,
                    prefix_cache=prefix_cache, overlap=overlap)
    if every:
        model.check = ReferenceCheck(model, engine_history(engine), every=every, requests=requests, queries=queries)
    return engine, model


def _prompts(n, system=37, user=11, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    head = torch.randint(0, VOCAB, (system,), generator=g, device="cpu").tolist()
    return [head + torch.randint(0, VOCAB, (user + 3 * i,), generator=g, device="cpu").tolist() for i in range(n)]


def _run(engine, prompts, new=12, stop=()):
    """generate() one step at a time, the engine's integrity checked after every step."""
    results = {}
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=new, stop_token_ids=stop)) for p in prompts]
    while engine.has_work():
        for r in engine.step():
            results[r.rid] = r.tokens
        engine.check_integrity()
    return [results[r] for r in rids]


def test_qkv_is_a_function_of_token_position_and_layer():
    _, m = _engine(every=0)
    ids, pos = torch.tensor([5, 9, 5, 40], device="cpu"), torch.tensor([0, 1, 7, 3], device="cpu")
    q0, k0, v0 = m.qkv(0, ids, pos)
    q1, k1, v1 = m.qkv(0, ids.clone(), pos.clone())
    assert torch.equal(q0, q1) and torch.equal(k0, k1) and torch.equal(v0, v1)
    assert q0.shape == (4, 4, 16) and k0.shape == (4, 2, 16) and v0.shape == (4, 2, 16)
    assert torch.equal(v0[0], v0[2]) and not torch.equal(k0[0], k0[2])  # the same token: V equal, K rotated
    assert not torch.equal(m.qkv(1, ids, pos)[1], k0)                    # another layer reads other rows
    q, k, _ = m.qkv(2, ids, pos, queries=1)
    assert torch.equal(q, m.qkv(2, ids, pos)[0][-1:]) and k.shape[0] == 4


def test_scores_depend_on_relative_positions_only():
    """RoPE: shifting every position alike leaves each q.k score as it was."""
    _, m = _engine(every=0)
    ids = torch.tensor([3, 14, 15, 92, 65], device="cpu")
    pos = torch.arange(5, device="cpu")
    q, k, _ = m.qkv(1, ids, pos)
    qs, ks, _ = m.qkv(1, ids, pos + 50)
    scores = torch.einsum("qhd,khd->hqk", q[:, :2], k)
    shifted = torch.einsum("qhd,khd->hqk", qs[:, :2], ks)
    torch.testing.assert_close(scores, shifted, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(q, qs)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_engine_outputs_match_the_reference_through_prefix_cache_release_and_reuse(page_size):
    """Every forward, every request, every query, every layer: prompts longer than the window, a shared prefix taken
    from the cache (K/V another request wrote), SWA slots released and reused in a small SWA pool."""
    engine, m = _engine(page_size=page_size)
    first = _run(engine, _prompts(3))
    again = _run(engine, [p + t for p, t in zip(_prompts(3), first)])  # the next turns: their history is cached
    assert engine.stats.reused_tokens >= 37 * 3 and len(again) == 3
    assert m.check.forwards_checked == m.forwards and m.check.requests_checked >= m.forwards
    assert m.check.max_err < m.check.tolerance and m.check.queries_checked > m.forwards


def test_the_history_holds_every_earlier_token_with_overlap_and_stops():
    """Overlapped, the host reads a forward's tokens during the next one, and a stopped request may run one more
    forward: the check still finds every token before the forward in the request's prompt and read outputs."""
    engine, m = _engine(overlap=True)
    stop = (3, 11, 29, 41, 57, 70, 88)
    out = _run(engine, _prompts(4), new=16, stop=stop)
    assert any(t[-1] in stop and len(t) < 16 for t in out)  # some stopped early
    assert engine.overlap and m.check.forwards_checked == m.forwards > 0 and m.check.max_err < m.check.tolerance


def test_greedy_tokens_are_the_same_with_and_without_the_prefix_cache():
    prompts = _prompts(4, system=29)
    cached, _ = _engine(every=0)
    plain, _ = _engine(every=0, prefix_cache=False)
    assert _run(cached, prompts[:1]) + _run(cached, prompts[1:]) == _run(plain, prompts[:1]) + _run(plain, prompts[1:])
    assert cached.stats.reused_tokens > 0 and plain.stats.reused_tokens == 0


def test_the_check_catches_a_corrupted_cached_key():
    """The second request reuses the first one's cached K/V: a changed key of a full layer there fails the check."""
    engine, m = _engine(requests=1, queries=1)
    prompts = _prompts(2, system=40, user=5)
    _run(engine, prompts[:1])
    match = engine.prefix.match_prefix(prompts[1][:-1])
    assert match.length >= 32
    full = engine.cache.pool.full_kv_pool
    local = engine.cache.pool.layers_mapping[1][0]  # layer 1 is a full layer
    full.k_buffer[local][match.locs[3]] += 1.0
    with pytest.raises(ReferenceMismatchError, match=r"layer 1 \(full\)"):
        _run(engine, prompts[1:])


def test_bad_values_are_refused():
    _, m = _engine(every=0)
    with pytest.raises(ConfigError, match="vocab_size must be an integer >= 2, got 1"):
        SyntheticModel(SHAPE, None, vocab_size=1, dtype=torch.float32, device=CPU, positions=8)
    with pytest.raises(ConfigError, match="positions must be an integer >= 1, got 0"):
        SyntheticModel(SHAPE, None, vocab_size=4, dtype=torch.float32, device=CPU, positions=0)
    with pytest.raises(ConfigError, match="every must be an integer >= 1, got 0"):
        ReferenceCheck(m, lambda row: [], every=0)
    engine, _ = _engine(every=0)
    with pytest.raises(ConfigError, match="no running request holds row 3"):
        engine_history(engine)(3)
